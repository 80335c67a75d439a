"""MkDocs hooks: the pages that are generated from the code and the results, so they cannot drift.

* ``<!-- generated: options -->`` in a page becomes the options reference, written from
  ``ortlab.config.Options``' docstring (its ``Args:`` section) and the fields' types and defaults. A field
  without an entry (or an entry without a field) fails the build.
* ``<!-- generated: debug-options -->``: the same for ``ortlab.config.DebugOptions``.
* ``<!-- generated: environment -->``: the ``ORTLAB_*`` variables, from ``ortlab.config``'s module docstring.
* ``<!-- generated: hf-architectures -->``: the supported-models table, from the last run in
  ``benchmarks/results/xeon-avx512/hf_architectures_auto.txt``.
* ``<!-- generated: speed-table -->``: issue 44's table (each contender alone beside the GEMM floor), from the
  newest ``benchmarks/results/<machine>/speed_table_<date>.md``.
* ``<!-- generated: benchmark-plots -->``: plotly figures of ``benchmarks/results/train_step.json`` and of
  every per-machine table (``benchmarks/results/<machine>/*.txt``), with plotly.js written once into the site.
* The notebooks in ``notebooks/`` are added as pages ``notebooks/*.ipynb`` for mkdocs-jupyter to render.
* ``ORTLAB_DOCS_EXECUTE=0`` turns mkdocs-jupyter's notebook execution off (it is on in mkdocs.yml).

The generators are plain functions of the repository (``options_markdown()``, ...), which
``tests/test_docs.py`` calls too.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PLOTLY_JS = "javascripts/plotly.min.js"

if str(ROOT) not in sys.path:  # mkdocs runs from the repository root; the import must find this checkout's ortlab
    sys.path.insert(0, str(ROOT))


class DocsError(RuntimeError):
    """A generated page could not be written: the message says which source is missing what."""


# ---------------------------------------------------------------------------------------------
# Docstrings: the Google-style ``Args:`` section of a class, entry by entry.


def docstring_args(doc: str) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style docstring as ``{name: text}``, paragraphs kept.

    Example:
        >>> docstring_args("X.\\n\\nArgs:\\n    a: one\\n        two.\\n\\n        Three.\\n    b: four.\\n")
        {'a': 'one two.\\n\\nThree.', 'b': 'four.'}
    """
    lines = doc.expandtabs().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return {}
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries: dict[str, list[str]] = {}
    name = None
    entry_indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            if name:
                entries[name].append("")
            continue
        depth = len(line) - len(line.lstrip())
        if depth <= indent:  # the next section (Example:, Returns:) or the end
            break
        if entry_indent is None:
            entry_indent = depth
        if depth == entry_indent and (m := re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s*\([^)]*\))?:\s?(.*)", line)):
            name = m.group(1)
            entries[name] = [m.group(2)]
        elif name:
            entries[name].append(line.strip())
    out = {}
    for key, parts in entries.items():
        paragraphs, current = [], []
        for part in parts:
            if part:
                current.append(part)
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        if current:
            paragraphs.append(" ".join(current))
        out[key] = "\n\n".join(paragraphs)
    return out


def _rst_literals(text: str) -> str:
    """RST's ``x`` and :func:`x` as markdown's `x`."""
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text))


def _first_sentence(text: str, limit: int = 160) -> str:
    """The text up to its first full stop before a capital (not e.g., i.e.), cut at ``limit`` characters."""
    m = re.search(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z])", text)
    first = text[: m.start() + 1] if m else text
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " ..."
    return first


