"""Label sparsity (Note [Label sparsity] in ``ortlab.capture.sparsity``): the LM head and the
loss computed only for labels that count, with eager's loss and gradients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab
from ortlab.capture import sparsity
from ortlab.models import GPT, GPTConfig

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _cut_small_heads(monkeypatch):
    """These models' heads are small, for speed; cut them anyway (the size rule has its own test)."""
    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 0)


def _labels(g: torch.Generator, shape: tuple[int, ...], vocab: int, ignored: float) -> torch.Tensor:
    t = torch.randint(0, vocab, shape, generator=g)
    return t.masked_fill(torch.rand(shape, generator=g) < ignored, -100)


def _train_beside_eager(model: nn.Module, batches: list[tuple], **options: object) -> ortlab.ORTModule:
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model, **options)
    for batch in batches:
        lo, le = ort(*batch), eager(*batch)
        torch.testing.assert_close(lo, le, rtol=RTOL, atol=ATOL)
        lo.backward()
        le.backward()
        _same_grads(model, eager)
    return ort


def _same_grads(model: nn.Module, eager: nn.Module, **tolerance: float) -> None:
    """The gradients of ``model`` equal ``eager``'s (float32 tolerances by default); both cleared."""
    tolerance = tolerance or dict(rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad.dtype == q.grad.dtype, name
        torch.testing.assert_close(p.grad, q.grad, msg=name, **tolerance)
        p.grad, q.grad = None, None


def _sparsity(ort: ortlab.ORTModule):
    return ort.report.captures[0].sparsity


def test_gpt_drops_the_ignored_rows_with_eagers_loss_and_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, vocab=500, d_model=64, n_heads=4, block_size=16)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 500, (3, 16), generator=g), _labels(g, (3, 16), 500, p)) for p in (0.5, 0.3, 0.8)]
    ort = _train_beside_eager(GPT(cfg), batches)
    record = _sparsity(ort)
    assert record.applied and record.module == "head"
    ignored = [int((t == -100).sum()) for _, t in batches]
    assert (record.steps, record.rows, record.dropped) == (3, 48, ignored[-1])
    assert record.total_dropped == sum(ignored)
    assert "label sparsity: on (head" in str(ort.report)
    # The tail is one more graph, compiled once with a symbolic row count: a new number of kept rows
    # re-captures nothing, and the tail runs in onnxruntime.
    main, tail = ort.report.captures
    assert "label sparsity" in tail.purpose and main.purpose == ""
    assert all(g.ort_partitions == 1 and g.torch_nodes == 0 for g in tail.graphs)
    assert not ort.report.fallbacks
    # The loss's gradient is exp, a scatter-add of -1 and a multiply (Note [The vocabulary-wide loss
    # gradient in three passes]), not log_softmax's and nll_loss's seven passes (zeros, scatter, ..., Sub).
    backward = next(g for g in tail.graphs if g.name == "backward")
    ops = backward.onnx_ops
    assert "Sub" not in ops, ops
    assert (ops.get("Exp"), ops.get("ScatterElements"), ops.get("Mul")) == (1, 1, 1), ops
    # the scatter adds onto the exp's copy, not onto vocabulary-wide zeros (the one ConstantOfShape left is the
    # column of ones the integer count of kept labels is summed with: Note [Integer arithmetic stays integer])
    nodes = [n for p in backward.parts if p.exported is not None for n in p.exported.model.graph]
    scatter = next(n for n in nodes if n.op_type == "ScatterElements")
    assert scatter.inputs[0].producer().op_type == "Exp"
    assert ops.get("ConstantOfShape", 0) <= 1, ops


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_losss_gradient_is_cross_entropys(reduction):
    """``_CrossEntropy`` gives ``F.cross_entropy``'s loss and gradient, ignored labels included
    (float64, so that only the formula is compared)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 37, generator=g, dtype=torch.float64) * 4
    labels = _labels(g, (12,), 37, 0.4)
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = sparsity._CrossEntropy.apply(mine, labels, -100, reduction)
    expected = F.cross_entropy(theirs, labels, ignore_index=-100, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    (loss * 3).backward()
    (expected * 3).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert mine.grad[labels == -100].abs().sum() == 0


def test_off_by_option():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=1, vocab=100, d_model=32, n_heads=2, block_size=8)
    g = torch.Generator().manual_seed(2)
    ort = _train_beside_eager(GPT(cfg), [(torch.randint(0, 100, (2, 8), generator=g),
                                          _labels(g, (2, 8), 100, 0.5))], label_sparsity=False)
    assert _sparsity(ort) is None and len(ort.report.captures) == 1


class _HFStyleHead(nn.Module):
    """A Hugging Face-style loss: logits upcast with ``.float()``, flattened with ``view``, summed and divided."""

    def __init__(self, reduction: str = "sum", smoothing: float = 0.0, return_logits: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16))
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.reduction, self.smoothing, self.return_logits = reduction, smoothing, return_logits

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        logits = self.lm_head(self.body(ids))
        loss = F.cross_entropy(logits.float().view(-1, 50), labels.view(-1), reduction=self.reduction,
                               label_smoothing=self.smoothing)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("reduction,smoothing", [("sum", 0.0), ("mean", 0.1)])
def test_upcast_view_sum_and_label_smoothing(reduction, smoothing):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, 0.4)) for _ in range(2)]
    ort = _train_beside_eager(_HFStyleHead(reduction, smoothing), batches)
    assert _sparsity(ort).applied


@pytest.mark.parametrize("use_logits", [False, True])
def test_returned_logits_are_every_row_and_the_loss_is_cut(use_logits):
    """Hugging Face models return the logits beside the loss: the head runs on every row for them,
    the loss and the head's gradient on the kept rows; a loss that also uses the returned logits
    gets their gradient too."""
    torch.manual_seed(0)
    model = _HFStyleHead(return_logits=True)
    g = torch.Generator().manual_seed(4)
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model)
    for p in (0.4, 0.7):
        ids, labels = torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, p)
        (lo, logits_o), (le, logits_e) = ort(ids, labels), eager(ids, labels)
        torch.testing.assert_close(lo, le, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(logits_o, logits_e, rtol=RTOL, atol=ATOL)
        if use_logits:
            lo, le = lo + logits_o.square().mean(), le + logits_e.square().mean()
        lo.backward()
        le.backward()
        _same_grads(model, eager)
    record = _sparsity(ort)
    assert record.applied and "returned logits" in record.reason, record
    assert record.steps == 2 and record.dropped == int((labels == -100).sum())
    purposes = [c.purpose for c in ort.report.captures]
    assert any("for the logits it returns" in p for p in purposes) and any("on the kept rows" in p for p in purposes)
    assert not ort.report.fallbacks


class _ScaledLoss(nn.Module):
    """Hugging Face's loss with ``num_items_in_batch``: a summed loss divided by a tensor, then by 2."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16))
        self.lm_head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, items: torch.Tensor):
        logits = self.lm_head(self.body(ids))
        loss = F.cross_entropy(logits.view(-1, 50), labels.view(-1), reduction="sum")
        return loss / items.to(loss.device) / 2, logits


