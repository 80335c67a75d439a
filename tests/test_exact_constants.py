"""A pass may only ever change a number exactly: ``x + 1e-8`` is not ``x``, and ``x * (0.5 + 1 ulp)`` is not GELU's 0.5.

Three kinds of test. Upstream repros show what plain onnxscript and plain onnxruntime do (each
fails with a note for the maintainer when an upgrade changes it: ortlab's workaround may then go).
ortlab's own passes: onnxscript's rules as ortlab runs them (Notes [Pattern constants matched
exactly], [Adding zero keeps the sign of zero], [Casts through float32 that round twice] in
``ortlab._compat.onnxscript``) and the fusions its sessions leave out (Note [onnxruntime's fusions
that change a formula] in ``ortlab.runtime.fusions``). And the user's view: ORTModule, export_onnx and
the on-device artifacts on ``+ eps`` and constants a few ulps from 0 and 1.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as nh
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortlab
from ortlab.config import Options
from ortlab.runtime.session import build_session

F32 = onnx.TensorProto.FLOAT
_LEVELS = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
           "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
_UPSTREAM_CHANGED = ("{what} no longer does this ({how}): the workaround in {where} may no longer be needed; "
                     "check it still holds and remove it, or update this repro.")


def _up(x: float, dtype: type = np.float32) -> float:
    """The next number of ``dtype`` above ``x``: one ulp off."""
    return float(np.nextafter(dtype(x), dtype(np.inf)))


# ----------------------------------------------------------------------------------------- hand-built models
def _model(nodes: list, inits: dict, dtype: type = np.float32, shape: tuple = (4, 8), opset: int = 18,
           negate: bool = True) -> onnx.ModelProto:
    """``x`` -> nodes -> ``z`` (-> Neg -> ``y``, so that ``z`` is no graph output onnxruntime must keep)."""
    elem = oh.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = nodes + ([oh.make_node("Neg", ["z"], ["y"])] if negate else [])
    out = "y" if negate else "z"
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", elem, list(shape))],
                          [oh.make_tensor_value_info(out, elem, None)],
                          initializer=[nh.from_array(np.array(v, dtype=np.int64 if k == "axes" else dtype), k)
                                       for k, v in inits.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _binary(op: str, value: float, dtype: type = np.float32, constant_first: bool = False) -> onnx.ModelProto:
    inputs = ["c", "x"] if constant_first else ["x", "c"]
    return _model([oh.make_node(op, inputs, ["z"])], {"c": value}, dtype, shape=(3,))


def _layer_norm(power: float = 2.0, mean_first: bool = False, root_first: bool = False) -> onnx.ModelProto:
    """``(x - mean) / sqrt(mean((x - mean)^power) + 1e-5) * g + b``, or it with Sub's or Div's operands swapped."""
    return _model([
        oh.make_node("ReduceMean", ["x", "axes"], ["mu"]),
        oh.make_node("Sub", ["mu", "x"] if mean_first else ["x", "mu"], ["d"]),
        oh.make_node("Pow", ["d", "p"], ["d2"]),
        oh.make_node("ReduceMean", ["d2", "axes"], ["var"]),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["s"]),
        oh.make_node("Div", ["s", "d"] if root_first else ["d", "s"], ["n"]),
        oh.make_node("Mul", ["n", "g"], ["ng"]),
        oh.make_node("Add", ["ng", "b"], ["z"]),
    ], {"axes": [-1], "p": power, "eps": 1e-5, "g": np.full(8, 1.5), "b": np.full(8, 0.25)}, negate=False)


def _gelu(half: float = 0.5, sqrt2: float = float(np.float32(math.sqrt(2)))) -> onnx.ModelProto:
    """``(x * half) * (1 + erf(x / sqrt2))``: onnxruntime's GeluFusion's pattern."""
    return _model([oh.make_node("Div", ["x", "s"], ["d"]), oh.make_node("Erf", ["d"], ["e"]),
                   oh.make_node("Add", ["e", "one"], ["a"]), oh.make_node("Mul", ["x", "h"], ["m"]),
                   oh.make_node("Mul", ["m", "a"], ["z"])], {"s": sqrt2, "h": half, "one": 1.0})


def _fast_gelu(half: float = 0.5, power: float = 3.0) -> onnx.ModelProto:
    """HF's ``gelu_new``: ``(0.5 * x) * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))``."""
    return _model([oh.make_node("Pow", ["x", "p"], ["x3"]), oh.make_node("Mul", ["x3", "a"], ["ax3"]),
                   oh.make_node("Add", ["x", "ax3"], ["inner"]), oh.make_node("Mul", ["inner", "k"], ["ki"]),
                   oh.make_node("Tanh", ["ki"], ["t"]), oh.make_node("Add", ["t", "one"], ["t1"]),
                   oh.make_node("Mul", ["x", "h"], ["hx"]), oh.make_node("Mul", ["hx", "t1"], ["z"])],
                  {"p": power, "a": 0.044715, "k": math.sqrt(2 / math.pi), "one": 1.0, "h": half})


