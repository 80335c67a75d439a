"""The graphs a trained ORTModule runs, as files netron shows: written once, linked from tables.

The toggles and the monitor's kernel table link rows to the module's own graphs, not to
a lab of a copy of the model (``ortlab.explore``). Each onnxruntime part of the report
(``GraphRecord.parts``) is written as its session got it: the exported model after
onnxscript's optimizer, whose node names are the ones onnxruntime's profile names
before its own fusions (see ``ortlab.inspect.profile.onnx_node_name``), and whose nodes
carry ``ortlab.fx_node``, ``ortlab.module`` and ``ortlab.source``. A part loaded from
the on-disk cache has no ExportedGraph: the model its session loaded is written, its
nodes given their source again from the provenance stored with the cache entry.

Files are named like saved stages (``gpt_g0_forward_fused_0_exported_train.onnx``,
label ``g0.forward.fused_0``) in a temp folder per module, removed when the module
is garbage collected or at exit. A re-capture (``reconfigure``, a new input size)
writes a new generation next to the old one, so links already shown keep working.
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

from ortlab.ui._links import Files, Linker

__all__ = ["ModuleGraphs", "graph_files", "module_linker"]

logger = logging.getLogger(__name__)

_FRAME = f"ortlab_netron_{secrets.token_hex(4)}_"  # unique to this process: outputs of an earlier run keep theirs
_FRAMES = itertools.count()


class ModuleGraphs:
    """The exported graphs of one ORTModule in a temp folder, rewritten when it re-captures."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="ortlab-graphs-")
        self.files: Files = []
        self._key: tuple[int, ...] | None = None
        self._generation = 0
        weakref.finalize(self, _remove, self.root)

    def update(self, ortmodule: Any) -> Files:
        """``(label, path)`` of every onnxruntime part the module runs now (written on first use)."""
        parts = [(f"g{c.index}", g, runner, exported)
                 for c in ortmodule.report.captures for g in c.graphs for runner, exported in g.parts]
        key = tuple(id(runner) for _, _, runner, _ in parts)
        if key == self._key:
            return self.files
        folder = os.path.join(self.root, str(self._generation))
        os.makedirs(folder)
        prefix = re.sub(r"[^a-z0-9]", "", type(getattr(ortmodule, "module", ortmodule)).__name__.lower()) or "model"
        files = []
        for index, graph, runner, exported in parts:
            try:
                model = _model_of(runner, exported)
            except Exception as e:  # an unreadable part: the rest still link
                logger.debug("no graph file for a part of %s.%s: %s", index, graph.name, e)
                continue
            part = model.graph.name[len(graph.name) + 1:] if model.graph.name.startswith(graph.name + "_") else ""
            stage = f"{graph.name}_{part}" if part else graph.name
            path = os.path.join(folder, f"{prefix}_{index}_{stage}_exported_{graph.mode}.onnx")
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
            files.append((f"{index}.{graph.name}" + (f".{part}" if part else ""), path))
        self.files, self._key = files, key
        self._generation += 1
        return files


def _model_of(runner: Any, exported: Any) -> Any:
    """The ONNX model (``onnx.ModelProto``) of a part, its nodes carrying their source."""
    import onnx

    from ortlab.ui._netron_graphs import annotate_from

    if exported is not None:
        return onnx.load_from_string(exported.to_bytes())
    source = runner.session_source.model
    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source, load_external_data=False)
    return annotate_from(model, runner.provenance or {}) or model


def _remove(root: str) -> None:
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
