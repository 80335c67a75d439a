"""torchlib: the ONNX translations of aten ops, and which ops have one.

Shared ground: the capture stage asks which ops to keep whole (torchlib translates
them) when it builds its decomposition table, the exporter translates with the
registry, and placement asks which ops have no translation (they run in PyTorch).

Building torch.onnx's registry takes ~0.5 s; a run whose graphs all come from the
on-disk cache needs only the list of translated op names, so with ``cache_dir`` that
list is kept there too, keyed on the library versions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Any

import torch

from ortlab._compat.torch import EXPORTER_LOGGERS, OpOverload, torchlib_registry
from ortlab._versions import library_versions

__all__ = ["get_registry", "translated_ops", "is_translated", "overload"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def get_registry() -> Any:
    """torch.onnx's registry of torchlib translations, with ortlab's own (built once, ~0.5 s)."""
    reg_logger = logging.getLogger(EXPORTER_LOGGERS[1])
    old = reg_logger.level
    reg_logger.setLevel(logging.ERROR)  # "torchvision is not installed" noise
    try:
        registry = torchlib_registry()
    finally:
        reg_logger.setLevel(old)
    from ortlab.torchlib.translations import register  # our own translations for torchlib's gaps

    register(registry)
    return registry


def _callable_key(target: object) -> str | None:
    """``py:<module>.<qualname>`` of a plain Python callable target (``operator.add``)."""
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or name is None or isinstance(target, OpOverload):
        return None
    return f"py:{module}.{name}"


@functools.lru_cache(maxsize=4)
def translated_ops(cache_dir: str | None = None) -> frozenset[str]:
    """Names of the ops the registry translates: ``aten::add.Tensor`` and ``py:_operator.add``."""
    path = None
    if cache_dir:
        digest = hashlib.sha256(library_versions().encode()).hexdigest()[:16]
        path = os.path.join(cache_dir, f"torchlib-ops-{digest}.json")
        try:
            with open(path) as f:
                names = json.load(f)
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                return frozenset(names)
            logger.warning("ortlab: ignoring malformed torchlib op list %s", path)
        except (OSError, ValueError):
            pass
    registry = get_registry()
    found = frozenset(n for n in (key if isinstance(key, str) else _callable_key(key) for key in registry.functions) if n)
    if path is not None:
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(sorted(found), f)
            os.replace(tmp, path)
        except OSError as e:
            logger.debug("could not write %s: %s", path, e)
    return found


def is_translated(target: object, cache_dir: str | None = None) -> bool:
    """Whether torchlib (or ortlab) has an ONNX translation for an FX node's target."""
    if isinstance(target, OpOverload):
        return target.name() in translated_ops(cache_dir)
    key = _callable_key(target)
    if key is None:  # higher-order ops and other objects: ask the registry itself
        return get_registry().is_registered(target)
    return key in translated_ops(cache_dir)


def overload(name: str) -> OpOverload | None:
    """``aten::add.Tensor`` -> ``torch.ops.aten.add.Tensor`` (None if it does not resolve)."""
    namespace, _, rest = name.partition("::")
    packet, _, over = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), over or "default")
    except (AttributeError, RuntimeError):
        return None
