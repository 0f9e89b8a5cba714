"""Shard layout and N->M re-partitioning, checked exhaustively without processes."""

import itertools
import json
import re

import numpy as np
import pytest

from hpcckpt.errors import ConfigError, FormatError, IncompatibleCheckpointError
from hpcckpt.format.layout import (
    BlockLayout,
    Layout,
    ReadRequest,
    TensorLayout,
    TensorSpec,
    block_problems,
    destination,
    extract_piece,
    insert_piece,
    piece_view_slices,
    place_read,
    plan_layout,
    read_requests,
    request_payload,
)

SHAPES = [(), (1,), (3,), (7,), (2, 3), (5, 4), (4, 5), (3, 3), (9, 2, 2), (2, 11, 3),
          (2, 3, 4, 5), (0,), (3, 0), (13, 1)]
DTYPES = ["float32", "int64", "uint8", "float64"]


def _random_array(spec: TensorSpec, rng) -> np.ndarray:
    return (rng.standard_normal(spec.shape) * 100).astype(spec.dtype)


def _specs(shapes, prefix="t"):
    return [TensorSpec(f"{prefix}{i}", DTYPES[i % len(DTYPES)], shape) for i, shape in enumerate(shapes)]


@pytest.mark.parametrize("world_size", range(1, 10))
@pytest.mark.parametrize("threshold", [0, 40, 1 << 20])
def test_pieces_cover_every_element_exactly_once(world_size, threshold):
    rng = np.random.default_rng(world_size)
    specs = _specs(SHAPES)
    layout = plan_layout(specs, world_size, split_threshold_bytes=threshold)
    assert [t.spec for t in layout.tensors] == specs
    for tensor_layout in layout.tensors:
        original = _random_array(tensor_layout.spec, rng)
        rebuilt = np.zeros_like(original)
        hits = np.zeros(tensor_layout.spec.shape, dtype=np.int64)
        for rank in range(world_size):
            piece = extract_piece(original, tensor_layout, rank)
            assert piece.flags.c_contiguous
            assert piece.shape == layout.piece_shape(tensor_layout.name, rank)
            assert piece.nbytes == tensor_layout.piece_nbytes(rank)
            insert_piece(rebuilt, tensor_layout, rank, piece)
            insert_piece(hits, tensor_layout, rank, extract_piece(hits, tensor_layout, rank) + 1)
        np.testing.assert_array_equal(rebuilt, original)
        assert (hits == 1).all()
        assert sum(tensor_layout.piece_nbytes(r) for r in range(world_size)) == tensor_layout.spec.nbytes


def test_split_rules_uneven_and_small_dims():
    spec = TensorSpec("w", "float32", (3, 10, 10))  # tie between axes 1 and 2: lowest wins
    layout = plan_layout([spec], 4, split_threshold_bytes=0)
    tensor = layout.tensor("w")
    assert tensor.axis == 1
    assert tensor.bounds == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert layout.piece_shape("w", 0) == (3, 3, 10)

    narrow = plan_layout([TensorSpec("n", "float32", (3, 2))], 5, split_threshold_bytes=0).tensor("n")
    assert narrow.axis == 0
    assert narrow.bounds == ((0, 1), (1, 2), (2, 3), (3, 3), (3, 3))
    layout = plan_layout([TensorSpec("n", "float32", (3, 2))], 5, split_threshold_bytes=0)
    assert [t.name for t in layout.rank_pieces(3)] == []
    assert layout.bytes_of_rank(3) == 0


