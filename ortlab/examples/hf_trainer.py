"""Train a Hugging Face GPT-2 (small config, random weights) with ``ortlab.hf.ORTTrainer``.

    python -m ortlab.examples.hf_trainer [--steps 20] [--out ortlab_hf_out]

The Trainer keeps its defaults (it drops dataset columns the model does not take, which it
reads from ``forward``'s signature), trains through onnxruntime, and ``save_model`` writes a
folder ``GPT2LMHeadModel.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from ortlab.hf import ORTTrainer


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "text": "a column the model does not take"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="ortlab_hf_out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(args.out, per_device_train_batch_size=8, max_steps=args.steps,
                                              logging_steps=max(1, args.steps // 5), report_to=[], use_cpu=True)
    trainer = ORTTrainer(model=model, args=training, train_dataset=_Tokens(64, 32, 1000))
    trainer.train()
    trainer.save_model(f"{args.out}/final")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(f"{args.out}/final")
    print(trainer.model.report)
    print(f"saved to {args.out}/final and loaded back: {type(loaded).__name__}")


if __name__ == "__main__":
    main()
