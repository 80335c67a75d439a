"""Text and HTML views of a compare result (step values, the first divergence, a per-layer table) and of a bisect."""

from __future__ import annotations

import html
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortlab.inspect._results import CompareResult, NodeComparison
    from ortlab.inspect.bisect import BisectResult

# ``(node, html) -> html``: the node's text linked to its node in a graph view (``ortlab.ui``).
NodeLink = Callable[["NodeComparison", str], str]

__all__ = ["result_text", "result_html", "bisect_html"]

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


def _fmt_ratio(x: float | None) -> str:
    """An error / tolerance ratio; a non-finite one (a NaN or an infinity on one side only) in words, not ``inf``."""
    if x is not None and not math.isfinite(x):
        return "NaN/inf on one side"
    return _fmt(x)


def _matches_by_noise(result: CompareResult) -> bool:
    """The step matches and whatever is beyond tolerance was judged fp32 noise."""
    return result.matches and any(c.fp32_noise for c in result.step)


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
    """The readable report of a compare result: the verdict, a line per kind of step value, the per-layer table,
    the first divergence (when there is one) and the notes. Each value's own line is in ``result.step``."""
    lines = [f"ortlab.compare: {_verdict(result)} (rtol={result.rtol:g}, atol={result.atol:g})"]
    for label, group in (("outputs", result.outputs), ("loss", [result.loss] if result.loss else []),
                         ("grads", result.grads), ("buffers", result.buffers)):
        if not group:
            continue
        bad = [c for c in group if not c.ok]
        worst = max((c for c in group if c.stats), key=lambda c: c.stats.worst_ratio, default=None)  # type: ignore[union-attr]
        noise = [c for c in group if c.fp32_noise]
        text = f"  {label:<8} {len(group) - len(bad)}/{len(group)} within tolerance"
        text += (f" ({len(noise)} beyond it but as exact as eager's against a float64 run: fp32 noise)"
                 if noise else "")
        if worst is not None and worst.stats is not None:
            text += f"; worst {worst.name}: max abs {worst.stats.max_abs:.3g}, max rel {worst.stats.max_rel:.3g}"
        lines.append(text)
        lines.extend(f"           {c.name}: {c.note}" for c in bad if c.note)
        lines.extend(f"           {c.name}: out of tolerance" for c in bad if not c.note)
    compared = [n for n in result.nodes if n.stats is not None]
    if result.nodes:
        lines.append(f"intermediates: {len(compared)} compared, {len(result.diverged_nodes)} out of tolerance, "
                     f"{sum(n.runtime == 'pytorch' for n in result.nodes)} ran in PyTorch")
    first = result.first_divergence
    layers = result.layers()
    if layers:
        kinds = _graph_kinds(result)
        rows = [["module", *[f"{k} err/tol" for k in kinds], "nodes", "diverged", "first diverged node"]]
        for layer in layers:
            mark = "  <- first divergence" if first is not None and layer.first is first else ""
            rows.append([layer.module or "<root>", *[_fmt_ratio(layer.worst.get(k)) for k in kinds], str(layer.nodes),
                         str(layer.diverged), (f"{layer.first.node} ({layer.first.op})" if layer.first else "-") + mark])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("per layer (largest error / tolerance; above 1 is out of tolerance):")
        lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    if first is not None:
        lines.append(f"first divergence: {first.describe()}")
    if any(c.fp32_noise for c in result.step):
        lines.append("note: fp32 noise: a value beyond tolerance whose distance from a float64 run of eager is at most "
                     "eager's own (Note [Judged against float64]); result.step has each value's comparison")
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


