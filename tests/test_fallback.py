"""Fallback to PyTorch is never silent: every op, graph or call that leaves onnxruntime has a reason."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch

RTOL, ATOL = 1e-4, 1e-5


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=2, block_size=16))


def grads_match(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def trains_like_eager(eager: nn.Module, om: ortlab.ORTModule, x: torch.Tensor, warning: str) -> None:
    """One step of ``om`` (warning ``warning`` as it falls back) and of ``eager``: same output, same grads."""
    with pytest.warns(ortlab.FallbackWarning, match=warning):
        out = om(x)
    out.backward()
    ref = eager(x)
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    grads_match(eager, om)


class Median(nn.Module):
    """kthvalue has no ONNX translation in torchlib."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        med = torch.kthvalue(h, 4, dim=-1, keepdim=True).values
        return self.out(torch.relu(h - med)).sum()


def test_user_named_fallback_ops_run_in_pytorch_with_reason():
    eager = tiny_gpt()
    om = ortlab.ORTModule(copy.deepcopy(eager), fallback_ops=["aten.gelu"])
    idx, tgt = make_batch("gpt", 4, vocab=50, block_size=16)
    with pytest.warns(ortlab.FallbackWarning, match="fallback_ops"):
        loss = om(idx, tgt)
    loss.backward()
    ref = eager(idx, tgt)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    grads_match(eager, om)
    gelu = [f for f in om.report.fallbacks if f.op == "aten.gelu"]
    assert len(gelu) == 2  # one per block, forward graph
    assert all(f.scope == "op" and "named in fallback_ops" in f.reason for f in gelu)
    assert all(f.module.startswith("blocks.") for f in gelu)
    assert "models.py" in gelu[0].source
    forward = om.report.captures[0].graphs[0]
    assert forward.name == "forward" and forward.ort_partitions >= 2 and forward.torch_nodes == 2
    assert "aten.gelu: named in fallback_ops" in str(om.report)


class Branches(nn.Module):
    """Two branches with a GELU each (named in ``fallback_ops``), and a branch with none."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.a2, self.b2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a2(F.gelu(self.a(x)))
        b = self.b2(F.gelu(self.b(x)))
        return (a * b + self.c(x)).sum()


def test_ops_in_pytorch_cut_the_graph_into_as_many_parts_as_its_deepest_chain_of_them():
    """Note [Parts by depth] in ortlab.runtime.split: the forward has two GELUs in PyTorch side by
    side, so two parts (before them, after them), whatever the branches; the result is eager's."""
    torch.manual_seed(0)
    eager = Branches()
    om = ortlab.ORTModule(copy.deepcopy(eager), fallback_ops=["aten.gelu"])
    trains_like_eager(eager, om, torch.randn(4, 8), warning="fallback_ops")
    forward = om.report.captures[0].graphs[0]
    assert forward.name == "forward" and forward.torch_nodes == 2 and forward.ort_partitions == 2


def test_op_without_translation_falls_back_per_op():
    eager = Median()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    trains_like_eager(eager, om, torch.randn(5, 8), warning="no ONNX translation")
    kth = [f for f in om.report.fallbacks if f.op == "aten.kthvalue"]
    assert kth and kth[0].node.startswith("kthvalue")
    # The rest of the forward still runs in onnxruntime.
    assert om.report.captures[0].graphs[0].ort_partitions >= 1


def test_fallback_raise_names_every_op():
    om = ortlab.ORTModule(Median(), fallback="raise")
    with pytest.raises(ortlab.FallbackError, match=r"aten\.kthvalue \(kthvalue\).*no ONNX translation"):
        om(torch.randn(5, 8))


def test_dropout_runs_in_pytorch_and_matches_eager_stream():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    torch.manual_seed(123)
    out = om(x)
    out.sum().backward()
    torch.manual_seed(123)
    ref = eager(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    grads_match(eager, om)
    assert any("random op" in f.reason for f in om.report.fallbacks)


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(h)).sum()


def test_graph_break_runs_between_graphs_with_reason():
    torch.manual_seed(0)
    eager = Breaks()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    trains_like_eager(eager, om, torch.randn(3, 4), warning="graph break")
    assert len(om.report.captures) == 2
    assert om.report.graph_breaks
    assert "graph breaks (the code between runs in PyTorch)" in str(om.report)


def test_graph_break_with_fallback_raise_is_an_error():
    om = ortlab.ORTModule(Breaks(), fallback="raise")
    with pytest.raises(ortlab.CaptureError, match="capture failed"):
        om(torch.randn(3, 4))


