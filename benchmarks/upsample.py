"""A convolution net with a bilinear and a nearest upsampling (a decoder's shape): training steps beside eager.

Note [Accumulating index_put as one scatter-add] in ortlab/capture/decompositions.py: the upsamplings' backward
(index_put with accumulate) is one scatter_add, so the backward is one onnxruntime part. Prints the medians of
eager's and ortlab's steps (forward and backward), taken in turns in one process, and each graph's parts.

    python benchmarks/upsample.py
"""
import argparse
import statistics
import time
import warnings

import torch  # torch first, as users' scripts do
import torch.nn.functional as F
from torch import nn

import ortlab


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 32, 3, padding=1)
        self.b = nn.Conv2d(32, 32, 3, padding=1)
        self.c = nn.Conv2d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(F.relu(self.a(x)), scale_factor=2, mode="bilinear")
        h = F.interpolate(F.relu(self.b(h)), scale_factor=2, mode="nearest")
        return self.c(h).square().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=8)
    cli = parser.parse_args()
    warnings.simplefilter("ignore", ortlab.FallbackWarning)
    torch.manual_seed(0)
    eager = Up()
    model = ortlab.ORTModule(Up())
    model.load_state_dict(eager.state_dict())
    x = torch.randn(8, 3, 48, 48)
    times: dict[str, list[float]] = {"eager": [], "ortlab": []}
    for _ in range(cli.steps):
        for name, module in (("eager", eager), ("ortlab", model)):
            start = time.perf_counter()
            module(x).backward()
            times[name].append(time.perf_counter() - start)
    e, o = (statistics.median(times[k][cli.warmup:]) for k in ("eager", "ortlab"))
    parts = [len(g.parts) for c in model.report.captures for g in c.graphs]
    print(f"eager {e * 1e3:.1f} ms ortlab {o * 1e3:.1f} ms ratio {e / o:.2f}x parts {parts}")


if __name__ == "__main__":
    main()
