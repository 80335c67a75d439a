"""The documentation's code runs: every ```python block of README.md and docs/**/*.md.

How blocks run: the blocks of one page run in order, in one namespace, from a fresh temporary folder, as
a reader pastes them one after another; every page in one Python process (started once, so the imports
are paid once), each page in its own namespace. A failing block is reported with its file and line.

A block that only works in a notebook (a widget, a live figure, a model too large to train here) is
marked by an HTML comment on the line before its fence, which the rendered page does not show::

    <!-- notebook -->
    ```python
    ortlab.monitor(model)
    ```

Such a block is compiled, not run. Only blocks whose fence starts a line (not indented inside a list or
an admonition) are collected; keep runnable examples at the top level.

Also here: the README's size limits (issue 45: at most 15,000 bytes, no line over 400 characters) and
the pages docs/hooks.py generates (every ``Options`` field documented, the result files parse).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTEBOOK_MARK = "<!-- notebook -->"
_FENCE = re.compile(r"^```(\w*)[^\n]*$")


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """The ```python blocks of a markdown file as (line of the fence, code, notebook-only)."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang in ("python", "py"):
            before = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            blocks.append((start + 1, "\n".join(lines[start + 1:j]) + "\n", before == NOTEBOOK_MARK))
        i = j + 1
    return blocks


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


ALL_BLOCKS = {_rel(p): python_blocks(p) for p in PAGES}
RUN_PAGES = sorted(page for page, blocks in ALL_BLOCKS.items() if any(not nb for _, _, nb in blocks))

# The driver the subprocess runs: each page's runnable blocks, in order, in a fresh folder and namespace.
_DRIVER = textwrap.dedent("""
    import json, os, sys, tempfile, time, traceback, warnings
    pages = json.load(sys.stdin)
    results = {}
    for page, blocks in pages.items():
        namespace = {"__name__": "__main__"}
        folder = tempfile.mkdtemp(prefix="ortlab_docs_")
        os.chdir(folder)
        began, failure = time.perf_counter(), None
        for line, code in blocks:
            try:
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            except BaseException:
                failure = {"line": line, "traceback": traceback.format_exc()[-4000:]}
                break
        results[page] = {"seconds": time.perf_counter() - began, "failure": failure, "blocks": len(blocks)}
    print("ORTLAB_DOCS_RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def run_results() -> dict:
    pages = {page: [(line, code) for line, code, nb in ALL_BLOCKS[page] if not nb] for page in RUN_PAGES}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(pages), capture_output=True,
                          text=True, env=env, timeout=600)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("ORTLAB_DOCS_RESULTS ")]
    assert proc.returncode == 0 and marker, f"the snippet runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(marker[-1].split(" ", 1)[1])
    for page, result in results.items():  # shown with -s: what each page's snippets cost
        print(f"{page}: {result['blocks']} block(s), {result['seconds']:.1f} s")
    return results


def test_there_are_snippets_to_run() -> None:
    assert "README.md" in RUN_PAGES, "the README's example must run (no <!-- notebook --> mark on it)"
    assert len(RUN_PAGES) >= 5, RUN_PAGES


@pytest.mark.parametrize("page", RUN_PAGES)
def test_snippets_run(page: str, run_results: dict) -> None:
    result = run_results[page]
    failure = result["failure"]
    assert failure is None, f"{page}: the block at line {failure['line']} raised:\n{failure['traceback']}"


@pytest.mark.parametrize("page", sorted(page for page, blocks in ALL_BLOCKS.items() if any(nb for _, _, nb in blocks)))
def test_notebook_snippets_compile(page: str) -> None:
    for line, code, notebook in ALL_BLOCKS[page]:
        if notebook:
            compile(code, f"{page}:{line}", "exec")  # a SyntaxError names the page and line


def test_readme_is_short() -> None:
    data = (ROOT / "README.md").read_bytes()
    assert len(data) <= 15_000, f"README.md is {len(data):,} bytes; at most 15,000: move the detail to docs/."
    long = [(n, len(line)) for n, line in enumerate(data.decode().splitlines(), 1) if len(line) > 400]
    assert not long, f"README.md lines over 400 characters (line, length): {long}; wrap the prose."


def test_readme_keeps_the_commands_ci_runs() -> None:
    text = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile tests' in text
    assert "pip install -e . && ortlab demo" in text
    # The CPU-build warning comes before the commands (a plain `pip install torch` is the CUDA build).
    assert text.index("download.pytorch.org/whl/cpu") < text.index("&& ortlab demo")


def _hooks():
    spec = importlib.util.spec_from_file_location("ortlab_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages() -> None:
    hooks = _hooks()
    from ortlab.config import DebugOptions, Options

    options = hooks.options_markdown()  # raises when a field has no Args entry in the docstring
    assert all(f"### `{name}`" in options for name in Options.names())
    assert all(f"### `{name}`" in hooks.debug_options_markdown() for name in ("log_level", "save_onnx"))
    assert DebugOptions.__doc__ and "ORTLAB_TUNE_OPENMP" in hooks.environment_markdown()
    assert hooks.hf_architectures_markdown().startswith("41 architectures")
    assert len(hooks.machine_tables()) > 50
    speed = hooks.speed_table_markdown()  # issue 44's table: each model with eager, torch.compile, ortlab
    assert speed.startswith("| model | contender |") and all(f"| {m} | ortlab |" in speed for m in (
        "gpt", "mlp", "resnet18-32", "resnet18-224", "mobilenet", "phi3", "gpt-neox"))


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [_rel(p)[len("docs/"):] for p in PAGES if p.parent != ROOT]
    assert [p for p in pages if p not in nav] == []
