"""On-device training from ONNX artifacts: onnxruntime's training API on the standard wheel, torch-free.

Where the model is built (with PyTorch)::

    from ortlab.ondevice import generate_artifacts
    generate_artifacts(model, example_inputs, loss="cross_entropy", optimizer="adamw", artifact_dir="artifacts")

On the device (onnxruntime, numpy and onnx only)::

    from ortlab.ondevice import CheckpointState, Module, Optimizer
    state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    module = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    optimizer = Optimizer("artifacts/optimizer_model.onnx", module)
    for x, y in batches:
        loss = module(x, y)          # loss and gradients, accumulated into state.gradients
        optimizer.step()             # every parameter updated in place, in one run
        module.lazy_reset_grad()
    module.export_model_for_inferencing("model.onnx", ["output"])

Importing this package never imports PyTorch (``generate_artifacts`` imports it when called).
"""

from ortlab.errors import ArtifactError
from ortlab.ondevice.artifacts import Artifacts, generate_artifacts
from ortlab.ondevice.checkpoint import CheckpointState
from ortlab.ondevice.layout import TrainingLayout
from ortlab.ondevice.module import Module
from ortlab.ondevice.optimizer import Optimizer
from ortlab.ondevice.optimizer_model import UpdateRule, build_optimizer_model

__all__ = [
    "generate_artifacts",
    "Artifacts",
    "CheckpointState",
    "Module",
    "Optimizer",
    "UpdateRule",
    "TrainingLayout",
    "build_optimizer_model",
    "ArtifactError",
]
