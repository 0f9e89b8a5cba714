"""The restore's steps, in the order hpcckpt/restore/flow.py runs them: discover (what each level
holds), plan (rank 0 agrees on a version and each rank's sources), fetch (each rank's shard
from the first level that delivers it verified; repartitioned over an old job's shards),
load (the arrays, in place), and tidy (what the resumed run writes again moves aside)."""