def _plain_run(model: onnx.ModelProto, x: np.ndarray, level: str) -> tuple[np.ndarray, list[str]]:
    """Plain onnxruntime at ``level``: the output and the ops of the model it optimized."""
    fd, path = tempfile.mkstemp(suffix=".onnx")
    os.close(fd)
    try:
        so = ort.SessionOptions()
        so.graph_optimization_level = _LEVELS[level]
        so.optimized_model_filepath = path
        so.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x})[0], [n.op_type for n in onnx.load(path).graph.node]
    finally:
        os.remove(path)


def _ortlab_run(model: onnx.ModelProto, x: np.ndarray, level: str) -> tuple[np.ndarray, list[str]]:
    """The same through ortlab's session builder (Note [onnxruntime's fusions that change a formula])."""
    fd, path = tempfile.mkstemp(suffix=".onnx")
    os.close(fd)
    try:
        built = build_session(model.SerializeToString(), Options(), providers=["CPUExecutionProvider"], level=level,
                              optimized_path=path)
        return built.session.run(None, {"x": x})[0], [n.op_type for n in onnx.load(path).graph.node]
    finally:
        os.remove(path)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _unit_inputs() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    x[0, :3] = [3.0, -3.0, 0.5]
    return x


# ------------------------------------------------------------------------------ upstream: plain onnxscript
@pytest.mark.parametrize(("op", "value", "dtype"), [("Add", 1e-8, np.float32), ("Add", 1e-12, np.float64),
                                                    ("Mul", 1.000001, np.float32), ("Div", 1.0000001, np.float32)])
def test_plain_onnxscript_takes_a_constant_near_0_or_1_for_it(op, value, dtype):
    """onnxscript's no-op rules match their 0 and 1 within math.isclose(rel_tol=1e-5, abs_tol=1e-8)."""
    import onnxscript

    model = ir.from_proto(_binary(op, value, dtype))
    onnxscript.optimizer.optimize(model)
    if op in _ops(model):
        pytest.fail(_UPSTREAM_CHANGED.format(what="onnxscript's optimizer", how=f"x {op} {value} is kept",
                                             where="ortlab._compat.onnxscript (Note [Pattern constants matched "
                                                   "exactly])"))


