"""The CPU provider's rewrites (ortlab/runtime/cpu_rewrites.py) keep the graph's values.

Note [Where as a checked multiply]: the select's result in every case, inf and NaN included.
Note [Convolutions in the blocked layout]: a float32 convolution within the parity tolerance,
forward and gradients, for the shapes it takes, and the others left as they are.
Note [One Slice for a window]: the same elements, bit for bit, and only where the axes differ.
Note [GELU in one kernel]: the exact GELU as torchlib writes it becomes onnxruntime's one Gelu kernel.
Note [A max pool's plane offsets]: the indices PyTorch's, exactly, without the 1x1 pool.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortlab
import ortlab.pipeline.part as part_module
from conftest import squared_loss_parity
from ortlab.runtime import cpu_rewrites
from ortlab.runtime.cpu_rewrites import (
    MIN_SELECT_ELEMENTS, CpuRewrites, blocked_convolutions, checked_selects, expanded_broadcasts, found_in, fused_gelus,
    merged_slices, nchwc_block_size, pool_offsets,
)
from ortlab.config import Options
from ortlab.runtime.session import optimized_model

RTOL, ATOL = 1e-4, 1e-5


def _value(name: str, dtype: ir.DataType, shape: list[int]) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))


def _run(model: ir.Model, feeds: dict[str, np.ndarray], optimize: bool = True) -> np.ndarray:
    so = ort.SessionOptions()
    if not optimize:  # the nodes as they are, unfused
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _where_model(shape: list[int], x_zero: bool, dtype: ir.DataType) -> ir.Model:
    cond = _value("c", ir.DataType.BOOL, shape)
    y = _value("y", dtype, shape)
    inputs = [cond, y]
    nodes = []
    if x_zero:
        zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), dtype=dtype.numpy()))})
        nodes.append(zero)
        x = zero.outputs[0]
    else:
        x = _value("x", dtype, shape)
        inputs.append(x)
    where = ir.node("Where", [cond, x, y])
    where.outputs[0].dtype, where.outputs[0].shape = dtype, ir.Shape(shape)
    nodes.append(where)
    return ir.Model(ir.Graph(inputs, [where.outputs[0]], nodes=nodes, opset_imports={"": 18}), ir_version=10)


@pytest.mark.parametrize("x_zero", [True, False], ids=["threshold_backward", "two_tensors"])
@pytest.mark.parametrize("special", ["finite", "inf_dropped", "nan_dropped", "nan_kept", "signed_zero"])
@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.DOUBLE], ids=["float32", "float64"])
def test_a_checked_select_is_the_select(x_zero, special, dtype):
    shape = [4, MIN_SELECT_ELEMENTS // 4]
    rng = np.random.default_rng(0)
    cond = rng.random(shape) < 0.5
    y = rng.standard_normal(shape).astype(dtype.numpy())
    x = rng.standard_normal(shape).astype(dtype.numpy())
    if special == "inf_dropped":  # where the select drops y (the condition picks x): inf * 0 would be NaN
        y[cond] = np.inf
    elif special == "nan_dropped":
        x[~cond] = np.nan
        y[cond] = np.nan
    elif special == "nan_kept":
        y[~cond] = np.nan
    elif special == "signed_zero":  # -0 kept where y passes, +0 where the select writes +0 (or x)
        y[:] = -0.0
        x[::2] = -x[::2]
    feeds = {"c": cond, "y": y} if x_zero else {"c": cond, "y": y, "x": x}
    plain = _where_model(shape, x_zero, dtype)
    expected = _run(plain, feeds)
    rewritten = _where_model(shape, x_zero, dtype)
    assert checked_selects(rewritten) == 1
    assert [n.op_type for n in rewritten.graph if n.op_type in ("Where", "If")] == ["If"]
    got = _run(rewritten, feeds)
    np.testing.assert_array_equal(got, expected)  # NaN where NaN; -0 == 0
    np.testing.assert_array_equal(got, np.where(cond, 0 if x_zero else x, y))
    numbers = ~np.isnan(expected)  # and the sign of every zero (Note [Signed zeros through a checked multiply])
    np.testing.assert_array_equal(np.signbit(got)[numbers], np.signbit(expected)[numbers])


def test_small_or_broadcast_selects_stay():
    small = _where_model([4, 100], True, ir.DataType.FLOAT)
    assert checked_selects(small) == 0
    # A condition smaller than the result (a causal mask beside the scores) stays: onnxruntime's Where is fast there.
    cond = _value("c", ir.DataType.BOOL, [256, 256])
    y = _value("y", ir.DataType.FLOAT, [4, 256, 256])
    x = _value("x", ir.DataType.FLOAT, [4, 256, 256])
    where = ir.node("Where", [cond, x, y])
    where.outputs[0].dtype, where.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([4, 256, 256])
    model = ir.Model(ir.Graph([cond, x, y], [where.outputs[0]], nodes=[where], opset_imports={"": 18}), ir_version=10)
    assert checked_selects(model) == 0


class _ReluLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (torch.relu(self.linear(x)) * scale).sum()


def _notes(om: ortlab.ORTModule) -> list[str]:
    return [n for c in om.report.captures for g in c.graphs for n in g.notes]


@pytest.mark.parametrize("scale", ["finite", "inf_where_relu_is_zero"])
def test_relu_gradients_through_checked_selects_are_the_select_s(scale, monkeypatch):
    """threshold_backward's Where with a full-size condition: the gradients are bit for bit those of the graph
    without the rewrite, and eager's within the tolerance, with an infinite upstream gradient where the ReLU
    was zero too (eager and the select: 0 there; a bare multiply: NaN, in every weight's gradient)."""
    torch.manual_seed(0)
    model = _ReluLoss()
    x = torch.randn(256, 256)
    s = torch.randn(256, 512)
    if scale != "finite":
        with torch.no_grad():
            s = torch.where(model.linear(x) <= 0, torch.tensor(float("inf")), s)
    om = ortlab.ORTModule(copy.deepcopy(model))
    om(x, s).backward()
    assert any("Where node(s) with a full-size condition" in n for n in _notes(om)), _notes(om)
    monkeypatch.setattr(part_module, "rewrite_for_cpu", lambda model, level: CpuRewrites())
    plain = ortlab.ORTModule(copy.deepcopy(model))
    plain(x, s).backward()
    model(x, s).backward()
    for p, q, r in zip(model.parameters(), om.parameters(), plain.parameters()):
        assert torch.equal(q.grad, r.grad)
        assert torch.isfinite(q.grad).all()
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=1e-4)
    assert not om.report.fallbacks


