"""The stepper's stages without a browser: order, op counts, diffs, save/reload, graph breaks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch import nn

from ortlab.errors import ConfigError, OrtlabError
import ortlab
from ortlab.inspect.lab import LAB_STAGE_NAMES, Lab
from ortlab.inspect.lab_stage import OpDiff, Stage
from ortlab.inspect.loss import default_loss, output_weights
from ortlab.provenance import onnx_node_index
from ortlab.stages import StageArtifact, count_ops, file_name

explore = ortlab.explore  # the public entry point: it loads the notebook views too
from models import TanhNet  # tests/models.py (conftest puts tests/ on sys.path)


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()  # BREAK_LINE
        return self.fc2(h)


BREAK_LINE = next(i for i, line in enumerate(open(__file__).read().splitlines(), 1) if "# BREAK_LINE" in line)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """A lab of TanhNet stepped one stage at a time, with the statuses seen after each step.

    The whole lab runs here, before the per-test Dynamo reset of conftest.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TanhNet()
    lab = explore(model, torch.randn(4, 6), folder=str(tmp_path_factory.mktemp("lab")))
    grads_before = [p.grad for p in model.parameters()]
    seen = []
    while not lab.done:
        stage = lab.next()
        seen.append((stage.name, [s.status for s in lab.stages]))
    yield lab, seen, model, grads_before
    lab.close()


# ------------------------------------------------------------------------------------ pure
def test_stage_artifacts_are_labelled_and_named_for_people():
    art = StageArtifact("ort_all", 1, "train", "forward", "fused_0", content=b"")
    assert art.label == "g1.forward.fused_0" and art.kind == "onnx"
    assert file_name("net", art) == "net_g1_forward_fused_0_ort_all_train.onnx"
    assert file_name("my_net", StageArtifact("backward", 0, "train", "backward", content=None)) == "my_net_backward_train.py"
    assert StageArtifact("captured", 0, "eval").label == "g0"
    with pytest.raises(ortlab.InternalError, match="unknown stage"):
        StageArtifact("nope", 0, "train")


def test_count_ops_and_diff():
    class Two(nn.Module):
        def forward(self, a, b):
            return torch.ops.aten.mm.default(torch.ops.aten.t.default(torch.ops.aten.mm.default(a, b)), b)

    assert count_ops(torch.fx.symbolic_trace(Two())) == {"aten.mm": 2, "aten.t": 1}
    diff = OpDiff.between({"aten.mm": 2, "aten.t": 1}, {"aten.mm": 1, "aten.add": 3})
    assert diff.added == {"aten.add": 3} and diff.removed == {"aten.mm": 1, "aten.t": 1}
    assert (diff.before, diff.after, diff.changed) == (3, 4, True)
    assert "added aten.add +3" in str(diff)
    assert not OpDiff.between({"a": 1}, {"a": 1}).changed


def test_default_loss_picks_scalar_or_weighted_sum():
    x = torch.ones(3, requires_grad=True)
    assert default_loss((x * 2, (x * 5).sum())).item() == 15.0
    assert default_loss({"a": x * 2}).item() == pytest.approx(float((x * 2 * output_weights(x)).sum()))
    assert default_loss(torch.ones(2)) is None


# ------------------------------------------------------------------------------- the stepper
def test_stages_run_in_order_one_at_a_time(stepped):
    lab, seen, _, _ = stepped
    assert [name for name, _ in seen] == list(LAB_STAGE_NAMES)
    for k, (_, statuses) in enumerate(seen, 1):
        assert all(s != "pending" for s in statuses[:k]), statuses
        assert all(s == "pending" for s in statuses[k:]), statuses
    assert all(s.status == "done" for s in lab.stages), str(lab)
    with pytest.raises(OrtlabError, match="every stage has run"):
        lab.next()
    assert lab["exported"] is lab[3] and lab.current is lab["step"]
    with pytest.raises(ConfigError, match="valid stages"):
        lab["nope"]


