"""ortlab.optim: FusedAdam steps as torch.optim.AdamW/Adam; FP16_Optimizer scales as torch.amp.GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortlab.errors import ConfigError
from ortlab.optim import FP16_Optimizer, FusedAdam

ATOL = 1e-6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))  # a 0-d parameter
        self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient: must stay as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def _groups(model: _Net) -> list[dict]:
    return [{"params": model.body.parameters(), "lr": 3e-3, "weight_decay": 0.1},
            {"params": [model.head.weight, model.head.bias, model.scale, model.unused], "betas": (0.8, 0.99)}]


def _run(model: _Net, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        if i % 3 == 1:
            model.head.bias.grad = None  # skipped this step: its step count falls behind the others'
        opt.step()
        opt.zero_grad()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("adam_w_mode, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_matches_torch_over_100_steps(adam_w_mode, reference):
    torch.manual_seed(0)
    ours = _Net()
    theirs = copy.deepcopy(ours)
    unused = ours.unused.detach().clone()
    opt = FusedAdam(_groups(ours), lr=1e-3, weight_decay=0.01, adam_w_mode=adam_w_mode)
    _run(ours, opt, 100)
    _run(theirs, reference(_groups(theirs), lr=1e-3, weight_decay=0.01), 100)
    assert _max_diff(ours, theirs) < ATOL
    assert torch.equal(ours.unused, unused) and ours.unused not in opt.state
    assert opt.state[ours.head.bias]["step"].item() == 67 and opt.state[ours.head.weight]["step"].item() == 100


def test_fused_adam_updates_in_place():
    torch.manual_seed(0)
    model = _Net()
    opt = FusedAdam(model.parameters())
    _run(model, opt, 1)
    pointers = {id(p): p.data_ptr() for p in model.parameters()}
    moments = {id(p): opt.state[p]["exp_avg"].data_ptr() for p in model.parameters() if p in opt.state}
    before = model.head.weight.detach().clone()
    _run(model, opt, 2)
    assert not torch.equal(model.head.weight, before)
    assert pointers == {id(p): p.data_ptr() for p in model.parameters()}
    assert moments == {id(p): opt.state[p]["exp_avg"].data_ptr() for p in model.parameters() if p in opt.state}


def test_fused_adam_state_dict_round_trips_and_loads_into_adamw():
    torch.manual_seed(0)
    model = _Net()
    resumed, torch_resumed = copy.deepcopy(model), copy.deepcopy(model)
    first = FusedAdam(_groups(model))
    _run(model, first, 10)
    state = copy.deepcopy(first.state_dict())
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["param_groups"][0]["decoupled_weight_decay"]
    resumed.load_state_dict(model.state_dict())
    torch_resumed.load_state_dict(model.state_dict())
    again = FusedAdam(_groups(resumed))
    again.load_state_dict(copy.deepcopy(state))  # loading keeps the tensors, which the steps then update
    _run(resumed, again, 10, seed=2)
    adamw = torch.optim.AdamW(_groups(torch_resumed))
    adamw.load_state_dict(state)  # the same state layout as torch's AdamW
    _run(torch_resumed, adamw, 10, seed=2)
    _run(model, first, 10, seed=2)
    assert _max_diff(resumed, model) == 0.0
    assert _max_diff(torch_resumed, model) < ATOL


def test_fused_adam_zero_grad_and_closure():
    model = _Net()
    opt = FusedAdam(model.parameters())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert opt.step() is None  # nothing has a gradient: nothing to do


def test_fused_adam_refuses_fp16_parameters():
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    p.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ConfigError, match="float32 and float64 parameters; one is torch.float16"):
        FusedAdam([p]).step()
    with pytest.raises(ConfigError, match=r"betas must both lie in \[0, 1\)"):
        FusedAdam([p], betas=(0.9, 1.5))


# --------------------------------------------------------------------------------- FP16_Optimizer
def _scaled_runs(steps: int, overflow_at: set[int], growth_interval: int) -> tuple:
    """FP16_Optimizer and torch.amp.GradScaler on twin fp32 models; an inf is put into a gradient on some steps."""
    torch.manual_seed(0)
    ours_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    theirs_model = copy.deepcopy(ours_model)
    ours = FP16_Optimizer(torch.optim.SGD(ours_model.parameters(), lr=0.1), init_scale=2.0**10,
                          growth_interval=growth_interval)
    opt = torch.optim.SGD(theirs_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    g = torch.Generator().manual_seed(1)
    trace = []
    for i in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        before = [p.detach().clone() for p in ours_model.parameters()]
        ours.zero_grad()
        ours.backward(F.cross_entropy(ours_model(x), y))
        opt.zero_grad()
        scaler.scale(F.cross_entropy(theirs_model(x), y)).backward()
        if i in overflow_at:
            ours_model[0].weight.grad[0, 0] = float("inf")
            theirs_model[0].weight.grad[0, 0] = float("inf")
        ours.step()
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, ours_model.parameters()))
        trace.append((ours.loss_scale, scaler.get_scale(), ours.overflow, unchanged))
    return ours, ours_model, theirs_model, trace


def test_fp16_optimizer_scales_as_grad_scaler():
    ours, ours_model, theirs_model, trace = _scaled_runs(12, overflow_at={2, 7, 8}, growth_interval=3)
    assert [t[0] for t in trace] == [t[1] for t in trace]  # the same scale after every step
    assert [i for i, t in enumerate(trace) if t[2]] == [2, 7, 8]
    assert all(t[3] for t in trace if t[2])  # skipped steps leave the parameters as they were
    assert ours.skipped_steps == 3
    assert [t[0] for t in trace][:7] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    assert max((a - b).abs().max().item() for a, b in zip(ours_model.parameters(), theirs_model.parameters())) == 0.0


def test_fp16_optimizer_trains_an_fp16_model_and_backs_off_from_overflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), init_scale=2.0**24, growth_interval=1000)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g).half(), torch.randint(0, 4, (32,), generator=g)
    losses, skipped = [], []
    for _ in range(40):
        before = [p.detach().clone() for p in model.parameters()]
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        if opt.overflow:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            skipped.append(opt.loss_scale)
        losses.append(loss.item())
    # fp16 gradients overflow at 2**24 (max 65504): the scale halves on each skipped step until they fit
    assert opt.skipped_steps >= 1 and skipped[0] == 2.0**23 and opt.loss_scale < 2.0**24
    assert losses[-1] < losses[opt.skipped_steps] - 0.05  # and then it trains


def test_fp16_optimizer_state_dict_and_unscale():
    model = nn.Linear(4, 2)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=8.0, growth_interval=2)
    opt.backward(model(torch.ones(1, 4)).sum())
    assert opt.unscale_() is False
    torch.testing.assert_close(model.bias.grad, torch.ones(2))  # the true gradient, before clipping it
    with pytest.raises(RuntimeError, match="unscale_\\(\\) was already called"):
        opt.unscale_()
    opt.step()
    state = opt.state_dict()
    other = FP16_Optimizer(torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    other.load_state_dict(state)
    assert (other.loss_scale, other.growth_interval, other.skipped_steps) == (8.0, 2, 0)
    assert other.state_dict()["good_steps"] == 1
    with pytest.raises(ConfigError, match="backoff_factor in \\(0, 1\\)"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), backoff_factor=2.0)
