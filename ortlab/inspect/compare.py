"""Compare one training step through ortlab with eager PyTorch, down to every intermediate value.

``compare(model, *inputs)`` runs one step (forward, loss, backward) twice from the same
state and the same random seed: in eager PyTorch, and through an ``ORTModule``. It
compares the outputs, the loss, every parameter gradient and every buffer, then every
intermediate value of the forward and backward graphs: each FX node's value as
onnxruntime computed it against the same node run by PyTorch. The result names the
first node that exceeds the tolerance, its op, module path and source line, and
aggregates node errors per module (a per-layer table, a heatmap in notebooks).

Comparators are pure functions (:func:`compare_tensors`) returning statistics; the
result objects render themselves (``str`` and ``_repr_html_``); nothing here prints.

Example:
    >>> result = compare(model, x, y)                  # doctest: +SKIP
    >>> result.first_divergence                        # doctest: +SKIP
    NodeComparison(graph='g0.forward', node='gelu', op='aten.gelu', module='mlp.act', ...)
    >>> print(result)                                  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import html
import logging
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx
import onnx_ir as ir
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

import ortlab.capture.backend as _backend
import ortlab.runtime.graph as _graph
from ortlab.capture.provenance import module_path, op_name, source_line
from ortlab.config import DebugOptions, Options
from ortlab.errors import OrtlabError, first_line
from ortlab.onnx.export import ExportedGraph
from ortlab.ortmodule import ORTModule
from ortlab.report import GraphRecord
from ortlab.runtime.runner import OrtRunner
from ortlab.runtime.session import create_session, providers_for

__all__ = [
    "RTOL",
    "ATOL",
    "ErrorStats",
    "TensorComparison",
    "NodeComparison",
    "LayerSummary",
    "GraphRun",
    "CompareResult",
    "compare_tensors",
    "default_loss",
    "onnx_values",
    "compare",
]

logger = logging.getLogger(__name__)

RTOL, ATOL = 1e-4, 1e-5

# ------------------------------------------------------------------------------- comparators


@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """How far ``actual`` is from ``expected``, element by element.

    An element is within tolerance when ``|actual - expected| <= atol + rtol * |expected|``
    (``torch.allclose``'s rule); NaN matches NaN. ``max_rel`` is taken over the elements
    whose ``|expected|`` exceeds ``atol`` (near zero only ``atol`` applies). ``worst_ratio`` is the largest
    ``|actual - expected| / (atol + rtol * |expected|)``: above 1 means out of tolerance,
    and it is the number the heatmap colors.
    """

    shape: tuple[int, ...]
    dtype: str
    numel: int
    mismatched: int
    max_abs: float
    max_rel: float
    mean_abs: float
    worst_ratio: float
    allclose: bool
    note: str = ""

    @property
    def mismatch_fraction(self) -> float:
        """Fraction of elements out of tolerance."""
        return self.mismatched / self.numel if self.numel else 0.0


def _mismatch(expected: torch.Tensor, note: str) -> ErrorStats:
    n = expected.numel()
    inf = math.inf
    return ErrorStats(tuple(expected.shape), str(expected.dtype).replace("torch.", ""), n, n, inf, inf, inf, inf, False, note)


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = RTOL, atol: float = ATOL) -> ErrorStats:
    """Element-wise error statistics of ``actual`` against ``expected``.

    Floating and complex tensors are compared in float64 within ``rtol``/``atol``;
    integer and bool tensors must be equal. A shape or dtype-kind mismatch gives
    ``allclose=False`` with a ``note``.

    Example:
        >>> s = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]))
        >>> s.allclose, s.mismatched, round(s.max_abs, 3)
        (False, 1, 0.1)
    """
    if tuple(actual.shape) != tuple(expected.shape):
        return _mismatch(expected, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_complex() or e.is_complex():
        a, e = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(e.to(torch.complex128))
    exact = not (e.is_floating_point() or e.is_complex())
    if exact and a.is_floating_point():
        return _mismatch(expected, f"dtype {actual.dtype} != expected {expected.dtype}")
    a, e = a.to(torch.float64), e.to(torch.float64)
    n = e.numel()
    dtype = str(expected.dtype).replace("torch.", "")
    if n == 0:
        return ErrorStats(tuple(e.shape), dtype, 0, 0, 0.0, 0.0, 0.0, 0.0, True)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    diff = torch.where(same, torch.zeros_like(a), (a - e).abs().nan_to_num(nan=math.inf))
    if exact:
        tol = torch.zeros_like(e)
    else:
        tol = atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0)
    bad = diff > tol
    ratio = torch.where(bad & (tol == 0), torch.full_like(diff, math.inf), diff / tol.clamp_min(1e-300))
    ratio = torch.where(diff == 0, torch.zeros_like(diff), ratio)
    # Relative error where it means something: where |expected| is above atol.
    rel = torch.where((diff == 0) | (e.abs() <= atol), torch.zeros_like(diff), diff / e.abs().clamp_min(1e-300))
    mismatched = int(bad.sum())
    return ErrorStats(
        shape=tuple(e.shape),
        dtype=dtype,
        numel=n,
        mismatched=mismatched,
        max_abs=float(diff.max()),
        max_rel=float(rel.max()),
        mean_abs=float(diff.mean()),
        worst_ratio=float(ratio.max()),
        allclose=mismatched == 0,
    )


# ----------------------------------------------------------------------------------- results


@dataclasses.dataclass
class TensorComparison:
    """One step-level value (an output, the loss, a gradient, a buffer) compared.

    Attributes:
        name: ``out[0]``, ``loss``, ``fc.weight``...
        kind: ``output``, ``loss``, ``grad``, ``input_grad`` or ``buffer``.
        stats: the error statistics; ``None`` when one side has no value.
        note: why there are no statistics (``grad is None in ortlab only``).
    """

    name: str
    kind: str
    stats: ErrorStats | None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.stats.allclose if self.stats is not None else not self.note


@dataclasses.dataclass
class NodeComparison:
    """One intermediate value: an FX node of a forward or backward graph.

    Attributes:
        graph: ``g0.forward``, ``g0.backward``... (the captured graph and its part).
        index: position of the node in its graph.
        node: the FX node name (also the ONNX value name and ``ortlab.fx_node``).
        op: ``aten.gelu``...
        module: nn.Module path of the node ("" for the root module).
        source: ``file:line in function`` of the model code.
        status: ``ok``, ``diverged``, ``pytorch`` (ran in PyTorch and never reached
            onnxruntime: nothing to compare) or ``absent`` (no onnxruntime value:
            folded, aliased or renamed away).
        stats: the error statistics when both sides have a value.
        runtime: where the step computed it: ``onnxruntime`` or ``pytorch`` (a fallback
            op whose value an onnxruntime part received is still compared).
    """

    graph: str
    index: int
    node: str
    op: str
    module: str
    source: str
    status: str
    stats: ErrorStats | None = None
    runtime: str = "onnxruntime"

    def describe(self) -> str:
        """One line: where the node is and how far off it is."""
        where = f"{self.graph} {self.node} ({self.op}) at {self.module or '<root>'}"
        if self.source:
            where += f", {self.source}"
        if self.stats is None:
            return f"{where}: {self.status}"
        s = self.stats
        return (
            f"{where}: max abs {s.max_abs:.3g}, max rel {s.max_rel:.3g}, "
            f"{100 * s.mismatch_fraction:.1f}% of {s.numel} elements out of tolerance ({s.worst_ratio:.3g}x tol)"
        )


@dataclasses.dataclass
class LayerSummary:
    """Node errors of one module, per graph (``forward``/``backward``/``inference``).

    Attributes:
        module: nn.Module path ("" for the root).
        worst: per graph name, the largest error / tolerance ratio of its nodes.
        nodes: nodes compared.
        diverged: nodes out of tolerance.
        first: the module's first diverged node, if any.
    """

    module: str
    worst: dict[str, float]
    nodes: int
    diverged: int
    first: NodeComparison | None


@dataclasses.dataclass
class PartRun:
    """One onnxruntime session of a graph as it ran: its model and its inputs."""

    exported: ExportedGraph
    inputs: list[Any] = dataclasses.field(repr=False)
    values: dict[str, str] = dataclasses.field(default_factory=dict)  # FX node -> its ONNX value name


@dataclasses.dataclass
class GraphRun:
    """One compiled graph as called in the compared step (kept for repro scripts).

    Attributes:
        where: ``g0`` (the captured graph); ``name``: forward, backward or inference.
        graph_module: the FX graph AOTAutograd handed to ortlab.
        inputs: the inputs PyTorch's reference run of the graph used.
        parts: the onnxruntime sessions with the inputs each received.
        reference: every node's value in PyTorch's run (dropped with ``keep_values=False``).
        onnx: every node's value as onnxruntime computed it (same).
        rng: the CPU random state when the graph was called (random ops draw from it).
    """

    where: str
    name: str
    graph_module: torch.fx.GraphModule = dataclasses.field(repr=False)
    inputs: list[Any] = dataclasses.field(repr=False)
    parts: list[PartRun] = dataclasses.field(repr=False)
    reference: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    onnx: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    rng: torch.Tensor | None = dataclasses.field(default=None, repr=False)  # CPU RNG state at the call

    @property
    def label(self) -> str:
        return f"{self.where}.{self.name}"


def _ratio_color(ratio: float | None) -> str:
    """Green (far within tolerance) -> yellow (at 1e-2 of it) -> red (beyond)."""
    if ratio is None:
        return "#eeeeee"
    if ratio > 1:
        return "#f4a6a6" if ratio < 100 else "#e05555"
    x = 0.0 if ratio <= 1e-4 else min(1.0, (math.log10(ratio) + 4) / 4)  # 1e-4 -> 0, 1 -> 1
    r, g = int(170 + 85 * x), int(230 - 30 * x)
    return f"#{r:02x}{g:02x}aa"


_HTML_NODES = 25


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


@dataclasses.dataclass
class CompareResult:
    """Everything one compared step found; ``str()`` is a readable report.

    Attributes:
        rtol, atol: the tolerances used.
        options: the ORTModule options of the ortlab side.
        outputs, loss, grads, buffers: step-level comparisons.
        nodes: every intermediate value, graphs in execution order (forward
            graphs, then backward graphs as autograd called them), nodes in graph order.
        graphs: the graphs as they ran (for repro scripts).
        notes: anything that limited the comparison.
    """

    rtol: float
    atol: float
    options: dict[str, Any]
    outputs: list[TensorComparison]
    loss: TensorComparison | None
    grads: list[TensorComparison]
    buffers: list[TensorComparison]
    nodes: list[NodeComparison] = dataclasses.field(default_factory=list)
    graphs: list[GraphRun] = dataclasses.field(default_factory=list, repr=False)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> list[TensorComparison]:
        """Outputs, loss, gradients and buffers, in that order."""
        return self.outputs + ([self.loss] if self.loss is not None else []) + self.grads + self.buffers

    @property
    def matches(self) -> bool:
        """True when outputs, loss, every gradient and every buffer are within tolerance."""
        return all(c.ok for c in self.step)

    @property
    def diverged_nodes(self) -> list[NodeComparison]:
        return [n for n in self.nodes if n.status == "diverged"]

    @property
    def first_divergence(self) -> NodeComparison | None:
        """The first intermediate value (in execution order) out of tolerance."""
        return next(iter(self.diverged_nodes), None)

    @property
    def ok(self) -> bool:
        """True when the step matches and no intermediate value is out of tolerance."""
        return self.matches and self.first_divergence is None

    def node(self, name: str, graph: str | None = None) -> NodeComparison:
        """The comparison of FX node ``name`` (in ``graph``, e.g. ``g0.backward``, if given)."""
        for n in self.nodes:
            if n.node == name and (graph is None or n.graph == graph):
                return n
        raise KeyError(f"no compared node {name!r}" + (f" in {graph}" if graph else ""))

    @property
    def first_divergent_layer(self) -> LayerSummary | None:
        """The per-layer row of the module where the first divergence is."""
        first = self.first_divergence
        return next((layer for layer in self.layers() if first is not None and layer.first is first), None)

    def layers(self) -> list[LayerSummary]:
        """Node errors aggregated by module path, modules in order of first appearance."""
        out: dict[str, LayerSummary] = {}
        for n in self.nodes:
            if n.stats is None:
                continue
            layer = out.setdefault(n.module, LayerSummary(n.module, {}, 0, 0, None))
            kind = n.graph.split(".")[-1]
            layer.worst[kind] = max(layer.worst.get(kind, 0.0), n.stats.worst_ratio)
            layer.nodes += 1
            if n.status == "diverged":
                layer.diverged += 1
                layer.first = layer.first or n
        return list(out.values())

    # ------------------------------------------------------------------------ rendering
    def _graph_kinds(self) -> list[str]:
        kinds: list[str] = []
        for n in self.nodes:
            k = n.graph.split(".")[-1]
            if k not in kinds:
                kinds.append(k)
        return kinds

    def _verdict(self) -> str:
        return "OK" if self.ok else ("DIVERGED" if not self.matches else "INTERMEDIATES DIVERGE")

    def __str__(self) -> str:
        lines = [f"ortlab.compare: {self._verdict()} (rtol={self.rtol:g}, atol={self.atol:g})"]
        for label, group in (("outputs", self.outputs), ("loss", [self.loss] if self.loss else []),
                             ("grads", self.grads), ("buffers", self.buffers)):
            if not group:
                continue
            bad = [c for c in group if not c.ok]
            worst = max((c for c in group if c.stats), key=lambda c: c.stats.worst_ratio, default=None)  # type: ignore[union-attr]
            text = f"  {label:<8} {len(group) - len(bad)}/{len(group)} within tolerance"
            if worst is not None and worst.stats is not None:
                text += f"; worst {worst.name}: max abs {worst.stats.max_abs:.3g}, max rel {worst.stats.max_rel:.3g}"
            lines.append(text)
            lines.extend(f"           {c.name}: {c.note}" for c in bad if c.note)
        compared = [n for n in self.nodes if n.stats is not None]
        lines.append(f"intermediates: {len(compared)} compared, {len(self.diverged_nodes)} out of tolerance, "
                     f"{sum(n.runtime == 'pytorch' for n in self.nodes)} ran in PyTorch")
        first = self.first_divergence
        lines.append(f"first divergence: {first.describe()}" if first else "first divergence: none")
        layers = self.layers()
        if layers:
            kinds = self._graph_kinds()
            rows = [["module", *[f"{k} err/tol" for k in kinds], "nodes", "diverged", "first diverged node"]]
            for layer in layers:
                mark = "  <- first divergence" if first is not None and layer.first is first else ""
                rows.append([layer.module or "<root>", *[_fmt(layer.worst.get(k)) for k in kinds], str(layer.nodes),
                             str(layer.diverged), (f"{layer.first.node} ({layer.first.op})" if layer.first else "-") + mark])
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines.append("per layer (largest error / tolerance; above 1 is out of tolerance):")
            lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        color = "#2e7d32" if self.ok else "#c62828"
        parts = [f"<div><b style='color:{color}'>ortlab.compare: {self._verdict()}</b> "
                 f"(rtol={self.rtol:g}, atol={self.atol:g})</div>"]
        rows = "".join(
            f"<tr style='background:{_ratio_color(c.stats.worst_ratio if c.stats else None)}'><td>{esc(c.kind)}</td>"
            f"<td>{esc(c.name)}</td><td>{_fmt(c.stats.max_abs if c.stats else None)}</td>"
            f"<td>{_fmt(c.stats.max_rel if c.stats else None)}</td><td>{'yes' if c.ok else 'no'}</td></tr>"
            for c in self.step
        )
        parts.append("<table><tr><th>kind</th><th>value</th><th>max abs</th><th>max rel</th><th>ok</th></tr>"
                     f"{rows}</table>")
        first = self.first_divergence
        parts.append(f"<p><b>first divergence:</b> {esc(first.describe()) if first else 'none'}</p>")
        kinds = self._graph_kinds()
        head = "".join(f"<th>{esc(k)}</th>" for k in kinds)
        body = []
        for layer in self.layers():
            cells = "".join(
                f"<td style='background:{_ratio_color(layer.worst.get(k))}'>{_fmt(layer.worst.get(k))}</td>" for k in kinds
            )
            first_node = f"{esc(layer.first.node)} ({esc(layer.first.op)})" if layer.first else "-"
            body.append(f"<tr><td>{esc(layer.module or '<root>')}</td>{cells}<td>{layer.nodes}</td>"
                        f"<td>{layer.diverged}</td><td>{first_node}</td></tr>")
        parts.append("<p>per layer, largest error / tolerance (above 1 is out of tolerance):</p>"
                     f"<table><tr><th>module</th>{head}<th>nodes</th><th>diverged</th><th>first diverged node</th></tr>"
                     + "".join(body) + "</table>")
        diverged = self.diverged_nodes
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
        parts.extend(f"<p><i>{esc(n)}</i></p>" for n in self.notes)
        return "".join(parts)


# ----------------------------------------------------------------------------------- the step


def _weights(t: torch.Tensor) -> torch.Tensor:
    n = max(t.numel(), 1)
    w = 1.0 + 0.5 * torch.sin(torch.arange(n, dtype=torch.float32, device=t.device) * 0.37 + 0.1)
    return w[: t.numel()].reshape(t.shape).to(t.dtype)


def default_loss(output: Any) -> torch.Tensor | None:
    """The loss ``compare`` backpropagates when no ``loss_fn`` is given.

    A scalar floating output is the loss itself; otherwise every differentiable floating
    leaf of the output is weighted by fixed, non-uniform weights and summed (uniform
    weights would hide errors that cancel out). ``None`` when nothing is differentiable.

    Example:
        >>> default_loss(torch.tensor(2.0, requires_grad=True))
        tensor(2., requires_grad=True)
    """
    leaves = [leaf for leaf in pytree.tree_leaves(output)
              if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad]
    if len(leaves) == 1 and leaves[0].dim() == 0 and isinstance(output, torch.Tensor):
        return leaves[0]
    terms = [(leaf * _weights(leaf)).float().sum() for leaf in leaves]
    return sum(terms) if terms else None  # type: ignore[return-value]


def _clone(tree: Any) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    return pytree.tree_map(one, tree)


def _snapshot(values: Sequence[Any]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


@dataclasses.dataclass
class _Step:
    outputs: list[tuple[str, Any]]
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    input_grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _run_step(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], Any], seed: int) -> _Step:
    args, kwargs = _clone((args, kwargs))
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    loss = loss_fn(out)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    paths, _ = pytree.tree_flatten_with_path(out)
    outputs = [(f"out{pytree.keystr(p)}", v.detach() if isinstance(v, torch.Tensor) else v) for p, v in paths]
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return _Step(
        outputs,
        loss.detach() if isinstance(loss, torch.Tensor) else None,
        {n: p.grad for n, p in module.named_parameters()},
        [t.grad for t in leaves],
        {n: b.detach().clone() for n, b in module.named_buffers()},
    )


def _pair(name: str, kind: str, actual: Any, expected: Any, rtol: float, atol: float) -> TensorComparison:
    if actual is None and expected is None:
        return TensorComparison(name, kind, None)
    if actual is None or expected is None:
        side = "ortlab" if actual is None else "eager PyTorch"
        return TensorComparison(name, kind, None, f"None in {side} only")
    if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
        return TensorComparison(name, kind, compare_tensors(actual, expected, rtol=rtol, atol=atol))
    if type(actual) is not type(expected):
        return TensorComparison(name, kind, None, f"{type(actual).__name__} != expected {type(expected).__name__}")
    if actual == expected or (isinstance(expected, float) and math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol)):
        return TensorComparison(name, kind, None)
    return TensorComparison(name, kind, None, f"{actual!r} != {expected!r}")


def _compare_steps(ort: _Step, eager: _Step, rtol: float, atol: float) -> tuple[list, TensorComparison | None, list, list]:
    outputs = [_pair(n, "output", a, e, rtol, atol) for (n, a), (_, e) in zip(ort.outputs, eager.outputs)]
    if len(ort.outputs) != len(eager.outputs):
        outputs.append(TensorComparison("out", "output", None, f"{len(ort.outputs)} outputs != {len(eager.outputs)}"))
    loss = _pair("loss", "loss", ort.loss, eager.loss, rtol, atol) if eager.loss is not None else None
    grads = [_pair(n, "grad", ort.grads.get(n), g, rtol, atol) for n, g in eager.grads.items()]
    grads += [_pair(f"input_grad[{i}]", "input_grad", a, e, rtol, atol)
              for i, (a, e) in enumerate(zip(ort.input_grads, eager.input_grads))]
    buffers = [_pair(n, "buffer", ort.buffers.get(n), b, rtol, atol) for n, b in eager.buffers.items()]
    return outputs, loss, grads, buffers


# Note [Recording what each graph received]
# The per-node comparison needs the exact inputs of every compiled graph: parameters and
# buffers as AOTAutograd passes them plus the user inputs (forward), the saved
# activations and incoming gradients (backward), and, when some ops fall back to
# PyTorch, what each onnxruntime partition received. None of this is kept by the
# engine, so while the compared step runs we patch two names, reversibly:
# * ``compile_graph`` as the backend calls it: the callable it returns is wrapped to
#   copy its boxed argument list (and the RNG state, so PyTorch's reference run of a
#   graph with dropout draws the same numbers) on its first call;
# * ``OrtRunner`` as ``runtime.graph`` builds it: a subclass that copies its inputs.
# Only the ORTModule that ``compare`` builds itself is compiled inside the patch, so no
# other model is touched, and each graph is recorded on its first call only.


@dataclasses.dataclass
class _GraphCall:
    record: GraphRecord
    where: str
    inputs: list[Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


class _RecordingRunner(OrtRunner):
    recorded: list[Any] | None = None

    def __call__(self, *args: object) -> list:
        if self.recorded is None:
            self.recorded = _snapshot(args)
        return super().__call__(*args)


@contextlib.contextmanager
def _recording(calls: list[_GraphCall]) -> Iterator[None]:
    original = _backend.compile_graph

    def compile_graph(gm: torch.fx.GraphModule, name: str, mode: str, ctx: Any) -> tuple[Callable, GraphRecord]:
        fn, record = original(gm, name, mode, ctx)
        seen = False

        def run(args: list) -> Any:
            nonlocal seen
            if not seen:
                seen = True
                cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
                calls.append(_GraphCall(record, ctx.where, _snapshot(args), torch.get_rng_state(), cuda))
            return fn(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run, record

    old_runner = _graph.OrtRunner
    _backend.compile_graph = compile_graph  # type: ignore[assignment]
    _graph.OrtRunner = _RecordingRunner  # type: ignore[misc]
    try:
        yield
    finally:
        _backend.compile_graph = original  # type: ignore[assignment]
        _graph.OrtRunner = old_runner  # type: ignore[misc]


class _Values(torch.fx.Interpreter):
    """Runs a graph in PyTorch, keeping every tensor-valued node's output."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output" and isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach()
        return out