def _cell(text: str) -> str:
    """Text for a markdown table cell: its pipes escaped, except in code spans (the table keeps those whole)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if hasattr(value, "name") and hasattr(value, "value"):  # an enum member
        return f"`{type(value).__name__}.{value.name}`"
    return f"`{value!r}`"


def _fields_markdown(cls: type, skip: tuple[str, ...] = ("from_env",)) -> str:
    doc = cls.__doc__ or ""
    described = docstring_args(doc)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    missing = [f.name for f in fields if f.name not in described]
    if missing:
        raise DocsError(f"{cls.__module__}.{cls.__qualname__}'s docstring has no Args entry for {missing}; "
                        "document every option there (docs/hooks.py writes the reference from it).")
    unknown = sorted(set(described) - {f.name for f in fields})
    if unknown:
        raise DocsError(f"{cls.__module__}.{cls.__qualname__}'s docstring documents {unknown}, which are not fields.")
    rows = ["| option | type | default | in short |", "|---|---|---|---|"]
    for f in fields:
        short = _first_sentence(_rst_literals(described[f.name]).split("\n\n")[0])
        kind, short, anchor = str(f.type), _cell(short), f.name.replace("_", "-")  # a code span keeps its pipes
        rows.append(f"| [`{f.name}`](#{anchor}) | `{kind}` | {_default(f)} | {short} |")
    sections = []
    for f in fields:
        sections.append(f"### `{f.name}` {{ #{f.name.replace('_', '-')} }}\n\nDefault {_default(f)}.\n\n"
                        + _rst_literals(described[f.name]))
    return "\n".join(rows) + "\n\n" + "\n\n".join(sections) + "\n"


def options_markdown() -> str:
    """The options reference: every field of ``Options``, from its docstring, types and defaults."""
    from ortlab.config import Options

    return _fields_markdown(Options)


def debug_options_markdown() -> str:
    """Every field of ``DebugOptions``, from its docstring."""
    from ortlab.config import DebugOptions

    return _fields_markdown(DebugOptions)


def environment_markdown() -> str:
    """The ``ORTLAB_*`` variables, from the RST table of ``ortlab.config``'s module docstring."""
    import ortlab.config

    rows = ["| variable | meaning |", "|---|---|"]
    current: list[list[str]] = []
    borders = 0  # an RST simple table: a border line, the rows, a border line
    for line in (ortlab.config.__doc__ or "").splitlines():
        if re.fullmatch(r"=+\s+=+", line.strip()):
            borders += 1
            continue
        if borders != 1:
            continue
        if m := re.match(r"``(ORTLAB_\w+)``\s+(.*)", line):
            current.append([m.group(1), m.group(2).strip()])
        elif current and line.strip():
            current[-1][1] += " " + line.strip()
    if not current:
        raise DocsError("ortlab.config's module docstring has no table of ORTLAB_* variables.")
    for name, meaning in current:
        rows.append(f"| `{name}` | {_cell(_rst_literals(meaning))} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# Supported models: the Hugging Face architectures benchmark's result file.


def hf_architectures_markdown(path: Path = RESULTS / "xeon-avx512" / "hf_architectures_auto.txt") -> str:
    """A table of the architectures ``benchmarks/hf_architectures.py`` trained beside eager: the last run
    (``== command (date, machine) ==`` block) of its newest result file, with the providers a user gets."""
    if not path.exists():
        raise DocsError(f"{path.relative_to(ROOT)} is missing: run `python benchmarks/hf_architectures.py`.")
    blocks: list[list[str]] = [[]]
    for line in path.read_text().splitlines():
        if line.startswith("== ") and line.rstrip().endswith("=="):
            blocks.append([])
        blocks[-1].append(line)
    block = blocks[-1]
    header, rows = [], []
    for line in block:
        m = re.match(r"(\w+)\s{2,}(.*)", line)
        if m and "; captures " in line:
            name, rest = m.groups()
            verdict = rest.split(";")[0]
            if m := re.search(r"float32 conditioning: .*? eager ([\d.e+-]+), ortlab ([\d.e+-]+)", rest):
                verdict = (f"beyond rtol/atol, as far from float64 as eager float32 is (float32 conditioning: "
                           f"eager {m.group(1)}, ortlab {m.group(2)})")
            elif verdict != "OK":
                verdict = _cell(verdict)
            largest = re.search(r"largest gradient difference ([\d.e+-]+)", rest)
            captures = re.search(r"captures (\d+)", rest).group(1)
            parts = re.search(r"parts on \w+ (\d+)", rest)
            in_pytorch = rest.split("in PyTorch: ", 1)[1] if "in PyTorch: " in rest else ""
            kinds = sorted({part.split(":")[0].strip() for part in in_pytorch.split(", ") if ":" in part})
            ops = sorted({part.split(": ")[-1].strip() for part in in_pytorch.split(", ")
                          if part.split(":")[0].strip() in ("random", "untranslatable", "known_wrong")})
            what = "nothing" if in_pytorch.strip() == "nothing" else ", ".join(kinds)
            if ops:
                what += " (" + ", ".join(f"`{op}`" for op in ops) + ")"
            rows.append(f"| {name} | {verdict} | {largest.group(1) if largest else ''} | {captures} | "
                        f"{parts.group(1) if parts else ''} | {what} |")
        elif not rows and line.strip():
            header.append(line.strip().strip("=").strip())
    if not rows:
        raise DocsError(f"{path.relative_to(ROOT)} has no result rows in its last run.")
    source = html.escape(" ".join(header), quote=False)
    return (f"{len(rows)} architectures, the last run in `{path.relative_to(ROOT)}`: {source}\n\n"
            "| architecture | verdict | largest gradient difference | captures | onnxruntime parts | what runs in PyTorch |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


# ---------------------------------------------------------------------------------------------
# Benchmark plots: train_step.json and the per-machine tables.

_TABLE_HEAD = re.compile(r"contender\s+median ms\s+vs eager")


def machine_tables(results: Path = RESULTS) -> list[dict]:
    """Every ``== model ==`` table of ``train_step.py``'s text output under ``benchmarks/results/``.

    Returns rows ``{machine, file, date, model, contender, median_ms, vs_eager}`` (the date: the first
    YYYY-MM-DD in the file's name or first lines, else ""); the machine is the folder
    (``xeon``, ``epyc-zen4``...; ``amd-epyc (top level)`` for the files directly in ``benchmarks/results/``,
    written on 2-core AMD EPYCs with and without AVX-512).
    """
    rows = []
    for path in sorted(results.rglob("*.txt")):
        machine = path.parent.name if path.parent != results else "amd-epyc (top level)"
        model, in_table = None, False
        text = path.read_text(errors="replace")
        dated = re.search(r"20\d\d-\d\d-\d\d", path.name + "\n" + "\n".join(text.splitlines()[:5]))
        for line in text.splitlines():
            if m := re.match(r"==\s*([\w.-]+)\s*==\s*$", line.strip()):
                model, in_table = m.group(1), False
            elif model and _TABLE_HEAD.match(line.strip()):
                in_table = True
            elif in_table and (m := re.match(r"([\w.,-]+(?: [\w.,-]+)?)\s+([\d.]+)\s+([\d.]+)x\b", line.strip())):
                rows.append({"machine": machine, "file": str(path.relative_to(ROOT)),
                             "date": dated.group(0) if dated else "", "model": model,
                             "contender": m.group(1), "median_ms": float(m.group(2)), "vs_eager": float(m.group(3))})
            elif in_table and not line.strip().startswith("-"):
                in_table = False
    return rows


def _figure_html(fig, div_id: str, caption: str) -> str:
    figure = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False})
    return f'<figure class="ortlab-plot">\n{figure}\n<figcaption>{html.escape(caption)}</figcaption>\n</figure>'


