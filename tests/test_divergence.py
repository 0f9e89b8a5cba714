"""The divergence rules (train/divergence.py) and the nan fault's grammar, without processes."""

from types import SimpleNamespace

import pytest

from hpcckpt.errors import ConfigError, DivergenceError
from hpcckpt.faults import FaultInjector, parse_fault
from hpcckpt.train.divergence import Rewinds


class Log:
    def __init__(self):
        self.lines, self.records = [], []

    def info(self, message, console=False):
        self.lines.append(message)

    def metrics(self, record):
        self.records.append(record)


class Checkpointer:
    """Where rewind() would restore to: the newest multiple of 10 before the step."""

    def __init__(self):
        self.rewound = []

    def rewind(self, step, reason):
        self.rewound.append((step, reason))
        return (step - 1) // 10 * 10


class Trainer:
    def __init__(self, step):
        self.step, self.skipped = step, []

    def skip_batches(self, count):
        self.skipped.append((self.step, count))


def settings(**overrides):
    values = dict(rewind_on_divergence=True, skip_batches_on_rewind=2, max_rewinds=2, rewind_window_steps=100)
    return SimpleNamespace(**{**values, **overrides})


def test_the_batches_that_led_to_a_divergence_are_skipped_when_the_replay_reaches_them():
    rewinds, ckpt = Rewinds(settings(), Log()), Checkpointer()
    assert rewinds.diverged(34, ckpt) == 30
    trainer = Trainer(30)
    for step in (30, 31, 32, 33):
        trainer.step = step
        rewinds.before_step(trainer)
    # Steps 31 and 32 replay batches 31, 32; then batches 33 and 34 (those that led to it) go.
    assert trainer.skipped == [(32, 2)]


def test_a_skip_longer_than_the_replay_starts_at_the_restored_version():
    rewinds = Rewinds(settings(skip_batches_on_rewind=50), Log())
    assert rewinds.diverged(34, Checkpointer()) == 30
    trainer = Trainer(30)
    rewinds.before_step(trainer)
    assert trainer.skipped == [(30, 4)]


def test_too_many_rewinds_in_the_window_stop_naming_the_steps_and_old_ones_age_out():
    rewinds, ckpt = Rewinds(settings(), Log()), Checkpointer()
    rewinds.diverged(34, ckpt)
    rewinds.diverged(60, ckpt)
    with pytest.raises(DivergenceError, match=r"diverged 3 times within 100 steps \(at steps \[34, 60, 90\]\)"):
        rewinds.diverged(90, ckpt)
    aged = Rewinds(settings(), Log())
    for step in (34, 60, 250):  # 34 and 60 are out of 250's window
        aged.diverged(step, ckpt)


def test_without_rewinds_or_checkpoints_a_divergence_stops_the_run():
    with pytest.raises(DivergenceError, match="rewind_on_divergence = true"):
        Rewinds(settings(rewind_on_divergence=False), Log()).diverged(5, Checkpointer())
    with pytest.raises(DivergenceError, match="checkpoints are off"):
        Rewinds(settings(), Log()).diverged(5, None)
    assert DivergenceError.exit_code == 2


def test_the_nan_fault_hits_its_rank_once():
    fault = parse_fault("nan:step=7:rank=1")
    assert (fault.kind, fault.target, fault.step) == ("nan", 1, 7)
    assert parse_fault("nan:step=3").target == 0
    injector = FaultInjector([fault], rank=1, node=0, local_dir=None)
    assert [injector.poisons(s) for s in (6, 7, 7)] == [False, True, False]
    assert not FaultInjector([fault], rank=0, node=0, local_dir=None).poisons(7)
    injector.strike(7)  # a nan kills no one
    with pytest.raises(ConfigError, match="needs step="):
        parse_fault("nan:rank=1")
