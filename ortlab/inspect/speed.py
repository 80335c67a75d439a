"""Where a training step is slower through ortlab than in eager PyTorch: per module and line of model code.

``compare`` answers "is it the same number?"; ``compare_speed(model, *inputs)`` answers "where
is it slower, and why?". It runs warm training steps (forward, loss, backward, optimizer
step) in eager PyTorch and through an ``ORTModule`` from the same state, and attributes
each side's time to the nn.Module and the source line that made the work:

* **timed steps** (``steps`` each, eager and ortlab in turns, nothing instrumented) give
  each side's step time, median and spread: the verdict, and every total, comes from them;
* **profiled steps** (``profile_steps`` each) split the step into rows, keyed by
  (module, source line), plus an ``optimizer`` row (``opt.step()``, timed alike on both
  sides) and an ``other`` row: the timed step's median minus the rows' (autograd's glue
  and gradient accumulation, copies, onnxruntime's work between kernels, Python, gaps).

Note [Attributing eager time with Python hooks]
torch.profiler's events name aten ops, not the line of model code that called them
(``with_stack=True`` hangs Python function events over the ops, each named by the
function's first line, not the calling statement), and its backward events are keyed by
autograd sequence numbers only. So the eager side is measured directly, in the profiled
steps only: forward hooks keep the stack of running modules; a ``TorchFunctionMode``
times each outermost torch call (``F.linear``, ``x + y``) and reads the calling line from
the frame (the innermost frame outside torch and ortlab, as in Dynamo's ``stack_trace``,
so the keys meet ortlab's ``ortlab.source``); the autograd nodes
each call created get pre- and post-hooks, so each backward node's time goes to the
module and line of the forward call that made it. Only the forward runs under the mode:
the loss function's work and its backward, like ``opt.step()``, are timed apart or left
to ``other`` on both sides alike. The hooks' own cost falls outside the
timed calls and lands in ``other``, which comes from the timed steps anyway.
On CUDA each timed call synchronizes the device (the call's kernels then count, not their
launch), which serializes the profiled steps; their totals are reported as overhead.

Note [Eager beside onnxruntime]
Both sides run in one process, in turns, so both see the same machine; but eager PyTorch can
run slower once onnxruntime's sessions exist (their memory arenas, thread pools and the
OpenMP settings ortlab makes; measured: a ResNet-18 step 147 ms in a process of its own,
169 ms in turns with ortlab). So eager is also timed before the ORTModule is built; when its
steps beside onnxruntime fall outside that spread, a note gives both and the ratio against
eager before. Ratios to quote come from separate processes (``benchmarks/train_step.py``).

Note [The ortlab side's rows]
Each profiled ortlab step is recorded as a :class:`~ortlab.inspect.timeline.Timeline`
(``TimelineRecorder``: profiling twins of the sessions warm up for a step, then
torch.profiler and onnxruntime's profiler record the next one): onnxruntime kernels go to
the module and source line of the FX node they were exported from (``ortlab.module``,
``ortlab.source``; backward nodes carry their forward node's), ops ortlab placed in
PyTorch to theirs, and what ran in a session between kernels to ``other``.

Example:
    >>> result = compare_speed(model, x, y)                   # doctest: +SKIP
    >>> print(result)                                         # doctest: +SKIP
    >>> result.rows[0].module, result.rows[0].lost_ms         # doctest: +SKIP
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ortlab._compat.torch import pytree
from ortlab.errors import OrtlabError
from ortlab.inspect._keywords import split_keywords
from ortlab.inspect.loss import default_loss
from ortlab.inspect.timing import Timing, compare_timings, overlap
from ortlab.inspect.views import find_view
from ortlab.ortmodule import ORTModule

__all__ = ["SpeedRow", "SpeedComparison", "compare_speed"]

logger = logging.getLogger(__name__)

OPTIMIZER, OTHER = "(optimizer)", "(other)"
OTHER_WHAT = ("autograd's glue and gradient accumulation, copies, onnxruntime between kernels, "
              "Python, gaps: the timed step's median minus the rows'")


@dataclasses.dataclass
class SpeedRow:
    """One row: the time of a module's line of code (or the optimizer, or the rest) on each side.

    Attributes:
        module: the nn.Module path (``blocks.0.attn``; ``""`` the root), or ``(optimizer)`` / ``(other)``.
        source: ``file:line in function`` of the model code, or ``""``.
        eager: seconds per step in eager PyTorch over the profiled steps (median and spread).
        ortlab: seconds per step through ortlab, likewise.
        aten_ops: the torch calls and backward nodes of eager PyTorch behind it, by time.
        kernels: the onnxruntime kernels (``node (OpType)``) and ops placed in PyTorch, by time.
        node: the slowest onnxruntime node's ``{graph, node, fx_node}``, for a link to netron.
    """

    module: str
    source: str
    eager: Timing
    ortlab: Timing
    aten_ops: list[str] = dataclasses.field(default_factory=list)
    kernels: list[str] = dataclasses.field(default_factory=list)
    node: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def eager_ms(self) -> float:
        """Eager PyTorch's median milliseconds a step."""
        return self.eager.median * 1e3

    @property
    def ortlab_ms(self) -> float:
        """ortlab's median milliseconds a step."""
        return self.ortlab.median * 1e3

    @property
    def lost_ms(self) -> float:
        """Milliseconds a step ortlab loses here (negative: gains), by the medians."""
        return self.ortlab_ms - self.eager_ms

    @property
    def ratio(self) -> float:
        """Eager's time over ortlab's: above 1 ortlab is faster here (``inf``: no ortlab time)."""
        if self.ortlab.median <= 0:
            return float("inf") if self.eager.median > 0 else 1.0
        return self.eager.median / self.ortlab.median

    @property
    def within_noise(self) -> bool:
        """Whether the two sides' spreads overlap (their difference is noise)."""
        return overlap(self.eager, self.ortlab)

    @property
    def label(self) -> str:
        where = self.module if self.module.startswith("(") else (self.module or "<root>")
        return f"{where} {_short(self.source)}".strip()


