"""Measure execution providers on a graph part's real inputs and keep the fastest that agrees.

Which provider is fastest depends on the graph and the machine (OpenVINO's fused kernels
win on transformer backwards on the Xeons we measured; small graphs pay its dispatch), so
ortlab does not guess: the session built with the first provider runs the first call as
usual, then each other candidate is built from the same model (``SessionSource``) and run
once on the same inputs. A candidate that fails to build, fails to run, or whose outputs
differ beyond the parity tolerance (rtol 1e-4, atol 1e-5; integers and booleans exactly) is
dropped with its reason. The part's next calls run on the candidates kept and the first
session in turn, timed (Note [The race times the next calls' own runs]); the one with the
lowest median time is swapped into the runner for every later call. The decision and the
times go to the report.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ortlab._workers import worker
from ortlab.errors import first_line
from ortlab.runtime.providers import is_plugin
from ortlab.runtime.session import SessionSource

if TYPE_CHECKING:
    from ortlab.runtime.runner import OrtRunner

__all__ = ["RaceResult", "make_race", "prebuild", "under_way", "REPEATS", "RTOL", "ATOL"]

REPEATS = 3
LONG_RUN_S = 0.25
RTOL, ATOL = 1e-4, 1e-5
# A bfloat16 or float16 output is compared at its own precision (torch.testing's defaults for
# the dtype): one rounding step of bfloat16 is 2**-8 relative, far above RTOL.
LOW_PRECISION_TOLERANCE = {torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


@dataclasses.dataclass
class RaceResult:
    """What a race measured: median milliseconds per provider list, and why others were dropped."""

    chosen: tuple[str, ...]
    times_ms: dict[str, float]
    dropped: dict[str, str]
    seconds: float = 0.0  # what the race spent beyond the calls' own runs (waiting for builds, the check runs)
    runs: int = 1  # timed runs of the most-measured candidate (Note [The race times the next calls' own runs])
    calls: tuple[int, int] = (0, 0)  # the part's calls whose runs were timed, first and last
    followed: str = ""  # the part whose race decided this one (Note [Parts that are the same graph])
    checked: bool = False  # a followed winner other than the first-built session agreed with its outputs
    shared: bool = False  # ... and it runs the followed part's session (Note [Parts that are the same graph])
    # candidates that differed from the first session beyond the tolerance, kept because they are no
    # further from float64 than it: name -> the figures (Note [Float64 decides a disagreement])
    judged: dict[str, str] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        if self.followed:
            how = (f"outputs checked on this part's call {max(self.calls[0], 1)}" if self.checked
                   else "the session it was built with")
            if self.shared:
                how += f", running {self.followed}'s session"
            text = f"{'+'.join(self.chosen)} as measured on {self.followed}, the same graph ({how}; {self.seconds:.2f} s)"
            for name, why in self.dropped.items():
                text += f"; {name} dropped: {why}"
            return text
        if not self.times_ms:  # every candidate dropped on the first call: nothing was timed
            text = (f"{'+'.join(self.chosen)} kept, every other candidate dropped (the runs beyond the call's own "
                    f"took {self.seconds:.2f} s)")
        else:
            times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.times_ms.items())
            how = "median of %d timed runs" % self.runs if self.runs > 1 else "one timed run each"
            first, last = self.calls
            if first and first != last:
                how += f", on the part's calls {first}-{last}"
            elif first:
                how += f", on the part's call {first}"
            text = (f"{'+'.join(self.chosen)} measured fastest ({times}; {how}; the runs beyond the calls' own "
                    f"took {self.seconds:.2f} s)")
        for name, why in self.judged.items():
            text += f"; {name} kept: {why}"
        for name, why in self.dropped.items():
            text += f"; {name} dropped: {why}"
        return text


def _name(source: SessionSource | None, taken: dict[str, float]) -> str:
    name = source.providers[0] if source is not None and source.providers else "default"
    if name in taken and source is not None:  # the same provider with other settings
        name += f" ({source.threads or 'default'} threads)"
    return name


def _timed_run(runner: OrtRunner, args: Sequence[object]) -> tuple[float, list]:
    """One run of the runner's current session: its seconds and its outputs."""
    start = time.perf_counter()
    outputs = runner.run(args)
    return time.perf_counter() - start, outputs


