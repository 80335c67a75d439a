"""Ops whose meaning depends on a size being 1 are right for every later size (Note [A squeeze removes
only dims of size 1] in ortlab/onnx/export.py).

Dynamo specializes sizes 0 and 1: a graph captured with a batch of 1 is guarded on it, and the
next size is captured again with a symbolic batch known to be at least 2, which later sizes
reuse. Each test walks a module through a sequence of batch sizes, forward, backward and
without grad, against eager.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_ran_in_ort, run_step, twin
from torch import nn

SEQUENCES = [(1, 3, 1, 5), (3, 1), (2, 1, 4)]


class _Squeeze(nn.Module):
    """The reliability issue's repro: ``squeeze(0)`` of a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).squeeze(0)


class _SizeOne(nn.Module):
    """Every op that reads whether a size is 1, each on a value of its own (no two outputs alias)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.l(x)  # [b, 4]
        return (
            (y + 1).squeeze(0),  # with a dim: a no-op unless b == 1
            (y + 2).squeeze(-2),  # the same dim, counted from the end
            (y + 3).unsqueeze(1).squeeze(),  # without dims: b's dim too where b == 1
            (y + 4).unsqueeze(1).squeeze((0, 1)),  # several dims, one of them b's
            (y + 5).sum(1, keepdim=True).expand(-1, 4) * y,  # a [b, 1] column broadcast to [b, 4]
            (y + 6)[:1].expand_as(y) + y,  # one row expanded to b rows
            y + (y + 7).mean(0, keepdim=True),  # a [1, 4] broadcast over the batch
            (y + 8).view(y.shape[0], 1, 4).transpose(0, 1).reshape(-1),  # a view with a size-1 dim
            (y + 9).unsqueeze(0).expand(2, -1, -1).sum(0),  # unsqueeze, then expand from 1
            (y + 10) * 2 if x.shape[0] == 1 else (y + 10) - 1,  # control flow on a size being 1
        )


def _walk(model: nn.Module, sizes: tuple[int, ...], **options: object) -> None:
    eager, om = twin(model, fallback="raise", **options)
    for step, b in enumerate(sizes):
        x = torch.randn(b, 4, requires_grad=True)
        run_step(eager, om, (x,), seed=step)
        eager.zero_grad(set_to_none=True)
        om.zero_grad(set_to_none=True)
        with torch.no_grad():
            run_step(eager, om, (x.detach(),), seed=step, backward=False)
    assert_ran_in_ort(om)


@pytest.mark.parametrize("sizes", SEQUENCES, ids=lambda s: "-".join(map(str, s)))
def test_squeeze_of_size_one_then_larger(sizes: tuple[int, ...]) -> None:
    _walk(_Squeeze(), sizes)


@pytest.mark.parametrize("sizes", SEQUENCES[:2], ids=lambda s: "-".join(map(str, s)))
def test_ops_that_read_size_one(sizes: tuple[int, ...]) -> None:
    _walk(_SizeOne(), sizes)


def test_symbolic_from_the_start() -> None:
    _walk(_SizeOne(), (1, 3, 1, 5), dynamic=True)


def test_static_sizes_without_onnxscripts_optimizer() -> None:
    """A squeeze of a static size other than 1 is exported as no Squeeze at all (not left to an optimizer)."""
    _walk(_SizeOne(), (3, 1, 5), dynamic=False, graph_optimization_level="disable")
