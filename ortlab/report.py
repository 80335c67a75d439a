"""Records of what the engine decided, and the first-step report built from them.

Every decision carries a reason a user can read: an op that runs in PyTorch, a
graph break, an activation that is recomputed. The UI shows these reasons; it
never re-derives them.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from ortlab.errors import FallbackWarning

if TYPE_CHECKING:
    from ortlab.partition.recompute import RecomputePlan

__all__ = ["Fallback", "GraphRecord", "Report", "reset_warnings", "warn_fallback"]

_WARNED: set[tuple[str, str]] = set()


@dataclasses.dataclass
class Fallback:
    """Something that runs in PyTorch instead of onnxruntime, and why.

    Attributes:
        scope: ``op`` (one FX node), ``graph`` (a whole captured graph) or ``module``
            (the whole module call, after a capture failure).
        where: graph name (``g0.forward``) or ``ORTModule``.
        node: FX node name for ``op`` fallbacks.
        op: the op (``aten.native_dropout``) or "".
        module: nn.Module path of the node.
        source: ``file:line in function`` of the model code.
        reason: why it runs in PyTorch.
    """

    scope: str
    where: str
    reason: str
    node: str = ""
    op: str = ""
    module: str = ""
    source: str = ""

    def __str__(self) -> str:
        what = f"{self.op} ({self.node})" if self.node else self.where
        loc = f" at {self.module}" if self.module else ""
        return f"[{self.scope}] {what}{loc}: {self.reason}"


def reset_warnings() -> None:
    """Forget which fallbacks were warned about (each is warned once per process)."""
    _WARNED.clear()


def warn_fallback(fb: Fallback) -> None:
    """Warn once per (op or scope, reason)."""
    key = (fb.op or fb.scope, fb.reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"ortlab: runs in PyTorch: {fb}", FallbackWarning, stacklevel=3)


@dataclasses.dataclass
class GraphRecord:
    """One graph as compiled: forward, backward or inference of a captured graph."""

    name: str
    mode: str
    fx_ops: dict[str, int]
    onnx_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    ort_partitions: int = 0
    torch_nodes: int = 0
    export_s: float = 0.0
    session_s: float = 0.0
    threads: str = ""
    cached: int = 0
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    # For inspection tools (profiling, divergence search, graph views); not part of the text report.
    graph_module: Any = dataclasses.field(default=None, repr=False, compare=False)
    parts: list[Any] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def runners(self) -> list[Any]:
        """The ``OrtRunner`` of each onnxruntime partition."""
        return [runner for runner, _ in self.parts]


@dataclasses.dataclass
class CaptureRecord:
    """One graph Dynamo captured, with what AOTAutograd and the partitioner made of it."""

    index: int
    mode: str
    fx_ops: dict[str, int]
    capture_s: float = 0.0
    plan: RecomputePlan | None = None
    graphs: list[GraphRecord] = dataclasses.field(default_factory=list)
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Report:
    """What happened on the first step of an ORTModule (and on re-captures).

    ``str(report)`` is the readable form, logged at INFO after the first step.
    """

    captures: list[CaptureRecord] = dataclasses.field(default_factory=list)
    graph_breaks: dict[str, int] = dataclasses.field(default_factory=dict)
    module_fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    first_call_s: float = 0.0
    hints: list[str] = dataclasses.field(default_factory=list)

    @property
    def fallbacks(self) -> list[Fallback]:
        out = list(self.module_fallbacks)
        for c in self.captures:
            out.extend(c.fallbacks)
            for g in c.graphs:
                out.extend(g.fallbacks)
        return out

    @property
    def saved_activation_bytes(self) -> int:
        return sum(c.plan.saved_bytes for c in self.captures if c.plan is not None)

    def __str__(self) -> str:
        lines = ["ortlab first-step report", "=" * 24]
        lines.append(f"captured graphs: {len(self.captures)}   first call: {self.first_call_s:.2f} s")
        if self.graph_breaks:
            lines.append("graph breaks (the code between runs in PyTorch):")
            for reason, count in self.graph_breaks.items():
                lines.append(f"  {count}x {reason}")
        else:
            lines.append("graph breaks: none")
        for c in self.captures:
            lines.append(f"graph g{c.index} ({c.mode}): {sum(c.fx_ops.values())} captured ops, capture {c.capture_s:.2f} s")
            for g in c.graphs:
                top = ", ".join(f"{k} {v}" for k, v in list(g.onnx_ops.items())[:6])
                lines.append(
                    f"  {g.name:<10} {sum(g.fx_ops.values()):>5} aten ops -> {sum(g.onnx_ops.values()):>5} ONNX ops "
                    f"in {g.ort_partitions} onnxruntime part(s), {g.torch_nodes} PyTorch op(s); "
                    f"export {g.export_s:.2f} s, session {g.session_s:.2f} s"
                    + (f" ({g.cached} from the on-disk cache)" if g.cached else "")
                )
                if top:
                    lines.append(f"             top ONNX ops: {top}")
                if g.threads:
                    lines.append(f"             threads: {g.threads}")
            if c.plan is not None:
                p = c.plan
                lines.append(
                    f"  saved activations ({p.policy}): {len(p.activations) - len(p.recomputed)} saved, "
                    f"{len(p.recomputed)} recomputed, {p.saved_bytes:,} bytes (without recompute {p.baseline_bytes:,})"
                )
        fbs = self.fallbacks
        if fbs:
            lines.append(f"fallbacks to PyTorch: {len(fbs)}")
            grouped = collections.Counter(f"{f.op or f.scope}: {f.reason}" for f in fbs)
            for text, count in grouped.most_common():
                lines.append(f"  {count}x {text}")
        else:
            lines.append("fallbacks to PyTorch: none")
        files = [f for c in self.captures for f in c.files]
        if files:
            lines.append(f"saved stages: {len(files)} files, e.g. {files[0]}")
        for hint in self.hints:
            lines.append(f"hint: {hint}")
        return "\n".join(lines)
