"""ortlab's background threads: one single-thread executor per job, made anew in a forked child.

A forked child inherits an executor's Python object but not its thread (nor, in CPython
3.11, a way to notice: the executor's idle semaphore says a worker is free), so work
submitted there would wait forever. Hence each executor is kept with the process that
made it. ``concurrent.futures`` has no fork-safe executor of its own.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["worker"]

_EXECUTORS: dict[str, tuple[concurrent.futures.ThreadPoolExecutor, int]] = {}
_LOCK = threading.Lock()


def worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The single-thread executor for ``name`` (its thread is called ``ortlab-{name}``) in this process."""
    with _LOCK:
        made = _EXECUTORS.get(name)
        if made is None or made[1] != os.getpid():
            made = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ortlab-{name}"), os.getpid())
            _EXECUTORS[name] = made
        return made[0]