def benchmark_plots_html(results: Path = RESULTS) -> str:
    """Three figures as HTML: step-time distributions of train_step.json, ortlab's ratio to eager on every
    machine and model, and each table's contenders side by side."""
    import plotly.graph_objects as go

    parts = []
    data = json.loads((results / "train_step.json").read_text())
    fig = go.Figure()
    for model, contenders in data["models"].items():
        eager = contenders.get("eager", {}).get("median_ms")
        for name, c in contenders.items():
            times = c.get("times_ms") or []
            if times and eager:
                fig.add_trace(go.Box(y=[eager / t for t in times], name=f"{model}: {name}", boxpoints=False))
    fig.update_layout(title="Every measured step against eager's median step", yaxis_title="eager median / step time",
                      showlegend=False, height=420, margin={"l": 60, "r": 20, "t": 60, "b": 80})
    fig.add_hline(y=1.0, line_dash="dot")
    parts.append(_figure_html(fig, "train-step-json", (
        f"benchmarks/results/train_step.json: {data.get('steps')} steps after {data.get('warmup')} warm-up steps per "
        f"contender, torch {data.get('torch')}, onnxruntime {data.get('onnxruntime')}, {data.get('threads')} threads; "
        "above 1 is faster than eager's median step.")))

    rows = machine_tables(results)
    if not rows:
        raise DocsError("no train_step tables found under benchmarks/results/")
    ours = [r for r in rows if r["contender"] == "ortlab"]
    fig = go.Figure()
    for machine in sorted({r["machine"] for r in ours}):
        mine = [r for r in ours if r["machine"] == machine]
        fig.add_trace(go.Scatter(x=[r["model"] for r in mine], y=[r["vs_eager"] for r in mine], mode="markers",
                                 name=machine, text=[r["file"] for r in mine], marker={"size": 10},
                                 hovertemplate="%{x}: %{y:.2f}x eager<br>%{text}<extra>" + machine + "</extra>"))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title="ortlab's step against eager, every table", yaxis_title="eager time / ortlab time",
                      height=440, margin={"l": 60, "r": 20, "t": 60, "b": 60})
    parts.append(_figure_html(fig, "ortlab-vs-eager", (
        f"One point per train_step.py table in benchmarks/results/ ({len(ours)} tables, dated history included: "
        "hover for the file), by machine folder. In-process runs of the large models flatter ortlab; see "
        "'Where the speed targets stand'.")))

    latest: dict[tuple[str, str, str], dict] = {}
    for r in sorted(rows, key=lambda r: (r["date"], r["file"])):  # the latest dated table wins
        latest[(r["machine"], r["model"], r["contender"])] = r
    fig = go.Figure()
    for contender in sorted({k[2] for k in latest}):
        picked = [v for k, v in sorted(latest.items()) if k[2] == contender]
        fig.add_trace(go.Bar(x=[f"{v['machine']}<br>{v['model']}" for v in picked],
                             y=[v["vs_eager"] for v in picked], name=contender,
                             text=[f"{v['file']} {v['date']}" for v in picked],
                             hovertemplate="%{y:.2f}x<br>%{text}"))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(barmode="group", title="Every contender against eager, the last table per machine and model",
                      yaxis_title="eager time / contender time", height=480,
                      margin={"l": 60, "r": 20, "t": 60, "b": 120})
    parts.append(_figure_html(fig, "contenders", (
        "For each machine folder and model, each contender's latest table (by the date in the file, then its "
        "name); ortlab-dense is label sparsity off, ortlab-padding embedding sparsity on.")))
    return "\n\n".join(parts)


