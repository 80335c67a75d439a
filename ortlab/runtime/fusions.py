"""The onnxruntime graph optimizations a model's sessions go without, because they would change its numbers.

onnxruntime fuses subgraphs into one kernel by matching their shape and, for some, their
constants; a few of those matches accept what is not the formula they replace. ``left_out``
says which of its optimizations a model must not get, and why; ``build_session`` passes the names
to onnxruntime (``disabled_optimizers``) for every session of that model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["ALWAYS_LEFT_OUT", "ALWAYS_REASON", "FusionChoice", "left_out"]

# Note [onnxruntime's fusions that change a formula]
# onnxruntime 1.32, checked on hand-built models (tests/test_exact_constants.py keeps each as an
# ONNX-only repro that says when an upgrade has changed it):
# * LayerNormFusion (level basic at opset 17 and up, "LayerNormFusionL1"; "LayerNormFusionL2" below)
#   puts LayerNormalization in place of ReduceMean -> Sub -> Pow -> ReduceMean -> Add -> Sqrt -> Div
#   -> Mul -> Add without reading Pow's exponent or the order of Sub's and Div's operands:
#   ``(x - mean) / sqrt(mean((x - mean)^3) + eps)``, ``(mean - x) / ...`` and ``sqrt(...) / (x - mean)``
#   all became a layer norm (errors of 6 to 1,200 on unit inputs). It is never run: torchlib
#   writes ``nn.LayerNorm`` as LayerNormalization itself, so only a norm written out by hand goes
#   without the fusion (the GPT's forward and backward come out of onnxruntime node for node as
#   before, at level all).
# * NoopElimination (basic) removes ``x + 0.0`` and ``x - (-0.0)``, which turn -0.0 into +0.0 (1/x: -inf
#   becomes +inf). onnxscript's pass before it already removes the exact no-ops (Note [Adding zero
#   keeps the sign of zero] in ortlab._compat.onnxscript); it is never run.
# * GeluFusion ("GeluFusionL1"/"L2") and FastGeluFusion (extended) test their constants with
#   ``optimizer_utils::IsInitializerWithExpectedValue``: |value - expected| <= 1e-8 + 1e-5 |expected|.
#   ``x * (0.5 + 1 ulp) * (1 + erf(x / sqrt(2)))`` became Gelu (0.00012 off at x = 3), so did
#   ``x / 1.41421`` (BERT's approximation, accepted on purpose); FastGelu took 3.00002 for Pow's 3.
#   These run only on a model none of whose scalar constants is such a near miss: one within
#   a band wider than onnxruntime's (1e-7 + 1e-4 |expected|) of an expected value without being it
#   in float16, float32 or float64 leaves the fusion out of that model's sessions. A model whose
#   constants are exact keeps it (torchlib's GELU constants and HF's ``gelu_new``'s are, to the bit).
#   AttentionFusion tests 1 and -10000 the same way, though its patterns (an Unsqueeze with an axes
#   attribute, Div of opset 7, as its source reads) do not occur in torchlib's opset-18 graphs; it
#   is treated alike.
# Constants onnxruntime folds itself (onnxscript's optimizer off or failed) are not seen here.
ALWAYS_LEFT_OUT = ("LayerNormFusionL1", "LayerNormFusionL2", "NoopElimination")
ALWAYS_REASON = ("LayerNormFusion does not read Pow's exponent or its operands' order; NoopElimination turns "
                 "-0.0 + 0.0, which is +0.0, into -0.0 (Note [onnxruntime's fusions that change a formula])")

_NEAR_MISSES: tuple[tuple[tuple[str, ...], tuple[float, ...]], ...] = (
    (("GeluFusionL1", "GeluFusionL2"), (math.sqrt(2.0), math.sqrt(0.5), 1.0, 0.5)),
    (("FastGeluFusion",), (0.044715, math.sqrt(2.0 / math.pi), 1.0, 0.5, 3.0)),
    (("AttentionFusion",), (1.0, -10000.0)),
)
_BAND_ABS, _BAND_REL = 1e-7, 1e-4
_RAW = {onnx.TensorProto.FLOAT: np.dtype("<f4"), onnx.TensorProto.DOUBLE: np.dtype("<f8"),
        onnx.TensorProto.FLOAT16: np.dtype("<f2")}
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


@dataclasses.dataclass(frozen=True)
class FusionChoice:
    """The onnxruntime optimizations a model's sessions go without, and why (one reason each)."""

    left_out: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def always(self) -> tuple[str, ...]:
        """The ones no session runs (:data:`ALWAYS_LEFT_OUT`) among ``left_out``."""
        return tuple(name for name in self.left_out if name in ALWAYS_LEFT_OUT)

    @property
    def model_reasons(self) -> tuple[str, ...]:
        """Why this model goes without more than those."""
        return tuple(r for r in self.reasons if r != ALWAYS_REASON)


def _exactly(expected: float) -> frozenset[float]:
    """``expected`` as float16, float32 and float64 store it."""
    return frozenset(float(t(expected)) for t in (np.float16, np.float32, np.float64))


def _scalars(graph: onnx.GraphProto) -> Iterator[float]:
    """The values of the one-element floating-point constants of ``graph`` and its subgraphs."""
    tensors = [t for t in graph.initializer]
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.name == "value_float":
                yield float(attr.f)
            elif node.op_type == "Constant" and attr.name == "value":
                tensors.append(attr.t)
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from _scalars(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _scalars(sub)
    for tensor in tensors:
        if tensor.data_type not in _FLOATS or math.prod(tensor.dims) != 1:
            continue
        if tensor.data_type in _RAW and len(tensor.raw_data) == _RAW[tensor.data_type].itemsize:
            yield float(np.frombuffer(tensor.raw_data, _RAW[tensor.data_type])[0])  # the common case, without to_array
            continue
        try:
            yield float(numpy_helper.to_array(tensor).reshape(()))
        except Exception:  # noqa: BLE001 - external data not loaded: onnxruntime cannot fold by it either
            continue


def _model(model: bytes | str | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        return onnx.load_model_from_string(bytes(model))
    return onnx.load(model, load_external_data=False)


def left_out(model: bytes | str | onnx.ModelProto) -> FusionChoice:
    """The onnxruntime optimizations ``model``'s sessions must go without, and why (Note [onnxruntime's fusions that
    change a formula]).

    Example:
        >>> left_out(model_bytes).left_out  # doctest: +SKIP
        ('LayerNormFusionL1', 'LayerNormFusionL2', 'NoopElimination')
    """
    names = list(ALWAYS_LEFT_OUT)
    reasons = [ALWAYS_REASON]
    try:
        values = set(_scalars(_model(model).graph))
    except Exception as e:  # noqa: BLE001 - a model onnx cannot read: onnxruntime will say why; none of them runs
        names += [name for fusions, _ in _NEAR_MISSES for name in fusions]
        reasons.append(f"the model's constants could not be read ({type(e).__name__}): every fusion that tests "
                       "constants approximately is left out")
        return FusionChoice(tuple(names), tuple(reasons))
    values = sorted(v for v in values if math.isfinite(v))
    for fusions, expected in _NEAR_MISSES:
        for e in expected:
            miss = next((v for v in values if abs(v - e) <= _BAND_ABS + _BAND_REL * abs(e)
                         and v not in _exactly(e)), None)
            if miss is not None:
                names += fusions
                reasons.append(f"{fusions[0]}: the constant {miss!r} is near {e!r}, which the fusion tests for "
                               "approximately, without being it")
                break
    return FusionChoice(tuple(names), tuple(reasons))
