"""Hugging Face ``transformers``: ``ORTTrainer``, a ``Trainer`` that trains through ORTModule.

``transformers.Trainer(model=ORTModule(model), ...)`` trains as it is (ORTModule shows the
wrapped model's ``forward`` signature, so the Trainer keeps the dataset columns the model
takes). What it cannot do is save: it only writes ``save_pretrained`` folders for a
``PreTrainedModel``, and for any other module falls back to a bare state dict, which
safetensors refuses for tied weights (GPT-2's ``lm_head.weight`` is ``wte.weight``): every
checkpoint (by default each 500 steps) raised. ``ORTTrainer`` saves the wrapped model with
``save_pretrained`` (config.json, weights, generation config), a folder
``from_pretrained`` loads. It also wraps a plain model in ``ORTModule`` for you, the way
optimum's ``ORTTrainer`` did.

    from ortlab.hf import ORTTrainer
    trainer = ORTTrainer(model=GPT2LMHeadModel(config), args=TrainingArguments("out"), train_dataset=ds)
    trainer.train()
    trainer.save_model("out/final")        # GPT2LMHeadModel.from_pretrained("out/final") loads it

``transformers`` is imported when this module is, not by ``import ortlab``.
"""

from __future__ import annotations

from typing import Any

import transformers

from ortlab.ortmodule import ORTModule

__all__ = ["ORTTrainer"]


class ORTTrainer(transformers.Trainer):
    """``transformers.Trainer`` training ``model`` through ``ORTModule``.

    Args:
        model: a model, wrapped in ``ORTModule(model, **ortmodule_options)`` unless it is one.
        ortmodule_options: ORTModule's options (``recompute``, ``cache_dir``...).
        *args, **kwargs: as ``transformers.Trainer`` takes them.
    """

    def __init__(self, model: Any = None, *args: Any, ortmodule_options: dict | None = None, **kwargs: Any) -> None:
        if model is not None and not isinstance(model, ORTModule):
            model = ORTModule(model, **(ortmodule_options or {}))
        super().__init__(model, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the wrapped model as ``Trainer`` saves a ``PreTrainedModel`` (``save_pretrained``)."""
        wrapper = self.model
        if not isinstance(wrapper, ORTModule):
            return super()._save(output_dir, state_dict)
        self.model = wrapper.module
        try:
            return super()._save(output_dir, state_dict)
        finally:
            self.model = wrapper
