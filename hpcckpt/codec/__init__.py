"""Reed-Solomon erasure coding over GF(2^8) for bulk checkpoint data.

`ErasureCode(k, m)` (NumPy, CPU) encodes k data blocks into m parity blocks and rebuilds
any m lost ones; `hpcckpt.codec.gpu.gpu_encode` produces the same bytes on a GPU (CuPy,
imported lazily). The generator matrix is documented in `hpcckpt.codec.gf256`.
"""

from hpcckpt.codec.cpu import CodecError, ErasureCode

__all__ = ["ErasureCode", "CodecError"]
