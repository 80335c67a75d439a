"""Where each benchmark model's ortlab step loses or gains time against eager: ``ortlab.compare_speed``'s
text form for the models of ``train_step.py`` (issue 44: each miss of the speed table explained).

``compare_speed`` runs both sides in one process, in turns (Note [Eager beside onnxruntime] in
``ortlab/inspect/speed.py``): its verdict can differ from ``gemm_floor.py``'s figures, which run each
contender alone in fresh processes; its rows say *where* the time goes, and those are what this prints.

Usage:
    python benchmarks/explain_speed.py --model gpt
    python benchmarks/explain_speed.py --model resnet18-32,mobilenet --steps 8 --rows 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402, I001

import ortlab  # noqa: E402
from train_step import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", help="a model of train_step.py, or a comma list of them")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a side")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps a side")
    parser.add_argument("--rows", type=int, default=15, help="rows printed, by time lost")
    args = parser.parse_args()
    for name in [m.strip() for m in args.model.split(",") if m.strip()]:
        model, draw, _ = build_model(name)
        batch = draw(torch.Generator().manual_seed(0))
        result = ortlab.compare_speed(model, *batch, steps=args.steps, profile_steps=args.profile_steps,
                                      optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))
        print(f"== {name} ==")
        text = str(result).splitlines()
        head = next(i for i, line in enumerate(text) if line.lstrip().startswith("lost ms")) + 1
        print("\n".join(text[:head + args.rows]))
        if len(text) > head + args.rows:
            print(f"  ... {len(text) - head - args.rows} more rows")
        print("per top-level module (lost ms, ortlab ms, eager ms):")
        for row in result.modules(depth=2)[:8]:
            print(f"{row.lost_ms:>+8.2f} {row.ortlab_ms:>8.2f} {row.eager_ms:>8.2f}  {row.module}")
        print(flush=True)


if __name__ == "__main__":
    main()
