"""NaN goes through maximum, minimum and max pools as in PyTorch (ortlab/torchlib/translations.py).

onnxruntime's ReduceMax/ArgMax skip NaN: on ``[1, nan, -2, .5]`` ``amax`` was 1.0 through
onnxruntime where PyTorch gives nan (and the first NaN's index for argmax/max.dim).
"""

from __future__ import annotations

import warnings

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab

NAN = float("nan")
INPUTS = {
    "nan": torch.tensor([[1.0, NAN, -2.0, 0.5], [3.0, 1.0, NAN, NAN], [0.0, -1.0, 2.0, 2.0]]),
    "finite": torch.tensor([[1.0, 4.0, -2.0, 0.5], [3.0, 1.0, 2.0, 0.0], [2.0, 2.0, -1.0, 5.0]]),
    "int": torch.tensor([[1, 4, -2, 5], [3, 1, 2, 0], [7, 7, 1, 0]]),
    "scalar": torch.tensor(NAN),
}
OPS: dict[str, Callable[[torch.Tensor], object]] = {
    "amax": lambda t: t.amax(dim=-1),
    "amax_all_keepdim": lambda t: t.amax(dim=tuple(range(t.dim())), keepdim=True),
    "amin": lambda t: t.amin(dim=0),
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "max_dim": lambda t: tuple(t.max(dim=-1)),
    "min_dim_keepdim": lambda t: tuple(t.min(dim=0, keepdim=True)),
    "argmax": lambda t: t.argmax(dim=-1),
    "argmin": lambda t: t.argmin(dim=0),
    "argmax_all": lambda t: t.argmax(),
    "argmin_all_keepdim": lambda t: t.argmin(keepdim=True),
    # Without ties: PyTorch does not define the order of equal elements (its CPU kernel put
    # index 1 before index 0 for [2, 2, -1, 5]; ONNX's TopK takes the lower index first).
    "topk": lambda t: tuple((t * 16 + torch.arange(t.shape[-1])).topk(2, dim=-1)),
    "max_pool1d": lambda t: F.max_pool1d(t.float().unsqueeze(0), 2),
    # ONNX MaxPool skips NaN: [[nan, 0.32], [1.24, 1.24]] where PyTorch gave [[nan, nan], [nan, nan]]
    "max_pool2d": lambda t: F.max_pool2d(t.float().reshape(1, 1, 3, 4), 2, 1, padding=1),
    "max_pool2d_unbatched": lambda t: F.max_pool2d(t.float().reshape(1, 3, 4), 3, 2, padding=1, ceil_mode=True),
    "max_pool3d": lambda t: F.max_pool3d(t.float().reshape(1, 1, 1, 3, 4), (1, 2, 2)),
    "clamp": lambda t: t.clamp(0, 1),
    "softmax": lambda t: t.float().softmax(-1),
}


def _same(actual: object, expected: object) -> None:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, (a, e)
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("kind", list(INPUTS))
def test_max_and_min_propagate_nan_like_pytorch(name, kind):
    fn, x = OPS[name], INPUTS[kind]
    try:
        expected = fn(x.clone())
    except (RuntimeError, IndexError):
        pytest.skip(f"PyTorch itself rejects {name} on {kind}")

    class Op(nn.Module):
        def forward(self, t: torch.Tensor) -> object:
            return fn(t)

    # topk's indices are read: it runs in PyTorch by design (Note [topk's ties] in ortlab/placement.py)
    om = ortlab.ORTModule(Op(), fallback="warn" if name == "topk" else "raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ortlab.FallbackWarning)
        _same(om(x.clone()), expected)
    if name == "topk":
        assert any("ONNX TopK takes the lowest first" in f.reason for f in om.report.fallbacks)


def test_gradients_through_max_and_min_match():
    x = INPUTS["finite"]

    class Reduce(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t.amax(1).sum() + t.max(dim=0).values.sum() * 2 + t.min() * 3 + t.amin(0).sum()

    eager_x, ort_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    Reduce()(eager_x).backward()
    ortlab.ORTModule(Reduce(), fallback="raise")(ort_x).backward()
    torch.testing.assert_close(ort_x.grad, eager_x.grad)