def _short(source: str) -> str:
    """``model.py:45 in forward`` from a full path."""
    if not source:
        return ""
    path, _, rest = source.partition(":")
    return f"{os.path.basename(path)}:{rest}"


@dataclasses.dataclass
class SpeedComparison:
    """What :func:`compare_speed` measured.

    Attributes:
        eager, ortlab: seconds per timed step (median, spread) in eager PyTorch and through ortlab.
        rows: the (module, source line) rows, the optimizer and the rest, most time lost first.
        steps, profile_steps: timed and profiled steps per side.
        profiled: seconds per profiled step on each side (``{"eager": Timing, "ortlab": Timing}``).
        notes: what a reader should know (eager slower beside onnxruntime, fallbacks, clamped remainders).
        eager_alone: seconds per eager step timed before ortlab's sessions existed (Note [Eager beside
            onnxruntime]).
    """

    eager: Timing
    ortlab: Timing
    rows: list[SpeedRow]
    steps: int
    profile_steps: int
    profiled: dict[str, Timing]
    notes: list[str] = dataclasses.field(default_factory=list)
    ortmodule: Any = dataclasses.field(default=None, repr=False)
    eager_alone: Timing | None = None

    @property
    def speedup(self) -> float:
        """Eager's median step over ortlab's: above 1 ortlab is faster."""
        return self.eager.median / self.ortlab.median if self.ortlab.median else float("nan")

    @property
    def verdict(self) -> str:
        """The timed steps compared by the one rule (``ortlab.inspect.timing``): faster, slower or within noise."""
        return compare_timings(self.eager, self.ortlab).replace("step ", "eager ", 1).replace(" -> ", " -> ortlab ", 1)

    @property
    def overhead(self) -> dict[str, float]:
        """How much slower each side's profiled steps ran than its timed ones (0.3: 30%)."""
        return {side: self.profiled[side].median / timed.median - 1
                for side, timed in (("eager", self.eager), ("ortlab", self.ortlab)) if timed.median}

    def modules(self, depth: int | None = None) -> list[SpeedRow]:
        """The rows summed per module (or per module path cut to ``depth`` parts), most time lost first.

        Example:
            >>> result.modules(depth=2)[0].module      # doctest: +SKIP
            'blocks.0'
        """
        groups: dict[str, list[SpeedRow]] = collections.defaultdict(list)
        for row in self.rows:
            name = row.module
            if depth is not None and not name.startswith("("):
                name = ".".join(name.split(".")[:depth])
            groups[name].append(row)
        out = []
        for name, rows in groups.items():
            def summed(side: str, rows: list[SpeedRow] = rows) -> Timing:
                return Timing(tuple(map(sum, zip(*(getattr(r, side).samples for r in rows)))))

            rows = sorted(rows, key=lambda r: -(r.eager_ms + r.ortlab_ms))
            out.append(SpeedRow(name, rows[0].source if len(rows) == 1 else "", summed("eager"), summed("ortlab"),
                                _top(o for r in rows for o in r.aten_ops), _top(k for r in rows for k in r.kernels),
                                next((r.node for r in rows if r.node), {})))
        return _sorted(out)

    def __str__(self) -> str:
        lines = [f"compare_speed: {self.verdict}", self.covers]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"{'lost ms':>8} {'ortlab ms (min-max)':>22} {'eager ms (min-max)':>22} {'ratio':>6}  where")
        for r in self.rows:
            noise = "  (within noise)" if r.within_noise else ""
            lines.append(f"{r.lost_ms:>+8.2f} {_ms(r.ortlab):>22} {_ms(r.eager):>22} {_ratio(r.ratio):>6}  "
                         f"{r.label}{noise}")
        return "\n".join(lines)

    @property
    def covers(self) -> str:
        over = ", ".join(f"{side} {v:+.0%}" for side, v in self.overhead.items())
        return (f"{self.steps} timed steps a side, in turns; rows from {self.profile_steps} profiled steps a side "
                f"(profiling made the steps slower: {over}); ratio: eager time / ortlab time, above 1 ortlab is "
                "faster; within noise: the two spreads overlap")

    def __repr__(self) -> str:
        return (f"SpeedComparison(eager={self.eager}, ortlab={self.ortlab}, speedup={self.speedup:.2f}, "
                f"rows={len(self.rows)})")

    def _repr_html_(self) -> str | None:
        view = find_view("speed_html")
        return view(self) if view is not None else None

    def _ipython_display_(self) -> None:
        view = find_view("speed_display")
        if view is None:
            from IPython.display import display

            display({"text/plain": str(self)}, raw=True)  # ortlab.ui not loaded: the text
            return
        view(self)

    def figure(self) -> Any:
        """A diverging bar chart of the rows' time lost (``ortlab.ui`` draws it)."""
        view = find_view("speed_figure")
        if view is None:
            from ortlab.inspect.views import view as required  # raises, saying what to import

            view = required("speed_figure")
        return view(self)


