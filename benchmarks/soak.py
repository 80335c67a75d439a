"""Long-run soak: RSS, threads, open files and live onnxruntime sessions over a GPT training run.

Trains ortlab's GPT (default config) with AdamW for ``--steps`` steps, ortlab and eager
PyTorch each in a fresh process, and prints RSS at ten checkpoints plus the growth from the
first checkpoint (after warm-up) to the end. The suite runs a 300-step tiny-GPT version
(``tests/test_soak.py``); this is the long one, kept out of the suite.

    python benchmarks/soak.py --steps 1500 | tee benchmarks/results/soak.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def run(engine: str, steps: int) -> dict:
    import ortlab  # noqa: F401  (first: its OpenMP settings apply before torch starts)
    import onnxruntime as ort
    import torch

    from ortlab.models import GPT, GPTConfig, make_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    if engine == "ortlab":
        model = ortlab.ORTModule(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    rows = []
    start = time.perf_counter()
    every = max(1, steps // 10)
    for step in range(steps + 1):
        idx, targets = make_batch("gpt", 8, gen)
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % every == 0:
            gc.collect()
            sessions = sum(1 for o in gc.get_objects() if type(o) is ort.InferenceSession)
            rows.append({"step": step, "rss_mib": round(_rss_mib(), 1), "threads": len(os.listdir("/proc/self/task")),
                         "open_files": len(os.listdir("/proc/self/fd")), "sessions": sessions,
                         "loss": round(float(loss), 4), "s": round(time.perf_counter() - start, 1)})
    return {"engine": engine, "steps": steps, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--engine", choices=["ortlab", "eager"])
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(run(args.engine, args.steps)))
        return
    print(f"soak: GPT (d=256, 4 layers, T=128, batch 8), AdamW, {args.steps} steps, one process per engine")
    print(f"command: python benchmarks/soak.py --steps {args.steps}")
    for engine in ("ortlab", "eager"):
        out = subprocess.run([sys.executable, __file__, "--engine", engine, "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows = result["rows"]
        print(f"\n{engine}")
        print(f"  {'step':>6} {'RSS MiB':>8} {'threads':>7} {'files':>5} {'sessions':>8} {'loss':>7} {'s':>7}")
        for r in rows:
            print(f"  {r['step']:>6} {r['rss_mib']:>8} {r['threads']:>7} {r['open_files']:>5} {r['sessions']:>8} "
                  f"{r['loss']:>7} {r['s']:>7}")
        first, last = rows[1], rows[-1]  # from the first checkpoint after warm-up
        growth = 100 * (last["rss_mib"] - first["rss_mib"]) / first["rss_mib"]
        print(f"  RSS step {first['step']} -> {last['step']}: {first['rss_mib']} -> {last['rss_mib']} MiB "
              f"({growth:+.2f}%); threads {first['threads']} -> {last['threads']}; "
              f"open files {first['open_files']} -> {last['open_files']}; sessions {first['sessions']} -> "
              f"{last['sessions']}")


if __name__ == "__main__":
    main()
