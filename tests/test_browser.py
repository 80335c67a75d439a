"""A real browser: JupyterLab runs notebooks, their views render and update, table links open netron.

JupyterLab is started on 127.0.0.1 (once for the module) and driven by Playwright with
Debian's chromium (``apt-get install chromium``; ``.ci/run`` installs it). Skipped when
chromium, Playwright or JupyterLab is missing. Screenshots are kept as test artifacts
in ``test-artifacts/``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
OUTPUTS = "() => Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n')"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


class JupyterLab(NamedTuple):
    base: str
    token: str
    root: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[JupyterLab]:
    pytest.importorskip("jupyterlab")
    pytest.importorskip("playwright")
    tmp_path = tmp_path_factory.mktemp("jupyterlab")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", work / "quickstart.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Render every cell, not only those in sight: the tests read all outputs' text.
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), "ortlab-test"
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--ServerApp.disable_check_xsrf=True",
         "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("JupyterLab did not start")
    yield JupyterLab(base, token, work)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a loaded box: JupyterLab still shutting its kernels down
        proc.kill()
        proc.wait(timeout=20)


@pytest.fixture()
def browser() -> Iterator[Any]:
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )
        yield chromium
        chromium.close()


def _run_all(page: Any, lab: JupyterLab, notebook: str, done: str) -> None:
    """Open ``notebook`` in JupyterLab, Run All Cells, wait until an output contains ``done``."""
    # A workspace per notebook: JupyterLab would reopen the notebooks of earlier tests as tabs around it.
    page.goto(f"{lab.base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?token={lab.token}")
    # Wait for a connected, idle kernel before running anything.
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    page.wait_for_function(
        "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus');"
        " return !!document.querySelector('.jp-NotebookPanel') && (!s || !/Connecting|Starting/.test(s.textContent || '')); }",
        timeout=120_000,
    )
    page.wait_for_timeout(3000)
    page.click(".jp-Notebook:visible")
    # Run > Run All Cells. It returns at once: wait for the given output instead.
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_function(f"() => ({OUTPUTS})().includes({json.dumps(done)})", timeout=300_000)


def test_quickstart_renders_in_jupyterlab(lab, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    _run_all(page, lab, "quickstart.ipynb", "largest gradient difference")
    page.wait_for_timeout(3000)  # let widgets and the netron frame finish drawing
    text = page.evaluate(OUTPUTS)
    plots = page.locator(".js-plotly-plot").count()
    checkboxes = page.locator(".widget-checkbox input").count()
    node_links = page.locator("a[title='open in netron']").count()  # saved activations, slow kernels
    frames = page.locator("iframe").count()
    netron_src = page.locator("iframe").first.get_attribute("src") if frames else ""
    # The monitor's plots carry the run's steps: a trace with data points.
    points = page.evaluate(
        "() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
        ".map(p => (p.data || []).reduce((n, t) => n + ((t.x || []).length), 0))"
        ".reduce((a, b) => a + b, 0)"
    )
    # Toggles update: click the layerwise preset and Apply, wait for the measured result.
    page.locator(".widget-toggle-button", has_text="layerwise").first.click()
    page.locator("button", has_text="Apply").first.click()
    page.wait_for_function(f"() => ({OUTPUTS})().includes(' ms (')", timeout=120_000)
    page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
    if plots:
        plot = page.locator(".js-plotly-plot").first
        plot.scroll_into_view_if_needed()
        plot.screenshot(path=str(ARTIFACTS / "monitor.png"))
    if frames:
        frame = page.frames[-1]
        frame.wait_for_load_state()
        page.locator("iframe").first.screenshot(path=str(ARTIFACTS / "netron.png"))
    assert "ortlab first-step report" in text
    assert "saved activations:" in text
    assert "largest gradient difference" in text
    assert plots >= 1 and points > 0, (plots, points)
    assert checkboxes > 0
    assert "Slowest onnxruntime kernels" in text and node_links > 0
    assert frames >= 1 and "127.0.0.1" in (netron_src or "") or "/proxy/" in (netron_src or "")


# A small model, trained with a kernel profile, and a lab of it whose graph view is open: the
# saved-activation table (lab["split"]) links into the lab's view; the monitor's kernel table and
# the recompute toggles link into the trained module's own graphs, shown under each table.
_LINKS_NOTEBOOK = [
    """import torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.ui.toggles import FallbackToggles, RecomputeToggles
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=1, block_size=16)
model = ortlab.ORTModule(GPT(config))
mon = ortlab.monitor(model, every=5, show=False)
for step in range(8):
    if step == 3:
        mon.profile_now()
    idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
    model(idx, targets).backward()