def _ms(t: Timing) -> str:
    return f"{t.median * 1e3:.2f} ({t.low * 1e3:.2f}-{t.high * 1e3:.2f})"


def _ratio(r: float) -> str:
    return "-" if r == float("inf") else f"{r:.2f}x"


def _top(names: Any, n: int = 6) -> list[str]:
    """The first ``n`` distinct names, in the order given (time-ordered lists, merged)."""
    seen: dict[str, None] = {}
    for name in names:
        seen.setdefault(name)
    return list(seen)[:n]


def _sorted(rows: list[SpeedRow]) -> list[SpeedRow]:
    """Most time lost first."""
    return sorted(rows, key=lambda r: -r.lost_ms)


# ------------------------------------------------------------------------------------------ eager side
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep  # ortlab/inspect: the tools, not a model


def _caller_source() -> str:
    """``file:line in function`` of the innermost frame of model code: frames in torch (``nn.Linear``'s own
    forward too, as Dynamo's ``stack_trace`` leaves them out) and in ortlab.inspect are skipped."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith((_TORCH, _OWN, "<")):
            frame = frame.f_back
            continue
        return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
    return ""


class _EagerProbe(TorchFunctionMode):
    """Times eager PyTorch's work per (module, source line), forward and backward (see the Note)."""

    def __init__(self, model: nn.Module, sync: Callable[[], None]) -> None:
        super().__init__()
        self.sync = sync
        self.stack: list[str] = []
        self.times: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.ops: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        self._keys: dict[int, tuple[str, str]] = {}  # autograd node sequence number -> key
        self._max_seq = -1
        self._started: dict[int, float] = {}
        self._hooks = []
        for name, module in model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def step_times(self) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], dict[str, float]]]:
        """This step's seconds per key and per op within each key; starts the next step's."""
        times, ops = dict(self.times), {k: dict(v) for k, v in self.ops.items()}
        self.times.clear()
        self.ops.clear()
        self._keys.clear()
        self._started.clear()
        return times, ops

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        key = (self.stack[-1] if self.stack else "", _caller_source())
        self.sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        took = time.perf_counter() - start
        self.times[key] += took
        self.ops[key][getattr(func, "__name__", str(func))] += took
        if torch.is_grad_enabled():
            self._hook_new_nodes(out, key)
        return out

    def _hook_new_nodes(self, out: Any, key: tuple[str, str]) -> None:
        """Hook the autograd nodes this call made (sequence numbers above any seen): their backward is ``key``'s."""
        todo = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        top = self._max_seq
        while todo:
            node = todo.pop()
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq <= self._max_seq or seq in self._keys or node.name() == "torch::autograd::AccumulateGrad":
                continue
            self._keys[seq] = key
            top = max(top, seq)
            node.register_prehook(self._before(seq))
            node.register_hook(self._after(seq, node.name()))
            todo.extend(n for n, _ in node.next_functions)
        self._max_seq = top

    def _before(self, seq: int) -> Callable[..., None]:
        def prehook(grad_outputs: Any) -> None:
            self.sync()
            self._started[seq] = time.perf_counter()
        return prehook

    def _after(self, seq: int, name: str) -> Callable[..., None]:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            self.sync()
            start = self._started.pop(seq, None)
            if start is not None:
                took = time.perf_counter() - start
                key = self._keys[seq]
                self.times[key] += took
                self.ops[key][name] += took
        return hook


