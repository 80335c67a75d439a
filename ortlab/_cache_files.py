"""Files of the on-disk cache (``cache_dir``): safe reads, atomic writes, the lock.

The models' entries (``ortlab.runtime.cache``) live in ``cache_dir``; this module is
the one place that opens its files and writes them.

Note [Links in the cache folder]
An entry is a model onnxruntime runs and the metadata the runner trusts (which output
goes where). Files are opened with ``O_NOFOLLOW`` and must be regular files of the
process's user (or root), so a link planted in the folder never sends a read
elsewhere; writes go through ``os.replace``, which replaces a link rather than writing
through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator

try:  # POSIX; without it the lock is a no-op and the entries' checksums catch torn pairs
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["read_file", "write_atomic", "stage_file", "discard", "folder_lock", "LOCK_NAME", "MISSING"]

LOCK_NAME = "ortlab-cache.lock"
# errno values of a read that means "no such entry" (the folder itself may be gone).
MISSING = (errno.ENOENT, errno.ENOTDIR)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _trusted_owners() -> tuple[int, ...]:
    euid = getattr(os, "geteuid", lambda: -1)()
    return (euid, 0)


def read_file(path: str) -> bytes:
    """The bytes of a cache file, never through a symbolic link.

    Raises:
        OSError: as ``open`` does; ``ELOOP`` for a link; ``EPERM`` for a file that is not a
            regular file or belongs to another user.
    """
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EPERM, "not a regular file", path)
        if hasattr(os, "geteuid") and st.st_uid not in _trusted_owners():
            raise OSError(errno.EPERM, f"owned by user {st.st_uid}, not by this process's user", path)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


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


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """Hold the cache folder's lock (``flock`` on ``ortlab-cache.lock``; one holder at a time, not re-entrant).

    An entry is two files: the lock makes writing both, or reading both, one step for
    every thread and process (see Note [Two writers of one entry] in
    ``ortlab.runtime.cache``). A folder where the lock cannot be opened or taken (read-only,
    no ``flock``) is used without it: the entries' checksums still catch a torn pair.
    """
    fd = None
    if fcntl is not None:
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                fd = os.open(os.path.join(folder, LOCK_NAME), flags | _NOFOLLOW | _CLOEXEC, 0o600)
                break
            except OSError:
                continue
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # e.g. ENOLCK on some network file systems
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
