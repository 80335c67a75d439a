"""torchlib: the ONNX translations of aten ops, and which ops have one.

Shared ground: the capture stage asks which ops to keep whole (torchlib translates
them) when it builds its decomposition table, the exporter translates with the
registry, and placement asks which ops have no translation (they run in PyTorch).

Building torch.onnx's registry takes ~0.5 s; a run whose graphs all come from the
on-disk cache needs only the list of translated op names, so with ``cache_dir`` that
list is kept there too, keyed on the library versions.

The list decides which ops run in PyTorch and which ops the decompositions keep
whole, so a damaged list is as bad as a damaged model: a flipped letter in
``aten::add.Tensor`` would send every ``add`` to PyTorch in every later process. The file
carries its format, the library versions it was built for and a SHA-256 of the
names; a file that fails a check is rebuilt and rewritten, with a warning
(as the models' entries are, see Note [Trusting a cache entry] in ``ortlab.runtime.cache``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from typing import Any

import torch

from ortlab._cache_files import MISSING, note_write_failure, read_file, writable, write_atomic
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


_OPS_FORMAT = 1


def _ops_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def _read_op_list(path: str) -> frozenset[str] | None:
    """The op names of a checked list file; None when missing, or malformed (warned, removed)."""
    try:
        raw = read_file(path)
    except OSError as e:
        if e.errno in MISSING:
            return None
        problem = f"cannot read it: {e.strerror or e}"
    else:
        problem = _op_list_problem(raw)
        if not problem:
            return frozenset(json.loads(raw)["ops"])
    logger.warning("ortlab: ignoring malformed torchlib op list %s (%s); it is rebuilt from torch.onnx's registry",
                   path, problem)
    with contextlib.suppress(OSError):
        os.remove(path)
    return None


def _op_list_problem(raw: bytes) -> str:
    """What is wrong with an op list file's content ("" if nothing)."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        return f"not JSON: {e}"
    if not isinstance(data, dict):
        return f"a {type(data).__name__}, expected an object"
    if type(data.get("format")) is not int or data["format"] != _OPS_FORMAT:
        return f"format {data.get('format')!r}, expected {_OPS_FORMAT}"
    if data.get("versions") != library_versions():
        return f"built for {data.get('versions')!r}"
    names = data.get("ops")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        return "ops must be a non-empty list of op names"
    if data.get("sha256") != _ops_digest(names):
        return "its checksum does not match the op names"
    return ""


@functools.lru_cache(maxsize=4)
def translated_ops(cache_dir: str | None = None) -> frozenset[str]:
    """Names of the ops the registry translates: ``aten::add.Tensor`` and ``py:_operator.add``."""
    path = None
    if cache_dir:
        digest = hashlib.sha256(library_versions().encode()).hexdigest()[:16]
        path = os.path.join(cache_dir, f"torchlib-ops-{digest}.json")
        names = _read_op_list(path)
        if names is not None:
            return names
    registry = get_registry()
    found = frozenset(n for n in (key if isinstance(key, str) else _callable_key(key) for key in registry.functions) if n)
    if path is not None and writable(cache_dir):
        ops = sorted(found)
        data = {"format": _OPS_FORMAT, "versions": library_versions(), "ops": ops, "sha256": _ops_digest(ops)}
        try:
            write_atomic(path, json.dumps(data).encode())
        except OSError as e:
            note_write_failure(cache_dir, e)
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
