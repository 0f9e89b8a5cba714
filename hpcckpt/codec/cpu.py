"""Systematic Reed-Solomon erasure code over GF(2^8), NumPy on the CPU.

    code = ErasureCode(k=4, m=2)
    parity = code.encode(data_blocks)                  # m arrays
    data = code.decode({0: d0, 2: d2, 4: p0, 5: p1}, block_len)
    lost = code.rebuild(available, wanted=[1, 5])      # {1: d1, 5: p1}

Block i is data block i for i < k and parity block i - k for i >= k; the bytes are those of
the code matrix [I_k; G] of `hpcckpt.codec.gf256` (row 0 all ones, row 1 = 0x8e^j, further
rows Cauchy-derived), so P_0 is the XOR of the data. Every output (parity or rebuilt block) is a linear combination
``out = sum_i c_i * S_i`` of source blocks, evaluated by one engine:

* each coefficient c is written in the basis 1, A, .., A^7 (A = 0x8e = 2^-1), and the sum
  is evaluated by Horner's rule over those 8 "bit levels":
  ``acc = A*acc ^ XOR{S_i : bit b of c_i}`` for b = 7..0; so the only multiply ever done is
  by A, five NumPy passes on uint64 words (SWAR, 8 bytes at a time):
  ``t = x & 0x0101..; x ^= t; x >>= 1; t *= 0x8e; x ^= t``. Encoding row 0 is then plain
  XOR and row 1 (coefficients A^j, single bits for j < 8) one multiply per data block;
* the work goes in cache-sized chunks (all sources and outputs of a chunk fit in L2), with
  one preallocated scratch buffer and ``out=`` everywhere: no temporaries;
* a block length that is not a multiple of 8 is handled by running the same program on a
  zero-padded copy of the last < 8 bytes.

Inputs are never written to. Single-threaded (NumPy ufuncs on integers).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Mapping, Sequence

import numpy as np

from hpcckpt.codec import gf256
from hpcckpt.errors import HpcckptError

__all__ = ["ErasureCode", "CodecError"]

_LSB = np.uint64(0x0101010101010101)
_A = np.uint64(gf256.ALPHA_INV)

# Bytes of source + output + scratch chunks that should stay in (a 1 MiB) L2 at once.
CACHE_BUDGET = 896 * 1024
MIN_CHUNK = 16 * 1024
MAX_CHUNK = 256 * 1024


class CodecError(HpcckptError, ValueError):
    """Blocks given to the erasure code are unusable (too few, wrong size or type)."""


# -- programs: coefficient vectors -> Horner levels -----------------------------------------


@lru_cache(maxsize=4096)
def _levels(coefs: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Source indices to XOR in at each Horner level, from the top bit down to bit 0."""
    betas = [gf256.ALPHA_COORDS[c] for c in coefs]
    top = max(betas).bit_length() - 1
    if top < 0:
        return ()
    return tuple(
        tuple(i for i, beta in enumerate(betas) if beta >> b & 1) for b in range(top, -1, -1)
    )


def _run(levels, srcs, out, t) -> None:
    """out = sum_i c_i * srcs[i] on uint64 views, Horner over the levels (see module doc).

    `out` and the scratch `t` have the length of every source; `out` aliases no source.
    """
    band, bxor, shr, mul = np.bitwise_and, np.bitwise_xor, np.right_shift, np.multiply
    ref = None  # the accumulator, while it is still equal to one source (not yet copied)
    state = 0  # 0: zero, 1: equals `ref`, 2: lives in `out`
    for depth, idxs in enumerate(levels):
        if depth and state:  # acc = A * acc
            x = ref if state == 1 else out
            band(x, _LSB, out=t)
            bxor(x, t, out=out)
            shr(out, 1, out=out)
            mul(t, _A, out=t)
            bxor(out, t, out=out)
            state = 2
        for i in idxs:
            if state == 0:
                ref, state = srcs[i], 1
            elif state == 1:
                bxor(ref, srcs[i], out=out)
                state = 2
            else:
                bxor(out, srcs[i], out=out)
    if state == 1:
        np.bitwise_or(ref, ref, out=out)  # a copy; much faster than np.copyto here
    elif state == 0:
        out.fill(0)


def _cost(levels) -> int:
    """NumPy passes per chunk of a program: 5 per multiply by A, 1 per XOR."""
    return 5 * max(len(levels) - 1, 0) + sum(len(idxs) for idxs in levels)


