"""Embedding sparsity (Note [Embedding sparsity] in ``ortlab.capture.padding``): the row-wise
layers run on the tokens that are not padding, with eager's loss and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_sparsity import _train_beside_eager  # conftest puts tests/ on sys.path

class Pooled(nn.Module):
    """Token embedding with a padding_idx, a learned position table, an RMS norm, an MLP and a masked mean."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(8, 16))
        self.norm = nn.Parameter(torch.ones(16))
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        h = self.down(F.gelu(self.up(h))) + h
        m = (ids != 0).unsqueeze(-1).float()
        return F.mse_loss((h * m).sum(1) / m.sum(1), y)


def _padded_ids(g: torch.Generator, lengths: list[int], seq: int, vocab: int) -> torch.Tensor:
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g)
    return ids.masked_fill(torch.arange(seq)[None] >= torch.tensor(lengths)[:, None], 0)


def test_row_wise_layers_run_on_the_tokens_that_are_not_padding_with_eagers_loss_and_gradients():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    lengths = [[8, 5, 3], [6, 6, 2], [8, 1, 4]]
    batches = [(_padded_ids(g, n, 8, 50), torch.randn(3, 16, generator=g)) for n in lengths]
    ort = _train_beside_eager(Pooled(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert record.applied and record.module == "emb", record
    assert record.packed_ops >= 8  # the position add, the norm's steps, both linear layers, gelu, the residual
    dropped = [24 - sum(n) for n in lengths]
    assert (record.steps, record.rows, record.dropped, record.total_dropped) == (3, 24, dropped[-1], sum(dropped))
    assert "embedding sparsity: on (emb" in str(ort.report)
    # One graph on the kept rows, with a symbolic row count: new padding re-captures nothing; all in onnxruntime.
    main, packed = ort.report.captures
    assert "embedding sparsity" in packed.purpose and not main.graphs
    assert all(g.ort_partitions == 1 and g.torch_nodes == 0 for g in packed.graphs)
    assert not ort.report.fallbacks


def test_off_by_default_and_the_report_says_where_it_would_apply():
    g = torch.Generator().manual_seed(1)
    ort = _train_beside_eager(Pooled(), [(_padded_ids(g, [8, 3], 8, 50), torch.randn(2, 16, generator=g))])
    (capture,) = ort.report.captures
    assert not capture.padding.applied and capture.padding.module == "emb"
    assert "embedding sparsity: not applied (emb" in str(ort.report) and "embedding_sparsity=False" in str(ort.report)


def _bert(**config: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=200, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, **config)

    class Classify(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertForSequenceClassification(cfg)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask, labels=labels).loss

    torch.manual_seed(0)
    return Classify()


def _bert_batches(lengths: list[list[int]], with_mask: bool = True) -> list[tuple]:
    g = torch.Generator().manual_seed(2)
    out = []
    for n in lengths:
        ids = _padded_ids(g, n, 16, 200)
        out.append((ids, (ids != 0).long() if with_mask else None, torch.randint(0, 2, (len(n),), generator=g)))
    return out


def test_bert_with_its_attention_mask_skips_padded_tokens():
    ort = _train_beside_eager(_bert(), _bert_batches([[16, 9, 5], [12, 16, 3]]), embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert record.applied and record.module.endswith("word_embeddings"), record
    assert record.total_dropped == (48 - 30) + (48 - 31)


def test_a_model_that_attends_to_its_padding_keeps_every_row():
    """Without an attention mask the padded tokens change the others: the first padded batch's check
    finds it, warns, and the graph runs on every row from then on (eager's results throughout)."""
    batches = _bert_batches([[16, 16, 16], [16, 9, 5], [12, 16, 3]], with_mask=False)
    with pytest.warns(UserWarning, match="embedding sparsity is off .* the padded tokens change the others"):
        ort = _train_beside_eager(_bert(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert not record.applied and "failed the check" in record.reason, record
    assert record.steps == 1  # the batch without padding ran on the kept rows, which were all of them
    assert "embedding sparsity: not applied" in str(ort.report)
    assert any("every row" in c.purpose for c in ort.report.captures)


def test_a_masked_language_model_skips_padded_tokens_and_ignored_labels(monkeypatch):
    """The LM head keeps every row in the graph on packed rows, so label sparsity still cuts it there:
    the encoder runs on the tokens that are not padding, the head and loss on the labelled ones."""
    transformers = pytest.importorskip("transformers")
    from ortlab.capture import sparsity

    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)  # a small head, for speed
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=200, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)

    class MaskedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = transformers.BertForMaskedLM(cfg)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids, attention_mask=mask, labels=labels).loss

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    batches = []
    for lengths in ([16, 9, 5], [12, 7, 3]):
        ids = _padded_ids(g, lengths, 16, 200)
        labels = ids.masked_fill((torch.rand(3, 16, generator=g) < 0.85) | (ids == 0), -100)
        batches.append((ids, (ids != 0).long(), labels))
    ort = _train_beside_eager(MaskedLM(), batches, embedding_sparsity=True)
    main, packed, tail = ort.report.captures
    assert main.padding.applied and main.padding.total_dropped == (48 - 30) + (48 - 22)
    assert packed.sparsity.applied and packed.sparsity.module == "lm.cls.predictions.decoder", packed.sparsity
    assert "label sparsity" in tail.purpose


def test_graphs_compiled_after_the_first_session_survive_a_wrapped_torch_compile(monkeypatch):
    """Lightning replaces torch.compile with a wrapper that deep-copies its keyword arguments (the
    backend, whose report holds onnxruntime sessions by then): ortlab compiles past such wrappers."""
    import functools

    compile_ = torch.compile

    @functools.wraps(compile_)
    def copying(*args, **kwargs):
        return compile_(*args, **copy.deepcopy(kwargs))

    monkeypatch.setattr(torch, "compile", copying)
    g = torch.Generator().manual_seed(1)
    # A new batch size re-captures: its graph on packed rows is compiled when sessions exist.
    batches = [(_padded_ids(g, n, 8, 50), torch.randn(len(n), 16, generator=g)) for n in ([8, 5, 3], [6, 2])]
    ort = _train_beside_eager(Pooled(), batches, embedding_sparsity=True)
    packed = [c for c in ort.report.captures if "embedding sparsity" in c.purpose]
    assert len(packed) == 2 and all(c.padding is None or c.padding.applied for c in ort.report.captures)


class Gated(nn.Module):
    """A first token's state plus a gated mean over every token, padding included (a ReZero-style gate at 0):
    the padded rows reach the loss, though not while the gate is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.zeros(()))
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(self.emb(ids)))
        pooled = h[:, 0] + self.gate * h.mean(1)
        return ((self.head(pooled).squeeze(-1) - y) ** 2).mean()


def _sgd_beside_eager(model: nn.Module, batches: list[tuple], **options: object):
    """Trains ``model`` in ortlab and a copy in eager with SGD, the same batches; their losses and gradients
    equal at every step (float32 tolerances)."""
    import ortlab
    from test_sparsity import RTOL, ATOL, _same_grads

    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model, **options)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for batch in batches:
        lo, le = ort(*batch), eager(*batch)
        torch.testing.assert_close(lo, le, rtol=RTOL, atol=ATOL)
        lo.backward()
        le.backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        opt.step()
        eager_opt.step()
        _same_grads(model, eager)  # clears them
    return ort


def test_a_parameter_at_zero_does_not_hide_padded_rows_that_reach_the_loss():
    """The check is decided on the graph, for every parameter value: a gate initialised to 0 in front of
    an unmasked mean passed a check on values, and the losses drifted from eager's once the gate moved."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(1, 20, (4, 10), generator=g)
        ids[:, 6:] = 0
        batches.append((ids, torch.randn(4, generator=g)))
    with pytest.warns(UserWarning, match=r"embedding sparsity is off .*through \.mean\(\).* the padded tokens "
                                         r"change the others"):
        ort = _sgd_beside_eager(Gated(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert not record.applied and "the first padded batch failed the check" in record.reason, record
    assert "whatever the parameters' values" in record.reason
    assert any("every row" in c.purpose for c in ort.report.captures)


class FirstToken(nn.Module):
    """Row-wise layers, then the first token's state (a classifier's [CLS])."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(self.emb(ids)))
        return ((self.head(h[:, 0]).squeeze(-1) - y) ** 2).mean()


def test_each_padded_batch_is_checked_a_padded_first_token_keeps_every_row():
    """Whether the padded rows are read depends on the batch: right padding leaves the first token,
    read by the loss, a token; a later batch padded on the left does not, and is caught there."""
    g = torch.Generator().manual_seed(0)
    right = _padded_ids(g, [10, 6, 3, 8], 10, 20)
    left = right.flip(1)
    batches = [(right, torch.randn(4, generator=g)), (right, torch.randn(4, generator=g)),
               (left, torch.randn(4, generator=g))]
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"embedding sparsity is off .*through getitem.*reads padded positions"):
        ort = _sgd_beside_eager(FirstToken(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert not record.applied and "the padded batch after 2 step(s) failed the check" in record.reason, record
    assert record.steps == 2 and record.total_dropped == 2 * (40 - 27)


class Attend(nn.Module):
    """One attention layer over a boolean key mask given beside the ids, then a masked mean."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(*ids.shape, 2, 24).transpose(1, 2).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        h = h + self.out(a.transpose(1, 2).reshape(*ids.shape, 16))
        m = mask.unsqueeze(-1).float()
        return F.mse_loss((h * m).sum(1) / m.sum(1), y)


def test_an_attention_mask_that_stops_masking_the_padding_keeps_every_row():
    """The attention mask is an input like the ids: a batch whose mask lets a padded token in (a collator's
    mistake) is caught on that batch, not only on the first."""
    g = torch.Generator().manual_seed(0)
    ids = _padded_ids(g, [8, 5, 2], 8, 30)
    good, bad = (ids != 0).long(), (ids != 0).long()
    bad[1, 6] = 1  # a padded token attended, and counted in the mean
    batches = [(ids, good, torch.randn(3, 16, generator=g)), (ids, bad, torch.randn(3, 16, generator=g))]
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"embedding sparsity is off .*through scaled_dot_product_attention"):
        ort = _sgd_beside_eager(Attend(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert not record.applied and "after 1 step(s)" in record.reason and record.total_dropped == 24 - 15, record


class ManualAttention(nn.Module):
    """Attention written out (scores, an additive -10000 mask, softmax, product) over the mask's keys."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / 4.0
        scores = scores + (1.0 - mask[:, None, :].float()) * -10000.0
        h = h + torch.softmax(scores, dim=-1) @ self.v(h)
        return F.mse_loss(h[:, 0], y)


def test_a_finite_attention_mask_counts_as_masking_and_the_report_says_under_what_assumption():
    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in ([8, 5, 2], [6, 8, 3]):
        ids = _padded_ids(g, lengths, 8, 30)
        batches.append((ids, (ids != 0).long(), torch.randn(3, 16, generator=g)))
    torch.manual_seed(0)
    ort = _sgd_beside_eager(ManualAttention(), batches, embedding_sparsity=True)
    record = ort.report.captures[0].padding
    assert record.applied and record.total_dropped == (24 - 15) + (24 - 17), record
    assert "mask values down to -10000 taken as masking" in record.reason and "by 9896" in record.reason
