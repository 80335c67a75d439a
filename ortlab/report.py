"""Records of what the engine decided, and the first-step report built from them.

Every decision carries a reason a user can read: an op that runs in PyTorch, a
graph break, an activation that is recomputed. The UI shows these reasons; it
never re-derives them.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

from ortlab.errors import FallbackWarning
from ortlab.provenance import restore_provenance
from ortlab.stages import StageArtifact
from ortlab.stages import label as stage_label

if TYPE_CHECKING:
    from ortlab.partition.recompute import RecomputePlan

__all__ = ["Fallback", "PartRecord", "GraphRecord", "CaptureRecord", "Report", "reset_warnings", "warn_fallback"]

_WARNED: set[tuple[str, str]] = set()


@dataclasses.dataclass
class Fallback:
    """Something that runs in PyTorch instead of onnxruntime, and why.

    Attributes:
        scope: ``op`` (one FX node), ``graph`` (a whole captured graph), ``graph_break``
            (the code around a graph break), ``frame`` (code Dynamo skipped, such as an
            ``nn.LSTM``) or ``module`` (the whole module call, after a capture failure).
        where: graph name (``g0.forward``) or ``ORTModule``.
        node: FX node name for ``op`` fallbacks.
        op: the op (``aten.native_dropout``) or "".
        module: nn.Module path of the node.
        source: ``file:line in function`` of the model code.
        reason: why it runs in PyTorch.
        kind: for ``op`` fallbacks, the kind of decision (``ortlab.placement.KINDS``).
    """

    scope: str
    where: str
    reason: str
    node: str = ""
    op: str = ""
    module: str = ""
    source: str = ""
    kind: str = ""

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
class PartRecord:
    """One onnxruntime session of a graph.

    Attributes:
        name: the partition (``fused_0``), or "" when the whole graph is one session.
        label: where it sits (``g0.forward.fused_0``, see ``ortlab.stages.label``).
        runner: the ``OrtRunner`` that calls the session.
        exported: the ``ExportedGraph`` the session was built from (after onnxscript's
            optimizer), or ``None`` for a session loaded from the on-disk cache.
        stage: the stage of the model the session was given (``onnxscript``;
            ``exported`` with onnxscript's optimizer off; ``execution`` from the cache).
    """

    name: str
    label: str
    runner: Any = dataclasses.field(repr=False)
    exported: Any = dataclasses.field(default=None, repr=False)
    stage: str = "onnxscript"


@dataclasses.dataclass
class GraphRecord:
    """One graph as compiled: forward, backward or inference of a captured graph.

    ``providers`` and ``threads`` say which execution providers and how many threads
    its sessions use, and why (the session builder's decisions); ``notes`` hold other
    decisions a user should see (a graph run as exported because onnxscript's optimizer
    failed on it).
    """

    name: str
    mode: str
    fx_ops: dict[str, int]
    capture: int = 0
    onnx_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    ort_partitions: int = 0
    torch_nodes: int = 0
    export_s: float = 0.0  # torch.onnx's translation and onnxscript's optimizer (optimize_s of it)
    session_s: float = 0.0
    optimize_s: float = 0.0
    race_s: float = 0.0  # the provider race's runs beyond the calls' own: the checks (Note in ortlab.runtime.race)
    providers: str = ""
    threads: str = ""
    cached: int = 0
    fallbacks: list[Fallback] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # What the model an OpenVINO session holds was given beyond the graph ("7 MatMul(s) split, ..."):
    # ortlab.runtime.openvino.preparation of each part's session, once per distinct answer.
    prepared: list[str] = dataclasses.field(default_factory=list)
    # For inspection tools (profiling, divergence search, graph views); not part of the text report.
    graph_module: Any = dataclasses.field(default=None, repr=False, compare=False)
    parts: list[PartRecord] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def label(self) -> str:
        """``g0.forward`` (see ``ortlab.stages.label``)."""
        return stage_label(self.capture, self.name)

    @property
    def runners(self) -> list[Any]:
        """The ``OrtRunner`` of each onnxruntime partition."""
        return [part.runner for part in self.parts]

    @property
    def measuring(self) -> int:
        """How many of its parts have not decided their providers yet: the race checks candidates on a
        part's first call and times them on its next calls (``ortlab.runtime.race``)."""
        return sum(getattr(part.runner, "race", None) is not None for part in self.parts)

    @property
    def fusions_left_out(self) -> list[str]:
        """Why this graph's sessions go without onnxruntime optimizations that would change its numbers, beyond the
        ones no session gets, once per distinct reason."""
        out: list[str] = []
        for choice in self._fusion_choices():
            out.extend(r for r in choice.model_reasons if r not in out)
        return out

    def _fusion_choices(self) -> list[Any]:
        """Each session's ``ortlab.runtime.fusions.FusionChoice``."""
        sources = [getattr(part.runner, "session_source", None) for part in self.parts]
        return [s.fusions for s in sources if getattr(s, "fusions", None) is not None]

    @property
    def providers_now(self) -> str:
        """``providers``, and how many parts are still measuring theirs."""
        if not self.measuring:
            return self.providers
        return (f"{self.providers} (still measuring on {self.measuring} of {len(self.parts)} part(s): their next "
                "calls run the candidates in turn, timed)")


@dataclasses.dataclass
class _RowsRecord:
    """What a compute optimization that drops rows did in one captured graph (one line of the report).

    Attributes:
        applied: whether it runs on the kept rows only.
        reason: why it applies or not, in words.
        module: the module path of the op it keys on, ``source`` its line of model code.
        steps: steps run with it; ``rows``/``dropped``: rows in the last step and how many were dropped;
        ``total_rows``/``total_dropped``: over all steps.
    """

    applied: bool
    reason: str
    module: str = ""
    source: str = ""
    steps: int = 0
    rows: int = 0
    dropped: int = 0
    total_rows: int = 0
    total_dropped: int = 0
    name: ClassVar[str] = ""

    def count(self, rows: int, kept: int) -> None:
        """One step over ``rows`` rows of which ``kept`` were kept."""
        self.steps += 1
        self.rows, self.dropped = rows, rows - kept
        self.total_rows += rows
        self.total_dropped += self.dropped

    def details(self) -> str:
        return ""

    def __str__(self) -> str:
        where = ", ".join(w for w in (self.module, self.source) if w)
        where = f" ({where})" if where else ""
        if not self.applied:
            return f"{self.name}: not applied{where}: {self.reason}"
        counts = (f"last step dropped {self.dropped} of {self.rows} rows; {self.total_dropped} of "
                  f"{self.total_rows} over {self.steps} step(s)") if self.steps else "no step run yet"
        return f"{self.name}: on{where}: {self.reason}; {self.details()}{counts}"


@dataclasses.dataclass
class SparsityRecord(_RowsRecord):
    """What label sparsity did (``module``: the LM head's path, ``head``); see ``_RowsRecord``."""

    name: ClassVar[str] = "label sparsity"


@dataclasses.dataclass
class PaddingRecord(_RowsRecord):
    """What embedding sparsity did (``module``: the embedding's path); see ``_RowsRecord``.

    ``packed_ops``: row-wise ops that run on the kept rows; ``unpacks``: places where rows go
    back to the padded layout (attention, the outputs).
    """

    packed_ops: int = 0
    unpacks: int = 0
    name: ClassVar[str] = "embedding sparsity"

    def details(self) -> str:
        return f"{self.packed_ops} ops on the kept rows, {self.unpacks} back to the padded layout; "


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
    sparsity: SparsityRecord | None = None
    padding: PaddingRecord | None = None  # embedding sparsity (Note [Embedding sparsity])
    purpose: str = ""  # why ortlab made this graph itself, e.g. a label-sparsity tail
    recapture: str = ""  # why Dynamo captured this code again: the guard of an earlier capture that failed
    same_as: int | None = None  # the earlier capture whose compiled graphs this one runs (the same graph)


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
        """Every fallback, each decision once: a re-capture of the same code (after a guard
        failed) repeats its ops' placements, which are listed once (graph labels aside)."""
        out = list(self.module_fallbacks)
        seen: set[tuple] = set()
        for c in self.captures:
            for fb in [*c.fallbacks, *(f for g in c.graphs for f in g.fallbacks)]:
                key = (fb.scope, fb.where.split(".", 1)[-1], fb.node, fb.op, fb.module, fb.source, fb.reason)
                if key in seen:
                    continue
                seen.add(key)
                out.append(fb)
        return out

    def session_stages(self) -> list[StageArtifact]:
        """The model each onnxruntime session runs now, as stages a sink can take.

        For notebook views of a module that already trained (the netron graphs its kernel
        and toggle tables link into): the model each session was given, with every
        node's ``ortlab.*`` provenance (restored from the cache entry for cached parts).
        """
        out = []
        for c in self.captures:
            for g in c.graphs:
                for part in g.parts:
                    if part.exported is not None:
                        model: Any = part.exported.model
                    else:
                        import onnx

                        source = part.runner.session_source.model
                        model = (onnx.load_from_string(source) if isinstance(source, bytes)
                                 else onnx.load(source, load_external_data=False))
                        model = restore_provenance(model, part.runner.provenance or {}) or model
                    out.append(StageArtifact(part.stage, c.index, g.mode, g.name, part.name, model))
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
            lines.append(f"graph {stage_label(c.index)} ({c.mode}{'; ' + c.purpose if c.purpose else ''}): "
                         f"{sum(c.fx_ops.values())} captured ops, capture {c.capture_s:.2f} s")
            if c.recapture:
                lines.append(f"  captured again because a guard of an earlier capture failed: {c.recapture}")
            if c.same_as is not None:
                lines.append(f"  the same graph as {stage_label(c.same_as)}, under the same global state: runs "
                             f"{stage_label(c.same_as)}'s compiled graphs and sessions (nothing compiled again)")
            if c.sparsity is not None:
                lines.append(f"  {c.sparsity}")
            if c.padding is not None:
                lines.append(f"  {c.padding}")
            for g in c.graphs:
                top = ", ".join(f"{k} {v}" for k, v in list(g.onnx_ops.items())[:6])
                lines.append(
                    f"  {g.name:<10} {sum(g.fx_ops.values()):>5} aten ops -> {sum(g.onnx_ops.values()):>5} ONNX ops "
                    f"in {g.ort_partitions} onnxruntime part(s), {g.torch_nodes} PyTorch op(s); "
                    f"export {g.export_s:.2f} s (onnxscript's optimizer {g.optimize_s:.2f} s), "
                    f"session {g.session_s:.2f} s" + (f", measuring providers {g.race_s:.2f} s" if g.race_s else "")
                    + (f" ({g.cached} from the on-disk cache)" if g.cached else "")
                )
                if top:
                    lines.append(f"             top ONNX ops: {top}")
                if g.providers:
                    lines.append(f"             providers: {g.providers_now}")
                for done in g.prepared:
                    lines.append(f"             {done} (ortlab/runtime/openvino.py)")
                if g.threads:
                    lines.append(f"             threads: {g.threads}")
                lines.extend(f"             note: {note}" for note in g.notes)
                lines.extend(f"             onnxruntime fusion left out: {why}" for why in g.fusions_left_out)
            if c.plan is not None:
                p = c.plan
                lines.append(
                    f"  saved activations ({p.policy}): {len(p.activations) - len(p.recomputed)} saved, "
                    f"{len(p.recomputed)} recomputed, {p.saved_bytes:,} bytes (without recompute {p.baseline_bytes:,})"
                    + (f"; {p.cost}" if p.recompute_flops else "")
                )
                if p.note:
                    lines.append(f"    note: {p.note}")
        fbs = self.fallbacks
        if fbs:
            lines.append(f"fallbacks to PyTorch: {len(fbs)}")
            grouped = collections.Counter(f"{f.op or f.scope}: {f.reason}" for f in fbs)
            for text, count in grouped.most_common():
                lines.append(f"  {count}x {text}")
        else:
            lines.append("fallbacks to PyTorch: none")
        always = next((c.always for cap in self.captures for g in cap.graphs for c in g._fusion_choices()
                       if c.always), ())
        if always:
            lines.append(f"onnxruntime optimizations no session runs: {', '.join(always)} (they change a "
                         "formula: Note [onnxruntime's fusions that change a formula] in ortlab.runtime.fusions)")
        files = [f for c in self.captures for f in c.files]
        if files:
            lines.append(f"saved stages: {len(files)} files, e.g. {files[0]}")
        for hint in self.hints:
            lines.append(f"hint: {hint}")
        return "\n".join(lines)
