"""Reed-Solomon for the small, precious parts of a file (a shard's header and tensor table):
a few flipped bytes there are corrected on read instead of costing the whole shard.

Systematic, byte for byte what reedsolo.RSCodec(nsym) writes (prim 0x11d, generator 2, fcr
0). Encoding runs on every checkpoint, so it is done for all codewords at once with NumPy;
decoding checks first that the codeword is intact (its parity recomputed) and only then
uses reedsolo itself.
"""

from __future__ import annotations

import numpy as np
import reedsolo

from hpcckpt.codec import gf256

RS_CODEWORD_BYTES = 255  # GF(2^8) Reed-Solomon limit

# The field tables are the erasure codec's (same field: 0x11d); one definition for both.
_GF_EXP = gf256.EXP
_GF_MUL = gf256.MUL_TABLE
_PARITY_MATRICES: dict[int, np.ndarray] = {}


def _generator_poly(nsym: int) -> np.ndarray:
    poly = np.array([1], dtype=np.uint8)
    for i in range(nsym):  # multiply by (x - 2**i); minus is xor in GF(2^8)
        root = _GF_EXP[i]
        shifted = np.append(poly, 0)
        scaled = np.insert(_GF_MUL[poly, root], 0, 0)
        poly = shifted ^ scaled
    return poly


def _remainders(message: np.ndarray, nsym: int) -> np.ndarray:
    """Parity of each row of `message` by long division, one column per step."""
    generator = _generator_poly(nsym)[1:]
    remainder = np.zeros((message.shape[0], nsym), dtype=np.uint8)
    for column in range(message.shape[1]):
        feedback = message[:, column] ^ remainder[:, 0]
        remainder[:, :-1] = remainder[:, 1:]
        remainder[:, -1] = 0
        remainder ^= _GF_MUL[feedback[:, None], generator[None, :]]
    return remainder


def _parity_matrix(nsym: int) -> np.ndarray:
    """(255 - nsym) x nsym: row i is the parity of the message with a 1 at position i. Parity
    is linear over GF(2^8), so any message's parity is the XOR of its bytes times these rows:
    one table lookup for all codewords of a header, instead of a division step per column
    (which cost milliseconds per shard file, and every checkpoint writes four per rank)."""
    if nsym not in _PARITY_MATRICES:
        # Row i is row i + 1 carried one division step further over a zero: one step per
        # row, where dividing the identity message takes a step per column for every row
        # (paid on a process's first shard read: a spare's, inside its restore).
        block = RS_CODEWORD_BYTES - nsym
        generator = _generator_poly(nsym)[1:]
        rows = np.empty((block, nsym), dtype=np.uint8)
        remainder = generator.copy()  # the message with a 1 in its last position
        rows[block - 1] = remainder
        for row in range(block - 2, -1, -1):
            remainder = np.append(remainder[1:], np.uint8(0)) ^ _GF_MUL[remainder[0], generator]
            rows[row] = remainder
        _PARITY_MATRICES[nsym] = rows
    return _PARITY_MATRICES[nsym]


def rs_encode(data: bytes, nsym: int) -> bytes:
    """Same bytes as reedsolo.RSCodec(nsym).encode(data): each (255 - nsym)-byte chunk
    followed by its nsym parity bytes."""
    block = RS_CODEWORD_BYTES - nsym
    if not data:
        return b""
    count = -(-len(data) // block)
    message = np.zeros((count, block), dtype=np.uint8)
    flat = np.frombuffer(data, dtype=np.uint8)
    full = len(data) // block
    message[:full] = flat[:full * block].reshape(full, block)
    tail = len(data) - full * block
    if tail:
        # A shortened last chunk behaves as if prefixed by zeros, which do not change
        # the remainder, so right-aligning it gives the parity reedsolo computes.
        message[full, block - tail:] = flat[full * block:]
    if count * nsym <= 2048:  # headers and tables of a few KiB: one lookup for everything
        remainder = np.bitwise_xor.reduce(_GF_MUL[message[:, :, None], _parity_matrix(nsym)[None, :, :]], axis=1)
    else:  # the lookup grows with count x block x nsym; division steps grow with block only
        remainder = _remainders(message, nsym)
    out = bytearray()
    for index in range(count):
        start = index * block
        out += data[start:start + block]
        out += remainder[index].tobytes()
    return bytes(out)


def rs_encoded_size(length: int, nsym: int) -> int:
    return length + -(-length // (RS_CODEWORD_BYTES - nsym)) * nsym


def rs_message_bytes(encoded: bytes, nsym: int) -> bytes:
    """The data bytes of a systematic encoding, as stored (no correction)."""
    parts = []
    for start in range(0, len(encoded), RS_CODEWORD_BYTES):
        parts.append(encoded[start:start + RS_CODEWORD_BYTES][:-nsym])
    return b"".join(parts)


def rs_decode(encoded: bytes, nsym: int) -> tuple[bytes, int]:
    """Corrected data bytes and how many bytes were repaired; ReedSolomonError if it can't."""
    encoded = bytes(encoded)
    message = rs_message_bytes(encoded, nsym)
    # An intact codeword is its message's own encoding: checked with the NumPy encoder, a
    # fraction of reedsolo's pure-Python syndromes, which every shard header read paid.
    if rs_encode(message, nsym) == encoded:
        return message, 0
    decoded, _, errata = reedsolo.RSCodec(nsym).decode(bytearray(encoded))
    return bytes(decoded), len(errata)
