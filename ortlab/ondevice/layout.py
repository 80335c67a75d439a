"""What each input and output of a training or eval model is, stored in the model itself.

``generate_artifacts`` writes a :class:`TrainingLayout` into the metadata of the training
and eval models (``ortlab.ondevice.layout``, JSON); ``Module`` reads it back from the
session (``custom_metadata_map``), so no name is ever parsed to learn what it holds.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from ortlab._index_guards import GUARD_ERRORS, GUARD_LOWEST, IndexGuard
from ortlab.errors import ArtifactError

__all__ = ["LAYOUT_KEY", "TrainingLayout", "gradient_name"]

LAYOUT_KEY = "ortlab.ondevice.layout"
_FORMAT = 1


def gradient_name(parameter: str) -> str:
    """The training model's output holding ``parameter``'s gradient (``fc1.weight`` -> ``fc1.weight_grad``)."""
    return f"{parameter}_grad"


@dataclasses.dataclass(frozen=True)
class TrainingLayout:
    """The roles of a training (or eval) model's inputs and outputs.

    The model's inputs are ``trainable + frozen + inputs + labels``, in that order; the
    training model's outputs are ``loss`` and one gradient per trainable parameter
    (:func:`gradient_name`); the eval model's are ``loss`` and ``outputs``.

    Attributes:
        trainable: parameters that train, by PyTorch name.
        frozen: parameters that do not train, and buffers.
        inputs: the model's inputs.
        labels: the loss's labels (none when the model computes its own loss).
        loss: the loss output's name.
        outputs: the model's own outputs (the eval model returns them beside the loss).
        dynamic_batch: whether the first dimension of inputs and labels may change.
        updated: frozen buffers the step writes (BatchNorm's running statistics): the
            model returns each new value as ``<name>_updated`` after its other outputs,
            and ``Module`` writes it back into the state.
        guards: the model's index guards, its last outputs (after the updated buffers),
            which ``Module`` checks after each run (Note [Index guards on the device] in
            ``ortlab.ondevice.module``); None for a model generated before ortlab added them.
    """

    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    inputs: tuple[str, ...]
    labels: tuple[str, ...]
    loss: str
    outputs: tuple[str, ...]
    dynamic_batch: bool = False
    updated: tuple[str, ...] = ()
    guards: tuple[IndexGuard, ...] | None = None

    @property
    def gradients(self) -> tuple[str, ...]:
        return tuple(gradient_name(p) for p in self.trainable)

    @property
    def model_inputs(self) -> tuple[str, ...]:
        """Every input of the training model, in order."""
        return self.trainable + self.frozen + self.inputs + self.labels

    @property
    def call_inputs(self) -> tuple[str, ...]:
        """What ``Module(...)`` is called with: the inputs, then the labels."""
        return self.inputs + self.labels

    @property
    def updated_outputs(self) -> tuple[str, ...]:
        return tuple(f"{n}_updated" for n in self.updated)

    def to_json(self) -> str:
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return json.dumps({"format": _FORMAT, **data})

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], path: str) -> TrainingLayout:
        """The layout in a model's metadata.

        Raises:
            ArtifactError: when ``path``'s model was not written by ``generate_artifacts``.
        """
        if LAYOUT_KEY not in metadata:
            raise ArtifactError(f"{path!r} has no {LAYOUT_KEY!r} metadata: it was not written by "
                                "ortlab.ondevice.generate_artifacts, which says what each input is")
        try:
            data = json.loads(metadata[LAYOUT_KEY])
        except ValueError as e:
            raise ArtifactError(f"{path!r} has a {LAYOUT_KEY!r} metadata entry that is not JSON ({e}); the file is "
                                "damaged: generate the artifacts again") from None
        if not isinstance(data, dict) or data.pop("format", None) != _FORMAT:
            raise ArtifactError(f"{path!r} has a layout this ortlab cannot read; generate the artifacts again")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
        if values.get("guards") is not None:
            values["guards"] = _guards(values["guards"], path)
        return cls(**values)


def _guards(items: object, path: str) -> tuple[IndexGuard, ...]:
    """The layout's index guards, each field checked (a guard the runner misreads would check nothing)."""
    fields = {f.name for f in dataclasses.fields(IndexGuard)}
    guards = []
    for i, g in enumerate(items if isinstance(items, tuple) else [items]):
        ok = (isinstance(g, dict) and set(g) == fields
              and all(isinstance(g[k], str) for k in ("output", "message", "where"))
              and type(g["dim"]) is int and g["dim"] >= 0
              and g["lowest"] in GUARD_LOWEST and g["error"] in GUARD_ERRORS)
        if not ok:
            raise ArtifactError(f"{path!r} has a malformed index guard in its layout (guards[{i}] = {g!r}); the file "
                                "is damaged: generate the artifacts again")
        guards.append(IndexGuard.from_dict(g))  # type: ignore[arg-type]
    return tuple(guards)
