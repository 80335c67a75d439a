"""A runnable repro of one diverging value, and the FX graph saved with its node names.

:func:`write_repro` leaves a folder with a runnable ``repro.py``: the ONNX model of the
diverging node's session exactly as onnxruntime ran it, the inputs it received and the
FX graph with its inputs (saved with their node names, see :func:`graph_to_dict`), so
the divergence reproduces without the notebook session that found it.

Example:
    >>> path = write_repro(compare(model, x), "repro")     # doctest: +SKIP
    >>> subprocess.run([sys.executable, path])              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from ortlab._compat.torch import HigherOrderOperator, OpOverload
from ortlab.errors import OrtlabError
from ortlab.inspect.compare import CompareResult, NodeComparison

__all__ = ["write_repro", "graph_to_dict", "graph_from_dict"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------- graph on disk


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclasses.dataclass(frozen=True)
class _TorchAttr:
    """``torch.contiguous_format``, ``torch.strided``...: these do not pickle."""

    name: str


def _encode(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return _NodeRef(a.name)
    if isinstance(a, (torch.memory_format, torch.layout)):
        return _TorchAttr(str(a).removeprefix("torch."))
    return a


def _target(node: torch.fx.Node) -> tuple[str, str]:
    t = node.target
    if isinstance(t, str):
        return ("str", t)
    if isinstance(t, OpOverload):
        return ("op", f"{t.namespace}.{t._opname}.{t._overloadname}")
    if isinstance(t, HigherOrderOperator):
        return ("hop", t.__name__)
    return ("py", f"{t.__module__}:{t.__qualname__}")


def _resolve(kind: str, name: str) -> Any:
    if kind == "str":
        return name
    if kind == "op":
        ns, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    if kind == "hop":
        return getattr(torch.ops.higher_order, name)
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def graph_to_dict(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """A picklable description of ``gm`` that keeps every node's name.

    ``torch.save(gm)`` re-traces the generated code on load, which renames nodes; the
    names are how a diverging value is found again, so we store the nodes themselves.

    Example:
        >>> gm2 = graph_from_dict(graph_to_dict(gm))      # doctest: +SKIP
    """
    nodes = []
    attrs = {}
    for n in gm.graph.nodes:
        nodes.append({"op": n.op, "name": n.name, "target": _target(n),
                      "args": torch.fx.node.map_aggregate(n.args, _encode),
                      "kwargs": torch.fx.node.map_aggregate(n.kwargs, _encode)})
        if n.op == "get_attr":
            value = getattr(gm, str(n.target))
            attrs[str(n.target)] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return {"nodes": nodes, "attrs": attrs}


def graph_from_dict(data: dict[str, Any]) -> torch.fx.GraphModule:
    """Rebuild a graph saved by :func:`graph_to_dict` (same node names)."""
    graph = torch.fx.Graph()
    root = nn.Module()
    env: dict[str, torch.fx.Node] = {}

    def look(a: Any) -> Any:
        if isinstance(a, _NodeRef):
            return env[a.name]
        return getattr(torch, a.name) if isinstance(a, _TorchAttr) else a
    for spec in data["nodes"]:
        target = _resolve(*spec["target"])
        if spec["op"] == "get_attr":
            setattr(root, target, data["attrs"][target])
        args = torch.fx.node.map_aggregate(spec["args"], look)
        kwargs = torch.fx.node.map_aggregate(spec["kwargs"], look)
        node = graph.create_node(spec["op"], target, args, kwargs, name=spec["name"])
        env[spec["name"]] = node
    return torch.fx.GraphModule(root, graph)


# ------------------------------------------------------------------------------- repro

_SCRIPT = '''"""Repro written by ortlab.inspect on {date}.