def test_a_scaled_loss_is_scaled_after_the_cut():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        labels = _labels(g, (2, 7), 50, 0.5)
        batches.append((torch.randint(0, 50, (2, 7), generator=g), labels, (labels != -100).sum()))
    model = _ScaledLoss()
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model)
    for batch in batches:
        (lo, _), (le, _) = ort(*batch), eager(*batch)
        torch.testing.assert_close(lo, le, rtol=RTOL, atol=ATOL)
        lo.backward()
        le.backward()
        _same_grads(model, eager)
    assert _sparsity(ort).applied


def test_logits_used_inside_the_graph_keep_every_row_and_say_why():
    class Extra(_HFStyleHead):
        def forward(self, ids, labels):
            logits = self.lm_head(self.body(ids))
            return F.cross_entropy(logits.view(-1, 50), labels.view(-1)) * logits.detach().mean()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(8)
    ort = _train_beside_eager(Extra(), [(torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, 0.4))])
    record = _sparsity(ort)
    assert not record.applied and "every row is needed" in record.reason
    assert "label sparsity: not applied" in str(ort.report)


def test_every_label_ignored_gives_eagers_nan_and_zero_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=1, vocab=100, d_model=32, n_heads=2, block_size=8)
    model = GPT(cfg)
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model, label_sparsity=True)
    ids, labels = torch.randint(0, 100, (2, 8)), torch.full((2, 8), -100)
    lo, le = ort(ids, labels), eager(ids, labels)
    assert math.isnan(lo.item()) and math.isnan(le.item())  # mean over no labels, as in eager
    assert _sparsity(ort).dropped == 16
    # With reduction="sum" the loss is a finite 0 and every gradient is eager's (zero for the head).
    ids = torch.randint(0, 50, (2, 7))
    ort = _train_beside_eager(_HFStyleHead("sum"), [(ids, torch.full((2, 7), -100))])
    assert _sparsity(ort).dropped == 14


