"""Dropout masks drawn ahead of the graph (Note [Dropout masks drawn ahead of the graph] in
ortlab/pipeline/dropout.py): the graph runs as one onnxruntime part, with eager's masks and eager's
random stream after it; graphs with other random ops keep their dropouts where they were."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab

RTOL, ATOL = 1e-4, 1e-5


class Encoder(nn.Module):
    """A batch-first encoder layer (its attention output is a transposed view, Note [Random ops see eager's memory
    layout]) and a dropout of the model's own."""

    def __init__(self, p: float = 0.2, extra_random: bool = False) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=p, batch_first=True)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(32, 5)
        self.extra_random = extra_random

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.layer(x))
        if self.extra_random:  # stochastic depth's kind of draw: another random op in the graph
            h = h * (torch.rand(h.shape[0], 1, 1) > 0.2)
        return F.cross_entropy(self.head(h).mean(1), y)


def _forward_parts(om: ortlab.ORTModule) -> int:
    (graph,) = [g for c in om.report.captures for g in c.graphs if g.name == "forward"]
    return len(graph.parts)


def _steps_beside_eager(model: nn.Module, **options: object) -> ortlab.ORTModule:
    eager, om = copy.deepcopy(model), ortlab.ORTModule(copy.deepcopy(model), **options)
    x, y = torch.randn(4, 10, 32), torch.randint(0, 5, (4,))
    for step in range(3):
        torch.manual_seed(100 + step)
        expected = eager(x, y)
        expected.backward()
        after_eager = torch.get_rng_state()
        torch.manual_seed(100 + step)
        got = om(x, y)
        got.backward()
        assert torch.equal(torch.get_rng_state(), after_eager), "the random stream is left where eager leaves it"
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for (name, p), q in zip(eager.named_parameters(), om.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)
            p.grad = q.grad = None
    return om


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
def test_a_graph_with_dropouts_runs_in_one_part_with_eagers_masks():
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder())
    assert _forward_parts(om) == 1
    fallbacks = [f for f in om.report.fallbacks if f.op == "dropout_mask"]
    assert len(fallbacks) == 5 and all("in eager's order" in f.reason and "random op" in f.reason for f in fallbacks)
    assert "5 dropout mask(s) drawn at the top of the graph" in str(om.report)


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_of_nothing_and_of_everything(p):
    torch.manual_seed(0)
    _steps_beside_eager(Encoder(p))


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
def test_another_random_op_keeps_the_dropouts_in_place():
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder(extra_random=True))
    assert _forward_parts(om) > 1
    assert not any(f.op == "dropout_mask" for f in om.report.fallbacks)


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
def test_a_dropout_named_in_fallback_ops_stays_in_pytorch():
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder(), fallback_ops=["aten.native_dropout"])
    assert _forward_parts(om) > 1
    assert any(f.op == "aten.native_dropout" for f in om.report.fallbacks)
