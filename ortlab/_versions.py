"""The versions of the libraries a cached artifact depends on (cache keys, the torchlib op list)."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

__all__ = ["library_versions", "instruction_sets", "cpu_model", "cpu_description"]

# Note [Cached models and the CPU's instruction sets]
# A cache entry is the model onnxruntime optimized at level "all", which may hold layout
# rewrites for this CPU: its NCHWc transformer blocks a convolution's channels by the
# vector width MLAS picks here (16 with AVX-512, 8 with AVX2), and onnxruntime warns that such
# a model "should only be used in the same environment the model was optimized in". ortlab's
# graphs feed their weights as inputs, which the transformer leaves alone, but a constant
# weight inside a graph is an initializer it rewrites. So the cache key holds the instruction
# sets MLAS and OpenVINO dispatch on: a cache folder shared between a machine with AVX-512
# and one without misses (and exports again) instead of serving one the other's layout.
_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


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
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (``model name``, ``flags``, ...); {} where there is
    none (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name (``Intel(R) Xeon(R) Processor @ 2.50GHz``), or what the platform module knows."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_description() -> str:
    """:func:`cpu_model` with the family, model and widest vector extension where ``/proc/cpuinfo`` has them:
    cloud machines all named "AMD EPYC" differ (a Zen 4, family 25 model 17, runs onnxruntime's GEMMs no faster
    than PyTorch's; the EPYC of the 2026-11-22 figures in docs/benchmarks.md ran them up to twice as fast), so a benchmark's
    figures are comparable on the same one only."""
    info = _cpuinfo()
    if "cpu family" not in info:
        return cpu_model()
    flags = set(info.get("flags", "").split())
    vector = ("AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
              else "no AVX2")
    return f"{cpu_model()} (family {info['cpu family']} model {info.get('model', '?')}, {vector})"


@functools.lru_cache(maxsize=1)
def instruction_sets() -> str:
    """The vector instruction sets of this CPU that kernels dispatch on (``avx,avx2,...,avx512f``; Note [Cached
    models and the CPU's instruction sets]), from ``/proc/cpuinfo``; "" where it cannot be read (not Linux)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return ",".join(flag for flag in _ISA_FLAGS if flag in flags)


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """``torch|onnx|onnxscript|onnxruntime|ortlab+code|machine+instruction sets``: what a cached model or op list
    depends on.

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
                     f"{__version__}+{_code_digest()}", f"{platform.machine()}+{instruction_sets()}"))