def test_the_block_size_is_read_and_checked():
    block, why = nchwc_block_size()
    assert (block, why) in ((8, ""), (16, "")), why


@pytest.mark.parametrize(
    "cin,cout,kernel,cfg",
    [(32, 16, 3, dict(padding=1)), (3, 32, 7, dict(stride=2, padding=3)), (16, 32, 1, dict(stride=2)),
     (32, 32, 3, dict(padding=2, dilation=2, bias=True)), (16, 16, (3, 1), dict(padding=(1, 0), stride=(1, 2)))],
    ids=["3x3", "stem", "1x1_stride2", "dilated_bias", "asymmetric"],
)
def test_blocked_convolutions_match_eager(cin, cout, kernel, cfg):
    torch.manual_seed(0)
    cfg.setdefault("bias", False)
    model = nn.Sequential(nn.Conv2d(cin, cout, kernel, **cfg), nn.Tanh())
    om = squared_loss_parity(model, torch.randn(3, cin, 13, 12))  # outputs, input and weight gradients
    assert not om.report.fallbacks
    assert any("1 convolution(s) run in onnxruntime's blocked (NCHWc) layout" in n for n in _notes(om)), _notes(om)
    (forward,) = [g for c in om.report.captures for g in c.graphs if g.name == "forward"]
    assert forward.onnx_ops.get("com.microsoft.nchwc.Conv", 0) == 1 and "Conv" not in forward.onnx_ops
    # the weight is reordered by ReorderInput, not by Transposes (Note [Reordering a weight with ReorderInput])
    assert "Transpose" not in forward.onnx_ops, forward.onnx_ops
    block, _ = nchwc_block_size()
    weight_reorders = 1 if cin % block or kernel == 1 else 2  # OIHWBo, or a 1x1 kernel: one move
    assert forward.onnx_ops["com.microsoft.nchwc.ReorderInput"] == weight_reorders + (cin % block == 0), forward.onnx_ops


