"""Note [Wide MatMuls for OpenVINO]: the model OpenVINO is given splits the MatMuls its GEMM runs slowly,
computes the same values, and is what the session (and the cache) hold; Note [Scatters of nothing for
OpenVINO]: it has no ScatterND without an index, which the plugin refuses."""

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
from ortlab.runtime.openvino import CUDA_MARK, MARK, _drop_unused, prepare_for_openvino, preparation
from ortlab.runtime.providers import prepare_model
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


def _deep_model(m: int | str, k: int, n: int) -> bytes:
    """``y = a @ relu(x)``, ``a`` ``[m, k]`` (``m`` may be symbolic), ``x`` ``[k, n]``."""
    nodes = [helper.make_node("Relu", ["x"], ["b"]), helper.make_node("MatMul", ["a", "b"], ["y"], name="node_mm")]
    nodes[1].metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="fc"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.mark.parametrize("m", [128, "rows"])
def test_a_deep_computed_matmul_is_computed_transposed_with_the_same_values(m):
    """Note [Deep MatMuls for OpenVINO]: dY @ W with K >= 2N runs as (W^T dY^T)^T; a symbolic M counts
    as 256 rows (label sparsity's kept rows)."""
    model = _deep_model(m, 4096, 512)
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["Relu", "Transpose", "Transpose", "MatMul", "Transpose"]
    assert proto.graph.node[-1].output[0] == "y" and proto.graph.node[-1].name == "node_mm"
    assert all({p.key: p.value for p in n.metadata_props}.get("ortlab.module") == "fc" for n in proto.graph.node[1:])
    assert [p.value for p in proto.metadata_props if p.key == MARK] == ["1 MatMul(s) computed transposed"]
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((128, 4096), dtype=np.float32),
             "x": rng.standard_normal((4096, 512), dtype=np.float32)}
    np.testing.assert_allclose(_run(prepared, feeds), _run(model, feeds), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m, k, n", [(128, 2048, 2048), (16, 4096, 512), (1024, 1024, 256)])
def test_matmuls_that_are_not_deep_are_left_as_they_are(m, k, n):
    """K below twice N, too little work, or K below 2048: the transposes would cost what they save."""
    model = _deep_model(m, k, n)
    assert prepare_for_openvino(model) is model


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


def test_a_deep_feed_forward_trains_on_openvino_like_eager():
    """Note [Deep MatMuls for OpenVINO]: the input gradient of Linear(256, 4096) at 256 tokens (a layer
    before it needs it) is computed transposed in the model OpenVINO runs, and the step matches eager's."""
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        pytest.skip(f"OpenVINO does not run here: {providers_module.plugin_notes().get('OpenVINOExecutionProvider')}")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256))
    eager = copy.deepcopy(module)
    om = ortlab.ORTModule(module, providers=["OpenVINOExecutionProvider"])
    for step in range(2):
        x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(step))
        run_step(eager, om, (x,), seed=step)
    held = om.report.captures[0].graphs[1].parts[0].runner.session_source.model
    done = [p.value for p in onnx.load_from_string(held).metadata_props if p.key == MARK]
    assert done and "computed transposed" in done[0], done


