"""Memory readings for a training run: process RSS, saved activations, CUDA memory.

Each reading is cheap enough to take every few steps (RSS: one read of
``/proc/self/statm``, about 10 us; CUDA: counters kept by PyTorch's allocator and
one ``cudaMemGetInfo``, no stream synchronization). psutil is not a dependency.

Note [Which CUDA memory]
PyTorch's ``memory_allocated`` counts only tensors PyTorch allocated. onnxruntime's
CUDA provider keeps its own arena, so the activations of the graphs it runs are not
in PyTorch's numbers. ``cuda_used`` (device total minus free, from
``torch.cuda.mem_get_info``) includes them, and everything else on the device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import sys
from typing import Any

__all__ = ["MemorySample", "rss_bytes", "peak_rss_bytes", "saved_activation_bytes", "cuda_memory", "sample_memory"]

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM = "/proc/self/statm"
_HAVE_STATM = os.path.exists(_STATM)


def rss_bytes() -> int:
    """The resident set size of this process now, in bytes.

    Read from ``/proc/self/statm`` on Linux; elsewhere the peak RSS is the best
    available reading (see :func:`peak_rss_bytes`).

    Example:
        >>> rss_bytes() > 0
        True
    """
    if _HAVE_STATM:
        try:
            with open(_STATM, "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            pass
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The highest resident set size of this process so far, in bytes.

    Example:
        >>> peak_rss_bytes() >= 0
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


def saved_activation_bytes(ortmodule_or_report: Any) -> int:
    """Bytes of activations the forward graphs save for the backward, at the captured sizes.

    Args:
        ortmodule_or_report: an ``ORTModule`` or its ``report``.

    Example:
        >>> saved_activation_bytes(om)        # doctest: +SKIP
        16384
    """
    report = getattr(ortmodule_or_report, "report", ortmodule_or_report)
    return int(getattr(report, "saved_activation_bytes", 0) or 0)


def cuda_memory(device: Any = None) -> dict[str, int] | None:
    """CUDA memory of ``device`` in bytes, or None when CUDA is not in use.

    Returns ``None`` without initializing CUDA when this process has not used it.
    See Note [Which CUDA memory].

    Returns:
        ``{"cuda_allocated", "cuda_max_allocated", "cuda_reserved", "cuda_used"}``.

    Example:
        >>> cuda_memory() is None or "cuda_used" in cuda_memory()
        True
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        return {
            "cuda_allocated": int(torch.cuda.memory_allocated(device)),
            "cuda_max_allocated": int(torch.cuda.max_memory_allocated(device)),
            "cuda_reserved": int(torch.cuda.memory_reserved(device)),
            "cuda_used": int(total - free),
        }
    except RuntimeError as e:  # a device that went away: no reading, keep training
        logger.debug("could not read CUDA memory: %s", e)
        return None


@dataclasses.dataclass
class MemorySample:
    """One memory reading (bytes).

    Attributes:
        rss: resident set size of the process.
        saved_activations: activations saved for the backward (ortlab's plan).
        cuda: :func:`cuda_memory` readings, or None on CPU.
    """

    rss: int
    saved_activations: int = 0
    cuda: dict[str, int] | None = None

    def to_dict(self) -> dict[str, int]:
        """Flat dict: ``rss_bytes``, ``saved_bytes`` and the ``cuda_*`` keys when on a GPU."""
        out = {"rss_bytes": self.rss, "saved_bytes": self.saved_activations}
        if self.cuda:
            out.update({f"{k}_bytes": v for k, v in self.cuda.items()})
        return out


def sample_memory(ortmodule: Any = None, device: Any = None) -> MemorySample:
    """Read RSS, the module's saved-activation bytes and CUDA memory.

    Example:
        >>> sample_memory().rss > 0
        True
    """
    saved = saved_activation_bytes(ortmodule) if ortmodule is not None else 0
    return MemorySample(rss=rss_bytes(), saved_activations=saved, cuda=cuda_memory(device))