def test_small_tensors_whole_and_balanced_by_bytes():
    big = TensorSpec("big", "float32", (999, 300))  # 1.2 MB: split evenly over 3 ranks
    smalls = [TensorSpec(f"s{i}", "float64", (n,)) for i, n in enumerate([500, 400, 300, 300, 200, 100, 7])]
    scalar = TensorSpec("scalar", "float32", ())
    layout = plan_layout([big] + smalls + [scalar], 3)
    assert layout.tensor("big").is_split
    owners = {}
    for t in layout.tensors[1:]:
        holders = [r for r in range(3) if t.rows(r) > 0]
        assert len(holders) == 1, t
        owners[t.name] = holders[0]
        owner_start, owner_stop = t.bounds[holders[0]]
        assert (owner_start, owner_stop) == (0, t.logical_shape[t.axis])
    # Greedy, largest first, onto the least-loaded rank (lowest on ties); loads start
    # equal. s0 4000 -> 0, s1 3200 -> 1, s2 2400 -> 2, s3 2400 -> 2 (2400 < 3200),
    # s4 1600 -> 1 (3200 < 4000 < 4800), s5 800 -> 0 (4000 < 4800 = 4800), s6 -> 1 or 2 ...
    assert [owners[f"s{i}"] for i in range(6)] == [0, 1, 2, 2, 1, 0]
    loads = [layout.bytes_of_rank(r) for r in range(3)]
    assert max(loads) - min(loads) <= max(s.nbytes for s in smalls)
    assert sum(loads) == sum(s.nbytes for s in [big] + smalls + [scalar])
    assert layout.tensor("scalar").logical_shape == (1,)
    assert layout.tensor("scalar").axis == 0
    # Same inputs, same layout: every rank computes it independently.
    assert plan_layout([big] + smalls + [scalar], 3) == layout


def test_zero_d_tensor_round_trip():
    spec = TensorSpec("lr", "float64", ())
    layout = plan_layout([spec], 3)
    tensor = layout.tensor("lr")
    value = np.array(0.125)
    target = np.array(0.0)
    for rank in range(3):
        piece = extract_piece(value, tensor, rank)
        assert piece.shape == tensor.piece_shape(rank)
        insert_piece(target, tensor, rank, piece)
    assert target == value


def test_piece_view_slices_match_extract():
    spec = TensorSpec("w", "float32", (4, 9, 2))
    tensor = plan_layout([spec], 4, split_threshold_bytes=0).tensor("w")
    array = np.arange(72, dtype=np.float32).reshape(4, 9, 2)
    for rank in range(4):
        manual = np.ascontiguousarray(np.moveaxis(array[piece_view_slices(tensor, rank)], tensor.axis, 0))
        np.testing.assert_array_equal(manual, extract_piece(array, tensor, rank))


def test_json_round_trip_exact():
    specs = _specs(SHAPES) + [TensorSpec("big_endian", ">f8", (5,))]
    for world_size in (1, 4, 7):
        layout = plan_layout(specs, world_size, split_threshold_bytes=48)
        text = layout.to_json()
        again = Layout.from_json(text)
        assert again == layout
        assert again.to_json() == text
        assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout.from_json(text).tensor("big_endian").spec.dtype == ">f8"


@pytest.mark.parametrize("dtype", ["S24", "U6", "V24", ">u2", "complex64", "bool"])
def test_every_flat_dtype_keeps_its_name_through_the_layout(dtype):
    layout = plan_layout([TensorSpec("a", dtype, (4, 3))], 2, split_threshold_bytes=0)
    assert np.dtype(Layout.from_json(layout.to_json()).tensor("a").spec.dtype) == np.dtype(dtype)


def test_a_structured_dtype_is_refused_with_advice():
    with pytest.raises(ConfigError, match="structured; checkpoint each field"):
        TensorSpec("s", np.dtype([("x", "f4"), ("y", "i8")]), (3,))


def test_from_json_rejects_garbage():
    layout = plan_layout(_specs([(8, 3)]), 2, split_threshold_bytes=0)
    data = layout.to_dict()
    data["tensors"][0]["bounds"] = [[0, 3], [4, 8]]  # leaves a hole
    with pytest.raises(FormatError):
        Layout.from_dict(data)
    with pytest.raises(FormatError):
        Layout.from_json("{not json")
    with pytest.raises(FormatError):
        Layout.from_dict({"format": 1})


