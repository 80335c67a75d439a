"""A DenseNet-shaped convolution net with average poolings: training steps beside eager.

Note [Average pooling's backward as repeats and shifted sums] in ortlab/capture/decompositions.py:
``avg_pool2d_backward`` (no ONNX translation) had cut the backward around every average pooling in
PyTorch. The net has DenseNet's transitions (1x1 convolution, 2x2 average pooling) and an Inception
branch's 3x3 stride-1 pooling without the padding counted. Prints the medians of eager's and
ortlab's steps, taken in turns in one process, each graph's parts and the losses.

    python benchmarks/avg_pool.py
"""

import torch  # torch first, as users' scripts do
import torch.nn.functional as F
from torch import nn

from side_by_side import arguments, in_turns, summary, twins  # benchmarks/ is the script's folder


class Dense(nn.Module):
    """Two DenseNet layers (batch norm, ReLU, 3x3 convolution, concatenated) and a transition."""

    def __init__(self, cin: int, growth: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(cin + i * growth), nn.ReLU(), nn.Conv2d(cin + i * growth, growth, 3, padding=1))
            for i in range(2))
        self.cout = (cin + 2 * growth) // 2
        self.transition = nn.Sequential(nn.BatchNorm2d(cin + 2 * growth), nn.ReLU(),
                                        nn.Conv2d(cin + 2 * growth, self.cout, 1), nn.AvgPool2d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.transition(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        blocks, c = [], 32
        for _ in range(3):
            blocks.append(Dense(c))
            c = blocks[-1].cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        h = h + F.avg_pool2d(h, 3, stride=1, padding=1, count_include_pad=False)  # Inception's pooling branch
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


def main() -> None:
    cli = arguments(__doc__)
    eager, model = twins(Net)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    e, o, losses = in_turns(eager, model, lambda module: module(x, y), cli.steps, cli.warmup)
    print(summary(e, o, model, losses))


if __name__ == "__main__":
    main()
