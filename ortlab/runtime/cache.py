"""On-disk cache of the models onnxruntime runs, keyed on what determines them.

The key hashes the FX graph's code (every op, argument and constant shape), the
type, shape and stride of each input, which ops stay in PyTorch, the options that
change the model, the device, and the versions of torch, onnx, onnxscript,
onnxruntime and ortlab. It never uses the module's repr: ORTModule's cache keyed on
``md5(repr(module))`` and silently served a stale graph after a code change.

An entry is the onnxruntime-optimized model (``{key}.onnx``) and what the runner
needs to call it (``{key}.json``). A hit skips the ONNX export, onnxscript's
optimizer and onnxruntime's graph optimizations.

Note [Trusting a cache entry]
A single flipped bit in a cached model can leave a valid ONNX model that computes
something else (a probe rewired a ``Mul`` input and dropped a ``Gemm`` bias: 4 of 90
flips loaded and gave wrong numbers), and the metadata tells the runner which output
is which. So the metadata carries its format, the key it was written for (two entries'
files swapped are caught), the SHA-256 of the model's bytes and a SHA-256 of its own
content; every field is checked against what the runner needs (kinds, dtypes from the
known set, output sources pointing at real inputs and earlier outputs, well-formed
guards), and once the session is built, its inputs and outputs against the metadata
(:func:`session_mismatch`). An entry that fails any check is removed with a warning
and the graph is exported again, so the next process finds a good entry instead of
failing the same way (before, a malformed entry crashed ``forward`` with a
``StopIteration`` or sent the graph to PyTorch in every later process).

Note [Two writers of one entry]
Two processes (or threads) can build the same graph at once. onnxruntime writes the
optimized model into a staged file of the cache folder; the entry is committed under
the folder's lock (``ortlab._cache_files.folder_lock``): the model first, then the
metadata, each with ``os.replace``. Readers take the same lock, so they see both files
of one writer or the files of no writer, never the model of one and the metadata of
another, and a reader never removes an entry a writer is completing. A writer killed
between the two renames leaves a model whose checksum the old metadata does not
match: dropped and rebuilt on the next load.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import re
from typing import Any

import onnxruntime as ort
import torch
import torch.fx

from ortlab._cache_files import (
    MISSING,
    discard,
    folder_lock,
    note_write_failure,
    read_file,
    stage_file,
    writable,
    write_atomic,
)
from ortlab._compat.torch import unset_fake_temporarily
from ortlab._versions import cpu_model, library_versions
from ortlab.onnx.guards import IndexGuard
from ortlab.onnx.interface import DTYPES, KINDS, GraphInterface
from ortlab.runtime.session import available_cores

__all__ = ["cache_key", "structure_key", "CacheEntry", "CachedModel", "load_entry", "stage_model", "store_entry", "drop_entry",
           "session_mismatch", "FORMAT"]

logger = logging.getLogger(__name__)

# 1: the unversioned entries before checksums; 2: format, key, model_sha256 and sha256; 3: output_views
# (a model of format 2 may return a reshaped output itself, but an older ortlab would not view a model of 3's).
FORMAT = 3

_GUARD_LOWEST = ("0", "-size")
_GUARD_ERRORS = ("IndexError", "RuntimeError")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _input_meta(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}:{tuple(val.shape)}:{tuple(val.stride())}"
    return type(val).__name__


def _placeholder_meta(gm: torch.fx.GraphModule) -> list[str]:
    return [f"{node.name}:{_input_meta(node)}" for node in gm.graph.find_nodes(op="placeholder")]


def _tensor_bytes(value: torch.Tensor) -> bytes:
    """A constant's bytes (a 0-dim tensor too: ``view(torch.uint8)`` refuses those)."""
    with unset_fake_temporarily():
        return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def cache_key(gm: torch.fx.GraphModule, blocked: dict[str, str], settings: dict[str, Any]) -> str:
    """A hash of everything that determines the model onnxruntime runs for ``gm``."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:  # lifted constants: the code names them, the key needs their data
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                h.update(_tensor_bytes(value))
    for part in (gm.code, "\n".join(_placeholder_meta(gm)), json.dumps(sorted(blocked)),
                 json.dumps(settings, sort_keys=True, default=str), library_versions()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def structure_key(gm: torch.fx.GraphModule) -> str:
    """A hash of what ``gm`` computes with its node names aside: the same layer's part in two layers of
    a model hashes alike (Note [Parts that are the same graph] in ``ortlab.runtime.race``)."""
    h = hashlib.sha256()
    index: dict[torch.fx.Node, str] = {}
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        if node.op == "placeholder":
            what = _input_meta(node)
        elif node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            what = type(value).__name__
            if isinstance(value, torch.Tensor):
                what = f"{value.dtype}:{tuple(value.shape)}:{hashlib.sha256(_tensor_bytes(value)).hexdigest()}"
        else:
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
            what = f"{node.target}{args!r}"
        h.update(f"{node.op} {what}\n".encode())
    return h.hexdigest()[:32]


class CacheEntry:
    """Paths of one entry."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder, self.key = folder, key
        self.model_path = os.path.join(folder, f"{key}.onnx")
        self.meta_path = os.path.join(folder, f"{key}.json")
        self.providers_path = os.path.join(folder, f"{key}.providers.json")
        self.providers_model_path = os.path.join(folder, f"{key}.providers.onnx")

    def exists(self) -> bool:
        return os.path.lexists(self.model_path) and os.path.lexists(self.meta_path)

    def remove(self) -> None:
        for path in (self.model_path, self.meta_path, self.providers_path, self.providers_model_path):
            discard(path)


