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
