"""ortlab's own cost per onnxruntime session run, against the bare run.

For each session a model's training step runs (forward and backward), times
``OrtRunner.run`` (torch tensors in, torch tensors out: wrapping the inputs,
running, handing the outputs to torch) against onnxruntime's bare
``run_with_ortvaluevector`` on the same inputs, already wrapped. The difference
is what ortlab adds to every run; the rest of ortlab's step beyond eager's is
Dynamo's guards and AOTAutograd's runtime wrappers (torch.compile pays those too).
Medians of alternating blocks (A B A B ...), in one process.

    python benchmarks/runner_overhead.py                 # tiny MLP and the GPT
    python benchmarks/runner_overhead.py --model tiny --blocks 9 --calls 3000
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch  # torch first, as users' scripts do

import ortlab
from ortlab.models import GPT, GPTConfig, TinyMLP, make_batch
from ortlab.runtime.runner import _NP_DTYPES, OrtRunner
from ortlab._compat.onnxruntime import OrtValueVector


def _runners(name: str) -> list[tuple[OrtRunner, list]]:
    """Every runner a few training steps of the model call, with the arguments of its last call."""
    seen: dict[int, tuple[OrtRunner, list]] = {}
    run = OrtRunner.run

    def record(self: OrtRunner, args: list) -> list:
        seen[id(self)] = (self, list(args))
        return run(self, args)

    torch.manual_seed(0)
    if name == "tiny":
        model, batch = ortlab.ORTModule(TinyMLP()), make_batch("tiny", 16, torch.Generator().manual_seed(0))
    else:
        model, batch = ortlab.ORTModule(GPT(GPTConfig())), make_batch("gpt", 8, torch.Generator().manual_seed(0))
    OrtRunner.run = record  # type: ignore[method-assign]
    try:
        for _ in range(3):
            model(*batch).backward()
    finally:
        OrtRunner.run = run  # type: ignore[method-assign]
    return list(seen.values())


def _median_us(fns: dict, blocks: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(blocks):
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[key].append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "gpt", "all"], default="all")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=0, help="runs per block (default: 3000 tiny, 30 GPT)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for name in (["tiny", "gpt"] if args.model == "all" else [args.model]):
        calls = args.calls or (3000 if name == "tiny" else 30)
        for runner, call_args in _runners(name):
            tensors = [runner._as_tensor(a, k) for a, k in zip(call_args, runner.input_kinds)]
            inputs = OrtValueVector()
            inputs.push_back_batch(tensors, [t.data_ptr() or runner._no_data_ptr for t in tensors],
                                   [_NP_DTYPES[t.dtype] for t in tensors], [t.shape for t in tensors],
                                   runner._in_devices)

            def bare(runner: OrtRunner = runner, inputs: OrtValueVector = inputs) -> None:
                out = OrtValueVector()
                runner._sess.run_with_ortvaluevector(runner._run_options, runner._feed, inputs, runner._fetch,
                                                     out, runner._out_devices)

            def full(runner: OrtRunner = runner, call_args: list = call_args) -> None:
                runner.run(call_args)

            _median_us({"bare": bare, "full": full}, 1, max(calls // 10, 3))  # warm up
            med = _median_us({"bare": bare, "full": full}, args.blocks, calls)
            print(f"{name:5s} {runner.session.get_modelmeta().graph_name or '?':>10s} "
                  f"{len(call_args):3d} inputs {len(runner.output_kinds):3d} outputs: "
                  f"bare run {med['bare']:9.2f} us, OrtRunner.run {med['full']:9.2f} us, "
                  f"ortlab's own {med['full'] - med['bare']:6.2f} us")


if __name__ == "__main__":
    main()
