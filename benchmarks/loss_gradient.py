"""The label-sparsity tail's backward with the loss gradient as exp, a scatter-add and a multiply, against the
gradient AOTAutograd derives from ``log_softmax`` + ``nll_loss`` (Note [The vocabulary-wide loss
gradient in three passes] in ``ortlab/capture/sparsity.py``).

The tail (the LM head and its loss on the kept rows) is compiled both ways with ``DebugOptions``
saving its graphs; each saved backward then runs alone in a session per provider, the two
variants in turns, and onnxruntime's profiler splits the kernel time into the head's two GEMMs
and the rest (on the CPU provider; OpenVINO's run is one node, so only its total is printed).

    python benchmarks/loss_gradient.py                 # 1024 rows, vocab 50257, d=768, 3 rounds
    python benchmarks/loss_gradient.py 512 50257 768 5
"""
import argparse
import collections
import json
import os
import statistics
import tempfile
import time
import warnings

import torch  # torch first, as users' scripts do
import torch.nn.functional as F
from torch import nn

import numpy as np
import onnx
import onnxruntime as ort

import ortlab
from ortlab.capture import sparsity
from ortlab.runtime.providers import plugin, plugin_eps, plugin_options, prepare_model

warnings.simplefilter("ignore")
_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
for _name, _default in (("rows", 1024), ("vocab", 50257), ("d", 768), ("rounds", 3)):
    _parser.add_argument(_name, nargs="?", type=int, default=_default, help=f"default {_default}")
_cli = _parser.parse_args()
rows, vocab, d, rounds = _cli.rows, _cli.vocab, _cli.d, _cli.rounds


class _Derived:
    """``F.cross_entropy`` as before the change: AOTAutograd differentiates log_softmax + nll_loss."""

    @staticmethod
    def apply(logits, labels, ignore_index, reduction):  # noqa: ANN001, ANN205
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.tail = sparsity._Tail([], -100, "mean", 0.0)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.tail(h, labels, self.weight, self.bias)


def saved_backward(variant: str, folder: str) -> str:
    original = sparsity._CrossEntropy
    if variant == "derived":
        sparsity._CrossEntropy = _Derived
    try:
        torch.manual_seed(0)
        model = ortlab.ORTModule(Tail(), providers=["CPUExecutionProvider"], label_sparsity=False, debug_options=ortlab.DebugOptions(
            save_onnx=True, onnx_prefix=variant, save_path=folder))
        h, labels = torch.randn(rows, d, requires_grad=True), torch.randint(0, vocab, (rows,))
        # A symbolic row count, as label sparsity compiles its tail (the kept rows change per step).
        torch._dynamo.mark_dynamic(h, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        model(h, labels).backward()
    finally:
        sparsity._CrossEntropy = original
    path = os.path.join(folder, f"{variant}_backward_onnxscript_train.onnx")
    if not os.path.exists(path):
        raise SystemExit(f"no saved backward for {variant}: {sorted(os.listdir(folder))}")
    return path


def feeds(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [rows if dim.dim_param else dim.dim_value for dim in t.shape.dim]
        if t.elem_type == onnx.TensorProto.INT64:
            out[value.name] = np.array(rows, np.int64) if not shape else rng.integers(0, vocab, shape).astype(np.int64)
        elif "log_softmax" in value.name:
            out[value.name] = np.full(shape, -np.log(vocab), np.float32)  # uniform probabilities
        else:
            out[value.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def run(path: str, provider: str) -> tuple[float, float | None]:
    """Median seconds of 5 runs, and (CPU provider) the kernel seconds other than the two largest GEMMs."""
    model = onnx.load(path)
    so = ort.SessionOptions()
    profile = provider == "CPUExecutionProvider"
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(os.path.dirname(path), "profile")
        session = ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
    else:
        ep = plugin(provider)
        so.add_provider_for_devices(list(ep.devices), plugin_options(ep, None))
        session = ort.InferenceSession(prepare_model(provider, model.SerializeToString()), sess_options=so)
    inputs = feeds(model)
    session.run(None, inputs)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        session.run(None, inputs)
        times.append(time.perf_counter() - start)
    if not profile:
        return statistics.median(times), None
    kernels = collections.Counter()
    with open(session.end_profiling()) as f:
        for event in json.load(f):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                kernels[(event["args"].get("op_name"), event["name"])] += event["dur"] / 6e6
    gemms = sorted((v for (op, _), v in kernels.items() if "MatMul" in op or op == "Gemm"), reverse=True)[:2]
    return statistics.median(times), sum(kernels.values()) - sum(gemms)


with tempfile.TemporaryDirectory() as folder:
    paths = {v: saved_backward(v, folder) for v in ("expression", "derived")}
    providers = ["CPUExecutionProvider"] + (["OpenVINOExecutionProvider"] if "OpenVINOExecutionProvider" in plugin_eps()
                                            else [])
    print(f"== the label-sparsity tail's backward, {rows} rows, vocab {vocab}, d={d}; standalone sessions, "
          f"{rounds} rounds in turns ==")
    for variant, path in paths.items():
        ops = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
        print(f"{variant}: {sum(ops.values())} nodes, " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
    for provider in providers:
        results = {v: [] for v in paths}
        for _ in range(rounds):
            for variant, path in paths.items():
                results[variant].append(run(path, provider))
        for variant, got in results.items():
            line = f"{provider:<26} {variant:<15} run " + ", ".join(f"{1000 * s:.0f}" for s, _ in got) + " ms"
            if got[0][1] is not None:
                line += "; kernels other than the head's GEMMs " + ", ".join(f"{1000 * k:.0f}" for _, k in got) + " ms"
            print(line)
