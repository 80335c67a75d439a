"""ortlab: train PyTorch models through ONNX Runtime, and see what happens.

Importing ortlab does not import plotly, ipywidgets or netron.
"""

from ortlab import _openmp

_openmp.tune_before_torch()  # first: it may shorten PyTorch's OpenMP spin, which only works before torch loads

from ortlab.config import DebugOptions, LogLevel, Options  # noqa: E402
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
# Each loads ortlab.ui too, which registers the views inspection records show themselves
# with (see ortlab.inspect.views): ortlab is the one layer above both.
_LAZY = {
    "explore": ("ortlab.inspect.explore", "explore"),
    "compare": ("ortlab.inspect.compare", "compare"),
    "bisect_fallbacks": ("ortlab.inspect.bisect", "bisect_fallbacks"),
    "monitor": ("ortlab.ui.monitor", "monitor"),
    "Lab": ("ortlab.inspect.lab", "Lab"),
}


def __getattr__(name: str) -> object:
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
    "UnsupportedInputError",
    "DeviceError",
    "InternalError",
    "explore",
    "compare",
    "bisect_fallbacks",
    "monitor",
    "Lab",
    "__version__",
]