def test_invalid_inputs():
    with pytest.raises(ConfigError):
        plan_layout(_specs([(2,)]), 0)
    with pytest.raises(ConfigError):
        plan_layout([TensorSpec("a", "f4", (2,)), TensorSpec("a", "f4", (3,))], 2)
    with pytest.raises(ConfigError):
        TensorSpec("o", object, (2,))


def test_same_tensors_reports_differences():
    base = plan_layout([TensorSpec("a", "float32", (4, 4)), TensorSpec("b", "int64", (3,)),
                        TensorSpec("c", "uint8", (2,))], 2)
    assert base.same_tensors(plan_layout(base.specs(), 5, split_threshold_bytes=0)) == []
    other = plan_layout([TensorSpec("a", "float64", (4, 4)), TensorSpec("b", "int64", (3, 1)),
                         TensorSpec("d", "uint8", (2,))], 3)
    problems = base.same_tensors(other)
    assert len(problems) == 4
    text = "\n".join(problems)
    assert "'a'" in text and "float64" in text
    assert "(3,)" in text and "(3, 1)" in text
    assert "'c' is in the checkpoint but not in the model" in text
    assert "'d' is in the model but not in the checkpoint" in text


# ---------------------------------------------------------------------------------------
# Re-partitioning

REPARTITION_SPECS = [
    TensorSpec("rows", "float32", (37, 6)),        # split along axis 0
    TensorSpec("cols", "float64", (3, 29, 2)),     # split along axis 1
    TensorSpec("last", "int64", (2, 3, 17)),       # split along axis 2
    TensorSpec("narrow", "float32", (2, 1)),       # big enough to split, fewer rows than ranks
    TensorSpec("bias", "float32", (5,)),           # small: whole on one rank
    TensorSpec("table", "uint8", (4, 3)),          # small: whole
    TensorSpec("step", "int64", ()),               # 0-d: whole
]
THRESHOLD = 8


def _old_shards(arrays, layout):
    """Each old rank's stored pieces as raw bytes, as they would be in its shard file."""
    return {(t.name, rank): extract_piece(arrays[t.name], t, rank).tobytes()
            for t in layout.tensors for rank in range(layout.world_size)}


def _rebuild_new_pieces(arrays, old, new, new_rank):
    stored = _old_shards(arrays, old)
    requests = read_requests(old, new, new_rank)
    pieces = {t.name: np.zeros(t.piece_shape(new_rank), dtype=t.spec.dtype)
              for t in new.rank_pieces(new_rank)}
    for request in requests:
        data = request_payload(stored[(request.name, request.old_rank)], request, old)
        assert len(data) == request.nbytes
        place_read(pieces[request.name], request, data, old, new, new_rank)
    return requests, pieces


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (4, 6), (3, 5), (1, 4), (6, 1), (2, 2), (5, 3)])
def test_repartition_reads_exactly_what_is_needed(old_world, new_world):
    rng = np.random.default_rng(old_world * 10 + new_world)
    arrays = {s.name: _random_array(s, rng) for s in REPARTITION_SPECS}
    old = plan_layout(REPARTITION_SPECS, old_world, split_threshold_bytes=THRESHOLD)
    new = plan_layout(REPARTITION_SPECS, new_world, split_threshold_bytes=THRESHOLD)
    assert {t.name: t.axis for t in old.tensors} == {t.name: t.axis for t in new.tensors}
    for new_rank in range(new_world):
        requests, pieces = _rebuild_new_pieces(arrays, old, new, new_rank)
        assert not any(r.box for r in requests)
        for t in new.tensors:
            expected = extract_piece(arrays[t.name], t, new_rank)
            if t.rows(new_rank):
                np.testing.assert_array_equal(pieces[t.name], expected)
            else:
                assert t.name not in pieces
        assert sum(r.nbytes for r in requests) == new.bytes_of_rank(new_rank)
        # Every destination row of every piece is written exactly once.
        for t in new.rank_pieces(new_rank):
            spans = sorted((r.dest_start, r.dest_stop) for r in requests if r.name == t.name)
            assert spans[0][0] == 0 and spans[-1][1] == t.rows(new_rank)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_repartition_whole_to_split_and_back():
    spec = [TensorSpec("w", "float32", (10, 3))]
    rng = np.random.default_rng(0)
    arrays = {"w": _random_array(spec[0], rng)}
    whole = plan_layout(spec, 3)  # below the default threshold: one owner
    split = plan_layout(spec, 4, split_threshold_bytes=0)
    for old, new in [(whole, split), (split, whole)]:
        for new_rank in range(new.world_size):
            requests, pieces = _rebuild_new_pieces(arrays, old, new, new_rank)
            t = new.tensor("w")
            if t.rows(new_rank):
                np.testing.assert_array_equal(pieces["w"], extract_piece(arrays["w"], t, new_rank))
            assert sum(r.nbytes for r in requests) == new.bytes_of_rank(new_rank)


