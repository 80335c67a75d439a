"""`ortlab demo`: the main job runs end to end on a small budget."""

from __future__ import annotations

import os
import subprocess
import sys

from ortlab.cli import speed_summary


def test_demo_trains_reports_and_writes_stages(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "ortlab", "demo", "--steps", "12", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, unbuffered: the report's place against the progress bar shows
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert "ortlab first-step report" in text
    # The report comes after the finished bar, on lines of its own, not into the bar while it runs.
    bar_done = max(i for i, line in enumerate(lines) if "12/12" in line)
    report = next(i for i, line in enumerate(lines) if line.startswith("first step took "))
    assert report > bar_done, text[-3000:]
    assert "loss:" in text
    assert any(line.startswith("speed: ortlab ") and line.endswith("above 1x ortlab is faster)") for line in lines)
    files = os.listdir(out)
    assert any(f.endswith("_forward_exported_train.onnx") for f in files)
    assert any(f.endswith("_backward_train.py") for f in files)


def test_speed_summary_says_which_way_the_ratio_goes():
    assert speed_summary(13.2, 12.3, 20) == (
        "speed: ortlab 0.93x eager PyTorch's (median step: eager 12.3 ms, ortlab 13.2 ms; "
        "20 alternating steps each; above 1x ortlab is faster)"
    )
    assert speed_summary(10.0, 15.0, 20).startswith("speed: ortlab 1.50x eager PyTorch's ")
