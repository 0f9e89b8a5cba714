"""Per-rank maps of a commit record (node of each rank, partner of each rank, erasure groups,
node-local directories) stored as the rule they follow, so a record's size does not grow with
the rank count for a regular placement; anything irregular is stored as it is.

Every encoding is checked by decoding it before it is used: what is read back is always
exactly what was written, whichever rule (or none) fits.

    {"block": k, "start": a, "count": n}          v[r] = a + r // k   (ranks filled node by node)
    {"shift": d, "count": n}                      v[r] = (r + d) % n  (the same rank on the next node)
    {"cycle": m, "start": a, "step": s, "count": n}  v[r] = a + s * (r % m)  (ranks dealt round-robin)
    {"runs": [[first, step, count], ...]}         arithmetic runs
    {"list": [...]}                               as it is
"""

from __future__ import annotations

from typing import Sequence


def pack_ints(values: Sequence[int]):
    values = [int(v) for v in values]
    n = len(values)
    candidates = []
    if n:
        first = values[0]
        block = next((r for r, v in enumerate(values) if v != first), n)
        candidates.append({"block": block, "start": first, "count": n})
        candidates.append({"shift": (values[0] - 0) % n, "count": n})
        if n > 1:
            step = values[1] - values[0]
            cycle = next((r for r in range(1, n) if values[r] != first + step * r), n)
            candidates.append({"cycle": cycle, "start": first, "step": step, "count": n})
    for candidate in candidates:
        if unpack_ints(candidate) == values:
            return candidate
    runs = _runs(values)
    return {"runs": runs} if 3 * len(runs) < n else {"list": values}


def unpack_ints(packed) -> list[int]:
    if isinstance(packed, list):  # format 1 kept plain lists
        return [int(v) for v in packed]
    if "list" in packed:
        return [int(v) for v in packed["list"]]
    if "runs" in packed:
        return [first + step * i for first, step, count in packed["runs"] for i in range(count)]
    n = int(packed["count"])
    if "block" in packed:
        k = max(1, int(packed["block"]))
        return [int(packed["start"]) + r // k for r in range(n)]
    if "shift" in packed:
        return [(r + int(packed["shift"])) % n for r in range(n)]
    m = max(1, int(packed["cycle"]))
    return [int(packed["start"]) + int(packed["step"]) * (r % m) for r in range(n)]


def _runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for value in values:
        if runs:
            first, step, count = runs[-1]
            if count == 1:
                runs[-1] = [first, value - first, 2]
                continue
            if value == first + step * count:
                runs[-1][2] += 1
                continue
        runs.append([value, 0, 1])
    return runs


def pack_groups(groups: Sequence[Sequence[int]], world_size: int):
    """Erasure groups as the group of each rank (-1: none), when that gives them back exactly
    (members in rank order); else as they are."""
    groups = [list(map(int, g)) for g in groups]
    if not groups:
        return []
    group_of = [-1] * world_size
    for index, group in enumerate(groups):
        for rank in group:
            if not 0 <= rank < world_size or group_of[rank] != -1:
                return groups
            group_of[rank] = index
    packed = {"group_of": pack_ints(group_of), "groups": len(groups)}
    return packed if unpack_groups(packed) == tuple(tuple(g) for g in groups) else groups


def unpack_groups(packed) -> tuple[tuple[int, ...], ...]:
    if isinstance(packed, list):
        return tuple(tuple(int(r) for r in g) for g in packed)
    members: list[list[int]] = [[] for _ in range(int(packed["groups"]))]
    for rank, group in enumerate(unpack_ints(packed["group_of"])):
        if group >= 0:
            members[group].append(rank)
    return tuple(tuple(g) for g in members)


def pack_dirs(dirs: Sequence[str], node_of_rank: Sequence[int]):
    """Each rank's node-local directory: a template with {node} where every directory is it
    with the rank's node filled in; else a table of the distinct ones and each rank's index."""
    dirs = [str(d) for d in dirs]
    if not dirs:
        return []
    if len(node_of_rank) == len(dirs):
        node = str(node_of_rank[0])
        at = dirs[0].rfind(node)
        if at >= 0:
            template = dirs[0][:at] + "{node}" + dirs[0][at + len(node):]
            packed = {"template": template, "count": len(dirs)}
            if unpack_dirs(packed, node_of_rank) == dirs:
                return packed
    table = sorted(set(dirs))
    index = {d: i for i, d in enumerate(table)}
    return {"table": table, "index": pack_ints([index[d] for d in dirs])}


def unpack_dirs(packed, node_of_rank: Sequence[int]) -> list[str]:
    if isinstance(packed, list):
        return [str(d) for d in packed]
    if "template" in packed:
        # Only {node} is filled: a directory may hold other braces.
        prefix, _, suffix = packed["template"].partition("{node}")
        return [f"{prefix}{node_of_rank[r]}{suffix}" for r in range(int(packed["count"]))]
    return [packed["table"][i] for i in unpack_ints(packed["index"])]