def test_convolutions_the_layout_cannot_take_stay_plain():
    """Grouped convolutions, channels that are not a multiple of the block, kernels larger than 7x7, 1x1 kernels
    with stride 1 and constant weights (onnxruntime blocks those itself) are left as they are."""
    block, _ = nchwc_block_size()
    x = _value("x", ir.DataType.FLOAT, [2, 2 * block, 8, 8])
    cases = [([block, 2 * block, 3, 3], {"group": 2}), ([block + 4, 2 * block, 3, 3], {}),
             ([block, 2 * block + 4, 3, 3], {}),
             ([block, 2 * block, 8, 8], {}),  # a weight gradient's kernel (dY as the kernel)
             ([block, 2 * block, 1, 1], {"pads": [0, 0, 0, 0]})]  # a GEMM per image already
    for w_shape, attrs in cases:
        x_in = _value("x", ir.DataType.FLOAT, [2, w_shape[1] * attrs.get("group", 1), 8, 8])
        w = _value("w", ir.DataType.FLOAT, w_shape)
        conv = ir.node("Conv", [x_in, w], {"pads": [1, 1, 1, 1], **attrs} if "pads" not in attrs else attrs)
        conv.outputs[0].dtype, conv.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([2, w_shape[0], 8, 8])
        model = ir.Model(ir.Graph([x_in, w], [conv.outputs[0]], nodes=[conv], opset_imports={"": 18}), ir_version=10)
        assert blocked_convolutions(model, block) == 0, (w_shape, attrs)
    weight = ir.tensor(np.ones((block, 2 * block, 3, 3), np.float32), name="w")
    w_const = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(weight.shape), const_value=weight)
    conv = ir.node("Conv", [x, w_const], {"pads": [1, 1, 1, 1]})
    conv.outputs[0].dtype, conv.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([2, block, 8, 8])
    graph = ir.Graph([x], [conv.outputs[0]], nodes=[conv], initializers=[w_const], opset_imports={"": 18})
    assert blocked_convolutions(ir.Model(graph, ir_version=10), block) == 0


