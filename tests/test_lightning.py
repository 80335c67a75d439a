"""A LightningModule holding ``ORTModule(model)`` fits with lightning's Trainer on CPU like eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ortlab

lightning = pytest.importorskip("lightning")


class _Classifier(lightning.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(net: nn.Module) -> _Classifier:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = _Classifier(net)
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lightning's hints about workers and logging
        trainer.fit(module, loader)
    return module


def test_lightning_fits_an_ortmodule_like_eager():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    eager = _fit(copy.deepcopy(net))
    ort = _fit(ortlab.ORTModule(net))
    assert isinstance(ort.net, ortlab.ORTModule) and ort.net.report.captures
    assert not ort.net.report.fallbacks
    for (name, p), q in zip(ort.net.named_parameters(), eager.net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
