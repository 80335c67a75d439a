"""The one place ortlab builds onnxruntime sessions, and decides how each runs.

Every ``InferenceSession`` of ortlab comes from :func:`build_session`: the sessions of
the graphs it trains, those loaded from the on-disk cache, profiling twins, the models
saved at each optimization level, the probes that ask onnxruntime for a kernel, and the
inspection tools' sessions. It takes the model, the options, the graph's device and a
pinned provider list (or none), and returns a :class:`BuiltSession`: the session, what
it was built from (so a tool can build another like it, :meth:`SessionSource.rebuild`)
and the decisions it made (providers, threads) with their reasons.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence

import onnxruntime as ort

from ortlab.config import DebugOptions, Options
from ortlab.errors import DeviceError, SessionError, first_line
from ortlab.runtime.fusions import FusionChoice, left_out
from ortlab.runtime.providers import bf16_provider, cpu_candidates, is_plugin, plugin, plugin_options, prepare_model

__all__ = [
    "SMALL_GRAPH_FLOPS",
    "ProviderChoice",
    "ThreadChoice",
    "SessionSource",
    "BuiltSession",
    "choose_providers",
    "available_cores",
    "choose_threads",
    "build_session",
    "optimized_model",
    "shared_cpu_arena",
    "PROFILE_PREFIX",
    "unique_profile_prefix",
]

logger = logging.getLogger(__name__)

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

# Below this many FLOPs a graph runs faster on one thread: waking onnxruntime's
# pool costs more than it saves (tiny MLP: 52 -> 37 us per run, measured).
SMALL_GRAPH_FLOPS = 10_000_000


@dataclasses.dataclass(frozen=True)
class ProviderChoice:
    """The execution providers a session runs on, in order of precedence, and why.

    ``candidates``: other provider lists to measure against on the first calls (the
    fastest that agrees is kept; see ``ortlab.runtime.race``).
    """

    providers: tuple[str, ...]
    reason: str
    candidates: tuple[tuple[str, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """onnxruntime's intra-op threads for a session (``None``: its default), and why."""

    threads: int | None
    reason: str


def choose_providers(device_type: str, options: Options, bf16: bool = False) -> ProviderChoice:
    """Execution providers for a graph whose tensors live on ``device_type`` (``bf16``: it computes
    in bfloat16, see Note [bfloat16 graphs on the CPU]).

    Raises:
        DeviceError: for CUDA tensors without onnxruntime-gpu, or another device type.
    """
    if options.providers is not None:
        for name in options.providers:
            if is_plugin(name):
                plugin(name)  # raises DeviceError saying why it cannot run here
        return ProviderChoice(tuple(options.providers), "pinned by the providers option")
    if device_type == "cpu":
        names, notes = cpu_candidates()
        reason = "the graph's tensors are on the CPU" + "".join(f"; not {name}: {note}" for name, note in notes.items())
        others = tuple((name,) for name in names if name != "CPUExecutionProvider")
        fast_bf16 = bf16_provider() if bf16 else None
        if fast_bf16 is not None:
            # Note [bfloat16 graphs on the CPU]
            reason = (f"the graph computes in bfloat16 and {fast_bf16} has bfloat16 kernels on this CPU "
                      "(onnxruntime's CPU provider lacks bfloat16 MatMul and Gemm); measured against "
                      "CPUExecutionProvider on the first calls")
            return ProviderChoice((fast_bf16,), reason, (("CPUExecutionProvider",),)
                                  + tuple(o for o in others if o[0] != fast_bf16))
        if others:
            reason += f"; measured against {', '.join(o[0] for o in others)} on the first calls"
        return ProviderChoice(("CPUExecutionProvider",), reason, others)
    if device_type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DeviceError(
                "inputs are on CUDA but this onnxruntime has no CUDAExecutionProvider; "
                "install the GPU build (pip install 'ortlab[gpu]') or move the model and inputs to CPU."
            )
        return ProviderChoice(("CUDAExecutionProvider", "CPUExecutionProvider"),
                              "the graph's tensors are on CUDA (the CPU provider takes what CUDA lacks)")
    raise DeviceError(f"device type {device_type!r} is not supported; use cpu or cuda tensors.")


