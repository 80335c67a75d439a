"""The runnable examples (ortlab/examples/) run as the README shows them, shortened.

The distributed ones (ddp, deepspeed_zero) are exercised by tests/test_distributed.py's worker
under torchrun, with the same calls."""

from __future__ import annotations

import warnings

import pytest


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ortlab.examples import hf_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_trainer.main(["--steps", "2", "--out", str(tmp_path)])
    assert (tmp_path / "final" / "config.json").exists()


def test_lightning_example():
    pytest.importorskip("lightning")
    from ortlab.examples import lightning_fit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning_fit.main(["--epochs", "1"])


def test_ondevice_example(tmp_path, capsys):
    from ortlab.examples import ondevice

    ondevice.main(["--dir", str(tmp_path), "--steps", "3"])
    assert (tmp_path / "inference.onnx").exists() and (tmp_path / "checkpoint_trained").exists()
    assert "step 2: loss" in capsys.readouterr().out


def test_optimizers_example(capsys):
    from ortlab.examples import optimizers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizers.main(["--steps", "3"])
    assert "FP16_Optimizer: loss scale" in capsys.readouterr().out
