"""``ortlab.explore(model, *inputs)``: step through the pipeline one stage at a time.

Note [How the lab drives the engine]
The lab reuses the engine rather than copying it. Its Dynamo backend records each
graph Dynamo captures and runs it eagerly (step ``captured``); the first later step
hands each recorded graph to the engine's own ``OrtlabBackend`` with the lab as a
stage sink (``ortlab.stages``): the engine builds the joint graph, splits it, exports,
optimizes and creates the sessions exactly as ``ORTModule`` does, and hands the lab
every stage it makes, typed (the FX graph or ONNX model, its graph and part, and the
seconds its own clock gave it). The lab writes each to its folder (for netron and
for reopening) and fills its steps from what it was handed; it never reads a file
name back. The ``step`` step calls the same ``torch.compile`` wrapper again: Dynamo's
cache sends each graph to its recorded callable, which now runs the engine's
compiled forward and backward.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ortlab._compat.torch import dynamo_counters, eager_backward_lowering, forget_sizes_seen, torch_compile
from ortlab.artifacts import FolderSink
from ortlab.config import DebugOptions, Options
from ortlab.errors import OrtlabError, UnsupportedInputError, first_line
from ortlab.inspect._keywords import split_keywords
from ortlab.inspect.lab import Lab
from ortlab.inspect.lab_stage import ActivationRow, FallbackRow, GraphBreak, Stage
from ortlab.inspect.loss import default_loss
from ortlab.ortmodule import ORTModule, configure_torch
from ortlab.pipeline.backend import OrtlabBackend
from ortlab.provenance import onnx_node_index
from ortlab.report import Fallback, Report
from ortlab.stages import LAB_STAGES, StageArtifact, count_ops, label

__all__ = ["explore", "default_loss"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any], "torch.Tensor | None"]
_ENGINE_STAGES = {spec.name: spec.stages for spec in LAB_STAGES}


def _location(user_stack: Sequence[Any] | None) -> str:
    if not user_stack:
        return ""
    frame = user_stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


@dataclasses.dataclass
class _Made:
    """One stage of one graph the engine handed the lab: its label, file, op counts and seconds."""

    label: str
    file: str
    op_counts: dict[str, int]
    seconds: float


class _LabSink:
    """The lab's stage sink: writes each stage into the lab folder and keeps what the steps show."""

    def __init__(self, folder: str, prefix: str) -> None:
        self.folder = folder
        self.writer = FolderSink(folder, prefix)
        self.made: dict[str, list[_Made]] = {}

    def wants(self, stage: str) -> bool:
        return stage != "captured"  # the lab records the captured graphs itself, before the engine runs

    def accept(self, artifact: StageArtifact) -> None:
        self.writer.accept(artifact)
        rel = os.path.relpath(self.writer.written[-1], self.folder)
        self.made.setdefault(artifact.stage, []).append(
            _Made(artifact.label, rel, artifact.op_counts(), artifact.seconds))

    def of(self, stages: Sequence[str]) -> list[_Made]:
        return [m for stage in stages for m in self.made.get(stage, [])]


