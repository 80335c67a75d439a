"""A compare result in a notebook, its nodes linked to netron views of the graphs that ran.

``ortlab.compare`` keeps the ONNX model of every onnxruntime session of the compared
step (``CompareResult.graphs``, for repro scripts). This view writes those models to a
temp folder once per result and links the first divergence, each layer's first
diverged node and every out-of-tolerance node to its node in a netron view shown
under the tables (the way the kernel table and the toggles link theirs, see
``ortlab.ui._links``). The node names are the FX node names, which the exported
models carry as ``ortlab.fx_node``; a node that ran in PyTorch links to the first
onnxruntime part that reads it, or to nothing.

Registered as the ``compare_html`` view (``ortlab.inspect.views``), so
``CompareResult._repr_html_`` uses it whenever ``ortlab.ui`` is loaded
(``ortlab.compare`` loads it).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import tempfile
import weakref

from ortlab.inspect._results import CompareResult, NodeComparison
from ortlab.inspect._tables import result_html
from ortlab.inspect.views import register_view
from ortlab.stages import serialize_onnx
from ortlab.ui._links import Files, Linker
from ortlab.ui._module_graphs import remove_graph_folder
from ortlab.ui.netron_view import HEIGHT

__all__ = ["compare_html", "graph_files"]

logger = logging.getLogger(__name__)

_FRAME = f"ortlab_compare_{secrets.token_hex(4)}_"
_FRAMES = itertools.count()
# Files per result, by id: a CompareResult is an (unhashable) dataclass; the finalizer
# removes the folder and the entry when the result is collected.
_FILES: dict[int, Files] = {}


def graph_files(result: CompareResult) -> Files:
    """The result's onnxruntime models as ``(label, path)``: ``g0.forward``, or ``g0.forward.1`` per part."""
    files = _FILES.get(id(result))
    if files is not None:
        return files
    root = tempfile.mkdtemp(prefix="ortlab-compare-")
    files = []
    for graph in result.graphs:
        for i, part in enumerate(graph.parts):
            label = graph.label if len(graph.parts) == 1 else f"{graph.label}.{i}"
            path = os.path.join(root, f"{label.replace('.', '_')}.onnx")
            try:
                with open(path, "wb") as f:
                    f.write(serialize_onnx(part.exported.model))
            except Exception as e:  # a model that cannot be written gets no links, the table stays
                logger.debug("no links into %s: %s", label, e)
                continue
            files.append((label, path))
    _FILES[id(result)] = files
    weakref.finalize(result, _remove, id(result), root)
    return files


def _remove(key: int, root: str) -> None:
    _FILES.pop(key, None)
    remove_graph_folder(root)


def compare_html(result: CompareResult, height: int = HEIGHT) -> str:
    """The compare tables with node links, and the netron view they open in (when any node links).

    Example:
        >>> from IPython.display import HTML; HTML(compare_html(ortlab.compare(model, x, y)))  # doctest: +SKIP
    """
    if not result.diverged_nodes or not result.graphs:
        return result_html(result)
    linker = Linker(lambda: graph_files(result), f"{_FRAME}{next(_FRAMES)}", start=True)
    if not linker.active:
        return result_html(result)
    urls: dict[tuple[str, str], str | None] = {}

    def url(n: NodeComparison) -> str | None:
        key = (n.graph, n.node)
        if key not in urls:
            urls[key] = linker.fx_node(n.graph, n.node)
        return urls[key]

    def node_link(n: NodeComparison, text: str) -> str:
        return linker.link(text, url(n))

    first = result.first_divergence or result.diverged_nodes[0]
    footer = linker.viewer(url(first), height)
    return result_html(result, node_link=node_link, footer=footer)


register_view("compare_html", compare_html)
