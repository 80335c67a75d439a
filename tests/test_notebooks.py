"""Every notebook runs top to bottom on CPU, and its key outputs are what the text says."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run(name: str) -> tuple[nbformat.NotebookNode, float]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb, time.perf_counter() - start


def text_of(nb: nbformat.NotebookNode) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") or "".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def html_of(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for c in nb.cells for o in c.get("outputs", []))


def test_quickstart():
    nb, seconds = run("quickstart.ipynb")
    text = text_of(nb)
    assert seconds < 180
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first
    assert "ortlab first-step report" in text and "fallbacks to PyTorch: none" in text
    before, after = (int(x.replace(",", "")) for x in re.search(r"saved activations: ([\d,]+) bytes -> ([\d,]+) bytes", text).groups())
    assert after * 2 <= before
    worst = float(re.search(r"largest gradient difference ([\d.e+-]+)", text).group(1))
    assert worst < 1e-4
    kernels = html_of(nb).split("Slowest onnxruntime kernels")[1]  # mon.kernel_table(): linked, with its view
    assert "title='open in netron'" in kernels and "<iframe" in kernels


def test_stages_and_graphs():
    nb, seconds = run("stages_and_graphs.ipynb")
    text = text_of(nb)
    assert seconds < 180
    for stage in ("captured", "joint", "split", "exported", "onnxscript", "ort_basic", "ort_extended", "ort_all", "step"):
        assert f"('{stage}', 'done')" in text
    assert "<iframe" in html_of(nb) or "IFrame" in text  # the netron view
    widgets = [o for c in nb.cells for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets, "the stepper (lab.widget()) is shown"
    split_again = html_of(nb).split("Saved activations")[-1]  # lab["split"] shown again once a view is open
    assert "title='open in netron'" in split_again


def test_memory_and_recompute():
    nb, seconds = run("memory_and_recompute.ipynb")
    text = text_of(nb)
    assert seconds < 180
    before, after = (int(x.replace(",", "")) for x in re.search(r"saved activations ([\d,]+) -> ([\d,]+) bytes", text).groups())
    assert after * 2 <= before
    assert "one activation:" in text
    budget, saved, none = (int(x.replace(",", "")) for x in re.search(
        r"budget ([\d,]+) bytes: saves ([\d,]+) of ([\d,]+) bytes", text).groups())
    assert saved <= budget == none // 2 and re.search(r"recomputes [\d.]+ [kMG]?FLOP \([\d.]+% of the forward\)", text)
    assert "measuring budget 10% (7/7)" in text and "back to budget 50%: re-capture" in text


def test_performance():
    nb, seconds = run("performance.ipynb")
    text = text_of(nb)
    assert seconds < 180
    assert re.search(r"steps recorded: (39|40)", text)
    assert re.search(r"step [\d.]+ ms: onnxruntime kernels [\d.]+ ms \(\d+%\)", text)  # the timeline
    assert "trace: " in text and "onnxruntime g0.forward" in json.dumps(nb)  # its figure's lanes
    kernels = html_of(nb).split("Slowest onnxruntime kernels")[1].split("compare_speed:")[0]
    assert kernels.count("title='open in netron'") == 10 and "<iframe" in kernels
    assert re.search(r"\d+ ops; \d+ op groups in PyTorch", text)
    # compare_speed: the verdict by the noise rule, the row losing most, its chart and its linked table
    assert re.search(r"eager [\d.]+ ms \(.*\) -> ortlab [\d.]+ ms \(.*\): (within noise|[\d.]+x (faster|slower))", text)
    assert re.search(r"most time lost: \S+", text)
    speed = html_of(nb).split("compare_speed:")[-1]
    assert "title='open in netron'" in speed and "<iframe" in speed and "eager / ortlab" in speed
    assert "Where ortlab loses (right) or gains (left) time a step" in json.dumps(nb)


def test_divergence():
    nb, seconds = run("divergence.ipynb")
    text = text_of(nb)
    assert seconds < 180
    assert "matches eager: True" in text
    assert "first divergence: g0.forward gelu_1 aten.gelu at blocks.1" in text
    assert "ops whose fallback removes the divergence: ['aten.gelu']" in text
    page = html_of(nb)
    assert "title='open in netron'" in page.split("ortlab.compare: DIVERGED")[1]  # diverged nodes link to netron
    bisect = page.split("ortlab bisect:")[1]
    assert "step matches eager" in bisect and "the repro script (" in bisect
    assert "g0.forward gelu_1 (aten.gelu) at blocks.1" in bisect.split("the repro script (")[1]  # the culprit's node
    assert "fallback_ops=[&#x27;aten.gelu&#x27;]" in bisect
