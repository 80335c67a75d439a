"""Training state on the device: parameters, gradients, optimizer state, in an ONNX checkpoint file.

Torch-free (onnx and numpy only).

Note [The checkpoint file]
A checkpoint is an ONNX ``ModelProto`` holding no nodes: every parameter (trainable and
frozen, buffers included) and every optimizer state tensor is a ``TensorProto``
initializer of its graph, and one metadata entry (``ortlab.ondevice.checkpoint``, JSON)
says which tensor is what: the parameter names in order, which of them train, which
tensors hold each parameter's optimizer state, the step count, the learning rate and the
user's properties. Protobuf, never pickle: loading a checkpoint runs no code, it can be
read with ``onnx.load`` (and looked at in netron), and numpy round-trips every value
bit for bit. A checkpoint over protobuf's 2 GB limit keeps its tensors in a side file
(ONNX external data, ``<name>.data``), which ``onnx.load`` reads back by itself.
Gradients are not saved (onnxruntime's checkpoints did not save them either).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortlab.errors import ArtifactError, first_line
from ortlab.ondevice.files import require_file, save_model

__all__ = ["CHECKPOINT_KEY", "Parameters", "CheckpointState"]

CHECKPOINT_KEY = "ortlab.ondevice.checkpoint"
_FORMAT = 1


class Parameters(MutableMapping):
    """Parameter name -> numpy array, in the training model's order.

    Reading gives the live array the module trains (update it and the module sees it).
    Assigning copies the new value into that array, which keeps its dtype and shape:
    a value of another shape is refused. Names cannot be added or removed.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self._arrays = {name: np.array(a, order="C", copy=True) for name, a in arrays.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r}; the checkpoint has {', '.join(self._arrays)}") from None

    def __setitem__(self, name: str, value: object) -> None:
        target = self[name]
        value = np.asarray(value)
        if value.shape != target.shape:
            raise ValueError(f"parameter {name!r} has shape {target.shape}; got a value of shape {value.shape}")
        target[...] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("parameters cannot be removed from a checkpoint state")

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        return "Parameters(" + ", ".join(f"{n}: {a.dtype}{list(a.shape)}" for n, a in self._arrays.items()) + ")"


