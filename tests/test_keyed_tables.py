"""Keyed tables without processes: the hash rule, merging a chain's rows, the table's rows and
changed rows, which versions go whole, and retention keeping each kept version's chain."""

import numpy as np
import pytest

from hpcckpt.save.drain import with_chains
from hpcckpt.ckpt.keyed_table import KeyedTable
from hpcckpt.save.retention import versions_to_delete
from hpcckpt.save.table_chain import TableChain
from hpcckpt.errors import CheckpointError, ConfigError, FormatError
from hpcckpt.format.keyed_rows import TableSpec, check_pieces, digest_text, merge_rows, mix, owner_of, rows_digest


def test_the_owner_of_an_id_depends_on_the_id_and_rank_count_only_and_spreads_evenly():
    ids = np.arange(200_000, dtype=np.int64)
    for ranks in (1, 3, 4, 6, 64):
        owners = owner_of(ids, ranks)
        assert owners.min() >= 0 and owners.max() < ranks
        counts = np.bincount(owners, minlength=ranks)
        assert counts.min() > 0.9 * ids.size / ranks, counts  # consecutive ids do not pile up
        assert np.array_equal(owner_of(ids[::-1], ranks), owners[::-1])
    # splitmix64's finalizer, as its reference states it in 64-bit arithmetic: the rule
    # recorded by name must never drift.
    some = [0, 1, -1, 2**62, -5, 123456789]
    assert mix(np.array(some)).tolist() == [_splitmix64_finalizer(i) for i in some]
    assert owner_of(np.array(some), 7).tolist() == [_splitmix64_finalizer(i) % 7 for i in some]
    with pytest.raises(ValueError):
        owner_of(ids, 0)


def _splitmix64_finalizer(value: int) -> int:
    z = value & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def test_a_tables_digest_is_the_same_however_its_rows_are_ordered_or_spread_over_ranks():
    ids = np.arange(1000, dtype=np.int64) * 7
    rows = np.random.default_rng(3).standard_normal((1000, 3)).astype(np.float32)  # 12-byte rows
    whole = digest_text(*rows_digest(ids, rows))
    order = np.random.default_rng(4).permutation(1000)
    parts = [rows_digest(ids[order][part], rows[order][part]) for part in np.array_split(np.arange(1000), 3)]
    assert digest_text(sum(c for c, _ in parts), sum(t for _, t in parts)) == whole
    changed = rows.copy()
    changed[500, 2] += 1
    assert digest_text(*rows_digest(ids, changed)) != whole
    assert digest_text(*rows_digest(ids[:-1], rows[:-1])) != whole
    assert whole.startswith("1000:")


def test_a_chain_of_rows_merges_oldest_first_the_last_row_of_an_id_winning():
    base_ids, base_rows = np.array([5, 1, 9]), np.array([[5.0], [1.0], [9.0]])
    ids, rows = merge_rows(base_ids, base_rows, np.array([9, 2, 9]), np.array([[90.0], [2.0], [91.0]]))
    assert ids.tolist() == [1, 2, 5, 9] and rows[:, 0].tolist() == [1.0, 2.0, 5.0, 91.0]
    ids, rows = merge_rows(base_ids, base_rows, np.empty(0, np.int64), np.empty((0, 1)))
    assert ids.tolist() == [1, 5, 9] and rows[:, 0].tolist() == [1.0, 5.0, 9.0]
    ids, rows = merge_rows(np.empty(0, np.int64), np.empty((0, 1)), np.array([3]), np.array([[3.0]]))
    assert ids.tolist() == [3] and rows.tolist() == [[3.0]]


def test_pieces_that_do_not_fit_their_versions_record_are_refused():
    spec = TableSpec(4, "float32")
    check_pieces("t", spec, np.zeros(3, np.int64), np.zeros((3, 4), np.float32), "here")
    for ids, rows in ((np.zeros(3, np.int64), np.zeros((2, 4), np.float32)),
                      (np.zeros(3, np.int32), np.zeros((3, 4), np.float32)),
                      (np.zeros(3, np.int64), np.zeros((3, 4), np.float64))):
        with pytest.raises(FormatError, match="table 't'"):
            check_pieces("t", spec, ids, rows, "here")
    assert TableSpec.from_dict("t", spec.to_dict()) == spec
    with pytest.raises(FormatError, match="hash rule 'crc32'"):
        TableSpec.from_dict("t", {"dim": 4, "dtype": "float32", "hash": "crc32"})