def _time_once(runner: OrtRunner, args: Sequence[object]) -> float:
    return _timed_run(runner, args)[0]


# Note [The race times the next calls' own runs]
# The first call checks; the next calls time. On a part's first call the first-built session
# runs the call (its outputs are the call's), and each candidate runs once on the same inputs:
# a warm-up (a session's first run allocates, and OpenVINO finishes compiling) whose outputs
# are compared with the first session's, the candidate dropped with its reason if they
# disagree. The timing then rides on the part's next calls, one entrant per call, taking
# turns (candidates first, then the first session: A B A B, so a busy moment of the machine
# hits both), each run's outputs being that call's own: measuring costs no run beyond the
# warm-ups. Timed this way each run is the training loop's own, in the loop's conditions:
# the earlier race timed extra runs on the first call while the call's own outputs (the
# activations the backward needs) were held, and the first session's runs there grew the
# arena for another set of outputs and paid page faults (the GPT's forward: 76-85 ms against
# 57 ms steady; its untimed run 20-47% slower than its timed one, even for runs of seconds),
# and it cost five runs a graph: 55 s of the GPT-2-small-sized model's first step. After one
# timed run each, only the entrants within CLOSE of the fastest run again, up to REPEATS
# times each, and the lowest median wins; a run over LONG_RUN_S is not repeated (its noise is
# small against its length). A call whose inputs have other shapes than the first call's
# times every entrant on its own inputs at once (times of other inputs do not compare), and
# decides. Until the race is decided the report names the first-built session.
CLOSE = 1.15
# A part that follows an earlier part's race waits this many of its calls for it to decide, then races
# on its own (Note [Parts that are the same graph]).
PENDING_CALLS = 8

# Note [The race's memory goes back after it]
# Every warm-up run allocates a full set of outputs while the part's own first outputs (the
# activations the backward needs) are still held, and each candidate runs its own working
# memory; onnxruntime's CPU arena (shared by every session, Note [One CPU arena for all
# sessions]) keeps every region it grew. After a race the part's next run asks onnxruntime
# to give the regions that are wholly free back (``memory.enable_memory_arena_shrinkage``),
# once, and glibc to hand back the pages its free lists hold (the export's garbage, the
# losing sessions; ``give_back_freed_heap`` in ortlab.runtime.runner). A candidate's warm-up
# outputs are compared and dropped before the next candidate runs, so it reuses their memory
# instead of growing the arena by another set. The GPT on the Xeon, 50 steps, when the race
# still timed its runs on the first call: steady RSS 1185 -> 754 MiB (arena shrink 947,
# warm-up outputs dropped 876, heap trimmed 754), peak 1185 -> 1103 MiB; the step time is
# unchanged (120 ms).


# Note [Parts that are the same graph]
# A graph split at ops that run in PyTorch repeats its parts once per layer: BERT-base's
# forward, split at its 37 dropouts, was 51 parts, of which 48 are four graphs twelve times
# over, and racing each one took 13.7 s of its first step (its dropouts' masks are now drawn
# ahead of the graph, Note [Random draws ahead of the graph], but any op in PyTorch in
# every layer, an untranslatable one or a random op beside the dropouts, splits the same way).
# A part whose graph is the same as an earlier part's (op for op, shapes, dtypes and
# constants, names aside: the caller's key) takes that race's winner: its first call runs on the first-built session as usual, then
# once on the winner's session, whose outputs must agree like any candidate's; a winner that
# disagrees sends the part to a race of its own. The report says which part it followed.
# The model of such a part is the earlier part's but for its names, so where the earlier
# part's winning session is at hand, the follower runs that very session (its inputs and
# outputs matched by position, ``OrtRunner.share_session``) instead of building its own: on
# BERT's forward, 44 followers no longer compile a model of their own in OpenVINO (0.15-0.3 s
# each, and the memory of each compiled copy), and no candidate is built for a part that will
# follow (``prebuild`` is not called for it). Its own session (the first-built provider) stays
# its own; tools that build a session like the runner's (profiling twins) build from the
# part's own model (``session_source``), so their kernels carry this part's names.
Follow = Callable[[], "tuple[tuple[str, ...], str, object | None] | None"]


