"""DeepSpeed ZeRO (stage 1 or 2) around ORTModule, as ONNX Runtime documented it.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m ortlab.examples.deepspeed_zero [--stage 2]

On CPU, DeepSpeed's CPU accelerator communicates with gloo where oneCCL is absent. A torch
optimizer under ZeRO needs ``zero_allow_untested_optimizer``.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2)
    args = parser.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(0)
    model = ortlab.ORTModule(GPT(GPTConfig(n_layers=2)))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                                      config=config)
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    for step in range(10):
        idx, targets = make_batch("gpt", 4, generator=gen)
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if engine.global_rank == 0:
        print(model.report)


if __name__ == "__main__":
    main()
