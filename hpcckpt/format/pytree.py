"""Registered state as users know it from JAX/Orbax pytrees: nested dicts, lists and tuples of
Python scalars, strings, bytes and small NumPy arrays, stored in the commit record's JSON and
given back with their types intact (a tuple stays a tuple, an int key an int, a float32 array
a float32 array of its shape, NaN a NaN).

Plain JSON values are stored as they are, so a state that was JSON before reads the same and
old versions load unchanged. Anything else becomes an object tagged with TAG, which no plain
value uses (a dict with TAG among its keys is tagged itself). Large arrays belong in
protect(), which shards and checksums them: a state array is capped at MAX_ARRAY_BYTES.
"""

from __future__ import annotations

import base64
import math

import numpy as np

from hpcckpt.errors import CheckpointError

TAG = "__hpcckpt__"
MAX_ARRAY_BYTES = 1 << 20


def encode(value, where: str):
    """`value` as JSON-able data that decode() turns back into it; a CheckpointError naming
    the place (`where`, then the keys and indices down to it) for what cannot be stored."""
    # Exact types: a subclass (np.float64 is a float, a namedtuple a tuple) would come back as
    # its base type, not as it was.
    if isinstance(value, np.generic):
        return {TAG: "scalar", **_array_fields(np.asarray(value), where)}
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}
    if type(value) in (list, tuple):
        items = [encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if type(value) is list else {TAG: "tuple", "items": items}
    if type(value) is dict:
        if all(type(k) is str for k in value) and TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {TAG: "dict", "items": [[_key(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if type(value) is bytes:
        return {TAG: "bytes", "data": base64.b64encode(value).decode()}
    if type(value) is np.ndarray:
        return _array(value, where)
    raise CheckpointError(
        f"registered state {where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored; "
        "use dicts, lists, tuples, None, bool, int, float, str, bytes and small NumPy arrays (convert the "
        "object to those in the state's get() and back in its set())")


def decode(data):
    """What encode() was given, types intact."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in data.items()}
    if kind == "tuple":
        return tuple(decode(item) for item in data["items"])
    if kind == "dict":
        return {decode(k): decode(v) for k, v in data["items"]}
    if kind == "float":
        return float(data["value"])
    if kind == "bytes":
        return base64.b64decode(data["data"])
    if kind in ("array", "scalar"):
        array = np.frombuffer(base64.b64decode(data["data"]), dtype=np.dtype(data["dtype"])).reshape(data["shape"])
        return array[()] if kind == "scalar" else array.copy()
    raise CheckpointError(f"registered state: unknown tagged value {kind!r} (written by a newer hpcckpt?)")


def _array(array: np.ndarray, where: str) -> dict:
    if array.nbytes > MAX_ARRAY_BYTES:
        raise CheckpointError(
            f"registered state {where}: a {array.nbytes / 2**20:.1f} MiB array is too large for the state "
            f"(at most {MAX_ARRAY_BYTES >> 20} MiB, stored in the commit record); protect() it instead, which "
            "shards it over the ranks' levels")
    return {TAG: "array", **_array_fields(array, where)}


def _array_fields(array: np.ndarray, where: str) -> dict:
    if array.dtype.hasobject or array.dtype.fields is not None:
        raise CheckpointError(f"registered state {where}: arrays of dtype {array.dtype} cannot be stored; use a "
                              "plain numeric, bool or string dtype")
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}


def _key(key, where: str):
    """A dict key that is not a string: encoded like a value (an int, a tuple of them, ...)."""
    if isinstance(key, (dict, list, np.ndarray)):  # unhashable once decoded
        raise CheckpointError(f"registered state {where}: a {type(key).__name__} cannot be a dict key")
    return encode(key, f"{where} key")