def test_repartition_request_values():
    spec = [TensorSpec("w", "float32", (10, 3))]
    old = plan_layout(spec, 4, split_threshold_bytes=0)   # rows 0-3, 3-6, 6-8, 8-10
    new = plan_layout(spec, 2, split_threshold_bytes=0)   # rows 0-5, 5-10
    row = 3 * 4
    assert read_requests(old, new, 1) == [
        ReadRequest("w", 1, 2 * row, 1 * row, 0, 1),
        ReadRequest("w", 2, 0, 2 * row, 1, 3),
        ReadRequest("w", 3, 0, 2 * row, 3, 5),
    ]


def test_repartition_fallback_when_axes_differ():
    """A layout cut along another axis (e.g. written by other rules): the parts of the old
    pieces that the new piece overlaps travel as boxes, no more bytes than the new piece."""
    spec = TensorSpec("w", "int64", (4, 6))
    arrays = {"w": np.arange(24, dtype=np.int64).reshape(4, 6)}
    old = Layout(2, (TensorLayout(spec, 0, ((0, 2), (2, 4))),))
    new = plan_layout([spec], 3, split_threshold_bytes=0)
    assert new.tensor("w").axis == 1
    for new_rank in range(3):
        requests, pieces = _rebuild_new_pieces(arrays, old, new, new_rank)
        assert all(r.box is not None for r in requests)
        assert sum(r.nbytes for r in requests) == new.bytes_of_rank(new_rank)
        np.testing.assert_array_equal(pieces["w"], extract_piece(arrays["w"], new.tensor("w"), new_rank))


def test_repartition_rejects_different_tensors():
    old = plan_layout([TensorSpec("w", "float32", (4, 4))], 2)
    new = plan_layout([TensorSpec("w", "float32", (4, 5))], 2)
    with pytest.raises(IncompatibleCheckpointError, match="shape"):
        read_requests(old, new, 0)


def test_many_random_repartitions():
    rng = np.random.default_rng(7)
    for old_world, new_world in itertools.product([1, 2, 3, 5, 8], repeat=2):
        shapes = [tuple(int(d) for d in rng.integers(0, 12, size=rng.integers(0, 4))) for _ in range(5)]
        specs = _specs(shapes, prefix="r")
        arrays = {s.name: _random_array(s, rng) for s in specs}
        threshold = int(rng.integers(0, 200))
        old = plan_layout(specs, old_world, split_threshold_bytes=threshold)
        new = plan_layout(specs, new_world, split_threshold_bytes=int(rng.integers(0, 200)))
        for new_rank in range(new_world):
            requests, pieces = _rebuild_new_pieces(arrays, old, new, new_rank)
            assert sum(r.nbytes for r in requests) == new.bytes_of_rank(new_rank)
            for t in new.rank_pieces(new_rank):
                np.testing.assert_array_equal(pieces[t.name], extract_piece(arrays[t.name], t, new_rank))


@pytest.mark.parametrize("shape", [(700, 1300), (3, 4), (1200, 900, 2), (513, 257)])
def test_copy_strided_equals_copyto_for_transposed_views(shape):
    from hpcckpt.format.layout import copy_strided

    source = np.random.default_rng(1).random(shape).astype(np.float32)
    view = np.moveaxis(source, 1, 0)
    out = np.empty(view.shape, np.float32)
    copy_strided(out, view)
    assert np.array_equal(out, view)
    back = np.empty(shape, np.float32)
    copy_strided(back, np.moveaxis(out, 0, 1))
    assert np.array_equal(back, source)


