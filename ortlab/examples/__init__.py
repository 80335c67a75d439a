"""Runnable examples, one per workflow (each trains a small model built from scratch, no downloads).

    python -m ortlab.examples.hf_trainer          # Hugging Face Trainer (ortlab.hf.ORTTrainer)
    python -m ortlab.examples.lightning_fit       # a LightningModule holding ORTModule
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m ortlab.examples.ddp
    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc-per-node=2 -m ortlab.examples.deepspeed_zero
    python -m ortlab.examples.ondevice             # on-device training from ONNX artifacts
    python -m ortlab.examples.optimizers           # FusedAdam and FP16_Optimizer
"""