def test_a_table_grows_tracks_changed_rows_and_gives_them_back_when_a_version_is_lost():
    table = KeyedTable(3, np.float32, initializer=lambda ids: np.repeat(ids[:, None].astype(np.float32), 3, 1))
    slots = table.slots(np.arange(3000), create=True)  # past the first capacity
    assert len(table) == 3000 and slots.tolist() == list(range(3000))
    assert table.get([7, 2999])[:, 0].tolist() == [7.0, 2999.0]
    assert table.slots([5, 10**9]).tolist() == [5, -1]
    ids, rows = table.take(full=False)  # every row is new
    assert ids.size == 3000
    table.settle(held=True)
    assert table.take(full=False)[0].size == 0
    table.settle(held=True)
    table.values[table.slots([4, 8])] += 1
    table.mark_changed(table.slots([4, 8]))
    table.set([8, 5000, 5000], np.array([[1, 1, 1], [2, 2, 2], [3, 3, 3]]))
    ids, rows = table.take(full=False)
    assert ids.tolist() == [4, 8, 5000] and rows[:, 0].tolist() == [5.0, 1.0, 3.0]  # the last row of 5000 wins
    table.settle(held=False)  # no level held that version: its rows go with the next
    ids, _ = table.take(full=False)
    assert ids.tolist() == [4, 8, 5000]
    table.settle(held=True)
    table.mark_changed(table.slots([6]))
    assert table.take(full=False)[0].tolist() == [6]  # never settled: that checkpoint went no further
    assert table.take(full=False)[0].tolist() == [6]
    table.settle(held=True)
    whole_ids, whole_rows = table.take(full=True)
    assert whole_ids.size == 3001 and whole_rows.shape == (3001, 3)
    table.load(np.array([3, 1]), np.ones((2, 3)))
    assert table.ids.tolist() == [3, 1] and table.take(full=False)[0].size == 0
    with pytest.raises(KeyError):
        table.get([2])


def test_a_table_holds_only_the_ids_that_hash_to_its_rank():
    table = KeyedTable(2)
    table.bind(1, 4)
    ids = np.arange(100)
    mine = ids[owner_of(ids, 4) == 1]
    table.slots(mine, create=True)
    stranger = int(ids[owner_of(ids, 4) == 2][0])
    with pytest.raises(CheckpointError, match=f"id {stranger} belongs on rank 2 of 4, not on rank 1"):
        table.slots([stranger], create=True)
    early = KeyedTable(2)
    early.set([stranger], np.ones((1, 2)))  # added before the table was protected on 4 ranks
    with pytest.raises(CheckpointError, match="belongs on rank 2 of 4, not on rank 1"):
        early.bind(1, 4)
    with pytest.raises(CheckpointError, match="slot.*outside this rank's"):
        table.mark_changed(table.slots([stranger]))


def test_bad_tables_are_refused_clearly():
    with pytest.raises(ConfigError, match="dim must be >= 1"):
        KeyedTable(0)
    with pytest.raises(ConfigError, match="not a numeric dtype"):
        KeyedTable(2, object)
    table = KeyedTable(2, initializer=lambda ids: np.zeros((ids.size, 3)))
    with pytest.raises(CheckpointError, match="initializer gave rows of shape"):
        table.slots([1], create=True)


def test_versions_go_whole_every_k_after_a_restore_and_a_lost_version_leaves_the_chain():
    chain = TableChain(3)
    taken = []
    for step in (5, 10, 15, 20, 25):
        taken.append(chain.next(step, {"local"}))
        chain.settle(held=True)
    assert taken == [(5,), (5, 10), (5, 10, 15), (20,), (20, 25)]
    assert chain.next(30, {"local"}) == (20, 25, 30)
    chain.settle(held=False)  # 30 is held nowhere: 35 builds on 25
    assert chain.next(35, {"local"}) == (20, 25, 35)
    chain.settle(held=True)
    chain.reset()
    assert chain.next(40, {"local"}) == (40,)
    assert TableChain(1).next(5, {"local"}) == (5,)
    chain.settle(held=True)
    assert chain.next(45, {"local"}, final=True) == (45,)  # the run's last version stands alone


def test_a_delta_is_no_more_redundant_than_its_chain():
    # resilience.partner_every = 2: odd versions go to L1 and L2, even ones to L1 only. A
    # version with partner copies never builds on one without: it goes whole.
    chain, taken = TableChain(8), []
    for step, levels in ((1, {"local", "partner"}), (2, {"local"}), (3, {"local", "partner"}), (4, {"local"}),
                         (5, {"local"}), (6, {"local", "partner"})):
        taken.append(chain.next(step, levels))
        chain.settle(held=True)
    assert taken == [(1,), (1, 2), (3,), (3, 4), (3, 4, 5), (6,)]


def test_the_drain_copies_a_kept_version_with_the_chain_the_target_lacks_or_not_at_all():
    chains = {20: (10, 20), 30: (30,), 40: (30, 35, 40)}
    assert with_chains([20, 30], chains, on_target={10}, available={20, 30}) == ([20, 30], [])
    assert with_chains([20, 40], chains, on_target=set(), available={10, 20, 30, 40}) == ([10, 20], [40])
    assert with_chains([40], chains, on_target={35}, available={30, 40}) == ([30, 40], [])


def test_retention_keeps_the_chain_of_every_version_it_keeps():
    committed = [5, 10, 15, 20, 25, 30]
    chains = {5: (5,), 10: (5, 10), 15: (5, 10, 15), 20: (20,), 25: (20, 25), 30: (20, 25, 30)}
    assert versions_to_delete(committed, [], 30, 1, {}, "", set(), chains) == [5, 10, 15]
    assert versions_to_delete(committed, [], 30, 4, {}, "", set(), chains) == []  # 15 kept needs 5, 10
    assert versions_to_delete(committed, [], 30, 1, {}, "", set()) == [5, 10, 15, 20, 25]
