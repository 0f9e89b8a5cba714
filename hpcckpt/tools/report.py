"""`hpcckpt report`: the story of a run.dir across all its attempts, from metrics.jsonl.

Each attempt (one `hpcckpt train`, or the survivors of dead ranks going on in the job) leaves
a restart record (where each rank's shard came from, how far the previous attempt had got), a
checkpoint summary and a final or halted record; an attempt in the job follows a
process_failure record (the ranks lost, the ranks left, the shrink's time) and, where the job
holds spare ranks, a spares record (the places they took). This module only reads them back.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcckpt.errors import ConfigError
from hpcckpt.levels.naming import LOCAL
from hpcckpt.restore.from_memory import MEMORY, SOURCE_LABELS, counted_by_source


def read_records(run_dir, damaged: list | None = None) -> list[dict]:
    """The records of metrics.jsonl; the numbers of lines that are not records (a crash cut
    one short, or the file was damaged) go to `damaged`: skipped, everything else counts."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: no run has written to run.dir {str(run_dir)!r} yet")
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            elif damaged is not None:
                damaged.append(number)
    return records


def _attempts(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each restart record with the process_failure record just before it: an attempt that the
    survivors of dead ranks began in the job (the record is written by their new Checkpointer,
    before its restart), not a relaunch."""
    attempts, failure, started_over = [], None, None
    for record in records:
        if record.get("event") == "process_failure":
            failure = dict(record)
        elif record.get("event") == "spares" and failure is not None:
            failure["spares"] = record  # what the job's spare ranks did in that recovery
        elif record.get("event") == "started_over":
            started_over = record  # written by the restore, before its restart record
        elif record.get("event") == "restart":
            attempts.append((dict(record, started_over=started_over) if started_over else record, failure))
            failure = started_over = None
    return attempts


def _spares_said(spares: dict | None) -> str:
    if spares is None:
        return ""
    said = []
    if spares["filled"]:
        said.append(f"spare(s) took place(s) {', '.join(sorted(spares['filled'], key=int))}")
    if spares["given_up"]:
        said.append(f"no spare for place(s) {', '.join(map(str, spares['given_up']))}")
    if spares["spares_lost"]:
        said.append(f"{spares['spares_lost']} idle spare(s) died")
    return "; " + "; ".join(said + [f"{spares['spares_left']} spare(s) left"])


def summarise(records: list[dict]) -> list[str]:
    attempts = _attempts(records)
    summaries = [r for r in records if r.get("event") == "checkpoint_summary"]
    in_job = sum(1 for _, failure in attempts if failure is not None)
    lines = [f"attempts: {len(attempts)}" + (f" ({in_job} of them in the job, after ranks died: no relaunch; "
                                             f"{len(attempts) - 1 - in_job} relaunch(es))" if in_job else "")]
    lost_total = 0
    for number, (attempt, failure) in enumerate(attempts, 1):
        sources = attempt.get("sources") or []
        if sources and set(sources) == {MEMORY}:
            start = (f"went on from step {attempt['step']}, held in memory by the {len(sources)} survivor(s) (no "
                     f"version read, {attempt.get('from_memory_s', 0.0):.3f} s)")
        elif sources:
            where = counted_by_source(sources, "rank(s)")
            old = "old " if attempt.get("ranks") not in (None, len(sources)) else ""
            # Got elsewhere than from the rank's own L1 file or its own memory.
            moved = [f"{old}rank {rank}: {SOURCE_LABELS[level]}" for rank, level in enumerate(sources)
                     if level not in (LOCAL, MEMORY)]
            start = f"resumed from step {attempt['step']} ({where})"
            if old:
                start += f" written by {len(sources)} ranks, onto {attempt['ranks']}"
            if moved:
                start += "; rebuilt: " + ", ".join(moved)
        elif attempt.get("started_over"):
            start = (f"started over from scratch: no stored version (up to step "
                     f"{attempt['started_over']['lost_up_to']}) could be recovered (resilience.unrecoverable)")
        else:
            start = "started from scratch"
        lost = attempt.get("lost_steps")
        if lost:
            lost_total += lost
            start += f"; the previous attempt had reached step {attempt['reached_before']}: {lost} step(s) of work lost"
        if failure is not None:
            start = (f"in the job after rank(s) {', '.join(map(str, failure['lost_ranks']))} died "
                     f"({failure['ranks_left']} rank(s) left{_spares_said(failure.get('spares'))}, shrunk in "
                     f"{failure['shrink_s']:.3f} s): {start}")
        lines.append(f"  attempt {number}: {start}")
    last_end = next((r for r in reversed(records) if "weights_digest" in r), None)
    steps_done = last_end["step"] if last_end else max(
        (r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    if last_end is not None and last_end is records[-1] and last_end.get("final"):
        state = "finished"
    elif last_end is not None and last_end is records[-1] and last_end.get("halted"):
        state = f"stopped on request: {last_end['halted']}"
    else:
        state = "not finished: the last attempt ended without its final record"
    lines.append(f"steps done: {steps_done} ({state})")
    # Each checkpoint leaves its own record, so a crashed attempt's checkpoints count too.
    blocking = sorted(r["checkpoint_blocking_s"] for r in records if "checkpoint_blocking_s" in r)
    lines.append(f"checkpoints taken: {len(blocking)}")
    if blocking:
        median = blocking[len(blocking) // 2]
        lines.append(f"checkpoint blocking: median {1000 * median:.1f} ms, max {1000 * blocking[-1]:.1f} ms; "
                     "estimated overhead " + ", ".join(f"{r.get('overhead_pct', 0.0):.2f} %" for r in summaries)
                     + " of the time of each attempt that ended normally")
    lines.append(f"work lost to failures: {lost_total} step(s)")
    diverged = [r for r in records if r.get("event") == "diverged"]
    if diverged:
        lines.append(f"rewinds after divergence: {len(diverged)}: " + ", ".join(
            f"step {r['step']} back to version {r['rewound_to']} ("
            + (f"{r['reason'].split(' at step')[0]}, " if r.get("reason") else "")
            + f"{r['skipping']} batch(es) skipped)" for r in diverged))
    return lines