# ----------------------------------------------------------------------------------------- ortlab side
def _timeline_rows(timeline: Any) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], dict[str, float]],
                                            dict[tuple[str, str], dict[str, str]]]:
    """Seconds per (module, source) of a recorded ortlab step, per kernel within each, and each key's slowest node
    (Note [The ortlab side's rows])."""
    times: dict[tuple[str, str], float] = collections.defaultdict(float)
    ops: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    slowest: dict[tuple[str, str], tuple[float, dict[str, str]]] = {}
    fell_back = sorted((e for e in timeline.of_kind("torch") if "fell_back" in e.args), key=lambda e: e.start_us)
    outer_end = -1.0
    for e in fell_back:  # the outermost ops placed in PyTorch (an op's own calls are inside it)
        if e.start_us < outer_end:
            continue
        outer_end = e.end_us
        key = (e.args.get("module", ""), e.args.get("source", ""))
        times[key] += e.dur_us / 1e6
        ops[key][f"{e.name} (in PyTorch)"] += e.dur_us / 1e6
    for e in timeline.of_kind("kernel"):
        key = (e.args.get("module", ""), e.args.get("source", ""))
        times[key] += e.dur_us / 1e6
        ops[key][f"{e.name} ({e.args.get('op_type', '?')})"] += e.dur_us / 1e6
        if e.dur_us > slowest.get(key, (-1.0, {}))[0]:
            slowest[key] = (e.dur_us, {"graph": e.args.get("graph", ""), "node": e.name,
                                       "fx_node": e.args.get("fx_node", "")})
    return dict(times), {k: dict(v) for k, v in ops.items()}, {k: v for k, (_, v) in slowest.items()}


# ---------------------------------------------------------------------------------------------- steps
class _Side:
    """One contender: a module, its optimizer, and one training step of it."""

    def __init__(self, module: nn.Module, optimizer: Callable[[Any], Any], inputs: tuple, kwargs: dict,
                 loss_fn: Callable[[Any], Any], sync: Callable[[], None]) -> None:
        self.module, self.inputs, self.kwargs, self.loss_fn, self.sync = module, inputs, kwargs, loss_fn, sync
        self.opt = optimizer(module.parameters())
        self.optimizer_s = 0.0

    def step(self, probe: Any = None) -> float:
        """One training step, its forward under ``probe`` if given; returns its seconds (the optimizer's are
        kept in ``optimizer_s``)."""
        self.sync()
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        if probe is not None:
            with probe:
                out = self.module(*self.inputs, **self.kwargs)
        else:
            out = self.module(*self.inputs, **self.kwargs)
        loss = self.loss_fn(out)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        self.sync()
        before = time.perf_counter()
        self.opt.step()
        self.sync()
        end = time.perf_counter()
        self.optimizer_s = end - before
        return end - start


def _sync_for(tensors: list[torch.Tensor]) -> Callable[[], None]:
    if any(t.device.type == "cuda" for t in tensors):
        return torch.cuda.synchronize
    return lambda: None


def _frozen_sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with lr 0: an optimizer step's work, the same weights at every step."""
    return torch.optim.SGD(params, lr=0.0)


