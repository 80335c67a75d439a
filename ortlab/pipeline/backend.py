"""The torch.compile backend: Dynamo's graph -> capture -> partition -> each graph compiled.

The orchestrator of the engine. For each graph Dynamo hands it, it traces the joint
graph (``ortlab.capture``), splits it under the recompute policy
(``ortlab.partition``), and compiles the forward, backward and no-grad graphs
(``ortlab.pipeline.graph``), handing every stage to the capture's sinks
(``ortlab.stages``) and recording every decision in the module's ``Report``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ortlab._compat.torch import (COMPILE_ISOLATION, DYNAMO_CONTROL_FLOW, CompiledRegion, compiled_region,
                                  forget_compiles, global_state, maybe_mark_dynamic, torch_compile)
from ortlab.artifacts import FolderSink
from ortlab.capture.aot import graph_device, rewrite_calls, trace
from ortlab.capture.padding import (EmbeddingSparsity, check_embedding_sparsity, embedding_sparsity_off,
                                   find_embedding_sparsity, traced)
from ortlab.capture.sparsity import LabelSparsity, find_label_sparsity
from ortlab.config import DebugOptions, Options
from ortlab.errors import (CaptureError, DeviceError, FallbackError, ParityWarning, SessionError, first_line,
                           is_pytorch_error)
from ortlab.partition.recompute import partition_joint
from ortlab.pipeline.graph import compile_graph
from ortlab.pipeline.part import GraphContext
from ortlab.pipeline.unused_outputs import absent_aware, watching
from ortlab.provenance import input_names, name_inputs
from ortlab.report import CaptureRecord, Fallback, Report, warn_fallback
from ortlab.runtime.observe import GraphObserver
from ortlab.stages import StageArtifact, StageSink, Stages, count_ops, label

__all__ = ["OrtlabBackend"]

logger = logging.getLogger(__name__)

# Note [The same graph captured again]
# Dynamo captures a module's code again whenever a guard of every earlier capture fails,
# and the new graph is often the very graph it captured before. Hugging Face's
# ``*ForSequenceClassification`` models set ``config.problem_type`` on their first call, so
# the second call fails the guard ``config.problem_type is None`` and hands the backend the
# same 337 ops again: on BERT-base the second step compiled everything a second time (37 s,
# with a second set of sessions and OpenVINO models in memory). The backend now keeps what
# it compiled, keyed on the graph's code and each input's type, shape, stride, dtype,
# requires_grad, view-ness and storage sharing (what AOTAutograd's trace depends on), and
# checks the rest before it reuses it: the global state the trace ran under (grad mode,
# autocast, default dtype: Dynamo's own ``GlobalStateGuard``) and each tensor constant of
# the graph (the same tensor, or equal), and the observer (``set_observer``) it reports to.
# A graph with submodules (``call_module``, higher-order ops' subgraphs) is never reused:
# its code does not show what they compute.
# A graph that fell back to PyTorch whole is compiled again (its failure may not recur).


def _graph_identity(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> str | None:
    """What AOTAutograd's trace of ``gm`` depends on besides its constants, as a string; None
    when ``gm`` has parts its code does not show (see Note [The same graph captured again])."""
    if any(n.op == "call_module" for n in gm.graph.nodes):
        return None
    if any(not isinstance(operator.attrgetter(str(n.target))(gm), torch.Tensor)
           for n in gm.graph.find_nodes(op="get_attr")):
        return None
    code = [line for line in gm.code.splitlines() if line.strip() and not line.strip().startswith("#")]
    storages: dict[int, int] = {}
    inputs = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            try:
                shared = storages.setdefault(x.untyped_storage().data_ptr(), i) if x.numel() else i
            except Exception:  # a tensor without storage (a subclass): no aliasing to compare
                shared = i
            inputs.append(f"{type(x).__name__} {x.dtype} {tuple(x.shape)} {x.stride()} {x.device} "
                          f"{x.requires_grad} {x._base is not None} {x.layout} {shared}")
        else:
            inputs.append(f"{type(x).__name__} {x!r}")
    metas = [str(getattr(n.meta.get("example_value"), "shape", None)) for n in gm.graph.find_nodes(op="placeholder")]
    return "\n".join([*code, *inputs, *metas])


def _same_constants(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x is y:
            continue
        if (x.dtype, x.shape, x.device, x.requires_grad, x.layout) != (y.dtype, y.shape, y.device, y.requires_grad,
                                                                      y.layout) or not torch.equal(x, y):
            return False
    return True


@dataclasses.dataclass
class _Compiled:
    """A capture's compiled callable, with what must hold to hand it out again."""

    index: int
    state: Any  # GlobalStateGuard, or None where torch has none
    constants: dict[str, torch.Tensor]
    compiled: Callable
    observer: GraphObserver | None  # the observer its calls report to (a graph compiled before set_observer has none)


