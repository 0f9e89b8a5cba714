"""The same Reed-Solomon code on a GPU: one CuPy RawKernel, table lookup in shared memory.

    parity = gpu_encode(data_blocks, k, m)          # CuPy uint8 arrays in, CuPy arrays out

Every output byte is sum_j c[o][j] * src_j[i] over GF(2^8) with the coefficients of
`hpcckpt.codec.gf256` (encode: the generator matrix G; decode/rebuild: the rows from
`ErasureCode.decode_matrix`), and c * x comes from a 256-byte product table per (o, j)
built on the host from the same field tables, so the bytes are those of the CPU codec.
Each thread handles 16 bytes (one uint4 load per source) of every output; coefficient 1
is a plain XOR. Sizes that are not a multiple of 16 (and unaligned arrays) go through a
byte-wise tail loop in the same kernel. CuPy is imported only when a function is called.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hpcckpt.codec import gf256

MAX_OUTPUTS = 16
SHARED_LIMIT = 48 * 1024  # default dynamic shared memory per block

_SOURCE = r"""
// M (number of outputs) is a compile-time constant (-DM=...): the accumulators stay in registers.
extern "C" __global__ void rs_combine(
    const unsigned long long* __restrict__ src_ptrs,   // K device pointers (uint8 data)
    const unsigned long long* __restrict__ dst_ptrs,   // M device pointers
    const unsigned char* __restrict__ coefs,           // M*K coefficients, row-major
    const unsigned char* __restrict__ tables,          // M*K*256: tables[(o*K+j)*256+x] = c*x
    const int K, const long long n_vec, const long long n_bytes)
{
    extern __shared__ unsigned char smem[];
    unsigned char* tab = smem;                // M*K*256 bytes
    unsigned char* cf = smem + M * K * 256;   // M*K bytes
    for (int i = threadIdx.x; i < M * K * 256; i += blockDim.x) tab[i] = tables[i];
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) cf[i] = coefs[i];
    __syncthreads();

    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;

    for (long long i = tid; i < n_vec; i += stride) {       // 16 bytes per step
        uint4 acc[M];
#pragma unroll
        for (int o = 0; o < M; ++o) acc[o] = make_uint4(0u, 0u, 0u, 0u);
        for (int j = 0; j < K; ++j) {
            const uint4 v = reinterpret_cast<const uint4*>(src_ptrs[j])[i];
#pragma unroll
            for (int o = 0; o < M; ++o) {
                const unsigned int c = cf[o * K + j];
                if (c == 1u) {
                    acc[o].x ^= v.x; acc[o].y ^= v.y; acc[o].z ^= v.z; acc[o].w ^= v.w;
                } else if (c != 0u) {
                    const unsigned char* t = tab + (o * K + j) * 256;
#define RS_MUL4(w) ((unsigned int)t[(w) & 0xffu] | ((unsigned int)t[((w) >> 8) & 0xffu] << 8) | \
                    ((unsigned int)t[((w) >> 16) & 0xffu] << 16) | ((unsigned int)t[(w) >> 24] << 24))
                    acc[o].x ^= RS_MUL4(v.x);
                    acc[o].y ^= RS_MUL4(v.y);
                    acc[o].z ^= RS_MUL4(v.z);
                    acc[o].w ^= RS_MUL4(v.w);
#undef RS_MUL4
                }
            }
        }
