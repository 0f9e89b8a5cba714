"""Arithmetic in GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d), and the
generator matrix of hpcckpt's systematic Reed-Solomon code.

The code
--------
k data blocks D_0..D_{k-1} and m parity blocks P_0..P_{m-1}, all of the same length. Every
parity byte is a GF(2^8) linear combination of the data bytes at the same offset:

    P_r[i] = sum_j  G[r][j] * D_j[i]          (sum = XOR, * = GF(2^8) multiply)

and the full code matrix is [I_k ; G] (block i < k is D_i, block k + r is P_r). With
A = 2^-1 = 0x8e:

    G[0][j] = 1                                    P_0 = XOR of the data (RAID-5 "P")
    G[1][j] = A^j                                  RAID-6 style "Q", generator 2^-1
    G[r][j] = y_j (x_r + y_0) / ((x_r + y_j) y_0)  r >= 2

where y_j = u_j / (1 + u_j), u_j = A^(j+1), and x_0 = 0, x_1 = 1, x_r = y_(255-r) (r >= 2).
All three lines are one formula: G is the Cauchy matrix C[r][j] = 1 / (x_r + y_j) with
row r scaled by (x_r + y_0) / (x_0 + y_0) and column j by (x_0 + y_j), which makes row 0
and column 0 all ones; for x_1 = 1 the y_j above make row 1 exactly A^j. The x's and y's
are distinct for k + m <= 256, every square submatrix of a Cauchy matrix is invertible and
nonzero row/column scaling keeps it so: any k of the k + m blocks determine the data (MDS)
for every k + m <= 256. Rows do not depend on k or m (the m = 2 code is the first two rows
of the m = 3 code), and `is_mds` checks the property exhaustively for small (k, m).

Why 2^-1 rather than 2 in row 1: multiplying a whole buffer by A in a 64-bit SWAR form takes
five NumPy passes (t = x & 0x0101..; x ^= t; x >>= 1; t *= 0x8e; x ^= t) against six for a
multiply by 2 (the high bit needs an extra shift down); the CPU codec evaluates every row by
Horner's rule in A (cpu.py), which made encoding ~12% faster when measured. A is primitive,
so nothing else changes. (The plain Vandermonde choice G[r][j] = A^(r*j) is MDS only for
m <= 3; already (k=22, m=4) and (k=6, m=5) fail.)
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

PRIMITIVE_POLY = 0x11D
ALPHA_INV = 0x8E  # 2^-1: the generator whose powers fill the parity rows

# -- tables -----------------------------------------------------------------------------

_exp = [0] * 512
_log = [0] * 256
_x = 1
for _i in range(255):
    _exp[_i] = _x
    _log[_x] = _i
    _x <<= 1
    if _x & 0x100:
        _x ^= PRIMITIVE_POLY
for _i in range(255, 512):
    _exp[_i] = _exp[_i - 255]
del _x, _i

EXP: tuple[int, ...] = tuple(_exp)  # EXP[i] = 2^i, i in 0..511 (doubled to skip a mod)
LOG: tuple[int, ...] = tuple(_log)  # LOG[x] for x in 1..255; LOG[0] is meaningless (0)
EXP_TABLE = np.array(_exp, dtype=np.uint8)
LOG_TABLE = np.array(_log, dtype=np.uint8)


def gf_mul(a: int, b: int) -> int:
    """a * b in GF(2^8)."""
    if a == 0 or b == 0:
        return 0
    return EXP[LOG[a] + LOG[b]]


def gf_inv(a: int) -> int:
    """1 / a in GF(2^8); ZeroDivisionError for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return EXP[255 - LOG[a]]


def gf_div(a: int, b: int) -> int:
    return gf_mul(a, gf_inv(b))


def gf_pow(a: int, n: int) -> int:
    """a ** n for any integer n (negative n means powers of the inverse)."""
    if a == 0:
        if n == 0:
            return 1
        if n < 0:
            raise ZeroDivisionError("0 has no inverse in GF(2^8)")
        return 0
    return EXP[(LOG[a] * n) % 255]


def _mul_table() -> np.ndarray:
    a = np.arange(256)
    la = np.array(_log)[a]
    t = np.array(_exp, dtype=np.uint8)[(la[:, None] + la[None, :])]
    t[0, :] = 0
    t[:, 0] = 0
    return t


MUL_TABLE: np.ndarray = _mul_table()  # MUL_TABLE[a, b] = a * b; 64 KiB uint8
MUL_TABLE.setflags(write=False)


def gf_mul_bytes(c: int, data: np.ndarray) -> np.ndarray:
    """c * data, byte by byte, by table lookup (a slow, obvious reference)."""
    return MUL_TABLE[c][np.asarray(data, dtype=np.uint8)]


# -- coordinates in the basis 1, A, A^2, .., A^7 ------------------------------------------


def _alpha_basis_coords() -> tuple[int, ...]:
    """coords[c] = bitmask beta with c = XOR of A^b over the bits b set in beta.

    A = 0x8e is primitive, so 1, A, .., A^7 are a basis of GF(2^8) over GF(2). The CPU
    codec multiplies a buffer by a constant c with Horner's rule in A over these bits, so
    it only ever needs the SWAR multiply-by-A.
    """
    powers = [gf_pow(ALPHA_INV, b) for b in range(8)]
    coords = [-1] * 256
    for beta in range(256):
        v = 0
        for b in range(8):
            if beta >> b & 1:
                v ^= powers[b]
        coords[v] = beta
    assert min(coords) >= 0
    return tuple(coords)


