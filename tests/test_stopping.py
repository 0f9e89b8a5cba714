"""Stop requests on one rank (the multi-rank agreement runs in tests/test_jobs_mpi.py)."""

import os
import signal

import pytest


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_a_stop_signal_is_reported_after_the_step_not_during_it(world):
    from hpcckpt.schedule.stopping import StopRequests

    stopper = StopRequests(world).install()
    try:
        stopper.post()
        assert stopper.agreed() is None
        stopper.post()
        os.kill(os.getpid(), signal.SIGUSR1)  # arrives during the step: noticed at the next post
        assert stopper.agreed() is None
        stopper.post()
        assert stopper.agreed() == "SIGUSR1 received"
    finally:
        stopper.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers are put back


def test_the_allocation_end_stops_the_run_halt_seconds_early(world):
    from hpcckpt.schedule.stopping import StopRequests

    now = [1000.0]
    stopper = StopRequests(world, end_time=1100.0, halt_seconds=30.0, clock=lambda: now[0])
    try:
        stopper.post()
        assert stopper.agreed() is None  # 100 s left
        now[0] = 1075.0
        stopper.post()
        assert "run.halt_seconds = 30" in stopper.agreed()
    finally:
        stopper.close()


def test_a_halt_file_is_looked_for_about_once_a_second_and_at_every_checkpoint(world, tmp_path):
    from hpcckpt.schedule.stopping import StopRequests

    halt = tmp_path / "HALT"
    stopper = StopRequests(world, halt_file=halt)
    try:
        stopper.step_over()  # looked for: absent
        halt.write_text("maintenance\n")
        assert stopper.step_over() is None  # not looked for again within the second
        assert stopper.step_over(look_now=True) is None  # a checkpoint step: looked for
        assert stopper.step_over() == f"halt file {halt} (maintenance)"
    finally:
        stopper.close()
