"""Out-of-range indices raise PyTorch's own error through ortlab (Note [Index guards]).

ONNX's Gather counts negative indices from the end and onnxruntime refuses indices past
the end with its own message: without the guards ``nn.Embedding(10, 4)`` returned row 9
for index -1 and ``F.cross_entropy`` returned a loss for target -1.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab


class Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(x), target)


class Gathers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.gather(self.w, 1, index), self.w[index[0]]


class Selects(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.w, 0, index) * 2


class Writes(nn.Module):
    """Ops that write at their indices: ONNX's scatters counted a negative index from the end, silently."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        base = torch.ones(5, 4)
        if self.op == "scatter_add":
            return base.scatter_add(0, index.unsqueeze(1).expand(3, 4), self.w)
        if self.op == "scatter_reduce":
            return base.scatter_reduce(0, index.unsqueeze(1).expand(3, 4), self.w, "amax")
        if self.op == "index_add":
            return base.index_add(0, index, self.w)
        if self.op == "index_copy":
            return base.index_copy(0, index, self.w)
        base[index] = self.w * 2  # index_put: negative indices count from the end, as in PyTorch
        return base


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[list], tuple]]] = [
    ("embedding", lambda: nn.Embedding(10, 4), lambda v: (torch.tensor(v),)),
    ("cross_entropy", Loss, lambda v: (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.tensor(v))),
    ("gather", Gathers, lambda v: (torch.tensor(v),)),
    ("index_select", Selects, lambda v: (torch.tensor(v),)),
    *((op, lambda op=op: Writes(op), lambda v: (torch.tensor(v),))
      for op in ("scatter_add", "scatter_reduce", "index_add", "index_copy", "setitem")),
]
VALID = {"embedding": [1, 2, 9], "cross_entropy": [0, -100, 4], "gather": [[0, 1], [2, 3], [1, 1]],
         "index_select": [0, 5, 5], "scatter_add": [4, 0, 4], "scatter_reduce": [4, 0, 4], "index_add": [4, 0, 4],
         "index_copy": [4, 0, 2], "setitem": [-1, 0, 2]}
INVALID = {
    "embedding": [[1, 2, -1], [1, 10], [-11]],
    "cross_entropy": [[0, -1, 2], [0, 5, 1]],
    "gather": [[[0, -1], [2, 3], [1, 1]], [[0, 1], [2, 4], [1, 1]]],
    "index_select": [[0, -1, 2], [6, 0, 0]],
    **{op: [[0, -1, 2], [5, 0, 1]] for op in ("scatter_add", "scatter_reduce", "index_add", "index_copy")},
    "setitem": [[0, -6, 2], [5, 0, 1]],
}


def _run(module: nn.Module, args: tuple) -> object:
    out = module(*args)
    leaves = out if isinstance(out, tuple) else (out,)
    torch.stack([o.float().sum() for o in leaves]).sum().backward()
    return out


