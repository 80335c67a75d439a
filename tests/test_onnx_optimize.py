"""onnxscript's optimizer as ortlab runs it: which rewrite rules, and what they leave."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

import ortlab

from ortlab.onnx.export import ExportedGraph
from ortlab.onnx.interface import GraphInterface
from ortlab.onnx.optimize import optimize_exported


def _exported(nodes: list, inits: list) -> ExportedGraph:
    graph = oh.make_graph(
        nodes, "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        initializer=inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    return ExportedGraph(ir.from_proto(model), GraphInterface(["tensor"], ["tensor"], [None], [None]), 0.0)


def _const(name: str, values: list[int]) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _nodes(model: ir.Model) -> list:
    """Each node's op, inputs and attributes, in order: what two optimizers must agree on."""
    return [(n.op_type, [v.name if v is not None else None for v in n.inputs],
             {k: str(a.value) for k, a in n.attributes.items()}) for n in model.graph]


def _run(exported: ExportedGraph, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(ir.to_proto(exported.model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_two_slices_of_one_tensor_keep_slices_split(caplog: pytest.LogCaptureFixture) -> None:
    # rotate_half's pattern (Llama): x[..., :n] and x[..., n:]; SlicesSplit can fire, so it runs.
    inits = [_const("b0", [0]), _const("e0", [4]), _const("b1", [4]), _const("e1", [8]), _const("ax", [-1])]
    nodes = [oh.make_node("Slice", ["x", "b0", "e0", "ax"], ["lo"]),
             oh.make_node("Slice", ["x", "b1", "e1", "ax"], ["hi"]),
             oh.make_node("Sub", ["hi", "lo"], ["y"])]
    exported = _exported(nodes, inits)
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    with caplog.at_level(logging.DEBUG, logger="ortlab.onnx.optimize"):
        result = optimize_exported(exported)
    assert result.skipped == ""
    assert "SlicesSplit rule left out" not in caplog.text
    np.testing.assert_array_equal(_run(exported, x), x[:, 4:] - x[:, :4])


def test_a_graph_without_two_slices_of_one_tensor_skips_slices_split(caplog: pytest.LogCaptureFixture) -> None:
    # The rule's two-output matcher walks the graph even when no Slice pair exists
    # (Note [onnxscript's optimizer without SlicesSplit]); the other rules still run.
    inits = [_const("b0", [0]), _const("e0", [4]), _const("ax", [-1]), _const("shape", [2, 4])]
    nodes = [oh.make_node("Slice", ["x", "b0", "e0", "ax"], ["lo"]),
             oh.make_node("Reshape", ["lo", "shape"], ["r1"]),
             oh.make_node("Reshape", ["r1", "shape"], ["y"])]  # ReshapeReshape folds these
    exported = _exported(nodes, inits)
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    with caplog.at_level(logging.DEBUG, logger="ortlab.onnx.optimize"):
        result = optimize_exported(exported)
    assert result.skipped == ""
    assert "SlicesSplit rule left out" in caplog.text
    assert [n.op_type for n in exported.model.graph].count("Reshape") <= 1
    np.testing.assert_array_equal(_run(exported, x), x[:, :4])


@pytest.fixture(scope="module")
def gpt_stages(tmp_path_factory):
    """The saved stages of a tiny GPT's first training step."""
    import torch

    from ortlab.models import GPT, GPTConfig

    folder = tmp_path_factory.mktemp("gpt_stages")
    torch.manual_seed(0)
    om = ortlab.ORTModule(GPT(GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, block_size=16)),
                          debug_options=ortlab.DebugOptions(save_onnx=True, onnx_prefix="g", save_path=str(folder)))
    idx = torch.randint(0, 64, (2, 16))
    om(idx, idx).backward()
    return folder


def test_every_node_onnxruntime_is_given_says_where_it_came_from(gpt_stages):
    """The nodes torchlib's functions inline (the GELU backward's Erf) and those the constant folding
    makes (the Split that replaces qkv.split's SplitToSequence + SequenceAt) carry the FX node, module and
    source line, so the kernel table and the timeline name them."""
    paths = sorted(gpt_stages.glob("g_*_onnxscript_train.onnx"))
    assert len(paths) == 2, paths
    for path in paths:
        nodes = onnx.load(path, load_external_data=False).graph.node
        props = {n.name: {p.key: p.value for p in n.metadata_props} for n in nodes}
        missing = [(n.op_type, n.name) for n in nodes
                   if not (props[n.name].get("ortlab.fx_node") and props[n.name].get("ortlab.source"))]
        assert not missing, (path.name, missing)
        assert "ortlab.module" in props[nodes[0].name]
    def by_op(name: str) -> dict[str, dict[str, str]]:
        nodes = onnx.load(gpt_stages / name, load_external_data=False).graph.node
        return {n.op_type: {p.key: p.value for p in n.metadata_props} for n in nodes}

    forward = by_op("g_forward_onnxscript_train.onnx")
    assert forward["Split"]["ortlab.op"] == "aten.split" and forward["Split"]["ortlab.module"].startswith("blocks.")
    backward = by_op("g_backward_onnxscript_train.onnx")
    assert backward["Erf"]["ortlab.op"] == "aten.erf" and backward["Erf"]["ortlab.module"].startswith("blocks.")


def test_the_saved_onnxruntime_stages_carry_the_provenance_onnxruntime_drops(gpt_stages):
    """onnxruntime's optimized models lose node metadata; the saved ort_* and execution files get it back,
    also on nodes onnxruntime adds beside an exported one (node_Reshape_3_new_reshape), so netron shows it."""
    paths = sorted(gpt_stages.glob("g_*_ort_*_train.onnx")) + sorted(gpt_stages.glob("g_*_execution_train.onnx"))
    assert len(paths) == 8, paths
    for path in paths:
        nodes = onnx.load(path, load_external_data=False).graph.node
        missing = [(n.op_type, n.name) for n in nodes
                   if not {p.key: p.value for p in n.metadata_props}.get("ortlab.source")]
        assert not missing, (path.name, missing)


def _without_plus_zero(model: ir.Model) -> ir.Model:
    """The model without its sums' ``+ 0.0`` (Note [A sum of negative zeros is +0.0]), which onnxscript's inexact
    ``x + 0 -> x`` rule drops and ortlab's rules keep: the graphs compared are otherwise the same."""
    import numpy as np

    for node in list(model.graph):
        if node.op_type != "Add" or len(node.inputs) != 2:
            continue
        zero = node.inputs[1].producer() if node.inputs[1] is not None else None
        value = zero.attributes.get("value") if zero is not None and zero.op_type == "Constant" else None
        array = np.asarray(value.as_tensor().numpy()) if value is not None else None
        if array is None or array.size != 1 or array.item() != 0 or np.signbit(array).any():
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0], replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
    return model


def test_running_only_the_rules_that_can_fire_leaves_the_graph_of_optimize_ir(gpt_stages):
    """Note [Only the rewrite rules that can fire] and Note [Shape inference only where a shape is missing]:
    the same graph, node for node, as onnxscript's own
    optimize_ir on a tiny GPT's exported forward and backward."""
    import onnxscript.optimizer

    from ortlab._compat.onnxscript import optimize

    paths = sorted(gpt_stages.glob("g_*_exported_train.onnx"))
    assert len(paths) == 2, paths

    for path in paths:
        theirs, ours = _without_plus_zero(ir.load(path)), _without_plus_zero(ir.load(path))
        onnxscript.optimizer.optimize_ir(theirs)
        optimize(ours)
        assert _nodes(ours) == _nodes(theirs), path.name


def _rotate_halves(layers: int) -> ir.Model:
    """``layers`` rounds of rotate_half (two Slices of one tensor, a Concat) with Reshape pairs between:
    SlicesSplit runs and ReshapeReshape fires, and most nodes are of neither op."""
    inits = [_const("b0", [0]), _const("e0", [4]), _const("b1", [4]), _const("e1", [8]), _const("ax", [-1]),
             _const("shape", [2, 8]), _const("flat", [16])]
    nodes, x = [], "x"
    for i in range(layers):
        nodes += [oh.make_node("Slice", [x, "b0", "e0", "ax"], [f"lo{i}"]),
                  oh.make_node("Slice", [x, "b1", "e1", "ax"], [f"hi{i}"]),
                  oh.make_node("Neg", [f"hi{i}"], [f"nh{i}"]),
                  oh.make_node("Concat", [f"nh{i}", f"lo{i}"], [f"c{i}"], axis=-1),
                  oh.make_node("Mul", [f"c{i}", x], [f"m{i}"]),
                  oh.make_node("Reshape", [f"m{i}", "flat"], [f"f{i}"]),
                  oh.make_node("Reshape", [f"f{i}", "shape"], [f"r{i}"]),
                  oh.make_node("Add", [f"r{i}", x], [f"x{i}"])]
        x = f"x{i}"
    nodes.append(oh.make_node("Slice", [x, "b0", "e0", "ax"], ["y"]))
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])], initializer=inits)
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))


