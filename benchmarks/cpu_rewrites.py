"""The CPU provider's rewrites (``ortlab/runtime/cpu_rewrites.py``) on and off, side by side.

Three contenders train the same model in one process, their steps alternating: eager PyTorch,
ortlab with the rewrites replaced by a no-op, and ortlab as it is. Prints what the rewrites did
(the report's notes), each contender's median step and last loss, and the ratios.

    python benchmarks/cpu_rewrites.py --model resnet18 --steps 30
    python benchmarks/cpu_rewrites.py --torchvision resnet50 --batch 8 --size 64 --steps 12
    python benchmarks/cpu_rewrites.py --model resnet18 --batch 4 --size 160 --only slices --steps 12
    python benchmarks/cpu_rewrites.py --model gpt --only gelus --steps 30

``--only NAME`` measures one rewrite (``selects``, ``convolutions``, ``slices``, ``gelus``, ``pools``, ``dgrads``,
``broadcasts``): the
"off" contender runs every rewrite but that one. ``--batch``/``--size`` also resize ``--model resnet18``'s images (16 of 64x64 by default).

``--torchvision NAME`` takes a torchvision classification model (100 classes, cross-entropy on random
labels) instead; PyPI's torchvision does not import beside the CPU torch 2.13, so that needs a torch and
torchvision pair that do (docs/getting-started.md says how).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ortlab
import ortlab.pipeline.part as part
import ortlab.runtime.cpu_rewrites as rewrites
from ortlab.runtime.cpu_rewrites import CpuRewrites
from train_step import LARGE_MODELS, MODELS, _cpu_model, build_model, train_step


class _Classifier(torch.nn.Module):
    """A torchvision classifier and its cross-entropy loss, as ``train_step`` calls a model: ``model(*batch)``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(images), labels)


def _torchvision(name: str, batch: int, size: int):  # noqa: ANN202
    import torchvision.models

    torch.manual_seed(0)
    model = _Classifier(getattr(torchvision.models, name)(num_classes=100))

    def draw(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 100, (batch,), generator=g)

    return model, draw


_ONE = {"selects": "checked_selects", "convolutions": "blocked_convolutions", "slices": "merged_slices",
        "gelus": "fused_gelus", "pools": "pool_offsets", "dgrads": "input_gradients", "broadcasts": "expanded_broadcasts"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=[*MODELS, *LARGE_MODELS])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--torchvision", default=None, help="a torchvision model name instead of --model")
    parser.add_argument("--batch", type=int, default=None, help="images per batch (--torchvision: 8)")
    parser.add_argument("--size", type=int, default=None, help="image height and width (--torchvision: 64)")
    parser.add_argument("--only", choices=sorted(_ONE), help="measure this rewrite alone against the others")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}; CPU: {_cpu_model()}; {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    if args.torchvision:
        batch, size = args.batch or 8, args.size or 64
        model, draw = _torchvision(args.torchvision, batch, size)
        print(f"torchvision {args.torchvision}, batch {batch}, {size}x{size}")
    else:
        model, draw, _ = build_model(args.model)
        if args.model == "resnet18" and (args.batch or args.size):
            batch, size = args.batch or 16, args.size or 64
            print(f"resnet18, batch {batch}, {size}x{size}")

            def draw(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
                return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 1000, (batch,), generator=g)
    batches = [draw(g) for _ in range(args.batches)]
    real = part.rewrite_for_cpu
    one = _ONE.get(args.only)
    real_one = getattr(rewrites, one) if one else None
    contenders = {}
    try:
        for label in ("eager", "off", "on"):
            m = copy.deepcopy(model)
            if one:  # "off": every rewrite but this one
                setattr(rewrites, one, real_one if label == "on" else (lambda *a, **k: 0))
            else:
                part.rewrite_for_cpu = real if label == "on" else (lambda model, level: CpuRewrites())
            wrapped = m if label == "eager" else ortlab.ORTModule(m)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            start = time.perf_counter()
            train_step(wrapped, opt, batches[0])  # the first step builds the sessions, with or without
            print(f"{label}: first step {time.perf_counter() - start:.2f} s")
            if label == "on":
                for c in wrapped.report.captures:
                    for graph in c.graphs:
                        for note in graph.notes:
                            if any(k in note for k in ("Where node(s)", "convolution", "Slice(s)", "GELU(s)", "gradient", "op(s)")):
                                print(f"  {note}")
            contenders[label] = (wrapped, opt)
    finally:
        part.rewrite_for_cpu = real
        if one:
            setattr(rewrites, one, real_one)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    losses: dict[str, float] = {}
    for i in range(args.steps):
        for label, (wrapped, opt) in contenders.items():
            ms, loss, _ = train_step(wrapped, opt, batches[(i + 1) % len(batches)])
            times[label].append(ms)
            losses[label] = loss.item()
    for label in contenders:
        print(f"{label:6s} median {statistics.median(times[label]):9.2f} ms   last loss {losses[label]:.6f}")
    eager, off, on = (statistics.median(times[k]) for k in ("eager", "off", "on"))
    what = f"{args.only} on vs off (the other rewrites on in both)" if one else "rewrites on vs off"
    print(f"{what} {off / on:.3f}x; off vs eager {eager / off:.3f}x; on vs eager {eager / on:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