def test_plain_torch_onnx_export_optimizes_eps_away(tmp_path):
    """torch.onnx.export(dynamo=True)'s default ``optimize=True`` runs onnxscript's optimizer: ``+ 1e-8`` goes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_RowNorm(), (torch.randn(4, 5),), dynamo=True)
    if any(n.op_type == "Add" for n in program.model.graph):
        pytest.fail(_UPSTREAM_CHANGED.format(what="torch.onnx.export", how="its model keeps the Add of 1e-8",
                                             where="ORTModule.export_onnx (Note [Exported models optimized "
                                                   "exactly])"))


def test_plain_onnxscript_casts_float64_to_float16_once_where_the_graph_rounds_twice():
    import onnxscript

    graph = oh.make_graph([oh.make_node("Cast", ["x"], ["a"], to=F32),
                           oh.make_node("Cast", ["a"], ["y"], to=onnx.TensorProto.FLOAT16)], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [1])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [1])])
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))
    onnxscript.optimizer.optimize(model)
    if _ops(model) != ["Cast"]:
        pytest.fail(_UPSTREAM_CHANGED.format(what="onnxscript's CastCast", how="both casts are kept",
                                             where="ortlab._compat.onnxscript (Note [Casts through float32 that "
                                                   "round twice])"))


# ---------------------------------------------------------------------------- upstream: plain onnxruntime
@pytest.mark.parametrize("variant", ["cube", "mean - x", "root / (x - mean)"])
def test_plain_onnxruntime_fuses_another_formula_into_a_layer_norm(variant):
    """LayerNormFusion reads neither Pow's exponent nor Sub's or Div's operand order (onnxruntime 1.32, level basic)."""
    model = {"cube": _layer_norm(power=3.0), "mean - x": _layer_norm(mean_first=True),
             "root / (x - mean)": _layer_norm(root_first=True)}[variant]
    x = _unit_inputs()
    written, _ = _plain_run(model, x, "disable")
    fused, ops = _plain_run(model, x, "basic")
    if "LayerNormalization" not in ops or np.allclose(fused, written, atol=1e-3, equal_nan=True):
        pytest.fail(_UPSTREAM_CHANGED.format(what="onnxruntime's LayerNormFusion", how=f"{variant} is not fused",
                                             where="ortlab.runtime.fusions.ALWAYS_LEFT_OUT"))


@pytest.mark.parametrize("variant", ["gelu, 0.5 + 1 ulp", "fast gelu, 0.5 + 1 ulp", "fast gelu, x^3.00002"])
def test_plain_onnxruntime_fuses_a_gelu_whose_constant_is_near_the_standard_one(variant):
    """GeluFusion and FastGeluFusion take a constant within 1e-5 of theirs for it (level extended)."""
    model, fused_op = {"gelu, 0.5 + 1 ulp": (_gelu(half=_up(0.5)), "Gelu"),
                       "fast gelu, 0.5 + 1 ulp": (_fast_gelu(half=_up(0.5)), "FastGelu"),
                       "fast gelu, x^3.00002": (_fast_gelu(power=3.00002), "FastGelu")}[variant]
    x = _unit_inputs()
    written, _ = _plain_run(model, x, "disable")
    fused, ops = _plain_run(model, x, "extended")
    if fused_op not in ops or np.array_equal(fused, written):
        pytest.fail(_UPSTREAM_CHANGED.format(what=f"onnxruntime's {fused_op} fusion", how=f"{variant} is not fused",
                                             where="ortlab.runtime.fusions (_NEAR_MISSES)"))


def test_plain_onnxruntime_noop_elimination_turns_negative_zero_positive():
    """``-x + 0.0`` is +0.0 at x = 0; NoopElimination (level basic) makes it -0.0 (the output is its negation)."""
    model = _model([oh.make_node("Neg", ["x"], ["n"]), oh.make_node("Add", ["n", "c"], ["z"])], {"c": 0.0}, shape=(3,))
    x = np.zeros(3, np.float32)
    written, _ = _plain_run(model, x, "disable")
    removed, ops = _plain_run(model, x, "basic")
    assert np.signbit(written).all()
    if "Add" in ops or np.signbit(removed).any():
        pytest.fail(_UPSTREAM_CHANGED.format(what="onnxruntime's NoopElimination", how="x + 0.0 is kept",
                                             where="ortlab.runtime.fusions.ALWAYS_LEFT_OUT"))


# ----------------------------------------------------------------------------------------- ortlab's passes
@pytest.mark.parametrize(("op", "value", "dtype", "constant_first"), [
    ("Add", 1e-8, np.float32, False), ("Add", 1e-12, np.float32, True), ("Add", 1e-12, np.float64, False),
    ("Sub", 1e-9, np.float32, False), ("Mul", 1.000001, np.float32, True), ("Mul", _up(1.0), np.float32, False),
    ("Div", 1.0000001, np.float32, False), ("Div", _up(1.0, np.float64), np.float64, False)])