def _tensor_nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}


def _onnx_names(nodes: dict[str, torch.fx.Node]) -> dict[str, str]:
    """ONNX value name -> FX node name: torch.onnx names values after FX nodes, ``x__i`` for outputs of tuples."""
    names = {name: name for name in nodes}
    for name, node in nodes.items():
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            names.setdefault(f"{node.args[0].name}__{node.args[1]}", name)
    return names


def onnx_value_names(model: ir.Model, wanted: dict[str, torch.fx.Node]) -> dict[str, str]:
    """FX node name -> name of the ONNX value (a node output of ``model``) that holds it."""
    by_name = _onnx_names(wanted)
    chosen: dict[str, str] = {}
    for node in model.graph:
        for value in node.outputs:
            fx = by_name.get(value.name or "")
            if fx is not None and fx not in chosen:
                chosen[fx] = value.name  # type: ignore[assignment]
    return chosen


def onnx_values(
    exported: ExportedGraph, inputs: Sequence[Any], wanted: dict[str, torch.fx.Node], options: Options, device: torch.device
) -> dict[str, torch.Tensor]:
    """Run a copy of ``exported``'s model that outputs the value of every FX node in ``wanted``.

    Returns FX node name -> value for the nodes the ONNX model computes (a node folded
    away or aliased to an input has no value of its own). The copy runs with the same
    options; onnxruntime cannot fuse away a value that is an output, so a fused kernel
    may be split where the original session ran it whole.

    Example:
        >>> values = onnx_values(exported, inputs, {"gelu": gelu_node}, Options(), torch.device("cpu"))  # doctest: +SKIP
    """
    model = ir.serde.deserialize_model(onnx.load_from_string(exported.to_bytes()))
    names = onnx_value_names(model, wanted)
    if not names:
        return {}
    values = {v.name: v for node in model.graph for v in node.outputs}
    model.graph.outputs.clear()
    for onnx_name in names.values():
        model.graph.outputs.append(values[onnx_name])
    dtypes: list[torch.dtype | None] = [wanted[fx].meta["val"].dtype for fx in names]
    data = ir.to_proto(model).SerializeToString()
    threads = options.intra_op_num_threads or 1
    session, _ = create_session(data, options, DebugOptions(), providers_for(device.type, options), None, threads)
    kinds: list[str | None] = ["tensor"] * len(names)
    runner = OrtRunner(session, exported.input_kinds, kinds, dtypes, [None] * len(names), device)
    return dict(zip(names, runner(*inputs)))


