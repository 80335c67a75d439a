"""Reading and writing lab folders safely: manifests checked before use, files kept inside the folder.

A lab folder (``lab.json``) or stage folder (``stage.json``) may come from someone
else: a shared run, a downloaded example. Before a record is built from it, its
manifest is checked here, every field of the types ortlab writes (a wrong one raises
a :class:`~ortlab.errors.ConfigError` naming the entry), and every artifact path is
checked to stay inside the folder.

Note [Artifact paths stay inside the folder]
An artifact is a path relative to the lab folder. A manifest could name
``/etc/passwd`` or ``../../.bashrc``, or the folder could hold a symlink leading out
of it; then ``stage.view()`` would show that file and ``lab.save(dest)`` would copy
it, or write over ``dest/../payload.py``. So a path must be relative without ``..``,
and must resolve (symlinks followed, :func:`os.path.realpath`) inside the folder: when
the manifest is read, and again each time a file is opened (:func:`inside`), since
the folder can change after it was read. Files are written through a temporary file
in the destination folder and :func:`os.replace`, which replaces a symlink in the way
rather than writing through it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable
from typing import Any

from ortlab.errors import ConfigError, InternalError
from ortlab.stages import LAB_STAGES

__all__ = ["read_manifest", "check_stage", "check_lab", "inside", "relative_path", "copy_into", "write_json"]

FORMAT_VERSION = 1
STATUSES = ("pending", "done", "skipped", "failed")
LAB_STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in LAB_STAGES)
_FIX = ("The file was not written by ortlab, or was changed since: fix or remove that entry, "
        "or save the lab again with ortlab (lab.save(folder)).")


def _bad(where: str, expected: str, value: Any) -> ConfigError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(f"{where}: expected {expected}, found {shown}. {_FIX}")


# ------------------------------------------------------------------------------------ types
def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "a string", value)
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(where, "a whole number >= 0", value)
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, "true or false", value)
    return value


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(where, "a finite number of seconds", value)
    return value


def _scalar(value: Any, where: str) -> Any:
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise _bad(where, "a string, number, true/false or null", value)
    return value


def _list(check: Callable[[Any, str], Any]) -> Callable[[Any, str], list]:
    def checked(value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise _bad(where, "a list", value)
        return [check(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return checked


def _mapping(check: Callable[[Any, str], Any]) -> Callable[[Any, str], dict]:
    def checked(value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise _bad(where, "an object (a JSON {...})", value)
        return {k: check(v, f"{where}[{k!r}]") for k, v in value.items()}
    return checked


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, where: None if value is None else check(value, where)


def _summary_value(value: Any, where: str) -> Any:
    return _list(_scalar)(value, where) if isinstance(value, list) else _scalar(value, where)


def _stage_name(value: Any, where: str) -> str:
    if value not in LAB_STAGE_NAMES:
        raise _bad(where, f"a stage name, one of {list(LAB_STAGE_NAMES)}", value)
    return value


def _previous(value: Any, where: str) -> str:
    return "" if value == "" else _stage_name(value, where)


def _status(value: Any, where: str) -> str:
    if value not in STATUSES:
        raise _bad(where, f"a status, one of {list(STATUSES)}", value)
    return value


_counts = _mapping(_count)

# The JSON types of the fields of the table rows (GraphBreak, ActivationRow, FallbackRow),
# by their annotation: a row field of another type needs an entry here.
_ROW_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "str": _text, "int": _count, "bool": _flag, "tuple[int, ...]": _list(_count), "list[str]": _list(_text),
    "int | None": _optional(_count),
}


def _record(fields: dict[str, Callable[[Any, str], Any]], required: tuple[str, ...]) -> Callable[[Any, str], dict]:
    """An object with ``fields`` (others are ignored, as newer versions may add some), ``required`` present."""
    def checked(value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise _bad(where, "an object (a JSON {...})", value)
        missing = [k for k in required if k not in value]
        if missing:
            raise ConfigError(f"{where}: the entries {missing} are missing (it needs {list(required)}). {_FIX}")
        return {k: fields[k](v, f"{where}.{k}") for k, v in value.items() if k in fields}
    return checked


def _row_check(row_type: type) -> Callable[[Any, str], dict]:
    """The check of a table row's JSON object, from the fields of its dataclass."""
    fields, required = {}, []
    for f in dataclasses.fields(row_type):
        check = _ROW_FIELDS.get(str(f.type))
        if check is None:
            raise InternalError(f"no JSON check for field {row_type.__name__}.{f.name} of type {f.type}",
                                context="checking a lab manifest")
        fields[f.name] = check
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    return _record(fields, tuple(required))


_DIFF = _record({"added": _counts, "removed": _counts, "before": _count, "after": _count}, ("added", "removed"))


def check_stage(data: Any, where: str, rows: dict[str, type]) -> dict[str, Any]:
    """A stage's JSON object with every field of the type ortlab writes, or a ConfigError naming the entry.

    ``rows``: the table fields and their row dataclasses. Artifact paths are checked to
    be relative without ``..`` (see :func:`inside` for where they lead).
    """
    fields: dict[str, Callable[[Any, str], Any]] = {
        "name": _stage_name, "status": _status, "title": _text, "description": _text, "previous": _previous,
        "error": _text, "op_counts": _counts, "graph_op_counts": _mapping(_counts), "diff": _optional(_DIFF),
        "seconds": _optional(_seconds), "timings": _mapping(_seconds), "artifacts": _mapping(relative_path),
        "summary": _mapping(_summary_value), "notes": _list(_text),
    }
    fields.update({key: _list(_row_check(row_type)) for key, row_type in rows.items()})
    return _record(fields, ("name", "status"))(data, where)


