"""The on-disk cache: a hit skips export and matches eager; a different graph misses."""

from __future__ import annotations

import copy

import torch
from torch import nn

import ortlab

RTOL, ATOL = 1e-4, 1e-5


class Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = act
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def step(om: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    out, ref = om(x), eager(x)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)


def cached(om: ortlab.ORTModule) -> int:
    return sum(g.cached for c in om.report.captures for g in c.graphs)


def test_second_module_hits_the_cache_and_matches(tmp_path):
    torch.manual_seed(0)
    base = Net(nn.Tanh())
    x = torch.randn(4, 6)
    first = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(first, copy.deepcopy(base), x)
    assert cached(first) == 0
    entries = [p for p in tmp_path.glob("*.json") if not p.name.startswith("torchlib-ops-")]
    assert len(list(tmp_path.glob("*.onnx"))) == 2 and len(entries) == 2
    assert len(list(tmp_path.glob("torchlib-ops-*.json"))) == 1  # the registry's op list
    second = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(second, copy.deepcopy(base), x)
    assert cached(second) == 2  # forward and backward
    assert all(g.export_s == 0 for g in second.report.captures[0].graphs)
    assert "from the on-disk cache" in str(second.report)
    # Other weights, same graph: still a hit (weights are inputs, not part of the model).
    other = Net(nn.Tanh())
    third = ortlab.ORTModule(copy.deepcopy(other), cache_dir=str(tmp_path))
    step(third, copy.deepcopy(other), x)
    assert cached(third) == 2


def test_different_graph_misses(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    for act in (nn.Tanh(), nn.Sigmoid()):
        base = Net(act)
        om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
        step(om, copy.deepcopy(base), x)
        assert cached(om) == 0
    # A new batch size is another graph too (static first capture).
    base = Net(nn.Tanh())
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(om, copy.deepcopy(base), torch.randn(5, 6))
    assert cached(om) == 0


def test_corrupt_entry_is_dropped_and_rebuilt(tmp_path):
    torch.manual_seed(0)
    base = Net(nn.Tanh())
    x = torch.randn(4, 6)
    step(ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path)), copy.deepcopy(base), x)
    for path in tmp_path.glob("*.onnx"):
        path.write_bytes(b"not an onnx model")
    om = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(om, copy.deepcopy(base), x)
    assert cached(om) == 0
    again = ortlab.ORTModule(copy.deepcopy(base), cache_dir=str(tmp_path))
    step(again, copy.deepcopy(base), x)
    assert cached(again) == 2


_FRESH_PROCESS = """
import sys, torch, ortlab
import ortlab.torchlib as D
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
om = ortlab.ORTModule(net, cache_dir=sys.argv[1])
om(torch.randn(4, 6)).sum().backward()
print(sum(g.cached for c in om.report.captures for g in c.graphs), D.get_registry.cache_info().currsize)
"""


def test_full_cache_hit_skips_building_the_torchlib_registry(tmp_path):
    """Building torch.onnx's registry costs ~0.5 s of the first step; a cache hit needs only its op list."""
    import subprocess
    import sys

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path)], capture_output=True, text=True,
                             check=True, timeout=300)
        return out.stdout.split()

    assert run() == ["0", "1"]  # exported: the registry was built
    assert run() == ["2", "0"]  # forward and backward from the cache, no registry
