"""A Heat DNDarray (a distributed array on torch and mpi4py) protected as what it is: this
rank's local tensor (its larray, seen through ckpt/array_views.py) at its place in the global
array. Split along an axis, it is a block of the global shape at the offset the framework's own
chunks give (counts_displs(): even or not); not split, every rank holds the whole array, which
is then replicated. A restore onto any rank count fills each rank's chunk, as Heat cut it for
that job, from the old blocks it overlaps.

The framework swaps the local tensor itself (resplit_(), balance_()), so a DNDarray is
protected by reference (ckpt/foreign_arrays.py's followed()): the registry reads it again at
each capture. counts_displs() may be collective on the array's communicator (Heat checks
whether the array is balanced): it is read where every rank reads it, at protect() and after
the array changed. The array's communicator is taken to number the ranks as the
checkpointer's does (both the world's, as Heat's default).
"""

from __future__ import annotations

import sys

from hpcckpt.ckpt.array_views import Geometry, Protectable, protectable_tensor


def is_dndarray(obj) -> bool:
    heat = sys.modules.get("heat")
    dndarray = getattr(heat, "DNDarray", None) if heat is not None else None
    return dndarray is not None and isinstance(obj, dndarray)


def protectable_dndarray(name: str, array) -> Protectable:
    """The DNDarray's local tensor, viewed in place, placed by the array's split."""
    kept = protectable_tensor(name, array.larray, "DNDarray's local tensor")
    if array.split is None:
        return Protectable(kept.array, Geometry(True), kept.witness)
    _, displacements = array.counts_displs()
    offset = [0] * len(array.gshape)
    offset[array.split] = int(displacements[array.comm.rank])
    return Protectable(kept.array, Geometry(False, tuple(int(n) for n in array.gshape), tuple(offset)), kept.witness)
