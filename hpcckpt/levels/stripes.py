"""Where the pieces of every erasure codeword live in a group (pure, no MPI).

A group of n members on distinct nodes protects its n shards with p parity pieces per
codeword, k = n - p. Each shard is padded and split into k segments. There are n stripes
(codewords); in stripe t the parity holders are members t, t+1, .., t+p-1 (mod n) and the
other k members contribute one data segment each. So every member holds exactly one piece of
every stripe (a data segment of its own shard, or a parity piece), losing any p members
loses at most p pieces of each stripe, parity is spread evenly (p pieces per member, no
parity node), and the storage overhead is p / k of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Stripe:
    index: int
    contributors: tuple[int, ...]  # member indices, in code order: data block j = contributors[j]
    segments: tuple[int, ...]  # segments[j]: which segment of contributor j's shard
    holders: tuple[int, ...]  # holders[h] stores parity block h

    def member_of_block(self, block: int) -> int:
        k = len(self.contributors)
        return self.contributors[block] if block < k else self.holders[block - k]

    def block_of_member(self, member: int) -> int:
        if member in self.contributors:
            return self.contributors.index(member)
        return len(self.contributors) + self.holders.index(member)


@lru_cache(maxsize=256)
def stripe_plan(n: int, p: int) -> tuple[Stripe, ...]:
    if not 1 <= p < n:
        raise ValueError(f"need 1 <= parity < group size, got parity {p} for {n} members")
    next_segment = [0] * n
    stripes = []
    for t in range(n):
        holders = tuple((t + h) % n for h in range(p))
        contributors = tuple(j for j in range(n) if j not in holders)
        segments = []
        for j in contributors:
            segments.append(next_segment[j])
            next_segment[j] += 1
        stripes.append(Stripe(t, contributors, tuple(segments), holders))
    return tuple(stripes)


def segment_length(shard_sizes, n: int, p: int) -> int:
    """Bytes per segment: the group's largest shard split into k equal parts (at least 1)."""
    k = n - p
    largest = max(shard_sizes) if shard_sizes else 0
    return max(1, -(-largest // k))


def recovery_sources(stripe: Stripe, lost: frozenset[int], k: int) -> tuple[int, ...]:
    """The k surviving blocks a rebuild of `stripe` reads: data blocks first, deterministic so
    every member knows whether it must send, without asking."""
    blocks = [b for b in range(len(stripe.contributors) + len(stripe.holders))
              if stripe.member_of_block(b) not in lost]
    if len(blocks) < k:
        raise ValueError(f"stripe {stripe.index}: {len(blocks)} pieces survive, {k} needed")
    return tuple(blocks[:k])
