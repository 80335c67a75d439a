"""Note [Wide MatMuls for OpenVINO]: the model OpenVINO is given splits the MatMuls its GEMM runs slowly,
computes the same values, and is what the session (and the cache) hold."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import run_step
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ortlab
from ortlab.runtime.openvino import MARK, prepare_for_openvino
from ortlab.runtime import providers as providers_module


def _model(n: int, *, b_from: str = "input") -> bytes:
    """``y = a @ B`` with ``B`` a ``[64, n]`` tensor: an input, computed (``Relu``), a transpose or a weight."""
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [32, 64])]
    if b_from == "weight":
        inits.append(numpy_helper.from_array(np.ones((64, n), np.float32), "b"))
    elif b_from == "transpose":
        inputs.append(helper.make_tensor_value_info("bt", TensorProto.FLOAT, [n, 64]))
        nodes.append(helper.make_node("Transpose", ["bt"], ["b"], perm=[1, 0]))
    else:
        inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, n]))
        nodes.append(helper.make_node("Relu", ["x"], ["b"]))
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="node_mm")
    node.metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="ffn.down"))
    nodes.append(node)
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, n])],
                              initializer=inits, value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT,
                                                                                          [64, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _run(model: bytes, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_wide_computed_matmul_is_split_into_slices_with_the_same_values():
    model = _model(3072)
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMul") == 3 and "Split" in ops and ops[-1] == "Concat"
    assert all({p.key: p.value for p in n.metadata_props}.get("ortlab.module") == "ffn.down"
               for n in proto.graph.node if n.op_type in ("Split", "MatMul", "Concat"))
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((32, 64), dtype=np.float32),
             "x": rng.standard_normal((64, 3072), dtype=np.float32)}
    np.testing.assert_allclose(_run(prepared, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)
    assert {p.key for p in proto.metadata_props} == {MARK}
    assert prepare_for_openvino(prepared) is prepared  # prepared once: recognised without parsing


@pytest.mark.parametrize("n, b_from", [(2048, "input"), (4096, "input"), (3072, "weight"), (3072, "transpose")])
def test_matmuls_openvino_runs_fast_are_left_alone(n, b_from):
    """Narrow or 4096-multiple widths ran at full speed; a weight OpenVINO packs ahead, and a
    transposed B (it fuses the Transpose into the GEMM) take its fast path too."""
    model = _model(n, b_from=b_from)
    assert prepare_for_openvino(model) is model


def test_a_wide_feed_forward_trains_on_openvino_like_eager():
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        pytest.skip(f"OpenVINO does not run here: {providers_module.plugin_notes().get('OpenVINOExecutionProvider')}")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(48, 3072), nn.ReLU(), nn.Linear(3072, 48))
    eager = copy.deepcopy(module)
    om = ortlab.ORTModule(module, providers=["OpenVINOExecutionProvider"])
    for step in range(2):
        x = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(step))
        run_step(eager, om, (x,), seed=step)
    backward = om.report.captures[0].graphs[1]
    assert backward.providers.startswith("OpenVINOExecutionProvider")
    held = backward.parts[0].runner.session_source.model
    assert isinstance(held, bytes) and MARK.encode() in held  # the session holds the prepared model