def test_op_counts_diffs_and_timings(stepped):
    lab, _, _, _ = stepped
    captured, joint, split = lab["captured"], lab["joint"], lab["split"]
    assert captured.op_counts == {"linear": 2, "tanh": 1, "call_method:sum": 1}
    assert joint.op_counts["aten.addmm"] == 2 and joint.op_counts["aten.mm"] >= 2
    assert joint.diff.added["aten.addmm"] == 2 and joint.diff.removed["linear"] == 2
    # Without recompute the forward and backward hold the joint graph's ops; only views are
    # re-applied in the backward (the forward hands it their bases: a view is a copy in onnxruntime).
    assert not split.diff.removed and set(split.diff.added) <= {"aten.t", "aten.view", "aten.transpose", "aten.permute"}
    assert {k: v for k, v in split.op_counts.items() if k not in split.diff.added} == {
        k: v for k, v in joint.op_counts.items() if k not in split.diff.added}
    assert set(split.artifacts) == {"g0.forward", "g0.backward"}
    exported = lab["exported"]
    assert exported.op_counts["Gemm"] >= 2 and "aten.addmm" in exported.diff.removed
    assert set(exported.graph_op_counts) == {"g0.forward", "g0.backward"}
    # onnxscript folds the exporter's Constant nodes; onnxruntime's levels fuse further.
    assert lab["onnxscript"].total_ops < exported.total_ops
    assert lab["ort_extended"].total_ops <= lab["ort_basic"].total_ops
    assert any(op.startswith("com.microsoft.") for op in lab["ort_extended"].op_counts)
    assert any("sessions run this level" in n for n in lab["ort_all"].notes)
    previous = None
    for stage in lab.stages:
        assert stage.seconds is not None and stage.seconds >= 0, stage.name
        assert stage.artifacts and all(os.path.exists(stage.artifact(label)) for label in stage.artifacts)
        assert sum(sum(c.values()) for c in stage.graph_op_counts.values()) == stage.total_ops
        if previous is not None:
            assert stage.previous == previous.name
            assert stage.diff == OpDiff.between(previous.op_counts, stage.op_counts)
        previous = stage
    assert lab["captured"].summary == {"graphs": 1, "graph_breaks": 0, "modes": ["train"]}
    assert any("ort_basic" in k for k in lab["ort_basic"].timings) or lab["ort_basic"].timings


def test_split_lists_saved_activations_with_their_onnx_node(stepped):
    lab, _, _, _ = stepped
    split = lab["split"]
    assert split.activations, split
    act = next(a for a in split.activations if a.op == "aten.tanh")
    assert act.graph == "g0" and act.shape == [4, 8] and act.dtype == "float32" and act.bytes == 128
    assert not act.recomputed and act.source.endswith("in forward") and TanhNet.forward.__code__.co_filename in act.source
    index = onnx_node_index(lab["exported"].artifact("g0.forward"))
    assert act.onnx_node == index[act.name]
    assert split.summary["saved_bytes"] == split.summary["baseline_bytes"] == sum(a.bytes for a in split.activations)


def test_step_trains_through_onnxruntime_and_restores_grads(stepped):
    lab, _, model, grads_before = stepped
    step = lab["step"]
    s = step.summary
    assert math.isfinite(s["loss"]) and s["grads_finite"] and s["params_with_grad"] == "4/4"
    assert s["grad_norm"] > 0 and s["onnxruntime_partitions"] == 2 and s["pytorch_ops"] == 0
    assert set(step.artifacts) == {"g0.forward", "g0.backward"}
    assert [p.grad for p in model.parameters()] == grads_before  # .grad put back as it was
    assert len(lab.report.captures) == 1  # the step reused the captured graph (no re-capture)
    # Which providers run each graph, and why (measured by the race where there were candidates).
    records = {g.label: g for c in lab.report.captures for g in c.graphs}
    assert set(records) == {"g0.forward", "g0.backward"}
    assert all(s[f"{label} providers"] == g.providers_now and "ExecutionProvider" in g.providers
               for label, g in records.items()), s
    for label, g in records.items():
        assert f"{label} runs on {g.providers_now}." in step.notes
        assert all(n in step.notes for n in g.notes if " providers: " in n)