def choose_threads(options: Options, flops: int) -> ThreadChoice:
    """Intra-op threads for a graph of ``flops`` FLOPs (``ortlab.sizes.work_flops``), and why."""
    if options.intra_op_num_threads is not None:
        n = options.intra_op_num_threads
        return ThreadChoice(n, f"{n} (intra_op_num_threads option)")
    if flops < SMALL_GRAPH_FLOPS:
        return ThreadChoice(1, f"1 (small graph: {flops:,} FLOPs < {SMALL_GRAPH_FLOPS:,}; "
                               "a thread pool costs more than it saves)")
    # Note [PyTorch's thread budget]
    # onnxruntime sizes its pool by the cores and ignores OMP_NUM_THREADS and torch.set_num_threads.
    # Where PyTorch was given fewer threads than there are cores (torchrun sets OMP_NUM_THREADS=1
    # for each of its processes; a user leaves cores to the data loader), the sessions keep to the
    # same budget: two DDP ranks on 2 cores each ran 2-thread sessions, 4 threads on 2 cores.
    # (ortlab.ondevice trains without torch: no PyTorch, no budget of its own to keep to.)
    torch = sys.modules.get("torch")
    budget, cores = (torch.get_num_threads() if torch is not None else None), available_cores()
    if budget is not None and budget < cores:
        return ThreadChoice(budget, f"{budget}, as PyTorch's (torch.get_num_threads(), {cores} cores here: "
                                    "OMP_NUM_THREADS or torch.set_num_threads lowered it)")
    return ThreadChoice(None, "onnxruntime's default (one per core)")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Note [bfloat16 graphs on the CPU]
# Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the captured graph computes its
# matmuls in bfloat16. onnxruntime's CPU provider has no bfloat16 MatMul or Gemm, so with it
# first those nodes run in PyTorch (``kernel`` placements) and the graph is cut around
# each. OpenVINO's CPU plugin has bfloat16 kernels where the CPU has AMX or AVX-512-bf16
# (its device lists BF16 among OPTIMIZATION_CAPABILITIES): such a graph is built on it
# first, whole, and the CPU provider is measured against it on the first calls like any
# candidate (it fails to build where it lacks a kernel, and is dropped saying so). Its
# f32 precision hint stays: the f32 ops autocast keeps in f32 (softmax, layer norm, the
# loss) must stay f32, and a bfloat16 MatMul runs in bfloat16 with it (the same values as
# PyTorch's, seen on a Xeon with AMX).

# Note [One CPU arena for all sessions]
# Each InferenceSession owns a CPU arena by default, which grows to that session's peak
# and never gives memory back. A training step runs the forward session, then the
# backward session: with one arena each, the process holds both peaks. One arena
# registered on onnxruntime's environment and shared by every ortlab session lets the
# backward reuse what the forward freed: peak RSS of 50 GPT steps fell from 1.46x to
# 1.29x eager's (benchmarks/memory_and_startup.py --only rss), at the same step time.
# Doubling growth (kNextPowerOfTwo) fragments less here than kSameAsRequested (1.42x).
_SHARED_ARENA: list[bool] = []


def shared_cpu_arena() -> bool:
    """Register (once per process) the CPU arena ortlab's sessions share; False if onnxruntime refused."""
    if not _SHARED_ARENA:
        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 0}))
            _SHARED_ARENA.append(True)
        except Exception as e:  # already registered by the host application, or an old onnxruntime
            logger.info("ortlab: sessions keep their own CPU arenas (%s)", first_line(e))
            _SHARED_ARENA.append(False)
    return _SHARED_ARENA[0]


# Note [No constants of a vocabulary's size]
# onnxruntime's constant folding turned every ``zeros`` of a static shape into an initializer: the
# zeros an embedding's gradient is scattered into (``[vocab, d]``) and those of a dense loss
# gradient (``[rows, vocab]``). A GPT-2-small-sized model's backward session held a 154 MB
# constant, its optimized model was written (and cached, and read back on every cached start)
# with it, and each run copied it out again before the scatter, where a ConstantOfShape fills the
# scatter's own buffer. Folding is capped at 1 MiB of output (onnxruntime's
# ``optimization.constant_folding_max_output_size_in_bytes``; older versions ignore the entry):
# smaller constants (shapes, masks, index tables) still fold. On that model with 4 layers
# (benchmarks/fold_limit.py, fresh processes in turns): peak RSS 2171-2173 -> 1846-1854 MB, the cache
# entry 156 -> 2 MB, the first step 7.2-8.8 s against 7.2-10.0 s; forward and backward 1.017x side
# by side. A vocabulary of 50257 at d=64 and 1024 rows with label sparsity off: the cache entry
# 219 -> 0.4 MB, peak RSS 1525 -> 1307 MB (0.994x side by side with a 16 MiB cap, which still
# folded the embedding's 13 MB).
_FOLD_LIMIT_BYTES = 1 << 20