def _scatter_model(indices_shape: tuple[int, ...], *, result_is_output: bool) -> bytes:
    """``ScatterND(data, indices, updates)`` with constant ``indices`` of ``indices_shape``, then a Relu
    (or the scatter's result as the graph output itself)."""
    q = int(np.prod(indices_shape[:-1]))
    indices = np.zeros(indices_shape, np.int64)
    updates_shape = [*indices_shape[:-1], *([4, 3][indices_shape[-1]:])]
    nodes = [helper.make_node("ScatterND", ["data", "indices", "updates"], ["scattered"], name="node_scatter")]
    nodes[0].metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="rotary"))
    out = "scattered"
    if not result_is_output:
        nodes.append(helper.make_node("Relu", ["scattered"], ["y"]))
        out = "y"
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("updates", TensorProto.FLOAT, updates_shape)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [4, 3])],
        initializer=[numpy_helper.from_array(indices, "indices")])
    assert q == 0 or indices_shape[-1] < 2
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.mark.parametrize("result_is_output", [False, True])
def test_a_scatter_without_an_index_gives_way_to_its_data(result_is_output):
    """Note [Scatters of nothing for OpenVINO]: the plugin refused graphs holding one."""
    model = _scatter_model((0, 1), result_is_output=result_is_output)
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "ScatterND" not in ops and ops == (["Identity"] if result_is_output else ["Relu"])
    assert {p.key: p.value for p in proto.metadata_props} == {MARK: "1 ScatterND(s) without an index dropped"}
    data = np.random.default_rng(0).standard_normal((4, 3), dtype=np.float32)
    feeds = {"data": data, "updates": np.zeros((0, 3), np.float32)}
    np.testing.assert_array_equal(_run(prepared, feeds), _run(model, feeds))


def test_a_scatter_that_replaces_the_whole_tensor_is_kept():
    """Indices of shape ``[1, 0]`` hold one (empty) index: one update, of the whole tensor."""
    model = _scatter_model((1, 0), result_is_output=False)
    assert prepare_for_openvino(model) is model


def test_an_empty_slice_scatter_trains_on_openvino_like_eager():
    """Phi-3's rotary embedding covers the whole head: ``torch.cat`` joins an empty pass-through part, and the
    backward's scatter of it made OpenVINO refuse the graph, which then ran in PyTorch."""
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        pytest.skip(f"OpenVINO does not run here: {providers_module.plugin_notes().get('OpenVINOExecutionProvider')}")

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.q(x)
            rot, kept = h[..., :16], h[..., 16:]  # kept has no columns
            rot = torch.cat((-rot[..., 8:], rot[..., :8]), dim=-1) * 0.5 + rot
            return torch.cat((rot, kept), dim=-1).tanh()

    torch.manual_seed(0)
    module = Rotary()
    eager = copy.deepcopy(module)
    om = ortlab.ORTModule(module, providers=["OpenVINOExecutionProvider"])
    for step in range(2):
        run_step(eager, om, (torch.randn(4, 16, generator=torch.Generator().manual_seed(step)),), seed=step)
    assert not om.report.fallbacks, om.report.fallbacks
    backward = om.report.captures[0].graphs[1]
    assert backward.parts[0].runner.session.get_providers()[0] == "OpenVINOExecutionProvider"
    assert b"ScatterND(s) without an index dropped" in backward.parts[0].runner.session_source.model


def _openvino_session(model: bytes) -> ort.InferenceSession | None:
    """``model`` on OpenVINO's plugin where it runs here (whole, as ortlab builds it), else ``None``."""
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        return None
    from ortlab.config import Options
    from ortlab.runtime.session import build_session

    return build_session(model, Options(providers=["OpenVINOExecutionProvider"]), None, device_type="cpu",
                         quiet=True).session