def result_html(result: CompareResult, node_link: NodeLink | None = None, footer: str = "") -> str:
    """The notebook view of a compare result: tables colored by error / tolerance.

    Args:
        result: the comparison.
        node_link: links a node's name to it in a graph view (``ortlab.ui`` gives one
            when it is loaded; ``inspect`` never imports ``ui``); default: plain text.
        footer: HTML after the tables (the graph view the links open in).
    """
    esc = html.escape

    def named(n: NodeComparison, text: str) -> str:
        return node_link(n, text) if node_link is not None else text
    # A step that matches is green, also when values were judged fp32 noise; intermediates beyond tolerance under
    # a matching step are amber; only a step that diverges is red.
    color = "#2e7d32" if result.matches and result.ok or _matches_by_noise(result) else \
        "#9a6700" if result.matches else "#c62828"
    parts = [f"<div><b style='color:{color}'>ortlab.compare: {_verdict(result)}</b> "
             f"(rtol={result.rtol:g}, atol={result.atol:g})</div>"]

    def state(c: object) -> tuple[str, str]:  # (the cell's words, the row's background)
        if c.fp32_noise:  # type: ignore[attr-defined]
            return "fp32 noise", "#eeeeee"
        if c.ok:  # type: ignore[attr-defined]
            return "within", _ratio_color(c.stats.worst_ratio if c.stats else None)  # type: ignore[attr-defined]
        return "OUT", _ratio_color(c.stats.worst_ratio if c.stats else math.inf)  # type: ignore[attr-defined]

    rows = "".join(
        f"<tr style='background:{state(c)[1]}'><td>{esc(c.kind)}</td>"
        f"<td>{esc(c.name)}</td><td>{_fmt(c.stats.max_abs if c.stats else None)}</td>"
        f"<td>{_fmt(c.stats.max_rel if c.stats else None)}</td><td>{state(c)[0]}</td></tr>"
        for c in result.step
    )
    bad = sum(not c.ok for c in result.step)
    summary = (f"{len(result.step)} step values (outputs, loss, gradients, buffers): "
               + (f"{bad} out of tolerance" if bad else "all within tolerance"))
    noise = sum(bool(c.fp32_noise) for c in result.step)
    if noise:
        summary += (f"; {noise} beyond it are fp32 noise: as close to a float64 run of eager as eager itself "
                    "(Note [Judged against float64])")
    table = ("<table><tr><th>kind</th><th>value</th><th>max abs</th><th>max rel</th><th>tolerance</th></tr>"
             f"{rows}</table>")
    # Detail on demand: the step's table is open only when the step diverges.
    parts.append(f"<details{' open' if not result.matches else ''}><summary>{esc(summary)}</summary>{table}</details>")
    first = result.first_divergence
    if first is not None and not result.ok:
        where = named(first, f"<code>{esc(first.node)}</code>")
        parts.append(f"<p><b>first divergence:</b> {where} {esc(first.describe())}</p>")
    kinds = _graph_kinds(result)
    head = "".join(f"<th>{esc(k)}</th>" for k in kinds)
    body = []
    for layer in result.layers():
        cells = "".join(
            f"<td style='background:{_ratio_color(layer.worst.get(k))}'>{_fmt_ratio(layer.worst.get(k))}</td>" for k in kinds
        )
        first_node = (f"{named(layer.first, esc(layer.first.node))} ({esc(layer.first.op)})" if layer.first
                      else "-")
        body.append(f"<tr><td>{esc(layer.module or '<root>')}</td>{cells}<td>{layer.nodes}</td>"
                    f"<td>{layer.diverged}</td><td>{first_node}</td></tr>")
    parts.append("<p>per layer, largest error / tolerance (above 1 is out of tolerance):</p>"
                 f"<table><tr><th>module</th>{head}<th>nodes</th><th>diverged</th><th>first diverged node</th></tr>"
                 + "".join(body) + "</table>")
    diverged = result.diverged_nodes
    if diverged:
        rows = "".join(
            f"<tr style='background:{_ratio_color(n.stats.worst_ratio if n.stats else None)}'>"
            f"<td>{esc(n.graph)}</td><td>{named(n, esc(n.node))}</td><td>{esc(n.op)}</td><td>{esc(n.module or '<root>')}</td>"
            f"<td>{esc(n.source)}</td><td>{_fmt(n.stats.max_abs if n.stats else None)}</td>"
            f"<td>{_fmt(n.stats.max_rel if n.stats else None)}</td>"
            f"<td>{_fmt_ratio(n.stats.worst_ratio if n.stats else None)}</td></tr>"
            for n in diverged[:_HTML_NODES]
        )
        more = f" (first {_HTML_NODES} of {len(diverged)})" if len(diverged) > _HTML_NODES else ""
        parts.append(f"<p>nodes out of tolerance, in execution order{more}:</p><table><tr><th>graph</th><th>node</th>"
                     "<th>op</th><th>module</th><th>source</th><th>max abs</th><th>max rel</th><th>err/tol</th></tr>"
                     f"{rows}</table>")
    parts.extend(f"<p><i>{esc(n)}</i></p>" for n in result.notes)
    parts.append(footer)
    return "".join(parts)



def bisect_html(result: BisectResult, baseline_html: str = "") -> str:
    """The notebook view of a bisect: the outcome, the fix, every trial, and the repro script.

    Args:
        result: what ``bisect_fallbacks`` found.
        baseline_html: the baseline comparison's view (folded under the trials).
    """
    esc = html.escape
    color = "#2e7d32" if result.found else "#c62828"
    parts = [f"<div style='font-family:sans-serif;font-size:13px'><b style='color:{color}'>ortlab bisect:</b> "
             f"{esc(result.reason)}</div>"]
    line = result.culprit_line()
    if line is not None:
        head, _, rest = line.partition(": ")
        parts.append(f"<p><b>{esc(head)}:</b> {esc(rest)}</p>")
    if result.found and result.ops:
        fix = f"ORTModule(model, fallback_ops={result.base_ops + result.ops!r})"
        parts.append(f"<p><b>fix for now:</b> <code>{esc(fix)}</code></p>")
    if result.trials:
        seconds = sum(t.seconds for t in result.trials)
        rows = "".join(
            f"<tr style='background:{'#d8f0d8' if t.passed else '#f6d8d8'}'><td>{i}</td>"
            f"<td style='text-align:left'>{esc(', '.join(t.ops) or '(none)')}</td><td>{'yes' if t.passed else 'no'}</td>"
            f"<td>{t.seconds:.1f} s</td></tr>"
            for i, t in enumerate(result.trials, 1)
        )
        parts.append(f"<p>{len(result.trials)} trials ({seconds:.1f} s): each runs these ops in PyTorch and "
                     "compares the step with eager</p><table><tr><th>#</th><th style='text-align:left'>ops in PyTorch</th>"
                     f"<th>step matches eager</th><th>time</th></tr>{rows}</table>")
    if result.repro:
        command = f"{sys.executable} {result.repro}"
        try:
            with open(result.repro, encoding="utf-8") as f:
                script = f.read()
            code = (f"<details><summary style='font-size:12px'>the repro script ({script.count(chr(10))} lines)"
                    f"</summary><pre style='font-size:11px;max-height:400px;overflow:auto'>{esc(script)}</pre></details>")
        except OSError as e:  # removed since: say so, keep the rest
            code = f"<p style='font-size:12px;color:#666'>the repro script is gone ({esc(str(e))})</p>"
        parts.append(f"<p><b>repro</b> (runs the first diverging node alone, standalone): <code>{esc(command)}</code></p>"
                     + code)
    if baseline_html:
        parts.append("<details><summary style='font-size:12px'>the comparison without extra fallbacks</summary>"
                     f"{baseline_html}</details>")
    return "".join(parts)