ALPHA_COORDS: tuple[int, ...] = _alpha_basis_coords()


# -- matrices (lists of lists of ints) ---------------------------------------------------

Matrix = list[list[int]]


def mat_mul(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> Matrix:
    n, p = len(a), len(b[0]) if b else 0
    if a and len(a[0]) != len(b):
        raise ValueError(f"shape mismatch: {len(a)}x{len(a[0])} @ {len(b)}x{p}")
    out = [[0] * p for _ in range(n)]
    for i in range(n):
        for t, ait in enumerate(a[i]):
            if ait:
                row = b[t]
                for j in range(p):
                    out[i][j] ^= gf_mul(ait, row[j])
    return out


def mat_inv(a: Sequence[Sequence[int]]) -> Matrix:
    """Inverse of a square matrix over GF(2^8) (Gauss-Jordan); ValueError if singular."""
    n = len(a)
    if any(len(row) != n for row in a):
        raise ValueError("mat_inv needs a square matrix")
    w = [list(row) + [int(i == j) for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        piv = next((r for r in range(col, n) if w[r][col]), None)
        if piv is None:
            raise ValueError("matrix is singular over GF(2^8)")
        w[col], w[piv] = w[piv], w[col]
        inv = gf_inv(w[col][col])
        w[col] = [gf_mul(inv, v) for v in w[col]]
        for r in range(n):
            f = w[r][col]
            if r != col and f:
                pr = w[col]
                w[r] = [v ^ gf_mul(f, pv) for v, pv in zip(w[r], pr)]
    return [row[n:] for row in w]


def is_invertible(a: Sequence[Sequence[int]]) -> bool:
    """Whether a square matrix over GF(2^8) is nonsingular (elimination, no inverse built)."""
    w = [list(row) for row in a]
    n = len(w)
    for col in range(n):
        piv = next((r for r in range(col, n) if w[r][col]), None)
        if piv is None:
            return False
        w[col], w[piv] = w[piv], w[col]
        lp = LOG[w[col][col]]
        for r in range(col + 1, n):
            f = w[r][col]
            if f:
                s = (LOG[f] - lp) % 255  # row_r -= (f / pivot) * row_col
                w[r] = [v ^ (EXP[LOG[pv] + s] if pv else 0) for v, pv in zip(w[r], w[col])]
    return True


# -- the generator matrix ------------------------------------------------------------------

MAX_K_M = 256  # k + m: the Cauchy points x_r, y_j must be distinct elements of GF(2^8)


def _cauchy_y(j: int) -> int:
    u = gf_pow(ALPHA_INV, j + 1)
    return gf_div(u, 1 ^ u)


def generator_row(r: int, k: int) -> list[int]:
    """Row r of G (the coefficients of parity block r) for k data blocks."""
    if r == 0:
        return [1] * k
    if r == 1:
        return [gf_pow(ALPHA_INV, j) for j in range(k)]
    if k + r >= MAX_K_M:
        raise ValueError(f"parity row {r} needs k + {r} < {MAX_K_M}, got k = {k}")
    y0 = _cauchy_y(0)
    xr = _cauchy_y(255 - r)
    return [gf_div(gf_mul(y, xr ^ y0), gf_mul(xr ^ y, y0)) for y in map(_cauchy_y, range(k))]


def generator_matrix(k: int, m: int) -> Matrix:
    """The m x k parity part G of the code matrix [I_k; G] (module docstring)."""
    check_supported(k, m)
    return [generator_row(r, k) for r in range(m)]


def check_supported(k: int, m: int) -> None:
    """Raise ValueError (TypeError for non-integers) unless 1 <= k, 1 <= m, k + m <= 256."""
    if not (isinstance(k, (int, np.integer)) and isinstance(m, (int, np.integer))):
        raise TypeError(f"k and m must be integers, got {k!r}, {m!r}")
    if k < 1 or m < 1:
        raise ValueError(f"erasure code needs k >= 1 data and m >= 1 parity blocks, got k={k}, m={m}")
    if k + m > MAX_K_M:
        raise ValueError(f"k+m = {k + m} blocks: at most {MAX_K_M} are supported over GF(2^8)")


def count_square_submatrices(k: int, m: int) -> int:
    from math import comb

    return sum(comb(m, s) * comb(k, s) for s in range(1, min(k, m) + 1))


def is_mds(g: Sequence[Sequence[int]]) -> bool:
    """Whether [I; g] is MDS, i.e. every square submatrix of g is invertible (exhaustive:
    count_square_submatrices(k, m) determinants)."""
    m, k = len(g), len(g[0])
    if any(v == 0 for row in g for v in row):
        return False
    for s in range(2, min(k, m) + 1):
        for rows in itertools.combinations(range(m), s):
            sub_rows = [g[r] for r in rows]
            for cols in itertools.combinations(range(k), s):
                if not is_invertible([[row[c] for c in cols] for row in sub_rows]):
                    return False
    return True
