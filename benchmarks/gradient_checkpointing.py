"""A RoBERTa masked LM with Hugging Face's gradient checkpointing and dropout on: training steps beside eager.

Note [Checkpointed dropouts drawn ahead] in ortlab/pipeline/random_draws.py: AOTAutograd wraps each checkpointed
dropout in run_and_save_rng_state (forward) and run_with_rng_state (the backward's recomputation); ortlab draws
their masks at the top of each graph, so each graph is one onnxruntime part (before 2026-11-27 the forward ran
whole in PyTorch). Prints the medians of eager's and ortlab's steps (forward and backward), taken in turns in one
process, the same seed before each forward (equal masks, equal losses), and each graph's parts.

    python benchmarks/gradient_checkpointing.py
"""

import torch  # torch first, as users' scripts do
import transformers

from side_by_side import arguments, in_turns, summary, twins  # benchmarks/ is the script's folder


def roberta() -> transformers.RobertaForMaskedLM:
    config = transformers.RobertaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                        num_hidden_layers=4, vocab_size=1000, max_position_embeddings=160)
    model = transformers.RobertaForMaskedLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def main() -> None:
    cli = arguments(__doc__)
    eager, model = twins(roberta)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(0))

    def step(module: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(0)  # the same dropout masks on both sides
        return module(input_ids=ids, labels=ids).loss

    e, o, losses = in_turns(eager, model, step, cli.steps, cli.warmup)
    print(summary(e, o, model, losses))


if __name__ == "__main__":
    main()
