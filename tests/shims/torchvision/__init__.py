"""The two names Heat's import needs of torchvision (see tests/shims/README.md)."""

from . import datasets, transforms  # noqa: F401
