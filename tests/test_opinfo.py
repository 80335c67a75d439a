"""PyTorch's OpInfo samples through ORTModule: a fixed slice of the sweep, and the harness's own checks.

The full sweep (every op, every dtype; hours on 2 cores) is ``benchmarks/opinfo_sweep.py``, its
table in ``benchmarks/results/opinfo/table.md``. This slice runs the ops of the edge-value defects
and a spread of what models use, in the dtypes users train in, and asserts that every sample ends
in one of the four acceptable outcomes: matched, the same error as eager, routed to PyTorch with
a reason, or a documented known difference. None may be silently different.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("expecttest")  # torch's OpInfo module imports it

from opinfo.harness import BAD_OUTCOMES, find_op, run_op, summarize  # noqa: E402

# (op, dtype): the defects' ops first, then a spread of what models use.
SLICE = [
    ("atan2", "float32"), ("sign", "float32"), ("signbit", "float32"), ("logaddexp", "float32"),
    ("logcumsumexp", "float32"), ("special.log_ndtr", "float32"), ("special.erfcx", "float32"),
    ("remainder", "float32"), ("remainder", "int64"), ("div.trunc_rounding", "int64"),
    ("div.floor_rounding", "int64"), ("div.no_rounding_mode", "float32"), ("sum", "int64"), ("prod", "int64"),
    ("cumprod", "int64"), ("nn.functional.hardtanh", "float32"), ("nn.functional.relu6", "float32"),
    ("nn.functional.avg_pool2d", "float32"), ("nn.functional.scaled_dot_product_attention", "float32"),
    ("max.reduction_with_dim", "float32"), ("amax", "float32"), ("nn.functional.mse_loss", "float32"),
    ("nn.functional.binary_cross_entropy", "float32"), ("argmax", "bool"), ("var", "float32"),
    ("std", "float32"), ("nn.functional.layer_norm", "float32"), ("linalg.vector_norm", "float32"),
    ("nn.functional.cross_entropy", "float64"), ("squeeze", "float32"),
    ("nn.functional.linear", "float32"), ("matmul", "float32"), ("nn.functional.conv2d", "float32"),
    ("nn.functional.embedding", "float32"), ("nn.functional.gelu", "float32"), ("softmax", "float32"),
    ("log_softmax", "float32"), ("mean", "float32"), ("where", "float32"), ("cat", "float32"),
    ("index_select", "float32"), ("gather", "int64"), ("clamp", "float32"), ("pow", "float32"),
]


@pytest.mark.parametrize(("name", "dtype"), SLICE, ids=[f"{n}-{d}" for n, d in SLICE])
def test_every_sample_ends_in_an_acceptable_outcome(name: str, dtype: str) -> None:
    outcomes = run_op(find_op(name), getattr(torch, dtype))
    assert outcomes, f"{name} {dtype}: no samples ran"
    bad = [o for o in outcomes if o.outcome in BAD_OUTCOMES]
    assert not bad, f"{name} {dtype}: {summarize(outcomes)}\n" + "\n".join(
        f"  {o.outcome} {o.source} {o.index} ({o.sample[:80]}): {o.detail[:300]}" for o in bad[:20])


# ---------------------------------------------------------------------------- the harness itself
class _Off(nn.Module):
    """Runs the module, then moves every float output by ``delta``: a wrong translation."""

    def __init__(self, module: nn.Module, delta: float) -> None:
        super().__init__()
        self.module, self.delta = module, delta

    def forward(self, *args: torch.Tensor) -> list:
        return [o + self.delta if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                for o in self.module(*args)]


class _Swallow(nn.Module):
    """Returns zeros instead of raising: an invalid input accepted."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> list:
        try:
            return self.module(*args)
        except Exception:  # noqa: BLE001
            return [torch.zeros(())]


def test_the_harness_calls_a_wrong_value_different_and_float32_rounding_a_match() -> None:
    op = find_op("sin")
    wrong = run_op(op, torch.float32, sources=("sample",), wrap=lambda m: _Off(m, 1e-3))
    assert wrong and all(o.outcome == "different" for o in wrong), summarize(wrong)
    tiny = run_op(op, torch.float32, sources=("sample",), wrap=lambda m: _Off(m, 1e-9))
    assert all(o.outcome == "matched" for o in tiny), summarize(tiny)


def test_the_harness_calls_a_flipped_zero_sign_different() -> None:
    class Negate(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: torch.Tensor) -> list:
            return [torch.where(o == 0, -o, o) for o in self.module(*args)]

    got = run_op(find_op("abs"), torch.float32, sources=("reference",), wrap=Negate)
    assert any(o.outcome == "different" and "signed zero" in o.detail for o in got), summarize(got)


def test_the_harness_calls_an_accepted_error_input_no_error() -> None:
    got = run_op(find_op("gather"), torch.float32, sources=("error",), wrap=_Swallow)
    # (an out= eager rejects is a known difference: Dynamo drops PyTorch's checks of out=)
    plain = [o for o in got if "out=" not in o.sample]
    assert plain and all(o.outcome == "no_error" for o in plain), summarize(got)
    assert all(o.outcome == "known" for o in got if "out=" in o.sample), summarize(got)
    alike = run_op(find_op("gather"), torch.float32, sources=("error",), wrap=lambda m: m)
    assert all(o.outcome == "errors_alike" for o in alike), summarize(alike)