def _session_options(
    level: str, log_severity: int, threads: int | None, optimized_path: str | None, profile_prefix: str | None
) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = _LEVELS[level]
    so.log_severity_level = log_severity
    if threads is not None:
        so.intra_op_num_threads = threads
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if optimized_path is not None:
        so.optimized_model_filepath = optimized_path
    if shared_cpu_arena():
        so.add_session_config_entry("session.use_env_allocators", "1")
    # Note [onnxruntime's threads spin within a run only]
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    # Note [No constants of a vocabulary's size]
    so.add_session_config_entry("optimization.constant_folding_max_output_size_in_bytes", str(_FOLD_LIMIT_BYTES))
    # Note [A training step's memory in onnxruntime]
    so.enable_mem_pattern = False
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return so


# Note [onnxruntime's threads spin within a run only]
# onnxruntime's idle pool threads spin by default, and went on spinning after a run, on the
# cores PyTorch needed for the ops between sessions (the optimizer, fallback ops, the data
# loader): the GPT's step 0.79x, the MLP's 0.81x (benchmarks/threads.py, "spin"). Turning
# spinning off (``allow_spinning=0``, ortlab's setting until 2026-11-28) parks them instead,
# and every parallel op of a run then waits for them to wake: a training graph's hundreds of
# short elementwise ops and reductions. ``force_spinning_stop`` stops the spinning when a run
# returns (onnxruntime's key for "low CPU usage between infrequent requests"): threads spin
# between the ops of a run and burn nothing after it (a session's 0.2 s idle after its runs: 0.04 CPU
# seconds with spinning, 0.000 with the stop). The GPT's step 1.037-1.08x, ResNet-18's 1.020-1.025x,
# the MLP's 1.011-1.015x against ``allow_spinning=0`` (``python benchmarks/threads.py gpt 30 --variants no-spin``).


# Note [A training step's memory in onnxruntime]
# Two session options decide how much memory a step holds at its peak, and neither changed
# the step time (A/B in one process, GPT 0.998x, MLP 1.011x, tiny MLP 0.994x, ResNet-18 0.998x):
# * No memory pattern. With it, each run takes one block sized for the whole plan of the
#   graph's intermediates; the backward's block did not fit where the forward's had been
#   freed in the shared arena (Note [One CPU arena for all sessions]), so the arena grew by it.
#   Allocating each value from the arena as it is made reuses the forward's freed space.
#   (The old ORTModule turned it off for training too.)
# * Nodes in priority order. onnxruntime's default order is a depth-first sort from the
#   outputs, which computes values long before they are used and keeps them alive meanwhile;
#   the priority-based sort (every node at the same priority) keeps the exported graph's
#   order, which is PyTorch's autograd order: each gradient is consumed soon after it is made,
#   as in eager. (MEMORY_EFFICIENT needs the training build's annotations: 791 MiB.)
# Peak RSS of 50 GPT steps (benchmarks/memory_and_startup.py --only rss; eager 518 MiB):
# 677 MiB with both defaults, 640 without the pattern, 617 with both changes (1.19x eager).


