"""Storage directories that nobody else can redirect or read.

Node-local checkpoints often go to shared scratch (/tmp, /local/scratch): world-writable
directories where any user can create a name first. A directory another user planted at the
job's path (theirs, or writable by everyone) lets them swap the job's versions; a symlink
planted there sends the job's checkpoints wherever they like. So before anything is written:

- every existing directory on the path must not be writable by every user unless sticky
  (like /tmp itself), or anyone could replace the entries below it;
- below a world-writable directory, every existing entry on the path must belong to this user
  (or root): anything else was planted; a symlink there is refused the same way;
- what hpcckpt creates on a node-local path it creates private (0700; 0750 with
  storage.share_with_group), one component at a time, and checks again after creating.

The PFS directory keeps the user's umask (shared project spaces rely on it) but gets the
same refusals. Errors are ConfigError (exit 2) naming the path, its owner and what to do.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from hpcckpt.errors import ConfigError

PRIVATE_DIR_MODE = 0o700
GROUP_DIR_MODE = 0o750
PRIVATE_FILE_MODE = 0o600
GROUP_FILE_MODE = 0o640


def modes(share_with_group: bool) -> tuple[int, int]:
    """(directory mode, file mode) for node-local storage."""
    return (GROUP_DIR_MODE, GROUP_FILE_MODE) if share_with_group else (PRIVATE_DIR_MODE, PRIVATE_FILE_MODE)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _world_writable(st: os.stat_result) -> bool:
    return bool(st.st_mode & stat.S_IWOTH)


def _refuse(path: str, problem: str, what: str) -> ConfigError:
    return ConfigError(f"{what}: {path!r} {problem}; nothing was written. Remove it (or ask its owner to), or "
                       f"point {what} at a directory of your own (e.g. with {{user}} in the template)")


def check_path(path: str | os.PathLike, what: str) -> None:
    """Refuse `path` if someone else could redirect what is written under it (see the module
    docstring). Parts that do not exist yet are fine: they will be created by this user."""
    parts = Path(os.path.abspath(path)).parts
    current = parts[0]
    inside_world_writable = False
    for part in parts[1:]:
        candidate = os.path.join(current, part)
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            return
        except OSError:
            return  # unreadable: creating or writing there fails later with its own message
        if stat.S_ISLNK(st.st_mode):
            if inside_world_writable and not _trusted(st.st_uid):
                raise _refuse(candidate, f"is a symlink owned by {_owner(st.st_uid)} in the world-writable "
                                         f"directory {current!r} (it could point anywhere)", what)
            current = os.path.realpath(candidate)
            try:
                st = os.stat(current)
            except OSError:
                return
        else:
            current = candidate
        if not stat.S_ISDIR(st.st_mode):
            return  # not a directory: creating below it fails with a clear message later
        if inside_world_writable and not _trusted(st.st_uid):
            raise _refuse(candidate, f"belongs to {_owner(st.st_uid)}, not to you, and sits in a world-writable "
                                     "directory (someone else created it first)", what)
        if _world_writable(st) and not st.st_mode & stat.S_ISVTX:
            raise _refuse(candidate, f"(owner {_owner(st.st_uid)}) is writable by every user without the sticky "
                                     "bit, so anyone could replace what is below it", what)
        inside_world_writable = _world_writable(st)


def make_private_dirs(path: str | os.PathLike, what: str, dir_mode: int = PRIVATE_DIR_MODE) -> None:
    """Check `path` (check_path), then create its missing parts with `dir_mode`, each checked
    again once it exists (a name taken by someone else in between is refused, not used)."""
    check_path(path, what)
    target = Path(os.path.abspath(path))
    missing = []
    probe = target
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, dir_mode)
            os.chmod(directory, dir_mode)  # mkdir's mode passes through the umask
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(f"{what}: cannot create {str(directory)!r}: {exc.strerror or exc}; point {what} at "
                              "a directory you can write") from None
        check_path(directory, what)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or not _trusted(st.st_uid):
            raise _refuse(str(directory), f"was created by {_owner(st.st_uid)} while this job was creating it", what)
