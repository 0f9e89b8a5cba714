"""Which finished step this process holds (ckpt/step_commits.py) and what a survivor offers
to go on from (restore/from_memory.py's offer): pure, no MPI."""

import numpy as np
import pytest

from hpcckpt.ckpt.foreign_arrays import protectable
from hpcckpt.ckpt.registry import ArrayRegistry
from hpcckpt.ckpt.step_commits import RECOVERING, StepCommits
from hpcckpt.restore.from_memory import offer


def registry_of(**arrays) -> ArrayRegistry:
    registry = ArrayRegistry()
    for name, array in arrays.items():
        registry.protect(name, protectable(name, array), True)
    return registry


def agreed(flag):
    return flag


def dead_rank(flag):
    raise RuntimeError("a rank died in the agreement")


def test_a_step_is_held_once_committed_and_finished_and_not_while_it_changes():
    registry = registry_of(w=np.zeros(4))
    commits = StepCommits()
    commits.step_done(1, registry, lambda: {"s": 1})
    assert commits.held() is None  # the application never committed: nothing is promised
    commits.commit(2, agreed)
    assert commits.held() is None  # between commit_step and due(): the arrays may be half changed
    commits.step_done(2, registry, lambda: {"s": 2})
    held = commits.held()
    assert held.step == 2 and held.state == {"s": 2} and held.arrays["w"] is registry.arrays["w"].array
    with pytest.raises(RuntimeError):
        commits.commit(3, dead_rank)
    assert commits.held().step == 2  # nobody passed the agreement: the finished step stands


def test_a_step_closed_without_its_commit_or_a_restore_forgets_the_step_held():
    registry = registry_of(w=np.zeros(4))
    commits = StepCommits()
    commits.commit(5, agreed)
    commits.step_done(5, registry, dict)
    commits.step_done(6, registry, dict)  # due(6) without commit_step(6)
    assert commits.held() is None
    commits.commit(7, agreed)
    commits.step_done(7, registry, dict)
    commits.forget()
    assert commits.held() is None


def test_a_survivor_offers_its_step_only_for_replicated_arrays_the_same_as_those_held():
    registry = registry_of(w=np.zeros(4), m=np.ones(3))
    commits = StepCommits()
    commits.commit(9, agreed)
    commits.step_done(9, registry, dict)
    held = commits.held()
    assert offer(held, registry_of(w=np.zeros(4), m=np.ones(3)), 1) == (9, None)
    assert offer(None, registry, 1)[1].startswith("it holds no finished step")
    assert "not those it held" in offer(held, registry_of(w=np.zeros(4)), 1)[1]
    assert "protected now as float64[5], held as float64[4]" in offer(held, registry_of(w=np.zeros(5),
                                                                                        m=np.ones(3)), 1)[1]
    blocks = ArrayRegistry()
    blocks.protect("w", protectable("w", np.zeros(4)), True, (8,), (0,))
    blocks.protect("m", protectable("m", np.ones(3)), True)
    assert "array 'w' is not replicated" in offer(held, blocks, 1)[1]
    per_rank = ArrayRegistry()
    per_rank.protect("w", protectable("w", np.zeros(4)), False)
    per_rank.protect("m", protectable("m", np.ones(3)), True)
    assert "array 'w' is not replicated" in offer(held, per_rank, 1)[1]


def test_per_rank_state_goes_on_from_memory_onto_fewer_ranks_only_through_its_reshard():
    registry = registry_of(w=np.zeros(4))
    registry.register_state("rng", dict, lambda state: None, per_rank=True)
    commits = StepCommits()
    commits.commit(3, agreed)
    commits.step_done(3, registry, dict, rank=2, world_size=4)
    held = commits.held()
    assert (held.rank, held.world_size) == (2, 4)
    assert offer(held, registry, 4) == (3, None)  # the same ranks: each survivor keeps its own
    assert "state 'rng' is per rank and has no reshard for 4 -> 3 ranks" in offer(held, registry, 3)[1]
    resharded = registry_of(w=np.zeros(4))
    resharded.register_state("rng", dict, lambda state: None, per_rank=True, reshard=lambda states, rank, size: {})
    assert offer(held, resharded, 3) == (3, None)


def test_a_survivor_in_recovery_meets_the_others_in_the_agreement_once_per_round():
    """Survivors that finished the step wait in the next commit_step's agreement, which a revoke
    does not end; one entering the recovery meets them there with 0: their commit fails and they
    recover too. A rank whose own commit failed took part in the round already."""
    from mpi4py import MPI

    registry = registry_of(w=np.zeros(4))
    others = StepCommits()
    others.commit(4, agreed)
    others.step_done(4, registry, dict)
    with pytest.raises(MPI.Exception) as caught:
        others.commit(5, lambda flag: flag & RECOVERING)  # a survivor in its recovery took part
    assert caught.value.Get_error_class() == MPI.ERR_PROC_FAILED
    assert others.held().step == 4
    calls = []
    others.join_recovery(lambda flag: calls.append(flag))
    assert calls == []  # its commit's round was the recovery's
    recovering = StepCommits()
    recovering.commit(4, agreed)
    recovering.join_recovery(lambda flag: calls.append(flag))
    recovering.join_recovery(lambda flag: calls.append(flag))
    assert calls == [RECOVERING]
    StepCommits().join_recovery(lambda flag: calls.append(flag))  # no commit_step: nobody waits in one
    assert calls == [RECOVERING]


def test_an_outcome_no_rank_gave_is_taken_for_a_failure_and_said_as_what_it_is():
    """Open MPI's agreement beside another thread inside MPI sometimes returns 0 with no rank
    dead (perf/agree_beside_threads.py), not always on every rank alike: bit 0, which every rank
    sets, is clear. Agreeing again would leave the ranks that got it waiting for those that went
    on, so it is raised as a failure, like a recovering survivor's flag, and told to the log."""
    from mpi4py import MPI

    registry = registry_of(w=np.zeros(4))
    commits, told = StepCommits(), []
    commits.commit(6, lambda flag: flag, on_unsound=told.append)
    commits.step_done(6, registry, dict)
    with pytest.raises(MPI.Exception) as caught:
        commits.commit(7, lambda flag: 0, on_unsound=told.append)
    assert caught.value.Get_error_class() == MPI.ERR_PROC_FAILED
    assert told == [0] and commits.held().step == 6
    calls = []
    commits.join_recovery(calls.append)
    assert calls == []  # its commit's round ended in the recovery already
    with pytest.raises(MPI.Exception):
        commits.commit(8, lambda flag: flag & RECOVERING, on_unsound=told.append)
    assert told == [0]  # a recovering survivor's flag is no glitch
