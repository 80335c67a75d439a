"""The stages of the pipeline: the one list of their names, the typed artifact each produces, sinks.

Shared ground: the engine, the folder writer (``ortlab.artifacts``), ``explore()``'s lab
and the notebook views all name stages from this module, and nothing here imports a
stage of the pipeline.

The engine hands every stage it produces to a sink as a :class:`StageArtifact`: the
FX graph or ONNX model itself, which captured graph, graph and onnxruntime part it
belongs to, and the seconds the engine's own clock gave it. A file name is for people
(:func:`file_name`); nothing reads one back to learn what a stage is.

==================  =====  =====================================================
stage               kind   what it is
==================  =====  =====================================================
``captured``        fx     the FX graph Dynamo captured (torch-level ops)
``joint``           fx     AOTAutograd's joint forward+backward graph (aten ops)
``forward``         fx     the forward graph after the split
``backward``        fx     the backward graph after the split
``inference``       fx     the no-grad (eval) graph
``exported``        onnx   ONNX as torch.onnx's translator (torchlib) wrote it
``onnxscript``      onnx   after onnxscript's optimizer (what onnxruntime is given)
``ort_basic``       onnx   as onnxruntime optimizes it at level basic
``ort_extended``    onnx   ... at level extended
``ort_all``         onnx   ... at level all
``execution``       onnx   the model the session runs (optimized at the chosen level)
==================  =====  =====================================================
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ortlab.errors import InternalError

__all__ = [
    "StageSpec",
    "STAGES",
    "STAGE_NAMES",
    "FX_STAGES",
    "ORT_LEVEL_STAGES",
    "LabStageSpec",
    "LAB_STAGES",
    "label",
    "file_name",
    "StageArtifact",
    "StageSink",
    "Stages",
    "count_ops",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage the engine produces: its name, ``fx`` or ``onnx``, and what it is."""

    name: str
    kind: str
    description: str


STAGES: tuple[StageSpec, ...] = (
    StageSpec("captured", "fx", "the FX graph Dynamo captured (torch-level ops)"),
    StageSpec("joint", "fx", "AOTAutograd's joint forward+backward graph (aten ops)"),
    StageSpec("forward", "fx", "the forward graph after the forward/backward split"),
    StageSpec("backward", "fx", "the backward graph after the forward/backward split"),
    StageSpec("inference", "fx", "the no-grad (eval) graph"),
    StageSpec("exported", "onnx", "ONNX as torch.onnx's translator (torchlib) wrote it"),
    StageSpec("onnxscript", "onnx", "ONNX after onnxscript's optimizer: what onnxruntime is given"),
    StageSpec("ort_basic", "onnx", "as onnxruntime optimizes it at level basic"),
    StageSpec("ort_extended", "onnx", "as onnxruntime optimizes it at level extended"),
    StageSpec("ort_all", "onnx", "as onnxruntime optimizes it at level all"),
    StageSpec("execution", "onnx", "the model the session runs"),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
_KIND = {s.name: s.kind for s in STAGES}
FX_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.kind == "fx")
ORT_LEVEL_STAGES: dict[str, str] = {"ort_basic": "basic", "ort_extended": "extended", "ort_all": "all"}


@dataclasses.dataclass(frozen=True)
class LabStageSpec:
    """A step of ``ortlab.explore``'s lab: a title, what it shows, and the engine stages it groups."""

    name: str
    title: str
    description: str
    stages: tuple[str, ...]