def _bounds_before_27(specs, world_size, threshold):
    """plan_layout as it listed bounds per rank before layouts became rules (format 1)."""
    from hpcckpt.format.layout import _even_bounds, _split_axis

    out, load, whole = [None] * len(specs), [0] * world_size, []
    for index, spec in enumerate(specs):
        if spec.shape and spec.nbytes >= threshold:
            axis = _split_axis(spec.shape)
            bounds = _even_bounds(spec.shape[axis], world_size)
            out[index] = (axis, bounds)
            row = spec.nbytes // spec.shape[axis] if spec.shape[axis] else 0
            for rank, (start, stop) in enumerate(bounds):
                load[rank] += (stop - start) * row
        else:
            whole.append(index)
    for index in sorted(whole, key=lambda i: (-specs[i].nbytes, i)):
        spec = specs[index]
        owner = min(range(world_size), key=lambda rank: (load[rank], rank))
        axis = _split_axis(spec.shape)
        dim = spec.shape[axis] if spec.shape else 1
        out[index] = (axis, tuple((0, dim) if rank == owner else (0, 0) for rank in range(world_size)))
        load[owner] += spec.nbytes
    return out


def test_layout_rules_plan_and_read_back_what_format_1_listed():
    """The rule-based plan gives every rank the rows the bounds-listing plan gave it, and a
    format-1 record of it reads back as an equal layout (a restart compares the two)."""
    rng = np.random.default_rng(27)
    for world_size in (1, 2, 3, 5, 8, 13):
        for _ in range(20):
            specs = [TensorSpec(f"t{i}", rng.choice(["float32", "int8", "float64"]),
                                tuple(int(d) for d in rng.integers(0, 9, size=rng.integers(0, 4))))
                     for i in range(int(rng.integers(1, 12)))]
            threshold = int(rng.choice([0, 1, 16, 64, 1 << 20]))
            layout = plan_layout(specs, world_size, split_threshold_bytes=threshold)
            before = _bounds_before_27(specs, world_size, threshold)
            assert [(t.axis, t.bounds) for t in layout.tensors] == before
            format_1 = {"format": 1, "world_size": world_size, "tensors": [
                {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "axis": axis, "bounds": [list(b) for b in bounds]}
                for s, (axis, bounds) in zip(specs, before)]}
            assert Layout.from_dict(format_1) == layout
            assert Layout.from_json(layout.to_json()) == layout
            for t in layout.tensors:
                for start in range(t.dim + 1):
                    for stop in range(start + 1, t.dim + 1):
                        brute = [r for r, (s, e) in enumerate(t.bounds) if e > s and s < stop and e > start]
                        assert list(t.holders(start, stop)) == brute, (t, start, stop)


def test_a_layout_record_does_not_grow_with_the_rank_count():
    specs = [TensorSpec(f"block{i}.w", "float32", (4096, 1024)) for i in range(20)] + \
        [TensorSpec(f"block{i}.b", "float32", (1024,)) for i in range(20)]
    small, large = plan_layout(specs, 64).to_json(), plan_layout(specs, 16384).to_json()
    assert len(large) <= len(small) + 20 * 4  # owners' digits only
    explicit = {"format": 1, "world_size": 3, "tensors": [
        {"name": "w", "dtype": "float32", "shape": [6], "axis": 0, "bounds": [[0, 1], [1, 5], [5, 6]]}]}
    odd = Layout.from_dict(explicit)  # bounds no rule makes are kept as they are
    assert odd.tensor("w").cut == "explicit" and odd.tensor("w").bounds == ((0, 1), (1, 5), (5, 6))
    assert Layout.from_json(odd.to_json()) == odd


# ---------------------------------------------------------------------------------------
# Blocks of a global array (domain decompositions)

