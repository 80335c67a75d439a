"""A Hugging Face causal LM given labels: one graph against the graph break ortlab used to leave.

GPT2LMHeadModel's loss_function calls transformers' ``logger.warning_once``, which Dynamo cannot
trace: the LM head and its loss were two graphs, the logits between them (Note [Once-only log calls
inside captured code] in ``ortlab/_compat/torch.py``). Three contenders in one process, steps
alternating: eager, ortlab as it is (one graph), and ortlab with Dynamo's
``ignore_logging_functions`` emptied while it captures (the graph break). Losses printed and equal.

    python benchmarks/hf_graph_break.py
"""
import copy
import statistics
import time
import warnings

import torch  # torch first, as users' scripts do
import torch._dynamo
from transformers import GPT2Config, GPT2LMHeadModel

import ortlab

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=50257, n_positions=128, resid_pdrop=0, embd_pdrop=0,
                 attn_pdrop=0)
eager = GPT2LMHeadModel(cfg)
new, old = ortlab.ORTModule(copy.deepcopy(eager)), ortlab.ORTModule(copy.deepcopy(eager))
ids = torch.randint(0, 50257, (4, 128), generator=torch.Generator().manual_seed(1))


def step(model: torch.nn.Module) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return float(loss)


ignored = torch._dynamo.config.ignore_logging_functions
kept = set(ignored)
start = time.perf_counter()
print("ortlab, one graph: first step loss", step(new), f"{time.perf_counter() - start:.1f} s")
ignored.clear()  # the old behaviour while `old` captures: the log call breaks the graph
start = time.perf_counter()
print("ortlab, graph break: first step loss", step(old), f"{time.perf_counter() - start:.1f} s")
ignored.update(kept)
print("eager: loss", step(eager))
print("captured graphs: one graph", len(new.report.captures), "| graph break", len(old.report.captures))
times: dict[str, list[float]] = {"eager": [], "old": [], "new": []}
for _ in range(8):
    for key, model in (("eager", eager), ("old", old), ("new", new)):
        start = time.perf_counter()
        step(model)
        times[key].append(time.perf_counter() - start)
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(f"median step: eager {med['eager']:.1f} ms, ortlab with the graph break {med['old']:.1f} ms "
      f"({med['eager'] / med['old']:.2f}x eager), ortlab one graph {med['new']:.1f} ms "
      f"({med['eager'] / med['new']:.2f}x eager); one graph against the break {med['old'] / med['new']:.3f}x")
