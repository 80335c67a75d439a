"""What ``compare`` finds: tensor comparators and the result records.

Comparators are pure functions (:func:`compare_tensors`) returning statistics; the
records render themselves (``str`` and ``_repr_html_``, see ``_tables``); nothing
here prints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from ortlab.errors import ConfigError
from ortlab.inspect._tables import result_html, result_text
from ortlab.inspect.views import find_view

if TYPE_CHECKING:
    from ortlab.onnx.export import ExportedGraph

__all__ = [
    "RTOL",
    "ATOL",
    "ErrorStats",
    "TensorComparison",
    "NodeComparison",
    "LayerSummary",
    "PartRun",
    "GraphRun",
    "CompareResult",
    "compare_tensors",
]

RTOL, ATOL = 1e-4, 1e-5
# A value out of tolerance by less than this factor is called borderline, not a finding.
BORDERLINE = 2.0

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
        fp32_noise: set when the value is out of tolerance but a float64 run of eager shows
            ortlab's value as close to the exact one as eager's (see Note [Judged against float64]).
    """

    name: str
    kind: str
    stats: ErrorStats | None
    note: str = ""
    fp32_noise: str = ""

    @property
    def ok(self) -> bool:
        if self.fp32_noise:
            return True
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
        note: what a divergence is where the cause is known (Note [Decided the other way on
            equal inputs] in ``ortlab.inspect._record``), or "".
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
    note: str = ""

    def describe(self) -> str:
        """One line: where the node is and how far off it is."""
        where = f"{self.graph} {self.node} ({self.op}) at {self.module or '<root>'}"
        if self.source:
            where += f", {self.source}"
        if self.stats is None:
            return f"{where}: {self.status}"
        s = self.stats
        text = (
            f"{where}: max abs {s.max_abs:.3g}, max rel {s.max_rel:.3g}, "
            f"{100 * s.mismatch_fraction:.1f}% of {s.numel} elements out of tolerance ({s.worst_ratio:.3g}x tol)"
        )
        if self.status == "diverged" and s.worst_ratio < BORDERLINE:
            text += " - borderline: within 2x of the tolerance, as fp32 rounding can be"
        if self.note:
            text += f" - {self.note}"
        return text


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
        """The first intermediate value (in execution order) out of tolerance by more than
        ``BORDERLINE`` times; the first borderline one when all are (then its line says so)."""
        clear = [n for n in self.diverged_nodes if n.stats is None or n.stats.worst_ratio >= BORDERLINE]
        return next(iter(clear or self.diverged_nodes), None)

    @property
    def worst_divergences(self) -> list[NodeComparison]:
        """Intermediate values out of tolerance, furthest beyond it first."""
        return sorted(self.diverged_nodes, key=lambda n: -(n.stats.worst_ratio if n.stats else math.inf))

    @property
    def ok(self) -> bool:
        """True when the step matches and no intermediate value is out of tolerance."""
        return self.matches and self.first_divergence is None

    def node(self, name: str, graph: str | None = None) -> NodeComparison:
        """The comparison of FX node ``name`` (in ``graph``, e.g. ``g0.backward``, if given)."""
        for n in self.nodes:
            if n.node == name and (graph is None or n.graph == graph):
                return n
        where = f" in {graph}" if graph else ""
        raise ConfigError(f"no compared node {name!r}{where}; compared nodes are listed in result.nodes "
                          "(names as in the FX graphs, e.g. 'gelu_1').")

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
    def __str__(self) -> str:
        return result_text(self)

    def _repr_html_(self) -> str:
        render = find_view("compare_html")  # with node links into netron, when ortlab.ui is loaded
        return render(self) if render is not None else result_html(self)
