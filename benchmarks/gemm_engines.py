"""The GEMMs of a GPT-2-small-sized step on each engine: PyTorch (MKL), onnxruntime's CPU provider (MLAS)
and OpenVINO's plugin (oneDNN's brgemm), one MatMul alone, the engines in turns.

A transformer step this size is GEMM-bound, so the engine that multiplies fastest sets the ratio to
eager. Shapes are those of the 12-layer, d=768 model at 1024 tokens (batch 4, T=256): the forward's
``x @ W^T`` (B given as ``[N, K]``, OpenVINO folds the transpose into the MatMul) and the backward's
input gradients ``dY @ W`` (B given as ``[K, N]``), for the attention's and the MLP's weights, and the
LM head's input gradient at 1024 kept rows (K = the vocabulary). OpenVINO's rows give the ``[K, N]``
MatMul as it is and as ortlab prepares it (split when wide, computed transposed when deep: Note [Wide
MatMuls for OpenVINO], Note [Deep MatMuls for OpenVINO] in ``ortlab/runtime/openvino.py``).

    python benchmarks/gemm_engines.py
    python benchmarks/gemm_engines.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch  # torch first, as users' scripts do

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortlab.config import Options
from ortlab.runtime.openvino import MARK
from ortlab.runtime.providers import cpu_candidates
from ortlab.runtime.session import build_session

# (M, K, N, what it is in the step)
SHAPES = [
    (1024, 768, 3072, "MLP up; the MLP down's input gradient"),
    (1024, 3072, 768, "MLP down; the MLP up's input gradient"),
    (1024, 768, 2304, "qkv"),
    (1024, 2304, 768, "the qkv's input gradient"),
    (1024, 768, 768, "attention out, and its input gradient"),
    (1024, 50257, 768, "LM head input gradient"),
]


def _matmul(m: int, k: int, n: int, b_as_nk: bool, unprepared: bool = False) -> bytes:
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])
    if b_as_nk:
        b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [n, k])
        nodes = [helper.make_node("Transpose", ["B"], ["Bt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["A", "Bt"], ["Y"])]
    else:
        b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [k, n])
        nodes = [helper.make_node("MatMul", ["A", "B"], ["Y"])]
    graph = helper.make_graph(nodes, "mm", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    if unprepared:  # marked as prepared: OpenVINO gets the MatMul as it is
        model.metadata_props.append(onnx.StringStringEntryProto(key=MARK, value="left as it is"))
    return model.SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="runs per round")
    args = parser.parse_args()
    names, notes = cpu_candidates()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__} ({threads} threads); engines: torch.mm, {', '.join(names)}"
          + "".join(f"; not {k}: {v}" for k, v in notes.items()))
    rng = np.random.default_rng(0)
    for m, k, n, what in SHAPES:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b_kn = rng.standard_normal((k, n)).astype(np.float32)
        b_nk = np.ascontiguousarray(b_kn.T)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b_kn)
        runs = {"torch.mm": lambda: torch.mm(ta, tb)}
        for provider in names:
            short = "MLAS" if provider == "CPUExecutionProvider" else provider.replace("ExecutionProvider", "")
            variants = [("B [K,N]", False, False, b_kn), ("B [N,K]", True, False, b_nk)]
            if provider != "CPUExecutionProvider":  # ortlab's preparation (Note [Deep MatMuls for OpenVINO]) or not
                variants = [("B [K,N] as is", False, True, b_kn), ("B [K,N] prepared", False, False, b_kn),
                            ("B [N,K]", True, False, b_nk)]
            for label, b_as_nk, unprepared, feed in variants:
                built = build_session(_matmul(m, k, n, b_as_nk, unprepared), Options(providers=[provider]), None,
                                      device_type="cpu", quiet=True)
                session, feeds = built.session, {"A": a, "B": feed}
                runs[f"{short} {label}"] = (lambda s=session, f=feeds: s.run(None, f))
        for fn in runs.values():
            fn()
            fn()
        flops = 2 * m * k * n
        calls = args.calls if flops < 2e10 else 1
        times: dict[str, list[float]] = {key: [] for key in runs}
        for _ in range(args.rounds):
            for key, fn in runs.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[key].append((time.perf_counter() - start) / calls)
        print(f"\n{what}: M={m} K={k} N={n}")
        for key, ts in times.items():
            med = statistics.median(ts)
            print(f"  {key:<27s} {med * 1e3:7.1f} ms  {flops / med / 1e9:5.0f} GFLOP/s")


if __name__ == "__main__":
    main()
