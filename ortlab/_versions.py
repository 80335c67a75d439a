"""The versions of the libraries a cached artifact depends on (cache keys, the torchlib op list)."""

from __future__ import annotations

import functools
import platform

__all__ = ["library_versions"]


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """``torch|onnx|onnxscript|onnxruntime|ortlab|machine``: what a cached model or op list depends on.

    Example:
        >>> library_versions().count("|")
        5
    """
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    from ortlab import __version__

    return "|".join((torch.__version__, onnx.__version__, onnxscript.__version__, onnxruntime.__version__,
                     __version__, platform.machine()))
