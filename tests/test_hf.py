"""Hugging Face: ORTModule shows the wrapped forward's signature (the Trainer keeps the columns the
model takes), ``ortlab.hf.ORTTrainer`` trains and saves a folder ``from_pretrained`` loads, and a
re-capture names the guard that failed, its fallbacks listed once."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import pytest
import torch

import ortlab

transformers = pytest.importorskip("transformers")


def _gpt2(dropout: float = 0.0):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(cfg)


def test_forward_signature_is_the_wrapped_models():
    model = _gpt2()
    om = ortlab.ORTModule(model)
    assert inspect.signature(om.forward) == inspect.signature(model.forward)
    assert "input_ids" in inspect.signature(om.forward).parameters
    assert om.forward.__doc__ == model.forward.__doc__


class _Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        # "source" is a column the model does not take: the Trainer must drop it (its default).
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": "web"}


def _train(trainer_class, model, out: str) -> tuple[list[float], object]:
    args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=3, report_to=[],
                                          logging_steps=1, use_cpu=True, save_strategy="no", seed=0)
    trainer = trainer_class(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_trainer_with_default_columns_trains_like_eager_and_saves_a_loadable_folder(tmp_path):
    pytest.importorskip("accelerate")
    from ortlab.hf import ORTTrainer

    torch.manual_seed(0)
    eager_model = _gpt2()
    state = {k: v.clone() for k, v in eager_model.state_dict().items()}
    eager_losses, _ = _train(transformers.Trainer, eager_model, str(tmp_path / "eager"))
    model = _gpt2()
    model.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, trainer = _train(ORTTrainer, model, str(tmp_path / "ort"))
    assert isinstance(trainer.model, ortlab.ORTModule)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "config.json").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for (name, a), b in zip(loaded.state_dict().items(), trainer.model.module.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_recapture_names_the_guard_and_lists_each_fallback_once():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100)
    om = ortlab.ORTModule(transformers.BertForSequenceClassification(cfg))
    ids, labels = torch.randint(0, 100, (2, 8)), torch.tensor([0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # HF sets config.problem_type on the first call: the second captures again
            om(input_ids=ids, labels=labels).loss.backward()
    first, again = om.report.captures
    assert first.recapture == ""
    assert "problem_type" in again.recapture
    assert "captured again because a guard of an earlier capture failed: " in str(om.report)
    dropouts = [f for f in om.report.fallbacks if f.op and "dropout" in f.op]
    assert len(dropouts) == len({(f.node, f.module) for f in dropouts}) > 0


def test_export_onnx_of_a_decoder_with_its_cache_on_and_dynamic_batch_and_sequence(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = _gpt2()
    assert model.config.use_cache
    om = ortlab.ORTModule(model)
    ids = torch.randint(0, 300, (2, 8))
    path = om.export_onnx(str(tmp_path / "gpt2.onnx"), kwargs={"input_ids": ids})
    assert model.config.use_cache, "restored after the export"
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["logits"]  # ModelOutput's key, not torch.onnx's "linear"
    other = torch.randint(0, 300, (3, 5))  # another batch and sequence length
    (logits,) = sess.run(None, {"input_ids": other.numpy()})
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(input_ids=other).logits, rtol=1e-4, atol=1e-5)


def test_a_causal_lm_with_labels_is_one_graph():
    """Note [Once-only log calls inside captured code]: transformers' ``logger.warning_once`` in
    GPT2LMHeadModel's loss_function no longer cuts the LM head off its loss; losses and gradients
    equal eager's."""
    torch.manual_seed(0)
    eager = _gpt2()
    model = _gpt2()
    model.load_state_dict(eager.state_dict())
    om = ortlab.ORTModule(model)
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, ::2] = -100  # half of the labels ignored, as padding or a prompt would be
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            expected = eager(input_ids=ids, labels=labels).loss
            expected.backward()
            loss = om(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
            for (name, p), q in zip(eager.named_parameters(), model.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
                p.grad = q.grad = None
    report = str(om.report)
    assert len(om.report.captures) == 1 and "graph breaks: none" in report, report
    assert not [f for f in om.report.fallbacks if "logging" in f.reason], om.report.fallbacks


@pytest.mark.parametrize("num_items", [False, True])
def test_a_causal_lm_skips_the_ignored_labels(monkeypatch, num_items):
    """Label sparsity on transformers' ForCausalLMLoss (shifted labels padded with -100, logits
    returned beside the loss; with ``num_items_in_batch``, as the Trainer passes it, a summed loss
    divided by it): losses, logits and gradients equal eager's, also on a batch whose labels are all
    ignored (no row kept: a NaN loss from the mean, 0 from the sum, as eager's)."""
    from ortlab.capture import sparsity

    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)  # this model's head is small, for speed
    torch.manual_seed(0)
    eager = _gpt2()
    model = _gpt2()
    model.load_state_dict(eager.state_dict())
    om = ortlab.ORTModule(model)
    g = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for share in (0.5, 1.0, 0.25):
            ids = torch.randint(0, 300, (4, 12), generator=g)
            labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < share, -100)
            kwargs = dict(input_ids=ids, labels=labels)
            if num_items:
                kwargs["num_items_in_batch"] = (labels[:, 1:] != -100).sum()
            expected, out = eager(**kwargs), om(**kwargs)
            expected.loss.backward()
            out.loss.backward()
            torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-5, equal_nan=share == 1.0)
            torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
            for (name, p), q in zip(eager.named_parameters(), model.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name, equal_nan=share == 1.0)
                p.grad = q.grad = None
    record = om.report.captures[0].sparsity
    assert record is not None and record.applied, om.report
    # Hugging Face pads the shifted labels with one ignored label per sequence.
    assert record.dropped == int((labels[:, 1:] == -100).sum()) + 4
    assert not om.report.fallbacks, om.report.fallbacks


