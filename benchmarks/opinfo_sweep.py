"""PyTorch's OpInfo samples through ortlab: the full sweep, one outcome per sample.

    python benchmarks/opinfo_sweep.py                      # every op, every dtype (hours on 2 cores)
    python benchmarks/opinfo_sweep.py --dtypes float32 --ops 'nn.functional.*' --jobs 2
    python benchmarks/opinfo_sweep.py --report             # the table from the results so far

Each op and dtype runs in a worker process (``tests/opinfo/harness.py``: ``run_op``); a worker
that exceeds ``--timeout`` seconds on one op, or dies, is replaced and that op recorded as not
finished. Results go to ``benchmarks/results/opinfo/sweep.jsonl``, a line per op and dtype
(counts of each outcome, and every sample that did not match with its detail), so an
interrupted sweep resumes where it stopped (``--fresh`` starts over). ``--report`` writes
``benchmarks/results/opinfo/table.md``, the table the docs show.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
RESULTS = HERE / "results" / "opinfo"
ALL_DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def _worker(args: argparse.Namespace) -> None:
    """Run the (op, dtype) pairs read from stdin, a JSON line each to stdout as each ends."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch._dynamo

    from opinfo.harness import find_op, run_op, summarize

    torch.set_num_threads(1)
    for line in sys.stdin:
        name, dtype = json.loads(line)
        print(json.dumps({"start": [name, dtype]}), flush=True)
        start = time.perf_counter()
        try:
            outcomes = run_op(find_op(name), getattr(torch, dtype))
            row = {"op": name, "dtype": dtype, "counts": summarize(outcomes), "samples": len(outcomes),
                   "seconds": round(time.perf_counter() - start, 1),
                   "outcomes": [{"source": o.source, "index": o.index, "outcome": o.outcome, "detail": o.detail,
                                 "sample": o.sample, "grad": o.grad} for o in outcomes if o.outcome != "matched"],
                   "grad": any(o.grad for o in outcomes)}
        except Exception as e:  # noqa: BLE001 - the harness itself failed on this op: recorded
            row = {"op": name, "dtype": dtype, "harness_error": f"{type(e).__name__}: {str(e)[:300]}",
                   "seconds": round(time.perf_counter() - start, 1)}
        torch._dynamo.reset()
        print(json.dumps(row), flush=True)


def _pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    import torch

    from opinfo.harness import full_name, op_db

    dtypes = args.dtypes.split(",") if args.dtypes else ALL_DTYPES
    out = []
    for op in op_db():
        name = full_name(op)
        if args.ops and not any(fnmatch.fnmatchcase(name, p) for p in args.ops.split(",")):
            continue
        supported = op.supported_dtypes("cpu")
        for dt in dtypes:
            if getattr(torch, dt) in supported:
                out.append((name, dt))
    return out


def _done(path: Path) -> set[tuple[str, str]]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done.add((row["op"], row["dtype"]))
    return done


