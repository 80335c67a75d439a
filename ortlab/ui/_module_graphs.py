"""The graphs a trained ORTModule runs, as files netron shows: written once, linked from tables.

The toggles and the monitor's kernel table link rows to the module's own graphs, not to
a lab of a copy of the model (``ortlab.explore``). :class:`ModuleGraphs` is a stage sink
(``ortlab.stages``) fed with the model each onnxruntime session runs
(``Report.session_stages``): the exported model as its session got it, whose node names
are the ones onnxruntime's profile names before its own fusions and whose nodes carry
``ortlab.fx_node``, ``ortlab.module`` and ``ortlab.source`` (for a part loaded from the
on-disk cache, the model its session loaded, its provenance restored from the entry).
It keeps each file's label in memory; no file name is parsed back.

The files live in a temp folder per module, removed when the module is garbage
collected or at exit. A re-capture (``reconfigure``, a new input size) writes a new
generation next to the old one, so links already shown keep working.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import weakref
from typing import Any

from ortlab.stages import StageArtifact, Stages, file_name
from ortlab.ui._links import Files, Linker

__all__ = ["ModuleGraphs", "graph_files", "module_linker", "remove_graph_folder"]

logger = logging.getLogger(__name__)

_FRAME = f"ortlab_netron_{secrets.token_hex(4)}_"  # unique to this process: outputs of an earlier run keep theirs
_FRAMES = itertools.count()


class ModuleGraphs:
    """The graphs of one ORTModule in a temp folder, rewritten when it re-captures (a stage sink)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ortlab-graphs-")
        self.files: Files = []
        self._key: tuple[int, ...] | None = None
        self._generation = 0
        self._folder = self.root
        self._prefix = "model"
        weakref.finalize(self, remove_graph_folder, self.root)

    def wants(self, stage: str) -> bool:
        return stage in ("exported", "onnxscript", "execution")

    def accept(self, artifact: StageArtifact) -> None:
        path = os.path.join(self._folder, file_name(self._prefix, artifact))
        with open(path, "wb") as f:
            f.write(artifact.onnx_bytes())
        self.files.append((artifact.label, path))

    def update(self, ortmodule: Any) -> Files:
        """``(label, path)`` of every onnxruntime part the module runs now (written on first use)."""
        report = ortmodule.report
        key = tuple(id(part.runner) for c in report.captures for g in c.graphs for part in g.parts)
        if key == self._key:
            return self.files
        self._folder = os.path.join(self.root, str(self._generation))
        os.makedirs(self._folder)
        module = getattr(ortmodule, "module", ortmodule)
        self._prefix = re.sub(r"[^a-z0-9]", "", type(module).__name__.lower()) or "model"
        self.files, self._key = [], key
        sink = Stages([self])
        for artifact in report.session_stages():
            sink.emit(artifact)
        self._generation += 1
        return self.files


def remove_graph_folder(root: str) -> None:
    """Stop serving a temp folder of graphs and delete it (when what wrote it is collected)."""
    from ortlab.ui._netron_server import forget_folder

    forget_folder(root)
    shutil.rmtree(root, ignore_errors=True)


_GRAPHS: weakref.WeakKeyDictionary[Any, ModuleGraphs] = weakref.WeakKeyDictionary()


def graph_files(ortmodule: Any) -> Files:
    """The module's graphs as ``(label, path)``, written once per capture.

    Example:
        >>> graph_files(om)[0]            # doctest: +SKIP
        ('g0.forward', '/tmp/ortlab-graphs-x1/0/gpt_g0_forward_exported_train.onnx')
    """
    graphs = _GRAPHS.get(ortmodule)
    if graphs is None:
        graphs = _GRAPHS[ortmodule] = ModuleGraphs()
    return graphs.update(ortmodule)


def module_linker(ortmodule: Any) -> Linker:
    """A :class:`Linker` into the module's own graphs (starting the shared netron server),
    opening links in a frame of its own: each table shows its nodes right below it."""
    return Linker(lambda: graph_files(ortmodule), f"{_FRAME}{next(_FRAMES)}", start=True)