def test_ortlab_s_optimizer_keeps_a_constant_near_0_or_1(op, value, dtype, constant_first):
    from ortlab._compat.onnxscript import optimize

    model = ir.from_proto(_binary(op, value, dtype, constant_first))
    optimize(model)
    assert op in _ops(model)
    x = np.array([0.0, 1e-10, 1000.0], dtype=dtype)
    c = dtype(value)
    expected = -{"Add": lambda: c + x if constant_first else x + c, "Sub": lambda: x - c,
                 "Mul": lambda: c * x if constant_first else x * c, "Div": lambda: x / c}[op]()
    got, _ = _plain_run(ir.to_proto(model), x, "disable")
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(("op", "value", "dtype", "constant_first", "removed"), [
    ("Mul", 1.0, np.float32, False, True), ("Mul", 1.0, np.float64, True, True), ("Div", 1.0, np.float32, False, True),
    ("Add", -0.0, np.float32, False, True), ("Add", -0.0, np.float32, True, True),
    ("Sub", 0.0, np.float32, False, True),
    ("Add", 0, np.int64, False, True), ("Add", 0.0, np.float32, False, False), ("Add", 0.0, np.float32, True, False),
    ("Sub", -0.0, np.float64, False, False)])
def test_ortlab_s_optimizer_removes_exact_no_ops_and_keeps_the_sign_of_zero(op, value, dtype, constant_first, removed):
    """Note [Adding zero keeps the sign of zero]: ``x + (-0.0)`` and ``x - 0.0`` are ``x``; not ``x + 0.0``."""
    from ortlab._compat.onnxscript import optimize

    model = ir.from_proto(_binary(op, value, dtype, constant_first))
    optimize(model)
    assert (op not in _ops(model)) == removed
    x = np.array([-0.0, 0.0, 3.0], dtype=dtype)
    got, _ = _plain_run(ir.to_proto(model), x, "disable")
    written, _ = _plain_run(_binary(op, value, dtype, constant_first), x, "disable")
    if got.dtype.kind == "f":
        np.testing.assert_array_equal(np.signbit(got), np.signbit(written))
    np.testing.assert_array_equal(got, written)


