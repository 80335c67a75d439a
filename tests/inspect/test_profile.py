"""Per-kernel profiles: parsing onnxruntime's JSON, mapping nodes to modules, aggregating.

The real profiles come from a tiny ORTModule trained a few steps, once with
``profile=True`` (read at the end) and once through profiling windows.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ortlab
from ortlab.inspect.memory import (
    MemorySample,
    cuda_memory,
    peak_rss_bytes,
    rss_bytes,
    sample_memory,
    saved_activation_bytes,
)
from ortlab.inspect.profile import (
    NodeTime,
    aggregate,
    by_module,
    by_op_type,
    count_runs,
    merge,
    parse_profile,
    top_nodes,
)
from ortlab.inspect.profile_window import ProfileWindow, collect_profile
from ortlab.models import TinyMLP, make_batch
from ortlab.provenance import node_provenance, onnx_node_of


def _train(om: torch.nn.Module, steps: int) -> None:
    x, y = make_batch("tiny", 16, torch.Generator().manual_seed(0))
    for _ in range(steps):
        torch.nn.functional.cross_entropy(om(x), y).backward()


def _parts(om: ortlab.ORTModule) -> list:
    return [(g.label, p.runner, p.exported) for c in om.report.captures for g in c.graphs for p in g.parts]


@pytest.fixture
def profiled_tiny():
    """A TinyMLP trained 3 steps with profile=True: (module, [(graph, events, exported)])."""
    om = ortlab.ORTModule(TinyMLP(), profile=True)
    _train(om, 3)
    profiles = []
    for graph, runner, exported in _parts(om):
        path = runner.session.end_profiling()
        with open(path, encoding="utf-8") as f:
            profiles.append((graph, json.load(f), exported))
        os.remove(path)
    return om, profiles


def test_onnx_node_of_strips_onnxruntime_renames():
    assert onnx_node_of("node_mm_kernel_time") == "node_mm"
    assert onnx_node_of("node_addmm/GemmTransposeFusion/_kernel_time") == "node_addmm"
    assert onnx_node_of("fused node_addmm/GemmTransposeFusion/_kernel_time") == "node_addmm"
    assert onnx_node_of("node_t_1") == "node_t_1"


def test_parse_real_profile_maps_every_kernel_to_the_model(profiled_tiny):
    _, profiles = profiled_tiny
    assert {g for g, _, _ in profiles} == {"g0.forward", "g0.backward"}
    for graph, events, exported in profiles:
        kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        records = parse_profile(events, exported.model, graph=graph)
        assert records, f"no kernel records in the {graph} profile"
        # Every kernel event is counted once, with its duration.
        assert sum(r.count for r in records) == len(kernels)
        assert sum(r.dur_us for r in records) == pytest.approx(sum(float(e["dur"]) for e in kernels))
        assert count_runs(events) == 3
        assert all(r.count % 3 == 0 for r in records), "each node runs once per step"
        names = {n.name for n in exported.model.graph}
        for r in records:
            assert r.node in names, f"{r.node} is not a node of the exported {graph} graph"
            assert r.graph == graph and r.op_type and r.provider == "CPUExecutionProvider"
            assert r.module in ("net.0", "net.1", "net.2"), r
            assert r.op.startswith("aten.") and r.fx_node and "models.py" in r.source
        assert [r.dur_us for r in records] == sorted((r.dur_us for r in records), reverse=True)
    forward = next(parse_profile(e, x.model) for g, e, x in profiles if g == "g0.forward")
    # onnxruntime fuses Transpose+Gemm on CPU: the fused kernel maps to the Gemm node of net.0.
    gemm = next(r for r in forward if r.node == "node_addmm")
    assert gemm.module == "net.0" and gemm.op == "aten.addmm" and gemm.fx_node == "addmm"


def test_skip_runs_drops_the_first_run(profiled_tiny):
    _, profiles = profiled_tiny
    graph, events, exported = profiles[0]
    all_runs = parse_profile(events, exported.model)
    later = parse_profile(events, exported.model, skip_runs=1)
    assert {r.node: r.count for r in later} == {r.node: r.count * 2 // 3 for r in all_runs}
    assert parse_profile(events, exported.model, skip_runs=5) == []


def test_parse_reads_a_file_and_works_without_a_model(tmp_path, profiled_tiny):
    _, profiles = profiled_tiny
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profiles[0][1]))
    records = parse_profile(str(path))
    assert records and all(r.module == "" and r.fx_node == "" for r in records)


def test_unknown_nodes_are_marked_and_prefix_matched():
    events = [
        {"cat": "Node", "name": "node_mm_kernel_time", "dur": 10, "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "node_mm_new_reshape_kernel_time", "dur": 2, "args": {"op_name": "Reshape"}},
        {"cat": "Node", "name": "made_up_kernel_time", "dur": 3, "args": {"op_name": "Cast"}},
        {"cat": "Node", "name": "n0_kernel_time", "dur": 1, "args": {"op_name": "Erf"}},
        {"cat": "Node", "name": "node_mm_fence_before", "dur": 0, "args": {}},
        {"cat": "Session", "name": "model_run", "dur": 20, "ts": 0},
    ]
    prov = {"node_mm": {"fx_node": "mm", "module": "head", "op": "aten.mm", "source": "m.py:1 in f"},
            "n0": {"fx_node": "", "module": "", "op": "", "source": ""}}  # onnxscript's, without metadata
    records = {r.node: r for r in parse_profile(events, provenance=prov)}
    assert set(records) == {"node_mm", "node_mm_new_reshape", "made_up", "n0"}
    assert records["node_mm_new_reshape"].module == "head"  # added by onnxruntime next to node_mm
    assert records["made_up"].module == "<unknown>" and records["n0"].module == "<unknown>"  # not the root module


def _records() -> list[NodeTime]:
    return [
        NodeTime("a", "Gemm", 60.0, 2, graph="g0.forward", module="blocks.0.fc"),
        NodeTime("b", "Gemm", 20.0, 2, graph="g0.backward", module="blocks.1.fc"),
        NodeTime("c", "Relu", 15.0, 2, graph="g0.forward", module="blocks.0"),
        NodeTime("d", "Add", 5.0, 2, graph="g0.forward", module=""),
    ]


def test_aggregations():
    recs = _records()
    ops = by_op_type(recs)
    assert [(g.key, g.dur_us, g.count) for g in ops] == [("Gemm", 80.0, 4), ("Relu", 15.0, 2), ("Add", 5.0, 2)]
    assert sum(g.share for g in ops) == pytest.approx(1.0)
    assert ops[0].share == pytest.approx(0.8)
    mods = by_module(recs)
    assert [g.key for g in mods] == ["blocks.0.fc", "blocks.1.fc", "blocks.0", "<root>"]
    by_block = [(g.key, g.dur_us) for g in by_module(recs, depth=2)]
    assert by_block == [("blocks.0", 75.0), ("blocks.1", 20.0), ("<root>", 5.0)]
    assert [r.node for r in top_nodes(recs, 2)] == ["a", "b"]
    assert [g.key for g in aggregate(recs, lambda r: r.graph)] == ["g0.forward", "g0.backward"]
    assert by_op_type([]) == []


def test_merge_sums_the_same_node_and_keeps_inputs():
    recs = _records()
    merged = merge(recs, recs[:1])
    a = next(r for r in merged if r.node == "a")
    assert (a.dur_us, a.count) == (120.0, 4)
    assert recs[0].dur_us == 60.0, "merge must not modify its inputs"
    assert NodeTime.from_dict(a.to_dict()) == a


def test_node_provenance_of_onnx_ir_and_proto(profiled_tiny):
    import onnx_ir as ir

    _, profiles = profiled_tiny
    model = profiles[0][2].model
    from_ir = node_provenance(model)
    from_proto = node_provenance(ir.to_proto(model))
    assert from_ir == from_proto and from_ir["node_addmm"]["module"] == "net.0"


def test_collect_profile_of_a_profiling_module():
    om = ortlab.ORTModule(TinyMLP(), profile=True)
    _train(om, 2)
    records = collect_profile(om, remove_files=True)
    assert {r.graph for r in records} == {"g0.forward", "g0.backward"}
    assert all(r.count % 2 == 0 for r in records)
    assert by_module(records)[0].key.startswith("net.")


def test_profile_window_profiles_only_inside_the_window():
    # Pinned: where OpenVINO runs, the provider race may pick it for a graph this small (by noise),
    # and its kernels are one compiled subgraph with no module of ours, where this test maps
    # each kernel to net.0-net.2.
    om = ortlab.ORTModule(TinyMLP(), providers=["CPUExecutionProvider"])
    _train(om, 1)
    originals = [r.session for _, r, _ in _parts(om)]
    window = ProfileWindow(om)
    mine = f"ortlab_profile_{os.getpid()}_"
    before = {f for f in os.listdir(window.folder) if f.startswith(mine)}  # other tests' profile=True files
    assert window.start() == 2 and window.active
    assert all(r.session is not s for (_, r, _), s in zip(_parts(om), originals)), "twins swapped in"
    _train(om, 4)
    records = window.stop()
    assert not window.active
    assert [r.session for _, r, _ in _parts(om)] == originals, "original sessions restored"
    assert window.runs == {"g0.forward": 3, "g0.backward": 3}  # 4 runs, the first skipped
    assert records and all(r.count == 3 for r in records)
    assert {r.module for r in records} <= {"net.0", "net.1", "net.2"}
    assert window.stop() == []  # nothing active: nothing to read
    # Training after the window runs unprofiled, with no re-capture.
    _train(om, 2)
    assert len(om.report.captures) == 1
    leftovers = {f for f in os.listdir(window.folder) if f.startswith(mine)} - before
    assert leftovers == set(), "profile files are removed after reading"


def test_profile_window_keeps_results_identical():
    torch.manual_seed(0)
    a, b = TinyMLP(), TinyMLP()
    b.load_state_dict(a.state_dict())
    oa, ob = ortlab.ORTModule(a), ortlab.ORTModule(b)
    _train(oa, 1)
    _train(ob, 1)
    window = ProfileWindow(ob)
    window.start()
    _train(oa, 2)
    _train(ob, 2)
    window.stop()
    for pa, pb in zip(oa.parameters(), ob.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)


def test_memory_readings():
    assert rss_bytes() > 10 * 2**20
    assert peak_rss_bytes() >= rss_bytes() // 2
    om = ortlab.ORTModule(TinyMLP())
    assert saved_activation_bytes(om) == 0  # nothing captured yet
    _train(om, 1)
    saved = saved_activation_bytes(om)
    assert saved == om.report.saved_activation_bytes > 0
    sample = sample_memory(om)
    assert isinstance(sample, MemorySample) and sample.saved_activations == saved
    flat = sample.to_dict()
    assert flat["saved_bytes"] == saved and flat["rss_bytes"] > 0
    if cuda_memory() is None:
        assert not any(k.startswith("cuda") for k in flat)