def test_eval_without_grad_uses_the_kept_rows_too():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=1, vocab=100, d_model=32, n_heads=2, block_size=8)
    model = GPT(cfg).eval()
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 100, (2, 8), generator=g), _labels(g, (2, 8), 100, 0.5)
    with torch.no_grad():
        torch.testing.assert_close(ort(ids, labels), eager(ids, labels), rtol=RTOL, atol=ATOL)
    assert _sparsity(ort).applied and _sparsity(ort).steps == 1


def test_a_small_head_is_not_cut(monkeypatch):
    monkeypatch.setattr(sparsity, "MIN_HEAD_WEIGHTS", 1 << 20)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    ort = _train_beside_eager(_HFStyleHead(), [(torch.randint(0, 50, (2, 7), generator=g),
                                                _labels(g, (2, 7), 50, 0.4))])
    assert _sparsity(ort) is None and len(ort.report.captures) == 1
    assert "label sparsity" not in str(ort.report)


@pytest.mark.parametrize("return_logits", [False, True])
def test_bfloat16_autocast(return_logits):
    """Under autocast the head computes bfloat16 logits from float32 rows and weight: the kept rows'
    gradient is computed in bfloat16 and given back in float32, as autocast's linear does."""
    torch.manual_seed(0)
    model = _HFStyleHead("mean", return_logits=return_logits)
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model)
    g = torch.Generator().manual_seed(9)
    ids, labels = torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lo, le = ort(ids, labels), eager(ids, labels)
    if return_logits:
        (lo, logits_o), (le, logits_e) = lo, le
        assert logits_o.dtype == logits_e.dtype == torch.bfloat16
    torch.testing.assert_close(lo, le, rtol=1e-3, atol=1e-4)
    lo.backward()
    le.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    _same_grads(model, eager, rtol=1e-2, atol=1e-4)
    assert _sparsity(ort).applied


class _BiasAfterHead(nn.Module):
    """BART's head: ``lm_head(h) + bias`` with one bias per class (a buffer in BART, here a buffer or a
    learned parameter, beside the head's own bias), the logits returned or not."""

    def __init__(self, learned: bool, return_logits: bool, shape: tuple[int, ...] = (1, 50)) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16))
        self.lm_head = nn.Linear(16, 50, bias=learned)
        extra = torch.randn(shape)
        if learned:
            self.final_bias = nn.Parameter(extra)
        else:
            self.register_buffer("final_bias", extra)
        self.return_logits = return_logits

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        logits = self.lm_head(self.body(ids))
        logits = logits + self.final_bias.to(logits.device)
        loss = F.cross_entropy(logits.view(-1, 50), labels.view(-1))
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("learned", [False, True], ids=["buffer", "parameter"])
@pytest.mark.parametrize("return_logits", [False, True], ids=["loss", "loss-and-logits"])
def test_a_bias_added_after_the_head_is_folded_into_it(learned, return_logits):
    """BART adds ``final_logits_bias`` to the head's output: the cut runs the head with that bias
    folded into its own, with eager's loss, logits and gradients (the added bias's too when learned)."""
    torch.manual_seed(0)
    model = _BiasAfterHead(learned, return_logits)
    eager = copy.deepcopy(model)
    ort = ortlab.ORTModule(model)
    g = torch.Generator().manual_seed(10)
    for p in (0.5, 0.7):
        ids, labels = torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, p)
        out_o, out_e = ort(ids, labels), eager(ids, labels)
        if return_logits:
            (out_o, logits_o), (out_e, logits_e) = out_o, out_e
            torch.testing.assert_close(logits_o, logits_e, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out_o, out_e, rtol=RTOL, atol=ATOL)
        out_o.backward()
        out_e.backward()
        _same_grads(model, eager)
    record = _sparsity(ort)
    assert record.applied and "folded into the head's bias" in record.reason, record
    assert record.dropped == int((labels == -100).sum())
    assert not ort.report.fallbacks


@pytest.mark.parametrize("shape,dtype,why", [((7, 1), torch.float32, "not one number per class"),
                                             ((50,), torch.float64, "changes the logits' dtype")])
def test_a_bias_that_differs_by_row_or_changes_the_dtype_keeps_every_row(shape, dtype, why):
    torch.manual_seed(0)
    model = _BiasAfterHead(False, False, shape)
    model.final_bias = model.final_bias.to(dtype)  # float32 logits + a float64 bias: float64 logits
    g = torch.Generator().manual_seed(11)
    ids, labels = torch.randint(0, 50, (2, 7), generator=g), _labels(g, (2, 7), 50, 0.5)
    ort = _train_beside_eager(model, [(ids, labels)])
    record = _sparsity(ort)
    assert not record.applied and why in record.reason, record
