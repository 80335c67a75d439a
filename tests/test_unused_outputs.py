"""Outputs the loss does not use get no gradient, as in eager (Note [Gradients of outputs a loss does not use]).

A compiled graph is one autograd node; autograd gives its unused outputs zero gradients, and a zero times an
infinite local derivative (log, sqrt, division at 0) is NaN. Each test compares ortlab with eager on inputs that
reach such a derivative: parameter gradients (None where eager's is None), NaN where eager has it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab


class _Auxiliary(nn.Module):
    """A main output and two auxiliary ones whose derivatives are infinite where ``w * x`` is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.0, 1.0, -1.0, 4.0]))
        self.v = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * self.w
        return y.log(), y * 2, (self.v * y).sqrt()


def _grads(module: nn.Module, x: torch.Tensor, loss_of) -> tuple[list, dict]:  # noqa: ANN001
    module.zero_grad(set_to_none=True)
    outs = module(x)
    loss_of(outs).backward()
    return [o.detach() for o in outs], {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same(ours: dict, eager: dict) -> None:
    assert ours.keys() == eager.keys()
    for name in eager:
        if eager[name] is None:
            assert ours[name] is None, f"{name}: {ours[name]} where eager has no gradient"
        else:
            assert ours[name] is not None, f"{name}: no gradient where eager has {eager[name]}"
            torch.testing.assert_close(ours[name], eager[name], rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)


LOSSES = {
    "main only": lambda o: o[1].sum(),
    "main and sqrt": lambda o: o[1].sum() + o[2].nan_to_num().sum(),
    "a zero weight": lambda o: o[1].sum() + 0 * o[2].sum(),  # a real zero: NaN in eager too
    "only a zero weight": lambda o: 0 * o[1].sum(),  # a real zero gradient beside unused outputs: zeros, not None
}


@pytest.mark.parametrize("loss", list(LOSSES), ids=list(LOSSES))
def test_unused_outputs_give_no_nan_and_no_gradient_as_in_eager(loss):
    eager = _Auxiliary()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.ones(4)
    for _ in range(2):  # the variant compiled, then reused
        _, g_e = _grads(eager, x, LOSSES[loss])
        _, g_o = _grads(om, x, LOSSES[loss])
        _same(g_o, g_e)
    if loss == "main only":
        assert g_e["w"].isfinite().all() and g_e["v"] is None
        notes = [n for c in om.report.captures for g in c.graphs for n in g.notes]
        assert any("does not use the outputs" in n for n in notes), str(om.report)
    if loss == "a zero weight":
        assert g_o["w"].isnan().any()


def test_every_output_used_runs_the_one_backward():
    om = ortlab.ORTModule(_Auxiliary())
    _grads(om, torch.full((4,), 2.0), lambda o: sum(t.sum() for t in o))
    assert [g.name for c in om.report.captures for g in c.graphs] == ["forward", "backward"]


class _LossAndLogits(nn.Module):
    """A Hugging Face style head: returns the loss and the logits, and normalized embeddings beside them; token 5's
    embedding is zeros (a row a model zeroed out, not the padding index, so its gradient is not masked)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 11)
        with torch.no_grad():
            self.embed.weight[5] = 0

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.embed(ids)
        norm = h / h.norm(dim=-1, keepdim=True)  # NaN on token 5; its derivative too
        logits = self.proj(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits, norm


def test_a_loss_and_logits_model_trains_as_eager_with_a_zero_row():
    torch.manual_seed(0)
    eager = _LossAndLogits()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(om.parameters(), lr=0.1)
    ids = torch.randint(0, 11, (3, 5))
    ids[0, 0] = 5
    labels = torch.randint(0, 11, (3, 5))
    for _ in range(3):
        for module, opt in ((eager, opt_e), (om, opt_o)):
            opt.zero_grad(set_to_none=True)
            loss, _, _ = module(ids, labels)
            loss.backward()
            opt.step()
        for (name, p_e), p_o in zip(eager.named_parameters(), om.parameters()):
            assert p_o.isfinite().all(), name
            torch.testing.assert_close(p_o, p_e, rtol=1e-5, atol=1e-6, msg=name)


class _Broken(nn.Module):
    """Two graphs (a graph break between them); the first's second output is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.0, 1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        aux = y.sqrt()
        torch._dynamo.graph_break()
        return y * 3 + 0 * aux.detach()


def test_an_unused_output_of_a_graph_before_a_break():
    eager = _Broken()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, g_e = _grads(eager, x, lambda o: o.sum())
        _, g_o = _grads(om, x, lambda o: o.sum())
    _same(g_o, g_e)