def test_rules_are_tried_only_at_their_op_and_leave_the_graph_of_optimize_ir(monkeypatch):
    """Note [Only the rewrite rules that can fire]: a rule is tried only at nodes of its pattern's
    (first) output op, and the graph comes out as onnxscript's own optimize_ir leaves it."""
    import onnxscript.optimizer
    from onnxscript import rewriter

    from ortlab._compat.onnxscript import optimize

    theirs, ours = _rotate_halves(8), _rotate_halves(8)
    onnxscript.optimizer.optimize_ir(theirs)
    (split,) = [r for r in rewriter._DEFAULT_REWRITE_RULES if getattr(r, "name", None) == "SlicesSplit"]
    tried: list[str] = []
    original = type(split).try_rewrite

    def counting(self, model, graph_or_function, node, **kwargs):  # noqa: ANN001, ANN202
        if self.name == "SlicesSplit":  # ortlab runs an exact copy of it (Note [Pattern constants matched exactly])
            tried.append(node.op_type)
        return original(self, model, graph_or_function, node, **kwargs)

    monkeypatch.setattr(type(split), "try_rewrite", counting)
    optimize(ours)
    assert _nodes(ours) == _nodes(theirs)
    assert "Reshape" not in [n.op_type for n in ours.graph]  # the Reshape rules fired at each of the 8 pairs
    # Tried at the Slice nodes only (onnxscript alone tries it at all 65 nodes of each round).
    assert tried and set(tried) == {"Slice"}, tried
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    sessions = [ort.InferenceSession(ir.to_proto(m).SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (_rotate_halves(8), ours)]
    np.testing.assert_array_equal(*(sess.run(None, {"x": x})[0] for sess in sessions))


def _expands() -> ir.Model:
    """A scalar expanded to 512 x 1024 (past onnxscript's fold limit) and to 2 x 4 (within it)."""
    inits = [onnx.numpy_helper.from_array(np.array(2.0, dtype=np.float32), "c"),
             _const("big", [512, 1024]), _const("small", [2, 4])]
    nodes = [oh.make_node("Expand", ["c", "big"], ["eb"]), oh.make_node("Mul", ["x", "eb"], ["y"]),
             oh.make_node("Expand", ["c", "small"], ["es"]), oh.make_node("Add", ["x2", "es"], ["z"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [512, 1024]),
                                       oh.make_tensor_value_info("x2", onnx.TensorProto.FLOAT, [2, 4])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [512, 1024]),
                           oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 4])], initializer=inits)
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))


