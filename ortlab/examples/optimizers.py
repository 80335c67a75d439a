"""ONNX Runtime's optimizers: ``FusedAdam`` (one onnxruntime run per step) and ``FP16_Optimizer``.

    python -m ortlab.examples.optimizers [--steps 20]

A GPT trains through ``ORTModule`` with ``FusedAdam``; then ``FP16_Optimizer`` wraps it to train
with dynamic loss scaling, as fp16 training needs (the scale and skipped steps are printed).
"""

from __future__ import annotations

import argparse

import torch

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.optim import FP16_Optimizer, FusedAdam


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = ortlab.ORTModule(GPT(GPTConfig(n_layers=2)))
    opt = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01)  # AdamW (adam_w_mode=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        loss = model(*make_batch("gpt", 4, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"FusedAdam step {step}: loss {loss.item():.4f}")
    scaled = FP16_Optimizer(opt, init_scale=2.0**16, growth_interval=5)
    for step in range(args.steps):
        loss = model(*make_batch("gpt", 4, generator=gen))
        scaled.zero_grad()
        scaled.backward(loss)  # the loss times the scale; step() unscales, skips on inf/nan
        scaled.step()
    print(f"FP16_Optimizer: loss scale {scaled.loss_scale:g}, {scaled.skipped_steps} step(s) skipped")


if __name__ == "__main__":
    main()
