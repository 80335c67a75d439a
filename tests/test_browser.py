"""A real browser: JupyterLab runs the quickstart notebook, and its views render and update.

JupyterLab is started on 127.0.0.1 and driven by Playwright with Debian's chromium
(``apt-get install chromium``; ``.ci/run`` installs it). Skipped when chromium,
Playwright or JupyterLab is missing. The screenshot is kept as a test artifact in
``test-artifacts/quickstart.png``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def lab(tmp_path):
    pytest.importorskip("jupyterlab")
    pytest.importorskip("playwright")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", work / "quickstart.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), "ortlab-test"
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings")}
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
    yield base, token
    proc.terminate()
    proc.wait(timeout=20)


def test_quickstart_renders_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(f"{base}/lab/tree/quickstart.ipynb?token={token}")
        # Wait for a connected, idle kernel before running anything.
        page.wait_for_selector(".jp-Notebook", timeout=120_000)
        page.wait_for_function(
            "() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus');"
            " return !!document.querySelector('.jp-NotebookPanel') && (!s || !/Connecting|Starting/.test(s.textContent || '')); }",
            timeout=120_000,
        )
        page.wait_for_timeout(3000)
        page.click(".jp-Notebook")
        # Run > Run All Cells. It returns at once: wait for the last cell's output instead.
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        outputs = "() => Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n')"
        page.wait_for_function(
            f"() => ({outputs})().includes('largest gradient difference')", timeout=300_000
        )
        page.wait_for_timeout(3000)  # let widgets and the netron frame finish drawing
        text = page.evaluate(outputs)
        plots = page.locator(".js-plotly-plot").count()
        checkboxes = page.locator(".widget-checkbox input").count()
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
        page.wait_for_function(f"() => ({outputs})().includes(' ms (')", timeout=120_000)
        page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
        if plots:
            plot = page.locator(".js-plotly-plot").first
            plot.scroll_into_view_if_needed()
            plot.screenshot(path=str(ARTIFACTS / "monitor.png"))
        if frames:
            frame = page.frames[-1]
            frame.wait_for_load_state()
            page.locator("iframe").first.screenshot(path=str(ARTIFACTS / "netron.png"))
        browser.close()
    assert "ortlab first-step report" in text
    assert "saved activations:" in text
    assert "largest gradient difference" in text
    assert plots >= 1 and points > 0, (plots, points)
    assert checkboxes > 0
    assert frames >= 1 and "127.0.0.1" in (netron_src or "") or "/proxy/" in (netron_src or "")
