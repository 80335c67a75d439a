"""The versions of the libraries a cached artifact depends on (cache keys, the torchlib op list)."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

__all__ = ["library_versions"]


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of ortlab's own Python files: a cached model is ortlab's translation of a graph, and a fix to a
    translation (a max pool that now propagates NaN) or to OpenVINO's preparation must not be served the
    model an earlier checkout made under the same version number. ~10 ms, once per process."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """``torch|onnx|onnxscript|onnxruntime|ortlab+code|machine``: what a cached model or op list depends on.

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
                     f"{__version__}+{_code_digest()}", platform.machine()))
