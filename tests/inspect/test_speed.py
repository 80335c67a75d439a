"""compare_speed: where a step is slower through ortlab than in eager PyTorch, per module and line of code.

A model with one heavy submodule (most of the step's FLOPs, forward and backward) is the
ground truth for the attribution: both sides must put most of their time there, with its
backward counted. The verdict and every comparison follow the one noise rule; keyword
inputs are taken as Hugging Face users pass them; the model given is left untouched.
"""

from __future__ import annotations

import torch
from torch import nn

import ortlab
from ortlab.inspect.speed import OPTIMIZER, OTHER, SpeedRow, compare_speed
from ortlab.inspect.timing import Timing
from ortlab.models import GPT, GPTConfig, make_batch


class Heavy(nn.Module):
    """A light embedding and head around one heavy MLP: the heavy part is ~95% of the FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.light = nn.Linear(32, 32)
        self.heavy = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                   nn.Linear(1024, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.light(x)
        h = self.heavy(h)
        return nn.functional.cross_entropy(self.head(h), y)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g)


def test_the_heavy_module_takes_most_time_on_both_sides_forward_and_backward():
    torch.manual_seed(0)
    model = Heavy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = compare_speed(model, *_inputs(), steps=5, profile_steps=3)
    # the model given is untouched: same weights, no gradients
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    by_module = {r.module: r for r in result.modules(depth=1)}
    heavy, light = by_module["heavy"], by_module["light"]
    for side in ("eager_ms", "ortlab_ms"):
        attributed = sum(getattr(r, side) for r in result.rows if not r.module.startswith("("))
        assert getattr(heavy, side) > 0.7 * attributed, (side, result)
        assert getattr(heavy, side) > 5 * getattr(light, side), (side, result)
    # eager's backward nodes are counted where their forward call was
    heavy_ops = [o for r in result.rows if r.module.startswith("heavy") for o in r.aten_ops]
    assert any(o.endswith("Backward0") for o in heavy_ops), heavy_ops
    # ortlab's rows name onnxruntime kernels and link their slowest node
    heavy_rows = [r for r in result.rows if r.module.startswith("heavy") and r.ortlab_ms > 0]
    assert heavy_rows and all(r.kernels and r.node.get("node") for r in heavy_rows), heavy_rows
    # each row's source is the line of model code that called it
    assert any(r.source.endswith("in forward") and "test_speed.py" in r.source for r in heavy_rows), heavy_rows


def test_rows_totals_and_text():
    torch.manual_seed(0)
    config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=2, block_size=16)
    idx, targets = make_batch("gpt", 4, vocab=config.vocab, block_size=config.block_size)
    om = ortlab.ORTModule(GPT(config), recompute="none")
    result = compare_speed(om, idx, targets, steps=4, profile_steps=2)
    assert result.ortmodule.options.recompute == "none"  # an ORTModule's options carry over
    assert result.steps == 4 and len(result.eager.samples) == 4 and len(result.ortlab.samples) == 4
    names = [r.module for r in result.rows]
    assert OPTIMIZER in names and OTHER in names
    lost = [r.lost_ms for r in result.rows]
    assert lost == sorted(lost, reverse=True), "most time lost first"
    modules = {name for name, _ in om.module.named_modules()}
    assert all(r.module in modules or r.module.startswith("(") for r in result.rows), names
    text = str(result)
    assert text.startswith("compare_speed: eager ") and "ortlab" in text.splitlines()[0]
    assert "within noise: the two spreads overlap" in text and "profiling made the steps slower" in text
    assert set(result.overhead) == {"eager", "ortlab"}
    assert result.speedup > 0


def test_keyword_inputs_as_hugging_face_users_pass_them():
    class KeywordModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.out = nn.Linear(16, 50)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            logits = self.out(self.emb(input_ids))
            return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}

    ids = torch.randint(0, 50, (2, 8))
    result = ortlab.compare_speed(KeywordModel(), input_ids=ids, labels=ids, steps=3, profile_steps=1)
    assert {"emb", "out"} <= {r.module for r in result.rows}


def test_the_noise_rule():
    a = Timing((0.010, 0.011, 0.012))
    row = SpeedRow("m", "", a, Timing((0.0115, 0.013, 0.014)))
    assert row.within_noise and abs(row.lost_ms - 2.0) < 1e-9
    row = SpeedRow("m", "", a, Timing((0.020, 0.021, 0.022)))
    assert not row.within_noise and abs(row.ratio - 0.011 / 0.021) < 1e-12
    assert SpeedRow("m", "", a, Timing((0.0, 0.0, 0.0))).ratio == float("inf")


def test_the_notebook_view_links_rows_and_draws_the_chart():
    torch.manual_seed(0)
    result = compare_speed(Heavy(), *_inputs(), steps=3, profile_steps=1)
    from ortlab.ui.speed_view import speed_figure, speed_html

    html = speed_html(result)
    assert "compare_speed:" in html and "<table" in html and "heavy" in html
    assert "href=" in html and "<iframe" in html, "rows link to their node in a netron view under the table"
    fig = speed_figure(result)
    bars = fig.data[0]
    assert len(bars.x) == len(bars.y) >= 3 and "heavy.2" in bars.y
    assert all(c in ("#c0392b", "#2e7d32", "#9aa0a6") for c in bars.marker.color)


def test_ops_in_pytorch_and_code_after_a_graph_break_join_eagers_rows():
    """An op placed in PyTorch at two nodes goes to each node's module (the k-th call is the k-th node); code after
    a graph break keeps its function's name (Dynamo's ``torch_dynamo_resume_in_forward_at_<line>`` is not shown)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=2, block_size=16)
    idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
    result = compare_speed(GPT(config), idx, targets, steps=3, profile_steps=1, fallback_ops=["aten.gelu"])
    in_pytorch = {r.module for r in result.rows if "aten::gelu (in PyTorch)" in r.kernels}
    assert in_pytorch == {"blocks.0", "blocks.1"}, in_pytorch
    # each of those rows is also eager's row of that line (the keys join)
    assert all(r.eager_ms > 0 for r in result.rows if "aten::gelu (in PyTorch)" in r.kernels)

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(torch.relu(h)).sum()

    result = compare_speed(Broken(), torch.randn(8, 16), steps=3, profile_steps=1)
    assert not any("torch_dynamo_resume" in r.source for r in result.rows), [r.label for r in result.rows]
    b = next(r for r in result.rows if r.module == "b")
    assert b.eager_ms > 0 and b.ortlab_ms > 0 and b.source.endswith("in forward"), b


def test_a_label_sparsity_tail_is_the_heads_row_not_ortlabs():
    """Note [A tail carries its head's provenance]: the LM head and loss that label sparsity runs in a graph of
    ortlab's own are reported at the user's head module and lines, so the head's row joins eager's."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=4096, d_model=256, n_heads=2, n_layers=1, block_size=8)  # a head of 1M weights: cut
    idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
    targets[:, :3] = -100
    result = compare_speed(GPT(config), idx, targets, steps=3, profile_steps=1, warmup=1)
    records = [c.sparsity for c in result.ortmodule.report.captures if c.sparsity is not None]
    assert records and records[0].applied, records
    assert not [r for r in result.rows if "sparsity.py" in r.source], \
        [(r.module, r.source) for r in result.rows]
    head = [r for r in result.rows if r.module == "head"]
    assert head and head[0].ortlab_ms > 0 and head[0].eager_ms > 0, [(r.module, r.source) for r in result.rows]
