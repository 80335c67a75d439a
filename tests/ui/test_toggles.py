"""Recompute and fallback toggles, driven without a browser."""

from __future__ import annotations

import copy

import pytest
import torch

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.ui.toggles import FallbackToggles, RecomputeToggles


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
    # Measuring steps leave the user's gradients alone.
    assert all(g is None for g in grads_before) and all(p.grad is None for p in om.parameters())
    # One activation at a time: explicit selection.
    toggles.preset("none")
    toggles.apply()
    name = next(a.name for a in toggles.plan.activations if a.op == "aten.gelu")
    toggles.toggle(name, True)
    assert toggles.pending == (name,)
    toggles.apply()
    assert [a.name for a in toggles.plan.recomputed] == [name]
    with pytest.raises(KeyError, match="not a saved activation"):
        toggles.toggle("nope", True)
    with pytest.raises(ValueError, match="choose one of"):
        toggles.preset("everything")


def test_recompute_widget_apply_updates_checkboxes(gpt_and_batch):
    model, batch = gpt_and_batch
    toggles = RecomputeToggles(ortlab.ORTModule(copy.deepcopy(model)), *batch)
    view = toggles.widget()
    presets, table, apply, status = view.children[1], view.children[2], view.children[3], view.children[4]
    presets.value = "layerwise"
    apply.click()
    checked = [row.children[0].value for row in table.children]
    assert any(checked) and "layerwise" in status.value and "-&gt;" in status.value


def test_fallback_toggles_send_and_back(gpt_and_batch):
    model, batch = gpt_and_batch
    om = ortlab.ORTModule(copy.deepcopy(model))
    toggles = FallbackToggles(om, *batch)
    rows = toggles.rows()
    gelu = [r for r in rows if r.op == "aten.gelu"]
    assert {r.module for r in gelu} == {"blocks.0", "blocks.1"} and all(r.where == "onnxruntime" for r in gelu)
    toggles.send("aten.gelu", module="blocks.0")
    with pytest.warns(ortlab.FallbackWarning):
        rows = toggles.apply()
    placed = {(r.op, r.module): r for r in rows}
    assert placed[("aten.gelu", "blocks.0")].where == "PyTorch"
    assert "fallback_ops" in placed[("aten.gelu", "blocks.0")].reason
    assert placed[("aten.gelu", "blocks.1")].where == "onnxruntime"
    toggles.send("aten.gelu", module="blocks.0", to_pytorch=False)
    rows = toggles.apply()
    assert all(r.where == "onnxruntime" for r in rows if r.op == "aten.gelu")
    view = toggles.widget()
    assert len(view.children[1].children) == len(rows)
