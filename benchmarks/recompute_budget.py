"""Memory budgets on a 3-layer GPT (d32, dropout 0.1): saved bytes, predicted cost, capture time, and
the largest difference from the plan without recompute (issue 43).

    python benchmarks/recompute_budget.py
"""

from __future__ import annotations

import copy
import time
import warnings

import torch

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch


def run(model, batch, **options):
    torch.manual_seed(1)
    om = ortlab.ORTModule(copy.deepcopy(model), **options)
    start = time.perf_counter()
    loss = om(*batch)
    loss.backward()
    return om, loss, {n: p.grad for n, p in om.named_parameters()}, time.perf_counter() - start


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=3, block_size=16, dropout=0.1))
    batch = make_batch("gpt", 4, vocab=50, block_size=16)
    base, loss0, grads0, t0 = run(model, batch, recompute="none")
    print(f"none: {base.report.captures[0].plan.saved_bytes:,} bytes saved; first step {t0:.1f} s")
    for budget in (0.75, 0.5, 0.25, 0.1, "10kB"):
        om, loss, grads, t = run(model, batch, recompute=("budget", budget))
        plan = om.report.captures[0].plan
        diff = max((grads[k] - g).abs().max().item() for k, g in grads0.items())
        print(f"budget {budget}: {plan.saved_bytes:,} bytes (budget {plan.budget_bytes:,}); {plan.cost}; "
              f"first step {t:.1f} s; loss diff {(loss - loss0).abs().item():.1e}, largest grad diff {diff:.1e}\n"
              f"  {plan.note}")


if __name__ == "__main__":
    main()