def compare_speed(
    model: nn.Module,
    *inputs: Any,
    steps: int = 10,
    profile_steps: int = 5,
    warmup: int = 3,
    optimizer: Callable[[Any], Any] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    forward_kwargs: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    seed: int = 0,
    **keywords: Any,
) -> SpeedComparison:
    """Time training steps in eager PyTorch and through ortlab, and show per module and line where time is lost.

    The model is deep-copied for each side (parameters, buffers and gradients of ``model``
    stay as they are). See the module's docstring for what is timed and how.

    Args:
        model: an ``nn.Module``, or an ``ORTModule`` (then its wrapped module and its options).
        *inputs: positional inputs of the forward.
        steps: timed steps a side (the verdict and the totals), in turns.
        profile_steps: profiled steps a side (the rows).
        warmup: untimed steps a side first (ortlab's first step also captures and compiles).
        optimizer: ``params -> optimizer`` for both sides (default SGD with lr 0: its work, fixed weights).
        loss_fn: output -> scalar loss (default :func:`~ortlab.inspect.loss.default_loss`).
        forward_kwargs: the forward's keyword inputs.
        options: ORTModule options of the ortlab side.
        seed: the random seed both sides start from.
        **keywords: the forward's keyword inputs (``input_ids=ids``) and ORTModule options by name
            (Note [Keyword inputs beside options] in ``ortlab.inspect._keywords``).

    Returns:
        A :class:`SpeedComparison`: ``print`` it, or show it in a notebook (a table and a chart).

    Example:
        >>> result = ortlab.compare_speed(model, x, y)            # doctest: +SKIP
        >>> result.rows[0].module, result.rows[0].lost_ms         # doctest: +SKIP
    """
    if steps < 3 or profile_steps < 1 or warmup < 0:
        raise OrtlabError(f"compare_speed: steps={steps} must be at least 3 (a median and a spread), "
                          f"profile_steps={profile_steps} at least 1, warmup={warmup} not negative.")
    forward_kwargs, options = split_keywords(model, keywords, tool="compare_speed", options=options,
                                             forward_kwargs=forward_kwargs)
    if isinstance(model, ORTModule):
        options = {**model.options.as_dict(), **options}
        model = model.module
    optimizer = optimizer or _frozen_sgd
    loss_fn = loss_fn or default_loss
    tensors = [t for t in pytree.tree_leaves((inputs, forward_kwargs, list(model.parameters())))
               if isinstance(t, torch.Tensor)]
    sync = _sync_for(tensors)
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        eager = _Side(copy.deepcopy(model), optimizer, inputs, forward_kwargs, loss_fn, sync)
        for _ in range(warmup):
            eager.step()
        alone = [eager.step() for _ in range(steps)]  # before any session exists (Note [Eager beside onnxruntime])
        om = ORTModule(copy.deepcopy(model), **options)
        ort = _Side(om, optimizer, inputs, forward_kwargs, loss_fn, sync)
        ort.step()  # captures and compiles
        for _ in range(warmup):
            ort.step()
        timed: dict[str, list[float]] = {"eager": [], "ortlab": []}
        for _ in range(steps):  # in turns: both sides see the same machine
            timed["eager"].append(eager.step())
            timed["ortlab"].append(ort.step())
        eager_rows = _profile_eager(eager, profile_steps, sync)
        ort_rows = _profile_ortlab(ort, profile_steps)
    notes = _fallback_notes(om)
    result = _combine(timed, eager_rows, ort_rows, steps, profile_steps, notes)
    result.ortmodule = om
    result.eager_alone = Timing(tuple(alone))
    if not overlap(result.eager_alone, result.eager):
        change = result.eager.median / result.eager_alone.median - 1
        result.notes.insert(0, (
            f"eager PyTorch ran {abs(change):.0%} {'slower' if change > 0 else 'faster'} beside onnxruntime's sessions "
            f"than before they existed ({result.eager_alone} before, {result.eager} beside): the verdict compares the "
            f"steps as they ran, in turns; against eager before, ortlab is {result.eager_alone.median / result.ortlab.median:.2f}x."
            " Quote speed ratios from separate processes (benchmarks/train_step.py)"))
    return result


@dataclasses.dataclass
class _Profiled:
    """One side's profiled steps: per step, seconds per key and per op; the optimizer's and the step's seconds."""

    times: list[dict[tuple[str, str], float]] = dataclasses.field(default_factory=list)
    ops: list[dict[tuple[str, str], dict[str, float]]] = dataclasses.field(default_factory=list)
    optimizer: list[float] = dataclasses.field(default_factory=list)
    step: list[float] = dataclasses.field(default_factory=list)
    nodes: dict[tuple[str, str], dict[str, str]] = dataclasses.field(default_factory=dict)


