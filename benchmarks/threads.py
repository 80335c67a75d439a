"""Thread settings for the whole training step: onnxruntime's pool beside PyTorch's OpenMP pool.

Three ORTModules of one model train side by side in one process (torch imported first, as
in users' scripts), steps alternating A B C A B C, medians:

* default: ortlab's settings (onnxruntime's intra-op threads = one per core, spinning between the
  ops of a run and stopped when it returns: ``session.force_spinning_stop=1``, Note
  [onnxruntime's threads spin within a run only] in ortlab/runtime/session.py);
* no-spin: idle threads never spin (``session.intra_op.allow_spinning=0``, ortlab's setting
  until 2026-11-28);
* spin: spinning that goes on after a run (onnxruntime's default);
* ort1thread: one onnxruntime thread per session;
* omp-spinning: ortlab's settings, but PyTorch's idle OpenMP threads are not released before
  the sessions run (they spin on the cores the session needs; Note [PyTorch's OpenMP spin and
  onnxruntime] in ortlab/_openmp.py).

Usage:
    python benchmarks/threads.py gpt 30
    python benchmarks/threads.py mlp 60 --variants no-spin   # default against one other, alone
    python benchmarks/threads.py resnet18 20 --variants no-spin  # train_step.py's models too
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402, I001
import ortlab  # noqa: E402
import ortlab.runtime.session as session_module  # noqa: E402
from ortlab.models import GPT, MLP, GPTConfig, make_batch  # noqa: E402

_SPIN = {"mode": None}
_original = session_module._session_options


def _with_spin(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the benchmark's one switch
    so = _original(*args, **kwargs)
    if _SPIN["mode"] == "no-spin":
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif _SPIN["mode"] == "spin":
        so.add_session_config_entry("session.force_spinning_stop", "0")
    return so


def main(which: str, steps: int, only: list[str] | None = None) -> None:
    session_module._session_options = _with_spin
    torch.manual_seed(0)
    if which == "gpt":
        base, draw = GPT(GPTConfig()), (lambda g: make_batch("gpt", 8, g))
    elif which == "mlp":
        base, draw = MLP((784, 1024, 1024, 10)), (lambda g: make_batch("mlp", 256, g))
    else:  # train_step.py's other models (resnet18, bert, ...), built as it builds them
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_step import build_model

        base, draw, _ = build_model(which)
    variants = {"default": {}, "no-spin": {"spin": "no-spin"}, "spin": {"spin": "spin"},
                "ort1thread": {"intra_op_num_threads": 1}, "omp-spinning": {"keep_omp": True}}
    # A variant whose threads spin after its run slows the one measured next: compare two alone.
    variants = {k: v for k, v in variants.items() if not only or k in only or k == "default"}
    modules = {}
    for name, cfg in variants.items():
        _SPIN["mode"] = cfg.pop("spin", None)
        keep_omp = cfg.pop("keep_omp", False)
        m = ortlab.ORTModule(copy.deepcopy(base), **cfg)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            m(*draw(g)).backward()
            opt.step()
            opt.zero_grad()
        if keep_omp:
            for capture in m.report.captures:
                for graph in capture.graphs:
                    for part in graph.parts:
                        part.runner._release_openmp = None
        modules[name] = (m, opt)
    _SPIN["mode"] = None
    times: dict[str, list[float]] = {n: [] for n in modules}
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = draw(g)
        for name, (m, opt) in modules.items():
            start = time.perf_counter()
            m(*batch).backward()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - start)
    base_ms = statistics.median(times["default"])
    for name, ts in times.items():
        print(f"{which} {name:<11} {statistics.median(ts) * 1e3:8.2f} ms  {base_ms / statistics.median(ts):.3f}x default")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="gpt",
                        help="gpt (default), mlp, or another of train_step.py's models (resnet18, bert, ...)")
    parser.add_argument("steps", nargs="?", type=int, default=30, help="measured steps per variant (default 30)")
    parser.add_argument("--variants", help="comma-separated variants beside default (default: all)")
    args = parser.parse_args()
    main(args.model, args.steps, args.variants.split(",") if args.variants else None)
