"""Links from table rows to their node in netron: a saved activation, an op, a fallback, a kernel.

A :class:`Linker` knows a set of exported ONNX graphs by label (``g0.forward``,
``g0.forward.fused_0``: one file per onnxruntime partition) and turns a row into the
URL of a netron view of the graph that has its node, the node selected (netron then
shows its ``ortlab.module`` and ``ortlab.source``). The graphs come from a lab's
``exported`` stage (:meth:`Linker.for_stage`, the stepper's tables) or from the trained
ORTModule itself (``ortlab.ui._module_graphs``, the toggles and the monitor's kernel
table). Links open in the IFrame named ``frame``; a linker that is not ``active``
(netron missing, or no server running when it must not start one) gives no URLs and
tables show plain text.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from ortlab.errors import ConfigError
from ortlab.inspect.lab_stage import ActivationRow, FallbackRow, Stage
from ortlab.inspect.profile import NodeTime
from ortlab.provenance import onnx_node_index
from ortlab.ui._html import link
from ortlab.ui._netron_frame import FOCUS_JS, frame_html

_VIEWERS = itertools.count(1)  # each view under a table is a frame of its own (Note [A link opens in the frame ...])

__all__ = ["Linker"]

logger = logging.getLogger(__name__)

Files = list[tuple[str, str]]  # (label, path of an exported ONNX graph)


class Linker:
    """URLs of netron views for table rows; ``None`` everywhere when not ``active``.

    Args:
        files: gives the exported graphs as ``(label, path)``; called once, on first use.
        frame: the IFrame links open in.
        start: start the shared netron server if it is not running; otherwise link
            only while one runs (a graph view is open).
    """

    def __init__(self, files: Callable[[], Files], frame: str, start: bool = False) -> None:
        self.frame = frame
        self.server: Any = None
        self._get_files, self._files = files, None
        try:
            from ortlab.ui import netron_view

            self.server = netron_view.default_server() if start else netron_view.running_default_server()
        except Exception as e:  # netron missing: tables without links
            logger.debug("no graph links: %s", e)

    @classmethod
    def for_stage(cls, stage: Stage) -> Linker:
        """Links into the graphs of the lab's ``exported`` stage, in the lab's view (while one is open)."""
        from ortlab.ui._netron_server import frame_name

        return cls(lambda: _stage_files(stage), frame_name(stage.root))

    def forget(self) -> None:
        """Read the graphs again on next use (the module re-captured)."""
        self._files = None

    @property
    def active(self) -> bool:
        return self.server is not None

    def graphs(self, label_prefix: str) -> list[str]:
        """Paths of the graphs labelled ``label_prefix`` or ``label_prefix.<part>``."""
        if self._files is None:
            self._files = self._get_files()
        return [path for label, path in self._files if label == label_prefix or label.startswith(label_prefix + ".")]

    def url(self, path: str, node: str | None = None) -> str | None:
        if not self.active:
            return None
        from ortlab.ui.netron_view import url_for

        try:
            return url_for(path, node, self.server)
        except Exception as e:  # a broken file must not break the table
            logger.debug("no link to %s: %s", path, e)
            return None

    def fx_node(self, label: str, name: str) -> str | None:
        """The node exported for FX node (or value) ``name`` in the graphs of ``label``.

        The partition that makes it, else one that reads it as an input (it is made
        in PyTorch or in another partition).
        """
        if not self.active:
            return None
        reader = None
        for path in self.graphs(label):
            target = onnx_node_index(path).get(name)
            if target is not None and target != name:
                return self.url(path, target)
            if target is not None and reader is None:
                reader = path
        return self.url(reader, name) if reader is not None else None

    def activation(self, row: ActivationRow) -> str | None:
        """A saved activation: its node in the forward graph."""
        return self.fx_node(f"{row.graph}.forward", row.name)

    def fallback(self, row: FallbackRow) -> str | None:
        """An op that runs in PyTorch: the first of its values an onnxruntime partition reads."""
        if not self.active or not row.values:
            return None
        from ortlab.ui._netron_graphs import load_model

        for path in self.graphs(row.where):
            inputs = {v.name for v in load_model(path).graph.input}
            value = next((v for v in row.values if v in inputs), None)
            if value is not None:
                return self.url(path, value)
        return None

    def kernel(self, record: NodeTime) -> str | None:
        """A kernel of onnxruntime's profile: its node (or its FX node's) in the graph it ran in."""
        if not self.active:
            return None
        from ortlab.ui._netron_graphs import load_model, resolve_node

        for path in self.graphs(record.graph):
            model = load_model(path)
            for name in (record.node, record.fx_node):
                if name and resolve_node(model, name) is not None:
                    return self.url(path, name)
        return None

    def link(self, text: str, url: str | None) -> str:
        """``text`` linked to ``url`` in this linker's frame (see ``ortlab.ui._html.link``), which
        a click brings into sight (see ``ortlab.ui._netron_frame``)."""
        return link(text, url, self.frame, onclick=FOCUS_JS)

    def viewer(self, url: str | None, height: int) -> str:
        """The IFrame the links open in, showing ``url`` first; "" without a URL."""
        return frame_html(url, f"{self.frame}_{next(_VIEWERS)}", height) if url else ""


def _stage_files(stage: Stage) -> Files:
    """The exported graphs a stage's rows link into, by label: its lab's ``exported`` stage,
    or the stage's own graphs for an ONNX stage saved and reopened alone."""
    exported = next((s for s in stage.lab.stages if s.name == "exported"), None) if stage.lab is not None else None
    source = exported if exported is not None and exported.status == "done" else stage
    if source.kind != "onnx":
        return []
    files = []
    for label in source.artifacts:
        try:
            files.append((label, source.artifact(label)))  # checked to stay inside the lab folder
        except ConfigError as e:  # a file leading out of the folder gets no link
            logger.debug("no links into %s: %s", label, e)
    return files
