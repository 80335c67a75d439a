"""recompute=("budget", ...): the saved activations fit the budget, at the least recompute, with eager's results."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import ortlab
from ortlab.config import describe_recompute, parse_budget
from ortlab.errors import ConfigError
from ortlab.models import GPT, GPTConfig, make_batch

pytestmark = pytest.mark.filterwarnings("ignore::ortlab.FallbackWarning")


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    # dropout: a budget must never recompute a random op (it would redraw the mask)
    model = GPT(GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=3, block_size=16, dropout=0.1))
    return model, make_batch("gpt", 4, vocab=50, block_size=16)


def run(model, batch, **options):
    torch.manual_seed(1)
    om = ortlab.ORTModule(copy.deepcopy(model), **options)
    loss = om(*batch)
    loss.backward()
    return om.report.captures[0].plan, loss, {n: p.grad for n, p in om.named_parameters()}


@pytest.fixture(scope="module")
def baseline(gpt_and_batch):
    return run(*gpt_and_batch, recompute="none")


@pytest.fixture(scope="module")
def budgets(gpt_and_batch):
    """One capture per budget (~5-8 s each), shared by the tests."""
    runs: dict[object, tuple] = {}

    def get(budget):
        if budget not in runs:
            runs[budget] = run(*gpt_and_batch, recompute=("budget", budget))
        return runs[budget]

    return get


@pytest.mark.parametrize("budget", [0.75, "25%", "150kB"])
def test_budget_fits_with_results_as_without_recompute(budgets, baseline, budget):
    plan0, loss0, grads0 = baseline
    plan, loss, grads = budgets(budget)
    kind, amount = parse_budget(budget)
    expected = int(amount * plan0.saved_bytes) if kind == "fraction" else int(amount)
    assert plan.budget_bytes == expected
    assert 0 < plan.saved_bytes <= plan.budget_bytes < plan0.saved_bytes
    assert plan.recomputed and plan.recompute_flops > 0 and plan.forward_flops > plan.recompute_flops
    assert plan.note.startswith(f"budget {expected:,} bytes: saves {plan.saved_bytes:,} of {plan0.saved_bytes:,}")
    assert "recomputes" in plan.cost and "of the forward" in plan.cost
    assert plan.policy == describe_recompute(("budget", budget))
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    for name, g in grads0.items():  # the same ops on the same values; onnxruntime may fuse a recomputed op apart
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{budget} {name}: {m}")


def test_a_larger_budget_recomputes_less(budgets):
    costs = [budgets(b)[0].recompute_flops for b in ("25%", "150kB", 0.75)]
    assert costs[0] >= costs[1] >= costs[2] > 0, costs


def test_an_unreachable_budget_says_so_with_the_smallest_figure(gpt_and_batch, baseline, caplog):
    with caplog.at_level(logging.WARNING, logger="ortlab"):
        plan, loss, _ = run(*gpt_and_batch, recompute=("budget", "1kB"))
    assert plan.budget_bytes == 1000 < plan.saved_bytes < baseline[0].saved_bytes / 2
    assert f"the budget (1,000 bytes) cannot be met: the smallest reachable is {plan.saved_bytes:,} bytes" in plan.note
    assert any("cannot be met" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(loss, baseline[1], rtol=0, atol=0)


def test_a_budget_already_met_recomputes_nothing(gpt_and_batch, baseline):
    plan, _, _ = run(*gpt_and_batch, recompute=("budget", "1GB"))
    assert not plan.recomputed and plan.saved_bytes == baseline[0].saved_bytes
    assert "within the budget" in plan.note and plan.cost == "recomputes nothing"


def test_budget_values_and_their_errors(monkeypatch):
    assert parse_budget(0.5) == ("fraction", 0.5) and parse_budget("50%") == ("fraction", 0.5)
    assert parse_budget("300MB") == ("bytes", 300e6) and parse_budget("2 GiB") == ("bytes", 2 * 2**30)
    assert parse_budget(4096) == ("bytes", 4096.0)
    assert describe_recompute(("budget", 0.5)) == "budget 50%"
    assert describe_recompute(("budget", "300MB", "-op:aten.clone")) == "budget 300 MB -op:aten.clone"
    for bad in [("budget",), ("budget", 0), ("budget", 1.5), ("budget", 1), ("budget", "lots"), ("budget", "150%")]:
        with pytest.raises(ConfigError, match="budget"):
            ortlab.Options(recompute=bad)
    monkeypatch.setenv("ORTLAB_RECOMPUTE", "budget,0.5")
    assert ortlab.Options().recompute == ("budget", "0.5")


def test_measured_kernel_times_refine_the_ranking():
    """The cost is counted in FLOPs and refined by measured times where a profile has them: ops measured
    far slower than their FLOPs say make the plan that recomputes them lose."""
    from ortlab.inspect.profile import NodeTime

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=3, block_size=16))
    batch = make_batch("gpt", 4, vocab=50, block_size=16)
    om = ortlab.ORTModule(model, recompute=("budget", 0.75))
    om(*batch).backward()
    by_flops = om.report.captures[0].plan
    assert "ranked by FLOPs (no kernel profile yet)" in by_flops.note and by_flops.recompute_us == 0
    slow = {a.name for a in by_flops.recomputed}
    forward = om.report.captures[0].graphs[0].graph_module.graph.nodes
    records = [NodeTime(n.name, "K", 1e4 if n.name in slow else 1.0, 1, "g0.forward", fx_node=n.name,
                        per_run_us=[1e4 if n.name in slow else 1.0]) for n in forward if n.op == "call_function"]
    assert om.note_kernel_times(records) >= len(slow) and set(om.kernel_times) >= slow
    om.reconfigure(recompute=("budget", 0.75))
    om(*batch).backward()
    by_time = om.report.captures[0].plan
    assert "ranked by measured kernel times" in by_time.note and "us a step by measured kernel times" in by_time.cost
    assert by_time.saved_bytes <= by_time.budget_bytes
    assert len(slow & {a.name for a in by_time.recomputed}) < len(slow), (slow, by_time.table())


def test_a_monitor_s_profile_window_hands_its_times_to_the_module():
    from ortlab.models import TinyMLP

    om = ortlab.ORTModule(TinyMLP())
    mon = ortlab.monitor(om, every=1000, show=False, profile_steps=2)
    mon.profile_now()
    for _ in range(30):
        om(torch.randn(4, 64)).sum().backward()
        if mon.profiles:
            break
    mon.close()
    assert mon.profiles and om.kernel_times and all(us >= 0 for us in om.kernel_times.values())
