"""Files of the on-disk cache (``cache_dir``): the folder's checks, safe reads, atomic writes, the lock.

The models' entries (``ortlab.runtime.cache``) and the torchlib op list
(``ortlab.torchlib``) both live in ``cache_dir``; this module is the one place that
creates the folder, opens its files and writes them.

Note [Who may write the cache folder]
An entry is a model onnxruntime runs and the metadata the runner trusts (which output
goes where): whoever can write into the folder decides what a training step computes.
So the folder is created 0700, and an existing folder is refused (``ConfigError``, when
the options are validated) if a user other than ours (or root) owns it, or its group or
others may write to it. Raising rather than running without the cache: the folder was
named on purpose (``cache_dir=`` or ``ORTLAB_CACHE_DIR``), the check runs when the
ORTModule is built, before any step, and the fix is one ``chmod 700`` or another folder;
a warning would let a shared, writable folder keep running as a slow, silent
"no cache" and hide what is wrong with it. Root may own the folder (as OpenSSH's
StrictModes allows): root can change the process's own code anyway, and a cache built
by root in an image, read-only to the user, is a fair use. Files are opened with
``O_NOFOLLOW`` and must be regular files of the same owners, so a link planted in the
folder never sends a read elsewhere; writes go through ``os.replace``, which replaces
a link rather than writing through it.

Note [A cache folder that stops taking writes]
The folder can fill up or turn read-only after the ORTModule was built. Writing is then
given up for that folder for the rest of the process, with one warning
(:func:`note_write_failure`): models are still built and run in onnxruntime, entries
already there are still read, and nothing is retried on every new graph.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Iterator

from ortlab.errors import ConfigError

try:  # POSIX; without it the lock is a no-op and the entries' checksums catch torn pairs
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["prepare_folder", "read_file", "write_atomic", "stage_file", "discard", "folder_lock", "writable",
           "note_write_failure", "LOCK_NAME", "MISSING"]

logger = logging.getLogger(__name__)

LOCK_NAME = "ortlab-cache.lock"
# errno values of a read that means "no such entry" (the folder itself may be gone).
MISSING = (errno.ENOENT, errno.ENOTDIR)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_unwritable: set[str] = set()
_unwritable_lock = threading.Lock()


def _trusted_owners() -> tuple[int, ...]:
    euid = getattr(os, "geteuid", lambda: -1)()
    return (euid, 0)


def prepare_folder(path: str) -> None:
    """Create the cache folder 0700, or check that an existing one is safe to use.

    See Note [Who may write the cache folder].

    Raises:
        ConfigError: the folder cannot be created, is not a folder, is owned by another
            user, or its group or others may write to it.

    Example:
        >>> prepare_folder("/tmp/ortlab-cache-doctest")  # doctest: +SKIP
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cache_dir {path!r} cannot be created or used as a folder ({e}); give a folder you own "
            "(it is created 0700 if missing), or leave cache_dir unset."
        ) from e
    if not hasattr(os, "geteuid"):  # pragma: no cover - Windows: no POSIX owners or mode bits
        return
    owners = _trusted_owners()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in owners:
        raise ConfigError(
            f"cache_dir {path!r} is a symbolic link owned by user {link.st_uid}, not by you (user {owners[0]}): "
            "whoever owns it decides where ortlab's models are read from. Give the real folder instead."
        )
    st = os.stat(path)
    if st.st_uid not in owners:
        raise ConfigError(
            f"cache_dir {path!r} is owned by user {st.st_uid}, not by you (user {owners[0]}): its owner could "
            "replace the models ortlab runs. Use a folder of your own (it is created 0700 if missing)."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"cache_dir {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: its group or others may write to it and "
            f"so replace the models ortlab runs. Run `chmod 700 {path}` or use a folder of your own."
        )


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


def writable(folder: str) -> bool:
    """Whether this process still writes to ``folder`` (see Note [A cache folder that stops taking writes])."""
    return os.path.abspath(folder) not in _unwritable


def note_write_failure(folder: str, error: BaseException) -> None:
    """Stop writing to ``folder`` for the rest of the process, warning once."""
    key = os.path.abspath(folder)
    with _unwritable_lock:
        if key in _unwritable:
            return
        _unwritable.add(key)
    reason = f"{type(error).__name__}: {error}".strip()
    logger.warning(
        "ortlab: cannot write to the cache folder %s (%s); this process stops storing models there and "
        "builds them as without a cache (training goes on in onnxruntime). Free space or make the folder "
        "writable, or choose another cache_dir.", folder, reason,
    )
