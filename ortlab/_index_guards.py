"""The torch-free half of the index guards: what a guard checks, and the check.

``ortlab.onnx.guards`` adds the guards to exported graphs (it needs PyTorch) and
re-exports these; ORTModule's runner checks them on torch tensors and
``ortlab.ondevice.Module`` on numpy arrays, on devices without PyTorch. See Note [Index
guards] in ``ortlab.onnx.guards``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["IndexGuard", "GUARD_LOWEST", "GUARD_ERRORS", "check"]

# The values ``IndexGuard.lowest`` and ``IndexGuard.error`` may take.
GUARD_LOWEST = ("0", "-size")
GUARD_ERRORS = ("IndexError", "RuntimeError")


class _Result(Protocol):  # a guard output: a torch tensor or a numpy array of three int64
    def tolist(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class IndexGuard:
    """What one guard output checks, and the error PyTorch raises when it fails.

    Attributes:
        output: the name of the guard's ONNX output (``[min, max, size]``).
        lowest: ``0``, or ``"-size"`` for indexing that counts from the end.
        error: ``IndexError`` or ``RuntimeError`` (what PyTorch raises for this op).
        message: PyTorch's message, with ``{index}``, ``{dim}`` and ``{size}`` to fill in.
        dim: the indexed dimension.
        where: the op, its module and source line, for the message.
    """

    output: str
    lowest: str
    error: str
    message: str
    dim: int
    where: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexGuard:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def check(guards: Sequence[IndexGuard], results: Sequence[_Result]) -> None:
    """Raise PyTorch's error for the first guard whose indices are out of range.

    ``results`` are the guards' outputs, torch tensors or numpy arrays.

    Raises:
        IndexError, RuntimeError: as PyTorch would for the same input.

    Example:
        >>> guard = IndexGuard("g", "0", "IndexError", "index out of range in self", 0, "aten.embedding at emb")
        >>> check([guard], [np.array([-1, 3, 10])])   # doctest: +SKIP
        IndexError: index out of range in self (ortlab: aten.embedding at emb; PyTorch raises ...)
    """
    for guard, result in zip(guards, results):
        low, high, size = result.tolist()
        lowest = -size if guard.lowest == "-size" else 0
        if low >= lowest and high < size:
            continue
        index = low if low < lowest else high
        text = guard.message.format(index=index, dim=guard.dim, size=size)
        error = IndexError if guard.error == "IndexError" else RuntimeError
        raise error(f"{text} (ortlab: {guard.where}; PyTorch raises the same error for this input)")