def check_lab(data: dict[str, Any], where: str) -> None:
    """A lab manifest's stages (a list of stage objects, each stage once) and meta (an object)."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        raise _bad(f"{where}: stages", "the list of the lab's stages", stages)
    if len(stages) > len(LAB_STAGE_NAMES):
        raise _bad(f"{where}: stages", f"at most the {len(LAB_STAGE_NAMES)} stages of a lab", f"{len(stages)} stages")
    names = [s.get("name") if isinstance(s, dict) else None for s in stages]
    twice = sorted({str(n) for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{where}: stages: {twice} appear more than once; each stage is listed once. {_FIX}")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise _bad(f"{where}: meta", "an object (a JSON {...})", meta)
    if "model" in meta:
        _text(meta["model"], f"{where}: meta.model")
    if "inputs" in meta:
        _list(_text)(meta["inputs"], f"{where}: meta.inputs")


def read_manifest(path: str, kind: str) -> dict[str, Any]:
    """The JSON object of a manifest of ``kind`` (``ortlab.lab``, ``ortlab.stage``) at most of our version."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist: not a folder saved by ortlab ({kind}).")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, RecursionError) as e:  # not JSON (or nested deeper than any manifest)
        raise ConfigError(f"{path} is not a JSON manifest of ortlab ({kind}): {e}. {_FIX}") from None
    version = data.get("version", 0) if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != kind or isinstance(version, bool)
            or not isinstance(version, int) or version > FORMAT_VERSION):
        found = (data.get("format"), version) if isinstance(data, dict) else (type(data).__name__, None)
        raise ConfigError(
            f"{path} is not a {kind} manifest of version <= {FORMAT_VERSION} "
            f"(found {found[0]!r} version {found[1]!r}); upgrade ortlab to read it."
        )
    return data


# ------------------------------------------------------------------------------------ paths
def relative_path(rel: Any, where: str) -> str:
    """``rel`` if it is a path relative to the folder without ``..``; else a ConfigError.

    Example:
        >>> relative_path("net_forward_exported_train.onnx", "artifact")
        'net_forward_exported_train.onnx'
    """
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise _bad(where, "a file name relative to the lab folder", rel)
    parts = re.split(r"[\\/]", rel)
    if os.path.isabs(rel) or rel[0] in "/\\" or re.match(r"^[A-Za-z]:", rel) or ".." in parts:
        raise ConfigError(f"{where}: {rel!r} is not a path inside the lab folder: artifact paths are relative "
                          f"to it, without '..' and not absolute (see Note [Artifact paths stay inside the folder]). "
                          f"{_FIX}")
    return rel


def _within(root: str, path: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    real_root, real = os.path.realpath(root or "."), os.path.realpath(path)
    return os.path.commonpath([real_root, real]) == real_root


def inside(root: str, rel: Any, where: str) -> str:
    """``root/rel``, checked to resolve inside ``root`` now (Note [Artifact paths stay inside the folder]).

    Raises:
        ConfigError: ``rel`` is absolute, has ``..``, or leads out of ``root`` through a symlink.
    """
    path = os.path.join(root, relative_path(rel, where))
    if os.path.realpath(path) == os.path.realpath(root or "."):
        raise _bad(where, "a file inside the lab folder, not the folder itself", rel)
    if not _within(root, path):
        raise ConfigError(f"{where}: {rel!r} leads outside the lab folder {os.path.abspath(root or '.')} "
                          f"(to {os.path.realpath(path)}) through a symlink; ortlab opens and copies only files "
                          f"inside the folder. Replace the link by the file itself.")
    return path


def copy_into(src_root: str, dst_root: str, rel: str, where: str) -> None:
    """Copy ``src_root/rel`` to ``dst_root/rel``, both inside their folders; a symlink at the target is replaced."""
    src = inside(src_root, rel, where)
    dst = os.path.join(dst_root, rel)
    if os.path.realpath(src) == os.path.realpath(dst):
        return
    parent = os.path.dirname(dst)
    if not _within(dst_root, parent):  # a folder on the way is a symlink leading out
        raise ConfigError(f"{where}: cannot save {rel!r} into {os.path.abspath(dst_root)}: the folder "
                          f"{parent} leads outside it (to {os.path.realpath(parent)}). Save into another folder.")
    os.makedirs(parent, exist_ok=True)
    with open(src, "rb") as f:
        _replace(parent, os.path.basename(dst), lambda out: shutil.copyfileobj(f, out), stat_from=src)


def write_json(folder: str, name: str, doc: Any) -> str:
    """Write ``folder/name`` as JSON through a temporary file (a symlink at the target is replaced)."""
    text = json.dumps(doc, indent=1).encode("utf-8")
    return _replace(folder, name, lambda out: out.write(text))


def _replace(folder: str, name: str, write: Callable[[Any], Any], stat_from: str | None = None) -> str:
    """Write ``folder/name`` as a new file: a fresh temporary file (``O_EXCL``: never through a link)
    renamed over it, with ``stat_from``'s mode and times (as ``shutil.copy2``)."""
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        if stat_from is not None:
            shutil.copystat(stat_from, tmp)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return os.path.join(folder, name)
