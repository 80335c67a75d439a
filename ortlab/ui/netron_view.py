"""Graph views: netron inside the notebook, serving only the files ortlab saved.

A view is an IFrame of netron's page (``NetronView``), served by a netron server of
ortlab's own on 127.0.0.1 with a page that works offline and selects the node named
in ``?node=``, opening its properties (``ortlab.module``, ``ortlab.source``) in netron's
sidebar. Tables (saved activations and fallbacks in ``ortlab.ui.stepper``, slow
kernels in ``ortlab.ui.kernel_table``, the toggles) link rows to :func:`url_for` URLs
(see ``ortlab.ui._links``) that open in the lab's view (the IFrame named
:func:`frame_name`) or in a view under the table. A graph too large for netron is
shown a module at a time.

The work is split by job, and every public name is re-exported here:

* ``ortlab.ui._netron_page``: netron's page and static files, offline
  (Note [Why ortlab serves netron itself]);
* ``ortlab.ui._netron_server``: the HTTP server and the process's shared one;
* ``ortlab.ui._netron_graphs``: the ONNX side: a node's source, module subgraphs,
  the node a name means (Note [Large graphs]), inputs by parameter name (Note [Named graph inputs]);
* ``ortlab.ui._netron_frame``: the frame in the notebook: the wheel scrolls the notebook
  until a click, and a saved notebook shows "re-run this cell", never a dead frame;
* this module: the views and the files they show.
"""

from __future__ import annotations

import html
import itertools
import os
import re
from typing import Any

from ortlab.errors import ConfigError, OrtlabError
from ortlab.inspect.views import register_view
from ortlab.ui._netron_frame import frame_html
from ortlab.ui._netron_graphs import (
    annotate,
    extract_module,
    input_names,
    load_model,
    module_counts,
    node_modules,
    rename_inputs,
    resolve_node,
)
from ortlab.ui._netron_page import SETTINGS_SCRIPT, netron_version  # noqa: F401 (SETTINGS_SCRIPT: for tests)
from ortlab.ui._netron_server import (
    NetronServer,
    default_server,
    forget_folder,
    frame_name,
    proxy_prefix,
    running_default_server,
    set_proxy,
    stop_default_server,
)

__all__ = [
    "NetronServer",
    "NetronView",
    "ModulePicker",
    "CodeView",
    "default_server",
    "stop_default_server",
    "set_proxy",
    "proxy_prefix",
    "extract_module",
    "annotate",
    "module_counts",
    "node_modules",
    "resolve_node",
    "view_file",
    "view_stage",
    "url_for",
    "frame_name",
    "forget_folder",
    "running_default_server",
    "netron_version",
]

MAX_NODES = 5000
# Tall enough for netron's node sidebar down to its metadata (ortlab.module, ortlab.source) for
# a node with a few inputs; the page also scrolls the sidebar to them (see _netron_page).
HEIGHT = 720


_FRAMES = itertools.count(1)


class NetronView:
    """A graph in netron, shown in the notebook as an IFrame (``_repr_html_``).

    Attributes:
        url: the page, with ``?file=`` and ``?node=``; ``path``: the file shown;
        node: the node selected; ``info``: what is shown (a module's subgraph...).
    """

    def __init__(self, server: NetronServer, name: str, path: str, node: str | None = None,
                 height: int = HEIGHT, info: str = "", frame: str | None = None) -> None:
        self.server, self.name, self.path, self.node = server, name, path, node
        # A name of its own in its family (Note [A link opens in the frame showing its graph]).
        family = frame or frame_name(os.path.dirname(path))
        self.height, self.info, self.frame = height, info, f"{family}_{next(_FRAMES)}"
        self.url = server.url(name, node)

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, scroll: bool = False) -> str:
        """The view as HTML; ``scroll``: brought into sight once it opens (a view the user just asked for)."""
        info = f" &middot; {html.escape(self.info)}" if self.info else ""
        node = f" &middot; node <code>{html.escape(self.node)}</code>" if self.node else ""
        header = (f"netron: <b>{html.escape(os.path.basename(self.path))}</b>{info}{node} &middot; "
                  f'<a href="{html.escape(self.url, quote=True)}" target="_blank" rel="noopener">open in a new tab</a>')
        return frame_html(self.url, self.frame, self.height, header, scroll)

    def iframe(self) -> Any:
        """An ``IPython.display.IFrame`` of the view."""
        from IPython.display import IFrame

        return IFrame(self.url, width="100%", height=self.height)

    def close(self) -> None:
        """Stop serving this view's file."""
        self.server.remove(self.name)

    def __repr__(self) -> str:
        return f"NetronView({self.url})"