@dataclasses.dataclass(frozen=True)
class CachedModel:
    """A checked entry: the model's bytes, how the runner calls it, and its nodes' provenance."""

    data: bytes
    interface: GraphInterface
    provenance: dict[str, dict[str, str]]


def _canonical(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def drop_entry(entry: CacheEntry, reason: str) -> None:
    """Remove an entry that cannot be trusted, with a warning saying why (the graph is exported again)."""
    with folder_lock(entry.folder):
        _drop(entry, reason)


def _drop(entry: CacheEntry, reason: str) -> None:  # under the folder's lock
    logger.warning("ortlab: dropping cache entry %s (%s); the graph is exported again and the entry rewritten",
                   entry.meta_path, reason)
    entry.remove()


def load_entry(entry: CacheEntry) -> CachedModel | None:
    """The checked entry, or None: missing, or dropped with a warning (see Note [Trusting a cache entry])."""
    with folder_lock(entry.folder):
        try:
            raw = read_file(entry.meta_path)
            data = read_file(entry.model_path)
        except OSError as e:
            if e.errno in MISSING:
                return None
            link = e.errno == errno.ELOOP  # O_NOFOLLOW met a link: never followed, removed
            reason = "a file of it is a symbolic link" if link else f"cannot read it: {e.strerror or e}"
        else:
            try:
                reason, cached = _parse(raw, data, entry.key)
            except Exception as e:  # untrusted bytes: a gap in the checks must drop the entry, not fail the graph
                reason, cached = f"unreadable: {type(e).__name__}: {e}", None
            if cached is not None:
                return cached
        _drop(entry, reason)
        return None


def _parse(raw: bytes, data: bytes, key: str) -> tuple[str, CachedModel | None]:
    """(reason, None) for an entry that fails a check, ("", model) for a good one."""
    try:
        meta = json.loads(raw)
    except ValueError as e:
        return f"metadata is not JSON: {e}", None
    if not isinstance(meta, dict):
        return f"metadata is a {type(meta).__name__}, expected an object", None
    if type(meta.get("format")) is not int or meta["format"] != FORMAT:
        return f"format {meta.get('format')!r}, expected {FORMAT} (written by another ortlab version)", None
    checksum = meta.pop("sha256", None)
    if not isinstance(checksum, str) or checksum != _digest(_canonical(meta)):
        return "the metadata's checksum does not match its content", None
    if meta.get("key") != key:
        return f"it was written for key {meta.get('key')!r}", None
    if meta.get("model_sha256") != _digest(data):
        return "the model's checksum does not match the metadata", None
    problem = _check_fields(meta)
    if problem:
        return problem, None
    return "", CachedModel(data, GraphInterface.from_json(meta), meta["provenance"])


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_fields(meta: dict[str, Any]) -> str:
    """What is wrong with the runner's fields of ``meta`` ("" if nothing)."""
    inputs, kinds = meta.get("input_kinds"), meta.get("output_kinds")
    dtypes, sources = meta.get("output_dtypes"), meta.get("output_sources")
    if not isinstance(inputs, list) or any(k not in KINDS for k in inputs):
        return f"input_kinds must be a list of {KINDS}"
    for name, value in (("output_kinds", kinds), ("output_dtypes", dtypes), ("output_sources", sources)):
        if not isinstance(value, list):
            return f"{name} must be a list"
    if not len(kinds) == len(dtypes) == len(sources):
        return f"output_kinds, output_dtypes and output_sources have {len(kinds)}, {len(dtypes)}, {len(sources)} items"
    for i, (kind, dtype, source) in enumerate(zip(kinds, dtypes, sources)):
        if kind is not None and kind not in KINDS:
            return f"output_kinds[{i}] is {kind!r}, expected one of {KINDS} or null"
        if (dtype is None) != (kind != "tensor") or (dtype is not None and (not isinstance(dtype, str)
                                                                            or dtype not in DTYPES)):
            return f"output_dtypes[{i}] is {dtype!r} for a {kind} output"
        if source is None:
            continue
        if kind is None or not isinstance(source, list) or len(source) != 2 or not _is_int(source[1]):
            return f"output_sources[{i}] is {source!r}, expected null or ['input'|'output', index]"
        where, index = source
        if where == "input":
            ok = 0 <= index < len(inputs)
        else:  # an earlier output that onnxruntime produces
            ok = where == "output" and 0 <= index < i and kinds[index] is not None and sources[index] is None
        if not ok:
            return f"output_sources[{i}] is {source!r}, which names no input or earlier output"
    provenance = meta.get("provenance")
    if not isinstance(provenance, dict) or not all(
            isinstance(v, dict) and all(isinstance(x, str) for x in v.values()) for v in provenance.values()):
        return "provenance must map node names to {field: text}"
    views = meta.get("output_views")
    if not isinstance(views, list) or (views and len(views) != len(kinds)):
        return "output_views must be an empty list or one entry per output"
    for i, view in enumerate(views):
        if view is not None and (kinds[i] != "tensor" or not isinstance(view, list)
                                 or not all(_is_int(n) and n >= 0 for n in view)):
            return f"output_views[{i}] is {view!r}, expected null or a tensor output's shape"
    guards = meta.get("guards")
    if not isinstance(guards, list):
        return "guards must be a list"
    fields = {f.name: f.type for f in dataclasses.fields(IndexGuard)}
    for i, g in enumerate(guards):
        if not isinstance(g, dict) or set(g) != set(fields):
            return f"guards[{i}] must have exactly the fields {sorted(fields)}"
        if not all(isinstance(g[k], str) for k in ("output", "message", "where")) or not _is_int(g["dim"]) \
                or g["dim"] < 0 or g["lowest"] not in _GUARD_LOWEST or g["error"] not in _GUARD_ERRORS:
            return f"guards[{i}] is malformed: {g!r}"
    return ""


def session_mismatch(cached: CachedModel, session: ort.InferenceSession) -> str:
    """How the session of a cached model disagrees with its metadata ("" if it does not)."""
    inputs, outputs = session.get_inputs(), [o.name for o in session.get_outputs()]
    interface = cached.interface
    if len(inputs) != len(interface.input_kinds):
        return f"the model has {len(inputs)} inputs, the metadata {len(interface.input_kinds)}"
    produced = sum(1 for k, s in zip(interface.output_kinds, interface.output_sources) if k is not None and s is None)
    if len(outputs) != produced + len(interface.guards):
        return (f"the model has {len(outputs)} outputs, the metadata {produced} plus {len(interface.guards)} "
                "index guards")
    if [g.output for g in interface.guards] != outputs[produced:]:
        return "the index guards name other outputs than the model's last ones"
    return ""


def stage_model(entry: CacheEntry) -> str | None:
    """A staged file in the cache folder for onnxruntime to write the optimized model to.

    None when the folder takes no writes (warned once; see Note [A cache folder that
    stops taking writes] in ``ortlab._cache_files``).
    """
    if not writable(entry.folder):
        return None
    try:
        return stage_file(entry.folder, f"{entry.key}.onnx")
    except OSError as e:
        note_write_failure(entry.folder, e)
        return None


def store_entry(entry: CacheEntry, staged: str, interface: GraphInterface,
                provenance: dict[str, dict[str, str]] | None = None) -> bool:
    """Commit ``staged`` (the model onnxruntime wrote) as the entry's model, with how the runner calls it.

    ``provenance`` maps node names to their source (onnxruntime's optimized model has
    lost the nodes' ``ortlab.*`` metadata). See Note [Two writers of one entry]. Returns
    whether the entry was written; a folder that takes no writes is warned about once.
    """
    try:
        model = read_file(staged)
        if not model:  # onnxruntime wrote nothing: nothing worth keeping, and no fault of the folder
            discard(staged)
            return False
        meta: dict[str, Any] = {
            "format": FORMAT,
            "key": entry.key,
            "model_sha256": _digest(model),
            **interface.to_json(),
            "provenance": {k: v for k, v in (provenance or {}).items() if any(v.values())},
        }
        meta["sha256"] = _digest(_canonical(meta))
        with folder_lock(entry.folder):
            os.replace(staged, entry.model_path)  # the model first: metadata never names a model not there
            write_atomic(entry.meta_path, json.dumps(meta).encode())
        return True
    except OSError as e:
        discard(staged)
        note_write_failure(entry.folder, e)
        return False


# Note [Stored provider decisions]
# Which execution provider ran a part fastest was measured on its first calls
# (``ortlab.runtime.race``): seconds of building and running every candidate. The decision
# is stored beside the entry (``{key}.providers.json``), with the candidates it was made
# among, so a later process that loads the entry builds the winner's session directly. A
# decision made among other candidates (a provider installed or removed since) is not
# used: the race runs again. A damaged decision costs a measurement, not a wrong result.
# Nor is one measured on another machine: a cache folder shared between machines (a
# network home, a container image with a warm cache) would otherwise run every part on
# the provider that was fastest on the CPU it was first measured on (OpenVINO on a Xeon,
# where on an AMD EPYC with AVX-512 the CPU provider was the faster one). The decision
# carries the CPU's model name and the cores this process may use (``this_machine``);
# the cached model itself does not depend on them and is used either way.
#
# The entry's model is the one onnxruntime optimized for the session built first (the CPU
# provider's, with its fused ``com.microsoft`` ops). A plugin provider that won measured
# another model: the exported one, which it compiles itself. Built on the CPU provider's
# model instead, a cached start ran a different graph than the one measured (the GPT's step
# 2-3% slower) and OpenVINO's compiled-model cache missed (its key is the model), so the
# first cached start compiled again (0.25 s). So a plugin winner's own model is stored
# beside the decision (``{key}.providers.onnx``) with its SHA-256 and the optimization level
# it was built at; a model whose checksum does not match is not used (the race runs again),
# and its session's inputs and outputs are checked like the entry's.


@functools.lru_cache(maxsize=1)
def this_machine() -> str:
    """The CPU's model name and the cores this process may use (``Intel(R) Xeon(R) ... x 2 cores``): what a
    measured provider decision depends on beyond the model (Note [Stored provider decisions])."""
    return f"{cpu_model()} x {available_cores()} cores"


@dataclasses.dataclass(frozen=True)
class StoredDecision:
    """A race's winner for an entry, how it was measured, and the model it ran (None: the entry's own)."""

    chosen: tuple[str, ...]
    described: str
    model: bytes | None = None
    level: str | None = None


def store_decision(entry: CacheEntry, chosen: tuple[str, ...], candidates: list[tuple[str, ...]],
                   described: str, model: bytes | None = None, level: str | None = None) -> None:
    """Keep a race's winner for ``entry``, and the model it ran when not the entry's (see Note [Stored
    provider decisions])."""
    data: dict[str, Any] = {"chosen": list(chosen), "candidates": sorted(list(c) for c in candidates),
                            "described": described, "machine": this_machine()}
    if model is not None:
        data.update(model_sha256=_digest(model), level=level)
    try:
        if writable(entry.folder):
            with folder_lock(entry.folder):
                if model is not None:
                    write_atomic(entry.providers_model_path, model)
                write_atomic(entry.providers_path, json.dumps(data).encode())
    except OSError as e:
        note_write_failure(entry.folder, e)


def load_decision(entry: CacheEntry, candidates: list[tuple[str, ...]]) -> StoredDecision | None:
    """The stored winner for ``entry`` and how it was measured, if it was chosen among ``candidates`` on this
    machine (and its model, when one is stored and matches its checksum)."""
    try:
        data = json.loads(read_file(entry.providers_path))
        if data.get("machine") != this_machine():
            return None  # measured on another CPU, or with other cores: measured again (Note [Stored provider decisions])
        chosen = tuple(data["chosen"])
        stored = sorted(list(c) for c in data["candidates"])
        described = str(data["described"])
        model, level = None, None
        if "model_sha256" in data:
            level = data["level"]
            if level is not None and not isinstance(level, str):
                return None
            with folder_lock(entry.folder):
                model = read_file(entry.providers_model_path)
            if _digest(model) != data["model_sha256"]:
                logger.warning("ortlab: the model stored with %s does not match its checksum; the providers are "
                               "measured again", entry.providers_path)
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    wanted = sorted(list(c) for c in candidates)
    if stored != wanted or list(chosen) not in wanted or not all(isinstance(n, str) for n in chosen):
        return None
    return StoredDecision(chosen, described, model, level)
