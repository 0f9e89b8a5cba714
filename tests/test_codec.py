"""Reed-Solomon codec: field arithmetic against reedsolo, parity bytes against a per-byte
reference, every loss pattern up to m for several (k, m), odd lengths, zfec as a baseline,
and the GPU kernel against the CPU bytes when a GPU is present."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpcckpt.codec import CodecError, ErasureCode, gf256

reedsolo = pytest.importorskip("reedsolo")
reedsolo.init_tables(0x11D)  # prim=0x11d, generator=2, c_exp=8 (reedsolo 1.7's defaults)

CODES = [(2, 1), (2, 2), (3, 2), (4, 2), (6, 3), (8, 4), (5, 1)]
LENGTHS = [1, 7, 13, 65537]


def _blocks(k: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]


# -- field -----------------------------------------------------------------------------------


def test_mul_and_inverse_match_reedsolo():
    for a in range(256):
        for b in range(256):
            assert gf256.gf_mul(a, b) == reedsolo.gf_mul(a, b)
    np.testing.assert_array_equal(
        gf256.MUL_TABLE, [[reedsolo.gf_mul(a, b) for b in range(256)] for a in range(256)])
    for a in range(1, 256):
        assert gf256.gf_inv(a) == reedsolo.gf_inverse(a)
        assert gf256.gf_mul(a, gf256.gf_inv(a)) == 1
    with pytest.raises(ZeroDivisionError):
        gf256.gf_inv(0)


def test_mul_random_bytes_against_reedsolo():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 5000)
    b = rng.integers(0, 256, 5000)
    got = gf256.MUL_TABLE[a, b]
    want = [reedsolo.gf_mul(int(x), int(y)) for x, y in zip(a, b)]
    np.testing.assert_array_equal(got, want)
    c = 0x8E
    np.testing.assert_array_equal(gf256.gf_mul_bytes(c, a.astype(np.uint8)),
                                  [reedsolo.gf_mul(c, int(x)) for x in a])


def test_matrix_inverse_and_alpha_coordinates():
    rng = np.random.default_rng(2)
    for n in range(1, 6):
        for _ in range(20):
            a = rng.integers(0, 256, (n, n)).tolist()
            if not gf256.is_invertible(a):
                with pytest.raises(ValueError):
                    gf256.mat_inv(a)
                continue
            ident = [[int(i == j) for j in range(n)] for i in range(n)]
            assert gf256.mat_mul(a, gf256.mat_inv(a)) == ident
    # coefficients in the basis 1, A, .., A^7 (A = 0x8e) that the CPU engine uses
    for c in range(256):
        v = 0
        for b in range(8):
            if gf256.ALPHA_COORDS[c] >> b & 1:
                v ^= gf256.gf_pow(0x8E, b)
        assert v == c


# -- generator matrix ----------------------------------------------------------------------


@pytest.mark.parametrize("k,m", CODES + [(10, 6), (16, 4), (6, 8)])
def test_generator_is_mds_and_structured(k, m):
    g = gf256.generator_matrix(k, m)
    assert gf256.is_mds(g)  # every square submatrix invertible
    assert g[0] == [1] * k  # P_0 = XOR
    if m > 1:
        assert g[1] == [reedsolo.gf_pow(0x8E, j) for j in range(k)]
    assert all(row[0] == 1 for row in g)
    # rows do not depend on m or k
    assert gf256.generator_matrix(k + 1, m + 1)[m][:k] == gf256.generator_row(m, k)
    assert [row[:k] for row in gf256.generator_matrix(k + 3, m)] == g


def test_generator_limits():
    gf256.generator_matrix(250, 6)
    gf256.generator_matrix(255, 1)
    for k, m in [(251, 6), (0, 2), (3, 0)]:
        with pytest.raises(ValueError):
            ErasureCode(k, m)


# -- encode ----------------------------------------------------------------------------------


def _reference_parity(g, data):
    """Per byte with reedsolo's gf_mul: P_r[i] = XOR_j g[r][j] * D_j[i]."""
    out = []
    for row in g:
        p = bytearray(len(data[0]))
        for c, d in zip(row, data):
            for i, x in enumerate(d.tolist()):
                p[i] ^= reedsolo.gf_mul(c, x)
        out.append(np.frombuffer(bytes(p), dtype=np.uint8))
    return out


