"""The stepper's HTML and widget: stages render their tables; rows link to netron nodes."""

from __future__ import annotations

import html
import re
import urllib.parse
import urllib.request

import pytest
import torch

from ortlab.inspect.explore import explore
from ortlab.inspect.lab_stage import ActivationRow, FallbackRow, GraphBreak, OpDiff, Stage
from ortlab.ui import netron_view
from ortlab.ui.stepper import StepperWidget, lab_html, stage_html
from models import TanhNet  # tests/models.py (conftest puts tests/ on sys.path)


@pytest.fixture
def no_server():
    netron_view.stop_default_server()
    yield
    netron_view.stop_default_server()


def _links(page: str) -> list[str]:
    return [html.unescape(u) for u in re.findall(r"href='([^']+)'", page)]


def test_stage_html_shows_counts_changes_and_tables(no_server):
    stage = Stage(
        "split", "Forward/backward split", "desc", status="done",
        op_counts={"aten.mm": 3, "aten.t": 2}, graph_op_counts={"g0.forward": {"aten.mm": 1}},
        diff=OpDiff.between({"aten.mm": 3, "aten.detach": 1}, {"aten.mm": 3, "aten.t": 2}), previous="joint",
        seconds=0.0123, timings={"g0.forward (from file times)": 0.01},
        graph_breaks=[GraphBreak("Call to <graph_break>", 2, "m.py:3 in forward", "long\ntext")],
        activations=[ActivationRow("tanh", "aten.tanh", [4, 8], "float32", 128, "fc1", "m.py:4 in forward", False, graph="g0")],
        fallbacks=[FallbackRow("op", "g0.forward", "random op", "drop", "aten.native_dropout", "drop", "m.py:5", values=["drop"])],
        summary={"saved": 1, "recomputed": 0, "saved_bytes": 128, "baseline_bytes": 128, "loss": 0.5},
        notes=["g0: recompute='none'"],
    )
    page = stage_html(stage)
    assert "Forward/backward split" in page and "done" in page and "12.3 ms" in page
    assert "<code>aten.t</code>" in page and "+2" in page and "aten.detach" in page and "-1" in page
    assert "Call to &lt;graph_break&gt;" in page and "<graph_break>" not in page  # escaped
    assert "m.py:3 in forward" in page and "<details>" in page
    assert "tanh" in page and "128 B" in page and "fc1" in page
    assert "aten.native_dropout" in page and "random op" in page
    assert "Timings" in page and "recompute=&#x27;none&#x27;" in page
    assert not _links(page)  # no graph view running: no links, no server started
    assert netron_view.running_default_server() is None
    assert "Not run yet" in stage_html(Stage("joint", "Joint", "d"))


@pytest.mark.filterwarnings("ignore::ortlab.errors.FallbackWarning")
def test_rows_link_to_their_node_in_netron(tmp_path, no_server):
    # tanh runs in PyTorch: its row links to the partition that reads its result.
    lab = explore(TanhNet(), torch.randn(4, 6), folder=str(tmp_path / "lab"), fallback_ops=["aten.tanh"])
    lab.run()
    exported, split = lab["exported"], lab["split"]
    (fb,) = [f for f in exported.fallbacks if f.op == "aten.tanh"]
    assert fb.where == "g0.forward" and fb.node in fb.values and len(fb.values) > 1
    view = exported.view()  # opening a graph starts the server: tables now link
    server = netron_view.running_default_server()
    assert server is not None and view.server is server
    frame = netron_view.frame_name(lab.folder)
    assert f"name=\"{frame}_" in view._repr_html_() and view.frame.startswith(f"{frame}_")
    page = stage_html(split)
    assert f"target='{frame}'" in page
    act = next(a for a in split.activations if a.onnx_node)
    wanted = [u for u in _links(page) if f"node={urllib.parse.quote(act.onnx_node)}" in u]
    assert wanted, _links(page)
    with urllib.request.urlopen(wanted[0].replace(server.url(), server.local_url()), timeout=10) as r:
        assert r.status == 200 and b"data/" in r.read()
    # The link opens the partition that reads the fallback's result, at that input.
    import onnx

    (link,) = [u for u in _links(stage_html(exported)) if "node=" in u]
    query = urllib.parse.parse_qs(urllib.parse.urlparse(link).query)
    (part,) = [rel for rel in exported.artifacts.values() if rel == query["file"][0]]
    inputs = [v.name for v in onnx.load(str(tmp_path / "lab" / part)).graph.input]
    assert query["node"][0] in fb.values and query["node"][0] in inputs
    lab.close()


def test_lab_html_and_widget_step_through(tmp_path, no_server):
    lab = explore(TanhNet(), torch.randn(4, 6), folder=str(tmp_path / "lab"))
    page = lab_html(lab)
    assert page.count("pending") == 9 and "lab.next()" in page
    stepper = StepperWidget(lab)
    stepper.next_button.click()
    assert lab["captured"].status == "done" and "captured (done)" in stepper.stage.options[0][0]
    assert "Captured graph" in stepper.body.value and list(stepper.graph.options) == ["g0"]
    assert stepper.graph.value == "g0"  # shown selected, not blank
    stepper.view_button.click()  # an FX stage shows its code
    assert "GraphModule" in stepper.viewer.value
    stepper.all_button.click()
    assert lab.done and stepper.next_button.disabled
    stepper.stage.value = "exported"
    stepper.graph.value = "g0.backward"
    stepper.view_button.click()
    assert "<iframe" in stepper.viewer.value and "backward_exported" in stepper.viewer.value
    assert "&rarr;" in lab_html(lab) and "no change" in lab_html(lab)
    # onnxruntime's optimized models lose node metadata; their view gets the source back.
    import onnx

    view = lab["ort_all"].view("g0.forward")
    modules = {p.value for n in onnx.load(view.path).graph.node for p in n.metadata_props if p.key == "ortlab.module"}
    assert {"fc1", "fc2"} & modules and "/views/" in view.path
    assert lab._repr_html_().count("done") >= 9
    assert lab["step"]._repr_html_().count("First training step") == 1
    lab.close()


