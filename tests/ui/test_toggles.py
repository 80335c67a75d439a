"""Recompute and fallback toggles, driven without a browser."""

from __future__ import annotations

import copy
import html
import re
import urllib.parse

import pytest
import torch

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.ui import netron_view
from ortlab.ui.toggles import FallbackToggles, RecomputeToggles


def _nodes_of_linked_file(url: str) -> set[str]:
    """The node names of the model a netron link opens (served by the default server)."""
    import onnx

    server = netron_view.running_default_server()
    assert server is not None
    path = server.path_of(_query(url)["file"])
    assert path is not None, url
    return {n.name for n in onnx.load(path, load_external_data=False).graph.node}


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(html.unescape(url)).query).items()}


def _link(cell: str) -> tuple[str, str, str] | None:
    """(text, url, target) of the link in a row's HTML, or None."""
    m = re.search(r"<a href='([^']+)' target='([^']+)'[^>]*>(.*?)</a>", cell)
    return (re.sub(r"<[^>]+>", "", m.group(3)), html.unescape(m.group(1)), m.group(2)) if m else None


@pytest.fixture()
def gpt_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=2, block_size=16))
    return model, make_batch("gpt", 4, vocab=50, block_size=16)


def test_recompute_presets_and_rows(gpt_and_batch):
    model, batch = gpt_and_batch
    om = ortlab.ORTModule(copy.deepcopy(model))
    toggles = RecomputeToggles(om, *batch)
    before = toggles.plan.saved_bytes
    grads_before = [p.grad for p in om.parameters()]
    toggles.preset("layerwise")
    result = toggles.apply()
    assert om.options.recompute == "layerwise"
    assert result.after_bytes * 2 <= result.before_bytes == before
    assert result.before_step_s > 0 and result.after_step_s > 0
    assert "saved activations" in str(result)
    assert len(result.after.samples) >= 5 and " steps)" in str(result)
    # Measuring steps leave the user's gradients alone.
    assert all(g is None for g in grads_before) and all(p.grad is None for p in om.parameters())
    # One activation at a time, on top of the preset in force.
    toggles.preset("none")
    toggles.apply()
    name = next(a.name for a in toggles.plan.activations if a.op == "aten.gelu")
    toggles.toggle(name, True)
    assert toggles.pending == ("none", f"+{name}")
    toggles.apply()
    assert [a.name for a in toggles.plan.recomputed] == [name]
    assert "policy in force <code>none +" in toggles._summary()
    # On layerwise, a row keeps the preset (it used to become a bare list and lose the layers):
    # ticking one more activation never saves more, unticking one of the preset's saves it.
    toggles.preset("layerwise")
    toggles.apply()
    layerwise_bytes = toggles.plan.saved_bytes
    saved = next(a.name for a in toggles.plan.activations if not a.recomputed)
    toggles.toggle(saved, True)
    assert toggles.pending == ("layerwise", f"+{saved}")
    toggles.apply()
    assert toggles.plan.saved_bytes <= layerwise_bytes
    assert om.options.recompute == ("layerwise", f"+{saved}")
    recomputed = next(a.name for a in toggles.plan.recomputed if a.name != saved)
    toggles.toggle(recomputed, False)
    assert toggles.pending == ("layerwise", f"+{saved}", f"-{recomputed}")
    with pytest.raises(ortlab.ConfigError, match="not a saved activation"):
        toggles.toggle("nope", True)
    with pytest.raises(ortlab.ConfigError, match="choose one of"):
        toggles.preset("everything")


