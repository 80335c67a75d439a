"""On-disk cache of the models onnxruntime runs, keyed on what determines them.

The key hashes the FX graph's code (every op, argument and constant shape), the
type, shape and stride of each input, which ops stay in PyTorch, the options that
change the model, the device, and the versions of torch, onnx, onnxscript,
onnxruntime and ortlab. It never uses the module's repr: ORTModule's cache keyed on
``md5(repr(module))`` and silently served a stale graph after a code change.

An entry is the onnxruntime-optimized model (``{key}.onnx``) and what the runner
needs to call it (``{key}.json``). A hit skips the ONNX export, onnxscript's
optimizer and onnxruntime's graph optimizations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch
import torch.fx

from ortlab._compat.torch import unset_fake_temporarily
from ortlab._versions import library_versions
from ortlab.onnx.guards import IndexGuard

__all__ = ["cache_key", "CacheEntry", "load_entry", "store_meta"]

logger = logging.getLogger(__name__)

_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _placeholder_meta(gm: torch.fx.GraphModule) -> list[str]:
    metas = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            metas.append(f"{node.name}:{val.dtype}:{tuple(val.shape)}:{tuple(val.stride())}")
        else:
            metas.append(f"{node.name}:{type(val).__name__}")
    return metas


def cache_key(gm: torch.fx.GraphModule, blocked: dict[str, str], settings: dict[str, Any]) -> str:
    """A hash of everything that determines the model onnxruntime runs for ``gm``."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:  # lifted constants: the code names them, the key needs their data
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                with unset_fake_temporarily():
                    h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for part in (gm.code, "\n".join(_placeholder_meta(gm)), json.dumps(sorted(blocked)),
                 json.dumps(settings, sort_keys=True, default=str), library_versions()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


class CacheEntry:
    """Paths of one entry."""

    def __init__(self, folder: str, key: str) -> None:
        self.model_path = os.path.join(folder, f"{key}.onnx")
        self.meta_path = os.path.join(folder, f"{key}.json")

    def exists(self) -> bool:
        return os.path.exists(self.model_path) and os.path.exists(self.meta_path)

    def remove(self) -> None:
        for path in (self.model_path, self.meta_path):
            if os.path.exists(path):
                os.remove(path)


def store_meta(entry: CacheEntry, input_kinds: list, output_kinds: list, output_dtypes: list,
               output_sources: list, provenance: dict[str, dict[str, str]] | None = None,
               guards: list[IndexGuard] | None = None) -> None:
    """Write the runner metadata of an entry; ``provenance`` maps node names to their source
    (onnxruntime's optimized model has lost the nodes' ``ortlab.*`` metadata)."""
    meta = {
        "input_kinds": input_kinds,
        "output_kinds": output_kinds,
        "output_dtypes": [str(d) if d is not None else None for d in output_dtypes],
        "output_sources": output_sources,
        "provenance": {k: v for k, v in (provenance or {}).items() if any(v.values())},
        "guards": [g.to_dict() for g in guards or []],
    }
    tmp = entry.meta_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, entry.meta_path)  # the .json appearing last marks the entry complete


def load_entry(entry: CacheEntry) -> dict | None:
    """The runner metadata of an entry, or None if it is unreadable."""
    try:
        with open(entry.meta_path) as f:
            meta = json.load(f)
        meta["output_dtypes"] = [_DTYPES[d] if d is not None else None for d in meta["output_dtypes"]]
        meta["output_sources"] = [tuple(s) if s is not None else None for s in meta["output_sources"]]
        meta.setdefault("provenance", {})
        meta["guards"] = [IndexGuard.from_dict(g) for g in meta.get("guards", [])]
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable cache entry %s: %s", entry.meta_path, e)
        return None