# The lab's steps, in pipeline order; each groups engine stages of STAGES ("step" runs a
# training step and shows the models the sessions run).
LAB_STAGES: tuple[LabStageSpec, ...] = (
    LabStageSpec("captured", "Captured graph",
                 "The FX graph(s) Dynamo captured (torch-level ops), with every graph break and its reason.",
                 ("captured",)),
    LabStageSpec("joint", "Joint forward+backward graph",
                 "AOTAutograd's joint graph: forward and backward traced together, decomposed to aten ops.",
                 ("joint",)),
    LabStageSpec("split", "Forward/backward split",
                 "The partitioner's forward and backward graphs and the activations the forward saves for the backward.",
                 ("forward", "backward", "inference")),
    LabStageSpec("exported", "ONNX as exported",
                 "Each graph (or onnxruntime partition) translated to ONNX by torchlib, before any optimization.",
                 ("exported",)),
    LabStageSpec("onnxscript", "ONNX after onnxscript",
                 "After onnxscript's optimizer: constant folding and pattern clean-up.", ("onnxscript",)),
    LabStageSpec("ort_basic", "onnxruntime: basic",
                 "The model as onnxruntime optimizes it at level basic (constant folding, redundant nodes).",
                 ("ort_basic",)),
    LabStageSpec("ort_extended", "onnxruntime: extended",
                 "The model as onnxruntime optimizes it at level extended (fusions such as Gelu, LayerNorm).",
                 ("ort_extended",)),
    LabStageSpec("ort_all", "onnxruntime: all",
                 "The model as onnxruntime optimizes it at level all (layout optimizations).", ("ort_all",)),
    LabStageSpec("step", "First training step",
                 "One forward and backward through onnxruntime: the models the sessions run, the loss and the timings.",
                 ("execution",)),
)


def label(capture: int, graph: str = "", part: str = "") -> str:
    """The one spelling of where a graph sits: ``g0``, ``g0.forward``, ``g0.forward.fused_0``.

    Example:
        >>> label(1, "backward", "fused_0")
        'g1.backward.fused_0'
    """
    out = f"g{capture}"
    if graph:
        out += f".{graph}"
        if part:
            out += f".{part}"
    return out


def file_name(prefix: str, artifact: StageArtifact) -> str:
    """The file a stage is saved as (for people; never parsed back).

    ``{prefix}[_g{i}]_{stage}_{mode}.py`` for FX stages and
    ``{prefix}[_g{i}]_{graph}[_{part}]_{stage}_{mode}.onnx`` for ONNX ones; ``_g{i}``
    only for captured graphs after the first.

    Example:
        >>> file_name("gpt", StageArtifact("exported", 0, "train", "forward", content=b""))
        'gpt_forward_exported_train.onnx'
    """
    head = prefix if artifact.capture == 0 else f"{prefix}_g{artifact.capture}"
    if artifact.kind == "fx":
        return f"{head}_{artifact.stage}_{artifact.mode}.py"
    graph = artifact.graph + (f"_{artifact.part}" if artifact.part else "")
    return f"{head}_{graph}_{artifact.stage}_{artifact.mode}.onnx"


@dataclasses.dataclass
class StageArtifact:
    """One stage of one graph, as the engine made it.

    Attributes:
        stage: a name of :data:`STAGE_NAMES`.
        capture: the captured graph it belongs to (``0`` for ``g0``).
        mode: ``train`` or ``eval``.
        graph: ``forward``, ``backward`` or ``inference`` ("" for ``captured``/``joint``).
        part: the onnxruntime part (``fused_0``) when some ops run in PyTorch, else "".
        content: a ``torch.fx.GraphModule`` (fx stages), an ``onnx_ir.Model``, an
            ``onnx.ModelProto`` or serialized bytes (onnx stages). Valid during
            :meth:`StageSink.accept` only: the engine goes on changing it (onnxscript
            optimizes the exported model in place).
        seconds: what producing this stage took, by the engine's clock.
    """

    stage: str
    capture: int
    mode: str
    graph: str = ""
    part: str = ""
    content: Any = dataclasses.field(default=None, repr=False)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.stage not in _KIND:
            raise InternalError(f"unknown stage {self.stage!r}; stages: {STAGE_NAMES}")

    @property
    def kind(self) -> str:
        """``fx`` or ``onnx``."""
        return _KIND[self.stage]

    @property
    def label(self) -> str:
        """``g0`` for whole captured graphs, ``g0.forward[.fused_0]`` otherwise (see :func:`label`)."""
        return label(self.capture, self.graph, self.part)

    def onnx_bytes(self) -> bytes:
        """The ONNX model serialized (onnx stages only)."""
        return serialize_onnx(self.content)

    def fx_code(self) -> str:
        """The FX graph as readable code (fx stages only)."""
        return self.content.print_readable(print_output=False, include_stride=False, include_device=True)

    def op_counts(self) -> dict[str, int]:
        """Ops of this stage and how often each occurs (see :func:`count_ops`)."""
        return count_ops(self.content)


