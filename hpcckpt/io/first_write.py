"""Small records that the first writer decides (a run's identity, why an attempt ended):
written whole under a private temporary name, then linked into place, which fails if the
name exists, so writers racing for one name never see a torn file and the first one wins."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def write_if_absent(path: str | os.PathLike, text: str) -> bool:
    """Write `text` to `path` unless it exists; True if this call wrote it. OSError propagates."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)
