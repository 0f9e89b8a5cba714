"""hpcckpt: multi-level checkpoint/restart for SPMD data-parallel training."""

__version__ = "0.1.0"