def speed_table_markdown(results: Path = RESULTS) -> str:
    """The newest ``benchmarks/results/<machine>/speed_table_<date>.md`` table (``benchmarks/gemm_floor.py``'s
    markdown rows: each contender alone, the GEMM floor, the first step), with the file it came from."""
    tables = sorted(results.glob("*/speed_table_*.md"), key=lambda f: (f.stem.rsplit("_", 1)[-1], f.parent.name))
    if not tables:
        raise DocsError(f"no speed_table_<date>.md under {results}: run benchmarks/gemm_floor.py (its docstring)")
    path = tables[-1]
    rows = [line for line in path.read_text().splitlines() if line.startswith("|")]
    if len(rows) < 3:
        raise DocsError(f"{path}: no markdown table (gemm_floor.py's '| model | contender | ...' rows)")
    return "\n".join(rows) + f"\n\nFrom `{path.relative_to(ROOT)}`."


# ---------------------------------------------------------------------------------------------
# MkDocs events.

_GENERATORS = {
    "options": options_markdown,
    "debug-options": debug_options_markdown,
    "environment": environment_markdown,
    "hf-architectures": hf_architectures_markdown,
    "speed-table": speed_table_markdown,
}


def on_config(config):
    """Turn notebook execution off when ``ORTLAB_DOCS_EXECUTE`` is 0 (or false, no, off)."""
    jupyter = config.plugins["mkdocs-jupyter"].config
    value = os.environ.get("ORTLAB_DOCS_EXECUTE", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        jupyter["execute"] = False
    elif value not in ("1", "true", "yes", "on", ""):
        raise DocsError(f"ORTLAB_DOCS_EXECUTE={value!r}: use 1 (execute the notebooks, the default) or 0.")
    if jupyter["execute"]:
        # mkdocs-jupyter's cache keys on the notebook's bytes, not on ortlab's code: an executed notebook
        # cached before a change would show the old outputs. Executed builds always run them.
        jupyter["cache"] = False
    return config


def _event_priority(priority: int):
    try:
        from mkdocs.plugins import event_priority
    except ImportError:  # tests/test_docs.py imports this module for its generators, where mkdocs may be absent
        return lambda f: f
    return event_priority(priority)


@_event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the notebooks we add
def on_files(files, config):
    """Add ``notebooks/*.ipynb`` (from the repository's notebooks/) and plotly.js to the site."""
    from mkdocs.structure.files import File

    # A File with the repository as its source folder, not File.generated: mkdocs-jupyter's wrapper
    # finds the notebook's path through src_dir, which a generated file does not have.
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(File(f"notebooks/{path.name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    import plotly.offline

    files.append(File.generated(config, PLOTLY_JS, content=plotly.offline.get_plotlyjs()))
    return files


def on_page_markdown(markdown, page, config, files):
    """Replace each ``<!-- generated: NAME -->`` marker with its generated markdown."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name == "benchmark-plots":
            prefix = "../" * page.url.count("/")  # the page's folder depth: benchmarks/ -> ../
            return f'<script src="{prefix}{PLOTLY_JS}"></script>\n\n' + benchmark_plots_html()
        if name not in _GENERATORS:
            raise DocsError(f"{page.file.src_uri}: unknown marker <!-- generated: {name} -->; "
                            f"known: {sorted([*_GENERATORS, 'benchmark-plots'])}.")
        return _GENERATORS[name]()

    return re.sub(r"<!-- generated: ([\w-]+) -->", replace, markdown)


__all__ = ["docstring_args", "options_markdown", "debug_options_markdown", "environment_markdown",
           "hf_architectures_markdown", "machine_tables", "benchmark_plots_html", "DocsError"]
