"""One rank of a distributed ORTModule run, launched by tests/test_distributed.py under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/distributed/worker.py ddp OUT

Each rank trains the same small model on its half of every combined batch for STEPS SGD
steps (gloo on CPU) and writes its parameters to OUT/rank{R}.pt; the test compares the ranks
with each other and with one process training on the combined batches.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import ortlab

STEPS, BATCH, FEATURES = 4, 8, 6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def train(model: nn.Module, rank: int, world: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = nn.functional.cross_entropy(model(x[shard]), y[shard])
        opt.zero_grad()
        loss.backward()
        opt.step()


def train_deepspeed(stage: int, rank: int, world: int, out: str) -> None:
    """DeepSpeed ZeRO ``stage`` as ONNX Runtime documented it: ``deepspeed.initialize(model=ORTModule(model))``."""
    import deepspeed

    model = ortlab.ORTModule(make_model())
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        # ZeRO's optimizer clips the gradients' global norm at 1.0 unless told otherwise; one
        # process on the combined batch does not clip.
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    for x, y in batches():
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = nn.functional.cross_entropy(engine(x[shard]), y[shard])
        engine.backward(loss)
        engine.step()
    fallbacks = [str(f) for f in model.report.fallbacks]
    torch.save({"state": model.state_dict(), "fallbacks": fallbacks, "captures": len(model.report.captures)},
               os.path.join(out, f"rank{rank}.pt"))


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    if kind.startswith("zero"):
        import deepspeed
        import deepspeed.ops

        # DeepSpeed compiles its shared-memory allreduce kernel (a C++ extension) on first use: ~100 s
        # on 2 cores, again for every new virtual environment. These tests are about ORTModule inside
        # ZeRO, not about that kernel: gloo's allreduce does the same sums. (DeepSpeed keeps the dict of
        # compatible ops in its module so that edits to it persist: deepspeed/ops/__init__.py.)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "ddp":
        model = ortlab.ORTModule(make_model())
        # Tiny buckets: Dynamo's DDPOptimizer would split the graph at each (see Note [DDP and Dynamo's DDPOptimizer]).
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = wrapped = ortlab.ORTModule(fully_shard(make_model()))
    elif kind == "fsdp2-outer":
        from torch.distributed.fsdp import fully_shard

        model = wrapped = fully_shard(ortlab.ORTModule(make_model()))
    elif kind.startswith("zero"):
        train_deepspeed(int(kind[-1]), rank, world, out)
        dist.destroy_process_group()
        return
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    train(wrapped, rank, world)
    if kind.startswith("fsdp2"):
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    else:
        state = model.state_dict()
    fallbacks = [str(f) for f in model.report.fallbacks]
    torch.save({"state": state, "fallbacks": fallbacks, "captures": len(model.report.captures)},
               os.path.join(out, f"rank{rank}.pt"))
    # DDP's reducer holds the process group: freed after destroy_process_group (at exit), its
    # gloo group's destructor waited forever on a thread (seen in CI). Free it while the group lives.
    del wrapped, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The results are on disk; skip interpreter teardown, where a gloo group's destructor once
    # waited forever on a thread (the test would then sit out its timeout).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
