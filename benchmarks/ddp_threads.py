"""Two DDP ranks on one machine (torchrun gives each OMP_NUM_THREADS=1): the 4-layer GPT's steps with
the sessions' threads as PyTorch's (ortlab's default, Note [PyTorch's thread budget]) against one per
core (onnxruntime's default, ortlab's before), step by step in turns, medians on rank 0.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/ddp_threads.py [steps]
"""
import os
import statistics
import sys
import time
import warnings

warnings.simplefilter("ignore")
import torch
import torch.distributed as dist

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch

dist.init_process_group("gloo")
rank = dist.get_rank()
cores = len(os.sched_getaffinity(0))
models = {}
for name, opts in (("as PyTorch's (new default)", {}), ("one per core (before)", {"intra_op_num_threads": cores})):
    torch.manual_seed(0)
    m = torch.nn.parallel.DistributedDataParallel(ortlab.ORTModule(GPT(GPTConfig()), **opts), bucket_cap_mb=1000)
    models[name] = (m, torch.optim.SGD(m.parameters(), lr=1e-3))
gen = torch.Generator().manual_seed(rank)
batch = make_batch("gpt", 4, generator=gen)


def step(m, o):
    loss = m(*batch)
    loss.backward()
    o.step()
    o.zero_grad()


for m, o in models.values():
    for _ in range(2):
        step(m, o)
times = {k: [] for k in models}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for k, (m, o) in models.items():
        dist.barrier()
        t = time.perf_counter()
        step(m, o)
        dist.barrier()
        times[k].append(time.perf_counter() - t)
if rank == 0:
    print(f"torch threads {torch.get_num_threads()} per rank, {cores} cores, 2 ranks")
    for k, v in times.items():
        print(f"{k:28s} median step {1000 * statistics.median(v):7.1f} ms")
    print("threads:", {k: m.module.report.captures[0].graphs[0].threads for k, (m, _) in models.items()})
dist.destroy_process_group()
