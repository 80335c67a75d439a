"""Writes each stage of a captured graph to disk when ``DebugOptions.save_onnx`` is set.

Names follow ``{prefix}_{stage}_{train|eval}.{py|onnx}``; graphs after the first
one of a module (graph breaks, re-captures) insert ``g{index}``:
``{prefix}_g1_{stage}_{mode}``. Stages, in pipeline order:

=====================  ==========================================================
``captured``           the FX graph Dynamo captured (torch level), ``.py``
``joint``              AOTAutograd's joint forward+backward graph, ``.py``
``forward``            forward FX graph after partitioning, ``.py``
``backward``           backward FX graph, ``.py``
``inference``          the no-grad (eval) FX graph, ``.py``
``forward_exported``   forward ONNX as exported by torch.onnx/torchlib, ``.onnx``
``backward_exported``  backward ONNX as exported, ``.onnx``
``*_onnxscript``       after onnxscript's optimizer (constant folding, pattern clean-up)
``*_ort_{level}``      onnxruntime's optimized model at basic/extended/all, ``.onnx``
``*_execution``        the model the session runs, ``.onnx``
=====================  ==========================================================
"""

from __future__ import annotations

import os

import torch.fx

from ortlab.config import DebugOptions

__all__ = ["StageWriter"]


class StageWriter:
    """Saves stages for one captured graph; does nothing when saving is off."""

    def __init__(self, debug: DebugOptions, graph_index: int) -> None:
        self.enabled = debug.save_onnx
        self.folder = debug.folder
        self.prefix = debug.onnx_prefix if graph_index == 0 else f"{debug.onnx_prefix}_g{graph_index}"
        self.written: list[str] = []

    def path(self, stage: str, mode: str, ext: str) -> str:
        return os.path.join(self.folder, f"{self.prefix}_{stage}_{mode}.{ext}")

    def stem(self, stage_prefix: str, mode: str) -> str:
        """A path template with ``{stage}`` left open (for per-level onnxruntime models)."""
        return os.path.join(self.folder, f"{self.prefix}_{stage_prefix}_{{stage}}_{mode}.onnx")

    def fx(self, stage: str, mode: str, gm: torch.fx.GraphModule) -> None:
        if not self.enabled:
            return
        path = self.path(stage, mode, "py")
        with open(path, "w") as f:
            f.write(f"# ortlab stage {stage!r} ({mode})\n")
            f.write(gm.print_readable(print_output=False, include_stride=False, include_device=True))
        self.written.append(path)

    def onnx(self, stage: str, mode: str, model_bytes: bytes) -> None:
        if not self.enabled:
            return
        path = self.path(stage, mode, "onnx")
        with open(path, "wb") as f:
            f.write(model_bytes)
        self.written.append(path)

    def add(self, paths: list[str]) -> None:
        self.written.extend(paths)