@dataclasses.dataclass
class _Entrant:
    name: str
    session: object  # onnxruntime.InferenceSession
    source: SessionSource | None
    times: list[float]


def _again(entrants: list[_Entrant]) -> list[_Entrant]:
    """The entrants to time once more (Note [The race times the next calls' own runs]): those within CLOSE of
    the fastest median, while that is under LONG_RUN_S and one of them has fewer than REPEATS runs; none once
    the race can be called."""
    if len(entrants) < 2:
        return []
    medians = [statistics.median(e.times) for e in entrants]
    fastest = min(medians)
    close = [e for e, m in zip(entrants, medians) if m <= fastest * CLOSE]
    if len(close) < 2 or fastest >= LONG_RUN_S or min(len(e.times) for e in close) >= REPEATS:
        return []
    return close


def _settle(runner: OrtRunner, args: Sequence[object], entrants: list[_Entrant]) -> None:
    """More timed runs on one call's inputs, taking turns, for the entrants too close to the fastest to call."""
    while again := _again(entrants):
        for e in again:
            runner.swap_session(e.session)
            e.times.append(_time_once(runner, args))


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """``torch.allclose(a, b, rtol, atol, equal_nan=True)``, in a few passes where it holds.

    allclose builds every intermediate of ``isclose`` (NaN and infinity masks included): 92 ms
    for a 2M-element float32 tensor, 0.18 s of the GPT's first step for its two races. For
    float32 and float64, the largest ``|a - b| - rtol * |b|`` says the same in three passes
    (5 ms); a NaN or an infinity anywhere makes it NaN, and allclose decides as before.
    """
    if a.dtype not in (torch.float32, torch.float64) or a.numel() == 0:
        return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    excess = torch.sub(a, b).abs_().sub_(b.abs().mul_(rtol)).max()
    return bool(excess <= atol) or torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


