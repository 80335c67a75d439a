"""The folder sink: writes each stage the engine hands it, when ``DebugOptions.save_onnx`` is set.

One of the engine's stage sinks (``ortlab.stages.StageSink``): FX stages are written
as readable code (``.py``), ONNX stages as models (``.onnx``), named by
``ortlab.stages.file_name``: ``{prefix}[_g{i}]_{stage}_{train|eval}`` for FX stages,
``{prefix}[_g{i}]_{graph}[_{part}]_{stage}_{train|eval}`` for ONNX ones. See
``ortlab.stages`` for the stages, in pipeline order.
"""

from __future__ import annotations

import os

from ortlab.config import DebugOptions
from ortlab.stages import StageArtifact, file_name

__all__ = ["FolderSink"]


class FolderSink:
    """Writes every stage to ``folder`` under ``prefix``; ``written`` lists the paths, in order.

    Example:
        >>> sink = FolderSink("stages", "gpt")                       # doctest: +SKIP
        >>> ORTModule(model, stage_sinks=[sink])                     # doctest: +SKIP
    """

    def __init__(self, folder: str, prefix: str, stages: frozenset[str] | None = None) -> None:
        self.folder, self.prefix, self.stages = folder, prefix, stages
        self.written: list[str] = []

    @classmethod
    def from_debug(cls, debug: DebugOptions) -> FolderSink | None:
        """The sink ``DebugOptions(save_onnx=True, ...)`` asks for, or None."""
        return cls(debug.folder, debug.onnx_prefix) if debug.save_onnx else None

    def wants(self, stage: str) -> bool:
        return self.stages is None or stage in self.stages

    def path(self, artifact: StageArtifact) -> str:
        return os.path.join(self.folder, file_name(self.prefix, artifact))

    def accept(self, artifact: StageArtifact) -> None:
        path = self.path(artifact)
        os.makedirs(self.folder, exist_ok=True)
        if artifact.kind == "fx":
            with open(path, "w") as f:
                f.write(f"# ortlab stage {artifact.stage!r} ({artifact.mode})\n")
                f.write(artifact.fx_code())
        else:
            with open(path, "wb") as f:
                f.write(artifact.onnx_bytes())
        self.written.append(path)
