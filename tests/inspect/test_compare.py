"""ortlab.inspect: comparing a step with eager PyTorch, finding the diverging node and op, repro scripts.

The planted bug: a wrapper around ``optimize_exported`` makes one ONNX node compute in
low precision (Cast to float16 or bfloat16 and back after it, the low-precision value keeping the FX
node's name), as a kernel that silently loses precision would.
"""

from __future__ import annotations

import html
import math
import os
import re
import subprocess
import sys
import warnings

import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortlab
import ortlab.pipeline.part
from ortlab.inspect import CompareResult, bisect_fallbacks, compare
from ortlab.inspect.compare import compare_tensors
from ortlab.inspect.reduce import minimize
from ortlab.inspect.repro import graph_from_dict, graph_to_dict

RTOL, ATOL = 1e-4, 1e-5


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)  # the planted bug's source line


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.act = Act()
        self.ln = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.mlp = Block()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.mlp(torch.tanh(self.emb(x)))), y)


def make() -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net(), torch.randn(6, 8, generator=g) * 2, torch.randint(0, 4, (6,), generator=g)


def plant_low_precision(exported: object, op: str, module: str, graph: str, dtype: ir.DataType) -> None:
    """Round the output of the ONNX nodes of ``op`` at ``module`` in graph ``graph*`` to ``dtype``."""
    model_graph = exported.model.graph  # type: ignore[attr-defined]
    if not (model_graph.name or "").startswith(graph):
        return
    for node in list(model_graph):
        props = node.metadata_props
        if props.get("ortlab.op") != op or props.get("ortlab.module") != module:
            continue
        fx = props["ortlab.fx_node"]
        out = next((v for v in node.outputs if v.name == fx), None)
        if out is None:
            continue
        uses = list(out.uses())
        outputs = [i for i, v in enumerate(model_graph.outputs) if v is out]
        low = ir.node("Cast", [out], attributes={"to": dtype}, name=f"planted_{fx}_low")
        back = ir.node("Cast", [low.outputs[0]], attributes={"to": ir.DataType.FLOAT}, name=f"planted_{fx}_fp32")
        for user, index in uses:
            user.replace_input_with(index, back.outputs[0])
        for i in outputs:
            model_graph.outputs[i] = back.outputs[0]
        out.name, back.outputs[0].name = f"{fx}_exact", fx
        back.outputs[0].dtype, back.outputs[0].shape = out.dtype, out.shape
        for n in (low, back):
            n.metadata_props.update(props)
        model_graph.insert_after(node, [low, back])


@pytest.fixture
def planted(monkeypatch):
    """``planted(op, module, graph)`` makes that op compute in float16 in every session built afterwards."""

    def plant(op: str, module: str, graph: str = "forward", dtype: ir.DataType = ir.DataType.FLOAT16) -> None:
        original = ortlab.pipeline.part.optimize_exported

        def optimize(exported: object) -> float:
            seconds = original(exported)
            plant_low_precision(exported, op, module, graph, dtype)
            return seconds

        monkeypatch.setattr(ortlab.pipeline.part, "optimize_exported", optimize)

    return plant


def fx_names(result: CompareResult, op: str, module: str, graph: str) -> list[str]:
    return [n.node for n in result.nodes if n.op == op and n.module == module and n.graph == graph]


# ------------------------------------------------------------------------------ comparators
def test_compare_tensors_follows_allclose_and_counts_mismatches():
    e = torch.tensor([1.0, 2.0, 0.0, float("nan")])
    s = compare_tensors(e + torch.tensor([0.0, 1e-3, 1e-6, 0.0]), e, rtol=RTOL, atol=ATOL)
    assert not s.allclose and s.mismatched == 1 and s.numel == 4  # NaN matches NaN, 1e-6 is within atol
    assert s.max_abs == pytest.approx(1e-3, rel=1e-3) and s.max_rel == pytest.approx(5e-4, rel=1e-3)
    assert s.worst_ratio == pytest.approx(1e-3 / (ATOL + RTOL * 2.0), rel=1e-3)
    assert compare_tensors(e, e).allclose and compare_tensors(e, e).max_abs == 0
    assert compare_tensors(torch.tensor([float("nan")]), torch.tensor([1.0])).max_abs == math.inf
    ints = compare_tensors(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]))
    assert not ints.allclose and ints.mismatched == 1
    shape = compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))
    assert not shape.allclose and "shape" in shape.note


