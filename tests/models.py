"""Tiny models shared by the parity tests.

``MODELS[name]()`` returns ``(module, inputs_fn)``. ``inputs_fn(step=0, **sizes)``
returns ``(args, kwargs)`` for one call; the same ``step`` always gives the same
values (own ``torch.Generator``, so the global random stream is never touched), and
a different ``step`` gives different values. Keyword ``sizes`` (``batch``, ``seq``)
change the shapes, for the dynamic-shape tests.

Everything here is defined at module level so ORTModules wrapping these models can
be pickled.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ortlab.models import GPT, GPTConfig, TinyMLP, make_batch

InputsFn = Callable[..., tuple[tuple, dict]]

GPT_CONFIG = dict(vocab=50, d_model=32, n_heads=2, n_layers=2, block_size=16)


def gen(step: int) -> torch.Generator:
    """A generator seeded by ``step`` (inputs never consume the global RNG)."""
    return torch.Generator().manual_seed(1000 + step)


def randn(step: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(step))


# ----------------------------------------------------------------------------- reference models
class TanhNet(nn.Module):
    """Linear-tanh-Linear on 6 features, for the stage and stepper tests; ``reduce`` sums the output."""

    def __init__(self, reduce: bool = True) -> None:
        super().__init__()
        self.reduce = reduce
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out.sum() if self.reduce else out


def tiny_mlp() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 8) -> tuple[tuple, dict]:
        x, y = make_batch("tiny", batch, gen(step))
        return (x, y), {}

    return TinyMLP(), inputs


def tiny_gpt(dropout: float = 0.0) -> tuple[nn.Module, InputsFn]:
    cfg = GPTConfig(**GPT_CONFIG, dropout=dropout)

    def inputs(step: int = 0, batch: int = 2, seq: int = 8) -> tuple[tuple, dict]:
        idx, targets = make_batch("gpt", batch, gen(step), vocab=cfg.vocab, block_size=seq)
        return (idx, targets), {}

    return GPT(cfg), inputs


def tiny_gpt_dropout() -> tuple[nn.Module, InputsFn]:
    return tiny_gpt(dropout=0.2)


# --------------------------------------------------------------------------- buffers / randomness
class ConvBN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> pool -> BatchNorm1d(momentum=None) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn1d = nn.BatchNorm1d(4, momentum=None)  # cumulative average: uses num_batches_tracked
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(self.bn1d(h.mean(dim=(2, 3))))


def conv_bn() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 3, 6, 6) * 2 + 0.5,), {}

    return ConvBN(), inputs


class BufferMutation(nn.Module):
    """Plain buffers written in forward: a step counter and an EMA of the input mean."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x - self.ema) * self.steps


def buffer_mutation() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 5) -> tuple[tuple, dict]:
        return (randn(step, batch, 6),), {}

    return BufferMutation(), inputs


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, p=0.1, training=self.training)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def dropout_mlp() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 8) -> tuple[tuple, dict]:
        return (randn(step, batch, 16),), {}

    return DropoutMLP(), inputs


# --------------------------------------------------------------------------------- call signatures
class KwargsDefaults(nn.Module):
    """Positional, keyword, None and default arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        scale: float = 1.0,
        *,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.lin(x) * scale
        if y is not None:
            h = h + self.other(y)
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        if bias is not None:
            h = h + bias
        return torch.tanh(h)


def kwargs_defaults() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 8),), {}

    return KwargsDefaults(), inputs


class VarArgs(nn.Module):
    """``forward(*xs, **named)``: every positional goes through ``lin``, every keyword is weighted by name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.weights = nn.ParameterDict({k: nn.Parameter(torch.randn(4)) for k in ("a", "b", "c")})

    def forward(self, *xs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        out = sum(self.lin(x) * (i + 1) for i, x in enumerate(xs))
        for key in sorted(named):
            out = out + named[key] * self.weights[key]
        return out


def varargs() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 3) -> tuple[tuple, dict]:
        return (randn(step, batch, 4), randn(step + 100, batch, 4)), {"b": randn(step + 200, batch, 4)}

    return VarArgs(), inputs


class NestedInputs(nn.Module):
    """Takes ``{"feats": [a, b, ...], "extra": {"w": tensor, "skip": None | tensor}, "alpha": float}``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, batch: dict[str, Any], pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        h = sum(self.enc(f) for f in batch["feats"])
        h = h * batch["extra"]["w"]
        if batch["extra"].get("skip") is not None:
            h = h + batch["extra"]["skip"]
        h = h * batch.get("alpha", 1.0)
        for a, b in pairs or []:
            h = h + a * b
        return self.head(h)


def nested_inputs() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 3) -> tuple[tuple, dict]:
        data = {
            "feats": [randn(step, batch, 5), randn(step + 1, batch, 5)],
            "extra": {"w": randn(step + 2, 5), "skip": None},
            "alpha": 0.5,
        }
        return (data,), {"pairs": [(randn(step + 3, batch, 5), randn(step + 4, batch, 5))]}

    return NestedInputs(), inputs


class ScalarArgs(nn.Module):
    """Python int/float/bool arguments used as values, loop counts and branch conditions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, alpha: float, n: int, flip: bool = False) -> torch.Tensor:
        h = self.lin(x) * alpha
        for _ in range(n):
            h = torch.tanh(h) + 0.1 * h
        h = h + n  # the int as a value too
        return -h if flip else h


def scalar_args() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 6), 0.5, 2), {}

    return ScalarArgs(), inputs