def _apply(coef_rows: Sequence[Sequence[int]], sources: Sequence[np.ndarray],
           outs: Sequence[np.ndarray]) -> None:
    """outs[o] = sum_i coef_rows[o][i] * X[i], bytewise over GF(2^8), where X is
    sources followed by outs: output o may use outputs before it (computed first).

    All arrays are 1-D uint8 of one length; outs alias no source.
    """
    if not outs:
        return
    n = outs[0].shape[0]
    programs = [_levels(tuple(int(c) for c in row)) for row in coef_rows]
    ns = len(sources)
    for o, row in enumerate(coef_rows):
        if any(row[ns + o:]):
            raise ValueError(f"output {o} may only use sources and earlier outputs")
    n8 = n - n % 8
    if n8:
        src64 = [s[:n8].view(np.uint64) for s in sources]
        out64 = [o[:n8].view(np.uint64) for o in outs]
        words = n8 // 8
        narrays = len(sources) + len(outs) + 1
        chunk = max(MIN_CHUNK, min(MAX_CHUNK, CACHE_BUDGET // narrays)) // 8
        chunk = min(chunk, words)
        scratch = np.empty(chunk, dtype=np.uint64)
        for lo in range(0, words, chunk):
            hi = min(lo + chunk, words)
            t = scratch[: hi - lo]
            x = [a[lo:hi] for a in src64] + [o[lo:hi] for o in out64]
            for o, prog in enumerate(programs):
                _run(prog, x, x[ns + o], t)
    if n8 < n:  # the last n % 8 bytes, zero-padded to one word
        rem = n - n8
        x = []
        for a in sources:
            p = np.zeros(8, dtype=np.uint8)
            p[:rem] = a[n8:]
            x.append(p.view(np.uint64))
        x += [np.zeros(1, dtype=np.uint64) for _ in outs]
        t = np.empty(1, dtype=np.uint64)
        for o, prog in enumerate(programs):
            _run(prog, x, x[ns + o], t)
            outs[o][n8:] = x[ns + o].view(np.uint8)[:rem]


# -- argument checking ----------------------------------------------------------------------


def _as_bytes(block, what: str) -> np.ndarray:
    """A 1-D uint8 view of `block` (any C-contiguous array or bytes-like object); no copy
    unless the array is not contiguous."""
    if isinstance(block, np.ndarray):
        a = block
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if a.dtype != np.uint8:
            a = a.reshape(-1).view(np.uint8)
        return a.reshape(-1)
    if hasattr(block, "__cuda_array_interface__"):
        raise CodecError(f"{what} is a GPU array; use hpcckpt.codec.gpu for device arrays")
    try:
        return np.frombuffer(block, dtype=np.uint8)
    except TypeError:
        raise CodecError(f"{what} is a {type(block).__name__}, not an array of bytes") from None


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class ErasureCode:
    """Systematic (k + m, k) Reed-Solomon code over GF(2^8): any k of the k + m blocks
    give back the k data blocks. Block i < k is data block i, block k + r is parity r."""

    def __init__(self, k: int, m: int):
        gf256.check_supported(k, m)
        self.k = int(k)
        self.m = int(m)
        self.generator = gf256.generator_matrix(self.k, self.m)  # m x k, row 0 all ones

    def __repr__(self) -> str:
        return f"ErasureCode(k={self.k}, m={self.m})"

    @property
    def n(self) -> int:
        return self.k + self.m

    def row(self, index: int) -> list[int]:
        """Row `index` of the code matrix [I_k; G]: block `index` = sum_j row[j] * D_j."""
        if index < self.k:
            return [int(j == index) for j in range(self.k)]
        return list(self.generator[index - self.k])

    # -- encode ---------------------------------------------------------------------------

    def encode(self, data_blocks: Sequence, out: Sequence[np.ndarray] | None = None
               ) -> list[np.ndarray]:
        """The m parity blocks of k equal-length data blocks (uint8 arrays or bytes-like).

        `out`: optional m preallocated, writable, C-contiguous uint8 arrays of the block
        length that receive the parity (and are returned).
        """
        data = self._check_data(data_blocks)
        n = data[0].shape[0] if data else 0
        outs = self._check_out(out, n, data)
        _apply(self.generator, data, outs)
        return list(outs)

    # -- decode / rebuild -----------------------------------------------------------------

    def decode(self, available: Mapping[int, np.ndarray], block_len: int) -> list[np.ndarray]:
        """The k data blocks from any k of the k + m blocks ({block index: bytes}).

        Data blocks that were given come back as read-only views of the inputs (no copy);
        lost ones are new arrays. Raises CodecError (a ValueError) if fewer than k distinct
        blocks are given or a block has the wrong length.
        """
        blocks = self._check_available(available, block_len)
        out = self.rebuild(blocks, [i for i in range(self.k) if i not in blocks])
        return [_readonly(blocks[i]) if i in blocks else out[i] for i in range(self.k)]

    def rebuild(self, available: Mapping[int, np.ndarray], wanted: Iterable[int]
                ) -> dict[int, np.ndarray]:
        """Blocks `wanted` (data or parity indices) from any k of the k + m blocks.

        A wanted block that is among the available ones comes back as a read-only view.
        """
        wanted = list(dict.fromkeys(int(w) for w in wanted))
        for w in wanted:
            if not 0 <= w < self.n:
                raise CodecError(f"wanted block {w} is out of range 0..{self.n - 1} for {self!r}")
        first = next((b for b in available.values() if b is not None), None)
        if first is None:
            raise CodecError(self._too_few(0))
        blocks = self._check_available(available, _as_bytes(first, "block").shape[0])
        result = {w: _readonly(blocks[w]) for w in wanted if w in blocks}
        todo = [w for w in wanted if w not in blocks]
        if not todo:
            return result
        src_ids, order, rows = self._plan(sorted(blocks), todo, chain=True)
        n = blocks[src_ids[0]].shape[0]
        outs = [np.empty(n, dtype=np.uint8) for _ in order]
        _apply(rows, [blocks[i] for i in src_ids], outs)
        result.update(zip(order, outs))
        return {w: result[w] for w in wanted}

    def decode_matrix(self, available_ids: Sequence[int], wanted: Sequence[int]
                      ) -> tuple[list[int], list[list[int]]]:
        """(source block ids, coefficient rows): wanted[o] = sum_i rows[o][i] * block src[i].

        The same coefficients drive the GPU path (`hpcckpt.codec.gpu.gpu_apply`)."""
        ids = sorted(set(int(i) for i in available_ids))
        if len(ids) < self.k:
            raise CodecError(self._too_few(len(ids)))
        src_ids, order, rows = self._plan(ids, list(wanted), chain=False)
        # Without chaining no row uses a computed block, so the columns past the k sources
        # are zero: drop them (gpu_apply wants one coefficient per source), in wanted order.
        by_block = {w: row[:len(src_ids)] for w, row in zip(order, rows)}
        return src_ids, [by_block[int(w)] for w in wanted]

    # -- internals ------------------------------------------------------------------------

    def _plan(self, ids: Sequence[int], wanted: Sequence[int], chain: bool):
        """Pick k sources (present data first, then the cheapest parity rows) and express
        every wanted block as a linear combination of them.

        With L the lost data indices and R the |L| parity rows used, D_L = A^-1 (P_R + G[R, ~L]
        D_~L) where A = G[R, L], an |L| x |L| submatrix of G (invertible: the code is MDS).
        Returns (source ids, wanted ids in computing order, coefficient rows). With `chain`,
        a row may also use blocks computed before it (coefficients after the k sources):
        e.g. the last lost data block is then the XOR of P_0 and all the others, and a lost
        parity block is re-encoded from the data when that is cheaper.
        """
        k = self.k
        present = [i for i in ids if i < k]
        lost = [j for j in range(k) if j not in set(present)]
        parity_rows = [i - k for i in ids if i >= k][: len(lost)]
        if len(present) + len(parity_rows) < k:
            raise CodecError(self._too_few(len(ids)))
        src_ids = present + [k + r for r in parity_rows]
        pos = {b: s for s, b in enumerate(src_ids)}
        g = self.generator
        # every data block j as a coefficient vector over the k sources
        data_vec: dict[int, list[int]] = {j: [int(s == pos[j]) for s in range(k)] for j in present}
        if lost:
            ainv = gf256.mat_inv([[g[r][l] for l in lost] for r in parity_rows])
            for a, l in enumerate(lost):
                v = [0] * k
                for i, r in enumerate(parity_rows):
                    c = ainv[a][i]
                    v[pos[k + r]] ^= c
                    for j in present:
                        v[pos[j]] ^= gf256.gf_mul(c, g[r][j])
                data_vec[l] = v

        def composed(w: int) -> list[int]:
            coef = [0] * k
            for j, e in enumerate(self.row(w)):
                if e:
                    for s, c in enumerate(data_vec[j]):
                        if c:
                            coef[s] ^= gf256.gf_mul(e, c)
            return coef

        # computing order: lost data first (so later rows can use them), then parity
        order = [w for w in wanted if w < k] + [w for w in wanted if w >= k]
        rows: list[list[int]] = []
        width = k + len(order)
        slot = {}  # block id -> column in the extended source list
        slot.update(pos)
        for o, w in enumerate(order):
            row = composed(w) + [0] * len(order)
            if chain:
                alt = self._chained(w, o, order, slot, width)
                if alt is not None and _cost(_levels(tuple(alt))) < _cost(_levels(tuple(row))):
                    row = alt
            rows.append(row)
            slot[w] = k + o
        if chain and len(order) > 1 and k in pos:
            # the last lost data block computed is cheaper as P_0 ^ (all other data)
            data_out = [o for o, w in enumerate(order) if w < k]
            if data_out and all(j in slot for j in range(k)):
                last = data_out[-1]
                w = order[last]
                alt = [0] * width
                alt[pos[k]] = 1
                for j in range(k):
                    if j != w:
                        alt[slot[j]] = 1
                if all(slot[j] < k + last for j in range(k) if j != w):
                    if _cost(_levels(tuple(alt))) < _cost(_levels(tuple(rows[last]))):
                        rows[last] = alt
        return src_ids, order, rows

    def _chained(self, w: int, o: int, order, slot, width):
        """Parity block w re-encoded from data blocks that are sources or earlier outputs."""
        if w < self.k or not all(j in slot for j in range(self.k)):
            return None
        alt = [0] * width
        for j, e in enumerate(self.row(w)):
            alt[slot[j]] ^= e
        return alt

    def _too_few(self, got: int) -> str:
        return (f"{self!r} cannot recover: {got} distinct block(s) available, at least "
                f"{self.k} of the {self.n} are needed (at most {self.m} may be lost)")

    def _check_data(self, data_blocks) -> list[np.ndarray]:
        data = [_as_bytes(b, f"data block {i}") for i, b in enumerate(data_blocks)]
        if len(data) != self.k:
            raise CodecError(f"{self!r}.encode needs {self.k} data blocks, got {len(data)}")
        lengths = {d.shape[0] for d in data}
        if len(lengths) > 1:
            raise CodecError(f"data blocks must have equal lengths, got {sorted(lengths)}")
        return data

    def _check_out(self, out, n: int, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        if out is None:
            return [np.empty(n, dtype=np.uint8) for _ in range(self.m)]
        out = list(out)
        if len(out) != self.m:
            raise CodecError(f"out= needs {self.m} parity buffers, got {len(out)}")
        for r, o in enumerate(out):
            if not (isinstance(o, np.ndarray) and o.dtype == np.uint8 and o.ndim == 1
                    and o.flags.c_contiguous and o.flags.writeable and o.shape[0] == n):
                raise CodecError(f"out[{r}] must be a writable contiguous 1-D uint8 array of "
                                 f"length {n}")
            if any(np.may_share_memory(o, d) for d in data) or any(
                    np.may_share_memory(o, p) for p in out[:r]):
                raise CodecError(f"out[{r}] overlaps a data block or another parity buffer")
        return out

    def _check_available(self, available: Mapping[int, np.ndarray], block_len: int
                         ) -> dict[int, np.ndarray]:
        if block_len < 0:
            raise CodecError(f"block_len must be >= 0, got {block_len}")
        blocks = {}
        for idx, b in available.items():
            i = int(idx)
            if not 0 <= i < self.n:
                raise CodecError(f"block index {idx} is out of range 0..{self.n - 1} for {self!r}")
            if b is None:
                continue
            a = _as_bytes(b, f"block {i}")
            if a.shape[0] != block_len:
                raise CodecError(f"block {i} has {a.shape[0]} bytes, expected {block_len}")
            blocks[i] = a
        if len(blocks) < self.k:
            raise CodecError(self._too_few(len(blocks)))
        return blocks
