"""Retention (save/retention.py): which versions go, which stay."""

from hpcckpt.save.retention import best_step, steps_to_delete


def test_retention_keeps_newest_and_best():
    steps = [10, 20, 30, 40, 50]
    assert steps_to_delete(steps, keep=2) == [10, 20, 30]
    metrics = {10: {"val_loss": 0.5}, 20: {"val_loss": 0.1}, 30: {"val_loss": 0.3}}
    assert steps_to_delete(steps, 2, metrics, "val_loss") == [10, 30]
    assert steps_to_delete(steps, 0) == [10, 20, 30, 40]  # never the newest
    assert steps_to_delete([], 3) == []


def test_best_step_direction_follows_metric():
    metrics = {1: {"val_loss": 0.2, "val_accuracy": 0.9}, 2: {"val_loss": 0.1, "val_accuracy": 0.8}}
    assert best_step(metrics, "val_loss") == 2
    assert best_step(metrics, "val_accuracy") == 1
    assert best_step(metrics, "missing") is None
