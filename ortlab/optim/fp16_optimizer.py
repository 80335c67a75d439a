"""``FP16_Optimizer``: dynamic loss scaling around any optimizer, for fp16 training.

onnxruntime's ``onnxruntime.training.optim.FP16_Optimizer`` API, doing what
``torch.amp.GradScaler`` does, step for step.

Note [Loss scaling, as GradScaler does it]
fp16 gradients underflow to zero below 6e-8, so the loss is multiplied by a large scale
before the backward and the gradients divided by it before the step. The scale is a
float32 number (each change rounded to float32, as GradScaler keeps it in a float32
tensor). Every step:

* the gradients are checked for inf/nan *before* they are unscaled, then multiplied by
  ``1 / scale`` (the reciprocal taken in float64, then rounded to float32);
* a step with a non-finite gradient is skipped (the parameters and the optimizer state
  do not change), the scale is multiplied by ``backoff_factor`` and the count of good
  steps restarts;
* otherwise the optimizer steps and, after ``growth_interval`` good steps in a row, the
  scale is multiplied by ``growth_factor`` (unless that would overflow float32).

GradScaler refuses fp16 gradients (it expects fp32 master weights under autocast); this
wrapper takes them, for models kept in fp16 whole. An fp16 loss is scaled in float32
(``2**16`` itself is not an fp16 number) and its gradient is cast back by autograd.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ortlab.errors import ConfigError

__all__ = ["FP16_Optimizer"]


def _float32(x: float) -> float:
    """``x`` rounded to float32 (inf past its range), as the scale is kept."""
    return float(torch.tensor(x, dtype=torch.float32))


class FP16_Optimizer:  # noqa: N801 - onnxruntime's name for it
    """Scales the loss, skips steps whose gradients overflow, and adapts the scale.

    Args:
        optimizer: the optimizer to step (``torch.optim.*``, ``ortlab.optim.FusedAdam``).
        init_scale: the first loss scale.
        growth_factor: the scale's factor after ``growth_interval`` good steps.
        backoff_factor: the scale's factor after a step with inf/nan gradients.
        growth_interval: good steps in a row before the scale grows.

    Attributes:
        loss_scale: the current scale.
        skipped_steps: how many steps were skipped for overflowing gradients.
        overflow: whether the last :meth:`step` was skipped.

    Example:
        >>> opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> opt.zero_grad(); opt.backward(loss); opt.step()                     # doctest: +SKIP
        >>> opt.loss_scale, opt.skipped_steps                                   # doctest: +SKIP
        (65536.0, 0)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ConfigError(f"init_scale must be a positive finite number, got {init_scale}")
        if growth_factor <= 1.0 or not (0.0 < backoff_factor < 1.0):
            raise ConfigError(f"growth_factor must be > 1 and backoff_factor in (0, 1); got {growth_factor} and "
                              f"{backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ConfigError(f"growth_interval must be a positive integer, got {growth_interval}")
        self.optimizer = optimizer
        self.loss_scale = _float32(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.skipped_steps = 0
        self.overflow = False
        self._good_steps = 0
        self._found_inf: bool | None = None  # set by unscale_, cleared by step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, in float32 (see Note [Loss scaling, as GradScaler does it])."""
        return loss.float() * torch.tensor(self.loss_scale, dtype=torch.float32, device=loss.device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate the scaled loss (``kwargs`` go to ``Tensor.backward``)."""
        self.scale_loss(loss).backward(**kwargs)

    @torch.no_grad()
    def unscale_(self) -> bool:
        """Divide the gradients by the scale now (before clipping them); returns whether one is inf/nan.

        :meth:`step` calls it when you have not; calling it twice before a step raises.
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last step()")
        grads = self._grads()
        found = False
        if grads:
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            found = not bool(finite)
            inv_scale = torch.tensor(self.loss_scale, dtype=torch.float64).reciprocal().float()
            for g in grads:
                g.mul_(inv_scale.to(g.device))
        self._found_inf = found
        return found

    def step(self, closure: Any = None) -> Any:
        """Unscale, then step the optimizer unless a gradient overflowed; then update the scale.

        Returns what the optimizer's step returned (``None`` when the step was skipped).
        """
        if closure is not None:
            raise ConfigError("FP16_Optimizer.step takes no closure; call backward() before step()")
        found = self.unscale_() if self._found_inf is None else self._found_inf
        self._found_inf = None
        self.overflow = found
        result = None
        if found:
            self.skipped_steps += 1
            self.loss_scale = _float32(self.loss_scale * self.backoff_factor)
            self._good_steps = 0
        else:
            result = self.optimizer.step()
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                grown = _float32(self.loss_scale * self.growth_factor)
                if math.isfinite(grown):
                    self.loss_scale = grown
                self._good_steps = 0
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and the scaler's (scale, good steps, skipped steps, factors)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scale": self.loss_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("optimizer", "loss_scale", "good_steps") if k not in state]
        if missing:
            raise ConfigError(f"not an FP16_Optimizer state dict: it lacks {missing}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scale = float(state["loss_scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._found_inf = None