{description}

    python repro.py              onnxruntime (saved model, as it ran) vs PyTorch (saved FX graph)
    python repro.py --reexport   translate the FX graph again with this ortlab (is it fixed?)
    python repro.py --model      the whole step again with ortlab.inspect.compare (needs the model's code)

Exits with status 1 while the value diverges.
"""

import argparse
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ortlab.inspect.repro import graph_from_dict
from ortlab.inspect.compare import compare_tensors

HERE = os.path.dirname(os.path.abspath(__file__))
bundle = torch.load(os.path.join(HERE, "bundle.pt"), weights_only=False)
NODE, RTOL, ATOL = bundle["node"], bundle["rtol"], bundle["atol"]


def torch_values(gm, inputs):
    """Every node's value with the graph run in PyTorch."""
    values = {{}}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if bundle["rng"] is not None:  # random ops (dropout) draw what they drew in the step
            torch.set_rng_state(bundle["rng"])
        Record(gm).run(*inputs)
    return values


def onnxruntime_value(model_bytes, value_name, inputs, kinds):
    """``value_name`` as onnxruntime computes it (added as an extra model output)."""
    model = onnx.load_from_string(model_bytes)
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(value_name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    dtypes = {{"int": np.int64, "float": np.float32, "bool": np.bool_}}
    feed = {{}}
    for arg, value, kind in zip(session.get_inputs(), inputs, kinds):
        feed[arg.name] = value.detach().cpu().numpy() if kind == "tensor" else np.array(value, dtype=dtypes[kind])
    return torch.from_numpy(session.run([value_name], feed)[0])


def report(label, actual, expected):
    s = compare_tensors(actual, expected, rtol=RTOL, atol=ATOL)
    status = "ok      " if s.allclose else "DIVERGES"
    print(f"{{status}} {{label}}: max abs {{s.max_abs:.3g}}, max rel {{s.max_rel:.3g}}, "
          f"{{100 * s.mismatch_fraction:.1f}}% of {{s.numel}} elements out of tolerance (rtol={{RTOL}}, atol={{ATOL}})")
    return not s.allclose


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reexport", action="store_true")
    parser.add_argument("--model", action="store_true")
    args = parser.parse_args()
    print(f"node {{NODE}} ({{bundle['op']}}) of {{bundle['graph_name']}} at {{bundle['module'] or '<root>'}}: {{bundle['source']}}")
    if args.model:
        if bundle.get("model") is None:
            sys.exit("the model's class could not be imported when this repro was written; run without --model")
        sys.path[:0] = bundle["model"]["path"]
        import ortlab.inspect

        model = torch.load(os.path.join(HERE, "model.pt"), weights_only=False)
        result = ortlab.inspect.compare(model, *bundle["model"]["inputs"], forward_kwargs=bundle["model"]["kwargs"],
                                        rtol=RTOL, atol=ATOL, **bundle["model"]["options"])
        print(result)
        sys.exit(0 if result.ok else 1)
    gm = graph_from_dict(bundle["graph"])
    expected = torch_values(gm, bundle["graph_inputs"])
    if args.reexport:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        from ortlab.onnx.export import export_graph

        random = sorted({{str(n.target) for n in gm.graph.nodes if "rand" in str(n.target) or "dropout" in str(n.target)}})
        if random:
            print(f"note: the graph has random ops ({{', '.join(random)}}); translated to ONNX they draw other numbers")
        # export_graph types every value from node.meta["val"], as AOTAutograd leaves it.
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*bundle["graph_inputs"])
        exported = export_graph(gm, "repro")
        data = exported.to_bytes()
        actual = onnxruntime_value(data, bundle["onnx_value"], bundle["graph_inputs"], exported.input_kinds)
    else:
        with open(os.path.join(HERE, "model.onnx"), "rb") as f:
            data = f.read()
        actual = onnxruntime_value(data, bundle["onnx_value"], bundle["onnx_inputs"], bundle["onnx_input_kinds"])
    bad = report("onnxruntime vs PyTorch (same graph, same inputs)", actual, expected[NODE])
    op_inputs = bundle["op_inputs"]
    if op_inputs is not None and not args.reexport:
        # The op alone, on the inputs onnxruntime itself computed: is this op wrong, or its inputs?
        node = next(n for n in gm.graph.nodes if n.name == NODE)
        look = lambda a: op_inputs[a.name] if isinstance(a, torch.fx.Node) else a
        with torch.no_grad():
            alone = node.target(*torch.fx.node.map_arg(node.args, look), **torch.fx.node.map_arg(node.kwargs, look))
        report(f"onnxruntime vs PyTorch's {{bundle['op']}} on onnxruntime's own inputs", actual, alone)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
'''


def _model_entry(model: nn.Module | None, inputs: Sequence[Any] | None, kwargs: dict | None, options: dict) -> dict | None:
    """How ``--model`` finds the model again, or None when its class cannot be imported by name."""
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
    return {"path": path, "inputs": list(inputs), "kwargs": kwargs or {}, "options": options}


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

    The folder holds ``repro.py``, ``bundle.pt`` (the FX graph with its inputs and the
    random state it was called with, the inputs of the onnxruntime session and the
    node's inputs as onnxruntime computed them), ``model.onnx`` (the session's model as onnxruntime ran it) and, when the
    model's class can be imported by name, ``model.pt`` for ``--model``.

    Args:
        result: a ``compare`` result with intermediates (``keep_values=True``).
        directory: where to write; created if missing.
        node: the FX node (name or comparison); default the first divergence.
        model, inputs, forward_kwargs: the compared model and inputs, for ``--model``.

    Raises:
        OrtlabError: when the node has no onnxruntime value to reproduce.

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
    os.makedirs(directory, exist_ok=True)
    fx_node = next(n for n in run.graph_module.graph.nodes if n.name == target.node)
    op_inputs: dict[str, Any] | None = {}
    for arg in fx_node.all_input_nodes:
        value = run.onnx.get(arg.name)
        if value is None and arg.name in part.exported.input_names:
            value = part.inputs[part.exported.input_names.index(arg.name)]
        if value is None:  # computed in PyTorch, or not kept: the op replay is skipped
            op_inputs = None
            break
        op_inputs[arg.name] = value  # type: ignore[index]
    options = {k: v for k, v in result.options.items() if k != "cache_dir"}
    entry = _model_entry(model, inputs, forward_kwargs, options)
    if entry is not None:
        try:
            torch.save(model, os.path.join(directory, "model.pt"))
        except Exception as e:  # pickling fails on lambdas, open files...: --model is then unavailable
            logger.info("the model cannot be saved for --model: %s", e)
            entry = None
    bundle = {
        "node": target.node, "op": target.op, "module": target.module, "source": target.source,
        "graph_name": target.graph, "rtol": result.rtol, "atol": result.atol,
        "graph": graph_to_dict(run.graph_module), "graph_inputs": run.inputs, "rng": run.rng,
        "onnx_value": part.values[target.node], "onnx_inputs": part.inputs,
        "onnx_input_kinds": part.exported.input_kinds, "op_inputs": op_inputs, "model": entry,
    }
    torch.save(bundle, os.path.join(directory, "bundle.pt"))
    with open(os.path.join(directory, "model.onnx"), "wb") as f:
        f.write(part.exported.to_bytes())
    script = os.path.join(directory, "repro.py")
    with open(script, "w") as f:
        f.write(_SCRIPT.format(date=datetime.date.today().isoformat(), description=target.describe()))
    logger.info("wrote a repro of %s to %s", target.node, script)
    return script
