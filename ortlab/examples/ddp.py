"""Data-parallel training: ``DistributedDataParallel(ORTModule(model))``, one process per rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m ortlab.examples.ddp

On several machines, the same script under torchrun's multi-node flags
(``--nnodes=N --node-rank=R --rdzv-endpoint=HOST:PORT``). Uses gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.parallel.DistributedDataParallel(ortlab.ORTModule(GPT(GPTConfig(n_layers=2))))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(10):
        idx, targets = make_batch("gpt", 4, generator=gen)
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0 of {world})")
    if rank == 0:
        print(model.module.report)
    del model, opt  # DDP's reducer holds the process group: free it before destroying the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
