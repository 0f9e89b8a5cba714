"""Every level answers the Level protocol (levels/base.py) the same way, on real ranks:
4 mpiexec ranks on 4 simulated nodes run tests/scripts/level_conformance.py for one level."""

from pathlib import Path

import pytest
from conftest import assert_ok, run_script, script_results

from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES

SCRIPT = Path(__file__).parent / "scripts" / "level_conformance.py"
RANKS = 4


# Replicas and parity travel in chunks (#26): one byte, and an odd size that divides neither a
# shard nor a segment, beside the default (larger than these shards).
@pytest.fixture(scope="module", params=["local", "partner", "erasure", "pfs", "partner:1", "erasure:1",
                                        "partner:997", "erasure:997"])
def answers(request, tmp_path_factory):
    kind, _, chunk = request.param.partition(":")
    base = tmp_path_factory.mktemp(kind)
    proc = run_script(RANKS, SCRIPT, [kind, str(base)] + ([chunk] if chunk else []), base)
    assert_ok(proc)
    got = {r["check"]: r["answers"] for r in script_results(proc)}
    got["chunk"] = int(chunk) if chunk else None
    return kind, got


def test_stored_bytes_are_reported(answers):
    kind, got = answers
    for step in (10, 20):
        assert all(n > 0 for n in got[f"stored_{step}"]), got[f"stored_{step}"]


def test_only_committed_versions_are_listed_and_leftovers_are_uncommitted(answers):
    kind, got = answers
    assert got["committed"] == [[10, 20]] * RANKS
    assert got["uncommitted"] == [[30]] * RANKS


def test_holdings_name_whose_shards_each_rank_can_supply(answers):
    kind, got = answers
    for rank, held in enumerate(got["holdings"]):
        assert set(held) == {"10", "20"}
        ranks = set(held["20"])
        if kind == "local":
            assert ranks == {rank}
        elif kind == "partner":
            assert ranks and rank not in ranks  # replicas of other ranks only
        else:  # a whole group (erasure), the whole job (pfs)
            assert ranks == set(range(RANKS))


def test_asked_about_its_own_rank_a_level_names_only_that_rank(answers):
    kind, got = answers
    for rank, held in enumerate(got["holdings_of_own"]):
        assert set(held) == {"10", "20"}
        expected = {"local": {rank}, "pfs": {rank}, "erasure": {rank}, "partner": set()}[kind]
        assert set(held["20"]) == expected  # a rank never holds its own replica


def test_the_commit_record_is_read_through_the_level(answers):
    kind, got = answers
    assert got["manifest_step"] == [20] * RANKS


def test_what_the_plan_asks_of_a_level_over_everyones_holdings(answers):
    kind, got = answers
    assert got["serves"] == [list(range(RANKS))] * RANKS
    served = got["serves_without_2"][0]
    if kind == "local":  # rank 2's own file went with its node
        assert served == [0, 1, 3]
    elif kind == "partner":  # every shard but the one whose replica rank 2 held
        assert 2 in served and len(served) == RANKS - 1
    else:  # a group of 4 with parity 1 loses one member; L4 is shared
        assert served == list(range(RANKS))


def test_a_collective_level_makes_again_what_a_lost_rank_held(answers):
    kind, got = answers
    if kind in ("local", "pfs"):
        assert "protected_again" not in got
        return
    for rank, answer in enumerate(got["protected_again"]):
        assert answer["same"] and answer["files"], (rank, answer)


def test_a_lost_shard_is_delivered_byte_exact_where_the_level_can(answers):
    kind, got = answers
    delivered = got["deliver_to_2"]
    if kind == "local":
        # L1 holds only a rank's own shard: rank 2 (deemed needy) reads its own file again.
        assert delivered[2]["delivered"] and delivered[2]["same_bytes"]
    else:
        assert delivered[2] == {"delivered": True, "same_bytes": True, "verifies": True, "warnings": []}
    assert not any(d["delivered"] for r, d in enumerate(delivered) if r != 2)


def test_a_corrupt_copy_is_never_delivered_as_good(answers):
    kind, got = answers
    answers = got["deliver_to_2_corrupt"]
    delivered = answers[2]
    assert not delivered["delivered"] or not delivered["verifies"], delivered
    if kind == "erasure":  # damaged parity makes its holders lost members: more than p
        warnings = [w for answer in answers for w in answer["warnings"]]
        assert any("unusable" in w for w in warnings) and any("more than L3 survives" in w for w in warnings)


def test_remove_deletes_this_levels_own_files_only(answers):
    kind, got = answers
    assert got["committed_after_remove"] == [[20]] * RANKS
    assert got["own_files_left_of_10"] == [[]] * RANKS


def test_a_withdrawn_commit_takes_the_version_out_of_the_committed_ones(answers):
    kind, got = answers
    assert got["withdraw"] == [[]] * RANKS


def test_no_level_keeps_a_buffer_larger_than_a_chunk(answers):
    """Chunk buffers, never a shard-sized one: at most a chunk, or the largest transfer where
    that is smaller (the default 8 MiB chunk over these few-KB shards)."""
    kind, got = answers
    chunk = got["chunk"] or DEFAULT_CHUNK_BYTES
    shard = max(got["shard_bytes"])  # the largest a rank receives
    segment = -(-shard // 3)  # group of 4, parity 1: a stripe's segment is a third of the largest shard
    for largest in got["largest_buffer"]:
        assert largest <= min(chunk, segment if kind == "erasure" else shard), (largest, chunk, shard)


def test_a_delivery_holds_chunks_not_the_shard_it_delivers(answers):
    """#26 item 2: a 4 MiB shard delivered to rank 2 in 16 KiB chunks, byte for byte; no
    rank's NumPy buffers (traced) reach an eighth of it (32 chunks) at any time: an L3
    rebuild holds 2 k = 6 chunks of input and the codec's temporaries. Mapped files are not
    buffers: their pages are the page cache's. L1 and L4 hand over rank 2's own file."""
    kind, got = answers
    answers = got["large_delivery"]
    assert answers[2]["delivered"] and answers[2]["same_bytes"] and answers[2]["verifies"], answers[2]
    for answer in answers:
        assert answer["peak"] < answer["shard_bytes"] / 8, (answer["peak"], answer["shard_bytes"])
