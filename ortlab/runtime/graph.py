"""Turn one FX graph into something AOTAutograd can call, running it in onnxruntime.

Ops onnxruntime cannot run (no torchlib translation, random ops, ops the user names
in ``fallback_ops``, a node whose translation or kernel fails) stay in PyTorch: we
split the graph with torch.fx's ``CapabilityBasedPartitioner`` into onnxruntime
partitions and PyTorch nodes, and each onnxruntime partition becomes one session.
Each op that stays in PyTorch is recorded with its reason and warned once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import re
import shutil
from collections.abc import Callable

import onnx
import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ortlab.artifacts import StageWriter
from ortlab.capture.provenance import module_path, op_name, source_line
from ortlab.config import DebugOptions, Options
from ortlab.errors import DeviceError, ExportError, FallbackError, SessionError, first_line
from ortlab.onnx.export import ExportedGraph, export_graph, unsupported_nodes
from ortlab.onnx.optimize import optimize_exported
from ortlab.report import Fallback, GraphRecord, warn_fallback
from ortlab.onnx.provenance import node_provenance
from ortlab.runtime.cache import CacheEntry, cache_key, load_entry, store_meta
from ortlab.runtime.kernels import low_precision_nodes, missing_kernels
from ortlab.runtime.observe import GraphObserver, observed_graph, observed_part
from ortlab.runtime.runner import OrtRunner, SessionSource
from ortlab.runtime.session import SMALL_GRAPH_FLOPS, choose_threads, create_session, failing_node, providers_for, save_optimized_models

__all__ = ["GraphContext", "compile_graph", "fx_op_counts"]

logger = logging.getLogger(__name__)

_MAX_RETRIES = 50
_FAILED_NODE = re.compile(r"translating node %?(\w+)")


@dataclasses.dataclass
class GraphContext:
    """What compiling a graph needs from its ORTModule."""

    options: Options
    debug: DebugOptions
    device: torch.device
    writer: StageWriter
    where: str  # "g0"
    observer: GraphObserver | None = None  # see Note [Observing compiled graphs]


def fx_op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """aten ops of an FX graph and how often each occurs."""
    counts = collections.Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")
    return dict(counts.most_common())


def _hint(size: object) -> int:
    if isinstance(size, int):
        return size
    hint = size.node.hint  # type: ignore[attr-defined]
    return int(hint) if hint is not None else SMALL_GRAPH_FLOPS


def _numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= _hint(s)
    return n


def matmul_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of the matrix products and convolutions of a graph, at its example sizes."""
    flops = 0
    for node in gm.graph.nodes:
        name = op_name(node)
        if name in ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.convolution", "aten.baddbmm"):
            val = node.meta.get("val")
            args = [a.meta.get("val") for a in node.all_input_nodes]
            if not isinstance(val, torch.Tensor) or not args:
                continue
            # Sizes may be symbolic: read their example values (hints); int() would
            # add a guard and re-capture for every new size.
            out = _numel(val)
            if name == "aten.convolution" and len(args) > 1:
                k = _numel(args[1]) // max(_hint(args[1].shape[0]), 1)
            else:
                k = _hint(args[-1].shape[-2])
            flops += 2 * out * k
    return flops


def _matches(node: torch.fx.Node, wanted: str) -> bool:
    """Does ``node`` match a ``fallback_ops`` entry: ``op`` or ``op@module.path``?"""
    wanted, _, scope = wanted.partition("@")
    if scope:
        path = module_path(node)
        if path != scope and not path.startswith(scope + "."):
            return False
    name = op_name(node)
    wanted = wanted.replace("::", ".")
    if not wanted.startswith("aten.") and "." not in wanted:
        wanted = f"aten.{wanted}"
    return name == wanted or str(node.target) == wanted


