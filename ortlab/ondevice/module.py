"""``Module``: run the training and eval models on a checkpoint state, torch-free.

onnxruntime's ``onnxruntime.training.api.Module`` rebuilt on the standard
``InferenceSession``: the training model is an ordinary ONNX graph that computes the loss
and every gradient (``generate_artifacts`` traced them with PyTorch), so nothing of
onnxruntime's training build is needed. Parameters live in the :class:`CheckpointState`
as numpy arrays and are fed as inputs on every call.

Note [Index guards on the device]
ONNX's ``Gather`` counts a negative index from the end, so the training model took a
cross-entropy label of -1 as the last class and trained on it, where PyTorch raises
``IndexError: Target -1 is out of bounds.``; a label equal to the class count stopped the
run with onnxruntime's own error, and embeddings and ``gather`` wrapped the same way.
ORTModule's graphs had index guards (Note [Index guards] in ``ortlab.onnx.guards``), but
``generate_artifacts`` exported its graphs without asking for them, and ``make_fx`` did
not record which op a node was decomposed from (``original_aten``), which the guard needs
to give a loss's target its loss's error. Now the training and eval graphs are traced
under ``preserve_node_meta`` and exported with ``guard_indices=True``: every op of them
that reads an index (a loss's target, embedding, gather, index_select, indexing, scatter)
gets a guard output ``[min, max, size]``, and the op reads its index clipped into range.
The layout lists the guards (``TrainingLayout.guards``, the models' last outputs); each
call fetches them and checks them with ORTModule's own ``check`` (torch-free, in
``ortlab._index_guards``) before anything of the state changes: no gradient is
accumulated and no running statistic written for a batch PyTorch would have refused,
and the error is PyTorch's, class and text. The training graph holds the forward and
the backward, so the backward's index ops (the loss's scatter, embedding's
``index_put``) get guards too: they repeat the forward's, which come first in the graph
and so give the error (three reductions each; not worth telling the two halves apart).
A target equal to ``ignore_index`` (-100 by default) reaches the ``gather`` as 0, as in
PyTorch's decomposition, so it is ignored, not refused. The inference model that
:meth:`Module.export_model_for_inferencing` writes runs in plain onnxruntime, with no one
to read a guard: its guard outputs are dropped and its indices stay clipped. Artifacts
generated before the guards load with a warning that nothing is checked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from ortlab._index_guards import IndexGuard, check
from ortlab.config import Options
from ortlab.errors import ArtifactError, SessionError, UnsupportedInputError, first_line
from ortlab.ondevice.checkpoint import CheckpointState
from ortlab.ondevice.files import require_file, save_model
from ortlab.ondevice.inference import inference_model
from ortlab.ondevice.layout import TrainingLayout
from ortlab.runtime.session import build_session

__all__ = ["Module"]

logger = logging.getLogger(__name__)

_ONNX_NP = {f"tensor({name})": np.dtype(dtype) for name, dtype in (
    ("float", np.float32), ("double", np.float64), ("float16", np.float16), ("int64", np.int64),
    ("int32", np.int32), ("int16", np.int16), ("int8", np.int8), ("uint8", np.uint8), ("bool", np.bool_))}


class _Model:
    """One of the module's models: its session, layout and what each input must be."""

    def __init__(self, path: str, what: str, options: Options) -> None:
        self.path = require_file(path, what)
        self.session: ort.InferenceSession = build_session(self.path, options).session
        meta = self.session.get_modelmeta().custom_metadata_map
        self.layout = TrainingLayout.from_metadata(meta, self.path)
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in self.layout.model_inputs if n not in inputs]
        if missing:
            raise ArtifactError(f"{self.path!r} lacks the inputs {missing} its layout names; generate the "
                                "artifacts again")
        self.dtypes = {n: _ONNX_NP.get(i.type) for n, i in inputs.items()}
        self.shapes = {n: i.shape for n, i in inputs.items()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.guards: tuple[IndexGuard, ...] = self.layout.guards or ()
        if self.layout.guards is None:
            logger.warning("ortlab.ondevice: %s was generated before ortlab checked indices on the device: an "
                           "out-of-range label or index is not refused as PyTorch refuses it (a cross-entropy "
                           "label of -1 trains as the last class); generate the artifacts again", self.path)
        lacking = [g.output for g in self.guards if g.output not in self.output_names]
        if lacking:
            raise ArtifactError(f"{self.path!r} lacks the index guard outputs {lacking} its layout names; generate "
                                "the artifacts again")


class Module:
    """Trains a model from its ONNX artifacts with onnxruntime alone.

    Args:
        training_model_path: ``training_model.onnx`` from ``generate_artifacts``.
        state: the parameters (``CheckpointState.load_checkpoint``); gradients accumulate
            into ``state.gradients``.
        eval_model_path: ``eval_model.onnx``, for :meth:`eval` and
            :meth:`export_model_for_inferencing`.
        options: ortlab options the sessions are built with (providers, threads,
            optimization level); the defaults otherwise.

    Attributes:
        training: train mode (the default) or eval mode.
        outputs: every output of the last call but the gradients, by name (eval mode:
            the loss and the model's outputs).

    Raises:
        ArtifactError: when a file is missing or does not match the state.

    Example:
        >>> state = CheckpointState.load_checkpoint("artifacts/checkpoint")                 # doctest: +SKIP
        >>> module = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")  # doctest: +SKIP
        >>> optimizer = Optimizer("artifacts/optimizer_model.onnx", module)                 # doctest: +SKIP
        >>> loss = module(x, y); optimizer.step(); module.lazy_reset_grad()                 # doctest: +SKIP
    """

    def __init__(self, training_model_path: str | os.PathLike, state: CheckpointState,
                 eval_model_path: str | os.PathLike | None = None, *, options: Options | None = None) -> None:
        self.state = state
        self.training = True
        self.outputs: dict[str, np.ndarray] = {}
        self._options = options or Options()
        self._train = _Model(os.fspath(training_model_path), "training model", self._options)
        self._eval_path = os.fspath(eval_model_path) if eval_model_path is not None else None
        self._eval: _Model | None = None
        self._reset_pending = False
        layout = self._train.layout
        missing = [n for n in layout.trainable + layout.frozen if n not in state.parameters]
        if missing:
            raise ArtifactError(f"the checkpoint state has no values for {missing}, which "
                                f"{self._train.path!r} takes; load the checkpoint generated with it")
        if set(layout.trainable) != set(state.trainable):
            raise ArtifactError(f"{self._train.path!r} trains {list(layout.trainable)} but the checkpoint state "
                                f"trains {list(state.trainable)}; load the checkpoint generated with it")

    @property
    def layout(self) -> TrainingLayout:
        """The roles of the training model's inputs and outputs."""
        return self._train.layout

    def input_names(self) -> list[str]:
        """What a call takes, in order: the model's inputs, then the labels."""
        return list(self.layout.call_inputs)

    def output_names(self) -> list[str]:
        """The model's own outputs (what :meth:`export_model_for_inferencing` can keep)."""
        return list(self.layout.outputs)

    def train(self, mode: bool = True) -> Module:
        """Train mode: calls compute the loss and accumulate gradients."""
        if not mode:
            return self.eval()
        self.training = True
        return self

    def eval(self) -> Module:
        """Eval mode: calls run the eval model (loss and outputs, no gradients)."""
        self._eval_model()
        self.training = False
        return self

    def lazy_reset_grad(self) -> None:
        """The next train-mode call overwrites the gradients instead of adding to them (as onnxruntime's did)."""
        self._reset_pending = True

    def _eval_model(self) -> _Model:
        if self._eval is None:
            if self._eval_path is None:
                raise ArtifactError("this Module was built without an eval model; pass eval_model_path="
                                    "'.../eval_model.onnx' (generate_artifacts writes it) to use eval mode or export")
            model = _Model(self._eval_path, "eval model", self._options)
            if model.layout.model_inputs != self.layout.model_inputs:
                raise ArtifactError(f"{model.path!r} takes {list(model.layout.model_inputs)} but the training model "
                                    f"takes {list(self.layout.model_inputs)}; use the eval model generated with it")
            self._eval = model
        return self._eval

    def _feeds(self, model: _Model, args: Sequence[object]) -> dict[str, np.ndarray]:
        layout = model.layout
        names = layout.call_inputs
        if len(args) != len(names):
            mode = "training" if self.training else "eval"
            raise UnsupportedInputError(
                f"the {mode} model takes {len(names)} inputs ({', '.join(names)}): "
                f"{len(layout.inputs)} model inputs then {len(layout.labels)} labels; got {len(args)}")
        feeds = {n: self.state.parameters[n] for n in layout.trainable + layout.frozen}
        for name, value in zip(names, args):
            array = np.asarray(value)
            want = model.dtypes.get(name)
            if want is not None and array.dtype != want:
                raise UnsupportedInputError(f"input {name!r} must be {want}; got {array.dtype} "
                                            f"(convert it with .astype(np.{want.name}))")
            shape = model.shapes[name]
            if shape is not None and (len(shape) != array.ndim or any(
                    isinstance(d, int) and d != n for d, n in zip(shape, array.shape))):
                raise UnsupportedInputError(f"input {name!r} must have shape {shape} (a named dimension takes "
                                            f"any size); got {list(array.shape)}")
            feeds[name] = array
        return feeds

    def __call__(self, *args: object) -> np.generic:
        """The loss on one batch: ``module(*inputs, *labels)``.

        In train mode the gradients are added to ``state.gradients`` (overwritten after
        :meth:`lazy_reset_grad`); in eval mode :attr:`outputs` holds the model's outputs too.

        Raises:
            UnsupportedInputError: for a wrong number of inputs, a dtype or a shape.
            IndexError, RuntimeError: PyTorch's error for a label or index out of range (Note [Index
                guards on the device]); the state is left as it was.
            SessionError: when onnxruntime fails.
        """
        model = self._train if self.training else self._eval_model()
        feeds = self._feeds(model, args)
        layout = model.layout
        n_grads = len(layout.trainable) if self.training else 0
        fetch = ([layout.loss, *layout.gradients] if self.training else [layout.loss, *layout.outputs])
        fetch += layout.updated_outputs
        try:
            results = model.session.run(fetch + [g.output for g in model.guards], feeds)
        except Exception as e:  # onnxruntime raises its own pybind exception types
            raise SessionError(f"onnxruntime could not run {model.path!r}: {first_line(e)}") from e
        check(model.guards, results[len(fetch):])  # before the state changes (Note [Index guards on the device])
        results = results[:len(fetch)]
        if self.training:
            gradients = self.state.gradients
            for name, grad in zip(layout.trainable, results[1:1 + n_grads]):
                held = gradients.get(name)
                if self._reset_pending or held is None:
                    gradients[name] = grad
                else:
                    held += grad
            self._reset_pending = False
        for name, value in zip(layout.updated, results[len(results) - len(layout.updated):]):
            self.state.parameters[name] = value  # BatchNorm's running statistics, as PyTorch updates them
        kept = fetch[:len(fetch) - len(layout.updated)]
        self.outputs = {n: r for n, r in zip(kept, results) if n not in layout.gradients}
        return self.outputs[layout.loss][()]

    def export_model_for_inferencing(self, inference_model_path: str | os.PathLike,
                                     output_names: Sequence[str] | None = None) -> str:
        """Write an inference model with the current parameters as initializers.

        It takes the model's inputs only (no labels, no loss) and runs in plain
        onnxruntime. Returns its path.

        Args:
            inference_model_path: where to write it.
            output_names: the outputs to keep (default: all the model's outputs, see
                :meth:`output_names`).

        Raises:
            ArtifactError: without an eval model, or for an unknown output name.
        """
        model = self._eval_model()
        outputs = list(output_names) if output_names is not None else list(self.layout.outputs)
        pruned = inference_model(onnx.load(model.path), self.state.parameters, outputs)
        return save_model(pruned, inference_model_path)
