"""ortlab: train PyTorch models through ONNX Runtime, and see what happens.

Importing ortlab does not import plotly, ipywidgets or netron.
"""

from ortlab import _openmp  # noqa: F401  (first: it may tune OpenMP before PyTorch loads)
from ortlab.config import DebugOptions, LogLevel, Options
from ortlab.errors import (
    CaptureError,
    ConfigError,
    DeviceError,
    ExportError,
    FallbackError,
    FallbackWarning,
    InternalError,
    OrtlabError,
    SessionError,
    UnsupportedInputError,
)
from ortlab.ortmodule import ORTModule

__version__ = "0.1.0"

# Notebook tools, imported on first use so ``import ortlab`` stays light
# (no plotly, ipywidgets or netron until a view is built).
_LAZY = {
    "explore": ("ortlab.inspect.explore", "explore"),
    "compare": ("ortlab.inspect.compare", "compare"),
    "bisect_fallbacks": ("ortlab.inspect.bisect", "bisect_fallbacks"),
    "monitor": ("ortlab.ui.monitor", "monitor"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

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
    "UnsupportedInputError",
    "DeviceError",
    "InternalError",
    "explore",
    "compare",
    "bisect_fallbacks",
    "monitor",
    "__version__",
]
