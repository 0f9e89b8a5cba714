"""Which versions a level keeps: the newest `keep`, plus the best evaluated one, plus (where
the run may rewind after a divergence) the newest one known good, plus every version a kept
version's keyed tables need (its chain, format/keyed_rows.py) (pure)."""

from __future__ import annotations

from typing import Mapping


def metric_prefers_higher(metric: str) -> bool:
    return "acc" in metric or "score" in metric


def best_step(metrics_by_step: Mapping[int, Mapping], metric: str) -> int | None:
    scored = [(step, m[metric]) for step, m in metrics_by_step.items() if metric in m]
    if not scored:
        return None
    higher = metric_prefers_higher(metric)
    # Ties go to the newer version.
    return max(scored, key=lambda sv: (sv[1] if higher else -sv[1], sv[0]))[0]


def steps_to_delete(committed: list[int], keep: int, metrics_by_step: Mapping[int, Mapping] | None = None,
                    keep_best: str = "") -> list[int]:
    """Oldest whole versions beyond `keep`; never the newest one, never the best one."""
    committed = sorted(committed)
    keep = max(1, keep)
    kept = set(committed[-keep:])
    if keep_best and metrics_by_step:
        best = best_step({s: metrics_by_step[s] for s in committed if s in metrics_by_step}, keep_best)
        if best is not None:
            kept.add(best)
    return [s for s in committed if s not in kept]


def newest_known_good(committed: list[int]) -> set[int]:
    """The newest version known good: the one before the newest. The newest is not known good
    yet (the steps after it may diverge, and a run that diverges again from the version it was
    rewound to blames that version too); the run went on from the one before it to a later
    version without diverging (a step that diverges is never checkpointed, and the versions
    after it are marked bad and removed by the rewind)."""
    committed = sorted(committed)
    return {committed[-2]} if len(committed) >= 2 else set()


def newest_redundant_versions(levels_by_step: Mapping[int, tuple[str, ...]], redundant: set[str]) -> set[int]:
    """The newest version holding each redundancy level in `redundant` (partner copies,
    parity). With partner_every or erasure_every above keep_local, the newest versions are
    L1 only; deleting older ones by count alone would delete the only version that survives
    a node loss (its replicas and parity live in the same version directory)."""
    missing = set(redundant)
    pinned: set[int] = set()
    for step in sorted(levels_by_step, reverse=True):
        if not missing:
            break
        found = missing & set(levels_by_step[step])
        if found:
            pinned.add(step)
            missing -= found
    return pinned


def versions_to_delete(committed: list[int], uncommitted: list[int], newest: int, keep: int,
                       metrics_by_step: Mapping[int, Mapping], keep_best: str, pinned: set[int],
                       chains: Mapping[int, tuple] | None = None) -> list[int]:
    """What retention deletes from one level after version `newest` committed: committed
    versions beyond `keep` (never the newest, the best, a pinned one or one a kept version's
    chain names: `chains[step]`), and uncommitted leftovers older than `newest` (a version
    being written now is never one of them)."""
    dropped = [s for s in steps_to_delete(committed, keep, metrics_by_step, keep_best) if s not in pinned]
    if chains:
        needed = {member for step in committed if step not in dropped for member in chains.get(step, ())}
        dropped = [s for s in dropped if s not in needed]
    return dropped + [s for s in uncommitted if s < newest]
