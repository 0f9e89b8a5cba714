"""When: the interval (fixed, under an overhead bound, Young/Daly), how often each level takes a
version, stop requests, divergence and rewinds, and what checkpoints cost the run."""
