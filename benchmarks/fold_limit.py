"""onnxruntime's constant folding capped at 1 MiB of output against no cap, in fresh processes in turns.

Note [No constants of a vocabulary's size] (``ortlab/runtime/session.py``): without the cap the zeros an
embedding's gradient (``[vocab, d]``) is scattered into were folded into a constant of the backward
session, and written with its optimized model into ``cache_dir``. Each child process trains a
GPT-2-small-sized model (vocab 50257, d=768, T=256, batch 4; ``--layers`` of them) for four SGD steps
with a fresh ``cache_dir`` and prints its first step, the next steps, the last loss, the size of the
cache folder and its peak RSS. ``--cached`` runs each setting a second time on the folder the first
filled: a cached start, which reads the models back.

    python benchmarks/fold_limit.py                  # 4 layers, two processes per setting
    python benchmarks/fold_limit.py --layers 12 --runs 1
    python benchmarks/fold_limit.py --cached
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, resource, sys, tempfile, time, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import torch
import ortlab
import ortlab.runtime.session as session
from ortlab.models import GPT, GPTConfig, make_batch
if sys.argv[1] != "cap":
    session._FOLD_LIMIT_BYTES = 1 << 62  # no cap, as before
cfg = GPTConfig(vocab=50257, block_size=256, d_model=768, n_heads=12, n_layers=int(sys.argv[2]))
torch.manual_seed(0)
folder = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp()
model = ortlab.ORTModule(GPT(cfg), cache_dir=folder)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
times = []
for _ in range(4):
    idx, tgt = make_batch("gpt", 4, gen, vocab=cfg.vocab, block_size=cfg.block_size)
    start = time.perf_counter()
    loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(f"{{sys.argv[1]:>6}}{{' (cached)' if len(sys.argv) > 3 and sys.argv[4:] else ''}}: first step {{times[0]:5.2f}} s, then {{', '.join(f'{{t:.2f}}' for t in times[1:])}} s; "
      f"loss {{loss.item():.5f}}; cache {{size / 1e6:6.1f}} MB; peak RSS {{rss}} MB")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="processes per setting, in turns")
    parser.add_argument("--cached", action="store_true", help="also a second process on the filled cache folder")
    args = parser.parse_args()
    code = CHILD.format(root=str(ROOT))
    for _ in range(args.runs):
        for setting in ("nocap", "cap"):
            with tempfile.TemporaryDirectory() as folder:
                for extra in ([[folder], [folder, "hit"]] if args.cached else [[]]):
                    out = subprocess.run([sys.executable, "-c", code, setting, str(args.layers), *extra],
                                         capture_output=True, text=True, check=True)
                    print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