class ModulePicker:
    """Shown instead of a graph too large for netron: its modules, to view one at a time."""

    def __init__(self, path: str, nodes: int, counts: dict[str, int], call: str, max_nodes: int) -> None:
        self.path, self.nodes, self.counts, self.call, self.max_nodes = path, nodes, counts, call, max_nodes

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><code>{html.escape(m or '<root>')}</code></td>"
            f"<td style='text-align:right'>{html.escape(str(n))}</td></tr>"
            for m, n in list(self.counts.items())[:40]
        )
        example = next((m for m in self.counts if m not in ("", "?")), "")
        return (
            f"<div style='font:12px sans-serif'><p><b>{html.escape(os.path.basename(self.path))}</b> has "
            f"{self.nodes} nodes (netron lays out more than {self.max_nodes} slowly). View one module: "
            f"<code>{html.escape(f'{self.call}(module={example!r})')}</code>, or all of it with "
            f"<code>force=True</code>.</p><table><tr><th>module</th><th>nodes</th></tr>{rows}</table></div>"
        )

    def __repr__(self) -> str:
        return f"ModulePicker({self.path}: {self.nodes} nodes, modules {list(self.counts)[:8]})"


class CodeView:
    """An FX stage's code (netron does not read FX graphs), with a node's line marked."""

    def __init__(self, path: str, node: str | None = None) -> None:
        self.path, self.node = path, node
        with open(path, encoding="utf-8") as f:
            self.code = f.read()

    def line_of(self, node: str) -> int | None:
        """1-based line that defines ``node`` (``name: "f32[..]" = ...`` or ``name = ...``)."""
        pattern = re.compile(rf"^\s+{re.escape(node)}(?:: \"[^\"]*\")? = ")
        return next((i for i, line in enumerate(self.code.splitlines(), 1) if pattern.match(line)), None)

    def _repr_html_(self) -> str:
        mark = self.line_of(self.node) if self.node else None
        lines = []
        for i, line in enumerate(self.code.splitlines(), 1):
            style = " style='background:#fff3b0'" if i == mark else ""
            lines.append(f"<span id='L{i}'{style}>{html.escape(line)}</span>")
        return (f"<div style='font:12px sans-serif'><b>{html.escape(os.path.basename(self.path))}</b></div>"
                f"<pre style='max-height:500px;overflow:auto;font-size:11px'>{chr(10).join(lines)}</pre>")


def _in_folder(folder: str, path: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) inside ``folder``."""
    real = os.path.realpath(folder)
    return os.path.commonpath([real, os.path.realpath(path)]) == real


def _view_file(path: str, out: str) -> str:
    """``out`` (a file under ``views/`` next to ``path``), checked not to lead out of ``path``'s folder."""
    if not _in_folder(os.path.dirname(path), out):
        raise ConfigError(f"cannot write the view {out}: it leads outside the graph's folder "
                          f"{os.path.dirname(path)} (to {os.path.realpath(out)}) through a symlink. "
                          "Remove the link (views/ holds only files ortlab makes).")
    return out


def _reference_path(path: str) -> str | None:
    """The exported (or onnxscript) model an optimized stage file came from, if saved next to it."""
    for stage in ("onnxscript", "exported"):
        candidate = re.sub(r"_(ort_basic|ort_extended|ort_all|execution|onnxscript)_(train|eval)\.onnx$",
                           rf"_{stage}_\2.onnx", path)
        if candidate != path and os.path.exists(candidate) and _in_folder(os.path.dirname(path), candidate):
            return candidate
    return None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "root"


def _fresh(out: str, path: str) -> bool:
    return os.path.exists(out) and os.stat(out).st_mtime_ns >= os.stat(path).st_mtime_ns


def _shown_names(model: Any, reference: Any) -> dict[str, str]:
    """Graph input -> the name netron shows (Note [Named graph inputs]); an optimized model's from its reference."""
    names = input_names(model)
    return names if names or reference is None else input_names(reference)


def _shown_model(model: Any, reference: Any, names: dict[str, str]) -> Any | None:
    """The model netron shows: the source restored on an optimized model's nodes (see :func:`annotate`),
    the inputs named; None when that is the file as saved."""
    annotated = annotate(model, reference) if reference is not None else None
    return rename_inputs(annotated or model, names) if names else annotated


def _module_file(path: str, model: Any, module: str, reference: Any, names: dict[str, str]) -> str:
    import onnx

    folder = os.path.join(os.path.dirname(path), "views")
    stem = os.path.splitext(os.path.basename(path))[0]
    out = _view_file(path, os.path.join(folder, f"{stem}.{_safe(module)}.onnx"))
    if not _fresh(out, path):
        os.makedirs(folder, exist_ok=True)
        onnx.save(extract_module(_shown_model(model, reference, names) or model, module, reference), out)
    return out