def test_stepper_follows_stages_run_from_other_cells(tmp_path, no_server):
    """A stepper shown first stays current when later cells call lab.run(...); a broken view never fails a stage."""
    lab = explore(TanhNet(), torch.randn(4, 6), folder=str(tmp_path / "lab"))
    stepper = StepperWidget(lab)
    assert stepper.overview.value.count("pending") == 9
    lab.run("split")  # as a later cell would
    assert stepper.overview.value.count("pending") == 6, stepper.overview.value
    assert stepper.stage.value == "split" and "split (done)" in stepper.stage.options[2][0]
    assert "Saved activations" in stepper.body.value

    def broken(stage):
        raise RuntimeError("a view that fails")

    lab.on_stage(broken)
    lab.run("exported")  # the broken callback is dropped, the stage runs, the stepper follows
    assert lab["exported"].status == "done" and broken not in lab._on_stage
    assert stepper.stage.value == "exported"
    lab.close()


# A string from a hostile lab.json: every place it shows must show it as text.
EVIL = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"


def _hostile_lab(folder) -> None:
    """A lab folder whose lab.json puts EVIL in every string a page shows."""
    import json

    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    x = EVIL
    stages = [
        {"name": "captured", "title": x, "description": x, "status": "done", "notes": [x], "op_counts": {x: 2},
         "graph_op_counts": {x: {x: 2}}, "artifacts": {x: "a.py"}, "seconds": 0.5, "timings": {x: 0.1},
         "graph_breaks": [{"reason": x, "count": 1, "location": x, "detail": x + " more"}],
         "summary": {x: x, "modes": [x]}},
        {"name": "joint", "title": x, "status": "done", "op_counts": {x: 1, "aten.mm": 1}, "previous": "captured",
         "diff": {"added": {"aten.mm": 1}, "removed": {x: 1, x + "2": 3}, "before": 2, "after": 2}},
        {"name": "split", "title": x, "status": "done", "op_counts": {"aten.mm": 1},
         "activations": [{"name": x, "op": x, "shape": [2, 3], "dtype": x, "bytes": 24, "module": x, "source": x,
                          "recomputed": True, "reason": x, "graph": x, "onnx_node": x}],
         "summary": {"saved": 1, "recomputed": 1, "saved_bytes": 24, "baseline_bytes": 48}},
        {"name": "exported", "title": x, "status": "done", "op_counts": {"Gemm": 1}, "artifacts": {x: "b.onnx"},
         "fallbacks": [{"scope": "op", "where": x, "reason": x, "node": x, "op": x, "module": x, "source": x,
                        "kind": x, "values": [x]}]},
        {"name": "onnxscript", "title": x, "status": "failed", "error": x},
        {"name": "ort_basic", "title": x, "status": "skipped", "notes": [x]},
        {"name": "step", "title": x, "description": x, "status": "pending", "artifacts": {x: "c.onnx"}},
    ]
    doc = {"format": "ortlab.lab", "version": 1, "meta": {"model": x, "inputs": [x]}, "stages": stages}
    (folder / "lab.json").write_text(json.dumps(doc))


def test_strings_from_a_lab_file_are_escaped(tmp_path, no_server):
    from ortlab.inspect.lab import Lab

    _hostile_lab(tmp_path / "lab")
    lab = Lab.load(str(tmp_path / "lab"))
    pages = [lab_html(lab), lab._repr_html_()] + [stage_html(s) for s in lab.stages]
    pages += [s._repr_html_() for s in lab.stages]
    for page in pages:
        assert "<script" not in page and "<img" not in page, page
    assert html.escape(EVIL) in pages[0]  # shown, as text
    graphs = stage_html(lab["captured"])
    assert html.escape(f"lab['captured'].view({EVIL!r})") in graphs  # the call to open the graph, as text


def test_table_links_never_serve_a_file_outside_the_lab(tmp_path, no_server):
    import json
    import os

    import onnx
    import onnx.helper as oh

    from ortlab.inspect.lab import Lab

    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["y"], name="node_relu")], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    (tmp_path / "lab").mkdir()
    onnx.save(model, str(tmp_path / "outside.onnx"))
    onnx.save(model, str(tmp_path / "lab" / "net_forward_exported_train.onnx"))
    stage = {"name": "exported", "status": "done", "op_counts": {"Relu": 1},
             "artifacts": {"g0.forward": "net_forward_exported_train.onnx"},
             "fallbacks": [{"scope": "op", "where": "g0.forward", "reason": "r", "op": "aten.relu", "values": ["x"]}]}
    (tmp_path / "lab" / "lab.json").write_text(json.dumps({"format": "ortlab.lab", "version": 1, "stages": [stage]}))
    lab = Lab.load(str(tmp_path / "lab"))
    server = netron_view.default_server()
    assert any(urllib.parse.quote("net_forward_exported_train.onnx") in u for u in _links(stage_html(lab["exported"])))
    # The graph is swapped for a link out of the lab folder: the table shows it without links.
    os.remove(tmp_path / "lab" / "net_forward_exported_train.onnx")
    os.symlink(tmp_path / "outside.onnx", tmp_path / "lab" / "net_forward_exported_train.onnx")
    for name in list(server.files):
        server.remove(name)
    page = stage_html(lab["exported"])
    assert "net_forward_exported_train.onnx" in page and not _links(page)
    assert not server.files