def test_a_rewrite_the_session_rejects_leaves_the_graph_in_onnxruntime_as_it_was(monkeypatch):
    """Should onnxruntime reject a rewritten graph (ortlab's bug), the graph runs as it was, in onnxruntime,
    and the report says so: not a fallback to PyTorch."""
    def broken(model: ir.Model, level: str) -> CpuRewrites:
        node = ir.node("NoSuchOp", [model.graph.inputs[0]], domain="ortlab.test", name="broken_rewrite")
        model.graph.append(node)
        model.graph.outputs.append(node.outputs[0])
        model.opset_imports["ortlab.test"] = 1
        return CpuRewrites(selects=1)

    monkeypatch.setattr(part_module, "rewrite_for_cpu", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    om = ortlab.ORTModule(copy.deepcopy(model))
    torch.testing.assert_close(om(x), model(x), rtol=RTOL, atol=ATOL)
    assert not om.report.fallbacks
    notes = _notes(om)
    assert any("runs without the CPU provider's rewrites" in n for n in notes), notes


def test_a_block_size_that_fails_its_check_keeps_convolutions_plain(monkeypatch):
    monkeypatch.setattr(cpu_rewrites, "_BLOCK", [(0, "a blocked convolution did not match the plain one")])
    torch.manual_seed(0)
    model = nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(2, 16, 6, 6)
    om = ortlab.ORTModule(copy.deepcopy(model))
    torch.testing.assert_close(om(x), model(x), rtol=RTOL, atol=ATOL)
    notes = _notes(om)
    assert any("convolutions kept in onnxruntime's plain layout: a blocked convolution did not match" in n
               for n in notes), notes


class _SelectThenFold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.where(x > 0, x, self.scale * x)  # a checked select: full-size condition, float64
        return torch.nn.functional.fold(y, (66, 66), (3, 3))  # Col2Im: no float64 kernel in onnxruntime


def test_a_graph_s_own_failure_is_not_blamed_on_the_rewrites():
    """A float64 Col2Im has no onnxruntime kernel: the graph fails with the rewrites (a checked select beside
    it) and without them alike, so the fold goes to PyTorch for its own reason and the report does not say
    the rewrites were rejected."""
    model = _SelectThenFold()
    x = torch.randn(2, 36, 64 * 64, dtype=torch.float64)
    om = ortlab.ORTModule(copy.deepcopy(model))
    with pytest.warns(ortlab.FallbackWarning):
        out = om(x)
    ref = model(x)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    notes = _notes(om)
    assert not any("rejected" in n for n in notes), notes
    assert any("Col2Im" in str(f) for f in om.report.fallbacks), om.report.fallbacks


def test_a_cached_start_reports_the_rewrites_its_models_hold(tmp_path):
    """The cache stores the model as onnxruntime optimized it; a start from it runs the same rewrites and
    its report says so (counted from the rewrites' node names, which onnxruntime keeps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 48 * 48, 2))
    x = torch.randn(2, 16, 48, 48)

    def notes_of(om: ortlab.ORTModule) -> list[str]:
        om(x).sum().backward()
        return sorted(n for n in _notes(om) if "Where node(s)" in n or "convolution(s)" in n or "Slice(s)" in n)

    first = notes_of(ortlab.ORTModule(copy.deepcopy(model), cache_dir=str(tmp_path)))
    assert any("blocked" in n for n in first) and any("Where" in n for n in first), first
    assert any("Slice(s) of a Slice" in n for n in first), first
    cached = ortlab.ORTModule(copy.deepcopy(model), cache_dir=str(tmp_path))
    assert notes_of(cached) == first
    assert all(g.cached for c in cached.report.captures for g in c.graphs)


def _ints_value(values: list[int]) -> tuple[ir.Node, ir.Value]:
    node = ir.node("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})
    return node, node.outputs[0]


def _slices_model(first: tuple, second: tuple, constant: bool = True, share: bool = False) -> ir.Model:
    """``Slice(Slice(x, *first), *second)`` on a [3, 4, 9, 10] input (each a (starts, ends, axes, steps));
    with ``share``, the first Slice's result is a second output; without ``constant``, the second's starts are
    an input."""
    x = _value("x", ir.DataType.FLOAT, [3, 4, 9, 10])
    inputs, nodes = [x], []
    operands = []
    for lists in (first, second):
        values = []
        for i, v in enumerate(lists):
            if i == 0 and lists is second and not constant:
                start = _value("start", ir.DataType.INT64, [len(v)])
                inputs.append(start)
                values.append(start)
                continue
            node, value = _ints_value(v)
            nodes.append(node)
            values.append(value)
        operands.append(values)
    inner = ir.node("Slice", [x, *operands[0]], name="inner")
    outer = ir.node("Slice", [inner.outputs[0], *operands[1]], name="outer")
    nodes += [inner, outer]
    for value in (inner.outputs[0], outer.outputs[0]):
        value.dtype = ir.DataType.FLOAT
    outputs = [outer.outputs[0], *([inner.outputs[0]] if share else [])]
    return ir.Model(ir.Graph(inputs, outputs, nodes=nodes, opset_imports={"": 18}), ir_version=10)


def _run_all(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("first, second", [
    (([1], [8], [2], [1]), ([0], [9], [3], [2])),           # a window: rows, then strided columns
    (([2], [9], [-2], [3]), ([-3], [-1], [-1], [1])),       # axes and ends counted from the end
    (([0, 1], [2, 4], [0, 1], [1, 2]), ([8], [0], [2], [-2])),  # two axes, then a reversed one
])
@pytest.mark.parametrize("share", [False, True], ids=["alone", "first_slice_read_elsewhere"])
def test_a_slice_of_a_slice_is_one_slice_with_the_same_elements(first, second, share):
    model = _slices_model(first, second, share=share)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 4, 9, 10)).astype(np.float32)}
    want = _run_all(model, feeds)
    assert merged_slices(model) == 1
    slices = [n for n in model.graph if n.op_type == "Slice"]
    assert len(slices) == (2 if share else 1), [n.name for n in slices]
    assert any(n.name == "outer_one_slice" and n.inputs[0].name == "x" for n in slices)
    got = _run_all(model, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_slices_along_one_axis_or_with_computed_bounds_stay():
    same_axis = _slices_model(([1], [8], [2], [1]), ([2], [5], [2], [1]))
    computed = _slices_model(([1], [8], [2], [1]), ([0], [9], [3], [2]), constant=False)
    assert merged_slices(same_axis) == 0 and merged_slices(computed) == 0
    assert [n.op_type for n in computed.graph].count("Slice") == 2


def _gelu_model(half: float = 0.5, erf_read_twice: bool = False, dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    """torchlib's exact GELU, ``x * (half * (1 + erf(x / sqrt(2))))``, on a [64, 256] input (and the erf
    also an output with ``erf_read_twice``)."""
    x = _value("x", dtype, [64, 256])
    consts = [ir.node("Constant", [], {"value": ir.tensor(np.array(v, dtype.numpy()))}) for v in (2 ** 0.5, 1.0, half)]
    div = ir.node("Div", [x, consts[0].outputs[0]])
    erf = ir.node("Erf", [div.outputs[0]])
    add = ir.node("Add", [erf.outputs[0], consts[1].outputs[0]])
    mul_half = ir.node("Mul", [consts[2].outputs[0], add.outputs[0]])
    mul_x = ir.node("Mul", [x, mul_half.outputs[0]], name="node_gelu")
    mul_x.metadata_props.update({"ortlab.fx_node": "gelu", "ortlab.module": "blocks.0"})
    outputs = [mul_x.outputs[0], *([erf.outputs[0]] if erf_read_twice else [])]
    for value in (div, erf, add, mul_half, mul_x):
        value.outputs[0].dtype, value.outputs[0].shape = dtype, ir.Shape([64, 256])
    graph = ir.Graph([x], outputs, nodes=[*consts, div, erf, add, mul_half, mul_x], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_an_exact_gelu_is_onnxruntime_s_one_gelu_kernel_named_after_the_exported_node():
    model = _gelu_model()
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 4
    before = _run(ir.from_proto(ir.to_proto(model)), {"x": x}, optimize=False)
    assert fused_gelus(model) == 1
    assert [(n.op_type, n.domain, n.name) for n in model.graph] == [("Gelu", "com.microsoft", "node_gelu_one_gelu")]
    assert model.graph.node(0).metadata_props["ortlab.module"] == "blocks.0"  # the exported node's provenance
    # its own erf: a few ulps (near zero, where GELU's values are tiny, absolute ones)
    np.testing.assert_allclose(_run(model, {"x": x}, optimize=False), before, rtol=1e-6, atol=1e-6)
    kept = optimized_model(ir.to_proto(model).SerializeToString(), Options(), None, "all", ["CPUExecutionProvider"])[0]
    assert found_in(onnx.load_from_string(kept)).gelus == 1  # onnxruntime keeps the name: a cached start says so


def test_gelus_that_are_not_the_pattern_or_not_float32_stay():
    assert fused_gelus(_gelu_model(half=0.25)) == 0
    assert fused_gelus(_gelu_model(erf_read_twice=True)) == 0
    assert fused_gelus(_gelu_model(dtype=ir.DataType.DOUBLE)) == 0  # the CPU provider's kernels are float's


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_layers_train_like_eager_through_the_fused_kernel(approximate):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(approximate=approximate), nn.Linear(256, 8))
    om = squared_loss_parity(model, torch.randn(64, 32) * 3)
    gelu_notes = [n for n in _notes(om) if "GELU(s)" in n]
    assert gelu_notes == ["g0.forward: 1 GELU(s) run as one onnxruntime kernel each (Gelu, FastGelu), not five or "
                          "eight elementwise ones (Note [GELU in one kernel])"], _notes(om)
    (forward,) = [g for c in om.report.captures for g in c.graphs if g.name == "forward"]
    fused = "com.microsoft.Gelu" if approximate == "none" else "com.microsoft.FastGelu"
    assert forward.onnx_ops.get(fused) == 1 and "Tanh" not in forward.onnx_ops and "Erf" not in forward.onnx_ops

class _PoolWithIndices(nn.Module):
    def __init__(self, **pool: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(return_indices=True, **pool)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool(torch.tanh(self.conv(x)))


@pytest.mark.parametrize("pool", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, ceil_mode=True)],
                         ids=["resnet_stem", "ceil"])
def test_max_pool_indices_are_pytorch_s_without_the_1x1_pool(pool):
    torch.manual_seed(0)
    model = _PoolWithIndices(**pool)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 3, 9, 11)
    (values, indices), (ref_values, ref_indices) = om(x), model(x)
    assert torch.equal(indices, ref_indices) and indices.dtype == ref_indices.dtype  # integers: exactly
    torch.testing.assert_close(values, ref_values, rtol=RTOL, atol=ATOL)
    values.pow(2).sum().backward()
    ref_values.pow(2).sum().backward()
    for a, b in zip(om.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    (forward,) = [g for c in om.report.captures for g in c.graphs if g.name == "forward"]
    assert forward.onnx_ops["MaxPool"] == 2, forward.onnx_ops  # the pool and its NaN flags' pool; no 1x1 pool


def test_a_1x1_pool_whose_values_are_read_or_whose_shape_is_unknown_stays():
    for values_read, shape in ((True, [2, 4, 6, 6]), (False, [2, 4, "h", 6])):
        x = _value("x", ir.DataType.FLOAT, shape)
        pool = ir.node("MaxPool", [x], {"kernel_shape": [1, 1], "strides": [1, 1]}, num_outputs=2)
        starts, ends = (ir.node("Constant", [], {"value": ir.tensor(np.array(v, np.int64))}) for v in ([0, 0], [1, 1]))
        axes = ir.node("Constant", [], {"value": ir.tensor(np.array([2, 3], np.int64))})
        first = ir.node("Slice", [pool.outputs[1], starts.outputs[0], ends.outputs[0], axes.outputs[0]])
        outputs = [first.outputs[0], *([pool.outputs[0]] if values_read else [])]
        graph = ir.Graph([x], outputs, nodes=[pool, starts, ends, axes, first], opset_imports={"": 18})
        assert pool_offsets(ir.Model(graph, ir_version=10)) == 0, (values_read, shape)


def test_input_gradients_of_stride_1_convolutions_on_large_images_are_blocked_convolutions():
    """Note [Input gradients as blocked convolutions]: dX of a stride-1 3x3 convolution on a 16x16 image is a
    convolution of dY with the flipped weight, run blocked; a stride-2 one, or an image under 16x16, keeps its
    GEMM and Col2Im. Outputs and every gradient (the input's too) match eager's."""
    block, _ = nchwc_block_size()
    if not block:
        pytest.skip("onnxruntime's blocked layout is not available here")
    torch.manual_seed(0)
    c = 2 * block
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(c, c, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                          nn.Flatten(), nn.Linear(c * 8 * 8, 4))
    om = squared_loss_parity(model, torch.randn(2, 3, 16, 16))
    notes = _notes(om)
    # dX of the first two (16x16, stride 1) convolutions (the input's gradient too) are Convs; the stride-2
    # one and the 8x8 one keep their Col2Im
    assert any("2 convolution input gradient(s) run as a convolution with the flipped weight" in n for n in notes), notes
    (backward,) = [g for cap in om.report.captures for g in cap.graphs if g.name == "backward"]
    assert backward.onnx_ops.get("Col2Im", 0) == 2, backward.onnx_ops


def _broadcast_model(op: str, big: list[int], small: list[int], small_first: bool = False) -> ir.Model:
    x, s = _value("x", ir.DataType.FLOAT, big), _value("s", ir.DataType.FLOAT, small)
    first = ir.node(op, [s, x] if small_first else [x, s], name="first")
    second = ir.node("Mul", [first.outputs[0], s], name="second")  # the same operand again: one Expand for both
    for n in (first, second):
        n.outputs[0].dtype, n.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(big)
    return ir.Model(ir.Graph([x, s], [second.outputs[0]], nodes=[first, second], opset_imports={"": 18}), ir_version=10)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("small_first", [False, True], ids=["x_op_s", "s_op_x"])
def test_a_per_channel_operand_over_small_planes_is_expanded_with_the_same_bits(op, small_first):
    """Note [Per-channel operands over small planes]: a batch norm's [1, C, 1, 1] against [N, C, 2, 2]."""
    model = _broadcast_model(op, [16, 32, 2, 2], [1, 32, 1, 1], small_first)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((16, 32, 2, 2)).astype(np.float32),
             "s": rng.standard_normal((1, 32, 1, 1)).astype(np.float32)}
    feeds["x"][0, 0, 0, 0], feeds["s"][0, 1] = np.inf, np.nan  # special values pass through the same op
    want = _run_all(model, feeds)
    assert expanded_broadcasts(model) == 2
    expands = [n for n in model.graph if n.op_type == "Expand"]
    assert len(expands) == 1 and list(expands[0].outputs[0].shape) == [1, 32, 2, 2]
    assert found_in(ir.to_proto(model)).broadcasts == 1  # counted by its Expand's name in a stored model
    np.testing.assert_array_equal(_run_all(model, feeds)[0], want[0])


