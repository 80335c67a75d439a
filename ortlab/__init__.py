"""ortlab: train PyTorch models through ONNX Runtime, and see what happens.

Importing ortlab does not import plotly, ipywidgets or netron.
"""

from ortlab import _openmp

_openmp.tune_before_torch()  # first: it may shorten PyTorch's OpenMP spin, which only works before torch loads

from ortlab.config import DebugOptions, LogLevel, Options  # noqa: E402
from ortlab.errors import (  # noqa: E402
    ArtifactError,
    CaptureError,
    ConfigError,
    DeviceError,
    ExportError,
    FallbackError,
    FallbackWarning,
    InternalError,
    OrtlabError,
    ParityWarning,
    SessionError,
    UnsupportedInputError,
)

# Note [Importing ortlab without PyTorch]
# ``ortlab.ondevice`` trains from ONNX files with onnxruntime and numpy alone, on devices
# where PyTorch is not installed, and importing it imports this package first. So the one
# name here that needs PyTorch, ``ORTModule``, is imported only when PyTorch imports;
# otherwise the failure is kept and raised, as an ImportError saying what to do, when
# ``ortlab.ORTModule`` (or a notebook tool) is asked for. With PyTorch every name is
# imported eagerly, exactly as before. The check imports torch itself rather than
# catching an ImportError from ``ortlab.ortmodule``, so a real bug there still raises.
_TORCH_MISSING: ImportError | None = None
try:
    import torch as _torch  # noqa: F401
except ImportError as _error:
    _TORCH_MISSING = _error
else:
    del _torch
    from ortlab.ortmodule import ORTModule  # noqa: E402

# The one source of the version: pyproject.toml reads it (``[tool.setuptools.dynamic]``), statically.
__version__ = "0.1.0"

# Notebook tools, imported on first use so ``import ortlab`` stays light
# (no plotly, ipywidgets or netron until a view is built).
# Each loads ortlab.ui too, which registers the views inspection records show themselves
# with (see ortlab.inspect.views): ortlab is the one layer above both.
_LAZY = {
    "explore": ("ortlab.inspect.explore", "explore"),
    "compare": ("ortlab.inspect.compare", "compare"),
    "compare_speed": ("ortlab.inspect.speed", "compare_speed"),
    "bisect_fallbacks": ("ortlab.inspect.bisect", "bisect_fallbacks"),
    "monitor": ("ortlab.ui.monitor", "monitor"),
    "Lab": ("ortlab.inspect.lab", "Lab"),
}


def _needs_torch(name: str) -> ImportError:
    return ImportError(
        f"ortlab.{name} needs PyTorch, which could not be imported ({_TORCH_MISSING}). Install torch to train "
        "PyTorch models; ortlab.ondevice trains from ONNX artifacts without it."
    )


def __getattr__(name: str) -> object:
    if _TORCH_MISSING is not None and (name == "ORTModule" or name in _LAZY):
        raise _needs_torch(name) from _TORCH_MISSING
    if name in _LAZY:
        import importlib

        importlib.import_module("ortlab.ui")
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ortlab' has no attribute {name!r}")


__all__ = [
    "ORTModule",
    "DebugOptions",
    "LogLevel",
    "Options",
    "OrtlabError",
    "ConfigError",
    "CaptureError",
    "ExportError",
    "SessionError",
    "FallbackError",
    "FallbackWarning",
    "ParityWarning",
    "UnsupportedInputError",
    "DeviceError",
    "ArtifactError",
    "InternalError",
    "explore",
    "compare",
    "compare_speed",
    "bisect_fallbacks",
    "monitor",
    "Lab",
    "__version__",
]
