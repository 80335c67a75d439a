"""On-device training from ONNX artifacts: generate them with PyTorch, train with onnxruntime alone.

    python -m ortlab.examples.ondevice [--dir ortlab_artifacts] [--steps 50]

The second half (``train_on_device``) imports nothing of PyTorch: it is what runs on a device
with onnxruntime, numpy and onnx installed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def make_artifacts(folder: str) -> None:
    """Where the model is built: a small classifier, cross-entropy loss, AdamW."""
    import torch
    from torch import nn

    from ortlab.ondevice import generate_artifacts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    generate_artifacts(model, (torch.randn(16, 8),), loss="cross_entropy", optimizer="adamw",
                       artifact_dir=folder)


def train_on_device(folder: str, steps: int) -> None:
    """On the device: onnxruntime, numpy and onnx only."""
    from ortlab.ondevice import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((8, 3)).astype(np.float32)
    module.train()
    for step in range(steps):
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = (x @ teacher).argmax(axis=1).astype(np.int64)
        loss = module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step}: loss {float(loss):.4f}")
    CheckpointState.save_checkpoint(state, os.path.join(folder, "checkpoint_trained"))
    module.export_model_for_inferencing(os.path.join(folder, "inference.onnx"), None)
    print(f"trained checkpoint and inference model in {folder}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="ortlab_artifacts")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    make_artifacts(args.dir)
    train_on_device(args.dir, args.steps)


if __name__ == "__main__":
    main()
