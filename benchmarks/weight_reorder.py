"""A convolution weight's reorder into onnxruntime's blocked layout: Transposes against ReorderInput.

The CPU rewrites run training's convolutions in onnxruntime's blocked (NCHWc) layout and reorder
their weights in the graph each step (Note [Reordering a weight with ReorderInput] in
``ortlab/runtime/cpu_rewrites.py``). This times the two ways to do it on ResNet-18's weight shapes,
one session each, runs alternating in one process (each run reads its weight from memory, as
a training step does after the optimizer's update), and checks that both give the same floats:

* ``transpose``: two Transposes that each move one axis (what the rewrite did before);
* ``reorder``: two ``ReorderInput`` nodes (what it does now).

    python benchmarks/weight_reorder.py --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortlab.runtime.cpu_rewrites import nchwc_block_size

# ResNet-18's convolutions with at least one block of input channels (count, out, in, kernel)
RESNET18 = [(4, 64, 64, 3), (1, 128, 64, 3), (3, 128, 128, 3), (1, 128, 64, 1), (1, 256, 128, 3), (3, 256, 256, 3),
            (1, 256, 128, 1), (1, 512, 256, 3), (3, 512, 512, 3), (1, 512, 256, 1)]


def _model(kind: str, co: int, ci: int, k: int, block: int) -> bytes:
    taps, ob, ib = k * k, co // block, ci // block
    inits = []

    def ints(name: str, values: list[int]) -> str:
        inits.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    if kind == "transpose":
        nodes = [helper.make_node("Reshape", ["w", ints("s1", [ob, block, ci * taps])], ["a"]),
                 helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
                 helper.make_node("Reshape", ["b", ints("s2", [ob * ib, block, taps, block])], ["c"]),
                 helper.make_node("Transpose", ["c"], ["d"], perm=[0, 2, 1, 3])]
    else:
        nodes = [helper.make_node("Reshape", ["w", ints("s1", [ob, block, ci * taps, 1])], ["a"]),
                 helper.make_node("ReorderInput", ["a"], ["b"], domain="com.microsoft.nchwc", channels_last=0),
                 helper.make_node("Reshape", ["b", ints("s2", [ob * ib, block, 1, taps * block])], ["c"]),
                 helper.make_node("ReorderInput", ["c"], ["d"], domain="com.microsoft.nchwc", channels_last=1)]
    if taps == 1:  # one move: [O/B, Bo, I] -> [O/B, I, Bo]
        nodes = nodes[:2]
        nodes[-1].output[0] = "d"
    nodes.append(helper.make_node("Reshape", ["d", ints("s3", [co, ci, k, k])], ["out"]))
    graph = helper.make_graph(nodes, "reorder", [helper.make_tensor_value_info("w", TensorProto.FLOAT, [co, ci, k, k])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [co, ci, k, k])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft.nchwc", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    block, why = nchwc_block_size()
    if not block:
        print(f"no blocked layout here: {why}")
        return 1
    print(f"onnxruntime {ort.__version__}, NCHWc block {block}")
    rng = np.random.default_rng(0)
    totals = {"transpose": 0.0, "reorder": 0.0}
    print(f"{'weight':>18} {'count':>5} {'transpose ms':>13} {'reorder ms':>11} {'ratio':>6}")
    for count, co, ci, k in RESNET18:
        w = rng.standard_normal((co, ci, k, k)).astype(np.float32)
        sessions = {kind: ort.InferenceSession(_model(kind, co, ci, k, block), providers=["CPUExecutionProvider"])
                    for kind in totals}
        outs = {kind: s.run(None, {"w": w})[0] for kind, s in sessions.items()}
        assert np.array_equal(outs["transpose"], outs["reorder"]), "the two reorders differ"
        times: dict[str, list[float]] = {kind: [] for kind in totals}
        for _ in range(args.repeats):
            for kind, s in sessions.items():  # alternating
                t = time.perf_counter()
                s.run(None, {"w": w})
                times[kind].append(time.perf_counter() - t)
        med = {kind: statistics.median(ts) * 1e3 for kind, ts in times.items()}
        for kind in totals:
            totals[kind] += count * med[kind]
        print(f"{f'{co}x{ci}x{k}x{k}':>18} {count:>5} {med['transpose']:>13.3f} {med['reorder']:>11.3f} "
              f"{med['transpose'] / med['reorder']:>5.1f}x")
    print(f"ResNet-18's weights, one step: transpose {totals['transpose']:.2f} ms, reorder {totals['reorder']:.2f} ms "
          f"({totals['transpose'] / totals['reorder']:.1f}x); the same floats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
