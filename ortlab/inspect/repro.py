"""A runnable repro of one diverging value: a folder that reproduces it without the session that found it.

:func:`write_repro` leaves ``repro.py``, ``model.onnx`` (the diverging node's session
exactly as onnxruntime ran it) and ``bundle.pt``: the FX graph with its node names
(:func:`graph_to_dict`), its inputs and the random state it was called with, the
inputs of the onnxruntime session and the node's inputs as onnxruntime computed them.

``repro.py`` is ``ortlab/inspect/_repro_script.py`` (read with ``importlib.resources``,
one docstring line replaced by what diverged), a real module rather than a string
template: ortlab imports its graph reader and its comparison, so the tests run the code
every repro runs, and linters see it. It imports torch, numpy, onnx, onnxruntime, the
standard library and ortlab's public API only (see Note [The repro script is a real
module] there).

``bundle.pt`` holds tensors and plain values only, and the script reads it with
``torch.load(weights_only=True)``: opening a repro someone sent runs no code from it
(see Note [What a bundle may run]). The ``--model`` mode needs the user's model itself,
which only a pickle can carry: it goes to ``model.pt`` with its inputs and options,
written only when the model's class can be imported by name, and the script unpickles
it only when asked with ``--model --trust-pickle``, never by default.

Example:
    >>> path = write_repro(compare(model, x), "repro")     # doctest: +SKIP
    >>> subprocess.run([sys.executable, path])              # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import importlib
import importlib.resources
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from ortlab._compat.torch import HigherOrderOperator, OpOverload
from ortlab.errors import InternalError, OrtlabError
from ortlab.inspect import _repro_script
from ortlab.inspect._repro_script import TAG
from ortlab.inspect.compare import CompareResult, NodeComparison

__all__ = ["write_repro", "graph_to_dict", "graph_from_dict"]

logger = logging.getLogger(__name__)

# The line of the script's docstring that each repro replaces with what diverged.
_SUMMARY_LINE = "(ortlab/inspect/_repro_script.py: write_repro copies this file into each repro folder as repro.py.)"

# ----------------------------------------------------------------------- graph on disk


def encode_value(a: Any) -> Any:
    """``a`` (a node argument, an input) as tensors and plain values ``torch.load(weights_only=True)`` reads.

    FX nodes, dtypes, layouts, memory formats, devices, slices, ``...`` and dicts become
    tagged dicts (``{"$ortlab": "node", "name": "addmm"}``) that the script's
    ``decode_value`` turns back.

    Raises:
        OrtlabError: for a value of another type.

    Example:
        >>> encode_value((torch.float16, [1, None]))
        ({'$ortlab': 'torch', 'name': 'float16'}, [1, None])
    """
    if isinstance(a, torch.fx.Node):
        return {TAG: "node", "name": a.name}
    if isinstance(a, torch.Tensor):
        return a
    if a is None:
        return None
    if isinstance(a, str):
        return str(a)
    if isinstance(a, bool):  # before int: bool is an int; numpy scalars and enums become plain numbers
        return bool(a)
    for kind in (int, float, complex):
        if isinstance(a, kind):
            return kind(a)
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return {TAG: "torch", "name": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {TAG: "device", "name": str(a)}
    if isinstance(a, slice):
        return {TAG: "slice", "args": [encode_value(a.start), encode_value(a.stop), encode_value(a.step)]}
    if a is Ellipsis:
        return {TAG: "ellipsis"}
    if isinstance(a, tuple):
        return tuple(encode_value(v) for v in a)
    if isinstance(a, list):
        return [encode_value(v) for v in a]
    if isinstance(a, dict):
        return {TAG: "dict", "items": [[encode_value(k), encode_value(v)] for k, v in a.items()]}
    raise OrtlabError(
        f"a repro cannot save a value of type {type(a).__module__}.{type(a).__qualname__} ({a!r}); it saves tensors, "
        "numbers, strings, dtypes, devices and lists, tuples and dicts of them. Reproduce this node by hand."
    )


def _target(node: torch.fx.Node) -> tuple[str, str]:
    t = node.target
    if isinstance(t, str):
        return ("str", t)
    if isinstance(t, OpOverload):
        return ("op", f"{t.namespace}.{t.__name__}")
    if isinstance(t, HigherOrderOperator):
        return ("hop", t.__name__)
    return ("py", f"{t.__module__}:{t.__qualname__}")


def graph_to_dict(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """A description of ``gm`` that keeps every node's name, in tensors and plain values.

    ``torch.save(gm)`` re-traces the generated code on load, which renames nodes; the
    names are how a diverging value is found again, so we store the nodes themselves.
    Graph-valued attributes (higher-order ops' subgraphs) are described the same way.
    :func:`graph_from_dict` rebuilds it.

    Example:
        >>> gm2 = graph_from_dict(graph_to_dict(gm))      # doctest: +SKIP
    """
    nodes = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        nodes.append({"op": n.op, "name": n.name, "target": _target(n), "args": encode_value(tuple(n.args)),
                      "kwargs": {str(k): encode_value(v) for k, v in n.kwargs.items()}})
        if n.op == "get_attr":
            value = getattr(gm, str(n.target))
            if isinstance(value, torch.fx.GraphModule):
                attrs[str(n.target)] = {TAG: "graph", **graph_to_dict(value)}
            else:
                attrs[str(n.target)] = value.detach().clone() if isinstance(value, torch.Tensor) else encode_value(value)
    return {"nodes": nodes, "attrs": attrs}


def graph_from_dict(data: dict[str, Any]) -> torch.fx.GraphModule:
    """Rebuild a graph saved by :func:`graph_to_dict` (same node names).

    The repro script's own reader (``ortlab.inspect._repro_script.graph_from_dict``),
    with its limits (see Note [What a bundle may run]).

    Raises:
        OrtlabError: when the description names a target a repro does not run.

    Example:
        >>> again = graph_from_dict(graph_to_dict(gm))    # doctest: +SKIP
        >>> [n.name for n in again.graph.nodes] == [n.name for n in gm.graph.nodes]  # doctest: +SKIP
        True
    """
    try:
        return _repro_script.graph_from_dict(data)
    except _repro_script.GraphFileError as e:
        raise OrtlabError(f"the graph cannot be rebuilt: {e}.") from e


# ------------------------------------------------------------------------------- repro


def script_text(description: str) -> str:
    """The text of a ``repro.py`` whose docstring names what diverged.

    Example:
        >>> "python repro.py --reexport" in script_text("g0.forward gelu (aten.gelu) at mlp.act")
        True
    """
    text = importlib.resources.files("ortlab.inspect").joinpath("_repro_script.py").read_text(encoding="utf-8")
    if _SUMMARY_LINE not in text:
        raise InternalError("ortlab/inspect/_repro_script.py lost the docstring line write_repro replaces")
    safe = description.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return text.replace(_SUMMARY_LINE, f"Written on {datetime.date.today().isoformat()}: {safe}", 1)


def _model_entry(model: nn.Module | None, inputs: Sequence[Any] | None) -> dict | None:
    """How ``--model`` finds the model's code again, or None when its class cannot be imported by name."""
    if model is None or inputs is None:
        return None
    cls = type(model)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return None
    try:
        mod = importlib.import_module(cls.__module__)
    except ImportError:
        return None
    path = []
    file = getattr(mod, "__file__", None)
    if file:  # the folder the top-level package is imported from
        root = os.path.dirname(os.path.abspath(file))
        for _ in range(cls.__module__.count(".") + (1 if file.endswith("__init__.py") else 0)):
            root = os.path.dirname(root)
        path.append(root)
    return {"path": path}


def _save_model(directory: str, model: nn.Module | None, inputs: Sequence[Any] | None, kwargs: dict | None,
                options: dict) -> dict | None:
    """Write ``model.pt`` for ``--model`` (a pickle: see the module docstring); its bundle entry, or None."""
    entry = _model_entry(model, inputs)
    if entry is None:
        return None
    try:
        torch.save({"model": model, "inputs": list(inputs or ()), "kwargs": kwargs or {}, "options": options},
                   os.path.join(directory, "model.pt"))
    except Exception as e:  # pickling fails on lambdas, open files...: --model is then unavailable
        logger.info("the model cannot be saved for --model: %s", e)
        return None
    return entry


def write_repro(
    result: CompareResult,
    directory: str,
    node: str | NodeComparison | None = None,
    *,
    model: nn.Module | None = None,
    inputs: Sequence[Any] | None = None,
    forward_kwargs: dict[str, Any] | None = None,
) -> str:
    """Write a runnable repro of one diverging node; returns the path of ``repro.py``.

    The folder holds ``repro.py``, ``bundle.pt`` (read with ``weights_only=True``),
    ``model.onnx`` and, when the model's class can be imported by name, ``model.pt``
    for ``--model --trust-pickle`` (see the module docstring).

    Args:
        result: a ``compare`` result with intermediates (``keep_values=True``).
        directory: where to write; created if missing.
        node: the FX node (name or comparison); default the first divergence.
        model, inputs, forward_kwargs: the compared model and inputs, for ``--model``.

    Raises:
        OrtlabError: when the node has no onnxruntime value to reproduce, or its graph
            holds a value a bundle cannot save.

    Example:
        >>> path = write_repro(compare(model, x), "repro")     # doctest: +SKIP
        >>> subprocess.run([sys.executable, path])              # doctest: +SKIP
    """
    target = node if isinstance(node, NodeComparison) else (
        result.first_divergence if node is None else result.node(node))
    if target is None:
        raise OrtlabError("no node diverged: pass the node to reproduce as node='name'.")
    run = next((g for g in result.graphs if g.label == target.graph), None)
    part = next((p for p in run.parts if target.node in p.values), None) if run is not None else None
    if run is None or part is None:
        raise OrtlabError(
            f"node {target.node} of {target.graph} has no onnxruntime value to reproduce (status {target.status!r}); "
            "run compare(..., intermediates=True, keep_values=True) and pick a node with status 'ok' or 'diverged'."
        )
    graph = graph_to_dict(run.graph_module)
    graph_from_dict(graph)  # a repro that cannot rebuild its graph fails here, not in the user's hands
    fx_node = next(n for n in run.graph_module.graph.nodes if n.name == target.node)
    op_inputs: dict[str, Any] | None = {}
    for arg in fx_node.all_input_nodes:
        value = run.onnx.get(arg.name)
        if value is None and arg.name in part.exported.input_names:
            value = part.inputs[part.exported.input_names.index(arg.name)]
        if value is None:  # computed in PyTorch, or not kept: the op replay is skipped
            op_inputs = None
            break
        op_inputs[arg.name] = encode_value(value)  # type: ignore[index]
    os.makedirs(directory, exist_ok=True)
    options = {k: v for k, v in result.options.items() if k != "cache_dir"}
    bundle = {
        "node": target.node, "op": target.op, "module": target.module, "source": target.source,
        "graph_name": target.graph, "rtol": float(result.rtol), "atol": float(result.atol),
        "graph": graph, "graph_inputs": encode_value(list(run.inputs)), "rng": run.rng,
        "onnx_value": part.values[target.node], "onnx_inputs": encode_value(list(part.inputs)),
        "onnx_input_kinds": list(part.exported.interface.input_kinds), "op_inputs": op_inputs,
        "model": _save_model(directory, model, inputs, forward_kwargs, options),
    }
    torch.save(bundle, os.path.join(directory, "bundle.pt"))
    with open(os.path.join(directory, "model.onnx"), "wb") as f:
        f.write(part.exported.to_bytes())
    script = os.path.join(directory, "repro.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(script_text(target.describe()))
    logger.info("wrote a repro of %s to %s", target.node, script)
    return script
