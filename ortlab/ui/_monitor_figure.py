"""The training monitor's plots: series from a StepLog, the plotly figure, in-place updates.

plotly is imported only when a figure is built. A redraw sets every trace of the
figure in one ``batch_update`` from :func:`series` (numpy arrays, at most ``max_points``
a line: see Note [Staying within the overhead budget] in ``ortlab.ui._monitor_schedule``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np

from ortlab.inspect.profile import by_module, by_op_type, top_nodes
from ortlab.ui._monitor_data import StepLog, column

__all__ = ["LINES", "BARS", "MEMORY", "bundle", "downsample", "figure", "in_kernel", "series", "status_line",
           "update_traces", "widgets_render_here"]

_MIB = float(2**20)
LINES = ("loss", "step_ms", "profiled_step_ms", "kernel_ms", "samples_per_s", "rss", "saved", "cuda_used",
         "cuda_allocated")
BARS = ("top_ops", "op_types", "modules")
MEMORY = {"rss": "rss_bytes", "saved": "saved_bytes", "cuda_used": "cuda_used_bytes",
          "cuda_allocated": "cuda_allocated_bytes"}


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket means of ``(x, y)`` so at most ``max_points`` remain; NaNs are skipped."""
    n = len(x)
    if n <= max_points:
        return x, y
    starts = np.arange(0, n, math.ceil(n / max_points))
    ok = ~np.isnan(y)
    sums = np.add.reduceat(np.where(ok, y, 0.0), starts)
    counts = np.add.reduceat(ok.astype(np.int64), starts)
    xs = np.add.reduceat(x, starts) / np.diff(np.append(starts, n))
    return xs, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def series(log: StepLog, n: int, max_points: int, top: int, module_depth: int | None) -> dict[str, tuple]:
    """x/y of every line and labels/values/hover of every bar chart for the first ``n`` steps, downsampled."""
    log.materialize()
    mp = max_points
    steps = np.arange(1, n + 1, dtype=float)
    dt = log.durations(n)
    profiled = log.profiled_mask(n)
    loss = column(log.loss, n)
    batch = np.asarray(log.batch[:n], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        sps = np.where(profiled, np.nan, batch / dt)
    out: dict[str, tuple] = {
        "loss": downsample(steps, loss, mp),
        "step_ms": downsample(steps, np.where(profiled, np.nan, dt * 1e3), mp),
        "profiled_step_ms": (steps[profiled][-mp:], (dt[profiled] * 1e3)[-mp:]),
        "samples_per_s": downsample(steps, sps, mp),
        "kernel_ms": (
            np.asarray([p["step"] for p in log.profiles], dtype=float),
            np.asarray([sum(r.dur_us for r in p["nodes"]) / p["steps"] / 1e3 for p in log.profiles], dtype=float),
        ),
    }
    mem_steps = np.asarray([m["step"] for m in log.memory], dtype=float)
    for name, key in MEMORY.items():
        out[name] = downsample(mem_steps, np.asarray([m.get(key) for m in log.memory], dtype=float) / _MIB, mp)
    nodes, per = (log.profiles[-1]["nodes"], log.profiles[-1]["steps"]) if log.profiles else ([], 1)
    slowest = top_nodes(nodes, top)
    out["top_ops"] = ([r.label for r in slowest], np.asarray([r.dur_us / per for r in slowest], dtype=float),
                      [f"{r.op or '?'} {r.fx_node}<br>{r.source}" for r in slowest])
    for name, groups in (("op_types", by_op_type(nodes)), ("modules", by_module(nodes, module_depth))):
        groups = groups[:top]
        out[name] = ([g.key for g in groups], np.asarray([g.dur_us / per for g in groups], dtype=float),
                     [f"{g.share:.1%} of kernel time, {g.count / per:.0f} kernel runs/step" for g in groups])
    return out


def status_line(log: StepLog, n: int, fraction: float, profiling: bool) -> str:
    """One line: step, step time, samples/s, loss, the monitor's share of training time."""
    if n == 0:
        return "ortlab monitor: waiting for the first step"
    log.materialize()
    dt = log.durations(n)[-50:]
    plain = dt[~log.profiled_mask(n)[-50:]]
    step_s = float(np.nanmedian(plain if len(plain) else dt)) if np.isfinite(dt).any() else float("nan")
    parts = [f"step {n}", f"{step_s * 1e3:.2f} ms/step"]
    batches = [b for b in log.batch[max(0, n - 50) : n] if b]
    if batches and step_s > 0 and math.isfinite(step_s):
        parts.append(f"{np.mean(batches) / step_s:,.0f} samples/s")
    loss = next((log.loss[i] for i in reversed(log.loss) if i < n and log.loss[i] is not None), None)
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    parts.append(f"monitor {fraction:.1%} of training time")
    if log.profiles:
        parts.append(f"kernels profiled at step {log.profiles[-1]['step']}")
    elif profiling:
        parts.append("kernels: first profile when the budget allows (mon.profile_now() to force)")
    return " | ".join(parts)


def figure(s: dict[str, tuple], status: str) -> Any:
    """A plain plotly Figure of :func:`series` ``s``, titled ``status``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=4, cols=2, specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None], [{}, {}]],
        subplot_titles=("loss", "step time (ms)", "samples / s", "memory (MiB)",
                        "slowest onnxruntime kernels (us / step)", "by op type (us / step)",
                        "by module (us / step)"),
        vertical_spacing=0.08, horizontal_spacing=0.22,
    )
    cells = {"loss": (1, 1), "step_ms": (1, 2), "profiled_step_ms": (1, 2), "kernel_ms": (1, 2),
             "samples_per_s": (2, 1), "top_ops": (3, 1), "op_types": (4, 1), "modules": (4, 2)}
    names = {"loss": "loss", "step_ms": "step", "profiled_step_ms": "profiled step",
             "kernel_ms": "onnxruntime kernels / step", "samples_per_s": "samples/s", "rss": "process RSS",
             "saved": "saved activations", "cuda_used": "CUDA used (device)",
             "cuda_allocated": "CUDA allocated (torch)"}
    for name in LINES:
        x, y = s[name]
        style: dict[str, Any] = {"mode": "lines"}
        if name == "profiled_step_ms":
            style = {"mode": "markers", "marker": {"size": 4}}
        elif name == "kernel_ms":
            style = {"mode": "markers", "marker": {"symbol": "diamond", "size": 8}}
        elif name in MEMORY:
            style["visible"] = bool(np.isfinite(y).any())
        row, col = cells.get(name, (2, 2))
        fig.add_trace(go.Scatter(x=x, y=y, name=names[name], **style), row=row, col=col)
    for name in BARS:
        labels, values, hover = s[name]
        row, col = cells[name]
        fig.add_trace(go.Bar(y=labels, x=values, orientation="h", hovertext=hover, showlegend=False),
                      row=row, col=col)
        fig.update_yaxes(autorange="reversed", row=row, col=col)
    for row, col in ((1, 1), (1, 2), (2, 1), (2, 2)):
        fig.update_xaxes(title_text="step", row=row, col=col)
    fig.update_layout(height=1100, title_text=status, legend={"orientation": "h", "y": -0.04})
    return fig


def update_traces(fig: Any, s: dict[str, tuple], status: str) -> None:
    """Set every trace of a :func:`figure` layout to :func:`series` ``s``, in one batch."""
    with fig.batch_update():
        for trace, name in zip(fig.data, LINES + BARS):
            if name in BARS:
                trace.y, trace.x, trace.hovertext = s[name]
            else:
                trace.x, trace.y = s[name]
                if name in MEMORY:
                    trace.visible = bool(np.isfinite(s[name][1]).any())
        fig.layout.title.text = status


def bundle(fig: Any, text: str) -> dict[str, Any]:
    """The mime bundle of a plotly figure for this front end.

    plotly picks the renderer (Colab needs HTML with plotly.js, JupyterLab and VS
    Code read plotly's JSON). Displaying the Figure itself would go through its
    ``_ipython_display_``, which ignores ``display_id``: every update would add a
    new output instead of replacing the old one.
    """
    out = dict(fig._repr_mimebundle_())
    if not out:  # no notebook renderer (plain Python, a terminal)
        out = {"text/html": fig.to_html(full_html=False, include_plotlyjs="cdn")}
    out["text/plain"] = text
    return out


def in_kernel() -> Any:
    """The IPython shell when running in a Jupyter kernel, else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def widgets_render_here() -> bool:
    """False in front ends where plotly's FigureWidget does not render (Colab, VS Code)."""
    if "google.colab" in sys.modules or "COLAB_NOTEBOOK_ID" in os.environ:
        return False
    return "VSCODE_PID" not in os.environ
