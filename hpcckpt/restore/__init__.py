"""The way back, in the order flow.py (the driver) runs it: discover (what each level holds),
plan (rank 0 agrees on a version and each rank's sources), fetch (each rank's shard from the
first level that delivers it verified; repartitioned over an old job's shards), load (the
arrays, in place), and tidy (what the resumed run writes again moves aside); a version loaded
onto another geometry is written again (protect_again.py)."""
