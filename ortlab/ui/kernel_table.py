"""The slowest onnxruntime kernels as a table whose rows open their node in netron.

The monitor draws kernel time as bars (a plotly chart holds no links). This table lists
the same records (:class:`~ortlab.inspect.profile.NodeTime`, one per ONNX node) and links
each node to a netron view of the graph it ran in, the node selected, the way the
stepper's tables link saved activations and fallbacks (see ``ortlab.ui.stepper``): into
the lab's netron frame, only while a graph view is open.

The kernels come from the trained ``ORTModule``, the graphs from a lab
(``ortlab.explore``) of the same model: the exported node names are the FX node names,
which depend on the model's code only, so a node of one is the node of the other.
onnxruntime's own nodes (``node_view_3_new_reshape``) are found through the FX node
their provenance names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ortlab.inspect.profile import NodeTime, top_nodes
from ortlab.inspect.stages import Lab
from ortlab.ui.stepper import _e, _Linker, _table

__all__ = ["KernelTable", "kernel_table"]

logger = logging.getLogger(__name__)


class KernelTable:
    """The slowest kernels of a profile, each with a netron link when one is possible.

    Attributes:
        rows: ``(record, url or None)``, slowest first.
        steps: profiled steps the times are divided by.
    """

    def __init__(self, rows: list[tuple[NodeTime, str | None]], steps: int, linker: _Linker | None) -> None:
        self.rows, self.steps, self._linker = rows, max(1, steps), linker

    def _repr_html_(self) -> str:
        if not self.rows:
            return ("<p style='font-size:12px'>No kernel profile yet: <code>mon.profile_now()</code>, "
                    "then train a few steps.</p>")
        total = sum(r.dur_us for r, _ in self.rows) or 1.0
        cells = []
        for r, url in self.rows:
            name = f"<code>{_e(r.node)}</code>"
            cells.append([_e(r.graph), self._linker.link(name, url) if self._linker else name,
                          f"<code>{_e(r.op_type)}</code>", f"{r.dur_us / self.steps:,.0f}", f"{r.dur_us / total:.0%}",
                          _e(r.module or "<root>"), f"<small>{_e(r.source)}</small>"])
        hint = "" if any(url for _, url in self.rows) else (
            "<p style='font-size:12px;color:#666'>Open a graph with <code>lab['exported'].view()</code>; "
            "rows then link to their nodes.</p>")
        header = ["graph", "node", "kernel", "us / step", "share", "module", "source"]
        return ("<div style='font-family:sans-serif'><h4 style='margin:8px 0 2px'>Slowest onnxruntime kernels</h4>"
                + _table(header, cells) + hint + "</div>")

    def __repr__(self) -> str:
        return "\n".join(f"{r.dur_us / self.steps:10,.0f} us  {r.label}" for r, _ in self.rows) or "no kernel profile"


def _url(linker: _Linker, record: NodeTime) -> str | None:
    """A view of the exported graph the kernel ran in, its node selected."""
    from ortlab.ui._netron_graphs import load_model, resolve_node

    for path in linker._exported(record.graph):
        model = load_model(path)
        for name in (record.node, record.fx_node):
            if name and resolve_node(model, name) is not None:
                return linker.url(path, name)
    return None


def kernel_table(source: Any, lab: Lab | None = None, top: int = 15) -> KernelTable:
    """The ``top`` slowest kernels of a monitor's last profile (or of records), linked into ``lab``.

    Args:
        source: a :class:`~ortlab.ui.monitor.Monitor` (its last profile window) or
            :class:`~ortlab.inspect.profile.NodeTime` records.
        lab: a lab of the same model whose ``exported`` stage has run; rows link to its
            graphs while a view of it is open. ``None``: no links.
        top: rows.

    Example:
        >>> lab = ortlab.explore(GPT(config), idx, targets); lab.run("exported")   # doctest: +SKIP
        >>> lab["exported"].view()                                                 # doctest: +SKIP
        >>> kernel_table(mon, lab)                                                 # doctest: +SKIP
    """
    profiles = getattr(source, "profiles", None)
    if profiles is not None:
        records: Iterable[NodeTime] = profiles[-1]["nodes"] if profiles else []
        steps = int(profiles[-1]["steps"]) if profiles else 1
    else:
        records, steps = source, 1
    rows = top_nodes(records, top)
    linker = _Linker(lab["exported"]) if lab is not None else None
    if linker is None or not linker.active:
        return KernelTable([(r, None) for r in rows], steps, linker)
    return KernelTable([(r, _url(linker, r)) for r in rows], steps, linker)