def _differs(i: int, a: object, b: object) -> str:
    """Why output ``i`` (``b``) disagrees with the first session's (``a``); "" when it agrees."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is {b.dtype}{tuple(b.shape)}, expected {a.dtype}{tuple(a.shape)}"
        if a.is_floating_point():
            rtol, atol = LOW_PRECISION_TOLERANCE.get(a.dtype, (RTOL, ATOL))
            if not _close(a, b, rtol, atol):
                diff = (a.float() - b.float()).abs().nan_to_num(0).max().item()
                return f"output {i} differs by up to {diff:.3g} (tolerance rtol {rtol}, atol {atol})"
        elif not torch.equal(a, b):
            return f"output {i} differs (exact match required for {a.dtype})"
    elif a != b:
        return f"output {i} is {b!r}, expected {a!r}"
    return ""


def _disagreement(reference: list, outputs: list) -> str:
    return next((why for i, (a, b) in enumerate(zip(reference, outputs)) if (why := _differs(i, a, b))), "")


# Note [Float64 decides a disagreement]
# A candidate is compared with the first-built session, both in float32. Where a graph sums
# long products, two correct kernels (MLAS's convolution, oneDNN's in OpenVINO) round
# differently: ResNet-18's forward on OpenVINO differed from the CPU provider's by 2.3e-5 at
# an output of small magnitude, past atol 1e-5, and was dropped unmeasured, though both are
# float32 roundings of one value (their largest errors beyond rtol against float64: 3.2e-5
# and 1.4e-5; eager PyTorch's own convolution gradients there are 3.5e-3 from float64,
# ortlab's 3.4e-3). Which of two float32 answers is right is a question for float64: when a
# candidate's outputs disagree (and only then), the part's FX graph runs once in PyTorch in
# float64 (float32 inputs, constants and dtype arguments widened), and the candidate is kept
# if, for every float output that disagrees, its largest error beyond rtol * |truth| is
# within twice the first session's plus atol, counted in the output's largest magnitude where that is
# above 1 (as ``benchmarks/hf_architectures.py`` judges float32 conditioning: an element near zero
# that sums products of the output's scale carries rounding errors of that scale, which rtol * |truth|
# does not cover). ResNet-18's
# last convolution output ([16, 512, 2, 2], values up to 3.07) on OpenVINO was 2.37e-5 from float64
# beyond rtol, the CPU provider 6.83e-6: dropped by 0.2% of a fixed atol (2.366e-5 allowed) on one
# batch and kept on another, and the forward ran 1.5x slower on the CPU provider. Eager PyTorch's
# own answer there is 5.8e-6 from float64, and 5.7e-5 without oneDNN (PyTorch's plain convolution):
# such spreads are float32's, not a wrong kernel's. Integer and boolean outputs must still be equal, and a graph
# that cannot run in float64 (or whose inputs and outputs in float64 would not fit in half of
# the memory free) leaves the candidate dropped as before. The report names every
# candidate kept this way with both errors. (ResNet-18's forward, measured then: OpenVINO
# 235 ms against the CPU provider's 66 ms, so the decision is now made on time; since its max
# pool's indices are computed for OpenVINO, Note [Max pools' indices for OpenVINO], 95-105 ms
# against 124-158 ms on the 2-core Xeon without AMX.)
Judge = Callable[[Sequence[object], Sequence[object]], "list | None"]


def _excess(values: torch.Tensor, truth: torch.Tensor, rtol: float) -> float:
    """The largest ``|values - truth| - rtol * |truth|``, in float64 (inf where a NaN disagrees)."""
    v, t = values.double(), truth.double()
    both_nan = v.isnan() & t.isnan()
    err = (v - t).abs().sub_(t.abs().mul_(rtol)).masked_fill_(both_nan, 0.0)
    if err.numel() == 0:
        return 0.0
    return float(err.nan_to_num(nan=float("inf"), posinf=float("inf")).max())


def _scale(truth: torch.Tensor) -> float:
    """The output's largest magnitude, or 1 below it: what atol is counted in (Note [Float64 decides a
    disagreement])."""
    if truth.numel() == 0:
        return 1.0
    largest = float(truth.abs().max())
    return largest if math.isfinite(largest) and largest > 1.0 else 1.0


def _judged(reference: list, outputs: list, truth: list) -> tuple[bool, str]:
    """Whether ``outputs`` is no further from the float64 ``truth`` than ``reference`` allows, and the
    figures that say so (Note [Float64 decides a disagreement]). Only float32 and float64 values that
    differ beyond the tolerance are judged; any other disagreement stands."""
    if len(truth) != len(reference):
        return False, "float64 could not judge it (the graph did not run in float64 here)"
    ours_worst = theirs_worst = 0.0
    for i, (a, b, t) in enumerate(zip(reference, outputs, truth)):
        if not _differs(i, a, b):
            continue
        if not isinstance(a, torch.Tensor) or a.dtype not in (torch.float32, torch.float64) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return False, ""  # a shape, a type, an integer or a low-precision value: no float64 question
        if not isinstance(t, torch.Tensor) or t.shape != a.shape:
            return False, "float64 could not judge it (the graph did not run in float64 here)"
        ours, theirs = _excess(b, t, RTOL), _excess(a, t, RTOL)
        atol = ATOL * _scale(t)
        allowed = 2 * max(theirs, 0.0) + atol if math.isfinite(theirs) else atol  # never "as bad as an inf"
        if ours > allowed:
            return False, (f"further from float64 than the first session (largest error beyond rtol {ours:.3g}, "
                           f"the first session's {theirs:.3g})")
        ours_worst, theirs_worst = max(ours_worst, ours), max(theirs_worst, theirs)
    return True, (f"no further from float64 than the first session (largest error beyond rtol {ours_worst:.3g}, "
                  f"the first session's {theirs_worst:.3g})")


def _free_bytes(device: torch.device) -> float:
    """Memory free on ``device`` now (inf where it cannot be read)."""
    try:
        if device.type == "cuda":
            return float(torch.cuda.mem_get_info(device)[0])
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError, RuntimeError):  # not Linux; no CUDA
        return float("inf")


def _widen_dtype(value: object) -> object:
    """A float32 dtype argument as float64; anything else as it is."""
    return torch.float64 if value is torch.float32 else value


def _widen(value: object) -> object:
    """A float32 tensor or dtype argument in float64; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.double()
    return _widen_dtype(value)