mon.detach()
lab = ortlab.explore(GPT(config), idx, targets)
lab.run("onnxscript")
from IPython.display import display
# Another graph of the lab opened first, as the stepper's "View graph" does: the table links still open in the
# view of the graph they belong to (Note [A link opens in the frame showing its graph]).
display(lab["onnxscript"].view())
lab["exported"].view()""",
    'lab["split"]',
    "mon.kernel_table(top=20)",
    "RecomputeToggles(model, idx, targets)",
    "FallbackToggles(model, idx, targets)",
]


def _notebook(cells: list[str]) -> str:
    return json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c}
                  for c in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    })


def _sidebar(frame: Any) -> dict[str, str]:
    """netron's sidebar as {property: value} (name, type, ortlab.module, ortlab.source...).

    Read through locators: netron's page forbids ``eval``, which ``frame.evaluate`` needs.
    """
    out: dict[str, str] = {}
    for item in frame.locator("#sidebar-content .sidebar-item").all():
        name = item.locator(".sidebar-item-name input").first.get_attribute("title")
        out.setdefault(name, item.locator(".sidebar-item-value-list").first.inner_text().strip())
    return out


def _frame_at(page: Any, name: str, url: str, timeout: float = 30) -> Any:
    """The frame ``name`` once it has navigated to ``url`` (a link's target frame)."""
    deadline, frame = time.time() + timeout, None
    while time.time() < deadline:
        frame = page.frame(name=name)
        if frame is not None and frame.url == url:
            return frame
        page.wait_for_timeout(100)
    others = [p.url for p in page.context.pages if p is not page]
    pytest.fail(f"the link did not open {url} in the frame {name!r} "
                f"(it shows {frame and frame.url}; other tabs {others})")


def _open(page: Any, link: Any, cells: dict[str, str], shot: str) -> tuple[dict[str, str], dict[str, str]]:
    """Click ``link`` (in a row whose cells are ``cells``), wait for netron to select its node.

    Returns the row (with ``node``: the node the link selects) and netron's sidebar; saves a
    screenshot of the netron frame (``shot``) as the user sees it: the page scrolls the sidebar
    to the node's source by itself, which must be in sight.
    """
    url = link.get_attribute("href")
    node = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)["node"][0]
    link.click()
    frame_name = link.get_attribute("target")  # the frame the click chose: the one showing the link's graph
    frame = _frame_at(page, frame_name, url)
    frame.locator("#sidebar-content").get_by_text(node, exact=True).first.wait_for(timeout=60_000)
    iframe = page.locator(f"iframe[name='{frame_name}']")
    iframe.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)  # the selection's scroll animation, and the sidebar's scroll to the source
    iframe.screenshot(path=str(ARTIFACTS / shot))
    source = frame.locator("#sidebar-content input[title='ortlab.source']").first.bounding_box()
    box = iframe.bounding_box()
    assert source and box and box["y"] <= source["y"] and source["y"] + source["height"] <= box["y"] + box["height"], (
        f"ortlab.source is out of sight in the {box and box['height']:.0f} px frame", source, box)
    return {**cells, "node": node}, _sidebar(frame)


def _open_from_table(page: Any, table: str, graph: str, shot: str) -> tuple[dict[str, str], dict[str, str]]:
    """Open the first link to a node of ``graph`` outside the root module in the table headed ``table``."""
    heading = page.locator("h4", has_text=table).first
    body = heading.locator("xpath=following-sibling::table[1]")
    body.scroll_into_view_if_needed()
    page.wait_for_timeout(500)  # JupyterLab lays out the cells coming into view
    body.screenshot(path=str(ARTIFACTS / f"table-{shot}"))
    rows = body.locator("tr")
    headers = [h.strip() for h in rows.first.locator("th").all_inner_texts()]
    row = rows.filter(has=page.locator("a[title='open in netron']")).filter(has_text=graph)
    row = row.filter(has_not_text="<root>").first
    cells = dict(zip(headers, (c.strip() for c in row.locator("td").all_inner_texts())))
    return _open(page, row.locator("a[title='open in netron']").first, cells, shot)


def _open_from_toggles(page: Any, shot: str) -> tuple[dict[str, str], dict[str, str]]:
    """Open the first saved activation outside the root module in the RecomputeToggles widget."""
    widget = page.locator(".widget-vbox", has=page.get_by_text("Saved activations (checked")).last
    header = widget.locator(".widget-html", has_text="dtype").first
    headers = [h.strip() for h in header.locator("span").all_inner_texts()]
    row = widget.locator(".widget-hbox").filter(has=page.locator("a[title='open in netron']"))
    row = row.filter(has_not_text="<root>").first
    row.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    widget.screenshot(path=str(ARTIFACTS / f"table-{shot}"))
    cells = dict(zip(headers, (c.strip() for c in row.locator(".widget-html span").all_inner_texts())))
    return _open(page, row.locator("a[title='open in netron']").first, cells, shot)