@dataclasses.dataclass(frozen=True)
class SessionSource:
    """What a session was built from: enough for :func:`build_session` to build another like it.

    Attributes:
        model: the serialized model the session loaded (the bytes object the session
            already holds, not a copy), or the path it was loaded from.
        level: the optimization level it was built at.
        providers: its execution providers, in order of precedence.
        threads: its intra-op threads (``None``: onnxruntime's default).
        log_severity: onnxruntime's log severity.
        cache_dir: the ``cache_dir`` option: a plugin provider that compiles (OpenVINO) keeps
            its compiled models in a folder inside it (Note [OpenVINO's compiled-model cache]).
        fusions: the onnxruntime optimizations the model goes without, and why (Note
            [onnxruntime's fusions that change a formula] in ``ortlab.runtime.fusions``).
    """

    model: bytes | str = dataclasses.field(repr=False)
    level: str
    providers: tuple[str, ...]
    threads: int | None
    log_severity: int
    cache_dir: str | None = None
    fusions: FusionChoice = FusionChoice()

    def rebuild(self, *, profile_prefix: str | None = None, quiet: bool = False) -> BuiltSession:
        """Another session of the same model and settings (a profiling twin with ``profile_prefix``).

        The new session does not write an optimized model (or a cache entry) again. With
        ``quiet`` onnxruntime logs nothing while building it: for candidates whose failure
        the caller records (the provider race), so a notebook shows no C++ error blocks.
        """
        source = dataclasses.replace(self, log_severity=4) if quiet else self
        return _build(source, None, profile_prefix)


@dataclasses.dataclass
class BuiltSession:
    """A session and the decisions behind it.

    Attributes:
        session: the ``InferenceSession``.
        source: what it was built from (:meth:`SessionSource.rebuild`).
        providers: the providers chosen, and why.
        threads: the threads chosen, and why.
        seconds: how long building it took.
    """

    session: ort.InferenceSession
    source: SessionSource
    providers: ProviderChoice
    threads: ThreadChoice
    seconds: float


def build_session(
    model: bytes | str,
    options: Options,
    debug: DebugOptions | None = None,
    *,
    device_type: str = "cpu",
    providers: Sequence[str] | None = None,
    threads: ThreadChoice | None = None,
    level: str | None = None,
    optimized_path: str | None = None,
    profile_prefix: str | None = None,
    quiet: bool = False,
) -> BuiltSession:
    """Build the session a model runs in: the one builder of ortlab.

    Args:
        model: serialized ONNX, or the path of an ``.onnx`` file.
        options: the engine options (providers, optimization level, threads, profiling).
        debug: the log level for onnxruntime (default: warnings).
        device_type: where the graph's tensors live (``cpu``/``cuda``): picks the providers.
        providers: pin these providers instead of choosing (probes and tools).
        threads: the intra-op thread choice (default: from ``options`` only).
        level: optimization level instead of ``options.graph_optimization_level``.
        optimized_path: where onnxruntime writes the model it optimized.
        profile_prefix: profile this session into a file with this prefix.
        quiet: onnxruntime logs nothing (for sessions expected to fail, such as probes).

    Raises:
        SessionError: with onnxruntime's message.
        DeviceError: when no provider serves ``device_type``.

    Example:
        >>> built = build_session(model_bytes, Options())      # doctest: +SKIP
        >>> built.providers.providers, built.providers.reason  # doctest: +SKIP
        (('CPUExecutionProvider',), "the graph's tensors are on the CPU")
    """
    choice = (ProviderChoice(tuple(providers), "pinned by the caller") if providers is not None
              else choose_providers(device_type, options))
    threads = threads or choose_threads(options, SMALL_GRAPH_FLOPS)
    if options.profile and profile_prefix is None:
        profile_prefix = unique_profile_prefix()
    severity = 4 if quiet else (debug or DebugOptions()).log_level.to_ort_severity()
    level = level or options.graph_optimization_level
    # Note [onnxruntime's fusions that change a formula]; at level "disable" onnxruntime runs none
    fusions = left_out(model) if level != "disable" else FusionChoice()
    source = SessionSource(model, level, choice.providers, threads.threads, severity, options.cache_dir, fusions)
    built = _build(source, optimized_path, profile_prefix)
    return dataclasses.replace(built, providers=choice, threads=threads)


