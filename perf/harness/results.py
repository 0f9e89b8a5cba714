"""Results as JSON, each with the machine it was measured on."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | os.PathLike, result: dict, machine: dict | None = None) -> None:
    """`result` (with `machine` under "machine" when given) as indented JSON at `path`."""
    if machine is not None:
        result = {**result, "machine": machine}
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
