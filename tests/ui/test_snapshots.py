"""A reopened notebook shows what the user saw: each live view leaves a static snapshot of its last state."""

from __future__ import annotations

import base64
import json

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CELLS = [
    """import ortlab, torch
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.ui.toggles import RecomputeToggles, FallbackToggles
torch.manual_seed(0)
config = GPTConfig(vocab=50, d_model=32, n_heads=2, n_layers=2, block_size=16)
idx, targets = make_batch("gpt", 4, vocab=50, block_size=16)
model = ortlab.ORTModule(GPT(config))
toggles = RecomputeToggles(model, idx, targets)
toggles""",
    """toggles.preset("layerwise"); print(toggles.apply())""",
    """mon = ortlab.monitor(model, every=1)
mon""",
    """opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(6):
    model(idx, targets).backward(); opt.step(); opt.zero_grad()""",
    """lab = ortlab.explore(GPT(config), idx, targets)
lab.widget()""",
    """lab.run("split"); print("ran")""",
    """FallbackToggles(model, idx, targets)""",
]


def outputs(cell):
    return [o for o in cell.get("outputs", []) if o.get("output_type") in ("display_data", "execute_result")]


def html(o):
    return "".join(o.get("data", {}).get("text/html", ""))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}}).execute()
    return nb


def test_each_view_leaves_a_snapshot_after_its_widget(executed):
    for index in (0, 2, 4, 6):
        outs = outputs(executed.cells[index])
        assert "application/vnd.jupyter.widget-view+json" in outs[0]["data"], index
        assert "ortlab-snapshot" in html(outs[1]) and "<b>Snapshot</b> of the" in html(outs[1]), index
        assert "run the cell again" in html(outs[1])
        # the rule hiding it beside a live widget (Note [A snapshot hides while its widget lives])
        assert ":has(.widget-box)" in html(outs[1])


def test_snapshots_hold_the_last_state_not_the_first(executed):
    toggles = html(outputs(executed.cells[0])[1])
    # Applied in the next cell: the saved snapshot shows the policy in force and the Apply's result.
    assert "policy in force <code>layerwise</code>" in toggles and "last Apply: saved activations" in toggles
    assert "blocks.0" in toggles and "recomputed" in toggles
    monitor = outputs(executed.cells[2])
    assert "the monitor" in html(monitor[1])
    figure = monitor[2]["data"]["application/vnd.plotly.v1+json"]
    loss = next(t for t in figure["data"] if t.get("name", "").startswith("loss"))["y"]
    steps = len(base64.b64decode(loss["bdata"])) // 8 if isinstance(loss, dict) else len(loss)  # plotly 6: binary
    assert steps >= 6  # the steps of the later cell, not the empty plot first shown
    stepper = html(outputs(executed.cells[4])[1])
    assert "split" in stepper and "done" in stepper
    fallback = html(outputs(executed.cells[6])[1])
    assert "fallback_ops = <code>[]</code>" in fallback and "onnxruntime" in fallback


def test_a_saved_notebook_keeps_the_snapshots(executed, tmp_path):
    path = tmp_path / "saved.ipynb"
    nbformat.write(executed, path)
    text = json.dumps(nbformat.read(path, as_version=4).cells[0].outputs)
    assert "ortlab-snapshot" in text and "layerwise" in text
