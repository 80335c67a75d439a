"""Every notebook runs top to bottom on CPU, and its key outputs are what the text says."""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
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
