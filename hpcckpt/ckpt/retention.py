"""Which versions a level keeps: the newest `keep`, plus the best evaluated one (pure)."""

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
