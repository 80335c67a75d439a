"""ortlab's type promotion pass is torch.onnx's, without running every node again
(Note [Type promotion without running every node again] in ortlab/_compat/torch.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import ortlab
import ortlab.onnx.export as export_module
from ortlab._compat.torch import insert_type_promotion_nodes
from ortlab.models import GPT, GPTConfig, make_batch


class Promotions(nn.Module):
    """Implicit promotions of every kind: int / int, int tensor with a float scalar, a float16
    tensor with a float32 0-dim tensor, bool masks, where with a scalar, float64 beside float32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ratio = n / 3  # int64 / int: true division, float
        scaled = h * ratio[:, None] + (n * 2 + 1)[:, None]  # float32 with int64
        half = h.half() * torch.tensor(0.5)  # float16 with a float32 0-dim tensor stays float16
        masked = torch.where(n[:, None] > 2, scaled, 0.25)
        wide = (h.double() * 1.5).sum(dim=1).float()
        return masked.sum() + half.float().sum() + wide.sum() + (n // 2).sum()


def _graphs_through_both_passes(monkeypatch, model: nn.Module, *args: object) -> list[tuple[str, str]]:
    """Each graph ortlab exports, through torch's pass (a copy) and through ours: their code."""
    seen = []

    def both(gm: torch.fx.GraphModule) -> None:
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        theirs = torch.fx.GraphModule(gm, graph)
        insert_type_promotion_nodes(theirs, from_meta=False)
        insert_type_promotion_nodes(gm)
        ours_meta = [(n.name, str(n.target), _meta(n)) for n in gm.graph.nodes]
        theirs_meta = [(n.name, str(n.target), _meta(n)) for n in theirs.graph.nodes]
        assert ours_meta == theirs_meta
        seen.append((gm.code, theirs.code))

    monkeypatch.setattr(export_module, "insert_type_promotion_nodes", both)
    out = model(*args)
    out.backward()
    return seen


def _meta(node: torch.fx.Node) -> object:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val.dtype, tuple(val.shape))
    if isinstance(val, (tuple, list)):
        return tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__ for v in val)
    return type(val).__name__


def test_type_promotion_from_meta_is_torchs(monkeypatch):
    torch.manual_seed(0)
    eager = Promotions()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x, n = torch.randn(4, 8), torch.tensor([1, 2, 3, 7])
    graphs = _graphs_through_both_passes(monkeypatch, om, x, n)
    assert len(graphs) == 2  # forward and backward
    for ours, theirs in graphs:
        assert ours == theirs
    assert "_to_copy" in graphs[0][0] or "convert_element_type" in graphs[0][0]  # promotions were inserted
    torch.testing.assert_close(om(x, n), eager(x, n), rtol=1e-4, atol=1e-5)


def test_type_promotion_from_meta_is_torchs_on_the_gpt(monkeypatch):
    torch.manual_seed(0)
    om = ortlab.ORTModule(GPT(GPTConfig(n_layers=1, dropout=0.1)))
    idx, tgt = make_batch("gpt", 2, generator=torch.Generator().manual_seed(0))
    graphs = _graphs_through_both_passes(monkeypatch, om, idx, tgt)
    assert len(graphs) >= 2  # the parts between the dropouts (which run in PyTorch), forward and backward
    for ours, theirs in graphs:
        assert ours == theirs


def test_one_op_signature_per_onnx_op_exports_the_same_graphs(monkeypatch):
    """Note [One op signature per ONNX op]: the GPT's graphs translate node for node as without
    the cache, which is put back after each translation."""
    import contextlib

    import onnx_ir as ir

    import ortlab._compat.torch as compat
    import ortlab.pipeline.part as part_module

    def exported(cached: bool) -> list[list[tuple]]:
        graphs = []
        original = part_module.export_graph

        def record(gm, name, guard_indices=False, view_outputs=False):
            out = original(gm, name, guard_indices, view_outputs)
            graphs.append([(n.op_type, [v.name if v is not None else "" for v in n.inputs],
                            sorted((k, str(a.value)) for k, a in n.attributes.items())) for n in out.model.graph])
            return out

        with monkeypatch.context() as m:
            m.setattr(part_module, "export_graph", record)
            if not cached:
                m.setattr(compat, "_op_signatures_cached", contextlib.nullcontext)
            torch.manual_seed(0)
            model = ortlab.ORTModule(GPT(GPTConfig(n_layers=1, vocab=64, d_model=32, n_heads=2, block_size=8)))
            model(*make_batch("gpt", 2, vocab=64, block_size=8)).backward()
        return graphs

    before = ir.schemas.OpSignature.from_op_schema
    compat._SIGNATURES.clear()
    cached = exported(True)
    assert ("", "Gemm", 13) in compat._SIGNATURES or ("", "MatMul", 13) in compat._SIGNATURES, compat._SIGNATURES
    assert cached == exported(False) and len(cached) == 2
    assert ir.schemas.OpSignature.from_op_schema == before


class OneMinusMask(nn.Module):
    """XLNet's ``1.0 - attention_mask`` on an integer mask: rsub's decomposition leaves
    ``aten.sub.Tensor(1.0, mask_as_float)``, a node torch.onnx's promotion pass cannot run again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * (1.0 - mask)[..., None] + (2 - mask)[..., None]).sum()


def test_a_number_minus_a_tensor_runs_in_onnxruntime():
    torch.manual_seed(0)
    model = OneMinusMask()
    om = ortlab.ORTModule(copy.deepcopy(model))
    x, mask = torch.randn(3, 4, 6), torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out, ref = om(x, mask), model(x, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.backward()
    ref.backward()
    for p, q in zip(om.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert not om.report.fallbacks, om.report.fallbacks
