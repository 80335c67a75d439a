"""The loss the notebook tools backpropagate when the user gives none: one rule for all of them.

``explore``'s step, ``compare``'s two steps and the toggles' measuring steps all use
:func:`default_loss`. A model that returns its loss (a scalar, alone or beside logits
as Hugging Face models do) is trained on that loss. Otherwise every differentiable
floating output is weighted by fixed, non-uniform weights and summed: uniform weights
(a plain ``sum()``) would hide errors that cancel out, which ``compare`` exists to find.
"""

from __future__ import annotations

from typing import Any

import torch

from ortlab._compat.torch import pytree

__all__ = ["default_loss", "output_weights"]


def output_weights(t: torch.Tensor) -> torch.Tensor:
    """The fixed weights ``default_loss`` gives the elements of an output ``t`` (between 0.5 and 1.5)."""
    n = max(t.numel(), 1)
    w = 1.0 + 0.5 * torch.sin(torch.arange(n, dtype=torch.float32, device=t.device) * 0.37 + 0.1)
    return w[: t.numel()].reshape(t.shape).to(t.dtype)


def default_loss(output: Any) -> torch.Tensor | None:
    """The loss of a model's output: its first differentiable scalar, else a weighted sum of all.

    Returns ``None`` when no floating output requires grad (nothing to backpropagate).

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> default_loss((x * 2, (x * 5).sum()))
        tensor(15., grad_fn=<SumBackward0>)
    """
    leaves = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        return None
    scalar = next((t for t in leaves if t.dim() == 0), None)
    if scalar is not None:
        return scalar
    total = (leaves[0] * output_weights(leaves[0])).float().sum()
    for t in leaves[1:]:
        total = total + (t * output_weights(t)).float().sum()
    return total