# Note [What Dynamo keeps of a compiled graph]
# Dynamo stores each compiled graph in the globals of the module that defines the traced
# code (``__compiled_fn_7`` in the user's model module) and never removes it. AOTAutograd's
# compiled function holds the captured graph, the forward and backward graphs and its
# decomposition table, so every discarded ORTModule left them behind (tracemalloc; the path
# to them ran from ``ortlab.models.__compiled_fn_N``). Dynamo is handed a small holder
# instead, and releasing the backend (Note [Releasing a module's sessions]) empties it:
# 100 TinyMLPs re-created after a warm-up grew the process by 50 MiB instead of 64 MiB.
class _Handed:
    """The compiled graph Dynamo calls, until the backend is released."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn: Callable | None = fn

    def __call__(self, *args: object) -> object:
        fn = self.fn
        if fn is None:
            raise SessionError("this graph was released: its ORTModule was reconfigured (or deleted)")
        return fn(*args)


class OrtlabBackend:
    """A torch.compile backend that runs captured graphs in onnxruntime.

    One instance per ORTModule; it appends a ``CaptureRecord`` to ``report`` for
    every graph Dynamo hands it. Graphs captured while ``observer`` is set report
    their calls to it (see Note [Observing compiled graphs]). Every stage goes to
    ``sinks`` and, with ``debug.save_onnx``, to a folder.
    """

    def __init__(self, options: Options, debug: DebugOptions, report: Report, observer: GraphObserver | None = None,
                 sinks: Sequence[StageSink] = (), purpose: str = "",
                 origin: Callable[[torch.fx.Node], dict[str, object]] | None = None) -> None:
        self.options = options
        # For a graph ortlab makes (a label-sparsity tail): the provenance meta each node takes
        # (Note [A tail carries its head's provenance] in ``ortlab.capture.sparsity``).
        self.origin = origin
        self.kernel_us: dict[str, float] = {}  # FX node -> kernel microseconds per run (ORTModule.note_kernel_times)
        self.purpose = purpose
        self.debug = debug
        self.report = report
        self.observer = observer
        self.sinks = list(sinks)
        self._compiled: dict[str, list[_Compiled]] = {}  # Note [The same graph captured again]
        self._handed: list[_Handed] = []  # what Dynamo was given (Note [What Dynamo keeps of a compiled graph])
        self._regions: list[CompiledRegion] = []  # Note [Forgetting a released module's compiles]

    def compile(self, module: torch.nn.Module, dynamic: bool | None) -> Callable:
        """``module`` compiled with this backend, in a region of Dynamo's caches of its own
        (Note [Isolated compiles]), which ``release`` makes Dynamo forget."""
        compiled = torch_compile(module, backend=self, dynamic=dynamic, fullgraph=self.options.fallback == "raise",
                                 **COMPILE_ISOLATION)
        region = compiled_region(compiled)
        if region is not None:
            self._regions.append(region)
        return compiled

    def release(self) -> None:
        """Free the sessions, models and graphs of every capture, and what Dynamo keeps of them
        (see Note [Releasing a module's sessions])."""
        regions, self._regions = self._regions, []
        forget_compiles(regions, "its ORTModule was garbage collected or reconfigured (ortlab released it)")
        for handed in self._handed:
            handed.fn = None
        self._handed = []
        for capture in self.report.captures:
            for graph in capture.graphs:
                for part in graph.parts:
                    part.runner.release()
                graph.parts, graph.graph_module = [], None
        self.observer = None
        self.sinks = []
        self._compiled = {}

    def _nested(self, module: torch.nn.Module, purpose: str, dynamic: bool | None,
                origin: Callable[[torch.fx.Node], dict[str, object]] | None = None, **changes: object) -> Callable:
        """``module`` compiled by a backend like this one (its report, observer and sinks), for a graph
        ortlab makes itself (a label-sparsity tail, a graph on packed rows); ``origin``: see ``__init__``."""
        options = dataclasses.replace(self.options, dynamic=dynamic, **changes)
        backend = OrtlabBackend(options, self.debug, self.report, self.observer, self.sinks, purpose=purpose,
                                origin=origin)
        backend._handed, backend._regions = self._handed, self._regions  # released with this backend
        return backend.compile(module, dynamic)

    def _with_packed_rows(self, gm: torch.fx.GraphModule, found: EmbeddingSparsity) -> Callable:
        """``found.graph`` (``gm`` on the tokens that are not padding), checked on every padded batch.

        Both graphs are compiled by a backend like this one, lazily: the rewritten one with a
        symbolic row count, the original only when the check fails (see Note [Embedding
        sparsity] in ``ortlab.capture.padding``).
        """
        of = label(len(self.report.captures))
        record = found.record
        state: dict[str, Callable | None] = {"packed": None, "dense": None}

        def run(*args: object) -> object:
            keep = found.keep(args)
            rows = args[found.ids_position].numel()  # type: ignore[union-attr]
            if record.applied and keep.numel() < rows:
                # Each padded batch: whether padded rows reach the outputs depends on its ids, mask and labels.
                problem = check_embedding_sparsity(gm, found, args, keep)
                if problem is not None:
                    which = ("the first padded batch" if record.steps == 0
                             else f"the padded batch after {record.steps} step(s)")
                    record.applied, record.reason = False, f"{which} failed the check: {problem}"
                    warnings.warn(f"ortlab: embedding sparsity is off for graph {of}: {problem}", stacklevel=2)
                    state["packed"] = None
            if record.applied:
                if state["packed"] is None:
                    state["packed"] = self._nested(traced(found.graph), f"embedding sparsity: {of} on the kept rows",
                                                   self.options.dynamic, embedding_sparsity=False)
                maybe_mark_dynamic(keep, 0)
                record.count(rows, keep.numel())
                return state["packed"](*args, keep)
            if state["dense"] is None:
                state["dense"] = self._nested(traced(gm), f"embedding sparsity dropped: {of} on every row",
                                              self.options.dynamic, embedding_sparsity=False)
            return state["dense"](*args)

        return run

    def _with_tail(self, compiled: Callable, cut: LabelSparsity) -> Callable:
        """``compiled`` (the graph cut before its LM head), then the head and loss on the kept rows.

        The tail is compiled by a backend like this one, sharing its report, observer and sinks,
        with a symbolic row count (see Note [Label sparsity] in ``ortlab.capture.sparsity``).
        Dynamo calls what a backend returns with the graph's inputs as arguments; the head's
        parameters are among them.
        """
        of = label(len(self.report.captures))

        def compile_(module: torch.nn.Module, purpose: str, dynamic: bool | None) -> Callable:
            return self._nested(module, f"label sparsity: {purpose}", dynamic, cut.origin_of, label_sparsity=False)

        if cut.logits_positions:
            # The graph returned the logits: the head runs on every row for them (shaped as the
            # graph's own inputs are), and the loss on the kept rows' logits.
            head = compile_(cut.head(), f"the LM head of {of}, for the logits it returns", self.options.dynamic)
            rows_loss = compile_(cut.rows_loss(), f"the loss of {of} on the kept rows", True)
            tail = None
        else:
            head = rows_loss = None
            tail = compile_(cut.tail(), f"the LM head and loss of {of} on the kept rows", True)

        def run(*args: object) -> tuple:
            weight, bias = cut.params(args)
            return cut.finish(compiled(*args), weight, bias, tail, head, rows_loss)

        return run

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        start = time.perf_counter()
        if self.origin is not None:  # its subgraphs too: an autograd.Function's forward and backward
            for sub in gm.modules():
                for node in sub.graph.nodes if isinstance(sub, torch.fx.GraphModule) else ():
                    if node.op not in ("placeholder", "output", "get_attr"):
                        node.meta.update(self.origin(node))
        index = len(self.report.captures)
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        )
        mode = "train" if needs_grad else "eval"
        capture = CaptureRecord(index=index, mode=mode, fx_ops=count_ops(gm), purpose=self.purpose)
        identity, state = _graph_identity(gm, example_inputs), global_state()
        constants = {str(n.target): operator.attrgetter(str(n.target))(gm) for n in gm.graph.find_nodes(op="get_attr")}
        for earlier in self._compiled.get(identity, ()) if identity is not None else ():
            if (earlier.observer is self.observer and earlier.state is not None and earlier.state.check()
                    and _same_constants(earlier.constants, constants)):
                capture.same_as = earlier.index
                capture.capture_s = time.perf_counter() - start
                self.report.captures.append(capture)
                return earlier.compiled
        folder = FolderSink.from_debug(self.debug)
        if folder is not None:
            capture.files = folder.written
        stages = Stages([folder, *self.sinks])
        device = graph_device(example_inputs)
        hints: list[str] = []
        rewrite_calls(gm, device, hints)
        for hint in hints:  # Note [Attention dropout on CUDA stays in PyTorch's kernel]
            if hint not in self.report.hints:
                self.report.hints.append(hint)
                warnings.warn(f"ortlab: {hint}", ParityWarning, stacklevel=2)
        if stages.wants("captured"):
            stages.emit(StageArtifact("captured", index, mode, content=gm))
        if device.type == "meta":
            # Meta tensors have shapes and no data: there is nothing for onnxruntime to compute
            # (it read a null pointer and returned CPU tensors of garbage). PyTorch propagates shapes.
            fb = Fallback(scope="graph", where=label(index),
                          reason="its tensors are meta tensors (no data): PyTorch propagates their shapes")
            if self.options.fallback == "raise":
                raise FallbackError(f"graph {label(index)} would run in PyTorch: {fb.reason}")
            capture.fallbacks.append(fb)
            warn_fallback(fb)
            self.report.captures.append(capture)
            return gm.forward
        # A graph ortlab made itself (purpose) was rewritten already, or is a tail: no hint for it.
        padding = (find_embedding_sparsity(gm) if self.options.embedding_sparsity
                   else None if self.purpose else embedding_sparsity_off(gm))
        if padding is not None:
            capture.padding = padding.record if isinstance(padding, EmbeddingSparsity) else padding
        if isinstance(padding, EmbeddingSparsity):
            # This graph runs as a graph of its own on the kept rows (or, if the check fails, as it is).
            compiled = _Handed(self._with_packed_rows(gm, padding))
            self._handed.append(compiled)
            if identity is not None:
                self._compiled.setdefault(identity, []).append(_Compiled(index, state, constants, compiled,
                                                                         self.observer))
            capture.capture_s = time.perf_counter() - start
            self.report.captures.append(capture)
            return compiled
        cut = find_label_sparsity(gm) if self.options.label_sparsity else None
        if cut is not None:
            capture.sparsity = cut.record if isinstance(cut, LabelSparsity) else cut
        traced = cut.graph if isinstance(cut, LabelSparsity) else gm
        ctx = GraphContext(self.options, self.debug, device, index, stages, self.observer)
        split_s: list[float] = []

        names = input_names(traced)  # the views name graph inputs after them (blocks.0.ln1.weight)

        def compile_variant(fx: torch.fx.GraphModule, note: str) -> Callable:
            fn, record = compile_graph(fx, "backward", "train", ctx)
            record.notes.append(note)
            capture.graphs.append(record)
            return fn

        def compiler(name: str, graph_mode: str) -> Callable:
            def compile_(fx: torch.fx.GraphModule, _inputs: Sequence[object]) -> Callable:
                name_inputs(fx, names)
                seconds = split_s.pop() if name == "forward" and split_s else 0.0
                fn, record = compile_graph(fx, name, graph_mode, ctx, split_s=seconds)
                capture.graphs.append(record)
                if name == "backward":  # Note [Gradients of outputs a loss does not use]
                    fn = absent_aware(fx, fn, compile_variant)
                return fn

            return compile_

        def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: object):
            if stages.wants("joint"):
                stages.emit(StageArtifact("joint", index, "train", content=joint, seconds=time.perf_counter() - start))
            split_start = time.perf_counter()
            num_fwd_outputs = kwargs.pop("num_fwd_outputs")
            fw, bw, plan = partition_joint(joint, joint_inputs, num_fwd_outputs, self.options.recompute,
                                           measured=self.kernel_us or None, **kwargs)
            capture.plan = plan
            split_s.append(time.perf_counter() - split_start)
            return fw, bw

        try:
            compiled = trace(
                traced,
                example_inputs,
                forward=compiler("forward", "train"),
                backward=compiler("backward", "train"),
                inference=compiler("inference", "eval"),
                partition=partition,
                cache_dir=self.options.cache_dir,
            )
            if isinstance(cut, LabelSparsity):
                compiled = self._with_tail(compiled, cut)
        except (FallbackError, DeviceError, *DYNAMO_CONTROL_FLOW):
            raise  # ours to report, or Dynamo's own control flow (it re-traces)
        except Exception as e:  # AOTAutograd/functionalization can fail on exotic code
            eager_raises = is_pytorch_error(e)  # Note [PyTorch's errors found at capture]
            reason = (f"PyTorch raises for these inputs, and the graph runs there: {first_line(e)}" if eager_raises
                      else f"AOTAutograd could not capture graph {label(index)}: {first_line(e)}")
            if self.options.fallback == "raise" and not eager_raises:
                raise CaptureError(reason + "\nUse fallback='warn' to run this graph in PyTorch.") from e
            fb = Fallback(scope="graph", where=label(index), reason=reason)
            capture.fallbacks.append(fb)
            if not eager_raises:
                warn_fallback(fb)
            logger.debug("capture of %s failed", label(index), exc_info=e)
            if isinstance(cut, LabelSparsity):
                capture.sparsity = dataclasses.replace(cut.record, applied=False, reason="the graph runs in PyTorch")
            compiled = gm.forward
        capture.capture_s = time.perf_counter() - start - sum(g.export_s + g.session_s for g in capture.graphs)
        self.report.captures.append(capture)
        if compiled is not gm.forward:
            compiled = _Handed(watching(compiled) if mode == "train" else compiled)
            self._handed.append(compiled)
            if identity is not None:
                self._compiled.setdefault(identity, []).append(_Compiled(index, state, constants, compiled,
                                                                         self.observer))
        return compiled