def _profile_eager(side: _Side, n: int, sync: Callable[[], None]) -> _Profiled:
    probe = _EagerProbe(side.module, sync)
    out = _Profiled()
    try:
        for _ in range(n):
            took = side.step(probe)
            times, ops = probe.step_times()
            out.times.append(times)
            out.ops.append(ops)
            out.optimizer.append(side.optimizer_s)
            out.step.append(took)
    finally:
        probe.remove()
    return out


def _profile_ortlab(side: _Side, n: int) -> _Profiled:
    from ortlab.inspect.timeline_record import TimelineRecorder

    out = _Profiled()
    recorder = TimelineRecorder(side.module, warmup=1)
    count = 0  # steps run
    for _ in range(n):
        recorder.arm(count)
        for _tries in range(12):  # a warm-up step, the recorded one; more while parts race their providers
            timeline = recorder.boundary(count)
            if timeline is not None:
                break
            side.step()
            count += 1
        else:
            recorder.finish()
            raise OrtlabError(f"compare_speed: could not record an ortlab step ({recorder.waiting or 'no reason'})")
        times, ops, nodes = _timeline_rows(timeline)
        out.times.append(times)
        out.ops.append(ops)
        out.optimizer.append(side.optimizer_s)  # of the step just recorded
        out.step.append(timeline.end_us / 1e6)
        for key, node in nodes.items():
            out.nodes.setdefault(key, node)
    return out


def _fallback_notes(om: ORTModule) -> list[str]:
    report = om.report
    notes = []
    if not report.captures or any(f.scope == "module" for f in report.module_fallbacks):
        notes.append("the ortlab side did not run through onnxruntime: "
                     + "; ".join(map(str, report.module_fallbacks)))
    ops = collections.Counter(f"{fb.op or fb.scope}: {fb.reason}" for fb in report.fallbacks if fb.scope != "module")
    notes.extend(f"ran in PyTorch: {count}x {what}" for what, count in ops.items())
    return notes


def _combine(timed: dict[str, list[float]], eager: _Profiled, ort: _Profiled, steps: int, profile_steps: int,
             notes: list[str]) -> SpeedComparison:
    keys = {k for t in eager.times + ort.times for k in t}
    # Rows join on (module, line) exactly; a line only one side names (Dynamo and the frames can disagree on an
    # inlined helper) stays a row of its own, and modules() sums both sides per module.
    rows = []

    def samples(p: _Profiled, key: tuple[str, str]) -> Timing:
        return Timing(tuple(t.get(key, 0.0) for t in p.times))

    def ops_of(p: _Profiled, key: tuple[str, str]) -> list[str]:
        total: dict[str, float] = collections.defaultdict(float)
        for o in p.ops:
            for name, s in o.get(key, {}).items():
                total[name] += s
        return [name for name, _ in sorted(total.items(), key=lambda kv: -kv[1])][:6]

    for key in keys:
        rows.append(SpeedRow(key[0], key[1], samples(eager, key), samples(ort, key), ops_of(eager, key),
                             ops_of(ort, key), ort.nodes.get(key, {})))
    rows.append(SpeedRow(OPTIMIZER, "", Timing(tuple(eager.optimizer)), Timing(tuple(ort.optimizer)),
                         ["opt.step()"], ["opt.step()"]))
    eager_t = Timing(tuple(timed["eager"]))
    ort_t = Timing(tuple(timed["ortlab"]))
    others = []
    for side, t, p in (("eager", eager_t, eager), ("ortlab", ort_t, ort)):
        attributed = [sum(step.values()) + opt for step, opt in zip(p.times, p.optimizer)]
        left = [s - statistics.median(attributed) for s in t.samples]
        if statistics.median(left) < 0:
            notes.append(f"{side}: the rows add up to more than the timed step ({statistics.median(attributed) * 1e3:.2f}"
                         f" against {t.median * 1e3:.2f} ms; profiling slowed the work itself): 'other' shows 0")
            left = [max(v, 0.0) for v in left]
        others.append(Timing(tuple(left)))
    rows.append(SpeedRow(OTHER, "", others[0], others[1], [OTHER_WHAT], [OTHER_WHAT]))
    rows = [r for r in rows if r.eager_ms > 0 or r.ortlab_ms > 0 or r.module.startswith("(")]
    profiled = {"eager": Timing(tuple(eager.step)), "ortlab": Timing(tuple(ort.step))}
    return SpeedComparison(eager_t, ort_t, _sorted(rows), steps, profile_steps, profiled, notes)
