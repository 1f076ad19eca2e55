"""Write a file whole or not at all: a reader, or a crash, sees the old file or the complete new one."""
from __future__ import annotations

import os
import tempfile
from typing import IO, Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, write: Callable[[IO], None], *, binary: bool = True) -> None:
    """Call write(f) on a temporary file in path's folder, then rename it over path.

    Behaves like writing the file with open(): the new file gets the mode open() would give (0o666 less
    the umask, not mkstemp's private 0o600), a symlink is written through (its target is replaced, the
    link stays), and a missing folder raises FileNotFoundError naming `path`, not the temporary file.
    """
    path = os.fspath(path)
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise FileNotFoundError(2, "No such directory to write the file in", path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
