"""ortlab: train PyTorch models through ONNX Runtime, and see what happens.

Importing ortlab does not import plotly, ipywidgets or netron.
"""

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
    "__version__",
]
