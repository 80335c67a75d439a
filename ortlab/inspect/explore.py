"""``ortlab.explore(model, *inputs)``: step through the pipeline one stage at a time.

Note [How the lab drives the engine]
The lab reuses the engine rather than copying it. Its Dynamo backend records each
graph Dynamo captures and runs it eagerly (stage ``captured``); the first later
stage hands each recorded graph to the engine's own ``OrtlabBackend``, with stage
saving on into the lab folder (``StageWriter``), which builds the joint graph, splits
it, exports, optimizes and creates the sessions exactly as ``ORTModule`` does. The
stages from ``joint`` to ``ort_all`` are then read from the records (``Report``) and
the files the engine saved, one at a time. The ``step`` stage calls the same
``torch.compile`` wrapper again: Dynamo's cache sends each graph to its recorded
callable, which now runs the engine's compiled forward and backward.

The engine does not time its sub-stages separately (joint tracing, partitioning,
each onnxruntime level), so a stage's ``seconds`` is read from the files' modification
times: the time from the previous file the engine wrote to this one. These are wall
times with the file system's timestamp granularity (a few ms); the engine's own
totals (export, sessions) are listed in ``timings`` next to them.
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
import torch._functorch.config
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters

from ortlab.artifacts import StageWriter
from ortlab.capture.backend import OrtlabBackend, torch_op_counts
from ortlab.config import DebugOptions, Options
from ortlab.errors import OrtlabError, UnsupportedInputError, first_line
from ortlab.inspect.stages import (
    ActivationRow,
    FallbackRow,
    GraphBreak,
    Lab,
    Stage,
    fx_code_op_counts,
    onnx_node_index,
    onnx_op_counts,
    parse_stage_file,
)
from ortlab.ortmodule import ORTModule, configure_torch
from ortlab.report import Fallback, Report
from ortlab.runtime.session import providers_for, session_options

__all__ = ["explore", "default_loss"]

logger = logging.getLogger(__name__)

_HAS_EAGER_BW = hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")

LossFn = Callable[[Any], "torch.Tensor | None"]


def default_loss(output: Any) -> torch.Tensor | None:
    """The loss of a model's output: its first differentiable scalar, else the sum of all.

    Returns ``None`` when no floating output requires grad (nothing to backpropagate).

    Example:
        >>> default_loss(torch.ones(2, requires_grad=True) * 3)
        tensor(6., grad_fn=<SumBackward0>)
    """
    leaves = [
        t for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        return None
    scalar = next((t for t in leaves if t.dim() == 0), None)
    if scalar is not None:
        return scalar
    total = leaves[0].float().sum()
    for t in leaves[1:]:
        total = total + t.float().sum()
    return total


def _location(user_stack: Sequence[Any] | None) -> str:
    if not user_stack:
        return ""
    frame = user_stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


class _Graph:
    """One graph Dynamo handed the lab: runs eagerly until the engine has compiled it."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, example_inputs: list, grad: bool, mode: str) -> None:
        self.index, self.gm, self.example_inputs, self.grad, self.mode = index, gm, example_inputs, grad, mode
        self.reason = getattr(gm, "compile_subgraph_reason", None)
        self.op_counts = torch_op_counts(gm)
        self.compiled: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        return (self.compiled or self.gm.forward)(*args)