class CheckpointState:
    """Everything training changes: parameter values, gradients, optimizer state, step and learning rate.

    Args:
        parameters: every parameter and buffer the training model takes, by its PyTorch name.
        trainable: the names among them that train (the others are frozen).
        optimizer_state: per trainable name, its optimizer tensors (``exp_avg``,
            ``exp_avg_sq`` for Adam); missing ones start at zero on the first step.
        step: how many optimizer steps were taken.
        learning_rate: the optimizer's learning rate.
        properties: your own values (int, float, str, bool) saved with the checkpoint.

    Attributes:
        gradients: accumulated gradients per trainable name (``Module`` fills them in
            train mode); not saved.

    Example:
        >>> state = CheckpointState.load_checkpoint("artifacts/checkpoint")   # doctest: +SKIP
        >>> state.parameters["fc1.weight"].shape                              # doctest: +SKIP
        (16, 8)
        >>> CheckpointState.save_checkpoint(state, "trained/checkpoint")      # doctest: +SKIP
    """

    def __init__(
        self,
        parameters: Mapping[str, np.ndarray],
        trainable: Sequence[str],
        optimizer_state: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        step: int = 0,
        learning_rate: float = 1e-3,
        properties: Mapping[str, object] | None = None,
    ) -> None:
        self.parameters = Parameters(parameters)
        unknown = [n for n in trainable if n not in self.parameters]
        if unknown:
            raise ArtifactError(f"trainable names {unknown} are not among the parameters "
                                f"({', '.join(self.parameters)})")
        self.trainable = tuple(trainable)
        self.optimizer_state: dict[str, dict[str, np.ndarray]] = {
            name: {k: np.array(v, order="C", copy=True) for k, v in tensors.items()}
            for name, tensors in (optimizer_state or {}).items()
        }
        self.step = int(step)
        self.learning_rate = float(learning_rate)
        self.properties: dict[str, object] = dict(properties or {})
        self.gradients: dict[str, np.ndarray] = {}

    @property
    def frozen(self) -> tuple[str, ...]:
        """The parameters (and buffers) that do not train."""
        return tuple(n for n in self.parameters if n not in set(self.trainable))

    def __repr__(self) -> str:
        return (f"CheckpointState({len(self.trainable)} trainable, {len(self.frozen)} frozen, step={self.step}, "
                f"learning_rate={self.learning_rate})")

    # ----------------------------------------------------------------------------- files
    @staticmethod
    def save_checkpoint(state: CheckpointState, path: str | os.PathLike, include_optimizer_state: bool = True) -> None:
        """Write ``state`` to ``path`` (see Note [The checkpoint file]).

        Raises:
            ArtifactError: for a property that is not an int, float, str or bool.
        """
        tensors: list[onnx.TensorProto] = []
        layout: dict[str, object] = {
            "format": _FORMAT, "parameters": list(state.parameters), "trainable": list(state.trainable),
            "optimizer": {}, "step": state.step, "learning_rate": state.learning_rate, "properties": {},
        }
        for name, array in state.parameters.items():
            tensors.append(numpy_helper.from_array(array, name))
        if include_optimizer_state:
            for name, entries in state.optimizer_state.items():
                layout["optimizer"][name] = {}  # type: ignore[index]
                for key, array in entries.items():
                    tensor_name = f"{name}:{key}"  # ':' never occurs in a PyTorch parameter name
                    tensors.append(numpy_helper.from_array(array, tensor_name))
                    layout["optimizer"][name][key] = tensor_name  # type: ignore[index]
        for key, value in state.properties.items():
            if not isinstance(value, (int, float, str, bool)):
                raise ArtifactError(f"property {key!r} is a {type(value).__name__}; a checkpoint keeps int, float, "
                                    "str and bool properties")
            layout["properties"][key] = value  # type: ignore[index]
        graph = helper.make_graph([], "ortlab.checkpoint", [], [], tensors)
        model = helper.make_model(graph, producer_name="ortlab")
        helper.set_model_props(model, {CHECKPOINT_KEY: json.dumps(layout)})
        save_model(model, path)

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike) -> CheckpointState:
        """Read a checkpoint written by :meth:`save_checkpoint` or ``generate_artifacts``.

        Raises:
            ArtifactError: when the file is missing or is not an ortlab checkpoint.
        """
        path = require_file(path, "checkpoint")
        try:
            model = onnx.load(path)
        except Exception as e:  # protobuf's DecodeError, a missing external data file
            raise ArtifactError(f"{path!r} is not an ONNX checkpoint: {first_line(e)}") from e
        props = {p.key: p.value for p in model.metadata_props}
        if CHECKPOINT_KEY not in props:
            raise ArtifactError(f"{path!r} is an ONNX file but not an ortlab checkpoint (no {CHECKPOINT_KEY!r} "
                                "metadata); load the checkpoint generate_artifacts wrote")
        layout = json.loads(props[CHECKPOINT_KEY])
        if layout.get("format") != _FORMAT:
            raise ArtifactError(f"{path!r} has checkpoint format {layout.get('format')!r}; this ortlab reads "
                                f"format {_FORMAT}")
        arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        missing = [n for n in layout["parameters"] if n not in arrays]
        if missing:
            raise ArtifactError(f"checkpoint {path!r} lists parameters {missing} but holds no tensors for them")
        optimizer_state = {name: {key: arrays[tensor] for key, tensor in entries.items()}
                           for name, entries in layout["optimizer"].items()}
        return cls({n: arrays[n] for n in layout["parameters"]}, layout["trainable"], optimizer_state,
                   layout["step"], layout["learning_rate"], layout["properties"])
