"""The torch.compile backend: Dynamo graph -> AOTAutograd -> forward/backward compilers.

Dynamo gives us, for free and correct: guards (a new input structure, a changed
Python scalar, a changed module attribute, train/eval or grad-mode switches all
re-capture instead of returning a stale result), graph breaks (the code between
captured graphs runs in PyTorch), and symbolic sizes. AOTAutograd gives the joint
forward+backward graph and, at run time, stitches our compiled forward and backward
into PyTorch autograd (``loss.backward()`` fills ``.grad`` of the real parameters;
buffer mutations such as BatchNorm running stats are written back every step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch._functorch.config
import torch.fx
from torch._dynamo import exc as dynamo_exc
from torch._functorch.aot_autograd import aot_module_simplified

from ortlab.artifacts import StageWriter
from ortlab.capture.decompositions import decomposition_table, sdpa_math
from ortlab.capture.provenance import op_name
from ortlab.config import DebugOptions, Options
from ortlab.errors import CaptureError, DeviceError, FallbackError, first_line
from ortlab.partition.recompute import partition_joint
from ortlab.report import CaptureRecord, Fallback, Report, warn_fallback
from ortlab.runtime.graph import GraphContext, compile_graph
from ortlab.runtime.observe import GraphObserver

__all__ = ["OrtlabBackend", "torch_op_counts"]

logger = logging.getLogger(__name__)

_SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def _rewrite_sdpa(gm: torch.fx.GraphModule) -> int:
    """Replace fused SDPA calls by their math form (see ``decompositions``)."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            node.target = sdpa_math
            count += 1
    if count:
        gm.recompile()
    return count


def _device_of(example_inputs: Sequence[object]) -> torch.device:
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    devices.discard(torch.device("meta"))
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise DeviceError(
            f"the captured graph mixes tensors on {names}; ortlab runs one graph on one device. "
            "Move the module and all inputs to the same device (module.to(device), x.to(device))."
        )
    return devices.pop() if devices else torch.device("cpu")


def torch_op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Ops of a Dynamo graph (torch level), most frequent first."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            key = op_name(node) if node.op == "call_function" else f"{node.op}:{node.target}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


class OrtlabBackend:
    """A torch.compile backend that runs captured graphs in onnxruntime.

    One instance per ORTModule; it appends a ``CaptureRecord`` to ``report`` for
    every graph Dynamo hands it. Graphs captured while ``observer`` is set report
    their calls to it (see Note [Observing compiled graphs]).
    """

    def __init__(
        self, options: Options, debug: DebugOptions, report: Report, observer: GraphObserver | None = None
    ) -> None:
        self.options = options
        self.debug = debug
        self.report = report
        self.observer = observer

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        start = time.perf_counter()
        index = len(self.report.captures)
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        )
        mode = "train" if needs_grad else "eval"
        capture = CaptureRecord(index=index, mode=mode, fx_ops=torch_op_counts(gm))
        writer = StageWriter(self.debug, index)
        capture.files = writer.written
        _rewrite_sdpa(gm)
        writer.fx("captured", mode, gm)
        ctx = GraphContext(self.options, self.debug, _device_of(example_inputs), writer, f"g{index}", self.observer)

        def compiler(name: str, graph_mode: str) -> Callable:
            def compile_(fx: torch.fx.GraphModule, _inputs: Sequence[object]) -> Callable:
                fn, record = compile_graph(fx, name, graph_mode, ctx)
                capture.graphs.append(record)
                return fn

            return compile_

        def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: object):
            writer.fx("joint", "train", joint)
            num_fwd_outputs = kwargs.pop("num_fwd_outputs")
            fw, bw, plan = partition_joint(joint, joint_inputs, num_fwd_outputs, self.options.recompute, **kwargs)
            capture.plan = plan
            return fw, bw

        try:
            with torch._functorch.config.patch(donated_buffer=False):
                compiled = aot_module_simplified(
                    gm,
                    example_inputs,
                    fw_compiler=compiler("forward", "train"),
                    bw_compiler=compiler("backward", "train"),
                    inference_compiler=compiler("inference", "eval"),
                    decompositions=decomposition_table(self.options.cache_dir),
                    partition_fn=partition,
                )
        except (FallbackError, DeviceError, dynamo_exc.RestartAnalysis, dynamo_exc.TensorifyScalarRestartAnalysis):
            raise  # ours to report, or Dynamo's own control flow (it re-traces)
        except Exception as e:  # AOTAutograd/functionalization can fail on exotic code
            reason = f"AOTAutograd could not capture graph g{index}: {first_line(e)}"
            if self.options.fallback == "raise":
                raise CaptureError(reason + "\nUse fallback='warn' to run this graph in PyTorch.") from e
            fb = Fallback(scope="graph", where=f"g{index}", reason=reason)
            capture.fallbacks.append(fb)
            warn_fallback(fb)
            logger.debug("capture of g%d failed", index, exc_info=e)
            compiled = gm.forward
        capture.capture_s = time.perf_counter() - start - sum(g.export_s + g.session_s for g in capture.graphs)
        self.report.captures.append(capture)
        return compiled