def _grid_boxes(shape, cuts_per_dim, rng, empty_ranks=0):
    """A decomposition into a grid of boxes with random cut points, in a random rank order,
    plus `empty_ranks` ranks holding nothing."""
    edges = []
    for dim, cuts in zip(shape, cuts_per_dim):
        inner = sorted(rng.choice(np.arange(1, dim), size=min(cuts - 1, dim - 1), replace=False).tolist()) if dim > 1 else []
        edges.append([0] + inner + [dim])
    boxes = [tuple(cell) for cell in itertools.product(*[list(zip(e[:-1], e[1:])) for e in edges])]
    boxes += [tuple((0, 0) for _ in shape)] * empty_ranks
    order = rng.permutation(len(boxes))
    return [boxes[i] for i in order]


def _block_pieces(array, layout):
    return {(t.name, r): extract_piece(array[t.name], t, r).tobytes()
            for t in layout.tensors for r in range(layout.world_size) if t.holds(r)}


def test_blocks_restore_onto_any_other_decomposition_byte_exact():
    rng = np.random.default_rng(23)
    spec = TensorSpec("grid", "float64", (13, 9, 4))
    arrays = {"grid": _random_array(spec, rng)}
    layouts = [Layout(len(b), (BlockLayout(spec, b),)) for b in
               (_grid_boxes(spec.shape, (2, 2, 1), rng), _grid_boxes(spec.shape, (3, 1, 1), rng, empty_ranks=1),
                _grid_boxes(spec.shape, (1, 2, 3), rng), _grid_boxes(spec.shape, (1, 1, 1), rng))]
    layouts += [plan_layout([spec], 5, split_threshold_bytes=0), plan_layout([spec], 2)]  # replicated, cut or whole
    for old, new in itertools.permutations(layouts, 2):
        if isinstance(old.tensor("grid"), BlockLayout):
            assert block_problems(spec, old.tensor("grid").boxes, False) == []
        stored = _block_pieces(arrays, old)
        for new_rank in range(new.world_size):
            t = new.tensor("grid")
            requests = read_requests(old, new, new_rank)
            assert sum(r.nbytes for r in requests) == new.bytes_of_rank(new_rank)
            if not t.holds(new_rank):
                assert requests == []
                continue
            piece = np.full(t.piece_shape(new_rank), np.nan)
            for request in requests:
                data = request_payload(stored[("grid", request.old_rank)], request, old)
                place_read(piece, request, data, old, new, new_rank)
            np.testing.assert_array_equal(piece, extract_piece(arrays["grid"], t, new_rank))


def test_a_block_layout_round_trips_through_json_and_checks_what_it_reads():
    spec = TensorSpec("u", "float32", (4, 6))
    layout = Layout(3, (BlockLayout(spec, [((0, 4), (0, 2)), ((0, 0), (0, 0)), ((0, 4), (2, 6))]),
                        BlockLayout(TensorSpec("v", "int8", (5,)), [((0, 2),), ((2, 3),), ((4, 5),)], gaps=True)))
    again = Layout.from_json(layout.to_json())
    assert again == layout and again.tensor("v").gaps
    assert [t.name for t in again.rank_pieces(1)] == ["v"] and again.bytes_of_rank(0) == 4 * 2 * 4 + 2
    broken = layout.to_dict()
    broken["tensors"][0]["blocks"][2] = [0, 4, 1, 6]  # overlaps rank 0's block
    with pytest.raises(FormatError, match="ranks 0 and 2 overlap in \\[0:4, 1:2\\]"):
        Layout.from_dict(broken)


