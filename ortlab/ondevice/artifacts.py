"""``generate_artifacts``: everything a device needs to train a model with onnxruntime alone.

onnxruntime's ``onnxruntime.training.artifacts.generate_artifacts`` rebuilt: from a PyTorch
model and example inputs it writes, into one folder, the training model (loss and
gradients), the eval model (loss and outputs), the optimizer model (every parameter's
update in one graph) and the checkpoint (the initial parameters). This module imports
PyTorch only inside :func:`generate_artifacts`, so ``import ortlab.ondevice`` works on a
device without it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ortlab.ondevice.checkpoint import CheckpointState
from ortlab.ondevice.files import save_model
from ortlab.ondevice.layout import TrainingLayout
from ortlab.ondevice.optimizer_model import ParamSlot, UpdateRule, build_optimizer_model

if TYPE_CHECKING:
    import torch

__all__ = ["TRAINING_MODEL", "EVAL_MODEL", "OPTIMIZER_MODEL", "CHECKPOINT", "Artifacts", "generate_artifacts"]

logger = logging.getLogger(__name__)

TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
OPTIMIZER_MODEL = "optimizer_model.onnx"
CHECKPOINT = "checkpoint"


@dataclasses.dataclass(frozen=True)
class Artifacts:
    """The files ``generate_artifacts`` wrote and what their inputs are.

    Attributes:
        directory: the artifact folder.
        training_model, eval_model, optimizer_model, checkpoint: the files' paths.
        layout: the roles of the training model's inputs and outputs.
        rule: the optimizer and its hyperparameters.
        seconds: how long generating took.
    """

    directory: str
    training_model: str
    eval_model: str
    optimizer_model: str
    checkpoint: str
    layout: TrainingLayout
    rule: UpdateRule
    seconds: float


def _rule(optimizer: str | UpdateRule) -> UpdateRule:
    return optimizer if isinstance(optimizer, UpdateRule) else UpdateRule.default(str(optimizer).lower())


def generate_artifacts(
    model: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    loss: str | Callable[..., torch.Tensor] | None = "cross_entropy",
    optimizer: str | UpdateRule = "adamw",
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    artifact_dir: str | os.PathLike = "artifacts",
    labels: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    learning_rate: float = 1e-3,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
) -> Artifacts:
    """Write the training, eval and optimizer models and the checkpoint of ``model`` into ``artifact_dir``.

    Runs where the model is built (it needs PyTorch); the files then train with
    ``ortlab.ondevice.Module`` and ``Optimizer`` on onnxruntime and numpy alone. See Note
    [Tracing the training step] in ``ortlab.ondevice.trace`` for how the gradients are made.

    Args:
        model: the module; its current parameters become the checkpoint. Its train/eval
            mode is kept: the training model is traced in train mode, the eval model in eval mode.
        example_inputs: a tensor or tuple of tensors the model is called with.
        loss: ``"cross_entropy"`` (labels: class indices), ``"mse"``, ``"bce_with_logits"``,
            ``"l1"`` (mean-reduced, applied to the model's first output), a callable
            ``(output, *labels) -> scalar``, or ``None`` when the model's first output is
            its scalar loss.
        optimizer: ``"adamw"`` (``torch.optim.AdamW``'s defaults), ``"adam"``, ``"sgd"``, or an
            :class:`UpdateRule` with other betas, eps or weight decay.
        requires_grad: the parameters that train (default: those with ``requires_grad``).
        frozen_params: parameters that do not train; they stay inputs of the models, with
            no gradient output.
        artifact_dir: the folder to write (created if missing; files in it are replaced).
        labels: example labels (default: zeros shaped for the built-in loss).
        learning_rate: the checkpoint's initial learning rate.
        input_names: names of the model's inputs (default ``input`` or ``input_0``, ...).
        output_names: names of the model's outputs (default ``output`` or ``output_0``,
            ..., or a returned dict's keys).
        dynamic_batch: the inputs' and labels' first dimension may change between calls.

    Returns:
        The files' paths and the models' layout.

    Raises:
        ConfigError: for a wrong argument (the message lists the valid choices).
        ExportError: when PyTorch cannot trace the model or ONNX cannot express an op.
        ImportError: when PyTorch is missing.

    Example:
        >>> art = generate_artifacts(model, torch.randn(8, 16), "cross_entropy", "adamw",  # doctest: +SKIP
        ...                          artifact_dir="artifacts")
        >>> art.layout.trainable                                                            # doctest: +SKIP
        ('fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias')
    """
    start = time.perf_counter()
    try:
        from ortlab.ondevice import trace
    except ImportError as e:
        raise ImportError(f"generate_artifacts traces the model with PyTorch, which could not be imported ({e}); "
                          "run it where the model is built, then train from its files with onnxruntime alone") from e
    rule = _rule(optimizer)
    spec = trace.prepare_step(model, example_inputs, loss, labels, requires_grad, frozen_params, input_names,
                              output_names, dynamic_batch)
    training, layout = trace.export_step(spec, train=True)
    evaluation, _ = trace.export_step(spec, train=False)

    arrays = {name: spec.tensors[name].detach().cpu().numpy() for name in layout.trainable + layout.frozen}
    slots = [ParamSlot(name, arrays[name].dtype, arrays[name].shape, rule) for name in layout.trainable]
    directory = os.fspath(artifact_dir)
    os.makedirs(directory, exist_ok=True)
    paths = {f: os.path.join(directory, f) for f in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT)}
    save_model(training, paths[TRAINING_MODEL])
    save_model(evaluation, paths[EVAL_MODEL])
    save_model(build_optimizer_model(slots), paths[OPTIMIZER_MODEL])
    state = CheckpointState(arrays, layout.trainable, learning_rate=learning_rate,
                            properties={"optimizer": rule.kind})
    CheckpointState.save_checkpoint(state, paths[CHECKPOINT])
    seconds = time.perf_counter() - start
    logger.info("ortlab.ondevice: artifacts for %d trainable and %d frozen tensors written to %s in %.1f s",
                len(layout.trainable), len(layout.frozen), directory, seconds)
    return Artifacts(directory, paths[TRAINING_MODEL], paths[EVAL_MODEL], paths[OPTIMIZER_MODEL], paths[CHECKPOINT],
                     layout, rule, seconds)