@pytest.mark.parametrize("k,m", CODES)
def test_encode_matches_per_byte_reference(k, m):
    code = ErasureCode(k, m)
    for n in (1, 7, 8, 13, 130):
        data = _blocks(k, n, seed=n)
        parity = code.encode(data)
        assert len(parity) == m
        for got, want in zip(parity, _reference_parity(code.generator, data)):
            np.testing.assert_array_equal(got, want)
    # P_0 is plain XOR
    data = _blocks(k, 4097, seed=9)
    np.testing.assert_array_equal(code.encode(data)[0], np.bitwise_xor.reduce(data))


def test_encode_large_block_crosses_chunks():
    code = ErasureCode(4, 3)
    data = _blocks(4, (3 << 20) + 5, seed=3)
    parity = code.encode(data)
    # spot check a few offsets, including both sides of chunk boundaries and the tail
    idx = np.array([0, 1, 65535, 65536, 131071, 131072, 1 << 20, (3 << 20) - 1, (3 << 20) + 4])
    for r in range(3):
        want = np.zeros(idx.size, dtype=np.uint8)
        for j in range(4):
            want ^= gf256.MUL_TABLE[code.generator[r][j]][data[j][idx]]
        np.testing.assert_array_equal(parity[r][idx], want)


def test_encode_out_and_input_kinds():
    code = ErasureCode(3, 2)
    data = _blocks(3, 1001, seed=4)
    want = code.encode(data)
    out = [np.empty(1001, np.uint8) for _ in range(2)]
    got = code.encode(data, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # bytes-like and non-uint8 contiguous arrays are encoded as their bytes
    np.testing.assert_array_equal(code.encode([bytes(d) for d in data])[1], want[1])
    floats = [np.frombuffer(d[:1000].tobytes(), dtype=np.float32).reshape(10, 25) for d in data]
    np.testing.assert_array_equal(code.encode(floats)[1], code.encode([d[:1000] for d in data])[1])
    with pytest.raises(CodecError, match="out"):
        code.encode(data, out=[np.empty(1000, np.uint8)] * 2)
    with pytest.raises(CodecError, match="overlaps"):
        code.encode(data, out=[data[0], np.empty(1001, np.uint8)])
    with pytest.raises(CodecError, match="3 data blocks"):
        code.encode(data[:2])
    with pytest.raises(CodecError, match="equal lengths"):
        code.encode([data[0], data[1], data[2][:5]])
    assert [p.size for p in code.encode([np.empty(0, np.uint8)] * 3)] == [0, 0]


# -- decode / rebuild: every loss pattern ------------------------------------------------------


@pytest.mark.parametrize("k,m", CODES)
def test_every_loss_pattern(k, m):
    code = ErasureCode(k, m)
    for n in LENGTHS:
        data = _blocks(k, n, seed=k * 100 + m * 10 + n)
        blocks = data + code.encode(data)
        for ro in blocks:
            ro.flags.writeable = False  # any write to an input would raise
        copies = [b.copy() for b in blocks]
        for e in range(m + 1):
            for lost in itertools.combinations(range(k + m), e):
                avail = {i: b for i, b in enumerate(blocks) if i not in lost}
                got = code.decode(avail, n)
                assert len(got) == k
                for a, b in zip(got, data):
                    np.testing.assert_array_equal(a, b)
                if lost:
                    rebuilt = code.rebuild(avail, lost)
                    assert sorted(rebuilt) == sorted(lost)
                    for i in lost:
                        np.testing.assert_array_equal(rebuilt[i], blocks[i])
        for lost in itertools.combinations(range(k + m), m + 1):
            avail = {i: b for i, b in enumerate(blocks) if i not in lost}
            with pytest.raises(ValueError, match=f"at least {k} of the {k + m}"):
                code.decode(avail, n)
            with pytest.raises(CodecError):
                code.rebuild(avail, lost)
        for a, b in zip(blocks, copies):
            np.testing.assert_array_equal(a, b)


def test_decode_returns_views_and_new_arrays():
    code = ErasureCode(4, 2)
    data = _blocks(4, 100, seed=6)
    blocks = data + code.encode(data)
    got = code.decode({0: blocks[0], 2: blocks[2], 4: blocks[4], 5: blocks[5]}, 100)
    assert np.shares_memory(got[0], blocks[0]) and not got[0].flags.writeable
    assert not np.shares_memory(got[1], blocks[4]) and got[1].flags.writeable
    # rebuild of a block that is available returns it; parity and data mixed, any order
    r = code.rebuild({i: blocks[i] for i in (1, 2, 3, 5)}, [5, 4, 0])
    assert list(r) == [5, 4, 0]
    for i in (5, 4, 0):
        np.testing.assert_array_equal(r[i], blocks[i])
    # extra blocks (more than k) are fine; None entries count as missing
    avail = {i: b for i, b in enumerate(blocks)}
    avail[1] = None
    np.testing.assert_array_equal(code.decode(avail, 100)[1], data[1])


def test_decode_errors_are_clear():
    code = ErasureCode(3, 2)
    data = _blocks(3, 50, seed=7)
    blocks = data + code.encode(data)
    with pytest.raises(CodecError, match="block 4 has 49 bytes, expected 50"):
        code.decode({0: blocks[0], 1: blocks[1], 4: blocks[4][:49]}, 50)
    with pytest.raises(CodecError, match="out of range"):
        code.decode({0: blocks[0], 1: blocks[1], 7: blocks[4]}, 50)
    with pytest.raises(CodecError, match="out of range"):
        code.rebuild({0: blocks[0], 1: blocks[1], 2: blocks[2]}, [5])
    with pytest.raises(ValueError, match="2 distinct block"):
        code.decode({0: blocks[0], 4: blocks[4]}, 50)
    with pytest.raises(CodecError, match="0 distinct block"):
        code.rebuild({0: None}, [1])
    with pytest.raises(CodecError, match="0 distinct block"):
        code.decode({}, 50)


def test_decode_matrix_rows_give_the_lost_blocks():
    code = ErasureCode(6, 3)
    data = _blocks(6, 300, seed=8)
    blocks = data + code.encode(data)
    wanted = [6, 1, 4, 5]  # a parity block first: rows come back in the order asked for
    src, rows = code.decode_matrix([0, 2, 3, 6, 7, 8], wanted)
    assert all(len(row) == len(src) for row in rows)  # one coefficient per source
    for w, row in zip(wanted, rows):
        acc = np.zeros(300, np.uint8)
        for s, c in zip(src, row):
            acc ^= gf256.MUL_TABLE[c][blocks[s]]
        np.testing.assert_array_equal(acc, blocks[w])


# -- zfec as a baseline ----------------------------------------------------------------------


def test_zfec_baseline_k4_m2():
    zfec = pytest.importorskip("zfec")
    k, m, n = 4, 2, 65536 + 3
    data = _blocks(k, n, seed=11)
    code = ErasureCode(k, m)
    ours = data + code.encode(data)
    theirs = [bytes(d) for d in data] + [bytes(p) for p in zfec.Encoder(k, k + m).encode(
        [bytes(d) for d in data], list(range(k, k + m)))]
    dec = zfec.Decoder(k, k + m)
    for lost in itertools.combinations(range(k + m), m):
        keep = [i for i in range(k + m) if i not in lost]
        # zfec 1.6 overwrites inputs unless each kept primary block sits at its own index:
        # hand it fresh copies, ordered primary-first
        order = sorted(keep, key=lambda i: (i >= k, i))[:k]
        z = dec.decode([bytes(theirs[i]) for i in order], order)
        got = code.decode({i: ours[i] for i in keep}, n)
        for a, b, d in zip(z, got, data):
            assert bytes(a) == d.tobytes()
            np.testing.assert_array_equal(b, d)


# -- GPU -------------------------------------------------------------------------------------


def _gpu_or_skip():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError
        return cupy
    except Exception:
        pytest.skip("no GPU")


@pytest.mark.parametrize("k,m", [(2, 1), (4, 2), (6, 3), (8, 4)])
@pytest.mark.parametrize("n", [1, 13, 4096, (1 << 20) + 7])
def test_gpu_encode_matches_cpu(k, m, n):
    cupy = _gpu_or_skip()
    from hpcckpt.codec.gpu import gpu_apply, gpu_encode

    code = ErasureCode(k, m)
    data = _blocks(k, n, seed=n + k)
    want = code.encode(data)
    got = gpu_encode([cupy.asarray(d) for d in data], k, m)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)
    # unaligned views take the byte path
    if n > 16:
        got = gpu_encode([cupy.asarray(d)[1:] for d in data], k, m)
        for a, b in zip(got, code.encode([d[1:] for d in data])):
            np.testing.assert_array_equal(cupy.asnumpy(a), b)
    # decoding rows on the GPU
    blocks = data + want
    lost = list(range(min(m, k)))
    src, rows = code.decode_matrix([i for i in range(k + m) if i not in lost], lost)
    got = gpu_apply(rows, [cupy.asarray(blocks[i]) for i in src])
    for i, a in zip(lost, got):
        np.testing.assert_array_equal(cupy.asnumpy(a), data[i])
