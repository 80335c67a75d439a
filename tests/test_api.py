"""The public surface: names, wrapping behaviour, errors for bad input, export for inference."""

from __future__ import annotations

import copy
import importlib
import pathlib
import pickle
import pkgutil
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortlab

RTOL, ATOL = 1e-4, 1e-5


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3))) * self.scale


def test_public_names_and_no_ui_imports():
    assert set(ortlab.__all__) >= {"ORTModule", "DebugOptions", "LogLevel", "OrtlabError", "FallbackError"}
    for name in ortlab.__all__:
        assert hasattr(ortlab, name), name
    for mod in pkgutil.walk_packages(ortlab.__path__, "ortlab."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    code = "import ortlab, sys; print(any(m in sys.modules for m in ('plotly', 'ipywidgets', 'netron')))"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_has_one_source():
    """``ortlab.__version__`` is the version; pyproject.toml reads it from there (the wheel test checks the built
    wheel's metadata against it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packaging.version import Version

    assert str(Version(ortlab.__version__)) == ortlab.__version__
    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ortlab.__version__"}


def test_wrapper_behaves_like_the_module():
    torch.manual_seed(0)
    inner = ConvBN()
    om = ortlab.ORTModule(inner)
    assert om.module is inner
    assert list(om.state_dict()) == list(inner.state_dict())
    assert [n for n, _ in om.named_parameters()] == [n for n, _ in inner.named_parameters()]
    assert [n for n, _ in om.named_buffers()] == [n for n, _ in inner.named_buffers()]
    assert om.conv is inner.conv and om.scale == 1.0
    om.scale = 2.0
    assert inner.scale == 2.0
    om.eval()
    assert not inner.training and not inner.bn.training
    om.train()
    assert inner.training
    # Nested inside a bigger model: keys carry no wrapper prefix.
    outer = nn.Sequential(om)
    assert list(outer.state_dict())[0] == "0.conv.weight"
    outer.load_state_dict(copy.deepcopy(outer.state_dict()))
    with pytest.raises(ortlab.UnsupportedInputError, match="wraps a torch.nn.Module"):
        ortlab.ORTModule(lambda x: x)
    with pytest.raises(ortlab.UnsupportedInputError, match="already an ORTModule"):
        ortlab.ORTModule(om)


def test_batchnorm_stats_attribute_change_and_pickle():
    torch.manual_seed(0)
    eager = ConvBN()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    for step in range(3):
        x = torch.randn(2, 3, 5, 5)
        out, ref = om(x), eager(x)
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
        out.sum().backward()
        ref.sum().backward()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(om.state_dict()[key], value, rtol=RTOL, atol=ATOL, msg=key)
    assert om.bn.num_batches_tracked.item() == 3
    # A changed attribute re-captures: never a stale result.
    om.scale = 3.0
    eager.scale = 3.0
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(om(x), eager(x), rtol=RTOL, atol=ATOL)
    # pickle / deepcopy keep weights and train again.
    for clone in (pickle.loads(pickle.dumps(om)), copy.deepcopy(om)):
        assert isinstance(clone, ortlab.ORTModule)
        assert list(clone.state_dict()) == list(om.state_dict())
        ref_clone = copy.deepcopy(eager)
        x = torch.randn(2, 3, 5, 5)
        torch.testing.assert_close(clone(x), ref_clone(x), rtol=RTOL, atol=ATOL)
        clone(x).sum().backward()
        assert clone.conv.weight.grad is not None


def test_bad_inputs_raise_like_pytorch_and_module_stays_usable():
    torch.manual_seed(0)
    om = ortlab.ORTModule(nn.Linear(4, 3))
    om(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        om(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        om(torch.randn(2, 4, dtype=torch.float64))
    out = om(torch.randn(3, 4))  # still usable
    assert out.shape == (3, 3)
    with pytest.raises(ortlab.UnsupportedInputError, match="torch.from_numpy"):
        om(np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ortlab.UnsupportedInputError, match="pass a list or tuple"):
        om(iter([torch.randn(2, 4)]))
    meta = torch.empty(2, 4, device="meta")
    with pytest.raises(ortlab.DeviceError, match="must share one device"):
        om(meta)
    with pytest.raises(ortlab.UnsupportedInputError, match="to_dense"):
        om(torch.randn(2, 4).to_sparse())
    om.to("meta")  # parameters moved after the fast path learned their device
    with pytest.raises(ortlab.DeviceError, match="must share one device"):
        om(torch.randn(2, 4))


def test_export_onnx_for_inference_matches_eager_eval(tmp_path):
    torch.manual_seed(0)
    eager = ConvBN()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    for _ in range(2):  # move BatchNorm's running stats away from their init
        om(torch.randn(4, 3, 5, 5)).sum().backward()
        eager(torch.randn(4, 3, 5, 5))
    path = om.export_onnx(str(tmp_path / "model.onnx"), torch.randn(2, 3, 5, 5))
    assert om.training  # mode restored
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]  # forward's parameter
    assert [o.name for o in sess.get_outputs()] == ["output"]  # not torch.onnx's "linear"
    batch, *image = sess.get_inputs()[0].shape
    assert isinstance(batch, str) and image == [3, 5, 5]  # the batch is dynamic by default, the image is not
    x = torch.randn(3, 3, 5, 5)  # another batch size than the example's
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    om.module.eval()
    with torch.no_grad():
        want = om.module(x)
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=RTOL, atol=ATOL)


def test_dynamic_true_captures_once_for_all_sizes():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    om = ortlab.ORTModule(copy.deepcopy(eager), dynamic=True)
    for batch in (2, 3, 7):
        x = torch.randn(batch, 6)
        torch.testing.assert_close(om(x), eager(x), rtol=RTOL, atol=ATOL)
    assert len(om.report.captures) == 1
    static = ortlab.ORTModule(copy.deepcopy(eager), dynamic=False)
    for batch in (2, 3, 7):
        static(torch.randn(batch, 6))
    assert len(static.report.captures) == 3


def test_reconfigure_recaptures_with_new_options_and_keeps_weights():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 6)
    om(x).sum().backward()
    assert not om.report.fallbacks
    weights = {k: v.clone() for k, v in om.state_dict().items()}
    om.reconfigure(fallback_ops=["aten.gelu"], profile=True)
    assert om.options.fallback_ops == ("aten.gelu",) and om.options.profile
    om.zero_grad()
    out = om(x)
    out.sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(out, eager(x), rtol=RTOL, atol=ATOL)
    assert [f.op for f in om.report.fallbacks] == ["aten.gelu"]
    for key, value in weights.items():
        assert torch.equal(om.state_dict()[key], value)
    forward = om.report.captures[0].graphs[0]
    assert forward.graph_module is not None and len(forward.runners) == forward.ort_partitions == 2
    profile = forward.runners[0].session.end_profiling()
    assert profile.endswith(".json")
    with pytest.raises(ortlab.ConfigError, match="valid options"):
        om.reconfigure(recompte="auto")


def test_providers_as_one_string_is_a_clear_error_not_a_provider_per_character():
    """``providers="CPUExecutionProvider"`` once became ('C', 'P', 'U', ...), and every graph fell back to PyTorch."""
    with pytest.raises(ortlab.ConfigError, match=r"providers=\['CPUExecutionProvider'\]"):
        ortlab.ORTModule(torch.nn.Linear(2, 2), providers="CPUExecutionProvider")
    with pytest.raises(ortlab.ConfigError, match="non-empty provider names"):
        ortlab.ORTModule(torch.nn.Linear(2, 2), providers=[])
    assert ortlab.ORTModule(torch.nn.Linear(2, 2), providers=["CPUExecutionProvider"]).options.providers == (
        "CPUExecutionProvider",)