def _pool_model(shape: tuple[int, ...], out: tuple[int, int], **attrs: object) -> bytes:
    """``MaxPool(x)`` with its indices, both outputs typed (as the exporter's value_info has them)."""
    n, c = shape[:2]
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], name="node_max_pool", **attrs)
    node.metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="stem.pool"))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, *out]),
                               helper.make_tensor_value_info("i", TensorProto.INT64, [n, c, *out])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.mark.parametrize("kernel, stride, padding, dilation, ceil_mode", [
    (3, 2, 1, 1, False),  # ResNet's stem
    (2, 2, 0, 1, True),  # ceil_mode: the last window passes the input's end
    (3, 1, 1, 2, False),  # dilated: the first element inside the input is a dilation step in
    (1, 1, 0, 1, False),  # torchlib's own 1x1 pool for the indices' offsets
])
def test_a_max_pools_indices_are_computed_as_pytorch_picks_them(kernel, stride, padding, dilation, ceil_mode):
    """Note [Max pools' indices for OpenVINO]: the plugin ran MaxPool's indices on its reference kernel
    (228 ms of a ResNet-18 forward); the model it is given computes them, and they are PyTorch's: the first
    of equal values (ReLU's zeros), the first element inside the input where a window is all -inf."""
    x = torch.relu(torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(0)))  # ties at 0
    x[0, 1] = -float("inf")  # a plane of -inf: every window's maximum is -inf
    x[1, 2, :4, :4] = -float("inf")  # -inf beside the padding
    values, indices = torch.nn.functional.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode,
                                                     return_indices=True)
    model = _pool_model(tuple(x.shape), tuple(values.shape[2:]), kernel_shape=[kernel] * 2, strides=[stride] * 2,
                        pads=[padding] * 4, dilations=[dilation] * 2, ceil_mode=int(ceil_mode))
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    assert "MaxPool" not in {n.op_type for n in proto.graph.node}
    assert all({p.key: p.value for p in n.metadata_props}.get("ortlab.module") == "stem.pool"
               for n in proto.graph.node)
    assert {p.key: p.value for p in proto.metadata_props} == {MARK: "1 MaxPool(s) with their indices computed"}
    planes = (torch.arange(6).reshape(2, 3, 1, 1) * 81).expand_as(indices)  # ONNX's indices are flat
    sessions = [ort.InferenceSession(prepared, providers=["CPUExecutionProvider"]), _openvino_session(prepared)]
    for session in filter(None, sessions):
        y, i = session.run(None, {"x": x.numpy()})
        np.testing.assert_array_equal(y, values.numpy())
        np.testing.assert_array_equal(i, (indices + planes).numpy())


def test_pools_without_indices_or_static_shapes_are_left_as_they_are():
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    assert prepare_for_openvino(model) is model
    symbolic = _pool_model(("batch", 3, 8, 8), (4, 4), kernel_shape=[2, 2], strides=[2, 2])
    assert prepare_for_openvino(symbolic) is symbolic


def _input_gradient_model(n: int, c: int, co: int, size: int, k: int, stride: int, pad: int,
                          from_nchw: bool = False) -> bytes:
    """A convolution's input gradient as ortlab's decomposition exports it: ``Col2Im(Transpose(Reshape(
    MatMul(Transpose(W), dY))))``, W ``[Co, C*k*k]``, dY ``[Co, N*Ho*Wo]`` (given, or ``from_nchw``: a
    reshaped transpose of dY as ``[N, Co, Ho, Wo]``, as in the exported backward)."""
    ho = (size + 2 * pad - k) // stride + 1
    ints = {"img": [size, size], "blk": [k, k], "to3": [-1, n, ho * ho]}
    nodes, dy = [], helper.make_tensor_value_info("dy", TensorProto.FLOAT, [co, n * ho * ho])
    if from_nchw:
        ints["to2"] = [co, n * ho * ho]
        nodes = [helper.make_node("Transpose", ["dy4"], ["dyt"], perm=[1, 0, 2, 3]),
                 helper.make_node("Reshape", ["dyt", "to2"], ["dy"])]
        dy = helper.make_tensor_value_info("dy4", TensorProto.FLOAT, [n, co, ho, ho])
    nodes += [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
              helper.make_node("MatMul", ["wt", "dy"], ["m"]), helper.make_node("Reshape", ["m", "to3"], ["r"]),
              helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0, 2]),
             helper.make_node("Col2Im", ["t", "img", "blk"], ["dx"], name="node_col2im", strides=[stride] * 2,
                              pads=[pad] * 4, dilations=[1, 1])]
    nodes[-1].metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="layer1.conv"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("w", TensorProto.FLOAT, [co, c * k * k]), dy],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [n, c, size, size])],
        initializer=[numpy_helper.from_array(np.array(v, np.int64), name) for name, v in ints.items()],
        value_info=[helper.make_tensor_value_info("dy", TensorProto.FLOAT, [co, n * ho * ho])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.mark.parametrize("size, k, stride, pad, from_nchw", [
    (8, 3, 1, 1, False), (9, 3, 2, 1, False), (8, 1, 2, 0, False), (8, 3, 1, 1, True)])
def test_a_convolutions_input_gradient_is_a_transposed_convolution_for_openvino(size, k, stride, pad, from_nchw):
    """Note [Input gradients of convolutions for OpenVINO]: the plugin ran Col2Im on its reference kernel.
    Where dY is a reshaped transpose of dY as ``[N, Co, Ho, Wo]``, the ConvTranspose reads that."""
    model = _input_gradient_model(2, 4, 6, size, k, stride, pad, from_nchw)
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node if n.op_type not in ("Constant", "Reshape", "Transpose")] == \
        ["ConvTranspose"]
    if from_nchw:
        assert [n.op_type for n in proto.graph.node] == ["Constant", "Reshape", "ConvTranspose"]
    assert not proto.graph.initializer  # the pattern's shapes went with it
    assert {p.key: p.value for p in proto.metadata_props} == {MARK: "1 Col2Im(s) as ConvTranspose"}
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim], dtype=np.float32)
             for i in proto.graph.input}
    expected = _run(model, feeds)
    np.testing.assert_allclose(_run(prepared, feeds), expected, rtol=1e-5, atol=1e-5)
    session = _openvino_session(prepared)
    if session is not None:
        np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size, k, stride, pad, from_nchw", [(9, 3, 2, 1, False), (8, 3, 1, 1, True)])