class _Pipeline:
    """Fills the lab's stages by driving the engine (see Note [How the lab drives the engine])."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, options: Options,
                 debug: DebugOptions, loss_fn: LossFn) -> None:
        self.model, self.args, self.kwargs = model, args, kwargs
        self.options, self.debug, self.loss_fn = options, debug, loss_fn
        self.prefix, self.folder = debug.onnx_prefix, debug.folder
        self.report = Report()
        self.engine = OrtlabBackend(options, debug, self.report)
        self.graphs: list[_Graph] = []
        self.compiled_model: Callable | None = None
        self.compiled = False
        self.compile_error = ""
        self.compile_s = 0.0
        self.durations: dict[str, float] = {}

    # ------------------------------------------------------------------------ backend
    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        grad = torch.is_grad_enabled()
        needs_grad = grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        graph = _Graph(len(self.graphs), gm, list(example_inputs), grad, "train" if needs_grad else "eval")
        self.graphs.append(graph)
        StageWriter(self.debug, graph.index).fx("captured", graph.mode, gm)
        if self.compiled:  # a graph captured after the compile (a guard failed): compile it now
            self._compile_graph(graph)
        return graph

    def _compile_graph(self, graph: _Graph) -> None:
        # AOTAutograd compiles the backward at the first backward call; the lab asks for
        # it now, so the backward's stages exist before the step stage runs.
        eager_bw = {"force_non_lazy_backward_lowering": True} if _HAS_EAGER_BW else {}
        with torch.set_grad_enabled(graph.grad), torch._functorch.config.patch(**eager_bw):
            graph.compiled = self.engine(graph.gm, graph.example_inputs)
        graph.example_inputs = []
        self.durations = self._file_durations()

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

    def _file_durations(self) -> dict[str, float]:
        """Seconds from the previous file each capture's engine run wrote to each file."""
        out: dict[str, float] = {}
        for capture in self.report.captures:
            files = sorted((f for f in set(capture.files) if os.path.exists(f)), key=lambda f: os.stat(f).st_mtime_ns)
            previous = None
            for path in files:
                mtime = os.stat(path).st_mtime_ns
                out[os.path.abspath(path)] = max(0.0, (mtime - previous) / 1e9) if previous is not None else 0.0
                previous = mtime
        return out

    def _files(self, stage: str) -> dict[str, str]:
        """label -> path relative to the lab folder, for one kind of stage file, in graph order."""
        found = []
        for name in os.listdir(self.folder):
            info = parse_stage_file(name, self.prefix)
            if info is not None and info["stage"] == stage:
                part = info["part"]
                order = int(part.rsplit("_", 1)[1]) if part and part.rsplit("_", 1)[-1].isdigit() else -1
                graph_order = {"forward": 0, "backward": 1, "inference": 2}.get(info["graph"], 3)
                found.append(((info["index"], graph_order, order), info["label"], name))
        return {label: name for _, label, name in sorted(found)}

    def _seconds(self, stage: Stage) -> None:
        per = {label: self.durations.get(os.path.join(self.folder, rel), 0.0) for label, rel in stage.artifacts.items()}
        stage.timings.update({f"{label} (from file times)": s for label, s in per.items()})
        stage.seconds = sum(per.values())

    # ---------------------------------------------------------------------- the stages
    def run_stage(self, stage: Stage) -> None:
        getattr(self, f"_stage_{stage.name}")(stage)

    def _stage_captured(self, stage: Stage) -> None:
        configure_torch()
        self.compiled_model = torch.compile(
            self.model, backend=self.backend, dynamic=self.options.dynamic, fullgraph=self.options.fallback == "raise"
        )
        before = dict(counters["graph_break"])
        start = time.perf_counter()
        with torch.enable_grad():
            self.compiled_model(*self.args, **self.kwargs)
        stage.seconds = time.perf_counter() - start
        stage.timings["Dynamo capture and one eager run"] = stage.seconds
        new = {r: c - before.get(r, 0) for r, c in counters["graph_break"].items() if c - before.get(r, 0) > 0}
        located: dict[str, str] = {}
        for g in self.graphs:
            if g.reason is not None and getattr(g.reason, "graph_break", False):
                located.setdefault(str(g.reason.reason), _location(getattr(g.reason, "user_stack", None)))
        for reason, count in new.items():
            stage.graph_breaks.append(GraphBreak(_first(reason), count, located.get(reason, ""), reason))
        for reason, where in located.items():
            if reason not in new:
                stage.graph_breaks.append(GraphBreak(_first(reason), 1, where, reason))
        files = self._files("captured")
        for g in self.graphs:
            label = f"g{g.index}"
            stage.graph_op_counts[label] = g.op_counts
            if label in files:
                stage.artifacts[label] = files[label]
            inputs = sum(1 for n in g.gm.graph.nodes if n.op == "placeholder")
            stage.notes.append(f"{label} ({g.mode}): {sum(g.op_counts.values())} ops, {inputs} inputs")
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        stage.summary = {"graphs": len(self.graphs), "graph_breaks": sum(b.count for b in stage.graph_breaks),
                         "modes": sorted({g.mode for g in self.graphs})}
        if not self.graphs:
            stage.notes.append("Dynamo captured no graph: the whole forward runs in PyTorch.")

    def _stage_joint(self, stage: Stage) -> None:
        self._compile()
        stage.timings["engine: all stages of all graphs (wall)"] = self.compile_s
        stage.artifacts = self._files("joint")
        for label, rel in stage.artifacts.items():
            with open(os.path.join(self.folder, rel)) as f:
                stage.graph_op_counts[label] = fx_code_op_counts(f.read())
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        self._seconds(stage)
        stage.fallbacks = [self._row(fb) for c in self.report.captures for fb in c.fallbacks]
        if not stage.artifacts:
            stage.status = "skipped"
            stage.notes.append(_no_files_reason(self.graphs, self.report, "joint"))

    def _stage_split(self, stage: Stage) -> None:
        self._compile()
        for kind in ("forward", "backward", "inference"):
            stage.artifacts.update(self._files(kind))
        stage.artifacts = dict(sorted(stage.artifacts.items()))
        for label, rel in stage.artifacts.items():
            with open(os.path.join(self.folder, rel)) as f:
                stage.graph_op_counts[label] = fx_code_op_counts(f.read())
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        self._seconds(stage)
        exported = self._files("exported")
        saved = baseline = 0
        for capture in self.report.captures:
            plan = capture.plan
            if plan is None:
                continue
            index: dict[str, str] = {}
            for label, rel in exported.items():
                if label.startswith(f"g{capture.index}.forward"):
                    for name, target in onnx_node_index(os.path.join(self.folder, rel)).items():
                        if index.get(name, name) == name:  # a producing node beats an input
                            index[name] = target
            saved, baseline = saved + plan.saved_bytes, baseline + plan.baseline_bytes
            stage.activations += [
                ActivationRow(**{**dataclasses.asdict(a), "shape": list(a.shape)}, graph=f"g{capture.index}",
                              onnx_node=index.get(a.name, ""))
                for a in plan.activations
            ]
            stage.notes.append(
                f"g{capture.index}: recompute={plan.policy!r}: {len(plan.activations) - len(plan.recomputed)} saved, "
                f"{len(plan.recomputed)} recomputed"
            )
        stage.summary = {"saved_bytes": saved, "baseline_bytes": baseline,
                         "saved": sum(not a.recomputed for a in stage.activations),
                         "recomputed": sum(a.recomputed for a in stage.activations)}
        if not stage.artifacts:
            stage.status = "skipped"
            stage.notes.append(_no_files_reason(self.graphs, self.report, "split"))

    def _onnx_stage(self, stage: Stage, kind: str) -> None:
        self._compile()
        stage.artifacts = self._files(kind)
        for label, rel in stage.artifacts.items():
            stage.graph_op_counts[label] = onnx_op_counts(os.path.join(self.folder, rel))
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        self._seconds(stage)
        records = [g for c in self.report.captures for g in c.graphs]
        if kind == "exported":
            stage.timings["engine: export + onnxscript"] = sum(g.export_s for g in records)
            stage.fallbacks = [self._row(fb, g.graph_module) for g in records for fb in g.fallbacks]
            stage.fallbacks += [self._row(fb) for c in self.report.captures for fb in c.fallbacks]
            stage.summary = {"onnxruntime_partitions": sum(g.ort_partitions for g in records),
                             "pytorch_ops": sum(g.torch_nodes for g in records)}
        elif kind.startswith("ort_"):
            self._time_level(stage, kind[len("ort_"):])
            level = self.options.graph_optimization_level
            stage.timings["engine: sessions at the chosen level"] = sum(g.session_s for g in records)
            if kind == f"ort_{level}":
                stage.notes.append(f"The sessions run this level (graph_optimization_level={level!r}).")
        if not stage.artifacts:
            stage.status = "skipped"
            stage.notes.append(_no_files_reason(self.graphs, self.report, kind, self.options))

    def _time_level(self, stage: Stage, level: str) -> None:
        """Time a session built at ``level`` from the model onnxruntime was given.

        File times are too coarse for onnxruntime's optimizations (a few ms), so the
        lab builds each level's session once more from the saved input model.
        """
        import onnxruntime as ort

        inputs = {**self._files("exported"), **self._files("onnxscript")}
        options = dataclasses.replace(self.options, profile=False)
        providers = providers_for(self._device().type, options)
        per: dict[str, float] = {}
        for label in stage.artifacts:
            if label not in inputs:
                continue
            so = session_options(options, self.debug, level=level)
            start = time.perf_counter()
            try:
                ort.InferenceSession(os.path.join(self.folder, inputs[label]), sess_options=so, providers=providers)
            except Exception as e:  # the engine saved this level, so this is unexpected: report, go on
                stage.notes.append(f"{label}: could not time level {level}: {first_line(e)}")
                continue
            per[label] = time.perf_counter() - start
        stage.timings.update({f"{label} (session at {level}, timed by the lab)": s for label, s in per.items()})
        stage.seconds = sum(per.values())

    def _device(self) -> torch.device:
        for value in [*pytree.tree_leaves((self.args, self.kwargs)), *self.model.parameters()]:
            if isinstance(value, torch.Tensor):
                return value.device
        return torch.device("cpu")

    def _stage_exported(self, stage: Stage) -> None:
        self._onnx_stage(stage, "exported")

    def _stage_onnxscript(self, stage: Stage) -> None:
        self._onnx_stage(stage, "onnxscript")

    def _stage_ort_basic(self, stage: Stage) -> None:
        self._onnx_stage(stage, "ort_basic")

    def _stage_ort_extended(self, stage: Stage) -> None:
        self._onnx_stage(stage, "ort_extended")

    def _stage_ort_all(self, stage: Stage) -> None:
        self._onnx_stage(stage, "ort_all")

    def close(self) -> None:
        """Drop the compiled graphs and their sessions."""
        self.compiled_model, self.graphs = None, []

    def _stage_step(self, stage: Stage) -> None:
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
        stage.timings = {"forward (first call)": forward_s, "backward (first call)": backward_s}
        stage.seconds = forward_s + backward_s
        records = [g for c in self.report.captures for g in c.graphs]
        stage.summary["onnxruntime_partitions"] = sum(g.ort_partitions for g in records)
        stage.summary["pytorch_ops"] = sum(g.torch_nodes for g in records)
        stage.summary["fallbacks"] = len(self.report.fallbacks)
        stage.artifacts = self._files("execution")
        for label, rel in stage.artifacts.items():
            stage.graph_op_counts[label] = onnx_op_counts(os.path.join(self.folder, rel))
        stage.op_counts = _sum_counts(stage.graph_op_counts.values())
        if not stage.artifacts:
            stage.notes.append(_no_files_reason(self.graphs, self.report, "execution", self.options))

    # ------------------------------------------------------------------------- helpers
    def _row(self, fb: Fallback, gm: torch.fx.GraphModule | None = None) -> FallbackRow:
        values = [fb.node] if fb.node else []
        if gm is not None and fb.node:
            node = next((n for n in gm.graph.nodes if n.name == fb.node), None)
            if node is not None:
                values += [u.name for u in node.users]
        return FallbackRow(fb.scope, fb.where, fb.reason, fb.node, fb.op, fb.module, fb.source, values)