def _user_fallbacks(gm: torch.fx.GraphModule, ops: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            for want in ops:
                if _matches(node, want):
                    out[node.name] = f"named in fallback_ops ({want!r})"
    return out


class _Support(OperatorSupportBase):
    def __init__(self, blocked: dict[str, str]) -> None:
        super().__init__()
        self.blocked = blocked

    def is_node_supported(self, submodules: object, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self.blocked:
            return False
        if node.target is operator.getitem:  # keep a getitem with its producer
            src = node.args[0]
            return not (isinstance(src, torch.fx.Node) and src.name in self.blocked)
        return True


class _OrtPart(torch.nn.Module):
    """A fused partition replaced by its onnxruntime session."""

    def __init__(self, runner: Callable[..., list], single: bool) -> None:
        super().__init__()
        self.runner = runner
        self.single = single

    def forward(self, *args: object) -> object:
        out = self.runner(*args)
        return out[0] if self.single else tuple(out)


def _boxed(fn: Callable) -> Callable:
    def run(args: list) -> object:
        return fn(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _Builder:
    """Exports and creates sessions, keeping the timings and files for the record."""

    def __init__(self, ctx: GraphContext, record: GraphRecord, name: str) -> None:
        self.ctx, self.record, self.name = ctx, record, name
        self.providers = providers_for(ctx.device.type, ctx.options)
        self.exported: list[ExportedGraph] = []

    def runner(self, gm: torch.fx.GraphModule, part: str) -> OrtRunner:
        stage = self.name if not part else f"{self.name}_{part}"
        threads, why = choose_threads(self.ctx.options, matmul_flops(gm))
        self.record.threads = why
        entry = None
        if self.ctx.options.cache_dir:
            settings = {
                "level": self.ctx.options.graph_optimization_level,
                "providers": self.providers,
                "threads": threads,
                "device": str(self.ctx.device),
            }
            entry = CacheEntry(self.ctx.options.cache_dir, cache_key(gm, {}, settings))
            hit = self._from_cache(entry, threads)
            if hit is not None:
                return hit
        exported = export_graph(gm, stage)
        self.record.export_s += exported.seconds
        w, mode = self.ctx.writer, self.record.mode
        if w.enabled:
            w.onnx(f"{stage}_exported", mode, exported.to_bytes())
        if self.ctx.options.graph_optimization_level != "disable":
            self.record.export_s += optimize_exported(exported)
            if w.enabled:
                w.onnx(f"{stage}_onnxscript", mode, exported.to_bytes())
        data = exported.to_bytes()
        optimized = w.path(f"{stage}_execution", mode, "onnx") if w.enabled else None
        target = entry.model_path if entry is not None else optimized
        try:
            session, seconds = create_session(data, self.ctx.options, self.ctx.debug, self.providers, target, threads)
        except SessionError as e:
            e.exported = exported  # type: ignore[attr-defined]
            e.providers = self.providers  # type: ignore[attr-defined]
            raise
        self.record.session_s += seconds
        if entry is not None:
            store_meta(entry, exported.input_kinds, exported.output_kinds, exported.output_dtypes, exported.output_sources,
                       node_provenance(exported.model))
            if optimized:
                shutil.copyfile(entry.model_path, optimized)
        if w.enabled:
            w.add([optimized] if optimized else [])
            w.add(save_optimized_models(data, self.ctx.options, self.ctx.debug, self.providers, w.stem(stage, mode)))
        self._count(exported.op_counts())
        self.exported.append(exported)
        runner = OrtRunner(
            session,
            exported.input_kinds,
            exported.output_kinds,
            exported.output_dtypes,
            exported.output_sources,
            self.ctx.device,
            SessionSource.of(session, data),
        )
        self.record.parts.append((runner, exported))
        return runner

    def part_callable(self, runner: OrtRunner) -> Callable[..., list]:
        """What the graph calls: ``runner``, or with an observer, ``runner`` telling it of each call."""
        observer = self.ctx.observer
        return runner if observer is None else observed_part(runner, self.record, observer)

    def _count(self, op_counts: dict[str, int]) -> None:
        for op, count in op_counts.items():
            self.record.onnx_ops[op] = self.record.onnx_ops.get(op, 0) + count
        self.record.ort_partitions += 1

    def _from_cache(self, entry: CacheEntry, threads: int | None) -> OrtRunner | None:
        if not entry.exists() or (meta := load_entry(entry)) is None:
            return None
        try:
            with open(entry.model_path, "rb") as f:
                data = f.read()
            # Already optimized by onnxruntime when it was stored.
            session, seconds = create_session(
                data, self.ctx.options, self.ctx.debug, self.providers, None, threads, level="disable"
            )
        except (OSError, SessionError) as e:
            logger.warning("ortlab: dropping cache entry %s: %s", entry.model_path, first_line(e))
            entry.remove()
            return None
        self.record.session_s += seconds
        self.record.cached += 1
        model = onnx.load_from_string(data)
        self._count(dict(collections.Counter(n.op_type for n in model.graph.node).most_common()))
        runner = OrtRunner(
            session, meta["input_kinds"], meta["output_kinds"], meta["output_dtypes"], meta["output_sources"],
            self.ctx.device, SessionSource.of(session, data),
        )
        runner.provenance = meta["provenance"]
        self.record.parts.append((runner, None))
        return runner


def _value_dtype(node: object) -> object:
    """The dtype a kernel is chosen by: the first output's (Where's input is a bool mask)."""
    values = [v for v in node.outputs if v is not None] or [v for v in node.inputs if v is not None]  # type: ignore[attr-defined]
    return values[0].dtype if values else None


def _culprits(e: Exception) -> dict[str, str]:
    """The FX nodes an export or session error points at, and a short reason.

    A missing onnxruntime kernel (say MatMul for bfloat16 on CPU) blocks every node
    of that ONNX op type and input dtype at once, not one node per retry.
    """
    text = f"{e} {e.__cause__ or ''}"
    exported = getattr(e, "exported", None)
    if isinstance(e, SessionError) and exported is not None and low_precision_nodes(exported.model):
        missing = missing_kernels(exported.model, getattr(e, "providers", ["CPUExecutionProvider"]))
        found: dict[str, str] = {}
        for n in missing:
            if "ortlab.fx_node" in n.metadata_props:
                found.setdefault(n.metadata_props["ortlab.fx_node"], f"onnxruntime has no {n.op_type} kernel for {_value_dtype(n)}")
        if found:
            return found
    if isinstance(e, ExportError):
        m = _FAILED_NODE.search(text)
        root = e.__cause__.__cause__ if e.__cause__ is not None and e.__cause__.__cause__ is not None else e.__cause__
        return {m.group(1): f"ONNX translation failed: {first_line(root or e)}"} if m else {}
    onnx_name = failing_node(text)
    if not onnx_name or exported is None:
        return {}
    graph_nodes = list(exported.model.graph)
    bad = next((n for n in graph_nodes if n.name == onnx_name), None)
    if bad is None:
        return {}
    dtype = _value_dtype(bad)
    same = [n for n in graph_nodes if n.op_type == bad.op_type and _value_dtype(n) == dtype]
    kind = "has no kernel for" if "NOT_IMPLEMENTED" in text else "rejects"
    reason = f"onnxruntime {kind} ONNX {bad.op_type} on {dtype}"
    return {n.metadata_props["ortlab.fx_node"]: reason for n in same if "ortlab.fx_node" in n.metadata_props}


def compile_graph(gm: torch.fx.GraphModule, name: str, mode: str, ctx: GraphContext) -> tuple[Callable, GraphRecord]:
    """Compile ``gm`` for AOTAutograd: a boxed callable and the record of what was done.

    With ``ctx.observer`` set, the callable and each onnxruntime session in it tell the
    observer of every call (see Note [Observing compiled graphs]).

    Raises:
        FallbackError: when ``fallback="raise"`` and anything would run in PyTorch.
    """
    fn, record = _compile(gm, name, mode, ctx)
    if ctx.observer is not None:
        fn = observed_graph(fn, record, ctx.where, ctx.observer)
    return fn, record


def _compile(gm: torch.fx.GraphModule, name: str, mode: str, ctx: GraphContext) -> tuple[Callable, GraphRecord]:
    record = GraphRecord(name=name, mode=mode, fx_ops=fx_op_counts(gm), graph_module=gm)
    ctx.writer.fx(name, mode, gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    blocked = {**unsupported_nodes(gm, ctx.options.cache_dir), **_user_fallbacks(gm, tuple(ctx.options.fallback_ops))}
    builder = _Builder(ctx, record, name)
    for _ in range(_MAX_RETRIES):
        _check_raise(blocked, nodes, ctx, name)
        record.onnx_ops, record.ort_partitions, builder.exported, record.parts = {}, 0, [], []
        try:
            fn = _build(gm, blocked, builder)
        except (ExportError, SessionError) as e:
            new = {c: r for c, r in _culprits(e).items() if c in nodes and c not in blocked}
            if not new:
                return _whole_graph_fallback(gm, name, mode, ctx, record, e)
            blocked.update(new)
            continue
        except (FallbackError, DeviceError):
            raise
        except Exception as e:  # a bug on our side or in a library: never crash training
            logger.warning("ortlab: unexpected error while compiling %s.%s", ctx.where, name, exc_info=e)
            return _whole_graph_fallback(gm, name, mode, ctx, record, e)
        break
    else:
        return _whole_graph_fallback(gm, name, mode, ctx, record, RuntimeError("too many failing ops"))
    for node_name, reason in blocked.items():
        node = nodes[node_name]
        fb = Fallback(
            scope="op",
            where=f"{ctx.where}.{name}",
            reason=reason,
            node=node_name,
            op=op_name(node),
            module=module_path(node),
            source=source_line(node),
        )
        record.fallbacks.append(fb)
        warn_fallback(fb)
    record.torch_nodes = len(blocked)
    return fn, record


def _check_raise(blocked: dict[str, str], nodes: dict, ctx: GraphContext, name: str) -> None:
    if blocked and ctx.options.fallback == "raise":
        lines = [f"  {op_name(nodes[n])} ({n}) at {module_path(nodes[n]) or '<root>'}: {r}" for n, r in blocked.items()]
        raise FallbackError(
            f"{len(blocked)} op(s) of graph {ctx.where}.{name} would run in PyTorch, and fallback='raise':\n"
            + "\n".join(lines)
            + "\nRemove them from fallback_ops, change the model, or use fallback='warn'."
        )


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A fresh graph with the same node names and (shallow-copied) meta."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _build(gm: torch.fx.GraphModule, blocked: dict[str, str], builder: _Builder) -> Callable:
    # Export inserts type-promotion nodes and fusing partitions rewrites the graph in
    # place: work on a copy so a retry starts from the graph AOTAutograd gave us.
    gm = _copy(gm)
    if not blocked:
        return _boxed_runner(builder.part_callable(builder.runner(gm, "")))
    partitioner = CapabilityBasedPartitioner(gm, _Support(blocked), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    # Partitions of only getitems/size arithmetic are not worth a session.
    partitions = [p for p in partitions if any(_worth_running(n) for n in p.nodes)]
    fused = partitioner.fuse_partitions(partitions)
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            out = next(n for n in sub.graph.nodes if n.op == "output")
            single = not isinstance(out.args[0], (tuple, list))
            if single:
                out.args = ((out.args[0],),)
                sub.recompile()
            runner = builder.runner(sub, node.target)
            setattr(fused, node.target, _OrtPart(builder.part_callable(runner), single))
    fused.recompile()
    return _boxed(fused.forward)


def _worth_running(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and isinstance(node.meta.get("val"), torch.Tensor)


def _boxed_runner(runner: Callable[..., list]) -> Callable:
    def run(args: list) -> list:
        out = runner(*args)
        args.clear()  # boxed convention: release inputs as soon as onnxruntime is done
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _whole_graph_fallback(gm, name, mode, ctx, record, error) -> tuple[Callable, GraphRecord]:
    reason = f"graph could not run in onnxruntime: {first_line(error)}"
    if ctx.options.fallback == "raise":
        raise FallbackError(f"graph {ctx.where}.{name} would run in PyTorch: {reason}") from error
    fb = Fallback(scope="graph", where=f"{ctx.where}.{name}", reason=reason)
    record.onnx_ops, record.ort_partitions, record.parts = {}, 0, []
    record.fallbacks.append(fb)
    record.torch_nodes = sum(record.fx_ops.values())
    warn_fallback(fb)
    logger.debug("graph %s falls back to PyTorch", name, exc_info=error)
    return _boxed(gm.forward), record