class _Float64(torch.fx.Interpreter):
    """Runs an FX graph with its float32 constants and dtype arguments widened to float64."""

    def get_attr(self, target, args, kwargs):  # noqa: ANN001, ANN201
        return _widen(super().get_attr(target, args, kwargs))

    def call_function(self, target, args, kwargs):  # noqa: ANN001, ANN201
        return super().call_function(target, tuple(map(_widen_dtype, args)),
                                     {k: _widen_dtype(v) for k, v in kwargs.items()})

    def call_method(self, target, args, kwargs):  # noqa: ANN001, ANN201
        return super().call_method(target, tuple(map(_widen_dtype, args)),
                                   {k: _widen_dtype(v) for k, v in kwargs.items()})


def float64_judge(gm: torch.fx.GraphModule) -> Judge:
    """Runs ``gm`` in float64 on a part's inputs (Note [Float64 decides a disagreement]); None when it cannot."""

    def judge(args: Sequence[object], reference: Sequence[object] = ()) -> list | None:
        # Its inputs and outputs in float64, all alive at the end, must fit in half of the memory free now.
        tensors = [t for t in (*args, *reference) if isinstance(t, torch.Tensor)]
        need = sum(t.numel() * (8 if t.is_floating_point() else t.element_size()) for t in tensors)
        device = next((t.device for t in tensors), torch.device("cpu"))
        if need > _free_bytes(device) / 2:
            return None
        try:
            with torch.no_grad():
                out = _Float64(gm).run(*[_widen(a) for a in args])
        except Exception:  # noqa: BLE001 - a graph that cannot run in float64 leaves the candidate dropped
            return None
        return list(out) if isinstance(out, (tuple, list)) else [out]

    return judge


# Note [Candidates build while the graph is still being compiled]
# Building a candidate's session is most of what a race costs on top of the runs (OpenVINO
# compiles: 0.18 s for the GPT's forward, 0.29 s for its backward), and onnxruntime lets go
# of the GIL while it builds. So a part's candidates start building on a worker thread as
# soon as the part's own session exists, while Dynamo and AOTAutograd finish and the first
# call runs. A part whose candidates are still building when it is called runs on its own
# session and checks them on a later call (the GPT's backward had waited 0.6 s of its first
# step for OpenVINO's compile); every timed run waits for all builds in flight (its own and
# other parts'), so no build shares the cores with a run being timed. A build that fails is
# recorded as before. Measured on the GPT's first step: the two races 1.55 -> 1.3 s.
_BUILDER_LOCK = threading.Lock()
_BUILDING: set[concurrent.futures.Future] = set()  # every module's builds in flight: a race waits for all
_BUILDING_PID = [os.getpid()]


