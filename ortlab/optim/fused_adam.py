"""``FusedAdam``: Adam/AdamW for PyTorch parameters as one onnxruntime run per step.

onnxruntime's ``onnxruntime.training.optim.FusedAdam`` (a CUDA kernel in its training
build) rebuilt on the standard wheel: the update is the on-device optimizer's graph
(``ortlab.ondevice.optimizer_model``) with a learning rate and a step number per parameter,
run on the parameters, gradients and moments where they lie and writing the new values
into the same tensors (Note [Updating in place]). Param groups of their own learning
rate, weight decay or betas share the one graph; a parameter without a gradient is left
out of the step, as ``torch.optim.AdamW`` leaves it.

On the CPU it runs at about the speed of ``torch.optim.AdamW(foreach=True)``, not of
``fused=True`` (``benchmarks/optim.py``: 12.0, 9.3 and 1.8 ms a step for a 3.7 M-parameter
GPT on 2 cores): the graph is 14 elementwise ops per parameter, each a pass over memory,
where PyTorch's fused kernel makes one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ortlab.config import Options
from ortlab.errors import ConfigError, DeviceError
from ortlab.ondevice.inplace import Buffers, InPlaceRunner
from ortlab.ondevice.optimizer_model import ParamSlot, UpdateRule, build_optimizer_model
from ortlab.runtime.session import build_session

__all__ = ["FusedAdam"]

logger = logging.getLogger(__name__)

_NP = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64), torch.int64: np.dtype(np.int64)}
_MAX_GRAPHS = 8  # graphs kept per optimizer (one per set of parameters with gradients and their settings)


class FusedAdam(torch.optim.Optimizer):
    """Adam and AdamW whose step updates every parameter in one onnxruntime run.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``adam_w_mode=True``) or the L2 coefficient.
        adam_w_mode: ``True``: AdamW (``torch.optim.AdamW``); ``False``: Adam with L2
            regularisation added to the gradient (``torch.optim.Adam(weight_decay=...)``).

    The state and the param groups' keys are ``torch.optim.AdamW``'s (``step``, ``exp_avg``,
    ``exp_avg_sq`` per parameter; ``decoupled_weight_decay`` is ``adam_w_mode``), so a
    ``state_dict()`` of either loads into the other. Parameters must be float32 or
    float64, on one device (CPU, or CUDA with onnxruntime-gpu).

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)   # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()    # doctest: +SKIP
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, adam_w_mode: bool = True) -> None:
        if lr < 0:
            raise ConfigError(f"lr must be >= 0, got {lr}")
        UpdateRule("adamw" if adam_w_mode else "adam", tuple(betas), eps, weight_decay)  # raises on bad values
        # torch.optim.Adam's group keys, so a state dict loads into AdamW/Adam and theirs into this;
        # ``decoupled_weight_decay`` is adam_w_mode (AdamW is Adam with it set, torch 2.8+).
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "decoupled_weight_decay": adam_w_mode, "amsgrad": False, "maximize": False, "foreach": None,
                    "capturable": False, "differentiable": False, "fused": None}
        super().__init__(params, defaults)
        self._graphs: dict[tuple, InPlaceRunner] = {}

    def _runner(self, slots: list[ParamSlot], device: torch.device) -> InPlaceRunner:
        key = (tuple(slots), device)
        runner = self._graphs.get(key)
        if runner is None:
            if len(self._graphs) >= _MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            model = build_optimizer_model(slots, per_param_schedule=True)
            built = build_session(model.SerializeToString(), Options(), device_type=device.type)
            runner = InPlaceRunner(built.session, device.type, device.index or 0)
            self._graphs[key] = runner
            logger.info("ortlab.optim: FusedAdam graph for %d parameters built in %.2f s", len(slots), built.seconds)
        return runner

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient, in one onnxruntime run.

        Raises:
            ConfigError: for a sparse gradient or a dtype other than float32/float64.
            DeviceError: when parameters live on more than one device.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slots: list[ParamSlot] = []
        tensors: list[torch.Tensor] = []  # per parameter: param, grad, exp_avg, exp_avg_sq
        updated: list[torch.Tensor] = []  # per parameter: param, exp_avg, exp_avg_sq (written in place)
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        lrs: list[float] = []
        steps: list[int] = []
        devices: set[torch.device] = set()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ConfigError("FusedAdam has no amsgrad or maximize; a loaded state dict turned them on "
                                  "(use torch.optim.AdamW for those)")
            rule = UpdateRule("adamw" if group.get("decoupled_weight_decay") else "adam", tuple(group["betas"]),
                              group["eps"], group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("FusedAdam does not take sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                target = p if p.is_contiguous() else p.contiguous()
                if target is not p:
                    write_back.append((p, target))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if not (m.is_contiguous() and v.is_contiguous()):
                    state["exp_avg"], state["exp_avg_sq"] = m, v = m.contiguous(), v.contiguous()
                grad = p.grad if p.grad.is_contiguous() and p.grad.dtype == p.dtype else p.grad.to(p.dtype).contiguous()
                slots.append(ParamSlot(f"p{len(slots)}", _np_dtype(p), tuple(p.shape), rule))
                tensors += [target, grad, m, v]
                updated += [target, m, v]
                lrs.append(float(group["lr"]))
                steps.append(int(state["step"].item()))
                devices.add(p.device)
        if not slots:
            return loss
        if len(devices) > 1:
            raise DeviceError(f"FusedAdam updates parameters on one device in one run; they are on "
                              f"{', '.join(sorted(map(str, devices)))}. Use one FusedAdam per device.")
        device = devices.pop()
        schedule = [torch.tensor(lrs, dtype=torch.float64, device=device),
                    torch.tensor(steps, dtype=torch.int64, device=device)]
        self._runner(slots, device).run(_buffers(schedule + tensors), _buffers(updated))
        for p, target in write_back:
            p.copy_(target)
        return loss


def _np_dtype(t: torch.Tensor) -> np.dtype:
    try:
        return _NP[t.dtype]
    except KeyError:
        raise ConfigError(f"FusedAdam updates float32 and float64 parameters; one is {t.dtype}. Keep float32 "
                          "master weights (and scale the loss with ortlab.optim.FP16_Optimizer)") from None


_NO_DATA = torch.empty(1, dtype=torch.uint8)  # onnxruntime refuses address 0, which an empty tensor has


def _buffers(tensors: list[torch.Tensor]) -> Buffers:
    """:class:`Buffers` over contiguous tensors, without copies (see ``ortlab.ondevice.inplace``)."""
    empty = _NO_DATA.data_ptr()
    return Buffers(tensors, [t.data_ptr() or empty for t in tensors], [_NP[t.dtype] for t in tensors],
                   [t.shape for t in tensors])
