"""DebugOptions and ORTLAB_* variables: every stage of every captured graph is saved."""

from __future__ import annotations

import logging
import os

import onnx
import onnxruntime as ort
import pytest
import torch

import ortlab
from models import TanhNet  # tests/models.py (conftest puts tests/ on sys.path)


def test_all_stages_saved_with_names(tmp_path):
    debug = ortlab.DebugOptions(save_onnx=True, onnx_prefix="net", save_path=str(tmp_path))
    om = ortlab.ORTModule(TanhNet(reduce=False), debug_options=debug)
    om(torch.randn(4, 6)).sum().backward()
    om.eval()
    with torch.no_grad():
        om(torch.randn(4, 6))
    names = set(os.listdir(tmp_path))
    expected_train = [
        "net_captured_train.py",
        "net_joint_train.py",
        "net_forward_train.py",
        "net_backward_train.py",
        "net_forward_exported_train.onnx",
        "net_backward_exported_train.onnx",
        "net_forward_onnxscript_train.onnx",
        "net_backward_onnxscript_train.onnx",
        "net_forward_ort_basic_train.onnx",
        "net_forward_ort_extended_train.onnx",
        "net_forward_ort_all_train.onnx",
        "net_forward_execution_train.onnx",
        "net_backward_execution_train.onnx",
    ]
    for name in expected_train:
        assert name in names, (name, sorted(names))
    # The eval call is a second captured graph: g1, inference stages, eval suffix.
    assert "net_g1_captured_eval.py" in names
    assert "net_g1_inference_exported_eval.onnx" in names
    assert "net_g1_inference_execution_eval.onnx" in names
    # Every saved ONNX file is a valid model onnxruntime can load.
    for name in names:
        if name.endswith(".onnx"):
            onnx.checker.check_model(str(tmp_path / name))
            ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])
    # ONNX nodes carry their provenance.
    model = onnx.load(str(tmp_path / "net_forward_exported_train.onnx"))
    props = {p.key: p.value for n in model.graph.node for p in n.metadata_props}
    assert "ortlab.fx_node" in props and "ortlab.module" in props and "ortlab.source" in props
    modules = {p.value for n in model.graph.node for p in n.metadata_props if p.key == "ortlab.module"}
    assert {"fc1", "fc2"} <= modules
    assert "saved stages" in str(om.report)


def test_env_vars_override_debug_options(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTLAB_SAVE_ONNX", "1")
    monkeypatch.setenv("ORTLAB_ONNX_PREFIX", "envnet")
    monkeypatch.setenv("ORTLAB_SAVE_PATH", str(tmp_path / "stages"))
    monkeypatch.setenv("ORTLAB_LOG_LEVEL", "info")
    debug = ortlab.DebugOptions()
    assert debug.save_onnx and debug.onnx_prefix == "envnet" and debug.log_level == ortlab.LogLevel.INFO
    assert set(debug.from_env) == {"ORTLAB_SAVE_ONNX", "ORTLAB_ONNX_PREFIX", "ORTLAB_SAVE_PATH", "ORTLAB_LOG_LEVEL"}
    om = ortlab.ORTModule(TanhNet(reduce=False), debug_options=debug)
    om(torch.randn(2, 6)).sum().backward()
    assert "envnet_forward_exported_train.onnx" in os.listdir(tmp_path / "stages")


def test_bad_debug_options_say_what_to_do(monkeypatch):
    with pytest.raises(ortlab.ConfigError, match="needs a file-name prefix"):
        ortlab.DebugOptions(save_onnx=True)
    with pytest.raises(ortlab.ConfigError, match="valid: VERBOSE, DEVINFO, INFO, WARNING, ERROR, FATAL"):
        ortlab.DebugOptions(log_level="loud")
    monkeypatch.setenv("ORTLAB_SAVE_ONNX", "maybe")
    with pytest.raises(ortlab.ConfigError, match="ORTLAB_SAVE_ONNX='maybe' is not a boolean"):
        ortlab.DebugOptions()


def test_first_step_report_logged_at_info(caplog):
    om = ortlab.ORTModule(TanhNet(reduce=False), debug_options=ortlab.DebugOptions(log_level="INFO"))
    with caplog.at_level(logging.INFO, logger="ortlab"):
        om(torch.randn(2, 6)).sum().backward()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "ortlab first-step report" in text
    report = str(om.report)
    assert "forward" in report and "backward" in report and "ONNX ops" in report
    assert "fallbacks to PyTorch: none" in report and "graph breaks: none" in report
    assert om.report.first_call_s > 0


def test_without_onnxscript_the_saved_onnxruntime_stages_carry_the_exports_provenance(tmp_path):
    """graph_optimization_level="disable" skips onnxscript: the ort_* and execution files take their nodes'
    provenance from the exported stage (all but a node onnxruntime adds without a name: a Cast here)."""
    import onnx

    from ortlab.models import TinyMLP, make_batch

    om = ortlab.ORTModule(TinyMLP(), graph_optimization_level="disable",
                          debug_options=ortlab.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path)))
    x, y = make_batch("tiny", 8)
    om(x, y).backward()
    assert not list(tmp_path.glob("*_onnxscript_*.onnx"))
    paths = sorted(tmp_path.glob("m_*_ort_all_train.onnx")) + sorted(tmp_path.glob("m_*_execution_train.onnx"))
    assert len(paths) == 4, paths
    for path in paths:
        nodes = [n for n in onnx.load(path).graph.node if n.name]
        assert nodes and all({p.key: p.value for p in n.metadata_props}.get("ortlab.source") for n in nodes), path.name
