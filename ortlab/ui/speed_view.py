"""``compare_speed``'s result in a notebook: a diverging bar chart and a table linked to netron.

The chart shows, per nn.Module, the milliseconds a step ortlab loses (right, red) or gains
(left, green) against eager PyTorch, with each side's spread in the hover; the table
lists the (module, source line) rows with both sides' medians and spreads, what ran
(eager's torch calls and backward nodes, onnxruntime's kernels), and a verdict by the one
rule (``ortlab.inspect.timing``). Each row with an onnxruntime kernel links to its slowest
node in the graphs the module trained with, in a netron view under the table (see
``ortlab.ui._links``). Registered as the ``speed_html``, ``speed_figure`` and
``speed_display`` views (``ortlab.inspect.views``).
"""

from __future__ import annotations

import logging
from typing import Any

from ortlab.inspect.profile import NodeTime
from ortlab.inspect.speed import OTHER, SpeedComparison, SpeedRow, _ms, _ratio, _short
from ortlab.inspect.views import register_view
from ortlab.ui._html import esc, table
from ortlab.ui.netron_view import HEIGHT

__all__ = ["speed_html", "speed_figure", "display_speed"]

logger = logging.getLogger(__name__)

_SLOWER, _FASTER, _NOISE = "#c0392b", "#2e7d32", "#9aa0a6"


def _verdict(row: SpeedRow) -> str:
    if row.within_noise:
        return "<span style='color:#555'>within noise</span>"
    if row.lost_ms > 0:
        return f"<span style='color:{_SLOWER}'>ortlab slower</span>"
    return f"<span style='color:{_FASTER}'>ortlab faster</span>"


def _linker(result: SpeedComparison) -> Any:
    if result.ortmodule is None or not any(r.node for r in result.rows):
        return None
    try:
        from ortlab.ui._module_graphs import module_linker

        linker = module_linker(result.ortmodule)
    except Exception as e:  # netron missing: a table without links
        logger.debug("no links: %s", e)
        return None
    return linker if linker.active else None


def speed_html(result: SpeedComparison, top: int = 25, height: int = HEIGHT) -> str:
    """The verdict, what the numbers cover, and the rows as a table linked to netron (the first ``top`` shown,
    the rest folded)."""
    linker = _linker(result)
    urls: list[str | None] = []
    cells = []
    for row in result.rows:
        url = None
        if linker is not None and row.node:
            url = linker.kernel(NodeTime(node=row.node["node"], op_type="", dur_us=0.0, count=1,
                                         graph=row.node["graph"], fx_node=row.node.get("fx_node", "")))
        urls.append(url)
        where = f"<code>{esc(row.module if row.module.startswith('(') else row.module or '<root>')}</code>"
        cells.append([
            linker.link(where, url) if linker is not None else where,
            f"<small title='{esc(row.source)}'>{esc(_short(row.source))}</small>",
            f"{row.lost_ms:+.2f}", esc(_ms(row.ortlab)), esc(_ms(row.eager)), esc(_ratio(row.ratio)), _verdict(row),
            f"<small>{esc(', '.join(row.kernels[:4]))}</small>", f"<small>{esc(', '.join(row.aten_ops[:4]))}</small>",
        ])
    header = ["module", "source", "lost ms / step", "ortlab ms (min-max)", "eager ms (min-max)",
              "eager / ortlab", "verdict", "onnxruntime kernels (or in PyTorch)", "eager torch calls / backward"]
    color = "#555" if "within noise" in result.verdict else (_FASTER if result.speedup > 1 else _SLOWER)
    notes = "".join(f"<li>{esc(n)}</li>" for n in result.notes)
    first = next((u for u in urls if u), None)
    viewer = linker.viewer(first, height) if linker is not None and first else ""
    other = next((r for r in result.rows if r.module == OTHER), None)
    other_line = f"<p style='font-size:12px;margin:2px 0'><code>{OTHER}</code>: {esc(other.aten_ops[0])}</p>" \
        if other is not None else ""
    return ("<div style='font-family:sans-serif'>"
            f"<h4 style='margin:8px 0 2px'>compare_speed: <span style='color:{color}'>{esc(result.verdict)}</span></h4>"
            f"<p style='font-size:12px;margin:2px 0'>{esc(result.covers)}</p>{other_line}"
            + (f"<ul style='font-size:12px;margin:2px 0'>{notes}</ul>" if notes else "")
            + table(header, cells, limit=top) + viewer + "</div>")


def speed_figure(result: SpeedComparison, top: int = 15, depth: int | None = None) -> Any:
    """A diverging bar chart: per module, the milliseconds a step ortlab loses (red, right) or gains (green, left);
    grey where the spreads overlap (within noise). The ``top`` modules by time lost or gained."""
    import plotly.graph_objects as go

    rows = sorted(result.modules(depth), key=lambda r: -abs(r.lost_ms))[:top]
    rows.sort(key=lambda r: r.lost_ms)
    labels = [r.module if r.module.startswith("(") else (r.module or "<root>") for r in rows]
    colors = [_NOISE if r.within_noise else (_SLOWER if r.lost_ms > 0 else _FASTER) for r in rows]
    hover = [f"<b>{esc(label)}</b><br>ortlab {_ms(r.ortlab)} ms<br>eager {_ms(r.eager)} ms<br>"
             f"{'within noise' if r.within_noise else ('ortlab slower' if r.lost_ms > 0 else 'ortlab faster')}"
             for label, r in zip(labels, rows)]
    fig = go.Figure(go.Bar(x=[r.lost_ms for r in rows], y=labels, orientation="h", marker_color=colors,
                           hovertext=hover, hoverinfo="text", name="ms lost a step"))
    fig.update_layout(
        title={"text": f"Where ortlab loses (right) or gains (left) time a step<br><sup>{esc(result.verdict)}</sup>",
               "font": {"size": 14}},
        xaxis={"title": {"text": "ms a step: ortlab's median minus eager's (grey: within noise)"},
               "zeroline": True, "zerolinecolor": "#333"},
        yaxis={"automargin": True}, height=160 + 26 * len(rows), margin={"l": 10, "r": 10, "t": 70, "b": 50},
        plot_bgcolor="white", showlegend=False,
    )
    fig.update_xaxes(gridcolor="#e9ecef")
    return fig


def display_speed(result: SpeedComparison) -> None:
    """The chart, then the linked table, in the notebook."""
    from IPython.display import HTML, display

    from ortlab.ui._monitor_figure import bundle

    display(bundle(speed_figure(result), str(result).splitlines()[0]), raw=True)
    display(HTML(speed_html(result)))


register_view("speed_html", speed_html)
register_view("speed_figure", speed_figure)
register_view("speed_display", display_speed)