@pytest.mark.parametrize("boxes, gaps, message", [
    ([((0, 3), (0, 4)), ((2, 5), (3, 8))], False, "ranks 0 and 1 overlap in [2:3, 3:4]"),
    ([((0, 3), (0, 8)), ((3, 5), (0, 7))], False, "cover 38 of the 40 elements"),
    ([((0, 3), (0, 8)), ((3, 6), (0, 8))], False, "rank 1's block [3:6, 0:8] is not inside the global shape (5, 8)"),
    ([((0, 3), (0, 8)), ((3, 5), (0, 7))], True, None),
    ([((0, 5), (0, 8)), ((2, 2), (0, 8))], False, None),  # an empty block overlaps nothing
])
def test_block_problems_name_what_is_wrong(boxes, gaps, message):
    problems = block_problems(TensorSpec("u", "float32", (5, 8)), boxes, gaps)
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and message in problems[0], problems


def test_overlaps_are_found_among_many_blocks():
    rng = np.random.default_rng(5)
    spec = TensorSpec("u", "float32", (64, 64))
    boxes = _grid_boxes(spec.shape, (16, 16), rng)
    assert block_problems(spec, boxes, False) == []
    (rows, (start, stop)) = boxes[100]
    boxes[100] = (rows, (start, stop + 1) if stop < 64 else (start - 1, stop))  # one column into a neighbour
    [problem] = block_problems(spec, boxes, False)
    assert re.search(r"ranks (100 and \d+|\d+ and 100) overlap in \[\d+:\d+, \d+:\d+\]", problem), problem
    assert block_problems(TensorSpec("s", "int8", ()), [()], False)[0].endswith("protect it as replicated")


def test_slabs_of_blocks_are_received_in_place():
    """A part that is contiguous in the new piece (whole rows of a slab) lands there
    directly; a column of a 2-D block cannot."""
    spec = TensorSpec("u", "int32", (6, 4))
    rows = Layout(2, (BlockLayout(spec, [((0, 3), (0, 4)), ((3, 6), (0, 4))]),))
    cols = Layout(2, (BlockLayout(spec, [((0, 6), (0, 2)), ((0, 6), (2, 4))]),))
    piece = np.zeros((3, 4), np.int32)
    [request] = read_requests(Layout(1, (BlockLayout(spec, [((0, 6), (0, 4))]),)), rows, 1)
    target = destination(piece, request, rows, 1)
    assert target is not None and np.shares_memory(target, piece) and target.size == request.nbytes
    assert all(destination(piece, r, rows, 0) is None for r in read_requests(cols, rows, 0))


def test_a_grid_of_blocks_is_stored_as_its_rule_whatever_the_rank_count():
    """A Cartesian decomposition (ranks in C order as MPI_Cart_create numbers them, or F
    order; ranks past the grid empty) is stored as its cut points, O(cuts), not O(ranks)."""
    import pickle

    spec = TensorSpec("u", "float32", (4096, 4096))
    edges = [sorted(set(np.linspace(0, 4096, 129, dtype=int).tolist())), list(range(0, 4097, 32))]
    for order in ("C", "F"):
        cells = list(np.ndindex(128, 128)) if order == "C" else [(i, j) for j in range(128) for i in range(128)]
        boxes = [((edges[0][i], edges[0][i + 1]), (edges[1][j], edges[1][j + 1])) for i, j in cells]
        layout = Layout(16384 + 3, (BlockLayout(spec, boxes + [((0, 0), (0, 0))] * 3),))
        text = layout.to_json()
        assert len(text) < 2000 and '"order":"%s"' % order in text
        again = Layout.from_json(text)
        assert again == layout and pickle.loads(pickle.dumps(layout.tensors[0])) == layout.tensors[0]
        assert again.tensor("u").box_of(129) == boxes[129] and not again.tensor("u").holds(16384)
    shuffled = list(reversed(boxes))  # a grid, but in no rule's order: listed
    listed = Layout(len(shuffled), (BlockLayout(spec, shuffled),))
    assert '"blocks"' in listed.to_json() and Layout.from_json(listed.to_json()) == listed
    too_big = json.loads(Layout(3, (BlockLayout(TensorSpec("v", "int8", (4,)), [((0, 2),), ((2, 4),), ((0, 0),)]),)
                                ).to_json())
    too_big["world_size"] = 1
    with pytest.raises(FormatError, match="2 cells for 1 ranks"):
        Layout.from_dict(too_big)
