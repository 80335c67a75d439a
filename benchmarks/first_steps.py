"""The first training steps of the GPT or the GPT-2-small-sized model in a fresh process, step by step.

Prints one JSON line: each step's seconds, their total, the seconds the provider race spent on the
first call (``race_s``: each part's own first run and its candidates' check runs; the timing rides
on the next calls, Note [The race times the next calls' own runs] in ``ortlab/runtime/race.py``),
the last loss and each graph's providers line. Run it in turns against another checkout
(``PYTHONPATH=/path/to/other python benchmarks/first_steps.py ...``) to compare first steps.

    python benchmarks/first_steps.py gpt 8
    python benchmarks/first_steps.py gpt2s 6
"""
import argparse
import json
import time

import torch  # torch first, as users' scripts do

import ortlab
from ortlab.models import GPT, GPTConfig, make_batch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", choices=("gpt", "gpt2s"))
parser.add_argument("steps", type=int)
cli = parser.parse_args()
name, n = cli.model, cli.steps
torch.manual_seed(0)
if name == "gpt":
    cfg = GPTConfig()
    batch = 8
else:  # gpt2s: train_step.py's GPT-2-small-sized model
    cfg = GPTConfig(vocab=50257, block_size=256, d_model=768, n_heads=12, n_layers=12)
    batch = 4
model = ortlab.ORTModule(GPT(cfg))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
times = []
for i in range(n):
    idx, tgt = make_batch("gpt", batch, g, vocab=cfg.vocab, block_size=cfg.block_size)
    s = time.perf_counter()
    loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - s)
graphs = [gr for c in model.report.captures for gr in c.graphs]
print(json.dumps({
    "file": ortlab.__file__, "steps": [round(t, 3) for t in times], "total": round(sum(times), 2),
    "race_s": round(sum(gr.race_s for gr in graphs), 2), "loss": round(loss.item(), 5),
    "providers": "; ".join(f"{gr.label}: {gr.providers[:60]}" for gr in graphs),
}))