def prebuild(candidates: Sequence[SessionSource]) -> list[concurrent.futures.Future]:
    """Start building each candidate's session on ortlab's builder thread (see the Note above)."""
    builder = worker("race-build")  # a forked child gets its own (ortlab._workers)
    with _BUILDER_LOCK:
        if _BUILDING and _BUILDING_PID[0] != os.getpid():  # a parent's builds never finish here
            _BUILDING.clear()
        _BUILDING_PID[0] = os.getpid()
        # quiet: a failure is recorded by the race, not printed by onnxruntime
        futures = [builder.submit(source.rebuild, quiet=True) for source in candidates]
        _BUILDING.update(futures)
    for future in futures:
        future.add_done_callback(_done)
    return futures


def _done(future: concurrent.futures.Future) -> None:
    with _BUILDER_LOCK:
        _BUILDING.discard(future)


def _wait_for_builds() -> None:
    """Until no candidate session is being built anywhere in the process (none may share the cores with a
    timed run)."""
    with _BUILDER_LOCK:
        pending = list(_BUILDING)
    concurrent.futures.wait(pending)


def _has_empty(args: Sequence[object]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args)


def _follow(runner: OrtRunner, args: Sequence[object], reference: list, candidates: Sequence[SessionSource],
            prebuilt: Sequence[concurrent.futures.Future] | None, chosen: tuple[str, ...], where: str,
            shared: object | None, start: float, call: int = 1) -> RaceResult | None:
    """Take the providers ``chosen`` by the race of ``where`` (Note [Parts that are the same graph]), running
    ``shared`` (that part's session, when given) or a session of this part's own; None when that provider
    cannot run this part or disagrees with ``reference``."""
    first = runner.session_source
    result = RaceResult(chosen, {}, {}, followed=where)
    if first is not None and first.providers == chosen:
        result.seconds = time.perf_counter() - start
        return result
    index = next((i for i, c in enumerate(candidates) if c.providers == chosen), None)
    if index is None or first is None or (is_plugin(chosen[0]) and _has_empty(args)):
        return None  # Note [OpenVINO and tensors with no elements]: the race of its own drops the plugin
    own = runner.session
    try:
        if shared is not None:
            runner.share_session(shared)
        else:
            built = prebuilt[index].result() if prebuilt else candidates[index].rebuild(quiet=True)
            runner.swap_session(built.session)
    except Exception:  # noqa: BLE001 - the race of its own says why
        return None
    try:
        why = _disagreement(reference, runner.run(args))
    except Exception:  # noqa: BLE001 - the race of its own says why
        why = "failed to run"
    if why:
        runner.swap_session(own)
        return None
    runner.session_source = (candidates[index] if shared is not None
                             else dataclasses.replace(candidates[index], model=built.source.model))
    runner.shrink_arena_on_next_run()
    result.checked, result.shared, result.calls = True, shared is not None, (call, call)
    result.seconds = time.perf_counter() - start
    return result