def test_minimize_bisects_then_drops_what_is_not_needed():
    seen = []

    def needs_3_and_5(subset):
        seen.append(list(subset))
        return 3 in subset and 5 in subset

    found, trials = minimize(list(range(8)), needs_3_and_5)
    assert found == [3, 5]
    assert len(trials) == len({frozenset(s) for s in seen})  # memoized
    assert minimize(list(range(8)), lambda s: 6 in s, hints=[6])[0] == [6]


def test_graph_round_trip_keeps_node_names():
    from torch.fx.experimental.proxy_tensor import make_fx

    const = torch.randn(4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.layer_norm(x, (4,)) * const).sum(dim=0)

    x = torch.randn(3, 4)
    gm = make_fx(fn)(x)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    again = graph_from_dict(graph_to_dict(gm))
    assert [n.name for n in again.graph.nodes] == [n.name for n in gm.graph.nodes]
    torch.testing.assert_close(again(x), fn(x), rtol=0, atol=0)


def test_the_repro_script_compares_like_compare_tensors():
    from ortlab.inspect._repro_script import error_stats

    e = torch.tensor([1.0, 2.0, 0.0, float("nan"), -3.0])
    cases = [
        (e + torch.tensor([0.0, 1e-3, 1e-6, 0.0, 0.0]), e),
        (e, e),
        (torch.tensor([float("nan")]), torch.tensor([1.0])),
        (torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3])),
        (torch.tensor([1.0, 2.0]), torch.tensor([1, 2])),
        (torch.zeros(2, 3), torch.zeros(3, 2)),
        (torch.zeros(0), torch.zeros(0)),
        (torch.tensor([1 + 1j, 2j]), torch.tensor([1 + 1j, 2.001j])),
    ]
    for actual, expected in cases:
        ours, theirs = error_stats(actual, expected, RTOL, ATOL), compare_tensors(actual, expected, rtol=RTOL, atol=ATOL)
        assert ours == {"max_abs": theirs.max_abs, "max_rel": theirs.max_rel, "mismatched": theirs.mismatched,
                        "numel": theirs.numel, "allclose": theirs.allclose}, (actual, expected)


def test_a_graph_description_names_only_ops_it_may_run():
    """A bundle from elsewhere is plain data, and the graph it describes cannot call arbitrary functions."""
    import operator

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.add.Tensor, (x, x), {"alpha": 2})
    z = graph.call_function(torch.ops.aten.to.dtype, (y, torch.float16))
    graph.output((graph.call_function(operator.getitem, ((z, slice(None, 2), ...), 0)), {"k": y}))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    data = graph_to_dict(gm)
    again = graph_from_dict(data)
    x = torch.randn(3)
    torch.testing.assert_close(again(x)[0], gm(x)[0], rtol=0, atol=0)
    for target in ("posix:system", "builtins:eval", "_operator:attrgetter", "torch:load"):
        evil = {**data, "nodes": [dict(n, target=("py", target)) if n["name"] == "getitem" else n for n in data["nodes"]]}
        with pytest.raises(ortlab.OrtlabError, match="a repro runs only torch ops"):
            graph_from_dict(evil)
    evil = {**data, "nodes": [dict(n, op="call_method", target=("str", "__reduce__")) if n["name"] == "getitem" else n
                              for n in data["nodes"]]}
    with pytest.raises(ortlab.OrtlabError, match="public methods only"):
        graph_from_dict(evil)
    with pytest.raises(ortlab.OrtlabError, match="cannot save a value of type"):
        graph = torch.fx.Graph()
        graph.output(graph.call_function(torch.ops.aten.add.Tensor, (graph.placeholder("x"), {1, 2})))
        graph_to_dict(torch.fx.GraphModule(nn.Module(), graph))


# ------------------------------------------------------------------------------- the step
def test_clean_model_reports_no_divergence():
    model, x, y = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = compare(model, x, y)
    assert result.ok and result.matches and result.first_divergence is None, str(result)
    assert result.loss is not None and result.loss.ok
    assert {c.name for c in result.grads} == {n for n, _ in model.named_parameters()}
    graphs = {n.graph for n in result.nodes}
    assert graphs == {"g0.forward", "g0.backward"}
    assert sum(n.stats is not None for n in result.nodes) > 40
    assert {layer.module for layer in result.layers()} >= {"emb", "mlp.fc", "mlp.act", "mlp.ln", "head"}
    text = str(result)
    assert text.startswith("ortlab.compare: OK") and "first divergence" not in text and "mlp.act" in text
    # Lead with the verdict and the per-layer table: a line per kind of step value, not per gradient.
    assert len(text.splitlines()) <= 8 + len(result.layers()) + len(result.notes), text
    page = result._repr_html_()
    assert "<table>" in page and "#c62828" not in page and "first divergence" not in page and "inf<" not in page
    assert "<details><summary>" in page  # the step's values on demand
    # The user's model is untouched: no grads, same state.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.drop(self.fc(x))))


