"""A framework's state dict protected in one call: every tensor in place, the rest as small state.

    state = {"model": model_sd, "optim": optim_sd}     # e.g. torch's get_state_dict(model, optimizer)
    ckpt.protect_state_dict("train", state)
    if ckpt.restart():                                  # tensors restored in place, the rest into `state`
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

The dict is walked once, at protect: each array leaf (a tensor, a DTensor, a NumPy or CuPy
array) is protected under "<name>/<path>" (path: the keys and indices down to it, joined by
"/"), as protect() would take it alone. Everything else that sits beside the arrays (an
optimizer's hyperparameters, its parameter names, a step kept as a number) is read from the
dict at every checkpoint, saved as registered state, and written back into the dict at a
restart; a container with no array inside is one such value. The dict's shape is fixed at
protect: values added later are not saved.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass

import numpy as np

from hpcckpt.errors import ConfigError


def is_array_leaf(value) -> bool:
    """What protect() takes: arrays and tensors, anything that speaks DLPack."""
    return isinstance(value, np.ndarray) or hasattr(value, "__dlpack__")


@dataclass(frozen=True)
class StateDictParts:
    """A state dict cut into its arrays (name, leaf) and its other values, found by path."""

    arrays: tuple[tuple[str, object], ...]
    values: tuple[tuple[str, tuple], ...]  # (path as saved, the keys and indices to it)
    root: object

    def get(self) -> dict:
        """The other values as they are now, by path."""
        return {path: _at(self.root, keys) for path, keys in self.values}

    def set(self, saved: dict) -> None:
        """A restored version's values written back into the dict, each at its path."""
        for path, keys in self.values:
            if path in saved:
                parent = _at(self.root, keys[:-1])
                parent[keys[-1]] = saved[path]


def split_state_dict(name: str, tree) -> StateDictParts:
    """The arrays and other values of `tree` (see the module's docstring); ConfigError where
    a restored value could not be written back."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"protect_state_dict({name!r}): expected a mapping (a state dict), got {type(tree).__name__}")
    arrays, values = [], []

    def walk(node, keys: tuple) -> None:
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, value in items:
            path = keys + (key,)
            label = "/".join(str(k) for k in path)
            if is_array_leaf(value):
                arrays.append((f"{name}/{label}", value))
            elif isinstance(value, (Mapping, list, tuple)) and _holds_arrays(value):
                if not isinstance(value, (MutableMapping, MutableSequence)):
                    raise ConfigError(f"protect_state_dict({name!r}): {label} is a {type(value).__name__} that holds "
                                      "arrays beside other values, which a restart could not write back; make it a "
                                      "list or a dict")
                walk(value, path)
            else:
                if not isinstance(node, (MutableMapping, MutableSequence)):
                    raise ConfigError(f"protect_state_dict({name!r}): {label} sits in a {type(node).__name__}, "
                                      "which a restart could not write back; make it a list or a dict")
                values.append((label, path))

    walk(tree, ())
    labels = [label for label, _ in arrays] + [label for label, _ in values]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"protect_state_dict({name!r}): two entries have the same path once their keys are joined "
                          "by '/' (e.g. a key 1 and a key '1'); rename one")
    return StateDictParts(tuple(arrays), tuple(values), tree)


def _holds_arrays(node) -> bool:
    children = node.values() if isinstance(node, Mapping) else node
    return any(is_array_leaf(c) or (isinstance(c, (Mapping, list, tuple)) and _holds_arrays(c)) for c in children)


def _at(node, keys: tuple):
    for key in keys:
        node = node[key]
    return node