def _shown_file(path: str, model: Any, reference: Any, names: dict[str, str]) -> str:
    """``path``, or a copy under ``views/`` whose nodes carry their source and whose inputs are named."""
    import onnx

    if reference is None and not names:
        return path
    out = _view_file(path, os.path.join(os.path.dirname(path), "views", os.path.basename(path)))
    if _fresh(out, path):
        return out
    shown = _shown_model(model, reference, names)
    if shown is None:
        return path
    os.makedirs(os.path.dirname(out), exist_ok=True)
    onnx.save(shown, out)
    return out


def url_for(path: str, node: str | None = None, server: NetronServer | None = None,
            max_nodes: int = MAX_NODES) -> str:
    """The URL of a view of ``path`` with ``node`` selected (for links in tables).

    A graph larger than ``max_nodes`` links to the subgraph of the node's module.

    Example:
        >>> url_for("lab/net_forward_exported_train.onnx", "tanh")     # doctest: +SKIP
        'http://127.0.0.1:40123/?file=net_forward_exported_train.onnx&node=node_tanh&title=...'
    """
    server = server or default_server()
    view = view_file(path, node=node, server=server, max_nodes=max_nodes)
    if isinstance(view, ModulePicker):  # a node of no known module: the whole graph
        return server.url(server.add(path), node)
    return view.url


def view_file(
    path: str,
    node: str | None = None,
    module: str | None = None,
    height: int = HEIGHT,
    max_nodes: int = MAX_NODES,
    force: bool = False,
    server: NetronServer | None = None,
    frame: str | None = None,
    call: str = "view",
) -> NetronView | ModulePicker:
    """Show a saved ONNX file in netron; a large one a module at a time.

    Args:
        path: an ONNX file ortlab saved.
        node: select this node (see :func:`resolve_node`).
        module: show only this nn.Module's nodes (see :func:`extract_module`).
        height: of the IFrame, in pixels.
        max_nodes: above this many nodes show a module (the node's, when ``node`` is
            given) or, without one, a :class:`ModulePicker`.
        force: show the whole graph however large.
        server: default :func:`default_server`.
        frame: the IFrame's name (links with this target open in it).
        call: how the picker tells the user to call again.

    Example:
        >>> view_file("lab/net_forward_exported_train.onnx", node="addmm")    # doctest: +SKIP
    """
    model = load_model(path)
    ref_path = _reference_path(path)
    reference = load_model(ref_path) if ref_path else None
    target = resolve_node(model, node, reference) if node else None
    nodes = len(model.graph.node)
    info = f"{nodes} nodes"
    if module is None and nodes > max_nodes and not force:
        modules = node_modules(model, reference)
        if target is not None and target not in modules:  # a value: its producer's module
            target_node = next((n.name for n in model.graph.node if target in n.output), None)
            module = modules.get(target_node or "")
        else:
            module = modules.get(target or "") if target else None
        if module in (None, "?"):
            return ModulePicker(path, nodes, module_counts(model, 2, reference), call, max_nodes)
    names = _shown_names(model, reference)
    if module is not None:
        sub = _module_file(path, model, module, reference, names)
        info = f"module {module or '<root>'} of {os.path.basename(path)} ({nodes} nodes)"
        path = sub
    else:
        path = _shown_file(path, model, reference, names)
    if target in names:
        target = names[target]  # an input, selected by the name netron shows
    server = server or default_server()
    return NetronView(server, server.add(path), path, target or node, height, info, frame)


def view_stage(stage: Any, graph: str | None = None, node: str | None = None, module: str | None = None,
               **kwargs: Any) -> NetronView | ModulePicker | CodeView:
    """Show a stage's graph (see ``Stage.view``); FX stages show their code.

    Example:
        >>> view_stage(lab["ort_all"], graph="g0.backward", node="mm")   # doctest: +SKIP
    """
    if not stage.artifacts:
        raise OrtlabError(f"stage {stage.name!r} has no saved graph (status: {stage.status}).")
    label = graph
    if label is None and node is not None:
        label = _label_with(stage, node)
    path = stage.artifact(label)
    if stage.kind == "fx":
        return CodeView(path, node)
    if stage.lab is not None:  # stop serving the lab's files when it closes
        stage.lab.on_close(_forget_lab)
    kwargs.setdefault("frame", frame_name(stage.root))
    kwargs.setdefault("call", f"lab[{stage.name!r}].view")
    return view_file(path, node=node, module=module, **kwargs)


def _forget_lab(lab: Any) -> None:
    forget_folder(lab.folder)


register_view("stage_view", view_stage)


def _label_with(stage: Any, node: str) -> str | None:
    """The first artifact of the stage that has ``node`` (by name, FX name or value)."""
    for label in stage.artifacts:
        path = stage.artifact(label)
        if stage.kind == "fx":
            if CodeView(path).line_of(node) is not None:
                return label
            continue
        ref = _reference_path(path)
        if resolve_node(load_model(path), node, load_model(ref) if ref else None) is not None:
            return label
    return None
