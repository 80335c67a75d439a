"""Optimizers for PyTorch models: onnxruntime's ``onnxruntime.training.optim`` API on the standard wheel.

* :class:`FusedAdam`: Adam/AdamW whose step is one onnxruntime run over every parameter,
  updating them in place (the graph of ``ortlab.ondevice``'s optimizer).
* :class:`FP16_Optimizer`: dynamic loss scaling for fp16 training, as ``torch.amp.GradScaler``.
"""

from ortlab.optim.fp16_optimizer import FP16_Optimizer
from ortlab.optim.fused_adam import FusedAdam

__all__ = ["FusedAdam", "FP16_Optimizer"]
