"""First-step time, peak memory and recomputation of ortlab against eager PyTorch.

Every figure that depends on process state runs in a fresh child process:

* first step: capture + export + session creation of the GPT (and torch.compile's), median of
  ``--runs`` fresh processes per row;
* peak RSS of a 50-step training run (``resource.getrusage(...).ru_maxrss``), eager
  vs ortlab, each alone in its process;
* recompute: saved-activation bytes of ``recompute="none"`` vs ``"layerwise"`` (from
  the first-step report) and their step times, alternating step by step.

Usage:
    python benchmarks/memory_and_startup.py            # all three
    python benchmarks/memory_and_startup.py --only rss
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
if sys.argv[1] == "ortlab" and len(sys.argv) > 3 and sys.argv[3] == "ortlab-first":
    import ortlab  # before torch (ortlab/_openmp.py); by default torch comes first, as in users' scripts
import torch
from ortlab.models import GPT, GPTConfig, make_batch
mode, steps = sys.argv[1], int(sys.argv[2])
if mode == "ortlab":
    import ortlab  # its code (torch._dynamo, onnxscript, onnxruntime) counted apart from training
elif mode == "compile":
    import torch._dynamo
import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
torch.manual_seed(0)
model = GPT(GPTConfig())
if mode == "ortlab":
    import ortlab
    model = ortlab.ORTModule(model)
elif mode == "compile":
    model = torch.compile(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(0)
times = []
for step in range(steps):
    idx, tgt = make_batch("gpt", 8, generator=gen)
    start = time.perf_counter()
    loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
    if step == 0 and mode == "ortlab":  # the race's checks of the first step alone (later ones are in later steps)
        first_race_s = sum(g.race_s for c in model.report.captures for g in c.graphs)
breakdown = {{}}
if mode == "ortlab":
    report = model.report
    graphs = [g for c in report.captures for g in c.graphs]
    breakdown = {{"capture_s": sum(c.capture_s for c in report.captures),
                 "export_s": sum(g.export_s - g.optimize_s for g in graphs),
                 "onnxscript_s": sum(g.optimize_s for g in graphs),
                 "session_s": sum(g.session_s for g in graphs), "measuring_s": first_race_s}}
print(json.dumps({{"first_s": times[0], "next_s": times[1:3], "median_ms": 1000 * statistics.median(times[1:]) if steps > 1 else None,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "import_rss_mib": import_rss, **breakdown}}))
""".replace("statistics.median", "__import__('statistics').median")