def _build(source: SessionSource, optimized_path: str | None, profile_prefix: str | None) -> BuiltSession:
    start = time.perf_counter()
    so = _session_options(source.level, source.log_severity, source.threads, optimized_path, profile_prefix)
    try:
        if source.providers and is_plugin(source.providers[0]):
            # A plugin provider takes its devices; onnxruntime adds the CPU provider after it.
            ep = plugin(source.providers[0])
            so.add_provider_for_devices(list(ep.devices), plugin_options(ep, source.cache_dir))
            # The plugin's own model (Note [Wide MatMuls for OpenVINO]); the source names what the session holds.
            source = dataclasses.replace(source, model=prepare_model(source.providers[0], source.model))
            session = ort.InferenceSession(source.model, sess_options=so,
                                           disabled_optimizers=list(source.fusions.left_out))
        else:
            missing = [p for p in source.providers if p not in ort.get_available_providers()]
            if missing:
                raise SessionError(f"onnxruntime has no {', '.join(missing)} here (available: "
                                   f"{', '.join(ort.get_available_providers())})")
            if source.providers and source.providers[0] == "CUDAExecutionProvider":
                source = dataclasses.replace(source, model=prepare_model(source.providers[0], source.model))
            session = ort.InferenceSession(source.model, sess_options=so,
                                           providers=[_with_options(p) for p in source.providers],
                                           disabled_optimizers=list(source.fusions.left_out))
        if source.providers and source.providers[0] not in session.get_providers():
            # onnxruntime falls back to the CPU provider for an unknown one, printing to stdout only.
            raise SessionError(f"onnxruntime has no {source.providers[0]} here (it would have run on "
                               f"{', '.join(session.get_providers())}; available: "
                               f"{', '.join(ort.get_available_providers())})")
    except (DeviceError, SessionError):
        raise
    except Exception as e:  # onnxruntime raises its own pybind exception types
        raise SessionError(f"onnxruntime could not create a session: {e}") from e
    return BuiltSession(session, source, ProviderChoice(source.providers, "as its source"),
                        ThreadChoice(source.threads, "as its source"), time.perf_counter() - start)


def _with_options(provider: str) -> str | tuple[str, dict[str, str]]:
    """A provider as onnxruntime takes it: CUDA's with its stream and TF32 setting
    (Note [onnxruntime's CUDA stream and PyTorch's] in ``ortlab.runtime.cuda``)."""
    if provider != "CUDAExecutionProvider":
        return provider
    from ortlab.runtime.cuda import provider_options  # imports torch: the CUDA path has it

    return provider, provider_options()


def optimized_model(model: bytes, options: Options, debug: DebugOptions | None, level: str,
                    providers: Sequence[str]) -> tuple[bytes, float]:
    """The model as onnxruntime optimizes it at ``level``, and the seconds the session took.

    onnxruntime writes an optimized model only to a file; this one is read back and removed.

    Raises:
        SessionError: when onnxruntime cannot build a session at that level.
    """
    fd, path = tempfile.mkstemp(suffix=".onnx", prefix=f"ortlab_{level}_")
    os.close(fd)
    try:
        built = build_session(model, options.replace(profile=False), debug, providers=providers, level=level,
                              optimized_path=path)
        with open(path, "rb") as f:
            return f.read(), built.seconds
    finally:
        os.remove(path)


# Note [Unique profile prefixes]
# onnxruntime names a profile ``{prefix}_{date}_{time}_{ms}.json`` when the session
# starts profiling. Sessions (and profiling twins) are built less than a millisecond
# apart: with one prefix, two of them wrote the same file (seen while building the
# profile window). So every profiled session gets a prefix no other session of the
# process uses: the process id, a counter and the graph's label
# (``ortlab_profile_4242_7_g0.backward``).
PROFILE_PREFIX = "ortlab_profile"
_COUNTER = itertools.count()
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def unique_profile_prefix(label: str = "", folder: str | None = None) -> str:
    """A profile file prefix no other call in this process returns (see Note [Unique profile prefixes]).

    Args:
        label: the graph the session runs (``g0.forward``); other characters than
            letters, digits, ``_``, ``.`` and ``-`` become ``_``.
        folder: where the profile goes; the temp dir by default.

    Example:
        >>> os.path.basename(unique_profile_prefix("g0.forward")).startswith(f"ortlab_profile_{os.getpid()}_")
        True
    """
    name = f"{PROFILE_PREFIX}_{os.getpid()}_{next(_COUNTER)}"
    safe = _UNSAFE.sub("_", label).strip("_")
    if safe:
        name += f"_{safe}"
    return os.path.join(folder or tempfile.gettempdir(), name)