def test_table_links_open_the_node_and_its_source_in_netron(lab, browser):
    (lab.root / "links.ipynb").write_text(_notebook(_LINKS_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    _run_all(page, lab, "links.ipynb", "Slowest onnxruntime kernels")
    page.get_by_text("Ops (checked").first.wait_for(timeout=120_000)
    # A saved activation in the lab's view; a slow kernel of the backward and a saved activation
    # of the trained module, each in the view under its table.
    for opened, shot in ((lambda s: _open_from_table(page, "Saved activations", "g0", s), "netron_activation.png"),
                         (lambda s: _open_from_table(page, "Slowest onnxruntime kernels", "g0.backward", s),
                          "netron_kernel.png"),
                         (lambda s: _open_from_toggles(page, s), "netron_toggles.png")):
        row, sidebar = opened(shot)
        # netron selected the row's node, and shows the nn.Module and the line that made it.
        assert sidebar.get("name") == row["node"], (shot, row, sidebar)
        assert sidebar.get("ortlab.module") == row["module"], (shot, row, sidebar)
        assert "source" not in row or sidebar.get("ortlab.source") == row["source"], (shot, row, sidebar)
        assert re.search(r"models\.py:\d+ in ", sidebar.get("ortlab.source", "")), (shot, sidebar)
    # The view opened first (another graph) still shows its own graph: no link was sent there.
    first = page.frame(name=page.locator("iframe").first.get_attribute("name"))
    assert first is not None and "onnxscript" in urllib.parse.unquote(first.url), first and first.url
    page.screenshot(path=str(ARTIFACTS / "links.png"), full_page=True)
    # The fallback toggles link their ops the same way.
    ops = page.locator(".widget-vbox", has=page.get_by_text("Ops (checked")).last
    ops.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    ops.screenshot(path=str(ARTIFACTS / "fallback_toggles.png"))
    assert ops.locator(".widget-hbox a[title='open in netron']").count() > 10


# The stepper shown first follows the stages later cells run; compare's diverged nodes and the
# bisect's result (trials, fix, repro script) show in the page; expected failures print nothing.
_DIVERGENCE_NOTEBOOK = [
    """import torch, ortlab, onnx_ir as ir
import ortlab.pipeline.part as part
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=2, block_size=16)
idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
lab = ortlab.explore(GPT(config), idx, targets)
lab.widget()""",
    'lab.run("split"); print("ran to", lab.current.name)',
    """original = part.optimize_exported
def bf16_gelu(exported):  # plant a bug: blocks.1's gelu rounds to bfloat16 in onnxruntime
    seconds = original(exported)
    graph = exported.model.graph
    for node in list(graph):
        if node.metadata_props.get("ortlab.op") == "aten.gelu" and node.metadata_props.get("ortlab.module") == "blocks.1":
            out = node.outputs[0]
            down = ir.node("Cast", [out], attributes={"to": ir.DataType.BFLOAT16})
            up = ir.node("Cast", [down.outputs[0]], attributes={"to": ir.DataType.FLOAT})
            graph.insert_after(node, [down, up])
            for use in list(out.uses()):
                if use.node is not down:
                    use.node.replace_input_with(use.idx, up.outputs[0])
            break
    return seconds
part.optimize_exported = bf16_gelu
bad = ortlab.compare(GPT(config), idx, targets)
bad""",
    """found = ortlab.bisect_fallbacks(GPT(config), idx, targets, atol=1e-7)
part.optimize_exported = original
found""",
]


def test_stepper_compare_and_bisect_in_jupyterlab(lab, browser):
    (lab.root / "divergence_views.ipynb").write_text(_notebook(_DIVERGENCE_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    _run_all(page, lab, "divergence_views.ipynb", "ortlab bisect:")
    page.wait_for_timeout(2000)
    # The stepper of the first cell shows the stages the second cell ran.
    overview = page.locator(".widget-html", has_text="ortlab lab:").first
    assert overview.inner_text().count("done") == 3, overview.inner_text()
    page.locator(".widget-vbox", has=overview).first.screenshot(path=str(ARTIFACTS / "stepper-live.png"))
    # No red stderr block anywhere: trials that fail are in the trial table, not printed.
    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert stderr.count() == 0, stderr.all_inner_texts()
    # The bisect: every trial in a table, the fix, the repro script of the culprit's node.
    bisect = page.locator(".jp-OutputArea-output", has_text="ortlab bisect:").first
    text = bisect.inner_text()
    assert "fix for now: ORTModule(model, fallback_ops=['aten.gelu'])" in text, text
    assert "step matches eager" in text and "repro" in text
    bisect.locator("summary", has_text="the repro script").click()
    assert "gelu_1 (aten.gelu) at blocks.1" in bisect.locator("pre").first.inner_text()
    bisect.scroll_into_view_if_needed()
    bisect.screenshot(path=str(ARTIFACTS / "bisect.png"))
    # compare: the first divergence links to its node in the view under the tables.
    result = page.locator(".jp-OutputArea-output", has_text="ortlab.compare: DIVERGED").first
    link = result.locator("p", has_text="first divergence").locator("a[title='open in netron']").first
    row, sidebar = _open(page, link, {}, "compare-netron.png")
    assert sidebar.get("ortlab.module") == "blocks.1", sidebar
    assert re.search(r"models\.py:\d+ in ", sidebar.get("ortlab.source", "")), sidebar
    result.screenshot(path=str(ARTIFACTS / "compare.png"))


# A tiny GPT trained a few steps under the monitor, one step recorded as a timeline and shown inline.
_TIMELINE_NOTEBOOK = [
    """import torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=1, block_size=16)
model = ortlab.ORTModule(GPT(config))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = ortlab.monitor(model, every=5, show=False)
for step in range(6):
    if step == 2:
        mon.record_timeline()
    idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
    model(idx, targets).backward()
    opt.step(); opt.zero_grad()
mon.detach()""",
    "timeline = mon.timeline()\nprint('recorded:', timeline.summary.line())\ntimeline",
]

# Each plotly trace of the page's last plot: its name, lanes, bars and hover texts.
_PLOT_TRACES = (
    "() => { const plots = document.querySelectorAll('.js-plotly-plot'); const p = plots[plots.length - 1];"
    " return {title: p.layout.title.text, traces: p.data.map(t => ({name: t.name, y: t.y, n: (t.x || []).length,"
    " hover: t.hovertext}))}; }"
)


def test_timeline_shows_inline(lab, browser):
    (lab.root / "timeline.ipynb").write_text(_notebook(_TIMELINE_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    _run_all(page, lab, "timeline.ipynb", "recorded:")
    plot = page.locator(".js-plotly-plot").last
    plot.wait_for(timeout=60_000)
    plot.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    shown = page.evaluate(_PLOT_TRACES)
    traces = {t["name"]: t for t in shown["traces"]}
    plot.screenshot(path=str(ARTIFACTS / "timeline.png"))
    # JupyterLab's plotly renderer redraws and resizes the figure on every resize of its output. The
    # figure keeps its height when it does, even where plotly did not see a 0 px div at the first draw
    # (Note [plotly's JSON output is not responsive]: it collapsed to 0 px in CI), and follows the width.
    before = page.evaluate(_PLOT_BOX)
    page.evaluate(_RESIZE_AS_JUPYTERLAB)
    _settle(page, _PLOT_BOX)
    assert page.evaluate(_PLOT_BOX) == before, (before, page.evaluate(_PLOT_BOX))
    page.set_viewport_size({"width": 1200, "height": 1000})
    _settle(page, _PLOT_BOX)
    narrower = page.evaluate(_PLOT_BOX)
    page.set_viewport_size({"width": 1400, "height": 1000})
    _settle(page, _PLOT_BOX)
    assert narrower["height"] == before["height"] > 300 and narrower["width"] <= before["width"] - 150, (before, narrower)
    assert page.evaluate(_PLOT_BOX) == before
    # As a user would: drag across the forward's session run to zoom in, then hover its longest
    # kernel; its node, module and source line show.
    box = plot.bounding_box()
    where = (
        "() => { const plots = document.querySelectorAll('.js-plotly-plot'); const p = plots[plots.length - 1];"
        " const xa = p._fullLayout.xaxis, ya = p._fullLayout.yaxis, at = (x, lane) =>"
        " ({x: xa._offset + xa.l2p(x), y: ya._offset + ya.l2p(ya.d2l(lane))});"
        " const run = p.data.find(t => t.name === 'onnxruntime session run'), k = p.data.find("
        " t => t.name === 'onnxruntime kernel'); const r = run.y.indexOf('onnxruntime g0.forward');"
        " let best = -1; k.y.forEach((lane, j) => { if (lane === 'onnxruntime g0.forward'"
        "   && (best < 0 || k.x[j] > k.x[best])) best = j; });"
        " return {from: at(run.base[r], run.y[r]), to: at(run.base[r] + run.x[r], run.y[r]),"
        "         kernel: at(k.base[best] + k.x[best] / 2, k.y[best])}; }"
    )
    settled = ("() => { const plots = document.querySelectorAll('.js-plotly-plot');"
               " return JSON.stringify(plots[plots.length - 1]._fullLayout.xaxis.range); }")
    # The x range shown, against the forward's session run: zoomed in when it is at most a few runs wide.
    zoomed = ("() => { const plots = document.querySelectorAll('.js-plotly-plot'); const p = plots[plots.length - 1];"
              " const run = p.data.find(t => t.name === 'onnxruntime session run');"
              " const r = run.y.indexOf('onnxruntime g0.forward'), range = p._fullLayout.xaxis.range;"
              " return range[1] - range[0] <= 4 * run.x[r]; }")
    dragged = False
    for _ in range(3):  # on a busy machine a drag made while plotly still redraws may not zoom: drag again
        plot.scroll_into_view_if_needed()
        box, spots = plot.bounding_box(), page.evaluate(where)
        page.mouse.move(box["x"] + spots["from"]["x"] - 2, box["y"] + spots["from"]["y"])
        page.mouse.down()
        page.mouse.move(box["x"] + spots["to"]["x"] + 2, box["y"] + spots["to"]["y"], steps=8)
        page.mouse.up()
        _settle(page, settled)
        if page.evaluate(zoomed):
            dragged = True
            break
    if not dragged:
        # Three drags on a CI machine with both cores on other tests did not zoom (plotly took
        # the drag during a redraw). Dragging zooms is plotly's own default (asserted); what this
        # test is about is the hover, so the range is set as the drag would have set it.
        assert page.evaluate(_DRAGMODE) == "zoom"
        page.evaluate(_ZOOM_TO_FORWARD)
        _settle(page, settled)
    # Hover the kernel as a user would. A busy machine can miss a move, or redraw and clear the
    # label: nudge and move again for up to 60 s. The label is read from the page, as a user reads
    # it; plotly's hover event is kept for the message if none shows.
    page.evaluate(_LISTEN_HOVER)
    deadline, nudges, text = time.time() + 60, itertools.cycle((0, 1, -1, 2, -2)), None
    while text is None and time.time() < deadline:
        plot.scroll_into_view_if_needed()
        box, spots = plot.bounding_box(), page.evaluate(where)
        page.mouse.move(box["x"] + spots["kernel"]["x"] + next(nudges), box["y"] + spots["kernel"]["y"], steps=4)
        for _ in range(10):
            page.wait_for_timeout(200)
            label = page.evaluate(_HOVER_LABEL)
            if label:
                text = label
                break
        else:
            page.mouse.move(box["x"] + 5, box["y"] + 5)
    if text is None:
        page.screenshot(path=str(ARTIFACTS / "timeline_no_hover.png"))
    assert text is not None, f"no hover label on the forward's longest kernel in 60 s: {json.dumps(page.evaluate(_HOVER_STATE))}"
    hover = text
    plot.screenshot(path=str(ARTIFACTS / "timeline_zoom.png"))
    assert "onnxruntime kernels" in shown["title"] and "PyTorch" in shown["title"], shown["title"]
    kernels = traces["onnxruntime kernel"]
    assert kernels["n"] > 50 and set(kernels["y"]) == {"onnxruntime g0.forward", "onnxruntime g0.backward"}
    assert any("source:" in h and "models.py:" in h for h in kernels["hover"])
    assert traces["optimizer"]["n"] >= 1 and traces["PyTorch op (aten)"]["n"] > 10
    assert "PyTorch" in traces["optimizer"]["y"]
    assert "module:" in hover and "models.py:" in hover, hover


def _settle(page: Any, probe: str) -> None:
    """Wait until a redraw settles (a busy machine takes seconds): ``probe`` gives the same twice, 0.3 s apart."""
    last = None
    for _ in range(40):
        page.wait_for_timeout(300)
        now = page.evaluate(probe)
        if now == last:
            return
        last = now


_PLOT_BOX = ("() => { const plots = document.querySelectorAll('.js-plotly-plot'); const b ="
             " plots[plots.length - 1].getBoundingClientRect(); return {width: b.width, height: b.height}; }")
# What jupyterlab-plotly's renderer does on a resize (onUpdateRequest), with plotly's record of a
# 0 px div at the first draw cleared, as it is when the div had a height then.
_RESIZE_AS_JUPYTERLAB = (
    "() => { const plots = document.querySelectorAll('.js-plotly-plot'); const p = plots[plots.length - 1];"
    " p._context._hasZeroHeight = false;"
    " return window.Plotly.redraw(p).then(() => window.Plotly.Plots.resize(p)).then(() => true); }"
)
_LAST_PLOT = "const plots = document.querySelectorAll('.js-plotly-plot'); const p = plots[plots.length - 1];"
_DRAGMODE = f"() => {{ {_LAST_PLOT} return p._fullLayout.dragmode; }}"
# The x range a drag across the forward's session run (2 % either side) gives.
_ZOOM_TO_FORWARD = (
    f"() => {{ {_LAST_PLOT} const run = p.data.find(t => t.name === 'onnxruntime session run');"
    " const r = run.y.indexOf('onnxruntime g0.forward'), pad = run.x[r] * 0.02;"
    " return window.Plotly.relayout(p, {'xaxis.range': [run.base[r] - pad, run.base[r] + run.x[r] + pad]})"
    "   .then(() => true); }"
)
# plotly's hover event on the last plot, kept on the window; and the hover label a user reads.
_LISTEN_HOVER = (
    f"() => {{ {_LAST_PLOT} window.__ortlabHover = null;"
    " p.on('plotly_hover', d => { window.__ortlabHover = d.points.map(q => q.hovertext).join(' '); }); }"
)
_HOVER_LABEL = (
    "() => { const t = document.querySelector('.hoverlayer .hovertext');"
    " return t ? (t.textContent || null) : null; }"
)
_HOVER_STATE = (
    f"() => {{ {_LAST_PLOT} const run = p.data.find(t => t.name === 'onnxruntime session run');"
    " const r = run.y.indexOf('onnxruntime g0.forward'), xa = p._fullLayout.xaxis;"
    " const seen = Array.from(plots).map(e => { const b = e.getBoundingClientRect();"
    "   return [b.x, b.y, b.width, b.height, getComputedStyle(e).visibility, !!e.offsetParent]; });"
    " return {range: xa.range, run_px: xa.l2p(run.base[r] + run.x[r]) - xa.l2p(run.base[r]),"
    "         event: window.__ortlabHover, plots: seen, scroll: window.scrollY,"
    "         layout: [p.layout.height, p.layout.width, p._fullLayout.height, p._fullLayout.width, p.style.cssText],"
    "         svg: Array.from(p.querySelectorAll('svg.main-svg')).map(e => [e.getAttribute('height'), e.getBoundingClientRect().height]),"
    "         up: (() => { const a = []; for (let e = p; e && a.length < 8; e = e.parentElement) a.push([e.className, e.getBoundingClientRect().height, getComputedStyle(e).display]); return a; })(),"
    "         dom: Array.from(document.querySelectorAll('.jp-RenderedPlotly')).map(n => Array.from(n.children).map("
    "           c => [c.tagName, c.className, c.style.display, (c.src || '').length,"
    "                 c.getBoundingClientRect().height]))}; }"
)


# A small GPT trained for 60 steps under a live monitor. Each step waits 60 ms for its batch (as
# a data loader would), so the loop runs for seconds and the monitor redraws on its clock.
_MONITOR_NOTEBOOK = [
    """import time, torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=200, d_model=64, n_heads=2, n_layers=2, block_size=32)
model = ortlab.ORTModule(GPT(config))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# No budget: a redraw each second of this short loop, whatever a redraw costs on this busy 2-core
# box (7-40 ms); the budget's rationing is tested in tests/ui/test_monitor.py.
mon = ortlab.monitor(model, budget=None, every=25)""",
    """for step in range(60):
    idx, targets = make_batch("gpt", 8, vocab=config.vocab, block_size=config.block_size)
    model(idx, targets).backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.06)  # the data loader fetches the next batch
print("trained", mon.steps, "steps")""",
]

# The monitor's status line, the number of points of its loss line, and how wide its plot is
# against the output it sits in.
_MONITOR_STATE = """() => {
  const status = document.querySelector('.ortlab-monitor-status');
  const plot = document.querySelector('.js-plotly-plot');
  const loss = plot && (plot.data || []).find(t => t.name === 'loss');
  const output = plot && plot.closest('.jp-OutputArea-output');
  const svg = plot && plot.querySelector('.main-svg');
  return {status: status ? status.innerText : '', points: loss && loss.x ? loss.x.length : 0,
          plot: svg ? svg.getBoundingClientRect().width : 0,
          output: output ? output.getBoundingClientRect().width : 0};
}"""


def _show_monitor(page: Any) -> None:
    """Scroll the monitor's status line to the top of the notebook (what a user looks at)."""
    page.locator(".ortlab-monitor-status").first.evaluate("e => e.scrollIntoView({block: 'start'})")


def _watch_monitor(page: Any, done: str, timeout: float = 300) -> list[dict[str, Any]]:
    """Poll the monitor's state every 100 ms until an output contains ``done``; every state seen.

    Saves ``monitor-live.png`` while the loop runs (half of it drawn).
    """
    seen: list[dict[str, Any]] = []
    shot = False
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = page.evaluate(_MONITOR_STATE)
        if not seen or state != seen[-1]:
            seen.append(state)
        if not shot and state["points"] >= 20:
            _show_monitor(page)
            page.screenshot(path=str(ARTIFACTS / "monitor-live.png"))
            shot = True
        if done in page.evaluate(OUTPUTS):
            return seen
        page.wait_for_timeout(100)
    pytest.fail(f"no output {done!r} after {timeout:.0f} s; the monitor showed {seen[-3:]}")


def test_monitor_is_live_and_fills_the_width(lab, browser):
    (lab.root / "monitor.ipynb").write_text(_notebook(_MONITOR_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _run_all(page, lab, "monitor.ipynb", "ortlab monitor")  # the status line is up: the loop starts
    seen = _watch_monitor(page, "trained 60 steps")
    page.wait_for_timeout(1500)  # the redraw at the cell's end
    statuses = [s["status"] for s in seen]
    compiling = [s for s in statuses if "step 1 compiling for onnxruntime" in s]
    # (a) The first step's compile showed its stages as they came, (b) the plot redrew during the loop.
    assert any("exported to ONNX" in s for s in compiling), statuses
    assert any("building its onnxruntime session" in s for s in compiling), statuses
    redrawn = sorted({s["points"] for s in seen if 0 < s["points"] < 60})
    assert len(redrawn) >= 3, (redrawn, statuses[-5:])
    # (c) The count shown is the steps run.
    final = page.evaluate(_MONITOR_STATE)
    assert final["status"].startswith("step 60 |"), final
    assert "first step (capture + export)" in final["status"]
    assert final["points"] == 60
    assert (ARTIFACTS / "monitor-live.png").exists()
    # (d) The plot fills the output at 1280x800 and at 1920x1080.
    for width, height in ((1280, 800), (1920, 1080)):
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_timeout(1500)  # plotly follows the new width
        _show_monitor(page)
        page.screenshot(path=str(ARTIFACTS / f"monitor-{width}.png"))
        state = page.evaluate(_MONITOR_STATE)
        assert state["plot"] >= 0.95 * state["output"] - 30 and state["output"] > 0.5 * width, (width, state)


# The default budget, a loop of ~12 s: what a user runs. The browser shares the 2 cores, so each
# redraw's rendering slows the next steps; the monitor counts that, and still redraws every
# MAX_GAP * redraw_s at least (Note [The view never stops for long]).
_MONITOR_BUDGET_NOTEBOOK = [
    """import time, torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=1000, d_model=128, n_heads=4, n_layers=2, block_size=64)
model = ortlab.ORTModule(GPT(config), providers=["CPUExecutionProvider"])
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
mon = ortlab.monitor(model, every=10)""",
    """start = None
for step in range(2000):
    idx, targets = make_batch("gpt", 32, vocab=config.vocab, block_size=config.block_size)
    model(idx, targets).backward()
    opt.step(); opt.zero_grad()
    start = start or time.perf_counter()
    if time.perf_counter() - start > 12:
        break
print("budget loop done", mon.overhead["fraction"])""",
]


def test_monitor_never_stands_still_for_long_under_its_budget(lab, browser):
    from ortlab.ui._monitor_schedule import MAX_GAP

    (lab.root / "monitor_budget.ipynb").write_text(_notebook(_MONITOR_BUDGET_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _run_all(page, lab, "monitor_budget.ipynb", "ortlab monitor")
    page.wait_for_function("() => /step [1-9]/.test((document.querySelector('.ortlab-monitor-status') || {}).innerText || '')",
                           timeout=120_000)  # the first step compiled: the loop runs
    changes, last = [time.time()], None
    while "budget loop done" not in page.evaluate(OUTPUTS):
        points = page.evaluate(_MONITOR_STATE)["points"]
        if points != last:
            changes.append(time.time())
            last = points
        assert time.time() - changes[0] < 120, "the loop did not end"
        page.wait_for_timeout(100)
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    _show_monitor(page)
    page.screenshot(path=str(ARTIFACTS / "monitor-budget.png"))
    # the floor, plus a redraw's trip to the browser and its rendering on a busy box
    assert max(gaps) <= MAX_GAP * 1.0 + 2.0, gaps
    assert len(changes) >= 4, changes


# compare_speed in a notebook: its chart, and a table whose rows open their slowest onnxruntime node.
_SPEED_NOTEBOOK = [
    """import torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=1, block_size=16)
idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
ortlab.compare_speed(GPT(config), idx, targets, steps=4, profile_steps=2)""",
]


def test_compare_speed_chart_and_table_open_netron(lab, browser):
    (lab.root / "speed.ipynb").write_text(_notebook(_SPEED_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    _run_all(page, lab, "speed.ipynb", "eager / ortlab")
    chart = page.locator(".js-plotly-plot").first
    chart.wait_for(timeout=60_000)
    chart.scroll_into_view_if_needed()
    chart.screenshot(path=str(ARTIFACTS / "compare-speed-chart.png"))
    bars = page.evaluate("() => document.querySelector('.js-plotly-plot').data[0].y.length")
    assert bars >= 3, bars
    row, sidebar = _open_from_table(page, "compare_speed:", "", "compare-speed-netron.png")
    # netron selected the row's slowest node, made by the row's module at the row's line
    assert sidebar.get("name") == row["node"], (row, sidebar)
    assert sidebar.get("ortlab.module") == row["module"], (row, sidebar)
    assert sidebar.get("ortlab.source", "").endswith(row["source"].split(":", 1)[1]), (row, sidebar)
    page.screenshot(path=str(ARTIFACTS / "compare-speed.png"), full_page=True)


# ----------------------------------------------------------------------- netron frames in a notebook
# A tiny ONNX graph between tall outputs: the notebook scrolls past its view (or does not).
_FRAME_NOTEBOOK = [
    'print("\\n".join(f"line {i} above the graph" for i in range(40)))',
    """import os, tempfile, onnx, onnx.helper as oh
from ortlab.ui.netron_view import view_file
folder = tempfile.mkdtemp()
x, y = (oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 3]) for n in "xy")
graph = oh.make_graph([oh.make_node("Relu", ["x"], ["r"], name="node_relu"), oh.make_node("Neg", ["r"], ["y"], name="node_neg")],
                      "tiny", [x], [y])
onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), os.path.join(folder, "tiny.onnx"))
view_file(os.path.join(folder, "tiny.onnx"))""",
    'print("\\n".join(f"line {i} below the graph" for i in range(40)) + "\\nframe notebook done")',
]

# The notebook's scroller around the first netron view: its scroll position, the part of the page it shows.
_SCROLLER = """() => {
  let e = document.querySelector('.ortlab-netron');
  while (e && !(e.scrollHeight > e.clientHeight && /auto|scroll/.test(getComputedStyle(e).overflowY))) e = e.parentElement;
  return e ? {top: e.scrollTop, y: e.getBoundingClientRect().top, bottom: e.getBoundingClientRect().bottom} : null;
}"""
_SCROLL_TOP = f"() => (({_SCROLLER})() || {{top: -1}}).top"


def _shield_shown(page: Any) -> bool:
    return page.locator(".ortlab-netron-shield").first.evaluate("e => getComputedStyle(e).display !== 'none'")


def _kernel_sessions(lab: JupyterLab, notebook: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{lab.base}/api/sessions?token={lab.token}", timeout=10) as r:
        return [s for s in json.load(r) if s.get("path", "").endswith(notebook)]


def test_netron_frame_lets_the_notebook_scroll_and_a_saved_notebook_shows_no_dead_frame(lab, browser):
    (lab.root / "frame.ipynb").write_text(_notebook(_FRAME_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _run_all(page, lab, "frame.ipynb", "frame notebook done")
    iframe = page.locator(".ortlab-netron iframe").first
    iframe.wait_for(state="visible", timeout=60_000)  # the server answered: the frame is swapped in
    assert "127.0.0.1" in (iframe.get_attribute("src") or "")
    assert not page.locator(".ortlab-netron-off").first.is_visible()
    page.frame_locator(".ortlab-netron iframe").first.get_by_text("Relu", exact=True).first.wait_for(timeout=60_000)
    # The pointer over the graph, the wheel scrolls the notebook.
    iframe.scroll_into_view_if_needed()
    box = iframe.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    before = page.evaluate(_SCROLL_TOP)
    page.mouse.wheel(0, 300)
    page.wait_for_timeout(800)
    scrolled = page.evaluate(_SCROLL_TOP)
    page.screenshot(path=str(ARTIFACTS / "netron-wheel.png"))
    assert before >= 0 and scrolled > before, (before, scrolled)
    assert _shield_shown(page)
    # A click hands the wheel to the graph: the notebook stays where it is.
    box = iframe.bounding_box()
    cx = box["x"] + box["width"] / 2
    cy = (max(box["y"], 150) + min(box["y"] + box["height"], 780)) / 2  # inside the part in sight
    page.mouse.click(cx, cy)
    assert not _shield_shown(page)
    scrolled = page.evaluate(_SCROLL_TOP)
    page.mouse.wheel(0, 300)
    page.wait_for_timeout(800)
    assert page.evaluate(_SCROLL_TOP) == scrolled
    # The pointer leaves the frame: the shield is back.
    page.mouse.move(5, box["y"] - 40 if box["y"] > 60 else 5)
    page.mouse.move(3, 3)
    assert _shield_shown(page)

    # Save, stop the kernel (and its netron server), reopen the notebook.
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    deadline = time.time() + 30
    while "ortlab-netron" not in (lab.root / "frame.ipynb").read_text() and time.time() < deadline:
        time.sleep(0.5)
    assert "ortlab-netron" in (lab.root / "frame.ipynb").read_text(), "the notebook was not saved with its view"
    for session in _kernel_sessions(lab, "frame.ipynb"):
        request = urllib.request.Request(f"{lab.base}/api/sessions/{session['id']}?token={lab.token}",
                                         method="DELETE")
        urllib.request.urlopen(request, timeout=30)
    page.reload()
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    message = page.locator(".ortlab-netron-off").first
    message.wait_for(state="visible", timeout=60_000)
    page.wait_for_timeout(3000)  # the probe of the dead server fails; nothing is swapped in
    message.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "netron-reopened.png"))
    assert "Re-run this cell to open the graph" in message.inner_text()
    visible_frames = [f for f in page.locator("iframe").all() if f.is_visible()]
    assert not visible_frames, [f.get_attribute("src") for f in visible_frames]
    assert all(not f.get_attribute("src") for f in page.locator(".ortlab-netron iframe").all())


_STEPPER_NOTEBOOK = [
    """import torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=1, block_size=16)
idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
lab = ortlab.explore(GPT(config), idx, targets)
lab.run("exported")
print("stepper ready")""",
    "lab.widget()",
]


def test_view_graph_opens_under_its_button_with_inputs_named_by_parameter(lab, browser):
    (lab.root / "stepper.ipynb").write_text(_notebook(_STEPPER_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _run_all(page, lab, "stepper.ipynb", "stepper ready")
    button = page.locator("button", has_text="View graph").first
    button.wait_for(timeout=120_000)
    stage = page.locator(".widget-dropdown select").first
    options = stage.locator("option").evaluate_all("os => os.map(o => o.textContent)")
    # ipywidgets writes the options' spaces as no-break spaces.
    stage.select_option(index=next(i for i, t in enumerate(options) if ". exported (" in t.replace("\xa0", " ")))
    page.wait_for_timeout(500)
    button.scroll_into_view_if_needed()
    button.click()
    iframe = page.locator(".ortlab-netron iframe").first
    iframe.wait_for(state="visible", timeout=60_000)
    page.wait_for_timeout(1000)  # the view scrolls itself into sight
    frame = page.frame_locator(".ortlab-netron iframe").first
    frame.get_by_text("blocks.0.ln1.weight", exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(ARTIFACTS / "netron-next-to-button.png"))
    top, below = button.bounding_box(), page.locator(".ortlab-netron").first.bounding_box()
    shown = page.evaluate(_SCROLLER)
    # Right under its button (the stage's tables come after it), scrolled into sight with its button.
    assert 0 <= below["y"] - (top["y"] + top["height"]) < 60, (top, below)
    # (at 1280x800 the notebook shows less than the 720 px view: its button stays in sight above it)
    assert shown["y"] <= top["y"] and below["y"] < shown["y"] + 100, (shown, top, below)
    # netron shows the graph's inputs by parameter name, not AOTAutograd's primals_N.
    inputs = frame.get_by_text("blocks.0.ln1.weight", exact=True)
    inputs.first.wait_for(timeout=60_000)
    iframe.screenshot(path=str(ARTIFACTS / "netron-inputs.png"))
    assert frame.get_by_text("tok.weight", exact=True).count() >= 1
    assert frame.get_by_text("primals_1", exact=True).count() == 0


# Recompute toggles as a user drives them: a later cell changes the policy in code; then the
# layerwise preset, Apply; then one more row ticked on top of it, Apply.
_TOGGLES_NOTEBOOK = [
    """import torch, ortlab
from ortlab.models import GPT, GPTConfig, make_batch
from ortlab.ui.toggles import RecomputeToggles
torch.manual_seed(0)
config = GPTConfig(vocab=100, d_model=32, n_heads=2, n_layers=2, block_size=16)
model = ortlab.ORTModule(GPT(config))
idx, targets = make_batch("gpt", 2, vocab=config.vocab, block_size=config.block_size)
RecomputeToggles(model, idx, targets)""",
    """model.reconfigure(recompute="auto")
model(idx, targets).backward()
from ortlab.ui import tradeoff  # four points, not seven: the browser test's time
tradeoff.TRADE_OFF_POLICIES = ("none", "layerwise", ("budget", 0.5), ("budget", 0.25))
print("policy changed in code")""",
]


def _saved_bytes(text: str) -> tuple[int, int]:
    before, after = re.search(r"saved activations ([\d,]+) -> ([\d,]+) bytes", text).groups()
    return int(before.replace(",", "")), int(after.replace(",", ""))


def test_recompute_toggles_follow_code_and_rows_never_add_bytes(lab, browser):
    (lab.root / "toggles.ipynb").write_text(_notebook(_TOGGLES_NOTEBOOK))
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    _run_all(page, lab, "toggles.ipynb", "policy changed in code")
    widget = page.locator(".widget-vbox", has=page.get_by_text("Saved activations (checked")).last
    status = widget.locator(".widget-html", has_text="policy in force").first
    status.wait_for(timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('re-captured from code')", timeout=60_000)
    assert "policy in force auto" in status.inner_text().replace("\n", " "), status.inner_text()
    active = widget.locator(".widget-toggle-button.mod-active")
    assert active.first.inner_text().strip() == "auto"
    # The layerwise preset, Apply: a measured result.
    widget.locator(".widget-toggle-button", has_text="layerwise").first.click()
    widget.locator("button", has_text="Apply").first.click()
    page.wait_for_function("() => /policy in force layerwise[^]*->/.test(document.body.innerText)", timeout=180_000)
    _, layerwise = _saved_bytes(status.inner_text())
    # Tick a row the preset saves, Apply: the preset stays, the row is added, bytes never grow.
    boxes = widget.locator(".widget-checkbox input")
    row = next(i for i in range(boxes.count()) if not boxes.nth(i).is_checked())
    boxes.nth(row).click()
    widget.locator("button", has_text="Apply").first.click()
    page.wait_for_function("() => /policy in force layerwise \\+/.test(document.body.innerText.replace(/\\n/g, ' '))",
                           timeout=180_000)
    page.wait_for_timeout(500)
    text = status.inner_text()
    before, after = _saved_bytes(text)
    widget.screenshot(path=str(ARTIFACTS / "recompute-toggles.png"))
    assert before == layerwise and after <= before, text
    assert active.first.inner_text().strip() == "layerwise"
    assert boxes.nth(row).is_checked() or "left out" in text, text  # recomputed, or left out with its reason
    assert re.search(r"\d+(\.\d+)? ms \(", text) and ("within noise" in text or "x " in text), text
    # While the widget lives its snapshot (for a reopened notebook) is hidden: Note [A snapshot hides while
    # its widget lives] in ortlab/ui/_snapshot.py.
    snapshot = page.locator("div.ortlab-snapshot", has_text="Snapshot").first
    assert snapshot.count() == 1 and not snapshot.is_visible()

    # The trade-off: measured points, the best joined; a click on a point applies its policy.
    widget.locator("button", has_text="Measure the trade-off").first.click()
    plot = widget.locator(".js-plotly-plot").first
    plot.wait_for(timeout=300_000)
    page.wait_for_function("() => document.body.innerText.includes('best on both axes')", timeout=60_000)
    plot.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    widget.screenshot(path=str(ARTIFACTS / "recompute-trade-off.png"))
    labels = plot.locator(".scatterlayer .trace").nth(1).locator(".textpoint").evaluate_all(
        "els => els.map(e => e.textContent)")
    assert labels == ["none", "layerwise", "budget 50%", "budget 25%"], labels
    # "none" saves far more than the others: alone on the plot, a click on it hovers no other point
    point = plot.locator(".scatterlayer .trace").nth(1).locator(".point").nth(0).bounding_box()
    page.mouse.move(point["x"] + point["width"] / 2, point["y"] + point["height"] / 2)  # plotly clicks the hovered point
    page.wait_for_timeout(300)
    page.mouse.click(point["x"] + point["width"] / 2, point["y"] + point["height"] / 2)
    page.wait_for_function("() => /policy in force none[^]*->/.test(document.body.innerText)", timeout=180_000)

    # Save, stop the kernel, reopen: the widget is gone, its snapshot shows the last state.
    deadline = time.time() + 60
    while "policy in force <code>none" not in (lab.root / "toggles.ipynb").read_text() and time.time() < deadline:
        page.locator(".jp-NotebookPanel-toolbar [data-command='docmanager:save']").first.click()  # the save button
        time.sleep(3)
    assert "policy in force <code>none" in (lab.root / "toggles.ipynb").read_text(), "not saved with its snapshot"
    # The kernel goes (its widgets with it), and the notebook opens in a new page, as on another day.
    kernels = [s["kernel"]["id"] for s in _kernel_sessions(lab, "toggles.ipynb")]
    for session in _kernel_sessions(lab, "toggles.ipynb"):
        request = urllib.request.Request(f"{lab.base}/api/sessions/{session['id']}?token={lab.token}", method="DELETE")
        urllib.request.urlopen(request, timeout=60)
    deadline = time.time() + 60
    while time.time() < deadline:
        with urllib.request.urlopen(f"{lab.base}/api/kernels?token={lab.token}", timeout=10) as r:
            if not {k["id"] for k in json.load(r)} & set(kernels):
                break
        time.sleep(0.5)
    page.close()
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{lab.base}/lab/workspaces/toggles-reopened/tree/toggles.ipynb?token={lab.token}")
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    snapshot = page.locator("div.ortlab-snapshot", has_text="Snapshot").first
    try:
        snapshot.wait_for(state="visible", timeout=60_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "recompute-toggles-reopened-failed.png"))
        raise
    snapshot.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(ARTIFACTS / "recompute-toggles-reopened.png"))
    saved = page.locator(".jp-OutputArea-output", has=snapshot).first.inner_text()
    assert "policy in force none" in saved and "trade-off" in saved and "last Apply" in saved, saved