def test_a_convolutions_input_gradient_is_a_transposed_convolution_for_cuda(size, k, stride, pad, from_nchw):
    """Note [Input gradients of convolutions on CUDA]: onnxruntime's CUDA provider has no Col2Im, which
    ran on the CPU with copies each way. The CUDA provider's model gets the ConvTranspose alone."""
    model = _input_gradient_model(2, 4, 6, size, k, stride, pad, from_nchw)
    prepared = prepare_model("CUDAExecutionProvider", model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    assert "Col2Im" not in [n.op_type for n in proto.graph.node] and \
        [n.op_type for n in proto.graph.node].count("ConvTranspose") == 1
    assert {p.key: p.value for p in proto.metadata_props} == {CUDA_MARK: "1 Col2Im(s) as ConvTranspose"}
    assert preparation(prepared) == "CUDA's model: 1 Col2Im(s) as ConvTranspose"
    assert prepare_model("CUDAExecutionProvider", prepared) is prepared  # once
    assert prepare_model("CPUExecutionProvider", model) is model
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim], dtype=np.float32)
             for i in proto.graph.input}
    np.testing.assert_allclose(_run(prepared, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


def test_the_cuda_model_of_a_batch_norm_backward_computes_the_same_gradients():
    """The exported backward of convolutions with batch norm as the CUDA provider is given it: every Col2Im a
    ConvTranspose; run here on the CPU provider in place of the exported one, the gradients are eager's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1),
                           nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    eager = copy.deepcopy(module)
    om = ortlab.ORTModule(module, providers=["CPUExecutionProvider"], graph_optimization_level="basic")
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    run_step(eager, om, (x,), seed=0)
    backward = next(g for g in om.report.captures[0].graphs if g.name == "backward")
    runner = backward.parts[0].runner
    exported = runner.session_source.model
    prepared = prepare_model("CUDAExecutionProvider", exported)
    ops = [n.op_type for n in onnx.load_from_string(prepared).graph.node]
    assert [n.op_type for n in onnx.load_from_string(exported).graph.node].count("Col2Im") == 1  # x needs no gradient
    assert "Col2Im" not in ops and ops.count("ConvTranspose") == 1
    runner.swap_session(ort.InferenceSession(prepared, providers=["CPUExecutionProvider"]))
    for step in (1, 2):
        run_step(eager, om, (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step)),), seed=step)


def test_what_a_subgraph_reads_is_kept_when_unused_nodes_go():
    """An If's branch reads ``y`` from the outer graph, not through its inputs: ``y``'s node stays."""
    branch = helper.make_graph([helper.make_node("Identity", ["y"], ["r"])], "then", [],
                               [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["r2"])], "else", [],
                              [helper.make_tensor_value_info("r2", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["unread"]),
             helper.make_node("If", ["c"], ["out"], then_branch=branch, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])])
    _drop_unused(graph)
    assert [n.op_type for n in graph.node] == ["Relu", "If"]


def test_a_small_resnet_trains_on_openvino_like_eager():
    """The stem's max pool (its indices) and the convolutions' input gradients in the model OpenVINO runs:
    the step matches eager's, outputs and gradients."""
    if "OpenVINOExecutionProvider" not in providers_module.plugin_eps():
        pytest.skip(f"OpenVINO does not run here: {providers_module.plugin_notes().get('OpenVINOExecutionProvider')}")
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                           nn.Conv2d(8, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 2, 1), nn.Flatten(),
                           nn.Linear(16 * 2 * 2, 10))
    eager = copy.deepcopy(module)
    om = ortlab.ORTModule(module, providers=["OpenVINOExecutionProvider"])
    for step in range(2):
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(step))
        run_step(eager, om, (x,), seed=step)
    for name, buffer in eager.named_buffers():  # batch norm's running statistics
        torch.testing.assert_close(dict(om.named_buffers())[name], buffer, rtol=1e-4, atol=1e-5)
    graphs = om.report.captures[0].graphs
    done = {g.name: [p.value for p in onnx.load_from_string(g.parts[0].runner.session_source.model).metadata_props
                     if p.key == MARK] for g in graphs}
    assert done["forward"] == ["1 MaxPool(s) with their indices computed"] or \
        "MaxPool(s) with their indices computed" in done["forward"][0], done
    assert "Col2Im(s) as ConvTranspose" in done["backward"][0], done
    assert "weight gradient(s) as a swapped Conv" in done["backward"][0], done  # the 8x8 outputs
    assert f"OpenVINO's model: {done['backward'][0]} (ortlab/runtime/openvino.py)" in str(om.report)


