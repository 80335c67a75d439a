"""PyTorch's OpenMP threads and onnxruntime's share the cores; keep the former out of the way.

Note [PyTorch's OpenMP spin and onnxruntime]
PyTorch's CPU wheels run ops on GNU OpenMP (libgomp). After each parallel op its idle
threads spin for GOMP_SPINCOUNT iterations (300,000 by default, about a millisecond)
before they sleep. An onnxruntime session that starts in that window (the training
loop's loss or optimizer ran in PyTorch just before) shares the cores with spinning
threads: on 2 cores the MLP's backward session ran 6.1 ms alone and 8.1-9.0 ms right
after a ``torch._foreach_add_``; on a 2-core Xeon with AVX-512 the MLP's whole step took
21 ms instead of 11 (eager: 11.9 ms).

Two levers, in this order:

1. Before a multi-threaded session runs, ortlab asks the OpenMP runtime to release its
   idle threads (``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0, in libgomp since
   GCC 9 and in LLVM's libomp): libgomp's idle workers leave at once instead of spinning,
   and PyTorch's next parallel op starts new ones (a few tens of microseconds). This
   works whatever the import order. It is skipped for single-threaded sessions (small
   graphs), where there is nothing to share and re-creating threads would cost more than
   the run (tiny MLP: 0.34 -> 0.66 ms a step). :func:`release_openmp_threads`.
2. ``import ortlab`` before torch also sets GOMP_SPINCOUNT=30000, which shortens the spin
   after every PyTorch op (libgomp reads it once, when PyTorch loads it): only when PyTorch
   is not imported yet and the user set neither variable.

``ORTLAB_TUNE_OPENMP=0`` turns both off; the first-step report then says what to do.
This is the one place ortlab writes to ``os.environ``, and ``ortlab/__init__.py`` calls
:func:`tune_before_torch` explicitly, first: an environment variable is the only knob
libgomp has before it loads. The variable ortlab itself reads (``ORTLAB_TUNE_OPENMP``) is
read in ``ortlab.config`` like every other.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

from ortlab.config import tune_openmp_enabled

SPINCOUNT = "30000"
_USER_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


_STATE = "not tuned yet"


def _decide() -> str:
    if not tune_openmp_enabled():
        return "left as it is (ORTLAB_TUNE_OPENMP=0)"
    for var in _USER_VARS:
        if var in os.environ:
            return f"{var}={os.environ[var]} (set by the user)"
    if "torch" in sys.modules:
        return "untouched"
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return f"GOMP_SPINCOUNT={SPINCOUNT} (set by ortlab before PyTorch loaded)"


def tune_before_torch() -> str:
    """Set GOMP_SPINCOUNT if it can still take effect (once per process); returns what was done."""
    global _STATE
    if _STATE == "not tuned yet":
        _STATE = _decide()
    return _STATE


def _uses_libgomp() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


# The OpenMP runtimes whose idle threads ortlab can release: GNU's (PyTorch's Linux wheels)
# and LLVM's (macOS wheels, some conda builds); Intel's libiomp5 is LLVM's.
_RUNTIMES = ("libgomp", "libomp", "libiomp5")
_PAUSE: list[Callable[[], None] | None] = []


def _loaded_runtime() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if any(os.path.basename(path).startswith(name) for name in _RUNTIMES):
                    return path
    except OSError:  # no /proc (macOS, Windows): nothing to release, the spin stays
        pass
    return None


def _find_pause() -> Callable[[], None] | None:
    path = _loaded_runtime() if tune_openmp_enabled() else None
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: dlopen only finds it
    except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    soft = 1  # omp_pause_soft

    def pause() -> None:
        fn(soft)

    return pause


def release_openmp_threads() -> Callable[[], None] | None:
    """A function that releases the OpenMP runtime's idle threads, or None where there is none.

    Looked up once per process, after PyTorch loaded its OpenMP runtime; see Note [PyTorch's
    OpenMP spin and onnxruntime]. None with ``ORTLAB_TUNE_OPENMP=0``.
    """
    if not _PAUSE:
        _PAUSE.append(_find_pause())
    return _PAUSE[0]


def openmp_note() -> str | None:
    """A line for the first-step report when PyTorch's OpenMP threads spin at the default length
    and ortlab cannot release them."""
    if _STATE != "untouched" or not _uses_libgomp() or release_openmp_threads() is not None:
        return None
    return (
        "PyTorch's OpenMP threads spin ~1 ms after each op, slowing the onnxruntime run that follows "
        "(up to 40% on 2 cores): import ortlab before torch, or set GOMP_SPINCOUNT=30000 before starting Python"
    )


def openmp_state() -> str:
    return _STATE
