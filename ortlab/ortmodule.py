"""ORTModule: a drop-in nn.Module wrapper that trains through onnxruntime.

Note [Sharing the wrapped module's dicts]
ORTModule shares ``_parameters``, ``_buffers`` and ``_modules`` with the module it
wraps instead of registering it as a child. So ``state_dict`` keys,
``named_parameters``, ``load_state_dict``, ``.to()`` and nesting an ORTModule inside
a bigger model all behave exactly as on the wrapped module (no ``_module.`` prefix),
without delegating each method by hand. Other attribute reads and writes go to the
wrapped module, so a changed attribute is seen by Dynamo's guards and re-captures.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ortlab._compat.torch import (
    COMPILE_ISOLATION,
    FAKE_TENSOR_LOGGER,
    BackendCompilerFailed,
    FailOnRecompileLimitHit,
    TorchDynamoException,
    ddp_active,
    disable_donated_buffers,
    forget_sizes_seen,
    ignore_once_only_logging,
    dynamo_counters,
    guard_failures_of,
    pytree,
    recompile_limit_hit,
    set_dynamo_config,
    skip_guard_latency_probe,
    tensor_version,
    without_ddp_optimizer,
)
from ortlab._openmp import openmp_note
from ortlab.config import DebugOptions, Options
from ortlab.errors import CaptureError, ConfigError, DeviceError, FallbackError, OrtlabError, UnsupportedInputError
from ortlab.onnx.output_names import default_output_names, name_outputs
from ortlab.pipeline.backend import OrtlabBackend
from ortlab.report import Fallback, Report, warn_fallback
from ortlab.runtime.observe import GraphObserver
from ortlab.stages import StageSink

__all__ = ["ORTModule", "configure_torch", "CallWatcher"]

# A tool watching every call of an ORTModule: ``watcher(call, args, kwargs)`` must return
# ``call(args, kwargs)`` (see ``ORTModule.set_call_watcher``).
CallWatcher = Callable[[Callable[[tuple, dict], Any], tuple, dict], Any]

logger = logging.getLogger("ortlab")

_OWN = (
    "_ortlab_module",
    "_ortlab_options",
    "_ortlab_debug",
    "_ortlab_report",
    "_ortlab_compiled",
    "_ortlab_calls",
    "_ortlab_backend",
    "_ortlab_observer",
    "_ortlab_watcher",
    "_ortlab_sinks",
    "_ortlab_kernel_us",
    "_ortlab_device_of",
    "_ortlab_seen",
    "_ortlab_release",
    "_ortlab_fresh",
)
# Note [Process-wide torch settings]
# Dynamo reads these when it compiles, which can happen on any call; patching them
# around every call cost ~28 us a step (a third of a tiny model's step), so ORTModule
# sets them once, process-wide, when the first one is created:
# * recompile limits raised: many ORTModules of one class share Dynamo's per-code cache
#   (each module adds its own budget to the accumulated limit: Note [Each ORTModule's own
#   recompile budget]);
# * fail_on_recompile_limit_hit: past the limit Dynamo raises instead of silently
#   running eager; ORTModule records that as a fallback with its reason;
# * skip_nnmodule_hook_guards off: a hook added after the first call re-captures
#   instead of being ignored (a stale result otherwise);
# * specialize_float: Python floats are constants guarded by value (a changed value
#   re-captures) instead of being turned into tensors mid-trace, which made Dynamo
#   trace and compile the whole model twice (first step 12.5 s -> 7.4 s on the GPT);
# * AOTAutograd's donated buffers off (see _disable_donated_buffers).
# Other torch.compile users in the process see the same settings; all of them trade a
# little speed for never returning a stale result.
_DYNAMO_CONFIG = {
    "recompile_limit": 64,
    "accumulated_recompile_limit": 1024,
    "fail_on_recompile_limit_hit": True,
    "skip_nnmodule_hook_guards": False,
    "specialize_float": True,
}


# Note [Releasing a module's sessions]
# torch keeps every compile backend it was given (torch._dynamo's backend cache, and the
# compiled entries on the wrapped forward's code object), so a discarded ORTModule, or the
# capture a reconfigure() replaces, kept its sessions, models and graphs alive: +1.9 MiB per
# re-created TinyMLP module, and 12 reconfigures took live sessions from 2 to 26. The
# backend releases them (OrtlabBackend.release) when the ORTModule is garbage collected or
# reconfigured, and has Dynamo forget its compiles: their cache entries, guards and the
# backend itself (Note [Forgetting a released module's compiles] in ortlab._compat.torch;
# without it a discarded module still kept ~0.1 MiB: its report, AOTAutograd functions and
# graphs). What torch still holds is one small record per compile. A graph whose sessions
# were released raises a clear error if it is ever called (a backward run after reconfigure()).
# Each ORTModule gets its own Dynamo cache and recompile budget where torch supports it
# (2.12+): otherwise every ORTModule of one class shares the per-code cache, and after
# 64 of them in a process (a notebook cell re-run 64 times) new ones would fall back.
# (COMPILE_ISOLATION in ortlab._compat.torch; Note [Each ORTModule's own recompile budget].)

# Note [Each ORTModule's own recompile budget]
# ``isolate_recompiles`` checks ``recompile_limit`` against the module's own region of a code
# object's cache, but Dynamo checks ``accumulated_recompile_limit`` against every region's
# entries on the code (``total_cache_entries_all_regions``) and against the code's count of
# compiles (``frame_compile_id``), and it never takes an entry out of the list: a released
# module's entries stay counted (as records, Note [Forgetting a released module's compiles]),
# and only ``torch._dynamo.reset_code`` clears them, with every live module's entries on that
# code (and it is not safe from a finalizer, which may run while Dynamo compiles that very
# code). So ORTModules of one class added up, alive together or created one after another
# (hyper-parameter searches, k-fold runs, a re-run notebook cell): the 1,025th raised
# ``FailOnRecompileLimitHit`` (not even a reported fallback). Every ORTModule (and every
# reconfigure, a region of its own) therefore adds its budget, its region's ``recompile_limit``,
# to the accumulated limit: ``_DYNAMO_CONFIG``'s 1024 stays for everything else, the modules'
# entries can never reach it, and each module's limit is its own region's. Other torch.compile
# users in the process see the larger accumulated limit (their ``recompile_limit`` holds). A
# module that reaches its own limit falls back with that reason (``_recompile_limit_hit``), or
# raises a ``FallbackError`` with ``fallback="raise"``. Without regions (torch before 2.12) the
# limits stay as they are.
_LIMIT_HIT = "Dynamo recompile limit exceeded"  # what Dynamo counts as unimplemented when it raises
_BUDGET_LOCK = threading.Lock()
_BUDGETS = [0]  # regions ORTModules were given in this process


def _accumulated_recompile_limit() -> int:
    return _DYNAMO_CONFIG["accumulated_recompile_limit"] + _BUDGETS[0] * COMPILE_ISOLATION.get("recompile_limit", 0)


def _add_recompile_budget() -> None:
    """One more module's budget in Dynamo's accumulated limit (Note [Each ORTModule's own recompile budget])."""
    with _BUDGET_LOCK:
        _BUDGETS[0] += 1
        set_dynamo_config({"accumulated_recompile_limit": _accumulated_recompile_limit()})


def configure_torch() -> None:
    """Apply the process-wide torch settings ORTModule needs (see Note [Process-wide torch settings]).

    Donated buffers are an Inductor memory optimization ortlab does not use; left on,
    ``loss.backward(retain_graph=True)`` followed by another backward raises. AOTAutograd
    reads the flag when the backward *runs*, so a scoped patch cannot reach it. The
    cost falls on torch.compile(inductor) models in the same process: their saved
    tensors are no longer freed early during backward.
    """
    with _BUDGET_LOCK:  # the modules' budgets on top (Note [Each ORTModule's own recompile budget])
        set_dynamo_config({**_DYNAMO_CONFIG, "accumulated_recompile_limit": _accumulated_recompile_limit()})
    ignore_once_only_logging()  # Note [Once-only log calls inside captured code]
    if disable_donated_buffers():
        logger.info("ortlab turned off torch._functorch.config.donated_buffer (see ORTModule docs)")


class _QuietFakeTensorErrors(logging.Filter):
    """Drops the fake-tensor tracebacks torch logs while an ORTModule call traces (see Note [Fake tensor errors]).

    The user gets PyTorch's own error instead (``ORTModule._capture_failed`` reruns the
    call eagerly); calls outside an ORTModule are not touched.
    """

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "depth", 0)


_QUIET = _QuietFakeTensorErrors()
logging.getLogger(FAKE_TENSOR_LOGGER).addFilter(_QUIET)
# The frames an ORTModule call converts skip Dynamo's guard latency probe (Note [Dynamo's guard latency probe]).
skip_guard_latency_probe(lambda: bool(getattr(_QUIET.active, "depth", 0)))


def _nested_tensor_note(module: nn.Module) -> str | None:
    """A report line when eager PyTorch's nested-tensor fast path would give other values in eval."""
    encoders = [n for n, m in module.named_modules() if isinstance(m, nn.TransformerEncoder)
                and getattr(m, "use_nested_tensor", False)]
    if not encoders:
        return None
    return (
        f"nn.TransformerEncoder {encoders[0] or '<root>'} uses nested tensors in eager eval: with a "
        "src_key_padding_mask, eager PyTorch returns 0 at padded positions; through ortlab (as with "
        "torch.compile) they hold computed values, and unpadded positions match. Build it with "
        "enable_nested_tensor=False for identical outputs"
    )


def _check_leaf(leaf: object) -> None:
    if isinstance(leaf, np.ndarray):
        raise UnsupportedInputError(
            "ORTModule got a numpy array; convert it with torch.from_numpy(array) before calling the module."
        )
    if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
        raise UnsupportedInputError(
            f"ORTModule got a {leaf.layout} tensor; onnxruntime needs dense tensors: pass tensor.to_dense()."
        )
    if isinstance(leaf, Iterator):
        raise UnsupportedInputError(
            f"ORTModule got an iterator ({type(leaf).__name__}); pass a list or tuple instead."
        )


def _auto_dynamic_shapes(module: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """``export_onnx``'s ``dynamic_shapes="auto"``: batch (and sequence) dimensions, by parameter name."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"the example inputs do not fit {type(module).__name__}.forward: {e}") from e
    shapes: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(module.forward).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: _auto_dims(v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(_auto_dims(v) for v in value)
        else:
            shapes[name] = _auto_dims(value)
    return shapes or None


def _auto_dims(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    dims = {0: torch.export.Dim.AUTO}
    integer = not (value.is_floating_point() or value.is_complex())
    if value.dim() >= 2 and ((integer and value.dim() == 2) or (not integer and value.dim() == 3)):
        dims[1] = torch.export.Dim.AUTO
    return dims


# Note [The wrapped module's forward signature]
# Libraries read ``inspect.signature(model.forward)`` to decide what to pass: Hugging Face's
# Trainer drops every dataset column the signature does not name, and with ORTModule's
# ``forward(*args, **kwargs)`` it dropped them all ("The batch received was empty").
# ``ORTModule.forward`` is therefore a descriptor: ``model.forward`` is a callable that runs
# the wrapper and whose ``__signature__`` is the wrapped module's. It is made once per
# instance (not per call) and never pickled or copied (a copy makes its own).
class _BoundForward:
    __slots__ = ("__self__",)

    def __init__(self, owner: ORTModule) -> None:
        self.__self__ = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__self__._ortlab_forward(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.__dict__["_ortlab_module"].forward)

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__self__.__dict__["_ortlab_module"].forward.__doc__

    def __repr__(self) -> str:
        return f"<ORTModule.forward of {type(self.__self__.__dict__['_ortlab_module']).__name__}>"


class _ForwardDescriptor:
    """``ORTModule.forward`` (see Note [The wrapped module's forward signature])."""

    def __get__(self, obj: ORTModule | None, objtype: type | None = None) -> Any:
        if obj is None:
            return ORTModule._ortlab_forward
        bound = obj.__dict__.get("_ortlab_bound")
        if bound is None or bound.__self__ is not obj:
            bound = _BoundForward(obj)
            obj.__dict__["_ortlab_bound"] = bound
        return bound


class ORTModule(nn.Module):
    """Wrap ``module`` so its forward and backward run in onnxruntime.

    The training loop, optimizer, scheduler and data loading stay plain PyTorch.

    Args:
        module: the ``torch.nn.Module`` to train.
        debug_options: a ``DebugOptions`` (logging, saving every stage).
        **options: engine options, see ``ortlab.config.Options`` (``recompute``,
            ``fallback``, ``fallback_ops``, ``providers``, ``graph_optimization_level``,
            ``dynamic``, ``intra_op_num_threads``).

    Example:
        >>> model = ORTModule(torch.nn.Linear(4, 2))
        >>> loss = model(torch.randn(3, 4)).sum()
        >>> loss.backward()
        >>> print(model.report)                     # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, debug_options: DebugOptions | None = None, **options: Any) -> None:
        if not isinstance(module, nn.Module):
            raise UnsupportedInputError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, ORTModule):
            raise UnsupportedInputError("this module is already an ORTModule; wrap the original module once.")
        if isinstance(module, nn.DataParallel):
            raise UnsupportedInputError(
                "ORTModule does not wrap nn.DataParallel; wrap the module first, then use DistributedDataParallel."
            )
        super().__init__()
        opts = Options.from_kwargs(options)
        debug = debug_options if debug_options is not None else DebugOptions()
        object.__setattr__(self, "_ortlab_module", module)
        object.__setattr__(self, "_ortlab_fresh", True)  # no capture yet: see _ortlab_call
        object.__setattr__(self, "_ortlab_options", opts)
        object.__setattr__(self, "_ortlab_debug", debug)
        object.__setattr__(self, "_ortlab_observer", None)
        object.__setattr__(self, "_ortlab_watcher", None)
        object.__setattr__(self, "_ortlab_sinks", ())
        object.__setattr__(self, "_ortlab_kernel_us", {})  # FX node -> measured kernel us (note_kernel_times)
        # See Note [Sharing the wrapped module's dicts].
        object.__setattr__(self, "_parameters", module._parameters)
        object.__setattr__(self, "_buffers", module._buffers)
        object.__setattr__(self, "_modules", module._modules)
        object.__setattr__(self, "_non_persistent_buffers_set", module._non_persistent_buffers_set)
        object.__setattr__(self, "training", module.training)
        logging.getLogger("ortlab").setLevel(debug.log_level.to_logging())
        configure_torch()
        self._ortlab_reset()

    # ----------------------------------------------------------------- engine state
    def _ortlab_reset(self) -> None:
        # See Note [Releasing a module's sessions].
        previous = self.__dict__.get("_ortlab_release")
        if previous is not None:
            previous()
        hints = [h for h in (openmp_note(), _nested_tensor_note(self._ortlab_module)) if h]
        report = Report(hints=hints)
        backend = OrtlabBackend(self._ortlab_options, self._ortlab_debug, report, self._ortlab_observer,
                                self._ortlab_sinks)
        backend.kernel_us = self._ortlab_kernel_us  # what profiles measured outlives captures
        _add_recompile_budget()  # see Note [Each ORTModule's own recompile budget]
        compiled = backend.compile(self._ortlab_module, self._ortlab_options.dynamic)
        object.__setattr__(self, "_ortlab_report", report)
        object.__setattr__(self, "_ortlab_backend", backend)
        object.__setattr__(self, "_ortlab_compiled", compiled)
        object.__setattr__(self, "_ortlab_calls", 0)
        object.__setattr__(self, "_ortlab_device_of", None)
        object.__setattr__(self, "_ortlab_seen", (-1, {}, {}, 0, 0))
        object.__setattr__(self, "_ortlab_release", weakref.finalize(self, backend.release))

    def reconfigure(self, **options: Any) -> None:
        """Change engine options (``recompute``, ``fallback_ops``, ``profile``, ...).

        The sessions are dropped and the next call captures again with the new
        options; the report starts afresh. Weights, buffers and optimizer state are
        untouched (they live in the wrapped module).

        Example:
            >>> model.reconfigure(recompute="layerwise", fallback_ops=["aten.gelu"])  # doctest: +SKIP
        """
        object.__setattr__(self, "_ortlab_options", self._ortlab_options.replace(**options))
        self._ortlab_reset()

    def note_kernel_times(self, records: Any) -> int:
        """Remember what this module's onnxruntime kernels took, from a profile's records
        (``ortlab.inspect.profile.NodeTime``: a monitor's profile windows hand theirs over); a
        ``("budget", ...)`` recompute plan then ranks its candidates by these times where it has them,
        FLOPs elsewhere (Note [A memory budget] in ortlab.partition.recompute). Returns how many FX nodes
        have a time. Later profiles replace earlier times of the same node.

        Example:
            >>> om.note_kernel_times(collect_profile(om, skip_runs=1))   # doctest: +SKIP
            42
        """
        forward: dict[str, float] = {}
        backward: dict[str, float] = {}
        for r in records:
            if not r.fx_node or r.count <= 0:
                continue
            us = statistics.median(r.per_run_us) if r.per_run_us else r.dur_us / r.count
            times = forward if r.graph.endswith("forward") else backward
            times[r.fx_node] = times.get(r.fx_node, 0.0) + us  # kernels onnxruntime added beside a node count too
        # a recomputed op runs in the backward as well: its forward time is the one a plan without it knows
        self._ortlab_kernel_us.update({**backward, **forward})
        return len(self._ortlab_kernel_us)

    @property
    def kernel_times(self) -> dict[str, float]:
        """Measured kernel microseconds per run by FX node (:meth:`note_kernel_times`); empty before a profile."""
        return dict(self._ortlab_kernel_us)

    def set_observer(self, observer: GraphObserver | None) -> GraphObserver | None:
        """Report the calls of graphs compiled from now on to ``observer``; returns the previous one.

        For inspection tools (``ortlab.inspect.compare`` records what each graph and
        onnxruntime session receives). Graphs already compiled keep the observer they
        were compiled with (none, usually): set it before the first call, or call
        :meth:`reconfigure` after. ``None`` stops observing new graphs. Graphs compiled
        without an observer carry no hook at all (see Note [Observing compiled graphs]
        in ``ortlab.runtime.observe``).

        Example:
            >>> om = ORTModule(model)                      # doctest: +SKIP
            >>> om.set_observer(recorder)                  # doctest: +SKIP
            >>> om(x).sum().backward()                     # doctest: +SKIP
        """
        previous = self._ortlab_observer
        object.__setattr__(self, "_ortlab_observer", observer)
        self._ortlab_backend.observer = observer
        return previous

    def set_call_watcher(self, watcher: CallWatcher | None) -> CallWatcher | None:
        """Run every call of this module through ``watcher``; returns the previous one.

        For tools that time training steps (``ortlab.monitor``): ``watcher(call, args,
        kwargs)`` must return ``call(args, kwargs)``, and may look at the inputs, the
        clock and the output around it. Without a watcher a call pays one attribute
        read for this hook. Copies and pickles of the module are not watched.

        Example:
            >>> def log(call, args, kwargs):
            ...     out = call(args, kwargs)
            ...     print("step")
            ...     return out
            >>> om.set_call_watcher(log)                   # doctest: +SKIP
        """
        previous = self._ortlab_watcher
        object.__setattr__(self, "_ortlab_watcher", watcher)
        return previous

    def add_stage_sink(self, sink: StageSink) -> None:
        """Hand every stage of graphs captured from now on to ``sink`` (see ``ortlab.stages``).

        Takes effect at the next capture: call :meth:`reconfigure` to capture again now.

        Example:
            >>> om.add_stage_sink(FolderSink("stages", "gpt")); om.reconfigure()   # doctest: +SKIP
        """
        object.__setattr__(self, "_ortlab_sinks", (*self._ortlab_sinks, sink))
        self._ortlab_backend.sinks.append(sink)

    def remove_stage_sink(self, sink: StageSink) -> None:
        """Stop handing stages to ``sink`` (added with :meth:`add_stage_sink`); no-op if it is not there.

        The sinks live as long as the compiled graphs, which torch keeps: a view that
        adds one removes it when it is done, so the module it watches can be freed.

        Example:
            >>> om.remove_stage_sink(sink)          # doctest: +SKIP
        """
        object.__setattr__(self, "_ortlab_sinks", tuple(s for s in self._ortlab_sinks if s is not sink))
        sinks = self._ortlab_backend.sinks
        sinks[:] = [s for s in sinks if s is not sink]

    @property
    def module(self) -> nn.Module:
        """The wrapped module (for saving, or to run it without onnxruntime)."""
        return self._ortlab_module

    @property
    def report(self) -> Report:
        """What the engine captured, compiled, saved and sent back to PyTorch, and why."""
        return self._ortlab_report

    @property
    def options(self) -> Options:
        return self._ortlab_options

    @property
    def debug_options(self) -> DebugOptions:
        return self._ortlab_debug

    # ------------------------------------------------------------ nn.Module plumbing
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_ortlab_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # "__class__" too: FSDP2's fully_shard swaps the class of the module it is given, which
        # is the wrapper; passed on, it swapped the wrapped module's and broke both.
        if name in _OWN or name == "training" or name == "__class__" or not hasattr(self, "_ortlab_module"):
            object.__setattr__(self, name, value)
        elif isinstance(value, (nn.Parameter, nn.Module)) or name in self._buffers:
            super().__setattr__(name, value)  # lands in the shared dicts
        else:
            setattr(self._ortlab_module, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._parameters or name in self._buffers or name in self._modules:
            super().__delattr__(name)
        else:
            delattr(self._ortlab_module, name)

    def train(self, mode: bool = True) -> ORTModule:
        super().train(mode)
        self._ortlab_module.train(mode)
        return self

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_ortlab_report", "_ortlab_compiled", "_ortlab_backend", "_ortlab_release", "_ortlab_bound"):
            state.pop(key, None)
        state["_ortlab_observer"] = None  # tools' hooks, not part of the model
        state["_ortlab_watcher"] = None
        state["_ortlab_sinks"] = ()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_ortlab_observer", None)
        self.__dict__.setdefault("_ortlab_watcher", None)
        self.__dict__.setdefault("_ortlab_sinks", ())
        self.__dict__.setdefault("_ortlab_kernel_us", {})
        self.__dict__["_ortlab_fresh"] = True
        configure_torch()
        self._ortlab_reset()

    def __repr__(self) -> str:
        return f"ORTModule({self._ortlab_module!r})"

    # --------------------------------------------------------------------- forward
    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list] | None:
        """Validate the inputs; returns contiguous replacements when some tensor is not contiguous.

        Note [Non-contiguous inputs]: Dynamo guards on strides, so every new layout of an
        input (a transposed batch, channels-last) captured and exported the model again (7
        captures for 8 layouts). onnxruntime reads dense tensors anyway, so such an input is
        given to the captured graph as a contiguous copy (differentiable, as
        ``contiguous()`` is), and an in-place change the model makes to it is copied back
        to the caller's tensor after the call, so the call behaves as eager's.
        """
        # Fast path, the usual call: plain tensors on the device of the parameter seen last
        # time. It saves ~40 us a call (pytree and parameters()) on a tiny model's step.
        known = self._ortlab_device_of
        if known is not None and not kwargs and known[0]._parameters.get(known[1]) is known[2]:
            device = known[2].device
            for a in args:
                if type(a) is not torch.Tensor or a.device != device or a.layout != torch.strided \
                        or not a.is_contiguous():
                    break
            else:
                return None
        leaves = pytree.tree_leaves((args, kwargs))
        devices = set()
        for leaf in leaves:
            _check_leaf(leaf)
            if isinstance(leaf, torch.Tensor):
                devices.add(leaf.device)
        # (owner, name, parameter): the fast path checks the parameter is still registered,
        # since module.to() may replace parameter objects.
        known = next(
            ((m, n, p) for m in self._ortlab_module.modules() for n, p in m._parameters.items() if p is not None), None
        )
        object.__setattr__(self, "_ortlab_device_of", known)
        if devices and known is not None:
            devices.add(known[2].device)
        if len(devices) > 1:
            names = ", ".join(sorted(map(str, devices)))
            raise DeviceError(
                f"ORTModule got tensors on {names}; inputs and parameters must share one device. "
                "Move them with module.to(device) and tensor.to(device)."
            )
        if all(t.is_contiguous() for t in leaves if isinstance(t, torch.Tensor)):
            return None
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []

        def dense(t: object) -> object:
            if not isinstance(t, torch.Tensor) or t.is_contiguous():
                return t
            copy = t.contiguous()
            copies.append((t, copy, tensor_version(copy)))
            return copy

        args, kwargs = pytree.tree_map(dense, (args, kwargs))
        return args, kwargs, copies

    # Container modules (nn.Sequential, nn.ModuleList) keep indexing and iteration.
    def __len__(self) -> int:
        return len(self._ortlab_module)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self._ortlab_module[index]  # type: ignore[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._ortlab_module)  # type: ignore[call-overload]

    def _ortlab_forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Inside an enclosing ORTModule or torch.compile: be traced as the plain
            # module, so the outer capture sees one graph instead of breaking here.
            return self._ortlab_module(*args, **kwargs)
        watcher = self._ortlab_watcher
        if watcher is not None:
            return watcher(self._ortlab_call, args, kwargs)
        return self._ortlab_call(args, kwargs)

    forward = _ForwardDescriptor()  # type: ignore[assignment]

    def _ortlab_call(self, args: tuple, kwargs: dict) -> Any:
        dense = self._check_inputs(args, kwargs)
        if dense is not None:  # see Note [Non-contiguous inputs]
            args, kwargs, copies = dense
            out = self._ortlab_call(args, kwargs)
            for original, copy, version in copies:
                if tensor_version(copy) != version:
                    with torch.no_grad():
                        original.copy_(copy)
            return out
        first = self._ortlab_calls == 0
        if first and self._ortlab_fresh:  # a new module's first capture (not a reconfigure's: its sizes were this module's)
            object.__setattr__(self, "_ortlab_fresh", False)
            if self._ortlab_options.dynamic is None:
                forget_sizes_seen(self._ortlab_module)  # see Note [A new module's first capture uses its own sizes]
        # Graph breaks and skipped frames happen only when Dynamo converts a frame, which
        # its frame counter tells; the per-call cost is two int reads (see _record_dynamo).
        frames = dynamo_counters["frames"]
        if frames["total"] != self._ortlab_seen[0]:
            self._ortlab_snapshot()
        start = time.perf_counter()
        quiet = _QUIET.active
        quiet.depth = getattr(quiet, "depth", 0) + 1
        try:
            if ddp_active():  # see Note [DDP and Dynamo's DDPOptimizer]
                with without_ddp_optimizer():
                    out = self._ortlab_compiled(*args, **kwargs)
            else:
                out = self._ortlab_compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if isinstance(inner, OrtlabError):
                raise inner from None
            out = self._capture_failed(e, args, kwargs)
        except TorchDynamoException as e:
            out = self._capture_failed(e, args, kwargs)
        except FailOnRecompileLimitHit as e:
            out = self._recompile_limit_hit(e, args, kwargs)
        except Exception as e:
            # Note [An error raised while Dynamo traces]: Dynamo re-raises some errors of its tracing as they are
            # (an IndexError of a fake-tensor kernel: torch.cat of 0-dim tensors, where eager raises RuntimeError),
            # marked with the tracer's output. Nothing ran yet: eager decides, as for any capture failure.
            if not hasattr(e, "_torch_dynamo_tracer_output") or isinstance(e, OrtlabError):
                raise
            out = self._capture_failed(e, args, kwargs)
        finally:
            quiet.depth -= 1
        if frames["total"] != self._ortlab_seen[0]:
            self._record_dynamo()
        object.__setattr__(self, "_ortlab_calls", self._ortlab_calls + 1)
        if first:
            self._ortlab_report.first_call_s = time.perf_counter() - start
            logger.info("%s", self._ortlab_report)
        return out

    def _ortlab_snapshot(self) -> None:
        object.__setattr__(self, "_ortlab_seen", (dynamo_counters["frames"]["total"],
                                                  dict(dynamo_counters["graph_break"]),
                                                  dict(dynamo_counters["unimplemented"]),
                                                  len(guard_failures_of(self._ortlab_module)),
                                                  len(self._ortlab_report.captures)))

    def _record_dynamo(self) -> None:
        """Graph breaks and frames Dynamo skipped (it runs them in PyTorch, silently): fallbacks with reasons."""
        _, breaks_before, skipped_before, failures_before, captures_before = self._ortlab_seen
        self._ortlab_snapshot()
        report = self._ortlab_report
        failures = guard_failures_of(self._ortlab_module)[failures_before:]
        if failures and captures_before:  # see Note [Why a graph was captured again]
            for capture in report.captures[captures_before:]:
                if not capture.purpose:
                    capture.recapture = failures[-1]
        for reason, count in dynamo_counters["graph_break"].items():
            new = count - breaks_before.get(reason, 0)
            if new <= 0:
                continue
            report.graph_breaks[reason] = report.graph_breaks.get(reason, 0) + new
            fb = Fallback(scope="graph_break", where="ORTModule", reason=f"graph break: {reason}")
            report.module_fallbacks.append(fb)
            warn_fallback(fb)
        for reason, count in dynamo_counters["unimplemented"].items():
            if count - skipped_before.get(reason, 0) <= 0:
                continue
            first = reason.strip().splitlines()[0] if reason.strip() else "unsupported code"
            if first.startswith(_LIMIT_HIT):
                continue  # reported once by _recompile_limit_hit, with the limit and its reason
            fb = Fallback(scope="frame", where="ORTModule",
                          reason=f"Dynamo cannot capture this code, so it runs in PyTorch: {first}")
            report.module_fallbacks.append(fb)
            warn_fallback(fb)

    def _capture_failed(self, error: Exception, args: tuple, kwargs: dict) -> Any:
        """Dynamo failed: a user error raises as PyTorch would; a capture failure falls back."""
        # Run the plain module: if PyTorch raises too, the input is wrong, and the user
        # gets PyTorch's own error; the ORTModule stays usable.
        out = self._ortlab_module(*args, **kwargs)
        reason = f"capture failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        if self._ortlab_options.fallback == "raise":
            raise CaptureError(reason + "\nUse fallback='warn' to run such calls in PyTorch.") from error
        fb = Fallback(scope="module", where="ORTModule", reason=reason)
        self._ortlab_report.module_fallbacks.append(fb)
        warn_fallback(fb)
        return out

    def _recompile_limit_hit(self, error: Exception, args: tuple, kwargs: dict) -> Any:
        """Dynamo would capture this module again past its recompile limit: the call runs in PyTorch,
        reported once (see Note [Each ORTModule's own recompile budget])."""
        limit = recompile_limit_hit(error)
        failures = guard_failures_of(self._ortlab_module)
        reached = (f"Dynamo's {limit} for this module was reached ({len(self._ortlab_report.captures)} captures"
                   + (f"; the last guard that failed: {failures[-1][:200]})" if failures else ")"))
        if self._ortlab_options.fallback == "raise":
            raise FallbackError(
                f"{reached}: this call would run in PyTorch.\nA module captured this often usually gets new input "
                "sizes or Python values each call: pass dynamic=True, or use fallback='warn' to run such calls "
                "in PyTorch."
            ) from error
        reason = f"{reached}: calls that no earlier capture's guards accept run in PyTorch"
        out = self._ortlab_module(*args, **kwargs)
        report = self._ortlab_report
        if not any(fb.scope == "module" and fb.reason.startswith(f"Dynamo's {limit} ")
                   for fb in report.module_fallbacks):
            fb = Fallback(scope="module", where="ORTModule", reason=reason)
            report.module_fallbacks.append(fb)
            warn_fallback(fb)
        return out

    # ---------------------------------------------------------------------- export
    def export_onnx(self, path: str, *example_inputs: Any, dynamic_shapes: Any = "auto",
                    kwargs: dict | None = None, **export_kwargs: Any) -> str:
        """Write an eval-mode ONNX model of the wrapped module for plain onnxruntime.

        Uses ``torch.onnx.export(..., dynamo=True)`` on the module in eval mode (dropout
        off, BatchNorm using its running statistics); the training mode is restored after.

        Args:
            path: the ``.onnx`` file to write.
            example_inputs: positional example inputs; ``kwargs``: keyword ones
                (``input_ids=..., attention_mask=...``).
            dynamic_shapes: ``"auto"`` (default): the batch dimension (dim 0) of every tensor
                input is dynamic, and the sequence dimension (dim 1) of token ids and masks
                (integer tensors of rank 2) and of rank-3 float inputs; a dimension the model
                fixes stays fixed (``torch.export.Dim.AUTO``). Use examples with a batch of 2
                or more: torch.export makes size-1 dimensions static. ``None``: every size as in
                the example. Anything else goes to ``torch.onnx.export`` as it is (its
                ``dynamic_shapes``: a dict from ``forward``'s parameter names to
                ``{dim: torch.export.Dim(...)}``).
            export_kwargs: more ``torch.onnx.export`` arguments. ``optimize`` (default True) runs
                ortlab's exact optimizer on the model, not torch.onnx's (Note [Exported models
                optimized exactly]). ``output_names``: one name per output tensor; by default the
                outputs are named after what ``forward`` returns: ``output`` for one tensor,
                ``output_0``, ``output_1``, ... for a tuple, the keys of a dict or ``ModelOutput``
                (``logits``) (``ortlab.onnx.output_names``). The inputs are named after
                ``forward``'s parameters.

        Plain onnxruntime fuses some formulas by their shape alone (a layer norm written out by hand
        with Pow's exponent or an operand order of its own); ortlab's sessions leave those fusions out,
        and so can yours: ``InferenceSession(path, disabled_optimizers=list(ortlab.runtime.fusions.
        left_out(path).left_out))`` (Note [onnxruntime's fusions that change a formula]).

        A Hugging Face model is exported with its key/value cache off (``config.use_cache``
        is False during the export): a cache in the outputs cannot be exported, and a model
        for plain onnxruntime returns the logits.

        Example:
            >>> model.export_onnx("model.onnx", torch.randn(8, 4))   # doctest: +SKIP
        """
        module = self._ortlab_module
        kwargs = dict(kwargs or {})
        # Note [Exported models optimized exactly]
        # torch.onnx's ``optimize=True`` runs onnxscript's optimize_ir, whose rules take constants within
        # 1e-5 of a pattern's number for it: ``x / (|x| + 1e-8)`` lost its ``+ 1e-8`` and gave NaN on a zero row
        # in plain onnxruntime (Note [Pattern constants matched exactly] in ortlab._compat.onnxscript). The
        # model is exported unoptimized and optimized by ortlab's exact rules; torch.onnx's opset-23 fusions
        # (RMSNormalization, which reads Pow's 2 the same way) do not run (the default opset is 18).
        optimize = export_kwargs.pop("optimize", True)
        output_names = export_kwargs.pop("output_names", None)  # named after the export (ortlab.onnx.output_names)
        if isinstance(dynamic_shapes, str):
            if dynamic_shapes != "auto":
                raise ConfigError(f"dynamic_shapes={dynamic_shapes!r}: use 'auto', None or torch.export's form")
            dynamic_shapes = _auto_dynamic_shapes(module, example_inputs, kwargs)
        config = getattr(module, "config", None)
        use_cache = getattr(config, "use_cache", None)
        was_training = module.training
        module.eval()
        try:
            if use_cache:
                config.use_cache = False
            with torch.no_grad():
                program = torch.onnx.export(module, tuple(example_inputs), kwargs=kwargs or None, dynamo=True,
                                            dynamic_shapes=dynamic_shapes, optimize=False, **export_kwargs)
            if optimize:
                from ortlab._compat.onnxscript import optimize as optimize_exactly

                optimize_exactly(program.model)
            if output_names is None:
                output_names = default_output_names(program.exported_program.call_spec.out_spec,
                                                     len(program.model.graph.outputs))
            name_outputs(program.model, output_names)
            program.save(path)
        except ConfigError:
            raise
        except Exception as e:
            raise OrtlabError(f"could not export the module for inference: {e}") from e
        finally:
            module.train(was_training)
            if use_cache:
                config.use_cache = use_cache
        return path
