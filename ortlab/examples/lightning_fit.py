"""Fit a LightningModule whose network is ``ORTModule(net)`` with lightning's Trainer on CPU.

    python -m ortlab.examples.lightning_fit [--epochs 3]
"""

from __future__ import annotations

import argparse

import lightning
import torch
from torch import nn

import ortlab


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ortlab.ORTModule(nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4)))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(256, 20)
    y = (x[:, :4] * torch.arange(1.0, 5.0)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    module = Classifier()
    trainer = lightning.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False)
    trainer.fit(module, loader)
    print(module.net.report)


if __name__ == "__main__":
    main()