def test_recompute_widget_links_rows_and_apply_updates_them(gpt_and_batch):
    model, batch = gpt_and_batch
    toggles = RecomputeToggles(ortlab.ORTModule(copy.deepcopy(model)), *batch)
    urls = toggles.urls()
    assert set(urls) == {a.name for a in toggles.plan.activations} and all(urls.values())
    gelu = next(a for a in toggles.plan.activations if a.op == "aten.gelu")
    # the GELU's node: the exported one, or what the CPU provider's rewrites made of it (node_gelu_one_gelu)
    assert _query(urls[gelu.name])["node"].startswith(f"node_{gelu.name}") and "forward" in _query(urls[gelu.name])["file"]
    assert _query(urls[gelu.name])["node"] in _nodes_of_linked_file(urls[gelu.name])
    view = toggles.widget()
    presets, header, table, buttons, status, _plot, viewer = view.children[1:]
    apply, _measure = buttons.children
    assert "module" in header.value and "bytes" in header.value
    # Each row: its checkbox, and its name linked to the node, opening in the view under the table.
    text, url, target = _link(table.children[0].children[1].value)
    assert text == toggles.plan.activations[0].name and url == urls[text]
    assert f'name="{target}_' in viewer.value and html.escape(url) in viewer.value
    assert "color:inherit" in table.children[0].children[1].value  # the link looks like a link
    presets.value = "layerwise"
    apply.click()
    checked = [row.children[0].value for row in table.children]
    assert any(checked) and "layerwise" in status.value and "-&gt;" in status.value
    # The module re-captured: rows link into the new graphs (the old files stay for links shown before).
    text, new_url, _ = _link(next(r.children[1].value for r in table.children if gelu.name in r.children[1].value))
    assert text == gelu.name and _query(new_url)["file"] != _query(urls[gelu.name])["file"]
    server = netron_view.running_default_server()
    assert server is not None and server.path_of(_query(urls[gelu.name])["file"]) is not None
    # A later cell changes the policy in code and trains: the widget shown earlier follows.
    om = toggles.run.om
    om.reconfigure(recompute="auto")
    om(*batch).backward()
    assert "<code>auto</code>" in status.value and "re-captured from code" in status.value, status.value
    assert presets.value == "auto" and toggles.pending == "auto"
    assert [row.children[0].value for row in table.children] == [a.recomputed for a in toggles.plan.activations]


def test_trade_off_points_best_line_and_click_to_apply(gpt_and_batch, monkeypatch):
    from plotly.callbacks import Points

    from ortlab.ui import tradeoff

    model, batch = gpt_and_batch
    om = ortlab.ORTModule(copy.deepcopy(model))
    toggles = RecomputeToggles(om, *batch)
    monkeypatch.setattr(tradeoff, "TRADE_OFF_POLICIES", ("none", "layerwise", ("budget", 0.5)))
    seen: list[str] = []
    points = toggles.trade_off(steps=3, progress=seen.append)
    assert [p.label for p in points] == ["none", "layerwise", "budget 50%"]
    assert seen[0].startswith("measuring none (1/3)") and seen[-1] == "back to none: re-capture"
    none, _, half = points
    assert half.saved_bytes <= none.saved_bytes / 2 and "recomputes" in half.cost
    assert all(len(p.timing.samples) == 3 and p.timing.low <= p.timing.median <= p.timing.high for p in points)
    assert om.options.recompute == "none"  # the module runs the policy it ran before
    best = tradeoff.best_points(points)
    assert best and all(not (q.saved_bytes <= p.saved_bytes and q.timing.median < p.timing.median)
                        for p in best for q in points)
    fig = tradeoff.figure(points, in_force="none")
    assert fig.layout.xaxis.title.text.startswith("saved activations (")
    assert fig.layout.yaxis.title.text == "step time (ms): median, bars min-max of 3 steps"
    assert len(fig.data[0].x) == len(best) and list(fig.data[1].text) == ["none", "layerwise", "budget 50%"]
    # In the widget: Measure draws the points; a click on one applies its policy.
    view = toggles.widget()
    buttons, status, plot = view.children[4:7]
    buttons.children[1].click()
    figure_widget = plot.children[0].children[0]
    assert "best on both axes" in plot.children[0].children[1].value
    trace = figure_widget.data[1]
    trace._dispatch_on_click(Points(point_inds=[1], xs=[0], ys=[0], trace_name="policies", trace_index=1), None)
    assert om.options.recompute == "layerwise" and "layerwise" in status.value and "-&gt;" in status.value


