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

Note [Trusting a checkpoint]
A flipped bit in a checkpoint mostly lands in a tensor's bytes, which protobuf and numpy
read as other numbers: 209 of 300 random single-bit flips of a small checkpoint loaded,
silently, with changed weights. Others reached the metadata and raised json's, dict's or
protobuf's own errors (``JSONDecodeError``, ``KeyError``, ``UnicodeDecodeError``,
``TypeError``) instead of saying the file was damaged. So, as the model cache does (Note
[Trusting a cache entry] in ``ortlab.runtime.cache``), a checkpoint carries its format and
a SHA-256 (metadata ``ortlab.ondevice.checkpoint.sha256``), checked before any field is
read, and then every field is checked for what the state needs before it is used; a
failure is an ``ArtifactError`` saying what is wrong, and any other error the untrusted
bytes raise (a gap in the checks) becomes one too.

The checksum covers what loading returns, not the file's bytes: the layout's JSON text as
stored and every tensor in file order, by name, element type, shape and the values numpy
reads (little-endian bytes). So it holds across protobuf versions and for a checkpoint
whose tensors are in a side file (their bytes are checked too), and a byte that changes
nothing loaded (the producer's name) cannot make a checkpoint fail; every flip that
changes a weight, a name, the step or a property does. ``save_checkpoint`` hashes the
tensors it wrote, read back as ``load_checkpoint`` reads them.

Format 1 (written before the checksum) still loads, with a warning and the field checks:
a checkpoint holds trained state, which ``generate_artifacts`` cannot write again (it
writes the initial weights), so refusing it would throw training away; saving it again
adds the checksum. A file of format 2 without a checksum is refused: the checksum was lost
or removed. One flipped bit cannot make format 2 read as format 1 (``"2"`` and ``"1"``
differ in two bits), so a damaged checksummed file is never taken for an unchecked one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortlab.errors import ArtifactError, first_line
from ortlab.ondevice.files import require_file, save_model

__all__ = ["CHECKPOINT_KEY", "CHECKSUM_KEY", "Parameters", "CheckpointState"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "ortlab.ondevice.checkpoint"
CHECKSUM_KEY = "ortlab.ondevice.checkpoint.sha256"
# 1: no checksum (still read, with a warning); 2: CHECKSUM_KEY (Note [Trusting a checkpoint]).
_FORMAT = 2
_UNCHECKED_FORMAT = 1
_PROPERTY_TYPES = (int, float, str, bool)
_REDO = ("load an intact copy of it, or edit a checkpoint only through CheckpointState (load_checkpoint, change, "
         "save_checkpoint); generate_artifacts writes the initial, untrained one")


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
            if not isinstance(value, _PROPERTY_TYPES):
                raise ArtifactError(f"property {key!r} is a {type(value).__name__}; a checkpoint keeps int, float, "
                                    "str and bool properties")
            layout["properties"][key] = value  # type: ignore[index]
        text = json.dumps(layout)
        graph = helper.make_graph([], "ortlab.checkpoint", [], [], tensors)
        model = helper.make_model(graph, producer_name="ortlab")
        checksum = _checksum(text, [(t, numpy_helper.to_array(t)) for t in tensors])  # as load_checkpoint reads them
        helper.set_model_props(model, {CHECKPOINT_KEY: text, CHECKSUM_KEY: checksum})
        save_model(model, path)

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike) -> CheckpointState:
        """Read a checkpoint written by :meth:`save_checkpoint` or ``generate_artifacts``.

        Its checksum and every field are checked first (Note [Trusting a checkpoint]).

        Raises:
            ArtifactError: when the file is missing, is not an ortlab checkpoint, or is
                damaged or edited (its checksum does not match, or a field is malformed).
        """
        path = require_file(path, "checkpoint")
        try:
            model = onnx.load(path)
        except Exception as e:  # protobuf's DecodeError, a missing external data file
            raise ArtifactError(f"{path!r} is not an ONNX checkpoint: {first_line(e)}") from e
        try:
            parameters, trainable, optimizer_state, layout = _read(model, path)
        except ArtifactError:
            raise
        except Exception as e:  # untrusted bytes: a gap in the checks must still say what happened
            raise ArtifactError(f"checkpoint {path!r} is damaged ({first_line(e)}); {_REDO}") from e
        return cls(parameters, trainable, optimizer_state, layout["step"], layout["learning_rate"],
                   layout["properties"])


def _checksum(text: str, tensors: Sequence[tuple[onnx.TensorProto, np.ndarray]]) -> str:
    """SHA-256 of a checkpoint's layout text and its tensors as read (Note [Trusting a checkpoint])."""
    h = hashlib.sha256(text.encode())
    for tensor, array in tensors:
        h.update(f"\0{tensor.name}\0{tensor.data_type}\0{list(array.shape)}\0".encode())
        h.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _read(model: onnx.ModelProto, path: str) -> tuple[dict[str, np.ndarray], list[str],
                                                      dict[str, dict[str, np.ndarray]], dict[str, object]]:
    """Parameters, trainable names, optimizer state and the layout of a checked checkpoint.

    Raises:
        ArtifactError: saying what is wrong (Note [Trusting a checkpoint]).
    """
    props: dict[str, str] = {}
    for p in model.metadata_props:
        if p.key in props and p.key in (CHECKPOINT_KEY, CHECKSUM_KEY):
            raise ArtifactError(f"checkpoint {path!r} has two {p.key!r} metadata entries; {_REDO}")
        props[p.key] = p.value
    if CHECKPOINT_KEY not in props:
        raise ArtifactError(f"{path!r} is an ONNX file but not an ortlab checkpoint (no {CHECKPOINT_KEY!r} "
                            "metadata); load the checkpoint generate_artifacts wrote")
    text = props[CHECKPOINT_KEY]
    try:
        layout = json.loads(text)
    except ValueError as e:
        raise ArtifactError(f"checkpoint {path!r} is damaged: its {CHECKPOINT_KEY!r} metadata is not JSON ({e}); "
                            f"{_REDO}") from None
    if not isinstance(layout, dict):
        raise ArtifactError(f"checkpoint {path!r} is damaged: its {CHECKPOINT_KEY!r} metadata is a "
                            f"{type(layout).__name__}, expected an object; {_REDO}")
    fmt = layout.get("format")
    if type(fmt) is not int or fmt not in (_UNCHECKED_FORMAT, _FORMAT):
        raise ArtifactError(f"{path!r} has checkpoint format {fmt!r}; this ortlab reads formats {_UNCHECKED_FORMAT} "
                            f"and {_FORMAT}. A checkpoint written by a newer ortlab needs that ortlab; otherwise the "
                            f"file is damaged: {_REDO}")
    tensors = list(model.graph.initializer)
    arrays: dict[str, np.ndarray] = {}
    read = []
    for tensor in tensors:
        try:
            array = numpy_helper.to_array(tensor)
        except Exception as e:  # bytes that do not fill the shape, an unknown element type
            raise ArtifactError(f"checkpoint {path!r} is damaged: its tensor {tensor.name!r} cannot be read "
                                f"({first_line(e)}); {_REDO}") from e
        if tensor.name in arrays:
            raise ArtifactError(f"checkpoint {path!r} is damaged: it holds two tensors named {tensor.name!r}; {_REDO}")
        if array.dtype.hasobject:
            raise ArtifactError(f"checkpoint {path!r} is damaged: its tensor {tensor.name!r} holds "
                                f"{onnx.TensorProto.DataType.Name(tensor.data_type)}s, not numbers; {_REDO}")
        arrays[tensor.name] = array
        read.append((tensor, array))
    checksum = props.get(CHECKSUM_KEY)
    if checksum is None and fmt != _UNCHECKED_FORMAT:
        raise ArtifactError(f"checkpoint {path!r} has format {fmt} but no {CHECKSUM_KEY!r} metadata, which that "
                            f"format always carries: the file was damaged or edited; {_REDO}")
    if checksum is None:
        logger.warning("ortlab.ondevice: checkpoint %s was written before checkpoints carried a checksum (format 1), "
                       "so a damaged copy cannot be told from a good one; CheckpointState.save_checkpoint writes it "
                       "again with one", path)
    elif checksum != _checksum(text, read):
        raise ArtifactError(f"checkpoint {path!r} is damaged: its content does not match the SHA-256 saved with it "
                            f"(a changed byte, a cut-off copy, or an edit by hand); {_REDO}")
    problem = _problem(layout, arrays)
    if problem:
        raise ArtifactError(f"checkpoint {path!r} is malformed: {problem}; {_REDO}")
    optimizer_state = {name: {key: arrays[tensor] for key, tensor in entries.items()}
                       for name, entries in layout["optimizer"].items()}
    return {n: arrays[n] for n in layout["parameters"]}, layout["trainable"], optimizer_state, layout


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value) and len(set(value)) == len(value)


