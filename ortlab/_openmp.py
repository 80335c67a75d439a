"""PyTorch's OpenMP threads and onnxruntime's share the cores; keep the former from spinning long.

Note [PyTorch's OpenMP spin and onnxruntime]
PyTorch's CPU wheels run ops on GNU OpenMP (libgomp). After each parallel op its idle
threads spin for GOMP_SPINCOUNT iterations (300,000 by default, about a millisecond)
before they sleep. An onnxruntime session that starts in that window (the training
loop's loss or optimizer ran in PyTorch just before) shares the cores with spinning
threads: on 2 cores the MLP's backward session ran 6.1 ms alone and 8.1-9.0 ms right
after a ``torch._foreach_add_``. With GOMP_SPINCOUNT=30000 the penalty is gone while
eager PyTorch keeps its speed (benchmarks/train_step.py, MLP: ortlab 12.6 -> 10.6 ms,
eager 9.4 -> 9.3 ms; OMP_WAIT_POLICY=PASSIVE also removes it but slowed eager's tiny
model by 25%).

libgomp reads the variable once, when PyTorch loads it, so ``import ortlab`` sets it
only when PyTorch is not imported yet and the user set neither variable;
``ORTLAB_TUNE_OPENMP=0`` turns this off. Otherwise the first-step report says what to do.
This is the one place ortlab writes to ``os.environ``, and ``ortlab/__init__.py`` calls
:func:`tune_before_torch` explicitly, first: an environment variable is the only knob
libgomp has, and it must be set before PyTorch loads. The variable ortlab itself reads
(``ORTLAB_TUNE_OPENMP``) is read in ``ortlab.config`` like every other.
"""

from __future__ import annotations

import os
import sys

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


def openmp_note() -> str | None:
    """A line for the first-step report when PyTorch's OpenMP threads spin at the default length."""
    if _STATE != "untouched" or not _uses_libgomp():
        return None
    return (
        "PyTorch's OpenMP threads spin ~1 ms after each op, slowing the onnxruntime run that follows "
        "(up to 40% on 2 cores): import ortlab before torch, or set GOMP_SPINCOUNT=30000 before starting Python"
    )


def openmp_state() -> str:
    return _STATE