class StructureSwitch(nn.Module):
    """Accepts a tensor, a list/tuple of tensors or a dict of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Any) -> torch.Tensor:
        if isinstance(x, dict):
            x = sum(v * (i + 1) for i, (_, v) in enumerate(sorted(x.items())))
        elif isinstance(x, (list, tuple)):
            x = torch.stack(list(x)).sum(0) + len(x)
        return self.lin(x)


def structure_switch() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 3) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return StructureSwitch(), inputs


class GradModes(nn.Module):
    """``torch.no_grad`` / ``enable_grad`` / ``detach`` inside forward (a stop-gradient target)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            target = torch.tanh(self.teacher(x))
        h = self.student(x)
        with torch.enable_grad():
            g = h * 2
        return ((h - target) ** 2).mean() + (h.detach() * g).mean(), target


def grad_modes() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 3) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return GradModes(), inputs


# ------------------------------------------------------------------------------------- outputs
Pair = namedtuple("Pair", ["value", "missing", "index"])


class StructuredOutputs(nn.Module):
    """Returns a dict holding a tuple, a namedtuple, a list and a nested dict, with None leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.a(x))
        logits = self.b(h)
        return {
            "logits": logits,
            "aux": (h, None, h.sum(-1)),
            "pair": Pair(value=logits.softmax(-1), missing=None, index=logits.argmax(-1)),
            "nested": [None, {"deep": h * 2, "none": None}],
        }


def structured_outputs() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 5) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return StructuredOutputs(), inputs


class NonDiffOutputs(nn.Module):
    """Differentiable logits next to argmax, a bool mask, topk indices and an int count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.lin(x)
        mask = logits > 0
        top = logits.topk(3, dim=-1)
        return logits, logits.argmax(-1), mask, top.indices, mask.sum(-1), top.values


def nondiff_outputs() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 6) -> tuple[tuple, dict]:
        return (randn(step, batch, 5),), {}

    return NonDiffOutputs(), inputs


# ---------------------------------------------------------------------------------- parameters
class FrozenUnused(nn.Module):
    """A frozen layer, a frozen bare parameter, a trainable layer and an unused layer/parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.full((4,), 1.5), requires_grad=False)
        self.train_me = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 4)
        self.unused_p = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.train_me(torch.relu(self.frozen(x)) * self.gain)


def frozen_unused() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return FrozenUnused(), inputs


# ------------------------------------------------------------------------------ autograd features
class StraightThroughClamp(torch.autograd.Function):
    """Forward clamps; backward passes the gradient through unchanged (not clamp's true grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ScaledSquare(torch.autograd.Function):
    """``y = alpha * x**2`` with a hand-written backward that saves ``x`` and a non-tensor ``alpha``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return alpha * x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * 2 * ctx.alpha * x + 0.25, None  # deliberately not the true gradient


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThroughClamp.apply(self.lin(x))
        return self.out(ScaledSquare.apply(h, 0.7))


def custom_function() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 4) * 3,), {}

    return CustomFunction(), inputs


class InPlace(nn.Module):
    """In-place ops on activations and views, and an in-place update of a (non-grad) input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.lin2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.mul_(2.0)
        h[:, 0] = x[:, 1]  # slice assignment of a tensor
        h.narrow(1, 2, 2).add_(1.0)  # in-place on a view
        h += x
        h.clamp_(min=-1.0)
        h.relu_()
        counter.add_(1)  # mutates the caller's tensor
        return self.lin2(h) * counter


class SetItemScalar(nn.Module):
    """``h[:, 0] = 0.0``: assigning a Python scalar into a slice (Dynamo lifts a constant tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h[:, 0] = 0.0
        return h


def setitem_scalar() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 3) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return SetItemScalar(), inputs


def inplace() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 6), torch.full((1,), float(step))), {}

    return InPlace(), inputs


class AttrScale(nn.Module):
    """Forward reads a float attribute, a bool attribute and a submodule that tests replace."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.scale = 0.5
        self.residual = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x)) * self.scale
        return h + x if self.residual else h


def attr_scale() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 4),), {}

    return AttrScale(), inputs


# ----------------------------------------------------------------------------- composite pieces
class Stage(nn.Module):
    """One stage of a chained pipeline; may hold a shared submodule."""

    def __init__(self, shared: nn.Module | None = None, width: int = 6) -> None:
        super().__init__()
        self.own = nn.Linear(width, width)
        self.shared = shared if shared is not None else nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.relu(self.own(x))))


def stage() -> tuple[nn.Module, InputsFn]:
    def inputs(step: int = 0, batch: int = 4) -> tuple[tuple, dict]:
        return (randn(step, batch, 6),), {}

    return Stage(), inputs


MODELS: dict[str, Callable[[], tuple[nn.Module, InputsFn]]] = {
    "tiny_mlp": tiny_mlp,
    "tiny_gpt": tiny_gpt,
    "tiny_gpt_dropout": tiny_gpt_dropout,
    "conv_bn": conv_bn,
    "buffer_mutation": buffer_mutation,
    "dropout_mlp": dropout_mlp,
    "kwargs_defaults": kwargs_defaults,
    "varargs": varargs,
    "nested_inputs": nested_inputs,
    "scalar_args": scalar_args,
    "structure_switch": structure_switch,
    "grad_modes": grad_modes,
    "structured_outputs": structured_outputs,
    "nondiff_outputs": nondiff_outputs,
    "frozen_unused": frozen_unused,
    "custom_function": custom_function,
    "inplace": inplace,
    "setitem_scalar": setitem_scalar,
    "attr_scale": attr_scale,
    "stage": stage,
}


def make(name: str, seed: int = 0) -> tuple[nn.Module, InputsFn]:
    """Build registry model ``name`` with parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    return MODELS[name]()