def test_ortlab_s_optimizer_casts_through_float32_as_the_graph_does():
    """Note [Casts through float32 that round twice]: float64 -> float32 -> float16 rounds twice; float16's -> float32
    -> bfloat16 is one cast."""
    from ortlab._compat.onnxscript import optimize

    def casts(source: int, target: int) -> ir.Model:
        nodes = [oh.make_node("Cast", ["x"], ["a"], to=F32), oh.make_node("Cast", ["a"], ["y"], to=target)]
        graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", source, [2])],
                              [oh.make_tensor_value_info("y", target, [2])])
        return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))

    twice = casts(onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    optimize(twice)
    assert _ops(twice) == ["Cast", "Cast"]
    x = np.array([1 + 2**-11 + 2**-40, 1.0])
    got = ort.InferenceSession(ir.to_proto(twice).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(got, x.astype(np.float32).astype(np.float16))
    assert got[0] != x.astype(np.float16)[0]  # one cast would round to 1.0009765625
    once = casts(onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    optimize(once)
    assert _ops(once) == ["Cast"]


@pytest.mark.parametrize(("half", "fused"), [(0.5, True), (_up(0.5), False), (0.500004, False)])
def test_the_cpu_provider_s_gelu_in_one_kernel_only_for_the_exact_formula(half, fused):
    """Note [GELU in one kernel]: torchlib's ``x * (0.5 * (1 + erf(x / sqrt(2))))`` becomes Gelu, a 0.5 an ulp off does
    not (onnxscript's rule matched it within 1e-5)."""
    from ortlab.runtime.cpu_rewrites import fused_gelus

    sqrt2 = float(np.float32(math.sqrt(2)))
    proto = _model([oh.make_node("Div", ["x", "s"], ["d"]), oh.make_node("Erf", ["d"], ["e"]),
                    oh.make_node("Add", ["e", "one"], ["a"]), oh.make_node("Mul", ["h", "a"], ["m"]),
                    oh.make_node("Mul", ["x", "m"], ["z"])], {"s": sqrt2, "h": half, "one": 1.0})
    model = ir.from_proto(proto)
    assert fused_gelus(model) == int(fused)
    assert ("Gelu" in _ops(model)) == fused


@pytest.mark.parametrize("variant", ["cube", "mean - x", "root / (x - mean)"])
def test_ortlab_s_sessions_run_a_layer_norm_of_another_formula_as_written(variant):
    model = {"cube": _layer_norm(power=3.0), "mean - x": _layer_norm(mean_first=True),
             "root / (x - mean)": _layer_norm(root_first=True)}[variant]
    x = _unit_inputs()
    written, _ = _plain_run(model, x, "disable")
    for level in ("basic", "all"):
        got, ops = _ortlab_run(model, x, level)
        assert "LayerNormalization" not in ops
        np.testing.assert_allclose(got, written, rtol=1e-6, atol=1e-6)  # its other passes: an ulp; the fusion: 6.3


def test_ortlab_s_sessions_keep_the_sign_of_zero():
    model = _model([oh.make_node("Neg", ["x"], ["n"]), oh.make_node("Add", ["n", "c"], ["z"])], {"c": 0.0}, shape=(3,))
    x = np.zeros(3, np.float32)
    for level in ("basic", "all"):
        got, ops = _ortlab_run(model, x, level)
        assert "Add" in ops and np.signbit(got).all()


@pytest.mark.parametrize("variant", ["gelu", "fast gelu", "fast gelu, x^3.00002"])
def test_ortlab_s_sessions_fuse_a_gelu_only_with_its_exact_constants(variant):
    """A near miss anywhere in the model leaves the fusion out of its sessions; exact constants keep it (speed)."""
    make, fused_op = (_gelu, "Gelu") if variant == "gelu" else (_fast_gelu, "FastGelu")
    x = _unit_inputs()
    near = _fast_gelu(power=3.00002) if variant.endswith("3.00002") else make(half=_up(0.5))
    written, _ = _plain_run(near, x, "disable")
    got, ops = _ortlab_run(near, x, "all")
    assert fused_op not in ops
    np.testing.assert_array_equal(got, written)
    exact = make()
    reference, _ = _plain_run(exact, x, "all")
    got, ops = _ortlab_run(exact, x, "all")
    assert fused_op in ops
    np.testing.assert_array_equal(got, reference)


# ------------------------------------------------------------------------------------------ the user's view
_EPS = (1e-12, 1e-10, 1e-8, 1e-6, 1e-5)


class _Normalized(nn.Module):
    """``h / (|h| + eps)`` of each row of ``h = x * w``, for every eps at once."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        n = h.norm(dim=1, keepdim=True)
        return torch.stack([h / (n + eps) for eps in _EPS])


class _NearConstants(nn.Module):
    """Elementwise ops with constants a few ulps from 0 and 1, of ``h = x * w``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * self.w
        return (*(h + eps for eps in _EPS), h * (1 + 1e-6), h - 1e-9, h / 1.0000001, torch.pow(h.abs(), 1.0000001))


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    x = torch.tensor([[0.0] * 6, [1e-10, 3e-9, -2e-12, 1e-7, 5.0, -7.0], [1000.0, -1000.0, 0.5, 2.0, 1e-3, 123.0]],
                     dtype=dtype)
    return x


def _both(cls: type, dtype: torch.dtype) -> tuple:
    """``cls`` eager and under ORTModule, forward and backward on the same inputs: (outputs, w.grad) of each."""
    torch.manual_seed(0)
    eager = cls(dtype)
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = _inputs(dtype)
    results = []
    for m in (eager, om):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = m(x)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
        results.append(([o.detach() for o in outs], m.w.grad.detach().clone()))
    assert not om.report.fallbacks, om.report.fallbacks
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ortmodule_keeps_eps_in_a_norm_on_a_zero_row(dtype):
    (eager_out, eager_grad), (ours_out, ours_grad) = _both(_Normalized, dtype)
    assert torch.isfinite(ours_out[0]).all() and torch.isfinite(ours_grad).all()
    assert (ours_out[0][:, 0] == 0).all()  # the zero row, for every eps
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(ours_out[0], eager_out[0], rtol=tol, atol=tol)
    torch.testing.assert_close(ours_grad, eager_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ortmodule_computes_constants_near_0_and_1_exactly_as_eager(dtype):
    """x + eps (1e-12 .. 1e-5), x * (1 + 1e-6), x - 1e-9 and x / 1.0000001 are exact elementwise in eager and in
    onnxruntime: equal to the bit, forward and backward; pow's libraries differ by an ulp, and its 1.0000001 stays."""
    (eager_out, eager_grad), (ours_out, ours_grad) = _both(_NearConstants, dtype)
    *exact, powed = range(len(eager_out))
    for i in exact:
        torch.testing.assert_close(ours_out[i], eager_out[i], rtol=0, atol=0, msg=f"output {i}")
    h = _inputs(dtype) * torch.linspace(0.5, 1.5, 6, dtype=dtype)
    for i in exact:
        assert not torch.equal(ours_out[i], h), f"output {i}: the constant's op was dropped"
    tol = 4e-7 if dtype == torch.float32 else 1e-15
    torch.testing.assert_close(ours_out[powed], eager_out[powed], rtol=tol, atol=0)
    big = h[2].abs() > 100
    assert (ours_out[powed][2][big] != h[2].abs()[big]).all(), "pow(x, 1.0000001) became x"
    torch.testing.assert_close(ours_grad, eager_grad, rtol=tol, atol=0)


class _RowNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.norm(dim=1, keepdim=True) + 1e-8)


def test_export_onnx_keeps_eps_for_plain_onnxruntime_on_a_zero_row(tmp_path):
    """Note [Exported models optimized exactly]: torch.onnx's optimizer dropped ``+ 1e-8``: NaN on a zero row."""
    om = ortlab.ORTModule(_RowNorm())
    x = torch.randn(4, 5)
    x[1] = 0
    path = om.export_onnx(str(tmp_path / "norm.onnx"), x)
    adds = [n for n in onnx.load(path).graph.node if n.op_type == "Add"]
    assert adds, "the + 1e-8 was optimized away"
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])  # plain onnxruntime, its defaults
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert np.isfinite(got).all() and (got[1] == 0).all()
    np.testing.assert_allclose(got, _RowNorm()(x).numpy(), rtol=1e-6, atol=1e-7)


def test_ondevice_artifacts_keep_eps_on_a_zero_row(tmp_path):
    from ortlab.ondevice import CheckpointState, Module, generate_artifacts

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))
            return h / (h.norm(dim=1, keepdim=True) + 1e-8)

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.fc.bias.fill_(-0.1)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 4)
    x[0] = -1e3  # relu zeroes row 0
    labels = torch.randn(4, 4)
    art = generate_artifacts(model, x, "mse", "sgd", artifact_dir=tmp_path / "art")
    state = CheckpointState.load_checkpoint(art.checkpoint)
    loss = float(Module(art.training_model, state, art.eval_model)(x.numpy(), labels.numpy()))
    expected = torch.nn.functional.mse_loss(eager(x), labels)
    expected.backward()
    assert math.isfinite(loss)
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for name, p in eager.named_parameters():
        np.testing.assert_allclose(state.gradients[name], p.grad.numpy(), rtol=1e-5, atol=1e-7)


class _NearGelu(nn.Module):
    """A hand-written GELU whose 0.5 is an ulp off: onnxruntime's GeluFusion would take it for 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _up(0.5) * (1 + torch.erf(x / math.sqrt(2.0)))


def test_the_report_says_which_fusions_a_model_goes_without_and_why():
    om = ortlab.ORTModule(_NearGelu())
    x = torch.linspace(-4, 4, 64).reshape(8, 8)
    torch.testing.assert_close(om(x), _NearGelu()(x), rtol=0, atol=1e-6)
    text = str(om.report)
    assert "onnxruntime fusion left out: GeluFusionL1: the constant" in text, text
    assert "onnxruntime optimizations no session runs: LayerNormFusionL1, LayerNormFusionL2, NoopElimination" in text
    plain = ortlab.ORTModule(nn.GELU())
    plain(x)
    assert "fusion left out" not in str(plain.report), str(plain.report)