def _weight_gradient_model(n: int, c: int, co: int, size: int, k: int, stride: int, pad: int) -> bytes:
    """A convolution's weight gradient as ortlab's decomposition exports it: ``MatMul(Reshape(Transpose(dY)),
    Transpose(Reshape(Concat(Unsqueeze(Slice(Slice(Pad(Transpose(x)))))))))``, each window two Slices as the
    exporter writes them, taken from the input with batch and channels swapped."""
    ho = (size + 2 * pad - k) // stride + 1
    ints = {"pads": [0, 0, pad, pad, 0, 0, pad, pad], "ax2": [2], "ax3": [3], "step": [stride], "at": [1],
            "cols": [c * k * k, -1], "rows": [co, -1]}
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
             helper.make_node("Pad", ["xt", "pads"], ["xp"])]
    for i in range(k):
        for j in range(k):
            ints.update({f"b{i}": [i], f"e{i}": [i + stride * (ho - 1) + 1], f"c{j}": [j],
                         f"f{j}": [j + stride * (ho - 1) + 1]})
            nodes += [helper.make_node("Slice", ["xp", f"b{i}", f"e{i}", "ax2", "step"], [f"r{i}{j}"]),
                      helper.make_node("Slice", [f"r{i}{j}", f"c{j}", f"f{j}", "ax3", "step"], [f"w{i}{j}"]),
                      helper.make_node("Unsqueeze", [f"w{i}{j}", "at"], [f"u{i}{j}"])]
    nodes += [helper.make_node("Concat", [f"u{i}{j}" for i in range(k) for j in range(k)], ["stack"], axis=1),
              helper.make_node("Reshape", ["stack", "cols"], ["patches"]),
              helper.make_node("Transpose", ["patches"], ["pt"], perm=[1, 0]),
              helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
              helper.make_node("Reshape", ["dyt", "rows"], ["g"]),
              helper.make_node("MatMul", ["g", "pt"], ["dw"], name="node_mm")]
    nodes[-1].metadata_props.append(onnx.StringStringEntryProto(key="ortlab.module", value="layer1.conv"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, size, size]),
                     helper.make_tensor_value_info("dy", TensorProto.FLOAT, [n, co, ho, ho])],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, [co, c * k * k])],
        initializer=[numpy_helper.from_array(np.array(v, np.int64), name) for name, v in ints.items()],
        value_info=[helper.make_tensor_value_info("stack", TensorProto.FLOAT, [c, k * k, n, ho, ho]),
                    helper.make_tensor_value_info("xp", TensorProto.FLOAT, [c, n, size + 2 * pad, size + 2 * pad])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.mark.parametrize("size, k, stride, pad", [(16, 3, 1, 1), (16, 3, 2, 1), (8, 3, 1, 1)])
def test_a_convolutions_weight_gradient_is_a_swapped_convolution_for_openvino(size, k, stride, pad):
    """Note [Weight gradients of convolutions for OpenVINO]: the patches' strided Slices ran on the plugin's
    reference kernels; from 64 output positions the gradient is a convolution of the input with dY."""
    model = _weight_gradient_model(2, 3, 4, size, k, stride, pad)
    prepared = prepare_for_openvino(model)
    proto = onnx.load_from_string(prepared)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "Conv" in ops and "MatMul" not in ops and "Concat" not in ops, ops
    assert {p.key: p.value for p in proto.metadata_props} == {MARK: "1 weight gradient(s) as a swapped Conv"}
    assert proto.graph.node[-1].output[0] == "dw" and proto.graph.node[-1].name == "node_mm"
    rng = np.random.default_rng(0)
    ho = (size + 2 * pad - k) // stride + 1
    feeds = {"x": rng.standard_normal((2, 3, size, size), dtype=np.float32),
             "dy": rng.standard_normal((2, 4, ho, ho), dtype=np.float32)}
    expected = torch.nn.grad.conv2d_weight(torch.from_numpy(feeds["x"]), (4, 3, k, k), torch.from_numpy(feeds["dy"]),
                                           stride=stride, padding=pad).reshape(4, -1).numpy()
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_run(prepared, feeds), expected, rtol=1e-4, atol=1e-5)
    session = _openvino_session(prepared)
    if session is not None:
        np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size, k", [(4, 3), (16, 1)])
