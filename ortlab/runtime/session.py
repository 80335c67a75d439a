"""onnxruntime sessions: options, providers and the optimized models they run."""

from __future__ import annotations

import logging
import os
import re
import time

import onnxruntime as ort

from ortlab.config import DebugOptions, Options
from ortlab.errors import DeviceError, SessionError, first_line

__all__ = ["choose_threads", "providers_for", "session_options", "create_session", "save_optimized_models", "failing_node"]

logger = logging.getLogger(__name__)

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def providers_for(device_type: str, options: Options) -> list[str]:
    """Execution providers for a graph whose tensors live on ``device_type``."""
    if options.providers is not None:
        return list(options.providers)
    if device_type == "cpu":
        return ["CPUExecutionProvider"]
    if device_type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DeviceError(
                "inputs are on CUDA but this onnxruntime has no CUDAExecutionProvider; "
                "install the GPU build (pip install 'ortlab[gpu]') or move the model and inputs to CPU."
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise DeviceError(f"device type {device_type!r} is not supported; use cpu or cuda tensors.")


# Below this many FLOPs a graph runs faster on one thread: waking onnxruntime's
# pool costs more than it saves (tiny MLP: 52 -> 37 us per run, measured).
SMALL_GRAPH_FLOPS = 10_000_000


def choose_threads(options: Options, flops: int) -> tuple[int | None, str]:
    """Intra-op threads for a graph of ``flops`` matmul FLOPs, and why."""
    if options.intra_op_num_threads is not None:
        return options.intra_op_num_threads, f"{options.intra_op_num_threads} (intra_op_num_threads option)"
    if flops < SMALL_GRAPH_FLOPS:
        return 1, f"1 (small graph: {flops:,} matmul FLOPs < {SMALL_GRAPH_FLOPS:,}; a thread pool costs more than it saves)"
    return None, "onnxruntime's default (one per core)"


def session_options(
    options: Options,
    debug: DebugOptions,
    *,
    level: str | None = None,
    optimized_path: str | None = None,
    threads: int | None = None,
) -> ort.SessionOptions:
    """SessionOptions for a training graph."""
    so = ort.SessionOptions()
    so.graph_optimization_level = _LEVELS[level or options.graph_optimization_level]
    so.log_severity_level = debug.log_level.to_ort_severity()
    if threads is not None:
        so.intra_op_num_threads = threads
    if options.profile:
        so.enable_profiling = True
        # One prefix per session: onnxruntime names the file by start time only, so two
        # sessions starting in the same millisecond would otherwise write the same file.
        from ortlab.runtime.profiling import profile_prefix  # profiling imports the runner

        so.profile_file_prefix = profile_prefix()
    if optimized_path is not None:
        so.optimized_model_filepath = optimized_path
    if shared_cpu_arena():
        so.add_session_config_entry("session.use_env_allocators", "1")
    # onnxruntime's idle threads spin by default, burning the cores PyTorch needs for
    # the ops between sessions (fallback ops, the optimizer, the data loader).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


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


def create_session(
    model_bytes: bytes,
    options: Options,
    debug: DebugOptions,
    providers: list[str],
    optimized_path: str | None = None,
    threads: int | None = None,
    level: str | None = None,
) -> tuple[ort.InferenceSession, float]:
    """Build the session a graph runs in; returns it with the seconds it took.

    Raises:
        SessionError: with onnxruntime's message (see :func:`failing_node`).
    """
    start = time.perf_counter()
    so = session_options(options, debug, optimized_path=optimized_path, threads=threads, level=level)
    try:
        session = ort.InferenceSession(model_bytes, sess_options=so, providers=providers)
    except Exception as e:  # onnxruntime raises its own pybind exception types
        raise SessionError(f"onnxruntime could not create a session: {e}") from e
    return session, time.perf_counter() - start


def save_optimized_models(model_bytes: bytes, options: Options, debug: DebugOptions, providers: list[str], stem: str) -> list[str]:
    """Save the model as onnxruntime optimizes it at each level: ``{stem}`` with the level inserted."""
    written = []
    for level in ("basic", "extended", "all"):
        path = stem.format(stage=f"ort_{level}")
        so = session_options(options, debug, level=level, optimized_path=path)
        try:
            ort.InferenceSession(model_bytes, sess_options=so, providers=providers)
            written.append(path)
        except Exception as e:  # a level may fail where the chosen one works; say so, keep going
            logger.warning("could not save the onnxruntime-optimized model at level %s: %s", level, e)
    return [p for p in written if os.path.exists(p)]


_NODE_IN_ERROR = re.compile(r"node with name '([^']+)'|[Nn]ode \(([^)]+)\)")


def failing_node(message: str) -> str | None:
    """The ONNX node name an onnxruntime error message points at, if any."""
    m = _NODE_IN_ERROR.search(message)
    if not m:
        return None
    name = next((g for g in m.groups() if g), None)
    # onnxruntime's optimizers rename fused nodes: "node_addmm/GemmTransposeFusion/".
    return name.split("/")[0] if name else None
