"""What crosses between PyTorch and an exported graph's session: :class:`GraphInterface`.

The exporter works it out from the FX graph (``ortlab.onnx.export``), the on-disk cache stores it
beside the optimized model (``ortlab.runtime.cache``) and the runner calls the session by it
(``ortlab.runtime.runner``): one object, so that what a runner needs is added in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ortlab.onnx.guards import IndexGuard

__all__ = ["DTYPES", "GraphInterface", "KINDS"]

KINDS = ("tensor", "int", "float", "bool")
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


@dataclasses.dataclass(frozen=True)
class GraphInterface:
    """How a runner feeds an exported graph and turns its session's outputs into the FX graph's.

    Attributes:
        input_kinds: kind of each FX placeholder, in session order (``KINDS``).
        output_kinds: kind of each FX output; ``None`` where the graph returns None.
        output_dtypes: torch dtype of each tensor output (None otherwise).
        output_sources: where each FX output comes from: ``None`` for the next onnxruntime
            output, ``("input", i)`` for the i-th input returned as it is, ``("output", j)``
            for a repeat of FX output ``j``.
        guards: the index guards among the session's last outputs, after the graph's own
            (see Note [Index guards] in ``ortlab.onnx.guards``).
        output_views: per FX output, the shape PyTorch views onnxruntime's tensor as, or
            ``None`` (Note [Graph outputs reshaped in PyTorch] in ``ortlab.onnx.export``);
            empty: no views.
    """

    input_kinds: list[str]
    output_kinds: list[str | None]
    output_dtypes: list[torch.dtype | None]
    output_sources: list[tuple[str, int] | None]
    guards: list[IndexGuard] = dataclasses.field(default_factory=list)
    output_views: list[tuple[int, ...] | None] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (the cache's metadata)."""
        return {
            "input_kinds": list(self.input_kinds),
            "output_kinds": list(self.output_kinds),
            "output_dtypes": [str(d) if d is not None else None for d in self.output_dtypes],
            "output_sources": [list(s) if s is not None else None for s in self.output_sources],
            "guards": [g.to_dict() for g in self.guards],
            "output_views": [list(v) if v is not None else None for v in self.output_views],
        }

    @classmethod
    def from_json(cls, meta: dict[str, Any]) -> GraphInterface:
        """The interface ``to_json`` wrote; ``meta``'s fields must have been checked (``ortlab.runtime.cache``)."""
        return cls(
            list(meta["input_kinds"]),
            list(meta["output_kinds"]),
            [DTYPES[d] if d is not None else None for d in meta["output_dtypes"]],
            [(s[0], s[1]) if s is not None else None for s in meta["output_sources"]],
            [IndexGuard.from_dict(g) for g in meta["guards"]],
            [tuple(v) if v is not None else None for v in meta["output_views"]],
        )