def _problem(layout: dict[str, object], arrays: Mapping[str, np.ndarray]) -> str:
    """What is wrong with a checkpoint's layout ("" if nothing); ``arrays`` are its tensors by name."""
    missing = [k for k in ("parameters", "trainable", "optimizer", "step", "learning_rate", "properties")
               if k not in layout]
    if missing:
        return f"its layout has no {', '.join(map(repr, missing))}"
    parameters, trainable, optimizer = layout["parameters"], layout["trainable"], layout["optimizer"]
    if not _names(parameters):
        return f"'parameters' is {parameters!r}, expected a list of distinct names"
    if not _names(trainable) or not set(trainable) <= set(parameters):  # type: ignore[arg-type]
        return f"'trainable' is {trainable!r}, expected a list of distinct names among the parameters"
    absent = [n for n in parameters if n not in arrays]  # type: ignore[union-attr]
    if absent:
        return f"it lists parameters {absent} but holds no tensors for them"
    if not isinstance(optimizer, dict):
        return f"'optimizer' is a {type(optimizer).__name__}, expected an object"
    for name, entries in optimizer.items():
        if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(t, str) and t in arrays
                                                    for k, t in entries.items()):
            return f"'optimizer'[{name!r}] is {entries!r}, expected {{state name: tensor the checkpoint holds}}"
    step, rate = layout["step"], layout["learning_rate"]
    if type(step) is not int:
        return f"'step' is {step!r}, expected an integer"
    if type(rate) not in (int, float):
        return f"'learning_rate' is {rate!r}, expected a number"
    properties = layout["properties"]
    if not isinstance(properties, dict) or not all(isinstance(v, _PROPERTY_TYPES) for v in properties.values()):
        return f"'properties' is {properties!r}, expected an object of int, float, str and bool values"
    return ""