@pytest.mark.parametrize("name, make, inputs", CASES, ids=[c[0] for c in CASES])
def test_out_of_range_indices_raise_what_pytorch_raises(name, make, inputs):
    eager = make()
    om = ortlab.ORTModule(copy.deepcopy(eager), fallback="raise")
    for values in INVALID[name]:
        with pytest.raises(Exception) as expected:
            _run(eager, inputs(values))
        with pytest.raises(type(expected.value)) as got:
            _run(om, inputs(values))
        assert str(expected.value) in str(got.value), (values, str(got.value))
        assert "ortlab:" in str(got.value) and "onnxruntime" not in str(got.value).lower().split("ortlab:")[0]
    # Valid indices (negative ones where PyTorch allows them) still match eager, gradients too.
    out_e, out_o = _run(eager, inputs(VALID[name])), _run(om, inputs(VALID[name]))
    torch.testing.assert_close(out_o, out_e, rtol=1e-4, atol=1e-5)
    for p, q in zip(om.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert not om.report.fallbacks


def test_advanced_indexing_counts_negative_indices_from_the_end():
    w = nn.Parameter(torch.randn(5, 3))

    class Index(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = w

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return self.w[i] * 3

    om = ortlab.ORTModule(Index())
    torch.testing.assert_close(om(torch.tensor([-1, 0, -5])), w[torch.tensor([-1, 0, -5])] * 3)
    with pytest.raises(IndexError, match="index -6 is out of bounds for dimension 0 with size 5"):
        om(torch.tensor([-6, 0]))
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 5"):
        om(torch.tensor([5, 0]))


def test_an_empty_index_is_fine():
    om = ortlab.ORTModule(nn.Embedding(10, 4))
    assert om(torch.tensor([], dtype=torch.long)).shape == (0, 4)


def test_the_module_stays_usable_after_an_index_error():
    eager = nn.Embedding(10, 4)
    om = ortlab.ORTModule(copy.deepcopy(eager))
    with pytest.raises(IndexError):
        om(torch.tensor([3, -1])).sum().backward()
    assert om.weight.grad is None
    om(torch.tensor([3, 4])).sum().backward()
    eager(torch.tensor([3, 4])).sum().backward()
    torch.testing.assert_close(om.weight.grad, eager.weight.grad)


def test_guards_survive_the_on_disk_cache(tmp_path):
    ortlab.ORTModule(nn.Embedding(10, 4), cache_dir=str(tmp_path))(torch.tensor([1]))
    cached = ortlab.ORTModule(nn.Embedding(10, 4), cache_dir=str(tmp_path))
    cached(torch.tensor([1]))
    assert sum(g.cached for c in cached.report.captures for g in c.graphs) >= 1
    with pytest.raises(IndexError, match="index out of range in self"):
        cached(torch.tensor([1, -1]))


def test_on_cuda_a_guard_is_an_assert_queued_on_the_device():
    """Note [Index guards on CUDA]: the range tests of ``check`` as asynchronous asserts, which wait for no GPU
    (on the CPU, where this runs, ``torch._assert_async`` raises at once)."""
    from ortlab.onnx.guards import IndexGuard, check_on_device

    embedding = IndexGuard("g", "0", "IndexError", "index {index} is out of range in self", 0, "emb (model.py:3)")
    indexing = IndexGuard("h", "-size", "IndexError", "index {index} is out of bounds for dimension {dim} with size "
                          "{size}", 0, "x[idx]")
    check_on_device([embedding, indexing], [torch.tensor([0, 9, 10]), torch.tensor([-10, 9, 10])])
    with pytest.raises(RuntimeError, match=r"index <index> is out of range in self \(ortlab: emb \(model.py:3\)\)"):
        check_on_device([embedding], [torch.tensor([0, 10, 10])])
    with pytest.raises(RuntimeError, match="with size <size>"):
        check_on_device([embedding, indexing], [torch.tensor([0, 9, 10]), torch.tensor([-11, 0, 10])])
    with pytest.raises(RuntimeError):
        check_on_device([embedding], [torch.tensor([-1, 3, 10])])


class _CatScalars(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b])


class _RaisesItself(torch.nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if a.shape[0] > 2:
            raise ValueError("the model's own check")
        return a * 2


def test_an_error_dynamo_raises_while_tracing_is_eager_s():
    """Note [An error raised while Dynamo traces]: torch.cat of 0-dim tensors fails in a fake-tensor kernel with an
    IndexError; eager's RuntimeError is what the user gets, and the model's own exceptions stay its own."""
    with pytest.raises(RuntimeError, match="zero-dimensional tensor .* cannot be concatenated"):
        ortlab.ORTModule(_CatScalars())(torch.tensor(1.0), torch.tensor(2.0))
    om = ortlab.ORTModule(_RaisesItself())
    with pytest.raises(ValueError, match="the model's own check"):
        om(torch.ones(3))
    torch.testing.assert_close(om(torch.ones(2)), torch.full((2,), 2.0))
    assert not om.report.module_fallbacks, om.report.module_fallbacks