def test_values_too_large_to_keep_are_not_computed_and_the_graph_is_optimize_irs(monkeypatch):
    """Note [Folding what would be dropped]: onnxscript computes the 512 x 1024 Expand and drops it for
    its size; ortlab does not compute it, folds the small one, and leaves optimize_ir's graph."""
    import onnxscript.optimizer
    from onnxscript.optimizer import _constant_folding

    from ortlab._compat.onnxscript import optimize

    evaluated: list[tuple] = []
    original = _constant_folding._reference_evaluator.evaluate

    def recording(domain, op_type, version, *args, **kwargs):  # noqa: ANN001, ANN202
        evaluated.append((op_type, tuple(args[1]) if op_type == "Expand" else None))
        return original(domain, op_type, version, *args, **kwargs)

    monkeypatch.setattr(_constant_folding._reference_evaluator, "evaluate", recording)
    theirs, ours = _expands(), _expands()
    onnxscript.optimizer.optimize_ir(theirs)
    assert ("Expand", (512, 1024)) in evaluated  # onnxscript's own run computes it (and drops it)
    evaluated.clear()
    optimize(ours)
    assert evaluated == [("Expand", (2, 4))], evaluated
    assert _nodes(ours) == _nodes(theirs)
    assert [n.op_type for n in ours.graph] == ["Expand", "Mul", "Add"]  # the small Expand folded, the large kept
    feeds = {"x": np.ones((512, 1024), np.float32), "x2": np.ones((2, 4), np.float32)}
    results = [ort.InferenceSession(ir.to_proto(m).SerializeToString(), providers=["CPUExecutionProvider"])
               .run(None, feeds) for m in (_expands(), ours)]
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