def serialize_onnx(model: Any) -> bytes:
    """Bytes of an ``onnx_ir.Model``, an ``onnx.ModelProto`` or bytes."""
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString()
    import onnx_ir as ir

    return ir.to_proto(model).SerializeToString()


class StageSink(Protocol):
    """What the engine hands stages to: a folder writer, a lab, a view.

    ``wants`` is asked before a stage is produced, so stages nobody wants cost nothing
    (the onnxruntime levels build a session each).
    """

    def wants(self, stage: str) -> bool: ...

    def accept(self, artifact: StageArtifact) -> None: ...


class Stages:
    """The sinks of one captured graph; the engine calls :meth:`emit` for each stage it makes.

    A sink that raises does not stop training: its error is logged once and the sink
    is dropped (a full disk must not fail a training step).
    """

    def __init__(self, sinks: Sequence[StageSink] = ()) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def wants(self, stage: str) -> bool:
        return any(s.wants(stage) for s in self.sinks)

    def emit(self, artifact: StageArtifact) -> None:
        for sink in list(self.sinks):
            if not sink.wants(artifact.stage):
                continue
            try:
                sink.accept(artifact)
            except Exception as e:  # a sink's failure (disk full, read-only folder) never breaks training
                logger.warning("ortlab: %s could not take stage %s of %s (%s); it gets no more stages",
                               type(sink).__name__, artifact.stage, artifact.label, e)
                self.sinks.remove(sink)


# ----------------------------------------------------------------------------------- op counts
def _onnx_nodes(graph: Any) -> Iterable[Any]:
    """Nodes of an ``onnx.GraphProto`` with those of its subgraphs."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _onnx_nodes(attr.g)
            for sub in attr.graphs:
                yield from _onnx_nodes(sub)


def _onnx_key(op_type: str, domain: str) -> str:
    return op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"


def count_ops(graph: Any) -> dict[str, int]:
    """Ops of a graph and how often each occurs, most frequent first: the one op counter.

    Takes a ``torch.fx.GraphModule`` (``aten.mm``; Dynamo's torch-level graphs also
    count ``call_method:view`` and ``call_module:fc``), an ``onnx_ir.Model``, an
    ``onnx.ModelProto``, serialized ONNX bytes or the path of an ``.onnx`` file (ONNX
    ops outside the default domain are ``domain.op``; subgraphs count too).

    Example:
        >>> count_ops(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))   # doctest: +SKIP
        {'call_module:...': 1}
    """
    counts: collections.Counter[str] = collections.Counter()
    if hasattr(graph, "graph") and hasattr(graph.graph, "nodes"):  # torch.fx.GraphModule
        from ortlab.provenance import op_name

        for node in graph.graph.nodes:
            if node.op == "call_function":
                counts[op_name(node)] += 1
            elif node.op in ("call_method", "call_module"):
                counts[f"{node.op}:{node.target}"] += 1
    elif hasattr(graph, "graph") and hasattr(graph.graph, "all_nodes"):  # onnx_ir.Model
        counts.update(_onnx_key(n.op_type, n.domain) for n in graph.graph.all_nodes())
    else:
        import onnx

        if isinstance(graph, (bytes, bytearray)):
            graph = onnx.load_from_string(bytes(graph))
        elif isinstance(graph, str):
            graph = onnx.load(graph, load_external_data=False)
        counts.update(_onnx_key(n.op_type, n.domain) for n in _onnx_nodes(graph.graph))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