def _first(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _sum_counts(parts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in parts:
        for op, n in counts.items():
            total[op] = total.get(op, 0) + n
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def _no_files_reason(graphs: list[_Graph], report: Report, kind: str, options: Options | None = None) -> str:
    if not graphs:
        return "Skipped: Dynamo captured no graph."
    if kind == "joint" and all(g.mode == "eval" for g in graphs):
        return ("Skipped: every graph was captured in eval mode (grad disabled, or nothing requires grad): "
                "there is no backward graph.")
    whole = [fb for fb in report.fallbacks if fb.scope == "graph"]
    if whole:
        return f"Skipped: {len(whole)} graph(s) run in PyTorch: {whole[0].reason}"
    if options is not None and kind == "onnxscript" and options.graph_optimization_level == "disable":
        return "Skipped: graph_optimization_level='disable' turns onnxscript's optimizer off."
    if options is not None and options.cache_dir and any(g.cached for c in report.captures for g in c.graphs):
        return "Skipped: the models came from the on-disk cache (cache_dir), so this stage did not run."
    return f"Skipped: the engine saved no {kind} file."


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
    **options: Any,
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
            :func:`default_loss` (the first differentiable scalar, else the sum).
        folder: where the stages are saved; default a temporary folder that is
            deleted with the lab (use ``lab.save(folder)`` to keep it).
        **options: engine options, as for ``ORTModule`` (``recompute``, ``fallback_ops``...).

    Example:
        >>> lab = ortlab.explore(model, x, y)         # doctest: +SKIP
        >>> lab.next()                                 # doctest: +SKIP
        >>> lab.run("split").activations[0]            # doctest: +SKIP
        >>> lab["exported"].view(node="addmm")         # doctest: +SKIP
    """
    if isinstance(model, ORTModule):
        current = {f.name: getattr(model.options, f.name) for f in dataclasses.fields(Options) if f.name != "from_env"}
        options = {**current, **options}
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedInputError(f"explore takes a torch.nn.Module, got {type(model).__name__}.")
    opts = Options.from_kwargs(options)
    owns = folder is None
    folder = os.path.abspath(folder or tempfile.mkdtemp(prefix="ortlab_lab_"))
    os.makedirs(folder, exist_ok=True)
    prefix = re.sub(r"\W+", "_", type(model).__name__).strip("_").lower() or "model"
    debug = DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=folder)
    # ORTLAB_SAVE_* variables override DebugOptions given in code; the lab needs its own folder.
    debug.save_onnx, debug.onnx_prefix, debug.save_path = True, prefix, folder
    kwargs = dict(example_kwargs or {})
    meta = {
        "model": type(model).__name__,
        "prefix": prefix,
        "options": {f.name: getattr(opts, f.name) for f in dataclasses.fields(Options) if f.name != "from_env"},
        "inputs": [_describe(v) for v in example_inputs] + [f"{k}={_describe(v)}" for k, v in kwargs.items()],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "onnxruntime": _ort_version()},
    }
    pipeline = _Pipeline(model, tuple(example_inputs), kwargs, opts, debug, loss_fn or default_loss)
    lab = Lab(folder, driver=pipeline, meta=meta, owns_folder=owns)
    lab._write_manifest()
    return lab


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__
