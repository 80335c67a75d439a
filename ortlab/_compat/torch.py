"""The private torch APIs ortlab uses, each with why and since when (checked on torch 2.6-2.13).

Everything else in ortlab uses torch's public API only. Grouped by what they serve:

* Dynamo: its config, counters and exception types (the backend contract is public,
  its control flow is not).
* AOTAutograd and functorch's partitioners: the joint graph and its split.
* torch.onnx's exporter internals: the FX-to-ONNX translator and the torchlib registry.
* Fake tensors, pytree, op types, DLPack: small helpers with no public spelling.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch._dynamo.config
import torch._functorch.config
import torch.utils._pytree as pytree  # noqa: F401  (re-exported)
from torch._decomp import decomposition_table as aten_decompositions  # noqa: F401  (re-exported)
from torch._dynamo import exc as _dynamo_exc
from torch._dynamo.utils import counters as dynamo_counters  # noqa: F401  (re-exported)
from torch._functorch import partitioners as _partitioners
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: F401  (re-exported)
from torch.onnx._internal.exporter import _constants, _core, _decomp, _fx_passes, _ir_passes, _registration

__all__ = [
    "tangent_positions",
    "OpOverload",
    "HigherOrderOperator",
    "pytree",
    "aten_decompositions",
    "dynamo_counters",
    "DYNAMO_CONTROL_FLOW",
    "BackendCompilerFailed",
    "TorchDynamoException",
    "set_dynamo_config",
    "ignore_once_only_logging",
    "disable_donated_buffers",
    "eager_backward_lowering",
    "aot_module_simplified",
    "default_partition",
    "min_cut_rematerialization_partition",
    "activation_memory_budget",
    "without_symbols",
    "forward_region",
    "FakeTensorMode",
    "unset_fake_temporarily",
    "SDPA_TARGETS",
    "assert_on_device",
    "MULTILABEL_MARGIN_TARGETS", "MULTI_MARGIN_TARGETS", "SOFTSHRINK_TARGETS",
    "legacy_reduction",
    "LINEAR_TARGETS",
    "GELU_TARGETS",
    "maybe_mark_dynamic",
    "torch_compile",
    "COMPILE_ISOLATION",
    "FailOnRecompileLimitHit",
    "recompile_limit_hit",
    "CompiledRegion",
    "compiled_region",
    "forget_compiles",
    "forget_sizes_seen",
    "guard_failures_of",
    "global_state",
    "ddp_active",
    "without_ddp_optimizer",
    "from_dlpack_capsule",
    "ONNX_IR_VERSION",
    "ONNXRegistry",
    "torchlib_registry",
    "onnx_friendly_decompositions",
    "translate_fx_graph",
    "insert_type_promotion_nodes",
    "add_opset_imports",
    "set_value_type",
    "EXPORTER_LOGGERS",
    "FAKE_TENSOR_LOGGER",
    "tensor_version",
    "dynamo_input_source",
    "aot_input_origin",
    "aot_user_outputs",
]

# ----------------------------------------------------------------------------------- op types
# Note [Op types]: ``torch._ops.OpOverload`` is the type of ``torch.ops.aten.mm.default``;
# torch has no public alias (2.0+). FX node targets are checked against it everywhere.
OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator

# -------------------------------------------------------------------------------------- Dynamo
# Note [Dynamo's control flow]: a backend may raise these to make Dynamo re-trace (2.1+);
# ortlab lets them through untouched. BackendCompilerFailed wraps an error raised by a
# backend; TorchDynamoException is the root of Dynamo's own failures (1.13+). torch has
# no public module for them.
DYNAMO_CONTROL_FLOW: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(_dynamo_exc, "RestartAnalysis", None), getattr(_dynamo_exc, "TensorifyScalarRestartAnalysis", None))
    if cls is not None
)
BackendCompilerFailed = _dynamo_exc.BackendCompilerFailed
TorchDynamoException = _dynamo_exc.TorchDynamoException


def set_dynamo_config(settings: dict[str, Any]) -> None:
    """Set ``torch._dynamo.config`` values that differ (see Note [Process-wide torch settings]).

    Dynamo's knobs (recompile limits, hook guards, float specialization) exist only in
    ``torch._dynamo.config`` (2.0+; ``recompile_limit`` since 2.6).
    """
    for key, value in settings.items():
        if getattr(torch._dynamo.config, key) != value:
            setattr(torch._dynamo.config, key, value)


# Note [Dynamo's guard latency probe]
# When Dynamo converts a frame it times one run of the new frame's guards for its compile metrics
# (``guard_latency_us``; the figure is logged at DEBUG on ``torch._dynamo.guards`` and sent to
# tlparse). The C++ probe flushes the CPU's caches first by writing a large buffer, and that costs
# 50-90 ms a frame on a 2-core EPYC (``torch.compile(f, backend="eager")`` of a one-line function:
# 136-162 ms a compile with the probe, 57-76 ms without; 2026-11-29, torch 2.13): a capture of a
# small model spent more time flushing caches than exporting its graphs. Nothing reads the figure
# but those logs, so while ortlab's own calls convert frames (``skip``: the caller says when) the probe
# answers 0.0, unless the guards logger is on at DEBUG (a user who asked for the figure gets it).
# The wrapper replaces the module global Dynamo calls (``torch._dynamo.guards.profile_guard_manager``,
# imported there from ``torch._C._dynamo.guards``, 2.5+); a torch without it is left alone.
def skip_guard_latency_probe(skip: Callable[[], bool]) -> None:
    """Answer Dynamo's guard latency probe with 0.0 while ``skip()`` is true (Note [Dynamo's guard latency
    probe]); once per process, the first caller's ``skip`` wins."""
    try:
        guards = importlib.import_module("torch._dynamo.guards")
    except ImportError:
        return
    probe = getattr(guards, "profile_guard_manager", None)
    if probe is None or getattr(probe, "_ortlab_skip", None) is not None:
        return
    log = logging.getLogger("torch._dynamo.guards")

    def profile_guard_manager(*args: Any, **kwargs: Any) -> float:
        if skip() and not log.isEnabledFor(logging.DEBUG):
            return 0.0
        return profile_guard_manager.original(*args, **kwargs)  # type: ignore[attr-defined]

    profile_guard_manager._ortlab_skip = skip  # type: ignore[attr-defined]
    profile_guard_manager.original = probe  # type: ignore[attr-defined]
    guards.profile_guard_manager = profile_guard_manager