def _sweep(args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    if args.fresh and out.exists():
        out.unlink()
    done = _done(out)
    todo = [p for p in _pairs(args) if p not in done]
    print(f"{len(todo)} op/dtype pairs to run ({len(done)} done already)", flush=True)
    queues = [todo[i::args.jobs] for i in range(args.jobs)]
    workers: list[dict] = [{"queue": q, "proc": None, "current": None, "since": 0.0} for q in queues]

    def start(w: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        w["proc"] = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     bufsize=1)
        for pair in w["queue"]:
            w["proc"].stdin.write(json.dumps(pair) + "\n")
        w["proc"].stdin.close()
        w["lines"] = queue.Queue()
        threading.Thread(target=lambda p=w["proc"], q=w["lines"]: [q.put(x) for x in p.stdout], daemon=True).start()

    for w in workers:
        if w["queue"]:
            start(w)
    with out.open("a") as sink:
        while any(w["proc"] is not None for w in workers):
            time.sleep(0.5)
            for w in workers:
                proc = w["proc"]
                if proc is None:
                    continue
                while not w["lines"].empty():
                    line = w["lines"].get()
                    if not line.startswith("{"):
                        continue
                    msg = json.loads(line)
                    if "start" in msg:
                        w["current"], w["since"] = tuple(msg["start"]), time.time()
                        continue
                    sink.write(json.dumps(msg) + "\n")
                    sink.flush()
                    w["queue"].remove((msg["op"], msg["dtype"]))
                    w["current"] = None
                    c = msg.get("counts", {})
                    bad = sum(v for k, v in c.items() if k in ("different", "no_error", "error_differs", "crashed"))
                    print(f"{msg['op']:45s} {msg['dtype']:8s} {msg.get('samples', 0):5d} samples "
                          f"{msg['seconds']:7.1f}s  bad {bad}" + (f"  {msg['harness_error']}" if "harness_error" in msg
                                                                 else ""), flush=True)
                timed_out = w["current"] is not None and time.time() - w["since"] > args.timeout
                if (proc.poll() is not None and w["lines"].empty()) or timed_out:
                    if timed_out:
                        proc.kill()
                        proc.wait()
                    if w["current"] is not None:
                        why = f"timeout after {args.timeout} s" if timed_out else f"worker died ({proc.returncode})"
                        sink.write(json.dumps({"op": w["current"][0], "dtype": w["current"][1],
                                               "unfinished": why}) + "\n")
                        sink.flush()
                        print(f"{w['current'][0]:45s} {w['current'][1]:8s} {why}", flush=True)
                        w["queue"].remove(w["current"])
                        w["current"] = None
                    w["proc"] = None
                    if w["queue"]:
                        start(w)
    _report(args)


def _report(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(args.out).read_text().splitlines()]
    by_op: dict[str, dict] = collections.defaultdict(lambda: collections.Counter())
    notes: dict[str, set] = collections.defaultdict(set)
    unfinished = []
    for r in rows:
        if "unfinished" in r or "harness_error" in r:
            unfinished.append(f"{r['op']} {r['dtype']}: {r.get('unfinished') or r.get('harness_error')}")
            continue
        c = by_op[r["op"]]
        c["samples"] += r["samples"]
        for k, v in r["counts"].items():
            c[k] += v
        c["dtypes"] += 1
        for o in r["outcomes"]:
            if o["outcome"] in ("routed", "known"):
                notes[r["op"]].add(o["detail"].split(": ", 1)[-1][:90] if o["outcome"] == "routed" else o["detail"][:90])
    total = collections.Counter()
    for c in by_op.values():
        total.update(c)
    bad_keys = ("different", "no_error", "error_differs", "crashed")
    lines = [
        "# PyTorch's OpInfo samples through ortlab",
        "",
        f"Made by `python benchmarks/opinfo_sweep.py` ({Path(args.out).name}); torch and onnxruntime versions in "
        "the run's environment.",
        "",
        f"- ops: {len(by_op)}; samples: {total['samples']}",
        f"- matched: {total['matched']}; errors alike: {total['errors_alike']}; routed to PyTorch with a reason: "
        f"{total['routed']}; known differences: {total['known']}",
        f"- **silently different: {total['different'] + total['no_error']}** (values {total['different']}, accepted "
        f"invalid input {total['no_error']}); other errors: {total['error_differs']}; crashed: {total['crashed']}",
        f"- op/dtype pairs not finished: {len(unfinished)}",
        "",
        "| op | dtypes | samples | matched | errors alike | routed | known | silently different | error differs "
        "| crashed | why routed / known |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(by_op):
        c = by_op[name]
        why = "; ".join(sorted(notes[name]))[:200].replace("|", "\\|")
        lines.append(f"| {name} | {c['dtypes']} | {c['samples']} | {c['matched']} | {c['errors_alike']} | "
                     f"{c['routed']} | {c['known']} | {c['different'] + c['no_error']} | {c['error_differs']} | "
                     f"{c['crashed']} | {why} |")
    if unfinished:
        lines += ["", "## Not finished", ""] + [f"- {u}" for u in unfinished]
    bad = [(r["op"], r["dtype"], o) for r in rows if "outcomes" in r for o in r["outcomes"] if o["outcome"] in bad_keys]
    if bad:
        lines += ["", "## Samples that differ", ""]
        for op, dt, o in bad:
            lines.append(f"- {op} {dt} {o['source']} {o['index']} ({o['sample'][:80]}): {o['outcome']}: "
                         f"{o['detail'][:200]}")
    (RESULTS / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:9]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", help="comma-separated (float32,int64,...); default every one")
    p.add_argument("--ops", help="comma-separated names or globs (add,nn.functional.*)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one op and dtype may take (default 900)")
    p.add_argument("--out", default=str(RESULTS / "sweep.jsonl"))
    p.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    p.add_argument("--report", action="store_true", help="only write the table from the results so far")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
    elif args.report:
        _report(args)
    else:
        _sweep(args)


if __name__ == "__main__":
    main()