def test_ops_in_pytorch_are_compared_where_they_enter_onnxruntime():
    torch.manual_seed(0)
    om = ortlab.ORTModule(Dropped(), fallback_ops=["aten.gelu"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ortlab.FallbackWarning)  # warned once per process, maybe already
        result = compare(om, torch.randn(5, 8))  # an ORTModule: its module and options
    assert result.ok, str(result)
    assert result.options["fallback_ops"] == ("aten.gelu",)
    gelu = next(n for n in result.nodes if n.op == "aten.gelu")
    # PyTorch's reference run of the graph drew the same dropout mask as the step did.
    assert gelu.runtime == "pytorch" and gelu.status == "ok" and gelu.stats is not None
    # The dropout's mask is drawn in PyTorch ahead of the graph (Note [Random draws ahead of the graph]):
    # compared where it enters onnxruntime, it is the mask the step drew; its multiplies run in onnxruntime.
    dropout = [n for n in result.nodes if n.module == "drop" and n.graph == "g0.forward"]
    masks = [n for n in dropout if n.op == "dropout_mask"]
    assert len(masks) == 1 and masks[0].runtime == "pytorch" and masks[0].status == "ok"
    assert len(dropout) > 1 and all(n.runtime == "onnxruntime" and n.status == "ok" for n in dropout if n not in masks)
    assert len([p for g in result.graphs if g.name == "forward" for p in g.parts]) == 2


def test_planted_fp16_gelu_is_the_first_divergence(planted):
    planted("aten.gelu", "mlp.act")
    model, x, y = make()
    result = compare(model, x, y)
    assert not result.matches, str(result)
    (gelu,) = fx_names(result, "aten.gelu", "mlp.act", "g0.forward")
    first = result.first_divergence
    assert first is not None, str(result)
    assert (first.graph, first.node, first.op, first.module) == ("g0.forward", gelu, "aten.gelu", "mlp.act")
    assert "test_compare.py" in first.source and "in forward" in first.source
    assert first.stats is not None and first.stats.max_rel > RTOL and first.stats.max_rel < 1e-2  # float16 rounding
    # Everything before it matches; the per-layer table points at the same module.
    before = [n for n in result.nodes if n.graph == "g0.forward" and n.index < first.index and n.stats is not None]
    assert before and all(n.status == "ok" for n in before)
    layer = result.first_divergent_layer
    assert layer is not None and layer.module == "mlp.act" and layer.first is first and layer.worst["forward"] > 1
    worst_forward = {row.module: row.worst["forward"] for row in result.layers()}
    assert worst_forward["emb"] <= 1 and worst_forward["mlp.fc"] <= 1 and worst_forward["mlp.ln"] > 1
    text = str(result)
    assert "DIVERGED" in text and f"first divergence: g0.forward {gelu} (aten.gelu) at mlp.act" in text
    # In a notebook the diverged nodes link to their node in a netron view of the graph that ran.
    import ortlab.ui  # noqa: F401  (registers the notebook views, as ortlab.compare does)

    page = result._repr_html_()
    links = re.findall(r"<a href='([^']+)' target='([^']+)' data-frames='[^']+' title='open in netron'", page)
    # The first link selects the node that made the diverged value (the planted Cast back to float32).
    assert links and f"node=planted_{gelu}_fp32" in html.unescape(links[0][0]), page[:2000]
    frame = links[0][1]
    assert f'<iframe name="{frame}_' in page and all(t == frame for _, t in links)  # a frame of the links' family


def test_planted_backward_bug_is_found_in_the_backward_graph(planted):
    # float16 rounding of this small gradient stays within atol; bfloat16's does not.
    planted("aten.mm", "head", graph="backward", dtype=ir.DataType.BFLOAT16)
    model, x, y = make()
    result = compare(model, x, y)
    first = result.first_divergence
    assert first is not None, str(result)
    assert (first.graph, first.op, first.module) == ("g0.backward", "aten.mm", "head")
    assert not any(n.status == "diverged" for n in result.nodes if n.graph == "g0.forward")
    assert not result.matches
    assert not next(c for c in result.grads if c.name == "mlp.fc.weight").ok


def test_bisect_names_the_op_and_the_repro_reproduces(planted, tmp_path):
    planted("aten.gelu", "mlp.act")
    model, x, y = make()
    said: list[str] = []
    found = bisect_fallbacks(model, x, y, repro_dir=str(tmp_path), progress=said.append)
    assert found.found and found.ops == ["aten.gelu"], str(found)
    # Progress as it runs: the comparison, each trial, the end; the summary is about the op found.
    assert said[0].startswith("comparing one step") and said[-1].startswith("done in"), said
    assert sum(line.startswith("trial ") for line in said) == len(found.trials), said
    assert found.culprit is not None and found.culprit.op == "aten.gelu"
    assert "first divergence: " in str(found) and "(aten.gelu)" in found.culprit_line()
    assert found.candidates[0] == "aten.gelu"
    assert found.trials[-1].ops == ("aten.gelu",) and found.trials[-1].passed
    assert "fallback_ops=['aten.gelu']" in str(found)
    page = found._repr_html_()  # the notebook view: every trial, and the repro script itself
    trials = page.split("step matches eager")[1].split("</table>")[0]
    assert trials.count("<tr style=") == len(found.trials)
    assert "the repro script (" in page and html.escape("def main(") in page and found.repro in page
    assert found.repro == str(tmp_path / "repro.py") and os.path.exists(found.repro)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTLAB_")}
    run = subprocess.run([sys.executable, found.repro], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    gelu = found.baseline.first_divergence.node  # type: ignore[union-attr]
    assert f"node {gelu} (aten.gelu)" in run.stdout and "mlp.act" in run.stdout
    assert "DIVERGES onnxruntime vs PyTorch (same graph" in run.stdout
    assert "DIVERGES onnxruntime vs PyTorch's aten.gelu on onnxruntime's own inputs" in run.stdout
    # Translated again without the planted bug, the same graph matches PyTorch.
    again = subprocess.run([sys.executable, found.repro, "--reexport"], capture_output=True, text=True, env=env,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ok       onnxruntime vs PyTorch" in again.stdout
    # The bundle is plain data: it loads without unpickling code; the model pickle needs an explicit opt-in.
    bundle = torch.load(tmp_path / "bundle.pt", weights_only=True)
    assert bundle["node"] == gelu and set(bundle["model"]) == {"path"}  # the model itself is in model.pt
    assert os.path.exists(tmp_path / "model.pt")
    refused = subprocess.run([sys.executable, found.repro, "--model"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr, refused.stdout + refused.stderr
    assert_imports_only_public_modules(found.repro)


def assert_imports_only_public_modules(path: str) -> None:
    """The repro imports torch, numpy, onnx, onnxruntime, the standard library and ortlab's public API only."""
    import ast

    tree = ast.parse(open(path, encoding="utf-8").read())
    allowed = {"torch", "numpy", "onnx", "onnxruntime", "ortlab"} | set(sys.stdlib_module_names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, ast.unparse(node)
            names = [node.module]
        else:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ortlab":
                assert node.attr in ortlab.__all__, f"ortlab.{node.attr} is not public API"
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in allowed, ast.unparse(node)
            assert top != "ortlab" or name == "ortlab", f"{ast.unparse(node)}: only ortlab's public API"
            assert not any(part.startswith("_") for part in name.split(".")[1:]), f"{ast.unparse(node)}: private"


def test_bisect_on_a_clean_model_has_nothing_to_do():
    model, x, y = make()
    found = bisect_fallbacks(model, x, y)
    assert found.found and found.ops == [] and found.repro is None and not found.trials
    assert "nothing to bisect" in str(found)


def test_fp32_noise_is_judged_against_float64_not_called_divergence():
    """Note [Judged against float64]: with tolerances tighter than fp32 rounding, every value differs, but a
    float64 run of eager shows ortlab's values as exact as eager's: OK, each value saying why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.LayerNorm(256), nn.Linear(256, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compare(model, torch.randn(32, 64), rtol=1e-9, atol=1e-12, intermediates=False)
    assert result.matches and str(result).startswith("ortlab.compare: OK (differences within fp32 noise")
    noisy = [c for c in result.step if c.fp32_noise]
    assert noisy and all(not c.stats.allclose for c in noisy)
    assert "as exact as eager's" in noisy[0].fp32_noise


def test_a_borderline_node_is_named_so_and_a_clear_one_comes_first():
    from ortlab.inspect._results import ErrorStats, NodeComparison

    def node(name: str, ratio: float) -> NodeComparison:
        stats = ErrorStats((4,), "float32", 4, 1, 1e-4, 1e-4, 1e-5, ratio, False)
        return NodeComparison("g0.forward", 0, name, "aten.mm", "fc", "", "diverged", stats)

    borderline, clear = node("mm", 1.01), node("mm_1", 40.0)
    result = CompareResult(RTOL, ATOL, {}, [], None, [], [], nodes=[borderline, clear])
    assert result.first_divergence is clear
    assert result.worst_divergences == [clear, borderline]
    assert "borderline" in borderline.describe() and "borderline" not in clear.describe()
    assert CompareResult(RTOL, ATOL, {}, [], None, [], [], nodes=[borderline]).first_divergence is borderline


def _traced(fn, *example):  # noqa: ANN001, ANN202
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*example)


def test_a_comparison_decided_the_other_way_on_inputs_within_tolerance_says_so():
    """Note [Decided the other way on equal inputs]: a ReLU's gradient mask (``le``) and a max pool's indices
    that differ on inputs agreeing within tolerance, as PyTorch's op decides on onnxruntime's inputs, are the
    model's float32 conditioning, and the node's comparison says so; on inputs beyond the tolerance, or where
    onnxruntime's result is not what PyTorch's op gives on the same inputs (a tie decided otherwise), it says
    nothing more."""
    from ortlab.inspect._record import _decided_on_equal_inputs
    from ortlab.inspect._results import NodeComparison

    def mask_and_indices(x: torch.Tensor):  # noqa: ANN202
        pooled = torch.ops.aten.max_pool2d_with_indices.default(x.view(1, 1, 2, 4), [2, 2], [2, 2])
        return torch.ops.aten.le.Scalar(torch.ops.aten.detach.default(x), 0), pooled[1]

    gm = _traced(mask_and_indices, torch.zeros(8))
    le = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.le.Scalar)
    indices = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"
                   and n.args[1] == 1)
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reference = torch.tensor([0.5, -1e-9, 2.0, 3.0, 0.25, 0.5, 0.25, 4.0])  # the first window ties: 0.5 twice
    close = reference.clone()
    close[1], close[5] = 1e-9, 0.5 + 1e-7  # the mask's sign and the first window's maximum, within rounding
    far = reference.clone()
    far[1], far[5] = 1e-3, 0.6

    class _Env(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            self.seen[n] = super().run_node(n)
            return self.seen[n]

    run = _Env(gm)
    run.seen = {}
    run.run(reference)  # PyTorch's value of every node; onnxruntime keeps none of the aliases (detach, view)

    def values_of(ortlab_x: torch.Tensor):  # noqa: ANN202
        return lambda arg: (ortlab_x if arg is x else None, run.seen[arg])

    for i, node in enumerate((le, indices)):
        for ortlab_x, noted in ((close, True), (far, False)):
            actual = mask_and_indices(ortlab_x)[i]
            assert not torch.equal(actual, mask_and_indices(reference)[i])
            note = _decided_on_equal_inputs(node, actual, 1, values_of(ortlab_x), 1e-4, 1e-5)
            assert note.startswith("decided the other way at 1 element(s) on inputs that agree within tolerance") \
                if noted else note == "", (node, ortlab_x, note)
    # The same inputs on both sides, a zero among them, and onnxruntime's mask computed as x < 0 (a wrong
    # translation of x <= 0): no excuse.
    wrong = torch.ops.aten.lt.Scalar(reference.clamp_min(0) * torch.sign(reference), 0)
    same = reference.clamp_min(0) * torch.sign(reference)
    assert _decided_on_equal_inputs(le, wrong, 1, lambda arg: (same, same) if arg is x else (None, same),
                                    1e-4, 1e-5) == ""
    stats = compare_tensors(torch.tensor([False, True]), torch.tensor([False, False]))
    line = NodeComparison("g0.backward", 3, "le", "aten.le", "blocks.0", "", "diverged", stats, note="why").describe()
    assert line.endswith("(infx tol) - why"), line
