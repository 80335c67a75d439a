"""Files of the on-disk cache (``cache_dir``): reads and atomic writes.

The models' entries (``ortlab.runtime.cache``) live in ``cache_dir``; this module is
the one place that opens its files and writes them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

__all__ = ["read_file", "write_atomic", "stage_file", "discard", "MISSING"]

# errno values of a read that means "no such entry" (the folder itself may be gone).
MISSING = (errno.ENOENT, errno.ENOTDIR)


def read_file(path: str) -> bytes:
    """The bytes of a cache file.

    Raises:
        OSError: as ``open`` does.
    """
    with open(path, "rb") as f:
        return f.read()


def stage_file(folder: str, name: str) -> str:
    """A new empty file ``.{name}.*.tmp`` (0600) in ``folder``, for a write that ``os.replace`` completes.

    Raises:
        OSError: the folder takes no new file.
    """
    fd, path = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    return path


def discard(path: str | None) -> None:
    """Remove a staged file, if it is still there."""
    if path is not None:
        with contextlib.suppress(OSError):
            os.remove(path)


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never a part.

    Raises:
        OSError: the folder is full or read-only (nothing is left behind).
    """
    tmp = stage_file(os.path.dirname(path) or ".", os.path.basename(path))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
