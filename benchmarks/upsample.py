"""A convolution net with a bilinear and a nearest upsampling (a decoder's shape): training steps beside eager.

Note [Accumulating index_put as one scatter-add] in ortlab/capture/decompositions.py: the upsamplings' backward
(index_put with accumulate) is one scatter_add, so the backward is one onnxruntime part. Prints the medians of
eager's and ortlab's steps (forward and backward), taken in turns in one process, and each graph's parts.

    python benchmarks/upsample.py
"""

import torch  # torch first, as users' scripts do
import torch.nn.functional as F
from torch import nn

from side_by_side import arguments, in_turns, summary, twins  # benchmarks/ is the script's folder


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
    cli = arguments(__doc__)
    eager, model = twins(Up)
    x = torch.randn(8, 3, 48, 48)
    e, o, losses = in_turns(eager, model, lambda module: module(x), cli.steps, cli.warmup)
    print(summary(e, o, model, losses))


if __name__ == "__main__":
    main()