# Note [Once-only log calls inside captured code]
# Dynamo cannot trace a call to a ``logging.Logger`` method: the call breaks the graph, and
# the frame around it runs in PyTorch. Hugging Face's models call transformers'
# ``logger.warning_once`` in their forward: a GPT2LMHeadModel given labels logs "`loss_type=None`
# ... Using the default loss" from its ``loss_function`` property, which cut the LM head off its
# loss: two graphs, with the logits (batch x T x vocab, 205 MB on a GPT-2-small-sized batch)
# handed from one to the other through PyTorch. Dynamo leaves the calls listed in
# ``ignore_logging_functions`` out of the captured code instead; ortlab lists transformers'
# once-only helpers there (``warning_once``,
# ``info_once``, which transformers puts on ``logging.Logger`` when it is imported, so before any
# of its models is built). The cost: those messages are not printed from code ortlab captures.
# Any other log call still breaks the graph, reported as a fallback. torch without the setting
# (before 2.6) keeps the graph break.
_ONCE_ONLY_LOGGING = ("warning_once", "info_once")


def ignore_once_only_logging() -> None:
    """Add transformers' once-only log helpers to Dynamo's ``ignore_logging_functions``
    (Note [Once-only log calls inside captured code])."""
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)
    if ignored is None:
        return
    for name in _ONCE_ONLY_LOGGING:
        function = getattr(logging.Logger, name, None)
        if function is not None:
            ignored.add(function)


def disable_donated_buffers() -> bool:
    """Turn off AOTAutograd's donated buffers, process-wide; True if it was on.

    ``torch._functorch.config.donated_buffer`` (2.5+) is read when the backward *runs*,
    so no scoped patch reaches it (see Note [Process-wide torch settings]).
    """
    if getattr(torch._functorch.config, "donated_buffer", False):
        torch._functorch.config.donated_buffer = False
        return True
    return False


def eager_backward_lowering() -> Any:
    """A context in which AOTAutograd compiles the backward graph at once, not at the first backward.

    ``force_non_lazy_backward_lowering`` (2.8+) is the only way to get it; on older
    torch this is a no-op context (the backward then compiles when it first runs).
    """
    if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)
    import contextlib

    return contextlib.nullcontext()


