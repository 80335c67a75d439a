"""The slowest onnxruntime kernels as a table whose rows open their node in netron.

The monitor draws kernel time as bars (a plotly chart holds no links). This table lists
the same records (:class:`~ortlab.inspect.profile.NodeTime`, one per ONNX node) and links
each node to a netron view of the graph it ran in, the node selected, the way the
stepper's tables link saved activations and fallbacks (see ``ortlab.ui._links``).

The graphs are the trained module's own (``mon.kernel_table()``, or ``kernel_table(mon)``):
written once to a temp folder (``ortlab.ui._module_graphs``) and shown in a netron view
under the table, where the rows' links open. Or a lab (``ortlab.explore``) of the same
model: the exported node names are the FX node names, which depend on the model's code
only, so a node of one is the node of the other; links then open in the lab's view while
one is open. Kernel names are onnxruntime's (``fused node_addmm``,
``node_mm_3/MatmulTransposeFusion/``): the profile reader keeps the exported node's name
(``ortlab.provenance.onnx_node_of``), and nodes onnxruntime made
(``node_view_3_new_reshape``) are found through the FX node their provenance names.
Links lead into the graphs the module runs now: after a re-capture (``reconfigure``)
a kernel of an earlier profile links to the node of the same name there, which is
the same op (node names come from the joint graph's FX names, which recompute and
fallback choices keep), or to nothing when that node is gone.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from typing import Any

from ortlab.inspect.profile import NodeTime, merge, top_nodes
from ortlab.inspect.lab import Lab
from ortlab.ui._html import esc, table
from ortlab.ui._links import Linker
from ortlab.ui.netron_view import HEIGHT

__all__ = ["KernelTable", "kernel_table"]

logger = logging.getLogger(__name__)


class KernelTable:
    """The slowest kernels of a profile, each with a netron link when one is possible.

    Attributes:
        rows: ``(record, url or None)``, slowest first.
        steps: profiled steps the times are divided by.
        height: of the netron view under the table (0: none; links into a lab open in its view).
    """

    def __init__(self, rows: list[tuple[NodeTime, str | None]], steps: int, linker: Linker | None,
                 height: int = 0, hint: str = "", empty: str = "", windows: int = 1,
                 total_us: float | None = None) -> None:
        self.rows, self.steps, self._linker, self.height, self._hint = rows, max(1, steps), linker, height, hint
        self.windows = windows
        # all kernels' time in the profiled steps, not only these rows' (shares are of it)
        self.total_us = sum(r.dur_us for r, _ in rows) if total_us is None else total_us
        # Why there is no row yet, and when there will be (the monitor's kernel note), for an empty table.
        self.empty = empty or "no kernel profile yet: mon.profile_now(), then train a few steps"

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p style='font-size:12px'>{esc(self.empty[0].upper() + self.empty[1:])}.</p>"
        total = self.total_us or 1.0
        cells = []
        for r, url in self.rows:
            name = f"<code>{esc(r.node)}</code>"
            cells.append([esc(r.graph), self._linker.link(name, url) if self._linker else name,
                          f"<code>{esc(r.op_type)}</code>", f"{r.dur_us / self.steps:,.0f}", esc(spread(r)),
                          f"{r.dur_us / total:.0%}", esc(r.module or "<root>"), f"<small>{esc(r.source)}</small>"])
        first = next((url for _, url in self.rows if url), None)
        hint = "" if first else self._hint
        viewer = self._linker.viewer(first, self.height) if self._linker and self.height else ""
        header = ["graph", "node", "kernel", "us / step", "per run: median (min-max)", "share", "module", "source"]
        return ("<div style='font-family:sans-serif'><h4 style='margin:8px 0 2px'>Slowest onnxruntime kernels</h4>"
                f"<p style='font-size:12px;margin:2px 0'>{esc(self.covers)}</p>"
                + table(header, cells) + hint + viewer + "</div>")

    @property
    def covers(self) -> str:
        """What the times cover: steps, windows, what was left out, and what share means."""
        return (f"{self.steps} profiled step(s) in {self.windows} window(s); each window's first step (new "
                "sessions' first runs allocate) is left out. Share: of all kernel time in those steps.")

    def __repr__(self) -> str:
        lines = [f"{r.dur_us / self.steps:10,.0f} us  {spread(r):>22}  {r.label}" for r, _ in self.rows]
        return "\n".join([self.covers, *lines]) if lines else self.empty


def spread(r: NodeTime) -> str:
    """A node's kernel time per run: ``median (min-max)`` in microseconds."""
    if not r.per_run_us:
        return "-"
    runs = sorted(r.per_run_us)
    return f"{statistics.median(runs):,.0f} ({runs[0]:,.0f}-{runs[-1]:,.0f})"


def kernel_table(source: Any, graphs: Any = None, top: int = 15, height: int = HEIGHT) -> KernelTable:
    """The ``top`` slowest kernels of a monitor's last profile (or of records), linked to their nodes.

    Args:
        source: a :class:`~ortlab.ui.monitor.Monitor` (its last profile window) or
            :class:`~ortlab.inspect.profile.NodeTime` records.
        graphs: where rows link to: the trained ``ORTModule`` (its own graphs, in a
            netron view under the table; default: the monitor's module), or a
            :class:`~ortlab.inspect.lab.Lab` of the same model whose ``exported`` stage
            has run (links open in its view while one is open).
        top: rows.
        height: of the netron view under the table; 0: no view (links open a new tab).

    Example:
        >>> kernel_table(mon)                     # same as mon.kernel_table()  # doctest: +SKIP
        >>> kernel_table(mon, lab)                # into lab["exported"].view()  # doctest: +SKIP
    """
    profiles = getattr(source, "profiles", None)
    empty = ""
    if profiles is not None and not profiles and hasattr(source, "kernel_note"):  # a monitor: why none, and when
        empty = (f"no kernel profile after {source.steps} step(s); "
                 + source.kernel_note().removeprefix("kernels: "))
    windows = 1
    if profiles is not None:  # every window the monitor profiled, not only the last: more steps, and their spread
        records: Iterable[NodeTime] = merge(*(p["nodes"] for p in profiles))
        steps = sum(int(p["steps"]) for p in profiles) or 1
        windows = len(profiles)
    else:
        records, steps = list(source), 1
    records = list(records)
    total = sum(r.dur_us for r in records)
    rows = top_nodes(records, top)
    if graphs is None:
        graphs = getattr(source, "ortmodule", None)
    hint = ""
    if isinstance(graphs, Lab):
        linker, height = Linker.for_stage(graphs["exported"]), 0
        hint = ("<p style='font-size:12px;color:#666'>Open a graph with <code>lab['exported'].view()</code>; "
                "rows then link to their nodes.</p>")
    elif graphs is not None and hasattr(graphs, "report"):
        from ortlab.ui._module_graphs import module_linker

        linker = module_linker(graphs) if rows else None
    else:
        linker = None
    if linker is None or not linker.active:
        return KernelTable([(r, None) for r in rows], steps, linker, 0, hint, empty, windows, total)
    return KernelTable([(r, linker.kernel(r)) for r in rows], steps, linker, height, hint, empty, windows, total)