def test_a_masked_lm_skips_the_unmasked_tokens(monkeypatch):
    """BertForMaskedLM: labels are -100 on the ~85% of tokens not masked, the decoder has a bias,
    the logits are returned: losses, logits and gradients equal eager's, the rows dropped counted."""
    from ortlab.capture import sparsity

    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)  # this model's head is small, for speed
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  max_position_embeddings=64)
    om, labels = _trains_like_eager(transformers.BertForMaskedLM, cfg, ignored=0.85)
    record = om.report.captures[0].sparsity
    assert record.applied and record.module.endswith("decoder"), record
    assert record.dropped == int((labels == -100).sum())
    assert not om.report.fallbacks, om.report.fallbacks


def _trains_like_eager(model_class: type, cfg: object, ignored: float,
                       prepare: Callable[[torch.nn.Module], None] | None = None) -> tuple[ortlab.ORTModule, torch.Tensor]:
    """``model_class(cfg)`` under ORTModule beside an eager copy, on two batches with a share ``ignored``
    of labels -100: losses, logits and gradients equal eager's. ``prepare`` changes the eager model
    before its state is copied. Returns the ORTModule and the last labels."""
    torch.manual_seed(0)
    eager, model = model_class(cfg), model_class(cfg)
    if prepare is not None:
        prepare(eager)
    model.load_state_dict(eager.state_dict())
    om = ortlab.ORTModule(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(5, cfg.vocab_size, (2, 16), generator=g)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < ignored, -100)
        expected, out = eager(input_ids=ids, labels=labels), om(input_ids=ids, labels=labels)
        expected.loss.backward()
        out.loss.backward()
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            if p.grad is None:
                assert q.grad is None, name
                continue
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
            p.grad = q.grad = None
    return om, labels


def test_a_causal_lm_returning_contiguous_logits_skips_the_ignored_labels(monkeypatch):
    """OPTForCausalLM returns ``lm_head(h).contiguous()`` and computes the loss from that copy:
    label sparsity still applies, with eager's losses, logits and gradients."""
    from ortlab.capture import sparsity

    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)  # this model's head is small, for speed
    cfg = transformers.OPTConfig(num_hidden_layers=1, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                                 word_embed_proj_dim=64, max_position_embeddings=64, vocab_size=500, dropout=0.0)
    om, labels = _trains_like_eager(transformers.OPTForCausalLM, cfg, ignored=0.5)
    record = om.report.captures[0].sparsity
    assert record.applied and record.module.endswith("lm_head"), record
    # Hugging Face pads the shifted labels with one ignored label per sequence.
    assert record.dropped == int((labels[:, 1:] == -100).sum()) + 2
    assert not om.report.fallbacks, om.report.fallbacks


def test_a_seq2seq_lm_adding_a_bias_after_its_head_skips_the_ignored_labels(monkeypatch):
    """BartForConditionalGeneration adds ``final_logits_bias`` to ``lm_head``'s output: label sparsity
    folds it into the head, with eager's losses, logits and gradients (the bias made non-zero)."""
    from ortlab.capture import sparsity

    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)  # this model's head is small, for speed
    cfg = transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=32, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
                                  vocab_size=300, max_position_embeddings=64, dropout=0.0)

    def random_bias(model: torch.nn.Module) -> None:
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape))

    om, labels = _trains_like_eager(transformers.BartForConditionalGeneration, cfg, ignored=0.5,
                                    prepare=random_bias)
    record = om.report.captures[0].sparsity
    assert record.applied and record.module.endswith("lm_head") and "folded" in record.reason, record
    assert record.dropped == int((labels == -100).sum())
    assert not om.report.fallbacks, om.report.fallbacks
