"""A DCGAN-shaped generator and a UNet-shaped decoder (transposed convolutions): training steps beside eager.

``convolution_backward`` of a transposed convolution had no decomposition: its gradients ran in PyTorch
between onnxruntime parts. Its input gradient is now the ordinary convolution of the output gradient
with the same weight, and its weight gradient that convolution's (``_transposed_convolution_backward``
in ortlab/capture/decompositions.py). Prints the medians of eager's and ortlab's steps, taken in turns
in one process, each graph's parts, providers and the losses.

    python benchmarks/conv_transpose.py --model dcgan
    python benchmarks/conv_transpose.py --model unet
"""
import argparse

import torch  # torch first, as users' scripts do
import torch.nn.functional as F
from torch import nn

from side_by_side import arguments, in_turns, summary, twins  # benchmarks/ is the script's folder


class Generator(nn.Module):
    """DCGAN's generator: a 64-d latent to a 3x32x32 image through 4x4 stride-2 transposed convolutions."""

    def __init__(self) -> None:
        super().__init__()

        def up(cin: int, cout: int, stride: int = 2, padding: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, stride, padding, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU())

        self.net = nn.Sequential(up(64, 256, 1, 0), up(256, 128), up(128, 64), nn.ConvTranspose2d(64, 3, 4, 2, 1),
                                 nn.Tanh())

    def forward(self, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(z[:, :, None, None]), target)


class UNet(nn.Module):
    """Two levels down (3x3 convolutions, max pools), two up (2x2 stride-2 transposed convolutions, skips)."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.ReLU())

        self.d1, self.d2, self.mid = block(3, 16), block(16, 32), block(32, 64)
        self.u2, self.b2 = nn.ConvTranspose2d(64, 32, 2, 2), block(64, 32)
        self.u1, self.b1 = nn.ConvTranspose2d(32, 16, 2, 2), block(32, 16)
        self.out = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.mid(F.max_pool2d(b, 2))
        b = self.b2(torch.cat([self.u2(c), b], 1))
        a = self.b1(torch.cat([self.u1(b), a], 1))
        return F.binary_cross_entropy_with_logits(self.out(a), target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dcgan", "unet"), default="dcgan")
    cli = arguments(__doc__, parser)
    eager, model = twins(Generator if cli.model == "dcgan" else UNet)
    g = torch.Generator().manual_seed(0)
    if cli.model == "dcgan":
        x, y = torch.randn(16, 64, generator=g), torch.rand(16, 3, 32, 32, generator=g) * 2 - 1
    else:
        x, y = torch.randn(8, 3, 64, 64, generator=g), (torch.rand(8, 1, 64, 64, generator=g) > 0.5).float()
    e, o, losses = in_turns(eager, model, lambda module: module(x, y), cli.steps, cli.warmup)
    print(f"{cli.model}: {summary(e, o, model, losses)}")


if __name__ == "__main__":
    main()
