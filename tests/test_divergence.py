"""The divergence rules (schedule/divergence.py) and the trainer's skipped batches
(train/divergence.py), what a version's metrics vouch for (run/health.py), retention's
known-good version, and the nan and spike faults' grammar, without processes."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpcckpt.schedule.divergence import LOSS_HISTORY, MIN_HISTORY, DivergenceCheck, DivergencePolicy
from hpcckpt.save.retention import newest_known_good
from hpcckpt.errors import ConfigError, DivergenceError
from hpcckpt.faults import FaultInjector, parse_fault
from hpcckpt.run.health import first_non_finite, non_finite_metrics, vouches_finite
from hpcckpt.train.divergence import SkippedBatches


class Log:
    def __init__(self):
        self.lines, self.records = [], []

    def info(self, message, console=False):
        self.lines.append(message)

    def metrics(self, record):
        self.records.append(record)


def rewind(policy, step, reason="non-finite gradients"):
    """What Checkpointer.observe does after admitting a divergence: back to the newest multiple
    of 10 before the step."""
    policy.admit(step, reason)
    return policy.rewound(step, (step - 1) // 10 * 10, reason)


class Trainer:
    def __init__(self, step):
        self.step, self.skipped = step, []

    def skip_batches(self, count):
        self.skipped.append((self.step, count))


def settings(**overrides):
    values = dict(rewind_on_divergence=True, skip_batches_on_rewind=2, max_rewinds=2, rewind_window_steps=100,
                  divergence_factor=0.0)
    return SimpleNamespace(**{**values, **overrides})


def test_the_batches_that_led_to_a_divergence_are_skipped_when_the_replay_reaches_them():
    rewound = rewind(DivergencePolicy(settings()), 34)
    assert rewound.step == 30
    skipped, trainer = SkippedBatches(Log()), Trainer(30)
    skipped.after(rewound)
    for step in (30, 31, 32, 33):
        trainer.step = step
        skipped.before_step(trainer)
    # Steps 31 and 32 replay batches 31, 32; then batches 33 and 34 (those that led to it) go.
    assert trainer.skipped == [(32, 2)]


def test_a_skip_longer_than_the_replay_starts_at_the_restored_version():
    rewound = rewind(DivergencePolicy(settings(skip_batches_on_rewind=50)), 34)
    assert rewound.step == 30
    skipped, trainer = SkippedBatches(Log()), Trainer(30)
    skipped.after(rewound)
    skipped.before_step(trainer)
    assert trainer.skipped == [(30, 4)]


def test_too_many_rewinds_in_the_window_stop_naming_the_steps_and_old_ones_age_out():
    policy = DivergencePolicy(settings())
    rewind(policy, 34)
    rewind(policy, 60)
    with pytest.raises(DivergenceError, match=r"diverged 3 times within 100 steps \(at steps \[34, 60, 90\]\)"):
        rewind(policy, 90)
    aged = DivergencePolicy(settings())
    for step in (34, 60, 250):  # 34 and 60 are out of 250's window
        rewind(aged, step)


def test_without_rewinds_a_divergence_stops_the_run():
    with pytest.raises(DivergenceError, match=r"step 5: the run diverged \(non-finite gradients at step 5\); set "
                                              "resilience.rewind_on_divergence = true"):
        rewind(DivergencePolicy(settings(rewind_on_divergence=False)), 5, "non-finite gradients at step 5")
    assert DivergenceError.exit_code == 2


def test_the_nan_and_spike_faults_hit_their_rank_once():
    fault = parse_fault("nan:step=7:rank=1")
    assert (fault.kind, fault.target, fault.step) == ("nan", 1, 7)
    assert parse_fault("nan:step=3").target == 0
    spike = parse_fault("spike:step=9:rank=1:factor=50")
    assert (spike.kind, spike.target, spike.step, spike.factor) == ("spike", 1, 9, 50.0)
    assert parse_fault("spike:step=9").factor == 30.0
    injector = FaultInjector([fault, spike], rank=1, node=0, local_dir=None)
    assert [injector.corruption(s) for s in (6, 7, 7, 9, 9)] == [None, fault, None, spike, None]
    assert FaultInjector([fault], rank=0, node=0, local_dir=None).corruption(7) is None
    injector.strike(7)  # a nan kills no one
    with pytest.raises(ConfigError, match="needs step="):
        parse_fault("nan:rank=1")
    with pytest.raises(ConfigError, match="needs step="):
        parse_fault("nan:step=3:factor=2")  # a factor is a spike's
    with pytest.raises(ConfigError, match="factor must be above 1"):
        parse_fault("spike:step=3:factor=0.5")


def test_a_step_diverges_on_non_finite_gradients_or_loss_whatever_the_factor():
    check = DivergenceCheck(0.0)
    assert check.verdict(1, 2.3, True) is None
    assert check.verdict(2, 2.1, False) == "non-finite gradients at step 2"
    assert check.verdict(3, float("nan"), True) == "non-finite loss (nan) at step 3"
    assert check.verdict(4, float("inf"), True).startswith("non-finite loss (inf)")
    assert check.losses == [2.3]  # a step that diverged leaves the history alone
    for step in range(5, 50):  # without a factor, no loss is a spike
        assert check.verdict(step, 1e6 if step == 40 else 1.0, True) is None


def test_a_loss_spike_is_measured_against_the_median_of_the_recent_healthy_steps():
    check = DivergenceCheck(4.0)
    for step in range(1, MIN_HISTORY):  # too little history to call anything a spike
        assert check.verdict(step, 100.0 if step == 2 else 1.0, True) is None
    assert check.verdict(MIN_HISTORY, 1.0, True) is None
    said = check.verdict(6, 4.5, True)  # median 1.0 of [1, 100, 1, 1, 1]: the outlier does not move it
    assert said == "loss spike at step 6: 4.5, above 4 x the median 1 of the last 5 steps"
    assert check.verdict(7, 3.9, True) is None
    # The history is bounded, and the median follows a loss that falls.
    for step in range(8, 8 + 3 * LOSS_HISTORY):
        assert check.verdict(step, 0.1, True) is None
    assert len(check.losses) == LOSS_HISTORY
    assert check.verdict(100, 0.5, True).startswith("loss spike at step 100: 0.5, above 4 x the median 0.1")
    # Its state goes with each version: a restored check judges the next step alike.
    restored = DivergenceCheck(4.0)
    restored.load_state(check.state())
    assert restored.verdict(101, 0.5, True) == check.verdict(101, 0.5, True)


def test_metrics_that_are_not_finite_are_named_and_a_finite_loss_vouches_for_the_arrays():
    assert non_finite_metrics({"loss": float("nan"), "val_accuracy": 0.9, "step": 3, "note": "x"}) == ["loss"]
    assert non_finite_metrics({"loss": 1.0, "val_loss": float("-inf")}) == ["val_loss"]
    assert non_finite_metrics(None) == [] and non_finite_metrics({"flag": True}) == []
    assert vouches_finite({"loss": 0.25}) and vouches_finite({"loss": np.float32(0.25)})
    assert not vouches_finite({"loss": float("nan")}) and not vouches_finite({"val_loss": 1.0})
    assert not vouches_finite({}) and not vouches_finite({"loss": True})


def test_the_first_array_holding_nan_or_inf_is_named_in_chunks_and_integers_pass():
    clean = np.ones((3, 5), dtype=np.float32)
    bad = np.zeros(3 * (1 << 22) + 7)  # past the first chunks
    bad[-1] = np.inf
    assert first_non_finite([("w", clean), ("i", np.arange(5))]) is None
    assert first_non_finite([("w", clean), ("b", bad), ("c", np.full(2, np.nan))]) == "b"
    assert first_non_finite([("z", np.array([1 + 1j, complex("nan")]))]) == "z"


def test_retention_keeps_the_version_before_the_newest_when_rewinds_may_need_it():
    assert newest_known_good([]) == set() and newest_known_good([10]) == set()
    assert newest_known_good([30, 10, 20]) == {20}