class _Graph:
    """One graph Dynamo handed the lab: runs eagerly until the engine has compiled it."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, example_inputs: list, grad: bool, mode: str) -> None:
        self.index, self.gm, self.example_inputs, self.grad, self.mode = index, gm, example_inputs, grad, mode
        self.reason = getattr(gm, "compile_subgraph_reason", None)
        self.op_counts = count_ops(gm)
        self.compiled: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        return (self.compiled or self.gm.forward)(*args)


class _Pipeline:
    """Fills the lab's steps by driving the engine (see Note [How the lab drives the engine])."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, options: Options,
                 debug: DebugOptions, loss_fn: LossFn, sink: _LabSink) -> None:
        self.model, self.args, self.kwargs = model, args, kwargs
        self.options, self.debug, self.loss_fn = options, debug, loss_fn
        self.sink = sink
        self.report = Report()
        self.engine = OrtlabBackend(options, debug, self.report, sinks=[sink])
        self.graphs: list[_Graph] = []
        self.compiled_model: Callable | None = None
        self.compiled = False
        self.compile_error = ""
        self.compile_s = 0.0

    # ------------------------------------------------------------------------ backend
    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        grad = torch.is_grad_enabled()
        needs_grad = grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        graph = _Graph(len(self.graphs), gm, list(example_inputs), grad, "train" if needs_grad else "eval")
        self.graphs.append(graph)
        self.sink.writer.accept(StageArtifact("captured", graph.index, graph.mode, content=gm))
        self.sink.made.setdefault("captured", []).append(
            _Made(label(graph.index), os.path.relpath(self.sink.writer.written[-1], self.sink.folder),
                  graph.op_counts, 0.0))
        if self.compiled:  # a graph captured after the compile (a guard failed): compile it now
            self._compile_graph(graph)
        return graph

    def _compile_graph(self, graph: _Graph) -> None:
        # AOTAutograd compiles the backward at the first backward call; the lab asks for
        # it now, so the backward's stages exist before the step stage runs.
        with torch.set_grad_enabled(graph.grad), eager_backward_lowering():
            graph.compiled = self.engine(graph.gm, graph.example_inputs)
        graph.example_inputs = []

    def _compile(self) -> None:
        if self.compile_error:
            raise OrtlabError(f"the engine failed in an earlier stage ({self.compile_error}); later stages cannot run.")
        if self.compiled:
            return
        start = time.perf_counter()
        try:
            for graph in self.graphs:
                self._compile_graph(graph)
        except Exception as e:
            self.compile_error = first_line(e)
            raise
        self.compile_s = time.perf_counter() - start
        self.compiled = True

    def _fill(self, stage: Stage) -> list[_Made]:
        """Artifacts, op counts and engine-clock timings of a step from the stages the engine made."""
        made = self.sink.of(_ENGINE_STAGES[stage.name])
        for m in made:
            stage.artifacts[m.label] = m.file
            stage.graph_op_counts[m.label] = m.op_counts
            stage.timings[f"{m.label} (engine clock)"] = m.seconds
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        stage.seconds = sum(m.seconds for m in made)
        return made

    # ---------------------------------------------------------------------- the steps
    def run_stage(self, stage: Stage) -> None:
        if stage.name == "captured":
            self._captured(stage)
        elif stage.name == "step":
            self._step(stage)
        else:
            self._compile()
            if stage.name == "joint":
                stage.timings["engine: all stages of all graphs (wall)"] = self.compile_s
            made = self._fill(stage)
            if stage.name == "joint":
                stage.fallbacks = [self._row(fb) for c in self.report.captures for fb in c.fallbacks]
            elif stage.name == "split":
                self._activations(stage)
            elif stage.name == "exported":
                self._exported(stage)
            elif stage.name.startswith("ort_"):
                level = self.options.graph_optimization_level
                stage.timings["engine: sessions at the chosen level"] = sum(
                    g.session_s for c in self.report.captures for g in c.graphs)
                if stage.name == f"ort_{level}":
                    stage.notes.append(f"The sessions run this level (graph_optimization_level={level!r}).")
            if not made:
                stage.status = "skipped"
                stage.notes.append(self._skipped_reason(stage.name))

    def _captured(self, stage: Stage) -> None:
        configure_torch()
        if self.options.dynamic is None:  # the sizes an ORTModule's first capture would see
            forget_sizes_seen(self.model)
        self.compiled_model = torch_compile(
            self.model, backend=self.backend, dynamic=self.options.dynamic, fullgraph=self.options.fallback == "raise"
        )
        before = dict(dynamo_counters["graph_break"])
        start = time.perf_counter()
        with torch.enable_grad():
            self.compiled_model(*self.args, **self.kwargs)
        stage.seconds = time.perf_counter() - start
        stage.timings["Dynamo capture and one eager run"] = stage.seconds
        new = {r: c - before.get(r, 0) for r, c in dynamo_counters["graph_break"].items() if c - before.get(r, 0) > 0}
        located: dict[str, str] = {}
        for g in self.graphs:
            if g.reason is not None and getattr(g.reason, "graph_break", False):
                located.setdefault(str(g.reason.reason), _location(getattr(g.reason, "user_stack", None)))
        for reason, count in new.items():
            stage.graph_breaks.append(GraphBreak(_first(reason), count, located.get(reason, ""), reason))
        for reason, where in located.items():
            if reason not in new:
                stage.graph_breaks.append(GraphBreak(_first(reason), 1, where, reason))
        for m in self.sink.of(("captured",)):
            stage.artifacts[m.label] = m.file
        for g in self.graphs:
            stage.graph_op_counts[label(g.index)] = g.op_counts
            inputs = sum(1 for n in g.gm.graph.nodes if n.op == "placeholder")
            stage.notes.append(f"{label(g.index)} ({g.mode}): {sum(g.op_counts.values())} ops, {inputs} inputs")
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        stage.summary = {"graphs": len(self.graphs), "graph_breaks": sum(b.count for b in stage.graph_breaks),
                         "modes": sorted({g.mode for g in self.graphs})}
        if not self.graphs:
            stage.notes.append("Dynamo captured no graph: the whole forward runs in PyTorch.")

    def _activations(self, stage: Stage) -> None:
        exported = self.sink.of(("exported",))
        saved = baseline = 0
        for capture in self.report.captures:
            plan = capture.plan
            if plan is None:
                continue
            index: dict[str, str] = {}
            for m in exported:
                if m.label.startswith(label(capture.index, "forward")):
                    for name, target in onnx_node_index(os.path.join(self.sink.folder, m.file)).items():
                        if index.get(name, name) == name:  # a producing node beats an input
                            index[name] = target
            saved, baseline = saved + plan.saved_bytes, baseline + plan.baseline_bytes
            stage.activations += [
                ActivationRow(**{**dataclasses.asdict(a), "shape": list(a.shape)}, graph=label(capture.index),
                              onnx_node=index.get(a.name, ""))
                for a in plan.activations
            ]
            stage.notes.append(
                f"{label(capture.index)}: recompute={plan.policy!r}: "
                f"{len(plan.activations) - len(plan.recomputed)} saved, {len(plan.recomputed)} recomputed"
            )
        stage.summary = {"saved_bytes": saved, "baseline_bytes": baseline,
                         "saved": sum(not a.recomputed for a in stage.activations),
                         "recomputed": sum(a.recomputed for a in stage.activations)}

    def _exported(self, stage: Stage) -> None:
        records = [g for c in self.report.captures for g in c.graphs]
        stage.timings["engine: export + onnxscript"] = sum(g.export_s for g in records)
        stage.fallbacks = [self._row(fb, g.graph_module) for g in records for fb in g.fallbacks]
        stage.fallbacks += [self._row(fb) for c in self.report.captures for fb in c.fallbacks]
        stage.summary = {"onnxruntime_partitions": sum(g.ort_partitions for g in records),
                         "pytorch_ops": sum(g.torch_nodes for g in records)}
        stage.notes.extend(note for g in records for note in g.notes)

    def close(self) -> None:
        """Drop the compiled graphs and their sessions."""
        self.compiled_model, self.graphs = None, []

    def _step(self, stage: Stage) -> None:
        self._compile()
        if self.compiled_model is None:
            raise OrtlabError("the captured stage has not run (or the lab was closed).")
        graphs_before = len(self.graphs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            start = time.perf_counter()
            with torch.enable_grad():
                out = self.compiled_model(*self.args, **self.kwargs)
            forward_s = time.perf_counter() - start
            loss = self.loss_fn(out)
            backward_s = 0.0
            if loss is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
                start = time.perf_counter()
                loss.backward()
                backward_s = time.perf_counter() - start
            else:
                stage.notes.append("No backward: the output has no differentiable loss (nothing requires grad).")
            grads = [p.grad for p in params if p.grad is not None]
            norm = math.sqrt(sum(float(g.detach().double().pow(2).sum()) for g in grads)) if grads else 0.0
            stage.summary = {
                "loss": float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None,
                "forward_s": forward_s,
                "backward_s": backward_s,
                "params_with_grad": f"{len(grads)}/{len(params)}",
                "grad_norm": norm,
                "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
            }
        finally:
            for p, g in zip(params, kept):
                p.grad = g
        if len(self.graphs) > graphs_before:
            stage.notes.append(f"Dynamo captured {len(self.graphs) - graphs_before} graph(s) again (a guard failed "
                               "or its cache was reset since the captured stage); they were compiled in this step.")
        self._fill(stage)
        stage.timings = {"forward (first call)": forward_s, "backward (first call)": backward_s}
        stage.seconds = forward_s + backward_s
        records = [g for c in self.report.captures for g in c.graphs]
        stage.summary["onnxruntime_partitions"] = sum(g.ort_partitions for g in records)
        stage.summary["pytorch_ops"] = sum(g.torch_nodes for g in records)
        stage.summary["fallbacks"] = len(self.report.fallbacks)
        # Which execution providers run each graph, and the measurement behind the choice (the
        # race of ortlab.runtime.race checks on this first call and times on the next calls, so
        # a graph still measuring says so): the report's lines, here too.
        # (one summary entry per graph: a lab's summaries hold plain values, ortlab.inspect._lab_files)
        for g in records:
            if g.providers:
                stage.summary[f"{g.label} providers"] = g.providers_now
                stage.notes.append(f"{g.label} runs on {g.providers_now}.")
            stage.notes += [n for n in g.notes if " providers: " in n]
        if not stage.artifacts:
            stage.notes.append(self._skipped_reason("step"))

    # ------------------------------------------------------------------------- helpers
    def _row(self, fb: Fallback, gm: torch.fx.GraphModule | None = None) -> FallbackRow:
        values = [fb.node] if fb.node else []
        if gm is not None and fb.node:
            node = next((n for n in gm.graph.nodes if n.name == fb.node), None)
            if node is not None:
                values += [u.name for u in node.users]
        return FallbackRow(**dataclasses.asdict(fb), values=values)

    def _skipped_reason(self, step: str) -> str:
        if not self.graphs:
            return "Skipped: Dynamo captured no graph."
        if step == "joint" and all(g.mode == "eval" for g in self.graphs):
            return ("Skipped: every graph was captured in eval mode (grad disabled, or nothing requires grad): "
                    "there is no backward graph.")
        whole = [fb for fb in self.report.fallbacks if fb.scope == "graph"]
        if whole:
            return f"Skipped: {len(whole)} graph(s) run in PyTorch: {whole[0].reason}"
        if step == "onnxscript" and self.options.graph_optimization_level == "disable":
            return "Skipped: graph_optimization_level='disable' turns onnxscript's optimizer off."
        if self.options.cache_dir and any(g.cached for c in self.report.captures for g in c.graphs):
            return "Skipped: the models came from the on-disk cache (cache_dir), so this stage did not run."
        return f"Skipped: the engine produced no {step} stage."


def _first(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _sum_counts(parts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in parts:
        for op, n in counts.items():
            total[op] = total.get(op, 0) + n
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}[{', '.join(map(str, value.shape))}]"
    return type(value).__name__


def explore(
    model: torch.nn.Module,
    *example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    folder: str | None = None,
    options: dict[str, Any] | None = None,
    **keywords: Any,
) -> Lab:
    """Step through the pipeline on ``model``: each stage runs when asked, and shows itself.

    Nothing runs until a stage is asked for: ``lab.next()`` runs the next stage,
    ``lab.run("exported")`` every stage up to that one, ``lab.run()`` all of them.
    The ``step`` stage runs one forward and backward through onnxruntime and then
    puts the parameters' ``.grad`` back as they were (weights are never changed).

    Args:
        model: the module (or an ``ORTModule``, whose options are the defaults).
        *example_inputs: positional inputs of one call.
        example_kwargs: keyword inputs of that call.
        loss_fn: ``output -> scalar tensor`` for the step's backward; default
            :func:`~ortlab.inspect.loss.default_loss`.
        folder: where the stages are saved; default a temporary folder that is
            deleted with the lab (use ``lab.save(folder)`` to keep it).
        options: engine options, as for ``ORTModule`` (``recompute``, ``fallback_ops``...).
        **keywords: the call's keyword inputs (``input_ids=ids``) and engine options by name (Note [Keyword
            inputs beside options] in ``ortlab.inspect._keywords``).

    Example:
        >>> lab = ortlab.explore(model, x, y)         # doctest: +SKIP
        >>> lab = ortlab.explore(hf_model, input_ids=ids, labels=ids)   # doctest: +SKIP
        >>> lab.next()                                 # doctest: +SKIP
        >>> lab.run("split").activations[0]            # doctest: +SKIP
        >>> lab["exported"].view(node="addmm")         # doctest: +SKIP
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedInputError(f"explore takes a torch.nn.Module, got {type(model).__name__}.")
    example_kwargs, options = split_keywords(model, keywords, tool="explore", options=options,
                                             forward_kwargs=example_kwargs)
    if isinstance(model, ORTModule):
        options = {**model.options.as_dict(), **options}
        model = model.module
    opts = Options.from_kwargs(options)
    owns = folder is None
    folder = os.path.abspath(folder or tempfile.mkdtemp(prefix="ortlab_lab_"))
    os.makedirs(folder, exist_ok=True)
    prefix = re.sub(r"\W+", "_", type(model).__name__).strip("_").lower() or "model"
    # The lab is its own stage sink; stages are not also written where ORTLAB_SAVE_* point.
    debug = DebugOptions(onnx_prefix=prefix)  # a prefix, should ORTLAB_SAVE_ONNX=1 be set
    debug.save_onnx = False
    kwargs = dict(example_kwargs or {})
    meta = {
        "model": type(model).__name__,
        "prefix": prefix,
        "options": opts.as_dict(),
        "inputs": [_describe(v) for v in example_inputs] + [f"{k}={_describe(v)}" for k, v in kwargs.items()],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "onnxruntime": _ort_version()},
    }
    pipeline = _Pipeline(model, tuple(example_inputs), kwargs, opts, debug, loss_fn or default_loss,
                         _LabSink(folder, prefix))
    lab = Lab(folder, driver=pipeline, meta=meta, owns_folder=owns)
    lab._write_manifest()
    return lab


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__
