"""One training step on one time axis: PyTorch's events and onnxruntime's kernels.

A tiny GPT is trained a few steps under the monitor, which records one step as a
timeline (``mon.record_timeline()``); the checks read it as a user would: onnxruntime's
kernels inside their session runs, PyTorch's optimizer and aten ops, the forward before
the backward, node/module/source on every kernel, a valid Chrome trace, a summary that
adds up. The pure parts (placing kernels, splitting the time) are checked on small events.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import ortlab
from ortlab.errors import OrtlabError
from ortlab.inspect.timeline import Timeline, TimelineEvent, place_kernels, summarize
from ortlab.models import GPT, GPTConfig, make_batch

CONFIG = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=1, block_size=16)
EPS_US = 1.0  # rounding of the profilers' microseconds


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        idx, targets = make_batch("gpt", 2, vocab=CONFIG.vocab, block_size=CONFIG.block_size)
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad()


def _recorded(model: torch.nn.Module) -> tuple[ortlab.ui.Monitor, Timeline]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = ortlab.monitor(model, every=5, show=False)
    _train(model, opt, 2)
    report = getattr(model, "report", None)  # None for a plain nn.Module
    runners = [p.runner for c in (report.captures if report else []) for g in c.graphs for p in g.parts]
    sessions = [r.session for r in runners]
    step = mon.record_timeline()
    _train(model, opt, 4)
    mon.detach()
    timeline = mon.timeline()
    assert timeline.step == step
    # Recording leaves the module as it was: its own sessions back, no spans around their runs.
    assert [r.session for r in runners] == sessions and all(r.span is None for r in runners)
    return mon, timeline


@pytest.fixture(scope="module")
def recorded() -> tuple[ortlab.ui.Monitor, Timeline]:
    torch.manual_seed(0)
    return _recorded(ortlab.ORTModule(GPT(CONFIG)))


def _inside(inner: TimelineEvent, outer: TimelineEvent) -> bool:
    return outer.start_us - EPS_US <= inner.start_us and inner.end_us <= outer.end_us + EPS_US


def test_kernels_lie_inside_their_session_run(recorded):
    _, tl = recorded
    runs, kernels = tl.of_kind("run"), tl.of_kind("kernel")
    assert tl.graphs == ["g0.forward", "g0.backward"], tl.graphs
    assert [r.name for r in runs] == ["g0.forward", "g0.backward"]  # one run each in one step
    assert len(kernels) > 50
    for graph in tl.graphs:
        of_graph = [k for k in kernels if k.args["graph"] == graph]
        assert of_graph, graph
        (run,) = [r for r in runs if r.name == graph]
        outside = [k for k in of_graph if not _inside(k, run)]
        assert not outside, (run, outside[:3])
        assert sum(k.dur_us for k in of_graph) <= run.dur_us + EPS_US


def test_pytorch_events_are_recorded(recorded):
    _, tl = recorded
    names = {e.name for e in tl.of_kind("torch")}
    assert "Optimizer.step#AdamW.step" in names
    assert any(n.startswith("aten::") for n in names)
    assert any("CompiledFunctionBackward" in n for n in names)  # autograd's glue around the backward graph
    optimizer = next(e for e in tl.of_kind("torch") if e.name == "Optimizer.step#AdamW.step")
    assert optimizer.depth == 0  # called by the step itself
    inner = [e for e in tl.of_kind("torch") if e.name.startswith("aten::") and _inside(e, optimizer)]
    assert inner and all(e.depth > 0 for e in inner)


def test_one_time_axis(recorded):
    mon, tl = recorded
    kernels = tl.of_kind("kernel")
    forward = [k for k in kernels if k.args["graph"] == "g0.forward"]
    backward = [k for k in kernels if k.args["graph"] == "g0.backward"]
    optimizer = next(e for e in tl.of_kind("torch") if e.name.startswith("Optimizer.step"))
    # The forward's kernels run before the backward's, both before the optimizer step.
    assert max(k.end_us for k in forward) <= min(k.start_us for k in backward)
    assert max(k.end_us for k in backward) <= optimizer.start_us
    # The session runs nest in the PyTorch calls that made them (two profilers, one axis).
    compiled = next(e for e in tl.of_kind("torch") if e.name == "CompiledFunction")
    backward_node = next(e for e in tl.of_kind("torch") if e.name == "CompiledFunctionBackward")
    runs = {r.name: r for r in tl.of_kind("run")}
    assert _inside(runs["g0.forward"], compiled) and _inside(runs["g0.backward"], backward_node)
    # Everything lies within the step, whose length is the monitor's own reading of it.
    assert all(-EPS_US <= e.start_us and e.end_us <= tl.end_us + EPS_US for e in tl.events)
    step_s = mon.data[tl.step - 1]["step_s"]
    assert tl.end_us / 1e6 == pytest.approx(step_s, rel=0.1, abs=2e-3), (tl.end_us, step_s)


def test_kernels_carry_node_module_and_source(recorded):
    _, tl = recorded
    kernels = tl.of_kind("kernel")
    assert all(k.args["node"] == k.name and k.args["op_type"] for k in kernels)
    with_source = [k for k in kernels if re.search(r"models\.py:\d+ in ", k.args.get("source", ""))]
    assert len(with_source) >= len(kernels) // 2, len(with_source)
    modules = {k.args["module"] for k in kernels}
    assert any(m.startswith("blocks.0.") for m in modules), modules


def test_export_trace_is_a_chrome_trace(recorded, tmp_path):
    mon, tl = recorded
    path = mon.export_trace(tmp_path / "step.json")
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tl.events) + 1  # and the step itself
    for e in complete:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= -EPS_US and e["dur"] >= 0
    lanes = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"PyTorch", "onnxruntime g0.forward", "onnxruntime g0.backward"} <= set(lanes)
    kernel = next(e for e in complete if e["cat"] == "kernel" and e["args"].get("source"))
    assert kernel["pid"] == lanes[f"onnxruntime {kernel['args']['graph']}"]
    assert {"node", "op_type", "source", "graph"} <= set(kernel["args"])
    assert any(e["cat"] == "torch" and e["name"].startswith("Optimizer.step") for e in complete)


def test_summary_adds_up(recorded):
    _, tl = recorded
    s = tl.summary
    parts = (s.ort_kernels_us, s.ort_other_us, s.torch_us, s.gaps_us)
    assert all(p >= 0 for p in parts) and s.ort_kernels_us > 0 and s.torch_us > 0
    assert sum(parts) == pytest.approx(s.step_us, rel=1e-9)
    assert s.ort_kernels_us <= sum(k.dur_us for k in tl.of_kind("kernel")) + EPS_US
    assert s.ort_kernels_us + s.ort_other_us == pytest.approx(sum(r.dur_us for r in tl.of_kind("run")), abs=EPS_US)
    assert "onnxruntime kernels" in s.line() and "gaps" in s.line()


def test_ops_that_fell_back_are_in_the_pytorch_lane():
    torch.manual_seed(0)
    _, tl = _recorded(ortlab.ORTModule(GPT(CONFIG), fallback_ops=["aten.gelu"]))
    gelu = [e for e in tl.of_kind("torch") if e.name == "aten::gelu"]
    assert gelu, sorted({e.name for e in tl.of_kind("torch")})
    # Marked with the reason ortlab placed it in PyTorch, and the module and line that called it.
    assert all("named in fallback_ops" in e.args["fell_back"] for e in gelu), gelu
    assert gelu[0].args["module"] == "blocks.0" and "models.py:" in gelu[0].args["source"], gelu[0]
    assert not any("fell_back" in e.args for e in tl.of_kind("torch") if e.name.startswith("Optimizer"))
    forward_parts = [r for r in tl.of_kind("run") if ".forward" in r.name]
    assert len(forward_parts) >= 2  # the forward is split around the op that fell back
    assert any(a.end_us <= gelu[0].start_us + EPS_US and gelu[0].end_us <= b.start_us + EPS_US
               for a, b in zip(forward_parts, forward_parts[1:]))
    assert all(not _inside(g, r) for g in gelu for r in tl.of_kind("run"))


def test_a_step_without_onnxruntime_says_so():
    torch.manual_seed(0)
    _, tl = _recorded(GPT(CONFIG))  # a plain nn.Module: everything in PyTorch
    assert tl.graphs == [] and not tl.of_kind("kernel") and not tl.of_kind("run")
    assert "no onnxruntime graph ran in step 3" in tl.notes[0] and "plain nn.Module" in tl.notes[0]
    assert tl.summary.ort_kernels_us == 0 and tl.summary.torch_us > 0
    assert any(e.name == "aten::addmm" or e.name == "aten::linear" for e in tl.of_kind("torch"))


def test_timeline_without_a_recording_arms_one_and_says_which_step():
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    mon = ortlab.monitor(model, show=False)
    _train(model, opt, 1)
    with pytest.raises(OrtlabError, match=r"no timeline recorded yet: step 2 will be recorded"):
        mon.timeline()
    with pytest.raises(OrtlabError, match=r"step 2 will be recorded as a timeline; it has not run yet"):
        mon.timeline()
    _train(model, opt, 2)
    assert mon.timeline().step == 2
    mon.close()


def test_a_timeline_waits_for_the_provider_race(monkeypatch):
    """Parts still measuring their execution providers run the race's sessions, which would swap the
    recorder's profiling twins out: an armed recording waits until they have decided, and says so."""
    from ortlab.runtime import race as race_module
    from ortlab.runtime import session as session_module

    # onnxruntime's Azure provider (it hands every node to the CPU provider) is a candidate that builds anywhere
    monkeypatch.setattr(session_module, "cpu_candidates",
                        lambda: (["CPUExecutionProvider", "AzureExecutionProvider"], {}))
    torch.manual_seed(0)
    model = ortlab.ORTModule(GPT(CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = ortlab.monitor(model, every=100, show=False)
    _train(model, opt, 1)  # the race checks its candidate; the next calls time the entrants
    runners = [r for c in model.report.captures for g in c.graphs for r in g.runners]
    assert any(race_module.under_way(r) for r in runners)
    mon.record_timeline()
    _train(model, opt, 1)
    with pytest.raises(OrtlabError, match=r"it waits while \d+ part\(s\) are still measuring their execution"):
        mon.timeline()
    steps = 2
    while any(race_module.under_way(r) for r in runners) and steps < 20:
        _train(model, opt, 1)
        steps += 1
    _train(model, opt, 3)  # the warm-up step, the recorded one, and the boundary that ends it
    mon.detach()
    timeline = mon.timeline()
    assert timeline.step > steps and any(e.lane.startswith("onnxruntime") for e in timeline.events)
    mon.close()


# ----------------------------------------------------------------------------- pure parts
def _ort(runs: list[tuple[int, int]], kernels: list[tuple[str, int, int]]) -> list[dict]:
    return ([{"cat": "Session", "name": "model_run", "ts": ts, "dur": dur} for ts, dur in runs]
            + [{"cat": "Node", "name": f"{n}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": "MatMul"}}
               for n, ts, dur in kernels])


def test_place_kernels_skips_warmup_runs_and_centres_each_run():
    events = _ort([(0, 50), (1000, 10), (2000, 20)], [("warm", 5, 40), ("a", 1002, 4), ("b", 2010, 5)])
    kernels, notes = place_kernels([(300.0, 14.0), (400.0, 20.0)], events, "g0.forward",
                                   {"a": {"fx_node": "mm", "module": "fc", "op": "aten.mm", "source": "m.py:3 in f"}})
    assert [(k.name, k.start_us, k.dur_us) for k in kernels] == [("a", 304.0, 4.0), ("b", 410.0, 5.0)]
    assert kernels[0].args["module"] == "fc" and kernels[0].args["source"] == "m.py:3 in f"
    assert notes == ["g0.forward: kernels placed within ±2 us (each run centred in its span)"]


def test_place_kernels_says_when_runs_are_missing():
    kernels, notes = place_kernels([(0.0, 10.0), (20.0, 10.0)], _ort([(0, 5)], []), "g0.backward")
    assert kernels == [] and "has 1 runs for 2 recorded calls" in notes[0]


def test_summarize_counts_each_instant_once():
    events = [TimelineEvent("CompiledFunction", "torch", "PyTorch", 0.0, 60.0),
              TimelineEvent("g0.forward", "run", "onnxruntime g0.forward", 10.0, 40.0),
              TimelineEvent("k1", "kernel", "onnxruntime g0.forward", 15.0, 10.0),
              TimelineEvent("k2", "kernel", "onnxruntime g0.forward", 20.0, 10.0),  # overlaps k1
              TimelineEvent("aten::add", "torch", "PyTorch", 70.0, 50.0)]  # runs past the step's end
    s = summarize(events, 100.0)
    assert (s.ort_kernels_us, s.ort_other_us, s.torch_us, s.gaps_us) == (15.0, 25.0, 50.0, 10.0)


def test_recording_a_timeline_writes_nothing_to_stderr():
    """Note [Kineto's USDT lines]: kineto's profiler_start/stop lines were red stderr under every timeline cell."""
    import subprocess
    import sys

    code = ("import torch, ortlab\nfrom ortlab.models import TinyMLP\nom = ortlab.ORTModule(TinyMLP())\n"
            "for _ in range(3): om(torch.randn(4, 64)).sum().backward()\n"
            "mon = ortlab.monitor(om, show=False)\nmon.record_timeline()\n"
            "for _ in range(3): om(torch.randn(4, 64)).sum().backward()\nmon.close()\nprint('recorded')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "recorded" in run.stdout, run.stderr
    assert "USDT" not in run.stderr and "profiler_start" not in run.stderr, run.stderr


def test_a_timeline_armed_before_the_first_step_skips_the_capture():
    """Issue 43, item 12: armed before the first step it recorded the compile step (seconds, 'all in PyTorch')."""
    import torch

    import ortlab
    from ortlab.models import TinyMLP

    om = ortlab.ORTModule(TinyMLP())
    mon = ortlab.monitor(om, show=False)
    mon.record_timeline()
    for _ in range(5):
        om(torch.randn(4, 64)).sum().backward()
    mon.close()
    timeline = mon.timeline()
    assert timeline is not None and timeline.step >= 3, timeline
    assert any(e.lane.startswith("onnxruntime") for e in timeline.events), [e.lane for e in timeline.events][:20]
