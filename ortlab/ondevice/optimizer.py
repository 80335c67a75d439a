"""``Optimizer``: one run of the optimizer model updates every trainable parameter, in place, torch-free.

onnxruntime's ``onnxruntime.training.api.Optimizer`` rebuilt on the standard
``InferenceSession``: the optimizer model (``ortlab.ondevice.optimizer_model``) takes the
learning rate, the step number, and each parameter with its gradient and moments, and
its outputs are written straight into the state's arrays (Note [Updating in place]).
"""

from __future__ import annotations

import os

import numpy as np

from ortlab.config import Options
from ortlab.errors import ArtifactError, OrtlabError
from ortlab.ondevice.files import require_file
from ortlab.ondevice.inplace import InPlaceRunner, numpy_buffers
from ortlab.ondevice.module import Module
from ortlab.ondevice.optimizer_model import LAYOUT_KEY, OptimizerLayout, state_names
from ortlab.runtime.session import build_session

__all__ = ["Optimizer"]


class Optimizer:
    """Updates ``module``'s trainable parameters from their accumulated gradients.

    Args:
        optimizer_model_path: ``optimizer_model.onnx`` from ``generate_artifacts``.
        module: the :class:`Module` whose state it updates.
        options: ortlab options the session is built with.

    Raises:
        ArtifactError: when the file is missing or updates other parameters than the module trains.

    Example:
        >>> optimizer = Optimizer("artifacts/optimizer_model.onnx", module)   # doctest: +SKIP
        >>> optimizer.set_learning_rate(3e-4); optimizer.step()               # doctest: +SKIP
    """

    def __init__(self, optimizer_model_path: str | os.PathLike, module: Module, *,
                 options: Options | None = None) -> None:
        self.path = require_file(optimizer_model_path, "optimizer model")
        self.module = module
        session = build_session(self.path, options or Options()).session
        meta = session.get_modelmeta().custom_metadata_map
        if LAYOUT_KEY not in meta:
            raise ArtifactError(f"{self.path!r} has no {LAYOUT_KEY!r} metadata: it is not an optimizer model "
                                "written by ortlab.ondevice.generate_artifacts")
        self.layout = OptimizerLayout.from_json(meta[LAYOUT_KEY])
        if self.layout.per_param_schedule:
            raise ArtifactError(f"{self.path!r} takes a learning rate per parameter (ortlab.optim.FusedAdam's "
                                "form); use the optimizer model generate_artifacts wrote")
        trains = module.state.trainable
        if set(self.layout.params) != set(trains):
            extra = sorted(set(self.layout.params) - set(trains))
            lacking = sorted(set(trains) - set(self.layout.params))
            raise ArtifactError(f"{self.path!r} updates other parameters than the module trains (only in the "
                                f"optimizer model: {extra}; only in the module: {lacking}); use the artifacts "
                                "generated together")
        self._runner = InPlaceRunner(session)
        self._states = state_names(self.layout.kind)

    def get_learning_rate(self) -> float:
        return self.module.state.learning_rate

    def set_learning_rate(self, learning_rate: float) -> None:
        """The learning rate of the following steps (kept in the checkpoint state)."""
        self.module.state.learning_rate = float(learning_rate)

    def step(self) -> None:
        """Update every trainable parameter (and its moments) in one run of the optimizer model.

        The gradients are the ones accumulated since the last :meth:`Module.lazy_reset_grad`.

        Raises:
            OrtlabError: when a parameter has no gradient yet (no train-mode call ran).
        """
        state = self.module.state
        missing = [n for n in self.layout.params if n not in state.gradients]
        if missing:
            raise OrtlabError(f"no gradients for {missing}: call the module in train mode on a batch "
                              "(loss = module(*inputs, *labels)) before optimizer.step()")
        step = state.step + 1
        inputs = [np.array(state.learning_rate, dtype=np.float64), np.array(step, dtype=np.int64)]
        outputs = []
        for name in self.layout.params:
            value = state.parameters[name]
            grad = np.ascontiguousarray(state.gradients[name], dtype=value.dtype)
            moments = state.optimizer_state.setdefault(name, {})
            for key in self._states:
                held = moments.get(key)
                if held is None:  # the first step: moments start at zero, as in torch.optim
                    moments[key] = np.zeros_like(value)
                elif held.shape != value.shape:
                    raise ArtifactError(f"optimizer state {key!r} of {name!r} has shape {held.shape}; the "
                                        f"parameter has {value.shape}")
                elif held.dtype != value.dtype or not held.flags.c_contiguous or not held.flags.writeable:
                    moments[key] = np.array(held, dtype=value.dtype, order="C")  # updated in place: our own copy
            inputs += [value, grad, *(moments[k] for k in self._states)]
            outputs += [value, *(moments[k] for k in self._states)]
        self._runner.run(numpy_buffers(inputs), numpy_buffers(outputs))
        state.step = step