@pytest.mark.parametrize("big, small", [
    ([16, 32, 8, 8], [1, 32, 1, 1]),    # planes of 64 elements: the broadcast's spans are long enough
    ([16, 32, 2, 2], [1, 1, 1, 1]),     # a scalar
    ([16, 32, 2, 2], [1, 32, 2, 2]),    # already as long as a plane
    ([2, 32, 2, 2], [2, 32, 1, 1]),     # the expanded operand would be as large as the result
    ([16, 32, 2, 4], [1, 1, 1, 4]),     # varies along the last dim: long spans already
])
def test_broadcasts_with_long_spans_or_no_saving_stay(big, small):
    assert expanded_broadcasts(_broadcast_model("Sub", big, small)) == 0


def test_batch_norm_on_small_planes_trains_through_expanded_operands_bit_for_bit(monkeypatch):
    """The same gradients and running statistics, bit for bit, as without the rewrite; the output as eager's.
    (Their gradients against eager's: batch norm over 8 planes of 2x2 amplifies float32 rounding, as much
    without the rewrite.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2,
                          padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten())
    x = torch.randn(8, 3, 4, 4)
    with_rewrite, copied = ortlab.ORTModule(copy.deepcopy(model)), copy.deepcopy(model)
    out = with_rewrite(x)
    torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
    out.pow(2).sum().backward()
    notes = [n for c in with_rewrite.report.captures for g in c.graphs for n in g.notes]
    assert sum("per-channel operand expanded" in n for n in notes) == 2, notes  # forward and backward
    monkeypatch.setattr(cpu_rewrites, "expanded_broadcasts", lambda model: 0)
    without = ortlab.ORTModule(copied)
    without(x).pow(2).sum().backward()
    for (name, a), b in zip(with_rewrite.named_parameters(), without.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(with_rewrite.named_buffers(), without.buffers()):
        assert torch.equal(a, b), name
