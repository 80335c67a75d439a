"""compare, bisect_fallbacks and explore on Hugging Face decoders as their users call them: keyword inputs, and
a DynamicCache among the outputs compared by its tensors (issue 43, items 10 and 11)."""

from __future__ import annotations

import pytest
import torch

import ortlab
from ortlab.errors import ConfigError

transformers = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)


def _decoder(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind](**SMALL)
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    return model_class(config)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2"])
def test_compare_of_a_decoder_with_its_cache_matches_by_keywords(kind):
    model = _decoder(kind).eval()
    ids = torch.randint(0, 300, (2, 12))
    result = ortlab.compare(model, input_ids=ids, labels=ids, intermediates=False)
    assert result.matches, result
    cache = [c for c in result.outputs if "cache" in c.name or "past_key_values" in c.name]
    assert cache and all(c.ok and c.stats is not None for c in cache), [str(c) for c in result.outputs]
    assert any("compared by the" in note for note in result.notes), result.notes


def test_keywords_that_are_options_and_clashes():
    model = _decoder("qwen2").eval()
    ids = torch.randint(0, 300, (2, 8))
    result = ortlab.compare(model, input_ids=ids, labels=ids, intermediates=False, fallback_ops=["aten.mm"])
    assert result.options["fallback_ops"] == ["aten.mm"]
    assert any("aten.mm" in note for note in result.notes), result.notes

    class Odd(torch.nn.Module):
        def forward(self, x, recompute=None):  # noqa: ANN001, ANN202 (a parameter named like an option)
            return x * 2

    with pytest.raises(ConfigError, match="both an ORTModule option and a parameter"):
        ortlab.compare(Odd(), torch.ones(2), recompute="auto")
    with pytest.raises(ConfigError, match="neither a parameter"):
        ortlab.compare(Odd(), torch.ones(2), colour="red")
    ok = ortlab.compare(Odd(), torch.ones(2, requires_grad=True), forward_kwargs={"recompute": 1}, intermediates=False)
    assert ok.matches


def test_explore_takes_keyword_inputs():
    model = _decoder("qwen2")
    ids = torch.randint(0, 300, (2, 8))
    lab = ortlab.explore(model, input_ids=ids, labels=ids)
    try:
        step = lab.run("step")
        assert step.status == "done", step.error
        assert any(text.startswith("input_ids=") for text in lab.meta["inputs"]), lab.meta["inputs"]
        assert "loss" in step.summary, step.summary
    finally:
        lab.close()


def test_bisect_of_a_matching_decoder_finds_nothing_to_bisect():
    """Its premise was a cache compared as an object: 'still diverges with all 55 candidate ops in PyTorch'."""
    model = _decoder("qwen2").eval()
    ids = torch.randint(0, 300, (2, 8))
    found = ortlab.bisect_fallbacks(model, input_ids=ids, labels=ids)
    assert found.found and found.ops == [] and "nothing to bisect" in found.reason, found.reason
