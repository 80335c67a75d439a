"""`ortlab demo`: the main job runs end to end on a small budget."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_trains_reports_and_writes_stages(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "ortlab", "demo", "--steps", "12", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "ortlab first-step report" in text
    assert "loss:" in text and "vs eager" in text
    files = os.listdir(out)
    assert any(f.endswith("_forward_exported_train.onnx") for f in files)
    assert any(f.endswith("_backward_train.py") for f in files)
