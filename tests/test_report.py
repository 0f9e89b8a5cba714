"""A run's report (tools/report.py): attempts, restart sources, work lost."""


def test_report_tells_attempts_sources_and_work_lost():
    from hpcckpt.tools.report import summarise

    records = [
        {"event": "restart", "attempt": 1, "step": 0, "sources": []},
        {"step": 50, "checkpoint_blocking_s": 0.002},
        {"step": 100, "checkpoint_blocking_s": 0.004},
        {"event": "restart", "attempt": 2, "step": 100, "sources": ["local", "partner", "erasure", "local"],
         "reached_before": 130, "lost_steps": 30},
        {"step": 150, "checkpoint_blocking_s": 0.003},
        {"event": "checkpoint_summary", "checkpoints": 1, "overhead_pct": 0.5},
        {"step": 150, "final": True, "weights_digest": "ab"},
    ]
    text = "\n".join(summarise(records))
    assert "attempts: 2" in text and "steps done: 150 (finished)" in text
    assert "2 rank(s) from L1 local, 1 rank(s) from L2 partner, 1 rank(s) from L3 erasure" in text
    assert "rebuilt: rank 1: L2 partner, rank 2: L3 erasure" in text
    assert "checkpoints taken: 3" in text and "median 3.0 ms, max 4.0 ms" in text
    assert "work lost to failures: 30 step(s)" in text
    crashed = summarise(records[:-1])
    assert any("not finished" in line for line in crashed)


def test_report_tells_an_attempt_begun_in_the_job_from_a_relaunch():
    """An attempt that follows a process_failure record is the survivors going on in the job,
    with the ranks lost and left and the shrink's time; the others are relaunches."""
    from hpcckpt.tools.report import summarise

    records = [
        {"event": "restart", "attempt": 1, "step": 0, "sources": []},
        {"step": 60, "checkpoint_blocking_s": 0.002},
        {"event": "process_failure", "lost_ranks": [1], "ranks_left": 3, "shrink_s": 0.0123},
        {"event": "restart", "attempt": 2, "step": 60, "ranks": 3, "sources": ["local"] * 4,
         "reached_before": 70, "lost_steps": 10},
        {"event": "restart", "attempt": 3, "step": 60, "ranks": 3, "sources": ["local"] * 3,
         "reached_before": 65, "lost_steps": 5},
    ]
    lines = summarise(records)
    assert lines[0] == "attempts: 3 (1 of them in the job, after ranks died: no relaunch; 1 relaunch(es))"
    assert lines[2].startswith("  attempt 2: in the job after rank(s) 1 died (3 rank(s) left, shrunk in 0.012 s): "
                               "resumed from step 60"), lines
    assert "in the job" not in lines[3]
    assert any(line == "work lost to failures: 15 step(s)" for line in lines)


def test_report_tells_an_attempt_that_went_on_from_the_survivors_memory():
    """Survivors that went on from the step they held read no version: said so, with no level
    named and no step lost."""
    from hpcckpt.tools.report import summarise

    records = [
        {"event": "restart", "attempt": 1, "step": 0, "sources": []},
        {"event": "process_failure", "lost_ranks": [2], "ranks_left": 3, "shrink_s": 0.004},
        {"event": "restart", "attempt": 2, "step": 70, "ranks": 3, "sources": ["memory"] * 3,
         "from_memory_s": 0.0123, "reached_before": 70, "lost_steps": 0},
    ]
    text = "\n".join(summarise(records))
    assert ("attempt 2: in the job after rank(s) 2 died (3 rank(s) left, shrunk in 0.004 s): went on from step 70, "
            "held in memory by the 3 survivor(s) (no version read, 0.012 s)") in text, text
    assert "work lost to failures: 0 step(s)" in text


def test_report_tells_shards_checked_in_memory_and_a_start_over():
    """A spare's restart where the survivors found their own shards in their snapshot
    buffers: counted as from memory, not as rebuilt; a start over after every version was
    lost is said as one, with the newest version lost."""
    from hpcckpt.tools.report import summarise

    records = [
        {"event": "restart", "attempt": 1, "step": 0, "sources": []},
        {"event": "process_failure", "lost_ranks": [1], "ranks_left": 4, "shrink_s": 0.001},
        {"event": "restart", "attempt": 2, "step": 8, "ranks": 4, "sources": ["memory", "partner", "memory", "memory"],
         "reached_before": 10, "lost_steps": 2},
        {"event": "started_over", "lost_up_to": 12},
        {"event": "restart", "attempt": 3, "step": 0, "ranks": 4, "sources": [], "reached_before": 14,
         "lost_steps": 14},
    ]
    lines = summarise(records)
    assert lines[2].endswith("resumed from step 8 (3 rank(s) from memory, 1 rank(s) from L2 partner); rebuilt: "
                             "rank 1: L2 partner; the previous attempt had reached step 10: 2 step(s) of work lost"), lines
    assert lines[3] == ("  attempt 3: started over from scratch: no stored version (up to step 12) could be recovered "
                        "(resilience.unrecoverable); the previous attempt had reached step 14: 14 step(s) of work lost")
