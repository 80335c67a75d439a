"""Graph output names of models exported for plain onnxruntime (``ortlab.onnx.output_names``)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import ortlab
from ortlab._compat.torch import pytree
from ortlab.onnx.output_names import ORIGINAL_NAME_KEY, default_output_names, name_outputs

Pair = collections.namedtuple("Pair", ["scores", "hidden"])


@pytest.mark.parametrize(
    ("returned", "names"),
    [
        (torch.zeros(1), ["output"]),
        ((torch.zeros(1), torch.zeros(1)), ["output_0", "output_1"]),
        ({"logits": torch.zeros(1), "aux": (torch.zeros(1), torch.zeros(1))}, ["logits", "aux.0", "aux.1"]),
        (Pair(torch.zeros(1), torch.zeros(1)), ["scores", "hidden"]),
        ([torch.zeros(1), {"a": torch.zeros(1)}], ["output_0", "output_1.a"]),
    ],
    ids=["tensor", "tuple", "nested-dict", "namedtuple", "list-of-dict"],
)
def test_default_names_follow_what_forward_returns(returned, names):
    spec = pytree.tree_structure(returned)
    assert default_output_names(spec, len(names)) == names


def test_default_names_are_numbered_when_the_structure_does_not_fit():
    spec = pytree.tree_structure((torch.zeros(1), torch.zeros(1)))
    assert default_output_names(spec, 3) == ["output_0", "output_1", "output_2"]
    assert default_output_names(None, 1) == ["output"]


def _model() -> ir.Model:
    """``x`` returned as it is, and ``Relu(x)``, whose value is already called ``output``."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["output"]), oh.make_node("Neg", ["output"], ["neg_3"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
         oh.make_tensor_value_info("neg_3", onnx.TensorProto.FLOAT, [2])],
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))


def test_renaming_keeps_inputs_and_every_name_unique():
    model = _model()
    name_outputs(model, ["x_again", "output"])
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert [v.name for v in model.graph.outputs] == ["x_again", "output"]
    assert model.graph.outputs[1].metadata_props[ORIGINAL_NAME_KEY] == "neg_3"
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.0, 2.0], dtype=np.float32)
    again, out = session.run(["x_again", "output"], {"x": x})
    np.testing.assert_array_equal(again, x)
    np.testing.assert_array_equal(out, -np.maximum(x, 0))


def test_renaming_rejects_a_wrong_count_or_a_repeated_name():
    with pytest.raises(ortlab.ConfigError, match=r"output_names has 1 name\(s\) \['a'\] but the exported model "
                                                 r"has 2 output\(s\); pass one name per output tensor"):
        name_outputs(_model(), ["a"])
    with pytest.raises(ortlab.ConfigError, match=r"output_names names \['a'\] more than once"):
        name_outputs(_model(), ["a", "a"])


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.relu(self.body(features))
        return {"logits": self.head(hidden), "hidden": hidden}


def test_export_onnx_names_outputs_after_the_returned_dict_and_inputs_after_forward(tmp_path):
    torch.manual_seed(0)
    om = ortlab.ORTModule(_TwoHeads())
    x = torch.randn(2, 4)
    path = om.export_onnx(str(tmp_path / "heads.onnx"), x)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["features"]
    assert [o.name for o in session.get_outputs()] == ["logits", "hidden"]
    (logits,) = session.run(["logits"], {"features": x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), om.module(x)["logits"], rtol=1e-5, atol=1e-6)


def test_export_onnx_takes_the_names_the_user_passes(tmp_path):
    om = ortlab.ORTModule(_TwoHeads())
    path = om.export_onnx(str(tmp_path / "heads.onnx"), torch.randn(2, 4), output_names=["scores", "features_out"])
    assert [o.name for o in onnx.load(path).graph.output] == ["scores", "features_out"]
    with pytest.raises(ortlab.ConfigError, match="output_names has 1 name"):
        om.export_onnx(str(tmp_path / "bad.onnx"), torch.randn(2, 4), output_names=["scores"])
