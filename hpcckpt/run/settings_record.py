"""The settings a version was written with, and what differs at restart.

Every commit record carries the job's settings (flattened `section.key` -> value). A restart
logs, once, what differs from them now; settings that change what the restored state means
(the model, the data and its order, the batch size, the seed) get a warning: the run goes
on, but it is no longer the run that was checkpointed. Another rank count is such a change
only for a version that holds per-rank arrays: replicated arrays, blocks and keyed tables
are saved to be restored onto any rank count.
"""

from __future__ import annotations

import dataclasses
import json

# Differ between attempts or allocations of one run by design: not a change of the run.
_PER_ATTEMPT = {"run.dir", "run.end_time", "run.halt_seconds", "source", "origins"}
# Settings whose change alters what the restored state means.
_MEANING = ("model.", "data.", "run.seed")


def recorded_settings(config) -> dict:
    """`section.key` -> JSON value of every setting of a JobConfig (anything else: nothing)."""
    if not dataclasses.is_dataclass(config):
        return {}
    flat = {}
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            for key, setting in dataclasses.asdict(value).items():
                flat[f"{section.name}.{key}"] = setting
    return {k: v for k, v in json.loads(json.dumps(flat, default=str)).items() if k not in _PER_ATTEMPT}


@dataclasses.dataclass(frozen=True)
class Change:
    key: str
    before: object
    after: object
    alters_meaning: bool | None = None  # None: as the key says (_MEANING)

    @property
    def changes_meaning(self) -> bool:
        return self.key.startswith(_MEANING) if self.alters_meaning is None else self.alters_meaning

    def __str__(self) -> str:
        return f"{self.key} {_show(self.before)} -> {_show(self.after)}"


def _show(value) -> str:
    return "(unset)" if value is None else json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def changed_settings(before: dict, after: dict, world_before: int, world_after: int,
                     per_rank_arrays: bool = False) -> list[Change]:
    """Settings that differ between a version (`before`) and this job (`after`), sorted; a
    version recorded without settings (older hpcckpt) yields only a rank-count change, which
    alters the meaning only where the version holds `per_rank_arrays`."""
    changes = []
    if before:
        for key in sorted(set(before) | set(after)):
            if key in _PER_ATTEMPT:
                continue
            if before.get(key) != after.get(key):
                changes.append(Change(key, before.get(key), after.get(key)))
    if world_before != world_after:
        changes.append(Change("world_size", world_before, world_after, alters_meaning=per_rank_arrays))
    return changes