def test_fallback_warning_is_emitted_once_per_reason():
    torch.manual_seed(0)
    om = ortlab.ORTModule(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.GELU()), fallback_ops=["gelu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        om(torch.randn(2, 4)).sum().backward()
        om(torch.randn(2, 4)).sum().backward()
    gelu_warnings = [w for w in caught if issubclass(w.category, ortlab.FallbackWarning) and "aten.gelu" in str(w.message)]
    assert len(gelu_warnings) == 1
    assert len([f for f in om.report.fallbacks if f.op == "aten.gelu"]) == 2


def _bf16_step(providers: list[str] | None) -> ortlab.ORTModule:
    """One autocast-bf16 step of a tiny GPT through ortlab, checked against eager's at bf16 tolerance."""
    eager = tiny_gpt()
    om = ortlab.ORTModule(copy.deepcopy(eager), providers=providers)
    idx, tgt = make_batch("gpt", 4, vocab=50, block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ortlab.FallbackWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = om(idx, tgt)
            ref = eager(idx, tgt)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=2e-2)
    return om


def test_bf16_autocast_kernels_missing_in_onnxruntime_fall_back_with_reason():
    om = _bf16_step(["CPUExecutionProvider"])  # onnxruntime's CPU provider has no bfloat16 MatMul
    reasons = " ".join(f.reason for f in om.report.fallbacks)
    assert "BFLOAT16" in reasons


def test_bf16_graphs_run_whole_on_a_provider_with_bf16_kernels():
    """Note [bfloat16 graphs on the CPU]: where OpenVINO has bf16 kernels (AMX, AVX-512-bf16) the
    autocast graph runs on it whole; elsewhere the CPU provider's missing kernels fall back."""
    from ortlab.runtime.providers import bf16_provider

    om = _bf16_step(None)
    provider = bf16_provider()
    if provider is None:
        assert "BFLOAT16" in " ".join(f.reason for f in om.report.fallbacks)
        return
    assert not om.report.fallbacks, [f.reason for f in om.report.fallbacks]
    graphs = om.report.captures[0].graphs
    assert {g.label.rsplit(".", 1)[-1] for g in graphs} == {"forward", "backward"}
    for graph in graphs:
        assert graph.providers.startswith(provider) and "bfloat16 kernels on this CPU" in graph.providers
        assert all(p.runner.session.get_providers()[0] == provider for p in graph.parts)
        assert any("CPUExecutionProvider dropped: could not build a session" in n for n in graph.notes), graph.notes


def test_unknown_option_and_bad_values_list_valid_choices():
    with pytest.raises(ortlab.ConfigError, match="valid options"):
        ortlab.ORTModule(nn.Linear(2, 2), fallbak="raise")
    with pytest.raises(ortlab.ConfigError, match=r"choose one of \('warn', 'raise'\)"):
        ortlab.ORTModule(nn.Linear(2, 2), fallback="sometimes")
    with pytest.raises(ortlab.ConfigError, match="recompute='everything' is not valid"):
        ortlab.ORTModule(nn.Linear(2, 2), recompute="everything")


def test_sdpa_model_exports_attention_in_math_form():
    """Fused SDPA's backward has no ONNX translation; ortlab rewrites it so nothing falls back."""
    eager = tiny_gpt()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    idx, tgt = make_batch("gpt", 2, vocab=50, block_size=16)
    om(idx, tgt).backward()
    ops = [f.op for f in om.report.fallbacks]
    assert not any("scaled_dot_product" in op for op in ops)
    assert F.scaled_dot_product_attention  # the model really uses it


def test_fallback_ops_scoped_to_a_module():
    eager = tiny_gpt()
    om = ortlab.ORTModule(copy.deepcopy(eager), fallback_ops=["aten.gelu@blocks.1"])
    idx, tgt = make_batch("gpt", 4, vocab=50, block_size=16)
    with pytest.warns(ortlab.FallbackWarning):
        loss = om(idx, tgt)
    loss.backward()
    ref = eager(idx, tgt)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    gelu = [f for f in om.report.fallbacks if f.op == "aten.gelu"]
    assert [f.module for f in gelu] == ["blocks.1"]


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


def test_code_dynamo_skips_is_a_warned_fallback_not_silent():
    """Dynamo skips an nn.LSTM's frame and runs it eagerly, counting it nowhere but its counters."""
    eager = _Recurrent()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 5, 4)
    with pytest.warns(ortlab.FallbackWarning, match="Dynamo cannot capture .*LSTM"):
        out = om(x)
    torch.testing.assert_close(out, eager(x))
    frames = [f for f in om.report.fallbacks if f.scope == "frame"]
    assert frames and "LSTM" in frames[0].reason and "LSTM" in str(om.report)
    with pytest.raises(ortlab.CaptureError, match="LSTM"):
        ortlab.ORTModule(copy.deepcopy(eager), fallback="raise")(x)