def _compare_graph(
    call: _GraphCall, env: dict[tuple[str, str], torch.Tensor], options: Options, rtol: float, atol: float
) -> tuple[list[NodeComparison], GraphRun]:
    record, gm = call.record, call.record.graph_module
    label = f"{call.where}.{record.name}"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # See Note [Chained reference]: a backward input that is a forward value of the
    # same capture takes PyTorch's forward value, not onnxruntime's.
    inputs = []
    for node, recorded in zip(placeholders, call.inputs):
        ref = env.get((call.where, node.name))
        same = isinstance(ref, torch.Tensor) and isinstance(recorded, torch.Tensor) and ref.shape == recorded.shape \
            and ref.dtype == recorded.dtype
        inputs.append(ref if same else recorded)
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cuda = list(range(len(call.cuda_rng))) if call.cuda_rng is not None else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.set_rng_state(call.rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state_all(call.cuda_rng)
        interp = _Values(gm)
        interp.run(*inputs)
    reference = interp.values
    for name, value in reference.items():
        env[(call.where, name)] = value
    nodes = _tensor_nodes(gm)
    onnx_vals: dict[str, torch.Tensor] = {}
    parts: list[PartRun] = []
    for runner, exported in record.parts:
        recorded = getattr(runner, "recorded", None)
        if exported is None or recorded is None:
            logger.warning("no inputs were recorded for a session of %s; its values are not compared", label)
            continue
        try:
            got = onnx_values(exported, recorded, nodes, options, device)
        except OrtlabError as e:
            logger.warning("could not read intermediate values of %s: %s", label, first_line(e))
            got = {}
        onnx_vals.update(got)
        names = onnx_value_names(exported.model, nodes)
        parts.append(PartRun(exported, recorded, {fx: names[fx] for fx in got}))
    # Values computed by PyTorch that an onnxruntime part received are compared too.
    crossing: dict[str, Any] = {}
    for part in parts:
        for name, value in zip(part.exported.input_names, part.inputs):
            if name in nodes and name not in onnx_vals and isinstance(value, torch.Tensor):
                crossing[name] = value
    in_torch = {fb.node for fb in record.fallbacks if fb.node} if record.parts else set(nodes)
    in_torch |= {n for n, node in nodes.items() if node.target is operator.getitem and str(node.args[0]) in in_torch}
    result = []
    for index, node in enumerate(gm.graph.nodes):
        if node.name not in nodes:
            continue
        info = dict(graph=label, index=index, node=node.name, op=op_name(node), module=module_path(node),
                    source=source_line(node))
        runtime = "pytorch" if node.name in in_torch else "onnxruntime"
        actual, expected = onnx_vals.get(node.name, crossing.get(node.name)), reference.get(node.name)
        if actual is None or expected is None:
            status = "pytorch" if runtime == "pytorch" else "absent"
            result.append(NodeComparison(status=status, runtime=runtime, **info))
            continue
        stats = compare_tensors(actual, expected, rtol=rtol, atol=atol)
        result.append(NodeComparison(status="ok" if stats.allclose else "diverged", stats=stats, runtime=runtime, **info))
    run = GraphRun(call.where, record.name, gm, inputs, parts, reference, onnx_vals, call.rng)
    return result, run


# Note [Chained reference]
# PyTorch's reference for the backward graph takes the saved activations from
# PyTorch's run of the forward graph (placeholders of the backward graph carry the
# names of the forward nodes they come from: both graphs are cut from one joint
# graph), and the incoming gradients from the recorded call. So every node is compared
# with an all-PyTorch run of the same decomposition, errors accumulate the way they do
# in training, and the first node out of tolerance is where the divergence starts.


def compare(
    model: nn.Module,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    intermediates: bool = True,
    keep_values: bool = True,
    seed: int = 0,
    **options: Any,
) -> CompareResult:
    """Run one training step in eager PyTorch and through ortlab from the same state; compare all.

    The model is deep-copied for each side, so its parameters, gradients and buffers
    are untouched. Both sides use random seed ``seed``.

    Args:
        model: an ``nn.Module`` or an ``ORTModule`` (then its wrapped module and options).
        *inputs: positional inputs of the forward.
        forward_kwargs: keyword inputs of the forward.
        loss_fn: output -> scalar loss to backpropagate (default :func:`default_loss`).
        rtol, atol: tolerances of every comparison.
        intermediates: also compare every intermediate value (slower: the graphs run
            again in PyTorch and in onnxruntime with every value as an output).
        keep_values: keep every node's two values in ``result.graphs`` (for repro).
        seed: the random seed of both steps.
        **options: ORTModule options of the ortlab side (``fallback_ops`` ...).

    Returns:
        A :class:`CompareResult`.

    Example:
        >>> result = compare(model, x, y, fallback_ops=["aten.gelu"])   # doctest: +SKIP
        >>> result.matches, result.first_divergence                        # doctest: +SKIP
    """
    if isinstance(model, ORTModule):
        merged = {f.name: getattr(model.options, f.name) for f in dataclasses.fields(Options) if f.name != "from_env"}
        options = {**merged, **options}
        model = model.module
    options = {**options, "cache_dir": None}  # cached parts have no ONNX model to inspect
    opts = Options.from_kwargs(options)
    kwargs = forward_kwargs or {}
    loss_fn = loss_fn or default_loss
    eager_model, ort_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (eager_model, ort_model):
        for p in m.parameters():
            p.grad = None
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves((inputs, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    calls: list[_GraphCall] = []
    with torch.random.fork_rng(devices=devices):
        eager = _run_step(eager_model, inputs, kwargs, loss_fn, seed)
        om = ORTModule(ort_model, **options)
        with _recording(calls):
            ort = _run_step(om, inputs, kwargs, loss_fn, seed)
    outputs, loss, grads, buffers = _compare_steps(ort, eager, rtol, atol)
    result = CompareResult(rtol, atol, dict(options), outputs, loss, grads, buffers)
    report = om.report
    if not report.captures or any(f.scope == "module" for f in report.module_fallbacks):
        result.notes.append("the step did not run through onnxruntime: " + "; ".join(map(str, report.module_fallbacks)))
    ops = collections.Counter(f"{fb.op or fb.scope}: {fb.reason}" for fb in report.fallbacks if fb.scope != "module")
    result.notes.extend(f"ran in PyTorch: {count}x {what}" for what, count in ops.items())
    if intermediates:
        graphs = sum(len(c.graphs) for c in report.captures)
        if len(calls) < graphs:
            result.notes.append(f"only {len(calls)} of {graphs} compiled graphs were recorded while the step ran; "
                                "the others have no intermediate values (this is a bug in ortlab.inspect)")
        env: dict[tuple[str, str], torch.Tensor] = {}
        for call in calls:
            nodes, run = _compare_graph(call, env, opts, rtol, atol)
            if not keep_values:
                run.reference, run.onnx = {}, {}
            result.nodes.extend(nodes)
            result.graphs.append(run)
    logger.debug("%s", result)
    return result
