"""Random numbers drawn ahead of the graph (Note [Random draws ahead of the graph] in
ortlab/pipeline/random_draws.py): dropout masks, stochastic depth's rand, rand_like and bernoulli_(p) are drawn
at the top, and the graph runs as one onnxruntime part, with eager's numbers and eager's random stream after it;
a graph with a random op that reads a tensor's values keeps its random ops where they were."""

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

    def __init__(self, p: float = 0.2, extra_random: str = "") -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=p, batch_first=True)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(32, 5)
        self.extra_random = extra_random

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.layer(x))
        if self.extra_random == "rand":  # Hugging Face's drop_path (stochastic depth)
            h = h.div(0.8) * (0.8 + torch.rand((h.shape[0], 1, 1), dtype=h.dtype)).floor()
        elif self.extra_random == "bernoulli_p":  # timm's drop_path
            h = h * h.new_empty((h.shape[0], 1, 1)).bernoulli_(0.8) / 0.8
        elif self.extra_random == "rand_like":  # noise of the activation's layout (transposed here)
            t = h.transpose(1, 2)
            h = (t + 0.1 * torch.randn_like(t) * torch.rand_like(t)).transpose(1, 2)
        elif self.extra_random == "dropout2d":
            h = F.dropout2d(h.unsqueeze(-1), 0.25).squeeze(-1)
        elif self.extra_random == "bernoulli":  # probabilities read from a tensor's values: cannot be drawn ahead
            h = h * torch.bernoulli(torch.sigmoid(h).detach())
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
@pytest.mark.parametrize(("extra", "op", "ops"), [
    ("rand", "aten.rand", "1 aten.rand"), ("bernoulli_p", "bernoulli_ahead", "1 aten.bernoulli"),
    ("rand_like", "rand_like_ahead", "1 aten.randn_like, 1 aten.rand_like"),
    ("dropout2d", "bernoulli_ahead", "1 aten.bernoulli")])
def test_draws_that_read_only_shapes_are_drawn_ahead_too(extra, op, ops):
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder(extra_random=extra))
    assert _forward_parts(om) == 1
    drawn = [f for f in om.report.fallbacks if f.op == op]
    assert drawn and all("at the top of the graph, in eager's order" in f.reason for f in drawn)
    assert f"5 dropout mask(s), {ops} drawn at the top of the graph" in str(om.report)


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
def test_a_draw_that_reads_values_keeps_every_random_op_in_place():
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder(extra_random="bernoulli"))
    assert _forward_parts(om) > 1
    assert not any(f.op == "dropout_mask" for f in om.report.fallbacks)
    assert any(f.op == "aten.bernoulli" and "drawn" not in f.reason for f in om.report.fallbacks)


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
def test_a_dropout_named_in_fallback_ops_stays_in_pytorch():
    torch.manual_seed(0)
    om = _steps_beside_eager(Encoder(), fallback_ops=["aten.native_dropout"])
    assert _forward_parts(om) > 1
    assert any(f.op == "aten.native_dropout" for f in om.report.fallbacks)


class Noisy(nn.Module):
    """A draw PyTorch's decompositions or torchlib used to take from eager (Note [Random ops keep their kernels])."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        noise = {
            "exponential_": lambda: h.new_empty(h.shape).exponential_(),
            "normal_": lambda: h.new_empty(h.shape).normal_(0.0, 0.5),
            "uniform_": lambda: h.new_empty(h.shape).uniform_(0.5, 1.5),
            "randint_like": lambda: torch.randint_like(h, 0, 3),
            "normal": lambda: torch.normal(h.detach(), 0.1),  # about a tensor of means: stays in place
        }[self.kind]()
        return (h * noise).square().mean()


@pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")
@pytest.mark.parametrize("kind", ["exponential_", "normal_", "uniform_", "randint_like", "normal"])
def test_every_random_op_draws_eagers_numbers(kind):
    """exponential_ had been decomposed into -log(1 - rand_like) and normal_ and randint_like translated to
    onnxruntime's own generators: other numbers than eager's, the random stream left behind, nothing reported."""
    torch.manual_seed(0)
    model = Noisy(kind)
    eager, om = copy.deepcopy(model), ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(8, 16)
    for step in range(2):
        torch.manual_seed(10 + step)
        expected = eager(x)
        expected.backward()
        after_eager = torch.get_rng_state()
        torch.manual_seed(10 + step)
        got = om(x)
        got.backward()
        assert torch.equal(torch.get_rng_state(), after_eager)
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for p, q in zip(eager.parameters(), om.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
            p.grad = q.grad = None
    random = [f for f in om.report.fallbacks if f.kind == "random"]
    assert len(random) == 1, om.report.fallbacks
    assert ("at the top of the graph" in random[0].reason) == (kind != "normal")
