"""ortlab's own cost per onnxruntime session run, against the bare run.

For each session a model's training step runs (forward and backward), times
``OrtRunner.run`` (torch tensors in, torch tensors out: wrapping the inputs,
running, handing the outputs to torch) against onnxruntime's bare
``run_with_ortvaluevector`` on the same inputs, already wrapped. The difference
is what ortlab adds to every run; the rest of ortlab's step beyond eager's is
Dynamo's guards and AOTAutograd's runtime wrappers (torch.compile pays those too).
Medians of alternating blocks (A B A B ...), in one process.

``--layers`` times one forward + backward (no optimizer) through each layer of the stack in
turn, outermost first: eager PyTorch; the ORTModule; Dynamo's compiled module (guards, frame
evaluation); AOTAutograd's compiled function called with the graph's inputs as Dynamo passes
them (its runtime wrappers, the autograd.Function, the autograd engine's backward); the two
``OrtRunner.run`` calls alone; onnxruntime's bare runs. Each difference is that layer's cost.

    python benchmarks/runner_overhead.py                 # tiny MLP and the GPT
    python benchmarks/runner_overhead.py --model tiny --blocks 9 --calls 3000
    python benchmarks/runner_overhead.py --model tiny --layers
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
    torch.manual_seed(0)
    if name == "tiny":
        model, batch = ortlab.ORTModule(TinyMLP()), make_batch("tiny", 16, torch.Generator().manual_seed(0))
    else:
        model, batch = ortlab.ORTModule(GPT(GPTConfig())), make_batch("gpt", 8, torch.Generator().manual_seed(0))
    for _ in range(2):
        model(*batch).backward()
    return _runners_of(model, batch)


def _median_us(fns: dict, blocks: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(blocks):
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[key].append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _layers(name: str, blocks: int, calls: int) -> None:
    """One forward + backward through each layer of the stack (see the module's docstring)."""
    import ortlab.pipeline.backend as backend

    torch.manual_seed(0)
    if name == "tiny":
        plain, batch = TinyMLP(), make_batch("tiny", 16, torch.Generator().manual_seed(0))
    else:
        plain, batch = GPT(GPTConfig()), make_batch("gpt", 8, torch.Generator().manual_seed(0))
    model = ortlab.ORTModule(plain)
    handed: dict[str, object] = {}
    call = backend._Handed.__call__

    def spy(self: backend._Handed, *args: object) -> object:
        handed["fn"], handed["args"] = self, args
        return call(self, *args)

    backend._Handed.__call__ = spy  # type: ignore[method-assign]
    try:
        for _ in range(3):
            model(*batch).backward()
    finally:
        backend._Handed.__call__ = call  # type: ignore[method-assign]
    runs = _runners_of(model, batch)
    if "fn" not in handed or len(runs) != 2 or len(model.report.captures) != 1:
        print(f"{name}: not one graph with one forward and one backward part; no layer breakdown")
        return
    (fw, fw_args), (bw, bw_args) = runs
    compiled, flat_args = handed["fn"], handed["args"]
    dynamo = model._ortlab_compiled  # the OptimizedModule ORTModule calls
    bare_fw, bare_bw = _bare(fw, fw_args), _bare(bw, bw_args)

    def loss_of(out: object) -> torch.Tensor:
        return out[0] if isinstance(out, (list, tuple)) else out  # type: ignore[return-value,index]

    fns = {
        "eager PyTorch": lambda: plain(*batch).backward(),
        "ORTModule": lambda: model(*batch).backward(),
        "Dynamo's compiled module": lambda: dynamo(*batch).backward(),
        "AOTAutograd's compiled function": lambda: loss_of(compiled(*flat_args)).backward(),  # type: ignore[operator]
        "OrtRunner.run x2": lambda: (fw.run(list(fw_args)), bw.run(list(bw_args))),
        "onnxruntime's bare runs x2": lambda: (bare_fw(), bare_bw()),
    }
    _median_us(fns, 1, max(calls // 10, 3))  # warm up
    med = _median_us(fns, blocks, calls)
    print(f"== {name}: one forward + backward through each layer (medians of {blocks} alternating blocks of "
          f"{calls} calls; torch {torch.__version__}) ==")
    names = list(fns)
    for i, key in enumerate(names):
        below = med[names[i + 1]] if 0 < i < len(names) - 1 else None
        own = f"   this layer's own: {med[key] - below:7.1f} us" if below is not None else ""
        print(f"{key:34s} {med[key]:8.1f} us  ({med[key] / med['eager PyTorch']:.2f}x eager){own}")


def _runners_of(model: torch.nn.Module, batch: tuple) -> list[tuple[OrtRunner, list]]:
    """The runners one step of ``model`` calls, with the arguments of that call."""
    seen: dict[int, tuple[OrtRunner, list]] = {}
    run = OrtRunner.run

    def record(self: OrtRunner, args: list) -> list:
        seen[id(self)] = (self, list(args))
        return run(self, args)

    OrtRunner.run = record  # type: ignore[method-assign]
    try:
        model(*batch).backward()
    finally:
        OrtRunner.run = run  # type: ignore[method-assign]
    return list(seen.values())


def _bare(runner: OrtRunner, call_args: list):
    """onnxruntime's own run of ``runner``'s session on ``call_args``, already wrapped."""
    tensors = [runner._as_tensor(a, k) for a, k in zip(call_args, runner.input_kinds)]
    inputs = OrtValueVector()
    inputs.push_back_batch(tensors, [t.data_ptr() or runner._no_data_ptr for t in tensors],
                           [_NP_DTYPES[t.dtype] for t in tensors], [t.shape for t in tensors], runner._in_devices)

    def bare() -> None:
        out = OrtValueVector()
        runner._sess.run_with_ortvaluevector(runner._run_options, runner._feed, inputs, runner._fetch, out,
                                             runner._out_devices)

    bare.tensors = tensors  # type: ignore[attr-defined]  # keeps the wrapped inputs' memory alive
    return bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "gpt", "all"], default="all")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=0, help="runs per block (default: 3000 tiny, 30 GPT)")
    parser.add_argument("--layers", action="store_true", help="one step's time through each layer of the stack")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.layers:
        for name in (["tiny", "gpt"] if args.model == "all" else [args.model]):
            _layers(name, args.blocks, args.calls or (300 if name == "tiny" else 5))
        return
    for name in (["tiny", "gpt"] if args.model == "all" else [args.model]):
        calls = args.calls or (3000 if name == "tiny" else 30)
        for runner, call_args in _runners(name):
            bare = _bare(runner, call_args)

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