def test_a_weight_gradient_with_few_output_positions_or_a_1x1_kernel_keeps_its_gemm(size, k):
    """4x4 outputs: the swapped convolution was slower there (5.2 -> 8.7 ms); a 1x1 kernel's patches are one
    slice, and the swap was not measured there."""
    model = _weight_gradient_model(2, 3, 4, size, k, 1, 1 if k == 3 else 0)
    assert prepare_for_openvino(model) is model


def test_the_exported_weight_gradients_are_the_pattern_openvino_is_given_as_convolutions():
    """The decomposition's real export (not a model written by hand) is what the matcher finds: a small ResNet's
    backward, prepared for OpenVINO, swaps the weight gradients with 64 or more output positions, and the
    prepared model computes what the exported one does (run here on the CPU provider)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
                           nn.Conv2d(16, 16, 3, 1, 1, dilation=1), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    om = ortlab.ORTModule(module)
    om(torch.randn(2, 3, 16, 16)).sum().backward()
    backward = next(g for g in om.report.captures[0].graphs if g.name == "backward")
    model = backward.parts[0].runner.session_source.model
    prepared = prepare_for_openvino(model)
    marks = {p.key: p.value for p in onnx.load_from_string(prepared).metadata_props}
    assert "3 weight gradient(s) as a swapped Conv" in marks.get(MARK, ""), marks
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        assert i.type == "tensor(float)", i
        feeds[i.name] = rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.float32)
    want = session.run(None, feeds)
    got = ort.InferenceSession(prepared, providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