def test_fallback_toggles_send_and_back(gpt_and_batch):
    model, batch = gpt_and_batch
    om = ortlab.ORTModule(copy.deepcopy(model))
    toggles = FallbackToggles(om, *batch)
    rows = toggles.rows()
    gelu = [r for r in rows if r.op == "aten.gelu"]
    assert {r.module for r in gelu} == {"blocks.0", "blocks.1"} and all(r.where == "onnxruntime" for r in gelu)
    toggles.send("aten.gelu", module="blocks.0")
    with pytest.warns(ortlab.FallbackWarning):
        result = toggles.apply()
    rows = toggles.rows()
    # Before and after, each the median of several steps with its spread, or "within noise".
    assert result.after_torch_ops > result.before_torch_ops == 0
    assert len(result.before.samples) >= 5 and ("within noise" in str(result) or "x " in str(result))
    placed = {(r.op, r.module): r for r in rows}
    assert placed[("aten.gelu", "blocks.0")].where == "PyTorch"
    assert "fallback_ops" in placed[("aten.gelu", "blocks.0")].reason
    assert placed[("aten.gelu", "blocks.1")].where == "onnxruntime"
    # Rows link to their first node; an op in PyTorch to its value, read by the next partition.
    from ortlab.ui._module_graphs import module_linker

    linker = module_linker(om)
    assert placed[("aten.gelu", "blocks.1")].nodes[0] == ("g0.forward", "gelu_1")
    kept = toggles.url(placed[("aten.gelu", "blocks.1")], linker)
    assert _query(kept)["node"].startswith("node_gelu_1") and _query(kept)["node"] in _nodes_of_linked_file(kept)
    moved = _query(toggles.url(placed[("aten.gelu", "blocks.0")], linker))
    assert moved["node"] == "gelu" and "forward_fused" in moved["file"]
    toggles.send("aten.gelu", module="blocks.0", to_pytorch=False)
    toggles.apply()
    rows = toggles.rows()
    assert all(r.where == "onnxruntime" for r in rows if r.op == "aten.gelu")
    view = toggles.widget()
    grid, viewer = view.children[2], view.children[-1]
    assert len(grid.children) == len(rows)
    linked = [_link(row.children[1].value) for row in grid.children]
    assert sum(1 for x in linked if x) > len(rows) // 2  # ops onnxscript folded away have no node
    assert all(f'name="{x[2]}_' in viewer.value for x in linked if x)


def test_timings_are_medians_and_overlapping_spreads_are_noise():
    from ortlab.ui.toggles import Timing, compare_timings

    a, b = Timing((0.010, 0.011, 0.012)), Timing((0.0105, 0.0115, 0.013))
    assert "within noise" in compare_timings(a, b)
    fast = Timing((0.005, 0.0052, 0.0051))
    assert "2.16x faster" in compare_timings(a, fast) and "11.0 ms (10.0-12.0, 3 steps)" in compare_timings(a, fast)
    # No claim beyond what the spreads support: the fastest before against the slowest after, said with its rule.
    assert "at least 1.92x (the fastest step before against the slowest after)" in compare_timings(a, fast)
    assert "slower by the medians, at least 1.92x" in compare_timings(fast, a)
    assert "ranges of step times overlap" in compare_timings(a, b)


def test_a_measuring_step_that_captures_again_is_left_out():
    """A guard that fails during the toggles' timing (a new shape) re-captures: that step is not a timing."""
    import ortlab
    from ortlab.models import TinyMLP
    from ortlab.ui.toggles import _Measured

    om = ortlab.ORTModule(TinyMLP())
    run = _Measured(om, (torch.randn(4, 64),), {}, None)
    run.ensure_captured()
    sizes = iter([4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])  # the third timed call meets a new batch size
    original = run.step

    def step() -> float:
        run.inputs = (torch.randn(next(sizes), 64),)
        return original()

    run.step = step  # type: ignore[method-assign]
    before = len(om.report.captures)
    timing = run.timed(steps=5)
    assert len(om.report.captures) > before and len(timing.samples) == 5
    assert max(timing.samples) < 0.5, timing  # no capture (seconds) among them


def test_measuring_steps_are_not_training_steps_for_a_monitor(gpt_and_batch):
    """Issue 43, item 5: after Apply the loss panel showed the example batch's loss flat and re-capture spikes."""
    model, batch = gpt_and_batch
    om = ortlab.ORTModule(copy.deepcopy(model))
    mon = ortlab.monitor(om, every=1, show=False)
    for _ in range(3):
        om(*batch).backward()
    steps = mon.steps
    toggles = RecomputeToggles(om, *batch)
    toggles.preset("layerwise")
    toggles.apply()
    assert mon.steps == steps and len(mon.data) <= steps
    om(*batch).backward()  # training goes on: counted again
    assert mon.steps == steps + 1
    mon.close()