def child(mode: str, steps: int, env: dict | None = None, ortlab_first: bool = False) -> dict:
    code = CHILD.format(root=str(ROOT))
    argv = [sys.executable, "-c", code, mode, str(steps), "ortlab-first" if ortlab_first else "torch-first"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_step(runs: int = 3) -> None:
    print(f"== first step of the 4-layer GPT, fresh process (torch imported first, as in users' scripts); "
          f"median of {runs} processes per row, taken in turns ==")

    def show(name: str, results: list[dict]) -> None:
        r = {k: statistics.median(x[k] for x in results) for k in results[0] if k.endswith("_s")}
        spread = sorted(x["first_s"] for x in results)
        parts = "".join(f", {k[:-2]} {r[k]:.2f} s" for k in ("capture_s", "export_s", "onnxscript_s", "session_s",
                                                            "measuring_s") if k in r)
        low = f" ({spread[0]:.2f}-{spread[-1]:.2f})" if len(spread) > 1 else ""
        following = [statistics.median(x["next_s"][i] for x in results) for i in range(len(results[0]["next_s"]))]
        then = ("; then " + ", ".join(f"{t * 1e3:.0f}" for t in following) + " ms") if following else ""
        print(f"{name:<30} first step {r['first_s']:6.2f} s{low}{parts}{then}")

    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as cache:
        # fills the cache: the race decides on the parts' third calls (Note [The race times the next calls' own
        # runs] in ortlab/runtime/race.py), and its decision is stored with the entry
        child("ortlab", 4, {"ORTLAB_CACHE_DIR": cache})
        # Three steps each: the first, and the two after it, on which the race times its candidates.
        kinds = {
            "eager": lambda: child("eager", 3),
            "compile": lambda: child("compile", 3),
            "ortlab": lambda: child("ortlab", 3),
            "ortlab, imported before torch": lambda: child("ortlab", 3, ortlab_first=True),
            "ortlab, on-disk cache hit": lambda: child("ortlab", 3, {"ORTLAB_CACHE_DIR": cache}),
        }
        for _ in range(runs):  # in turns, so a busy moment of the machine does not hit one row only
            for name, run in kinds.items():
                rows.setdefault(name, []).append(run())
    for name, results in rows.items():
        show(name, results)
    print("(capture: Dynamo + AOTAutograd + partitioning; export: torch.onnx's translation; onnxscript: its "
          "optimizer; session: building onnxruntime's sessions; measuring: the execution-provider race's runs beyond "
          "the first step's own (the candidates' check runs; a candidate still building is checked on the second "
          "step); the rest of the first step is Dynamo's own "
          "tracing and the runs; 'then': the second and third steps, on which the race times its candidates; a "
          "'then' figure ~0.2 s above the others is CPython's full garbage collection over the objects the capture "
          "left, once, in whichever step crosses its threshold: with gc.disable() it is gone)")


def peak_rss(steps: int) -> None:
    print(f"== peak RSS of a {steps}-step GPT training run, fresh process each ==")
    results = {mode: child(mode, steps) for mode in ("eager", "ortlab")}
    base = results["eager"]["max_rss_mib"]
    grown = base - results["eager"]["import_rss_mib"]
    for mode, r in results.items():
        training = r["max_rss_mib"] - r["import_rss_mib"]
        print(f"{mode:<8} max RSS {r['max_rss_mib']:8.1f} MiB  ({r['max_rss_mib'] / base:.2f}x eager); "
              f"after imports {r['import_rss_mib']:6.1f} MiB, training adds {training:6.1f} MiB "
              f"({training / grown:.2f}x eager's)")
    print("(after imports: the process once torch, and for ortlab ortlab with torch._dynamo, onnxscript and "
          "onnxruntime, are imported)")


def recompute(steps: int) -> None:
    import copy
    import warnings

    sys.path.insert(0, str(ROOT))
    warnings.simplefilter("ignore")
    import torch

    import ortlab
    from ortlab.models import GPT, GPTConfig, make_batch

    print(f"== recompute on the 4-layer GPT: saved bytes and step time ({steps} alternating steps) ==")
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    contenders = {p: ortlab.ORTModule(copy.deepcopy(base), recompute=p) for p in ("none", "auto", "layerwise")}
    opts = {p: torch.optim.SGD(m.parameters(), lr=1e-3) for p, m in contenders.items()}
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch("gpt", 8, generator=gen) for _ in range(4)]
    times: dict[str, list[float]] = {p: [] for p in contenders}
    for step in range(steps + 2):
        for p, m in contenders.items():
            start = time.perf_counter()
            loss = m(*batches[step % 4])
            loss.backward()
            opts[p].step()
            opts[p].zero_grad()
            if step >= 2:
                times[p].append(time.perf_counter() - start)
    ref = statistics.median(times["none"])
    base_bytes = contenders["none"].report.saved_activation_bytes
    for p, m in contenders.items():
        med = statistics.median(times[p])
        saved = m.report.saved_activation_bytes
        print(
            f"{p:<10} saved activations {saved / 2**20:7.1f} MiB ({saved / base_bytes:.2f}x none)  "
            f"step {1000 * med:7.1f} ms ({med / ref:.2f}x none)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("first", "rss", "recompute"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per first-step row (median)")
    args = parser.parse_args(argv)
    if args.only in (None, "first"):
        first_step(args.runs)
    if args.only in (None, "rss"):
        peak_rss(args.steps)
    if args.only in (None, "recompute"):
        recompute(min(args.steps, 20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