def test_save_and_reload_round_trip(stepped, tmp_path):
    lab, _, _, _ = stepped
    folder = lab.save(str(tmp_path / "saved"))
    again = Lab.load(folder)
    assert [s.to_dict() for s in again.stages] == [s.to_dict() for s in lab.stages]
    assert again.meta["model"] == "TanhNet" and again.meta["prefix"] == "tanhnet"
    for stage in again.stages:
        for label in stage.artifacts:
            assert stage.artifact(label).startswith(str(tmp_path)) and os.path.exists(stage.artifact(label))
    with open(os.path.join(folder, "lab.json")) as f:
        assert json.load(f)["format"] == "ortlab.lab"
    # The lab's own folder is re-openable too (lab.json is written after every stage).
    assert Lab.load(lab.folder)["split"].activations == lab["split"].activations
    # A single stage.
    stage_dir = lab["split"].save(str(tmp_path / "split"))
    one = Stage.load(stage_dir)
    assert one.to_dict() == lab["split"].to_dict() and os.path.exists(one.artifact("g0.backward"))
    assert "split" in str(one) and "[done]" in str(one)


def test_reopened_lab_cannot_run_pending_stages(tmp_path):
    lab = explore(TanhNet(), torch.randn(2, 6), folder=str(tmp_path / "lab"))
    lab.next()
    again = Lab.load(lab.save(str(tmp_path / "partial")))
    assert again["captured"].status == "done" and again["joint"].status == "pending"
    with pytest.raises(OrtlabError, match="reopened from"):
        again.next()


def test_a_temporary_lab_is_deleted_on_close():
    lab = explore(TanhNet(), torch.randn(2, 6))
    lab.next()
    assert os.path.exists(os.path.join(lab.folder, "lab.json"))
    lab.close()
    assert not os.path.exists(lab.folder)
    with pytest.raises(OrtlabError, match="closed"):
        lab.next()


def test_graph_breaks_are_shown_with_reasons(tmp_path):
    lab = explore(Broken(), torch.randn(4, 6), folder=str(tmp_path / "lab"))
    captured = lab.next()
    assert captured.summary["graphs"] == 2 and captured.summary["graph_breaks"] == 1
    (brk,) = captured.graph_breaks
    assert "graph_break()" in brk.reason and brk.count == 1
    assert brk.location == f"{__file__}:{BREAK_LINE} in forward"
    assert "Explanation" in brk.detail
    assert set(captured.artifacts) == {"g0", "g1"}
    html = captured._repr_html_()
    assert "graph_break()" in html and f"{BREAK_LINE} in forward" in html
    # Both graphs go through every stage, named g0 and g1.
    assert set(lab.run("exported").graph_op_counts) == {"g0.forward", "g0.backward", "g1.forward", "g1.backward"}


def test_no_grad_model_skips_the_joint_graph(tmp_path):
    model = TanhNet().requires_grad_(False)
    lab = explore(model, torch.randn(2, 6), folder=str(tmp_path / "lab"))
    lab.run()
    assert lab["captured"].summary["modes"] == ["eval"]
    assert lab["joint"].status == "skipped" and "eval mode" in lab["joint"].notes[0]
    assert set(lab["split"].artifacts) == {"g0.inference"}
    assert lab["split"].previous == "captured"  # the diff skips the skipped stage
    assert any("No backward" in n for n in lab["step"].notes)


def test_a_failed_stage_blocks_the_next(tmp_path):
    lab = explore(Broken(), torch.randn(2, 6), folder=str(tmp_path / "lab"), fallback="raise")
    stage = lab.next(raise_errors=False)
    assert stage.status == "failed" and stage.error
    with pytest.raises(OrtlabError, match="'captured' failed"):
        lab.next()


def test_importing_the_stepper_imports_no_notebook_library():
    code = (
        "import sys, ortlab, ortlab.inspect.explore, ortlab.inspect.lab, ortlab.ui.stepper, ortlab.ui.netron_view\n"
        "bad = [m for m in ('ipywidgets', 'netron', 'plotly', 'IPython') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
