"""Text and HTML views of a compare result: step values, the first divergence, a per-layer table."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortlab.inspect._results import CompareResult

__all__ = ["result_text", "result_html"]

_HTML_NODES = 25


def _ratio_color(ratio: float | None) -> str:
    """Green (far within tolerance) -> yellow (at 1e-2 of it) -> red (beyond)."""
    if ratio is None:
        return "#eeeeee"
    if ratio > 1:
        return "#f4a6a6" if ratio < 100 else "#e05555"
    x = 0.0 if ratio <= 1e-4 else min(1.0, (math.log10(ratio) + 4) / 4)  # 1e-4 -> 0, 1 -> 1
    r, g = int(170 + 85 * x), int(230 - 30 * x)
    return f"#{r:02x}{g:02x}aa"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _graph_kinds(result: CompareResult) -> list[str]:
    """The graph kinds (forward, backward, inference) of the compared nodes, in order of appearance."""
    kinds: list[str] = []
    for n in result.nodes:
        k = n.graph.split(".")[-1]
        if k not in kinds:
            kinds.append(k)
    return kinds


def _verdict(result: CompareResult) -> str:
    noise = any(c.fp32_noise for c in result.step)
    if result.ok:
        return "OK (differences within fp32 noise, judged against float64)" if noise else "OK"
    if not result.matches:
        return "DIVERGED"
    return ("MATCHES within fp32 noise (judged against float64); some intermediates beyond tolerance" if noise
            else "INTERMEDIATES DIVERGE")


def result_text(result: CompareResult) -> str:
    """The readable report of a compare result: step values, first divergence, per-layer table."""
    lines = [f"ortlab.compare: {_verdict(result)} (rtol={result.rtol:g}, atol={result.atol:g})"]
    for label, group in (("outputs", result.outputs), ("loss", [result.loss] if result.loss else []),
                         ("grads", result.grads), ("buffers", result.buffers)):
        if not group:
            continue
        bad = [c for c in group if not c.ok]
        worst = max((c for c in group if c.stats), key=lambda c: c.stats.worst_ratio, default=None)  # type: ignore[union-attr]
        noise = sum(1 for c in group if c.fp32_noise)
        text = f"  {label:<8} {len(group) - len(bad)}/{len(group)} within tolerance"
        text += f" ({noise} of them fp32 noise, judged against float64)" if noise else ""
        if worst is not None and worst.stats is not None:
            text += f"; worst {worst.name}: max abs {worst.stats.max_abs:.3g}, max rel {worst.stats.max_rel:.3g}"
        lines.append(text)
        lines.extend(f"           {c.name}: {c.note}" for c in bad if c.note)
        lines.extend(f"           {c.name}: out of tolerance, but {c.fp32_noise}" for c in group if c.fp32_noise)
    compared = [n for n in result.nodes if n.stats is not None]
    lines.append(f"intermediates: {len(compared)} compared, {len(result.diverged_nodes)} out of tolerance, "
                 f"{sum(n.runtime == 'pytorch' for n in result.nodes)} ran in PyTorch")
    first = result.first_divergence
    lines.append(f"first divergence: {first.describe()}" if first else "first divergence: none")
    layers = result.layers()
    if layers:
        kinds = _graph_kinds(result)
        rows = [["module", *[f"{k} err/tol" for k in kinds], "nodes", "diverged", "first diverged node"]]
        for layer in layers:
            mark = "  <- first divergence" if first is not None and layer.first is first else ""
            rows.append([layer.module or "<root>", *[_fmt(layer.worst.get(k)) for k in kinds], str(layer.nodes),
                         str(layer.diverged), (f"{layer.first.node} ({layer.first.op})" if layer.first else "-") + mark])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("per layer (largest error / tolerance; above 1 is out of tolerance):")
        lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


def result_html(result: CompareResult) -> str:
    """The notebook view of a compare result: tables colored by error / tolerance."""
    esc = html.escape
    color = "#2e7d32" if result.ok else "#c62828"
    parts = [f"<div><b style='color:{color}'>ortlab.compare: {_verdict(result)}</b> "
             f"(rtol={result.rtol:g}, atol={result.atol:g})</div>"]
    rows = "".join(
        f"<tr style='background:{_ratio_color(c.stats.worst_ratio if c.stats else None)}'><td>{esc(c.kind)}</td>"
        f"<td>{esc(c.name)}</td><td>{_fmt(c.stats.max_abs if c.stats else None)}</td>"
        f"<td>{_fmt(c.stats.max_rel if c.stats else None)}</td><td>{'yes' if c.ok else 'no'}</td></tr>"
        for c in result.step
    )
    parts.append("<table><tr><th>kind</th><th>value</th><th>max abs</th><th>max rel</th><th>ok</th></tr>"
                 f"{rows}</table>")
    first = result.first_divergence
    parts.append(f"<p><b>first divergence:</b> {esc(first.describe()) if first else 'none'}</p>")
    kinds = _graph_kinds(result)
    head = "".join(f"<th>{esc(k)}</th>" for k in kinds)
    body = []
    for layer in result.layers():
        cells = "".join(
            f"<td style='background:{_ratio_color(layer.worst.get(k))}'>{_fmt(layer.worst.get(k))}</td>" for k in kinds
        )
        first_node = f"{esc(layer.first.node)} ({esc(layer.first.op)})" if layer.first else "-"
        body.append(f"<tr><td>{esc(layer.module or '<root>')}</td>{cells}<td>{layer.nodes}</td>"
                    f"<td>{layer.diverged}</td><td>{first_node}</td></tr>")
    parts.append("<p>per layer, largest error / tolerance (above 1 is out of tolerance):</p>"
                 f"<table><tr><th>module</th>{head}<th>nodes</th><th>diverged</th><th>first diverged node</th></tr>"
                 + "".join(body) + "</table>")
    diverged = result.diverged_nodes
    if diverged:
        rows = "".join(
            f"<tr style='background:{_ratio_color(n.stats.worst_ratio if n.stats else None)}'>"
            f"<td>{esc(n.graph)}</td><td>{esc(n.node)}</td><td>{esc(n.op)}</td><td>{esc(n.module or '<root>')}</td>"
            f"<td>{esc(n.source)}</td><td>{_fmt(n.stats.max_abs if n.stats else None)}</td>"
            f"<td>{_fmt(n.stats.max_rel if n.stats else None)}</td>"
            f"<td>{_fmt(n.stats.worst_ratio if n.stats else None)}</td></tr>"
            for n in diverged[:_HTML_NODES]
        )
        more = f" (first {_HTML_NODES} of {len(diverged)})" if len(diverged) > _HTML_NODES else ""
        parts.append(f"<p>nodes out of tolerance, in execution order{more}:</p><table><tr><th>graph</th><th>node</th>"
                     "<th>op</th><th>module</th><th>source</th><th>max abs</th><th>max rel</th><th>err/tol</th></tr>"
                     f"{rows}</table>")
    parts.extend(f"<p><i>{esc(n)}</i></p>" for n in result.notes)
    return "".join(parts)