# Note [Where a graph input comes from]: netron views name a graph's inputs after the
# parameter, buffer or user input they are, not AOTAutograd's ``primals_3``. Dynamo keeps
# each placeholder's source on ``node.meta["grapharg"].source`` (``L['self']._modules['ln1']
# ._parameters['weight']``; ``.name`` a property since 2.9, a method before), and
# AOTAutograd (2.9+) describes each placeholder of its joint, forward, backward and
# inference graphs in ``node.meta["desc"]``: ``PlainAOTInput(idx)``, the Dynamo graph's
# ``idx``-th input, or ``ParamAOTInput(target)`` / ``BufferAOTInput(target)`` for a module
# attribute it lifted. Both are private; without them the names stay as they are.
def dynamo_input_source(node: torch.fx.Node) -> str | None:
    """The source Dynamo recorded for a placeholder of its graph (``L['idx']``), if any."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else None


def aot_input_origin(node: torch.fx.Node) -> int | str | None:
    """What a placeholder of an AOTAutograd graph is: the index of the Dynamo graph's input
    it receives, or the target of the parameter or buffer AOTAutograd lifted; None if unknown."""
    desc = node.meta.get("desc")
    kind = type(desc).__name__
    if kind == "PlainAOTInput" and isinstance(getattr(desc, "idx", None), int):
        return desc.idx
    if kind in ("ParamAOTInput", "BufferAOTInput") and isinstance(getattr(desc, "target", None), str):
        return desc.target
    return None


# Note [What an AOTAutograd graph's outputs are]: AOTAutograd (2.9+) describes each output of
# its graphs too, in the output node's ``meta["desc"]`` (one descriptor per output):
# ``PlainAOTOutput`` (the user's), ``InputMutationAOTOutput`` and ``MetadataMutationAOTOutput``
# (a mutated input's new value, copied back), ``IntermediateBaseAOTOutput`` (a base it
# regenerates aliased user outputs from), ``SavedForBackwardsAOTOutput`` (what the backward
# reads), gradients, tokens. Private (``torch._functorch._aot_autograd.descriptors``); without
# them every output counts as one the user sees.
_USER_OUTPUTS = ("PlainAOTOutput", "InputMutationAOTOutput", "MetadataMutationAOTOutput", "IntermediateBaseAOTOutput")


def aot_user_outputs(gm: torch.fx.GraphModule) -> list[bool] | None:
    """Per output of an AOTAutograd forward or inference graph, whether the user sees it (or AOTAutograd
    makes what the user sees from it) rather than the backward; None where the graph does not say."""
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    descs = out.meta.get("desc") if out is not None else None
    outputs = out.args[0] if out is not None else None
    if not isinstance(descs, (list, tuple)) or not isinstance(outputs, (list, tuple)) or len(descs) != len(outputs):
        return None
    return [type(d).__name__ in _USER_OUTPUTS for d in descs]


def tangent_positions(node: object) -> tuple[int, ...] | None:
    """For the autograd node of an AOTAutograd compiled graph (``CompiledFunctionBackward``): which of the gradients
    autograd hands it (mutated inputs, outputs, views' bases) become the backward graph's tangents, in order; None
    where its metadata does not say (another torch, tensor subclasses).

    AOTAutograd's backward prologue keeps the gradients of inputs whose data it mutates and which require grad, of
    outputs that are no alias (or an unsafe view, or a custom Function's view) and require grad, and of every
    intermediate base (``_codegen_backward_prologue`` in ``torch/_functorch/_aot_autograd/runtime_wrappers.py``,
    torch 2.6 to 2.13)."""
    cls = getattr(node, "_forward_cls", None)
    cached = getattr(cls, "_ortlab_tangent_positions", False)
    if cached is not False:
        return cached
    positions: tuple[int, ...] | None = None
    try:
        from torch._functorch._aot_autograd.schemas import OutputType

        meta = cls.metadata
        if getattr(cls, "maybe_subclass_metadata", None) is None:
            mutated = meta.num_mutated_inp_runtime_indices
            kept = [i for i, idx in enumerate(meta.mutated_inp_runtime_indices)
                    if meta.input_info[idx].mutates_data and meta.input_info[idx].requires_grad]
            views = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
            for i, info in enumerate(meta.output_info):
                needs = getattr(info, "requires_grad_for_backward", info.requires_grad)
                if info.output_type in views and issubclass(info.raw_type, torch.Tensor) and needs:
                    kept.append(mutated + i)
            start = mutated + meta.num_outputs
            kept += range(start, start + meta.num_intermediate_bases)
            positions = tuple(kept)
    except Exception:  # noqa: BLE001 - another torch's metadata: no positions, the backward as it is
        positions = None
    try:
        cls._ortlab_tangent_positions = positions
    except Exception:  # noqa: BLE001
        pass
    return positions


# ------------------------------------------------------------------------------ partitioners
# Note [functorch's partitioners]: ``default_partition`` and
# ``min_cut_rematerialization_partition`` are what torch.compile itself passes as
# ``partition_fn`` (1.13+); torch exports no public name for them. ortlab stays inside
# their contract ``(joint, inputs, *, num_fwd_outputs) -> (fw, bw)`` and their recompute
# protocol (``node.meta["recompute"]``).
default_partition = _partitioners.default_partition
min_cut_rematerialization_partition = _partitioners.min_cut_rematerialization_partition


def without_symbols(value: object, fallback: int = 4096) -> object:
    """``value`` (a node's meta value: a fake tensor, a SymInt) with each symbolic size replaced by its
    hint, adding no guard: counting FLOPs on a symbolic capture must not specialize its sizes (``int()``
    of a SymInt guards, and the next batch size then re-captured). torch's partitioner does the same for
    its runtime estimates (``_remove_symbols_without_guarding``); values without symbols come back as they are."""
    from torch.fx.experimental import symbolic_shapes

    if isinstance(value, torch.SymInt):
        hint = getattr(symbolic_shapes, "optimization_hint", None)
        return hint(value, fallback=fallback) if hint is not None else fallback
    if isinstance(value, torch.Tensor) and symbolic_shapes.has_free_symbols(value):
        remove = getattr(_partitioners, "_remove_symbols_without_guarding", None)
        if remove is None:
            raise NotImplementedError("this torch has no way to read a symbolic tensor's sizes without guarding")
        return remove(value, fallback=fallback)
    return value


def activation_memory_budget(fraction: float):  # noqa: ANN201 - a context manager
    """functorch's knapsack over the min-cut partition (``torch._functorch.config.activation_memory_budget``,
    2.4+): 1.0 saves what the min-cut partitioner saves, 0.0 only the graph's inputs; between, the
    fewest FLOPs recomputed that fit. torch names no public switch for it."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=fraction, activation_memory_budget_runtime_estimator="flops")


def forward_region(joint: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes ``default_partition`` places in the forward, by its own region rules.

    Every non-tangent node up to the last one tagged forward (or a primal, or a seed
    offset): functorch's private helpers ``_has_tag_is_forward``, ``_is_primal``,
    ``_is_fwd_seed_offset`` and ``_is_tangent`` (2.1+) decide it; copying them would
    drift from torch.
    """
    nodes = list(joint.graph.nodes)
    last = max(
        (i for i, n in enumerate(nodes)
         if _partitioners._has_tag_is_forward(n) or _partitioners._is_primal(n) or _partitioners._is_fwd_seed_offset(n)),
        default=-1,
    )
    return {n for n in nodes[: last + 1] if not _partitioners._is_tangent(n) and n.op != "output"}


# Note [Fake tensor errors]: when a user's input is wrong (a shape a matmul rejects), Dynamo
# meets the error while tracing with fake tensors and this logger prints ~20 lines of
# traceback at ERROR before PyTorch's own error reaches the user (2.1+).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# ------------------------------------------------------------------------------- device asserts
# Note [Index guards on CUDA] in ortlab.onnx.guards: an assert queued on the tensor's device, raised
# by a later CUDA call as eager's own index checks are (the CPU raises at once). No public spelling;
# ``torch._assert_async(tensor, msg)`` since 2.1.
def assert_on_device(ok: torch.Tensor, message: str) -> None:
    torch._assert_async(ok, message)


# ------------------------------------------------------------------------------- attention
# Note [Fused attention targets]: Dynamo records ``F.scaled_dot_product_attention`` as
# either the public function or its C binding ``torch._C._nn.scaled_dot_product_attention``.
SDPA_TARGETS = frozenset({torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention})
# Note [Multilabel margin loss with its target slots masked] in ortlab.capture.decompositions
MULTILABEL_MARGIN_TARGETS = frozenset({torch.nn.functional.multilabel_margin_loss, torch._C._nn.multilabel_margin_loss})
# F.multi_margin_loss and F.softshrink as Dynamo records them (Note [Margin losses' gradients as PyTorch's kernels],
# Note [softshrink's zeros as PyTorch's vector path]).
MULTI_MARGIN_TARGETS = frozenset({torch.nn.functional.multi_margin_loss, torch._C._nn.multi_margin_loss})
SOFTSHRINK_TARGETS = frozenset({torch.nn.functional.softshrink, torch._C._nn.softshrink,
                                torch.ops.aten.softshrink.default, torch.ops.aten.softshrink})


def legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    """The ``reduction`` a loss's deprecated ``size_average``/``reduce`` arguments stand for (torch.nn._reduction,
    1.0+; no public spelling)."""
    return torch.nn._reduction.legacy_get_string(size_average, reduce)


# Note [Isolated compiles]: each ORTModule (and each label-sparsity tail) gets its own Dynamo
# cache and recompile budget where torch supports it (2.12+, public torch.compile arguments);
# otherwise every instance of one class shares the per-code cache and, past the limit, new
# ones would fall back (see Note [Releasing a module's sessions] in ortlab.ortmodule). Only
# ``recompile_limit`` is checked per region: ``accumulated_recompile_limit`` still counts every
# region's entries on a code object (Note [Each ORTModule's own recompile budget] in
# ortlab.ortmodule).
COMPILE_ISOLATION: dict[str, Any] = (
    {"isolate_recompiles": True, "recompile_limit": 64}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)
# Past a recompile limit, with ``fail_on_recompile_limit_hit`` (Note [Process-wide torch
# settings]), Dynamo raises this; it is not a ``TorchDynamoException`` (2.5+). On a torch without
# it, a class nothing raises.
class _NotInThisTorch(Exception):
    pass


FailOnRecompileLimitHit: type[Exception] = getattr(_dynamo_exc, "FailOnRecompileLimitHit", _NotInThisTorch)


def recompile_limit_hit(error: BaseException) -> str:
    """Which limit a ``FailOnRecompileLimitHit`` is about (``recompile_limit``,
    ``accumulated_recompile_limit``), read from the ``Unsupported`` Dynamo chains to it ("Limit
    type: ..."); "a recompile limit" where it does not say."""
    cause = error.__cause__
    text = str(cause) if cause is not None else ""
    for limit in ("accumulated_recompile_limit", "recompile_limit"):
        if f"Limit type: {limit}" in text:
            return limit
    return "a recompile limit"


# Note [Forgetting a released module's compiles]
# Dynamo keeps, for every compile, a cache entry on each code object it traced (the guards, the
# transformed bytecode, torch's wrapper of the backend), the backend itself in
# ``eval_frame.cached_backends`` (for ``torch._dynamo.reset``), and, for each guard that
# ID_MATCHes a long-lived object (a class, a Python module, a builtin: 8 for a one-Linear model),
# a ``weakref.finalize`` on that object holding the guards' ``CheckFunctionManager``. None of it
# goes when the compiled module is collected: the guards check the module's tensors, not the
# module, so Dynamo's own invalidation (when an ID_MATCHed object dies) never fires. A discarded
# ORTModule so kept its backend and report, its AOTAutograd functions, FX and ONNX IR graphs, and
# the compiled graphs Dynamo stores in the model's module globals (``__compiled_fn_N``): +106 KiB
# RSS a module (a one-Linear model, 60 modules after 20, gc and malloc_trim), 453 -> 554 MiB over
# 1,024 modules; glibc's in-use bytes +41-46 KiB and ~550 Python blocks a module, +14-19 KiB and
# ~90 blocks after (tests/test_module_lifecycle.py). ``forget_compiles`` does for a released
# module's regions what Dynamo does when an ID_MATCHed object dies: ``ExtraState.invalidate`` on
# each of their entries, on every code object Dynamo converted (``convert_frame.input_codes``):
# the entry stays in the code's list as a record
# with no guards, code or backend (a ``CompileId``), and its bytecode's cleanup hook deletes the
# ``__compiled_fn_N`` globals. It detaches the finalizers holding those entries' guards (found in
# ``weakref.finalize._registry``, the stdlib's private registry: nothing else lists them) and takes
# the backend out of ``cached_backends``. It runs from a finalizer, as Dynamo's own invalidation
# does. On torch without regions (before 2.12) there are none to forget; where these internals
# are missing, a warning says once that discarded modules keep their graphs' memory.
@dataclasses.dataclass(frozen=True)
class CompiledRegion:
    """An isolated ``torch.compile``'s region of Dynamo's caches, and torch's wrapper of its backend."""

    region: int
    backend: Any


def compiled_region(compiled: Any) -> CompiledRegion | None:
    """The region of Dynamo's caches a ``torch.compile``'d module was given (``isolate_recompiles``),
    or None (not isolated, or another torch)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    region = getattr(ctx, "_isolate_recompiles_id", -1)
    if not isinstance(region, int) or region < 0:
        return None
    try:
        from torch._dynamo.eval_frame import innermost_backend

        backend = innermost_backend(ctx.callback)
    except Exception:  # noqa: BLE001 - another torch: the backend stays in torch's cache
        backend = None
    return CompiledRegion(region, backend)


_FORGET_FAILED: list[str] = []


def forget_compiles(regions: list[CompiledRegion], reason: str) -> int:
    """Drop what Dynamo keeps of these regions' compiles (Note [Forgetting a released module's
    compiles]); ``reason`` is what Dynamo says of the entries if asked. Returns how many entries."""
    if not regions:
        return 0
    try:
        from torch._C._dynamo.eval_frame import _get_cache_entries_for_region
        from torch._dynamo import convert_frame, eval_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        for r in regions:
            if r.backend is not None and eval_frame.cached_backends.get(id(r.backend)) is r.backend:
                del eval_frame.cached_backends[id(r.backend)]
        ids = {r.region for r in regions}
        guards: dict[int, Any] = {}  # held until the finalizers are detached, so no id is reused
        for ref in list(convert_frame.input_codes.seen):
            code = ref()
            if code is None:
                continue
            for region in ids:
                for entry in _get_cache_entries_for_region(code, region):
                    manager = entry.guard_manager
                    state = getattr(manager, "extra_state", None)
                    if isinstance(manager, DeletedGuardManagerWrapper) or state is None:
                        continue
                    guards[id(manager)] = manager
                    state.invalidate(entry, DeletedGuardManagerWrapper(reason))
        if guards:
            for finalizer, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
                owner = getattr(getattr(info.func, "func", None), "__self__", None)
                if id(getattr(owner, "guard_manager", None)) in guards:
                    finalizer.detach()
        return len(guards)
    except Exception as e:  # noqa: BLE001 - another torch: its caches keep the compiles
        if not _FORGET_FAILED:
            _FORGET_FAILED.append(str(e))
            logging.getLogger("ortlab").warning(
                "ortlab could not release what torch keeps of a discarded ORTModule's compiles "
                "(%s: %s); each discarded module keeps its graphs' memory", type(e).__name__, e)
        return 0
# The same for ``F.linear`` (``nn.Linear`` in Dynamo's graph is ``torch._C._nn.linear``).
LINEAR_TARGETS = frozenset({torch._C._nn.linear, torch.nn.functional.linear})
# And for ``F.gelu`` (``nn.GELU`` and Hugging Face's activations record the C binding).
GELU_TARGETS = frozenset({torch._C._nn.gelu, torch.nn.functional.gelu})
# Marks a dim of a tensor Dynamo is about to trace as symbolic, without an error if the graph
# specializes it (2.1+; torch has no public spelling).
maybe_mark_dynamic = torch._dynamo.maybe_mark_dynamic


def torch_compile(model: Any, **kwargs: Any) -> Any:
    """``torch.compile``, past the wrappers other libraries put over it.

    Lightning's ``lightning.fabric.wrappers`` replaces ``torch.compile`` at import with a
    function that deep-copies every keyword argument of a module's compile, the backend
    included: ortlab's backends share their report, which holds onnxruntime sessions, and
    copying one raised "cannot pickle InferenceSession" (a label-sparsity tail or an
    embedding-sparsity graph compiled after the first session, in a process that imported
    Lightning). The wrappers say what they wrap in ``__wrapped__`` (``functools.wraps``).
    """
    compile_ = torch.compile
    while getattr(compile_, "__wrapped__", None) is not None:
        compile_ = compile_.__wrapped__
    return compile_(model, **kwargs)


def forget_sizes_seen(module: Any) -> None:
    """Clear what Dynamo remembers of the sizes ``module``'s ``forward`` was called with.

    Note [A new module's first capture uses its own sizes]: Dynamo's automatic dynamic keeps,
    per code object (``torch._dynamo.pgo``'s code state, 2.6+; no public spelling), every size a
    frame was traced with, across ``torch.compile`` calls; ``isolate_recompiles`` does not
    isolate it. A second ORTModule of the same class called with another batch size was
    therefore captured with symbolic sizes from its first call, against ``dynamic=None``'s
    promise that the first capture uses the example's sizes: on a 2-core EPYC the 4-layer
    GPT's second and third modules (batch 6 and 8 after 4) took 7.9 and 9.0 s to their first
    step instead of 4.0 and 3.7 s, with the same step time after it. ORTModule calls this
    before a new module's first capture, not after ``reconfigure`` (what Dynamo saw then was
    this module's own sizes: a module whose sizes vary captures symbolic again at once, one
    capture instead of two); a module of the same class captured earlier keeps its compiled
    graphs, and a new size of it is judged against the sizes of the module captured last.
    The frames Dynamo resumes after a graph break in ``forward`` (``torch_dynamo_resume_in_
    forward_at_<line>``, code of their own in the same file) keep sizes too, and are cleared
    with it. A module whose ``forward`` is torch's own (``nn.Sequential``, ``nn.BatchNorm2d``,
    ``nn.TransformerEncoder``) is traced from a frame Dynamo wraps around it
    (``torch._dynamo.external_utils.wrap_inline``'s ``inner``), one code for every such module:
    its sizes are cleared too (in torch 2.13 a ``BatchNorm1d`` after a ``BatchNorm2d`` made every
    later ``nn.Sequential`` and ``nn.Upsample`` capture symbolic, and an upsampling's backward ran
    in PyTorch). Without the code state (another torch), nothing is cleared.
    """
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    try:
        from torch._dynamo import external_utils, pgo

        state = pgo.get_code_state()
        own = pgo.CodeId.make(code, getattr(forward, "__closure__", None))
        wrapper = pgo.CodeId.make(external_utils.wrap_inline(lambda: None).__code__)
        resumed = f"torch_dynamo_resume_in_{code.co_name}_at_"
        for key in [k for k in state if k == own or (k.file_hash == own.file_hash and resumed in k.name)
                    or (k.file_hash, k.firstlineno, k.name) == (wrapper.file_hash, wrapper.firstlineno, wrapper.name)]:
            del state[key]
    except Exception:  # noqa: BLE001 - another torch: Dynamo's own behaviour
        return


def tensor_version(t: torch.Tensor) -> int:
    """The version counter in-place ops bump (``Tensor._version``, 1.0+; no public spelling)."""
    return t._version


# ----------------------------------------------------------------------------------- DLPack
# Note [DLPack capsules]: onnxruntime's ``OrtValueVector.to_dlpacks(fn)`` calls ``fn`` on
# each output's capsule; ``torch._C._from_dlpack`` takes a capsule with no Python-level
# checks (``torch.utils.dlpack.from_dlpack`` costs ~1 us more per tensor, on every step).
from_dlpack_capsule: Callable[[Any], torch.Tensor] = torch._C._from_dlpack

# ----------------------------------------------------------------------- torch.onnx internals
# Note [torch.onnx's translator]: ortlab translates AOTAutograd's FX graphs with the same
# functions ``torch.onnx.export(dynamo=True)`` uses (2.5+), without ``torch.export``:
# the graph is already functional aten, and re-tracing it would cost seconds and lose
# the SymInt inputs that keep sizes dynamic. torch exposes only the whole-model export
# publicly, so the translator, its FX passes and the torchlib registry are reached here.
ONNX_IR_VERSION: int = _constants.ONNX_IR_VERSION
ONNXRegistry = _registration.ONNXRegistry
EXPORTER_LOGGERS = (_core.__name__, _registration.__name__)


def torchlib_registry() -> Any:
    """A fresh registry of torchlib's translations (``ONNXRegistry.from_torchlib``).

    Note [Building torchlib's registry]: ``from_torchlib`` asks onnxscript for torchlib's
    functions (``get_torchlib_ops``), which reads each function's ``function_ir`` to fill in a
    ``domain`` field the registry never uses; that parses the source of all 497 functions
    (``inspect.getsource`` + ``ast``) and took 0.57 of the registry's 0.75 s, on every
    process's first step. The registry is built here with that list made without the parse
    (the domain read from the function's opset, which is where ``function_ir`` takes it from);
    any surprise falls back to torch's own call. ``test_the_registry_is_torchs`` checks the two
    registries hold the same functions for the same ops.
    """
    apis = _registration.onnxscript_apis
    try:
        original = apis.get_torchlib_ops
        light = _torchlib_ops_without_source(original)
    except Exception:  # noqa: BLE001 - another onnxscript: torch's own way
        return _registration.ONNXRegistry.from_torchlib()
    apis.get_torchlib_ops = light
    try:
        return _registration.ONNXRegistry.from_torchlib()
    finally:
        apis.get_torchlib_ops = original


def _torchlib_ops_without_source(original: Callable[[], list]) -> Callable[[], list]:
    module = inspect.getmodule(original)
    meta_type = module._OnnxFunctionMeta  # type: ignore[union-attr]
    importlib.import_module("onnxscript.function_libs.torch_lib.ops")  # importing it registers the functions
    from onnxscript.function_libs.torch_lib import registration

    def light() -> list:
        metas = []
        for qualified_name, funcs in registration.default_registry.items():
            if qualified_name.startswith("internal::"):
                continue
            for is_complex, group in ((False, funcs.overloads), (True, funcs.complex)):
                for func in group:
                    metas.append(meta_type(qualified_name=qualified_name, function=func, domain=func.opset.domain,
                                           name=func.name, is_complex=is_complex))
        return metas

    return light


def onnx_friendly_decompositions(onnx_ops: set[Any]) -> dict[Any, Callable]:
    """torch's decompositions minus the ops torchlib translates (``_decomp``, 2.5+)."""
    return dict(_decomp.create_onnx_friendly_decomposition_table(onnx_ops))


def translate_fx_graph(graph: torch.fx.Graph, model: Any, registry: Any) -> dict[str, Any]:
    """Translate an FX graph into ``model``'s graph; returns FX node name -> ONNX value(s)."""
    with _op_signatures_cached():
        return _core._translate_fx_graph(
            graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
        )


# Note [One op signature per ONNX op]
# torch.onnx's OpRecorder.eval builds an ``OpSignature`` from the op's ONNX schema on every
# op it records (``OpSignature.from_op_schema``: parameters, type constraints, default
# attributes deserialized again), and torchlib records a Constant for each dimension it
# merges into a shape: on a 6-layer Hugging Face GPT-2 graph pair (d=768), translation minus
# onnxscript's optimizer took 1.6-2.2 s, 1.0-1.7 s with one signature per (domain, op, version),
# alternating runs on a 2-core AMD EPYC (a small share of that first step's 18-26 s). onnxscript's own
# ``Op`` keeps one signature per op the same way (``Op.op_signature``); the recorder copies a
# default attribute before renaming it, and nothing writes to a signature. While ortlab
# translates a graph, ``from_op_schema`` answers from that cache; it is put back after.
_SIGNATURES: dict[tuple[str, str, int], Any] = {}


class _op_signatures_cached:
    def __enter__(self) -> None:
        signature = getattr(getattr(_building_ir(), "schemas", None), "OpSignature", None)
        self.owner = signature if signature is not None and "from_op_schema" in vars(signature) else None
        if self.owner is None:
            return
        self.original = vars(self.owner)["from_op_schema"]
        build = self.original.__func__

        def from_op_schema(cls: type, schema: Any) -> Any:
            key = (schema.domain, schema.name, schema.since_version)
            sig = _SIGNATURES.get(key)
            if sig is None:
                sig = _SIGNATURES[key] = build(cls, schema)
            return sig

        self.owner.from_op_schema = classmethod(from_op_schema)

    def __exit__(self, *exc: object) -> None:
        if self.owner is not None:
            self.owner.from_op_schema = self.original


def _building_ir() -> Any:
    from torch.onnx._internal.exporter import _building

    return getattr(_building, "ir", None)


# Note [Type promotion without running every node again]
# torch.onnx's type promotion pass (``InsertTypePromotion``: explicit casts where aten
# promotes implicitly, so ``int_tensor / 2`` does not become an integer Div) is an FX
# Interpreter that runs every node of the graph again on fake tensors, to have each node's
# value at hand for the promotion rules of the nodes after it. AOTAutograd has already left
# that value on every node (``node.meta["val"]``, from the same FakeTensorMode), and the pass
# never changes a node's output type (it casts a promoted node's result back, and asserts
# so), so the values downstream of a promotion are the ones already there. Our interpreter
# returns a call's ``meta["val"]`` instead of running it again; a node the pass promotes is
# still run (by the pass itself, which writes its new value to ``meta["val"]``), and a node
# without a value runs as before. On the GPT's forward and backward the pass took 0.23 s of
# the first step, the same graphs come out of it node for node
# (tests/test_type_promotion.py).
def _promotion_from_meta() -> type | None:
    try:
        from torch.onnx._internal.fx.passes import type_promotion as tp
        base, get_rule = tp._TypePromotionInterpreter, tp.get_type_promotion_rule
        if not hasattr(base, "_maybe_promote_node") or not hasattr(base, "_set_current_node"):
            return None
    except (ImportError, AttributeError):  # another torch: its own pass runs
        return None

    class PromotionFromMeta(base):  # type: ignore[misc, valid-type]
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op != "call_function" or n.meta.get("val") is None:
                return super().run_node(n)
            with self._set_current_node(n):
                rule = get_rule(n, self.type_promotion_table)
                if rule:
                    self._maybe_promote_node(n, rule)
            return n.meta["val"]

    return PromotionFromMeta


_PROMOTION_FROM_META = _promotion_from_meta()


def insert_type_promotion_nodes(gm: torch.fx.GraphModule, *, from_meta: bool = True) -> None:
    """torch.onnx's type promotion pass (explicit casts where aten promotes implicitly), without running
    every node again (Note [Type promotion without running every node again]; ``from_meta=False``: torch's
    own pass as it is)."""
    if not from_meta or _PROMOTION_FROM_META is None:
        _fx_passes.insert_type_promotion_nodes(gm)
        return
    from torch.onnx._internal.fx import passes

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            raise AssertionError(f"Expected GraphModule, got {type(module)}")
        transform = passes.InsertTypePromotion(module)
        transform.interpreter = _PROMOTION_FROM_META(module, transform.interpreter.type_promotion_table)
        transform.run()


def add_opset_imports(model: Any) -> None:
    """Add the opset imports the translated nodes use."""
    _ir_passes.add_opset_imports(model)


def set_value_type(value: Any, meta_val: Any) -> None:
    """Type and shape an ONNX value from an FX ``meta["val"]`` (complex as float pairs)."""
    _core._set_shape_type(value, meta_val, complex_to_float=True)


# Note [Why a graph was captured again]: when a guard of a captured graph fails (a config
# attribute the code branched on changed: Hugging Face sets ``config.problem_type`` on the
# first call), Dynamo captures the code again and records the failed guard in
# ``torch._dynamo.utils.guard_failures`` (keyed by the code object; 2.0+), which nothing
# public exposes. The report names it beside the new capture.
def guard_failures_of(module: torch.nn.Module) -> list[str]:
    """The guard failures Dynamo recorded for ``module.forward``'s code, one readable line each."""
    from torch._dynamo.utils import guard_failures

    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    out = []
    for failure in guard_failures.get(code, ()) if code is not None else ():
        text = str(failure).split("User stack trace", 1)[0].strip()
        head, _, rest = text.partition(": ")
        if rest and "/" in head and head.replace("/", "").isdigit():  # "0/0: ..." (frame/compile ids)
            text = rest
        out.append(" ".join(text.split()))
    return out


def global_state() -> Any:
    """A snapshot of the global state a trace depends on (grad mode, autocast, default dtype,
    deterministic algorithms, ...): ``.check()`` says whether it still holds, ``.reason()`` what
    changed. It is the snapshot Dynamo guards every graph on (``GlobalStateGuard``, 2.1+, no
    public spelling); None where it is missing, and callers then assume the state changed."""
    guard = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    cls = getattr(guard, "GlobalStateGuard", None)
    return cls() if cls is not None else None


# Note [DDP and Dynamo's DDPOptimizer]
# When a module compiles while ``DistributedDataParallel.forward`` runs (``DDP(ORTModule(m))``),
# Dynamo hands the graph to its DDPOptimizer instead of the backend: it splits the graph at
# DDP's gradient buckets and compiles each piece, to overlap each bucket's all-reduce with the
# rest of the backward. With ortlab's backend the pieces' backward compiles did not line up
# ("AssertionError: expected same # of fw and bw compiles, but found bucket -1", a GPT under
# torchrun), and onnxruntime would run many small graphs. ORTModule compiles with it off
# (``optimize_ddp=False``, only while DDP is active): DDP's reducer all-reduces the gradients
# as the backward produces them, as for any module. ``_get_active_ddp_module`` is the private
# classmethod Dynamo itself asks (2.0+).
def ddp_active() -> bool:
    """Whether a ``DistributedDataParallel`` forward is running (the module it runs is being called)."""
    return torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None


def without_ddp_optimizer() -> Any:
    """A context in which Dynamo compiles without its DDPOptimizer (see Note [DDP and Dynamo's DDPOptimizer])."""
    return torch._dynamo.config.patch(optimize_ddp=False)