def _shapes(args: Sequence[object]) -> tuple:
    """What a run's time depends on in its inputs: each tensor's shape and dtype (scalars by type)."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args)


class _Timing:
    """A race's timed runs, one per call from the part's second call on (Note [The race times the next
    calls' own runs]): the entrants take turns, each run's outputs are that call's."""

    def __init__(self, entrants: list[_Entrant], result: RaceResult, shapes: tuple,
                 on_result: Callable[[RaceResult], None], start_call: int,
                 on_spent: Callable[[float], None]) -> None:
        self.entrants, self.result, self.shapes, self.on_result = entrants, result, shapes, on_result
        self.on_spent = on_spent
        self.turns = [*entrants[1:], entrants[0]]  # the candidates first, as their warm-ups ran last
        self.call = start_call  # the part's calls so far
        self.first_timed = 0

    def __call__(self, runner: OrtRunner, args: Sequence[object]) -> list:
        self.call += 1
        _wait_for_builds()  # no build shares the cores with a timed run
        if _shapes(args) != self.shapes:
            # Times of other inputs are not comparable: this call times every entrant on its own inputs.
            return self._all_on(runner, args)
        entrant = self.turns.pop(0)
        runner.swap_session(entrant.session)
        try:
            seconds, outputs = _timed_run(runner, args)
            entrant.times.append(seconds)
        except Exception as e:  # noqa: BLE001 - a candidate failing now is dropped, said why; the first raises
            if entrant is self.entrants[0]:
                raise
            self.result.dropped[entrant.name] = f"failed to run on the part's call {self.call}: {first_line(e, 200)}"
            self.entrants.remove(entrant)
            self.turns = [t for t in self.turns if t is not entrant]
            runner.swap_session(self.entrants[0].session)
            outputs = runner.run(args)
        self.first_timed = self.first_timed or self.call
        if not self.turns:
            self.turns = self._next_round()
        if self.turns:
            runner.race = self
        else:
            self._decide(runner)
        return outputs

    def _next_round(self) -> list[_Entrant]:
        """The entrants to time once more, in turn, candidates first as in the first round; none once the race
        is decided."""
        again = _again(self.entrants)
        return [e for e in [*self.entrants[1:], self.entrants[0]] if e in again]

    def _all_on(self, runner: OrtRunner, args: Sequence[object]) -> list:
        """Every entrant timed on this call's inputs (their earlier times, on other inputs, forgotten); the
        first entrant's outputs are returned, as on the first call."""
        for e in self.entrants:
            e.times = []
        runner.swap_session(self.entrants[0].session)
        outputs = runner.run(args)  # the call's own run; it grows the memory for a new size, untimed
        start = time.perf_counter()
        for e in self.entrants[1:]:
            runner.swap_session(e.session)
            try:
                e.times.append(_time_once(runner, args))
            except Exception as exc:  # noqa: BLE001
                self.result.dropped[e.name] = f"failed to run on the part's call {self.call}: {first_line(exc, 200)}"
        self.entrants = [e for e in self.entrants if e is self.entrants[0] or e.times]
        runner.swap_session(self.entrants[0].session)
        self.entrants[0].times.append(_time_once(runner, args))
        _settle(runner, args, self.entrants)
        spent = time.perf_counter() - start  # runs beyond the call's own
        self.result.seconds += spent
        self.on_spent(spent)
        self.first_timed = self.call
        self._decide(runner)
        return outputs

    def _decide(self, runner: OrtRunner) -> None:
        result = self.result
        for e in self.entrants:
            result.times_ms[e.name] = statistics.median(e.times) * 1e3
        best = min(self.entrants, key=lambda e: statistics.median(e.times))
        runner.swap_session(best.session)
        runner.session_source = best.source
        result.chosen = best.source.providers if best.source is not None else ()
        result.runs = max(len(e.times) for e in self.entrants)
        result.calls = (self.first_timed, self.call)
        runner.shrink_arena_on_next_run()  # Note [The race's memory goes back after it]
        self.entrants = []  # the losers' sessions go with the race
        self.on_result(result)


def under_way(runner: object) -> bool:
    """Whether a race has begun on ``runner`` and not decided yet: its next calls check or time candidates
    in place of its session (tools that swap a session of their own in, profiling twins, wait for it)."""
    race = getattr(runner, "race", None)
    return isinstance(race, _Timing) or getattr(race, "begun", False)


def make_race(candidates: Sequence[SessionSource], on_result: Callable[[RaceResult], None],
              prebuilt: Sequence[concurrent.futures.Future] | None = None, follow: Follow | None = None,
              judge: Judge | None = None, pending: Callable[[], bool] | None = None,
              on_spent: Callable[[float], None] = lambda seconds: None,
              ) -> Callable[[OrtRunner, Sequence[object]], list]:
    """The first-call hook for an ``OrtRunner`` (``runner.race``) measuring ``candidates`` against its session;
    ``prebuilt`` holds their sessions being built already (``prebuild``), in the same order. ``follow``
    names the winner of an earlier race on the same graph, if any (Note [Parts that are the same graph]);
    while ``pending`` says that race is still timing, the part waits for it on its own session. ``judge``
    gives the float64 outputs that decide a disagreement (Note [Float64 decides a disagreement]).
    ``on_result`` is called once the race is decided (Note [The race times the next calls' own runs]);
    ``on_spent`` with the seconds of each call's runs beyond its own (the checks), when they are spent."""
    calls = [0]

    def race(runner: OrtRunner, args: Sequence[object]) -> list:
        calls[0] += 1
        race.begun = True  # type: ignore[attr-defined]  # under_way() while it waits to check
        first = runner.session_source
        reference = runner.run(args)  # the call's own run, and the first session's warm-up
        start = time.perf_counter()  # what the race spends beyond the call's own run
        earlier = follow() if follow is not None else None
        if earlier is not None:
            followed = _follow(runner, args, reference, candidates, prebuilt, *earlier, start=start, call=calls[0])
            if followed is not None:
                on_spent(followed.seconds)
                on_result(followed)
                return reference
        elif pending is not None and pending() and calls[0] < PENDING_CALLS:
            runner.race = race  # Note [Parts that are the same graph]: the earlier part's race decides soon
            return reference
        if prebuilt and not all(f.done() for f in prebuilt) and calls[0] < PENDING_CALLS:
            # Note [Candidates build while the graph is still being compiled]: still building; the check
            # waits for a later call instead of holding this one up.
            runner.race = race
            return reference
        result = RaceResult(first.providers if first is not None else (), {}, {})
        entrants = [_Entrant(_name(first, {}), runner.session, first, [])]
        empty = _has_empty(args)
        truth: list | None = None  # the float64 outputs, once a candidate disagrees
        for i, source in enumerate(candidates):
            name = _name(source, {e.name: 0.0 for e in entrants})
            if empty and source.providers and is_plugin(source.providers[0]):
                # Note [OpenVINO and tensors with no elements] in ortlab.pipeline.part
                result.dropped[name] = ("not measured: an input has no elements, on which it would crash the "
                                        "process")
                continue
            try:
                # quiet: a failure is recorded below, not printed by onnxruntime
                built = prebuilt[i].result() if prebuilt else source.rebuild(quiet=True)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot build is dropped, said why
                result.dropped[name] = f"could not build a session: {first_line(e, 200)}"
                continue
            runner.swap_session(built.session)
            try:
                # The warm-up: its outputs are checked and let go.
                outputs = runner.run(args)
                why = _disagreement(reference, outputs)
                if why and judge is not None:
                    if truth is None:
                        truth = judge(args, reference) or []
                    kept, figures = _judged(reference, outputs, truth)
                    if kept:
                        result.judged[name], why = f"{why}, but {figures}", ""
                    elif figures:
                        why = f"{why}, and {figures}"
                del outputs
            except Exception as e:  # noqa: BLE001
                result.dropped[name] = f"failed to run: {first_line(e, 200)}"
                continue
            finally:
                runner.swap_session(entrants[0].session)
            if why:
                result.dropped[name] = why
                continue
            # The source with the model the session holds (a plugin's: its prepared one), as the report shows it
            entrants.append(_Entrant(name, built.session, dataclasses.replace(source, model=built.source.model), []))
        result.seconds = time.perf_counter() - start
        on_spent(result.seconds)
        if len(entrants) == 1:  # nothing left to time against the first session
            result.runs = 0
            runner.shrink_arena_on_next_run()
            on_result(result)
            return reference
        runner.race = _Timing(entrants, result, _shapes(args), on_result, calls[0], on_spent)
        return reference

    return race