#pragma unroll
        for (int o = 0; o < M; ++o) reinterpret_cast<uint4*>(dst_ptrs[o])[i] = acc[o];
    }

    for (long long b = n_vec * 16 + tid; b < n_bytes; b += stride) {   // the byte tail
        unsigned int acc[M];
#pragma unroll
        for (int o = 0; o < M; ++o) acc[o] = 0u;
        for (int j = 0; j < K; ++j) {
            const unsigned int x = reinterpret_cast<const unsigned char*>(src_ptrs[j])[b];
#pragma unroll
            for (int o = 0; o < M; ++o) acc[o] ^= tab[(o * K + j) * 256 + x];
        }
#pragma unroll
        for (int o = 0; o < M; ++o) reinterpret_cast<unsigned char*>(dst_ptrs[o])[b] = (unsigned char)acc[o];
    }
}
"""

_kernels: dict = {}


def _kernel(m: int):
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, m)
    if key not in _kernels:
        _kernels[key] = cupy.RawKernel(_SOURCE, "rs_combine", options=(f"-DM={m}",))
    return _kernels[key]


def gpu_apply(coef_rows: Sequence[Sequence[int]], sources: Sequence, outs=None) -> list:
    """outs[o] = sum_j coef_rows[o][j] * sources[j] over GF(2^8), bytewise, on the GPU.

    `sources`: equal-length CuPy arrays (viewed as bytes; C-contiguous). `outs`: optional
    preallocated CuPy uint8 arrays. Returns the outputs (asynchronous on the current stream).
    """
    import cupy

    m, k = len(coef_rows), len(sources)
    if not 1 <= m <= MAX_OUTPUTS:
        raise ValueError(f"gpu_apply supports 1..{MAX_OUTPUTS} outputs, got {m}")
    if any(len(row) != k for row in coef_rows):
        raise ValueError(f"every coefficient row needs {k} entries")
    shared = m * k * 256 + m * k
    if shared > SHARED_LIMIT:
        raise ValueError(f"{m} outputs x {k} sources need {shared} bytes of shared memory "
                         f"(limit {SHARED_LIMIT}); split the outputs into several calls")
    srcs = []
    for j, s in enumerate(sources):
        a = cupy.asarray(s)
        if not a.flags.c_contiguous:
            raise ValueError(f"source {j} is not C-contiguous")
        srcs.append(a.reshape(-1).view(cupy.uint8))
    n = srcs[0].size
    if any(a.size != n for a in srcs):
        raise ValueError(f"sources must have equal byte lengths, got {sorted({a.size for a in srcs})}")
    if outs is None:
        outs = [cupy.empty(n, dtype=cupy.uint8) for _ in range(m)]
    else:
        outs = list(outs)
        if len(outs) != m or any(o.dtype != cupy.uint8 or o.size != n or not o.flags.c_contiguous
                                 for o in outs):
            raise ValueError(f"outs must be {m} contiguous uint8 CuPy arrays of {n} bytes")
    if n == 0:
        return outs
    coefs = np.asarray(coef_rows, dtype=np.uint8)
    tables = gf256.MUL_TABLE[coefs.reshape(-1)]  # (m*k, 256): c * x
    ptrs = [a.data.ptr for a in srcs] + [o.data.ptr for o in outs]
    n_vec = n // 16 if all(p % 16 == 0 for p in ptrs) else 0
    src_ptrs = cupy.asarray(np.array(ptrs[:k], dtype=np.uint64))
    dst_ptrs = cupy.asarray(np.array(ptrs[k:], dtype=np.uint64))
    d_coefs = cupy.asarray(coefs.reshape(-1))
    d_tables = cupy.asarray(np.ascontiguousarray(tables).reshape(-1))
    threads = 256
    work = max(n_vec, n - n_vec * 16)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    blocks = int(max(1, min((work + threads - 1) // threads, sms * 8)))
    _kernel(m)((blocks,), (threads,),
               (src_ptrs, dst_ptrs, d_coefs, d_tables, np.int32(k), np.int64(n_vec), np.int64(n)),
               shared_mem=shared)
    return outs


def gpu_encode(data_blocks: Sequence, k: int, m: int, out=None) -> list:
    """The m parity blocks of k equal-length CuPy data blocks: the same bytes as
    `ErasureCode(k, m).encode` on the host."""
    if len(data_blocks) != k:
        raise ValueError(f"gpu_encode(k={k}) needs {k} data blocks, got {len(data_blocks)}")
    return gpu_apply(gf256.generator_matrix(k, m), data_blocks, out)
