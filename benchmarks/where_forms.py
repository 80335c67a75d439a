"""onnxruntime's CPU ``Where`` in the forms ortlab's graphs take, timed on bare sessions (one thread).

The forms of a masked gradient and of a slope's gradient (Note [Where as a checked multiply] and Note [A -0.0
from Where's first branch] in ``ortlab/runtime/cpu_rewrites.py``, Note [A slope's gradient as a product] in
``ortlab/capture/float_edges.py``): each is timed on the same condition and tensor, in turns, and each result's
bits are compared with numpy's select (``exact``: values and signs of zero).

    python benchmarks/where_forms.py --elements 1048576 --runs 25
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _session(nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray], n: int) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info("c", TensorProto.BOOL, [n]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])]
    output = helper.make_tensor_value_info("o", TensorProto.FLOAT, [n])
    used = {name for n in nodes for name in n.input}
    inits = [numpy_helper.from_array(v, k) for k, v in constants.items() if k in used]
    graph = helper.make_graph(nodes, "g", inputs, [output], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _forms(n: int) -> dict[str, tuple[ort.InferenceSession, object]]:
    node = helper.make_node
    k = {"zero": np.zeros((), np.float32), "one": np.ones((), np.float32), "s": np.full((), 0.1, np.float32),
         "false": np.array(False)}
    checked = [node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT), node("Not", ["c"], ["nc"]),
               node("Cast", ["nc"], ["ncf"], to=TensorProto.FLOAT), node("Mul", ["ncf", "s"], ["b"]),
               node("Add", ["cf", "b"], ["w"]), node("Reciprocal", ["w"], ["r"]),
               node("ReduceSum", ["r"], ["rs"], keepdims=0), node("Mul", ["x", "w"], ["o0"]),
               node("Add", ["o0", "rs"], ["o"])]
    return {
        "where(c, x, 0)": (_session([node("Where", ["c", "x", "zero"], ["o"])], k, n),
                           lambda c, x: np.where(c, x, np.float32(0))),
        "where(c == false, 0, x)": (_session([node("Equal", ["c", "false"], ["n"]),
                                              node("Where", ["n", "zero", "x"], ["o"])], k, n),
                                    lambda c, x: np.where(c, x, np.float32(0))),
        "where(c, x, x * s)": (_session([node("Mul", ["x", "s"], ["xs"]),
                                         node("Where", ["c", "x", "xs"], ["o"])], k, n),
                               lambda c, x: np.where(c, x, x * np.float32(0.1))),
        "x * where(c, 1, s)": (_session([node("Where", ["c", "one", "s"], ["w"]),
                                         node("Mul", ["x", "w"], ["o"])], k, n),
                               lambda c, x: np.where(c, x, x * np.float32(0.1))),
        "x * checked where(c, 1, s)": (_session(checked, k, n), None),
        "x * s (a Mul alone)": (_session([node("Mul", ["x", "s"], ["o"])], k, n), None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--runs", type=int, default=25)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    rng = np.random.default_rng(0)
    c = rng.random(args.elements) > 0.5
    x = rng.standard_normal(args.elements).astype(np.float32)
    x[::7] = -0.0
    forms = _forms(args.elements)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(3):
        for session, _ in forms.values():
            session.run(None, {"c": c, "x": x})
    for _ in range(args.runs):
        for name, (session, _) in forms.items():
            start = time.perf_counter()
            session.run(None, {"c": c, "x": x})
            times[name].append(time.perf_counter() - start)
    print(f"onnxruntime {ort.__version__}, {args.elements} float32 elements, one thread, {args.runs} runs in turns")
    for name, (session, reference) in forms.items():
        got = session.run(None, {"c": c, "x": x})[0]
        exact = "" if reference is None else (
            "exact" if np.array_equal(got.view(np.uint32), reference(c, x).view(np.uint32)) else "NOT exact")
        median, least = np.median(times[name]) * 1e3, min(times[name]) * 1e3
        print(f"  {name:30s} median {median:6.2f} ms  min {least:6.2f} ms  {exact}")


if __name__ == "__main__":
    main()
