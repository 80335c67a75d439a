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
from ortlab.stages import ORT_LEVEL_STAGES, StageArtifact, file_name

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
        # Each part's node provenance, from its exported or onnxscript stage: onnxruntime's optimized models
        # drop node metadata, and the files of those stages get it back (netron shows it).
        self._provenance: dict[tuple, dict[str, dict[str, str]]] = {}

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
            data = artifact.onnx_bytes()
            key = (artifact.capture, artifact.mode, artifact.graph, artifact.part)
            if artifact.stage in ("exported", "onnxscript"):  # onnxscript's, when it runs, replaces the export's
                from ortlab.provenance import node_provenance

                self._provenance[key] = node_provenance(artifact.content)
            elif (artifact.stage in ORT_LEVEL_STAGES or artifact.stage == "execution") and key in self._provenance:
                data = _with_provenance(data, self._provenance[key])
            with open(path, "wb") as f:
                f.write(data)
        self.written.append(path)


def _with_provenance(data: bytes, provenance: dict[str, dict[str, str]]) -> bytes:
    """``data`` (a serialized model onnxruntime optimized) with its nodes' ``ortlab.*`` metadata back."""
    import onnx

    from ortlab.provenance import restore_provenance

    restored = restore_provenance(onnx.load_from_string(data), provenance)
    return data if restored is None else restored.SerializeToString()
