"""Repro of one diverging value, written by ortlab.inspect.

(ortlab/inspect/_repro_script.py: write_repro copies this file into each repro folder as repro.py.)

    python repro.py              onnxruntime (saved model, as it ran) vs PyTorch (saved FX graph)
    python repro.py --reexport   the FX graph through this ortlab's ORTModule again: is it fixed?
    python repro.py --model --trust-pickle
                                 the whole step again with ortlab.compare; this unpickles
                                 model.pt, which runs code stored in it: use it only on a
                                 folder you wrote, or whose author you trust

The default mode needs torch, numpy, onnx and onnxruntime only; --reexport and --model
need ortlab (its public API). Exits with status 1 while the value diverges.
"""

# Note [The repro script is a real module]
# This file is both ortlab.inspect._repro_script and, copied verbatim, every repro
# folder's repro.py. ortlab imports it for the graph format (``graph_from_dict``) and
# the comparison the script prints, so the code the tests run is the code a repro runs,
# and linters and type checkers see it (a string template would hide it from both).
# It therefore imports only torch, numpy, onnx, onnxruntime and the standard library at
# the top, has no side effects on import, and reaches ortlab only through its public
# API (``ortlab.ORTModule``, ``ortlab.compare``), inside the modes that need it: a
# repro keeps working across ortlab versions, and without ortlab in the default mode.
# Printing is this script's output (it is a command-line tool, not library code).
#
# Note [What a bundle may run]
# ``bundle.pt`` holds tensors and plain values only (str, numbers, lists, tuples, dicts)
# and is read with ``torch.load(weights_only=True)``: loading it runs no code. The FX
# graph it describes is a program, though, so rebuilding it accepts only torch.ops
# overloads (``torch.ops.aten.gelu.default``), torch.ops.higher_order operators, the
# functions of ``operator`` and ``math``, ``torch.sym_*``, and public method names: a
# bundle cannot name ``os.system``. ``model.pt`` (``--model``) is a pickle of the
# user's model and does run code when loaded: it is read only with ``--trust-pickle``.

from __future__ import annotations

import argparse
import math
import operator
import os
import sys
import warnings
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.fx

TAG = "$ortlab"  # dicts in an encoded value are tagged values; a real dict is {TAG: "dict", "items": [...]}
_TORCH_ATTRS = (torch.dtype, torch.layout, torch.memory_format)
_PY_FUNCTIONS = {"_operator": operator, "operator": operator, "math": math, "torch": torch}
_NOT_RUN = {"attrgetter", "itemgetter", "methodcaller", "call"}  # operator's ways to reach any attribute


class GraphFileError(ValueError):
    """A graph description this script cannot rebuild (see Note [What a bundle may run])."""


# ----------------------------------------------------------------------- the saved graph


def decode_value(value: Any, env: dict[str, torch.fx.Node] | None = None) -> Any:
    """A node argument or input from its encoded form (``env``: node name -> FX node).

    Example:
        >>> decode_value(({"$ortlab": "torch", "name": "float16"}, [1, None]))
        (torch.float16, [1, None])
    """
    if isinstance(value, list):
        return [decode_value(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(decode_value(v, env) for v in value)
    if not isinstance(value, dict):
        return value  # None, bool, int, float, complex, str, tensor
    kind = value.get(TAG)
    if kind == "node":
        if env is None or value.get("name") not in env:
            raise GraphFileError(f"node {value.get('name')!r} is used before the graph defines it")
        return env[value["name"]]
    if kind == "torch":
        obj = getattr(torch, str(value.get("name")), None)
        if isinstance(obj, _TORCH_ATTRS):
            return obj
    if kind == "device":
        return torch.device(value["name"])
    if kind == "dict":
        return {decode_value(k, env): decode_value(v, env) for k, v in value["items"]}
    if kind == "slice":
        return slice(*(decode_value(v, env) for v in value["args"]))
    if kind == "ellipsis":
        return ...
    raise GraphFileError(f"cannot decode {value!r}: not a value ortlab writes")


def _resolve(op: str, kind: str, name: str) -> Any:
    """The target of a node, from the names ``graph_to_dict`` stored (Note [What a bundle may run])."""
    if kind == "str":
        if op == "call_method" and name.startswith("_"):
            raise GraphFileError(f"the graph calls the method {name!r}; a repro calls public methods only")
        return name
    if kind in ("op", "hop"):
        parts = name.split(".")
        named = all(p.isidentifier() and not p.startswith("__") for p in parts)
        if not named or len(parts) != (3 if kind == "op" else 1):
            raise GraphFileError(f"{name!r} is not the name of a torch op")
        try:
            if kind == "hop":
                return getattr(torch.ops.higher_order, name)
            ns, op_name, overload = parts
            return getattr(getattr(getattr(torch.ops, ns), op_name), overload)
        except (AttributeError, RuntimeError) as e:
            raise GraphFileError(
                f"torch.ops.{'higher_order.' if kind == 'hop' else ''}{name} does not exist in this torch "
                f"({torch.__version__}): load the library that defines it, or use the torch that wrote the repro"
            ) from e
    module, _, qualname = name.partition(":")
    allowed = qualname.isidentifier() and (
        (module in ("_operator", "operator", "math") and not qualname.startswith("_") and qualname not in _NOT_RUN)
        or (module == "torch" and qualname.lstrip("_").startswith("sym_"))
    )
    obj = getattr(_PY_FUNCTIONS[module], qualname, None) if allowed else None
    if not callable(obj):
        raise GraphFileError(
            f"the graph calls {name}; a repro runs only torch ops, operator and math functions and torch.sym_*"
        )
    return obj


def _decode_attr(value: Any) -> Any:
    if isinstance(value, dict) and value.get(TAG) == "graph":
        return graph_from_dict(value)
    return decode_value(value)


def graph_from_dict(data: dict[str, Any]) -> torch.fx.GraphModule:
    """Rebuild a graph saved by ``ortlab.inspect.repro.graph_to_dict``, with the same node names.

    Example:
        >>> gm = graph_from_dict(torch.load("bundle.pt", weights_only=True)["graph"])  # doctest: +SKIP
    """
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[str, torch.fx.Node] = {}
    for spec in data["nodes"]:
        kind, name = spec["target"]
        target = _resolve(spec["op"], kind, name)
        if spec["op"] == "get_attr":
            setattr(root, target, _decode_attr(data["attrs"][target]))
        args = decode_value(spec["args"], env)
        kwargs = {k: decode_value(v, env) for k, v in spec["kwargs"].items()}
        env[spec["name"]] = graph.create_node(spec["op"], target, tuple(args), kwargs, name=spec["name"])
    return torch.fx.GraphModule(root, graph)


# --------------------------------------------------------------------------------- values


def torch_values(gm: torch.fx.GraphModule, inputs: list[Any], rng: torch.Tensor | None) -> dict[str, Any]:
    """Every node's value with the graph run in PyTorch, drawing what the step drew.

    Example:
        >>> values = torch_values(gm, inputs, bundle["rng"])    # doctest: +SKIP
        >>> values["gelu"].shape                                # doctest: +SKIP
        torch.Size([6, 32])
    """
    values: dict[str, Any] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if rng is not None:  # random ops (dropout) draw what they drew in the step
            torch.set_rng_state(rng)
        Record(gm).run(*inputs)
    return values


def onnxruntime_value(model_bytes: bytes, value_name: str, inputs: list[Any], kinds: list[str]) -> torch.Tensor:
    """``value_name`` as onnxruntime computes it (added as an extra model output).

    Example:
        >>> onnxruntime_value(open("model.onnx", "rb").read(), "gelu", inputs, kinds)  # doctest: +SKIP
    """
    model = onnx.load_from_string(model_bytes)
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(value_name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    dtypes = {"int": np.int64, "float": np.float32, "bool": np.bool_}
    feed: dict[str, np.ndarray] = {}
    for arg, value, kind in zip(session.get_inputs(), inputs, kinds):
        feed[arg.name] = value.detach().cpu().numpy() if kind == "tensor" else np.array(value, dtype=dtypes[kind])
    return torch.from_numpy(session.run([value_name], feed)[0])


def reexported_value(gm: torch.fx.GraphModule, node_name: str, inputs: list[Any], rng: torch.Tensor | None) -> Any:
    """``node_name``'s value with the graph up to it run by this ortlab (``ortlab.ORTModule``).

    Every op runs in onnxruntime (``fallback="raise"``); when some cannot (random ops
    stay in PyTorch, so they draw what the step drew), they run in PyTorch as
    ORTModule would run them, and are listed.

    Example:
        >>> reexported_value(gm, "gelu", inputs, bundle["rng"]).shape     # doctest: +SKIP
        torch.Size([6, 32])
    """
    import ortlab  # the public API only: see Note [The repro script is a real module]

    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.graph_copy(gm.graph, copies)
    graph.output(copies[next(n for n in gm.graph.nodes if n.name == node_name)])
    graph.eliminate_dead_code()
    upto = torch.fx.GraphModule(gm, graph)

    def run(fallback: str) -> tuple[Any, Any]:
        om = ortlab.ORTModule(upto, fallback=fallback)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if rng is not None:
                torch.set_rng_state(rng)
            return om, om(*inputs)

    try:
        return run("raise")[1]
    except ortlab.FallbackError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ortlab.FallbackWarning)
            om, value = run("warn")
    if om.report.module_fallbacks:
        sys.exit("the graph did not run through onnxruntime: " + "; ".join(map(str, om.report.module_fallbacks)))
    for fb in om.report.fallbacks:
        print(f"note: ran in PyTorch, not onnxruntime: {fb}")
    return value


# ----------------------------------------------------------------------------- comparing


def _all_out(expected: torch.Tensor) -> dict[str, Any]:
    n = expected.numel()
    return {"max_abs": math.inf, "max_rel": math.inf, "mismatched": n, "numel": n, "allclose": False}


def error_stats(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> dict[str, Any]:
    """``max_abs``, ``max_rel``, ``mismatched``, ``numel``, ``allclose`` of ``actual`` against ``expected``.

    ``torch.allclose``'s rule, NaN matching NaN, integers exact, ``max_rel`` where
    ``|expected| > atol``: what ``ortlab.compare`` reports, in a few lines.

    Example:
        >>> error_stats(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]), 1e-4, 1e-5)["mismatched"]
        1
    """
    if tuple(actual.shape) != tuple(expected.shape):
        return _all_out(expected)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_complex() or e.is_complex():
        a, e = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(e.to(torch.complex128))
    exact = not e.is_floating_point()
    if exact and a.is_floating_point():  # a dtype of another kind
        return _all_out(expected)
    n = e.numel()  # a complex element counts as two, as in ortlab.compare
    a, e = a.to(torch.float64), e.to(torch.float64)
    if n == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "mismatched": 0, "numel": 0, "allclose": True}
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    diff = torch.where(same, torch.zeros_like(a), (a - e).abs().nan_to_num(nan=math.inf))
    tol = torch.zeros_like(e) if exact else atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0)
    rel = torch.where((diff == 0) | (e.abs() <= atol), torch.zeros_like(diff), diff / e.abs().clamp_min(1e-300))
    mismatched = int((diff > tol).sum())
    return {"max_abs": float(diff.max()), "max_rel": float(rel.max()), "mismatched": mismatched, "numel": n,
            "allclose": mismatched == 0}


def report(label: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> bool:
    """Print one comparison; True when it diverges.

    Example:
        >>> report("x", torch.ones(2), torch.ones(2), 1e-4, 1e-5)
        ok       x: max abs 0, max rel 0, 0.0% of 2 elements out of tolerance (rtol=0.0001, atol=1e-05)
        False
    """
    s = error_stats(actual, expected, rtol, atol)
    status = "ok      " if s["allclose"] else "DIVERGES"
    share = 100 * s["mismatched"] / s["numel"] if s["numel"] else 0.0
    print(f"{status} {label}: max abs {s['max_abs']:.3g}, max rel {s['max_rel']:.3g}, "
          f"{share:.1f}% of {s['numel']} elements out of tolerance (rtol={rtol}, atol={atol})")
    return not s["allclose"]


# ---------------------------------------------------------------------------------- main


def _whole_step(here: str, bundle: dict[str, Any], rtol: float, atol: float) -> int:
    """``--model --trust-pickle``: the step again with ``ortlab.compare``; the exit status."""
    if bundle.get("model") is None:
        sys.exit("the model's class could not be imported when this repro was written; run without --model")
    sys.path[:0] = bundle["model"]["path"]
    import ortlab

    # The opt-in: model.pt is a pickle (the model, its inputs and options), see Note [What a bundle may run].
    saved = torch.load(os.path.join(here, "model.pt"), weights_only=False)
    result = ortlab.compare(saved["model"], *saved["inputs"], forward_kwargs=saved["kwargs"], rtol=rtol, atol=atol,
                            options=saved["options"])
    print(result)
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the repro in the folder of this file; returns the exit status (1: the value diverges).

    Example:
        >>> main(["--reexport"])      # python repro.py --reexport        # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reexport", action="store_true", help="run the FX graph through this ortlab again")
    parser.add_argument("--model", action="store_true", help="the whole step again (needs --trust-pickle)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow --model to unpickle model.pt, which runs code stored in it")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    bundle = torch.load(os.path.join(here, "bundle.pt"), weights_only=True)
    node, rtol, atol = bundle["node"], bundle["rtol"], bundle["atol"]
    where = bundle["module"] or "<root>"
    print(f"node {node} ({bundle['op']}) of {bundle['graph_name']} at {where}: {bundle['source']}")
    if args.model:
        if not args.trust_pickle:
            parser.error("--model unpickles model.pt, which runs code stored in it; add --trust-pickle if you "
                         "wrote this folder or trust its author")
        return _whole_step(here, bundle, rtol, atol)
    try:
        gm = graph_from_dict(bundle["graph"])
    except GraphFileError as e:
        sys.exit(f"bundle.pt: {e}")
    inputs = decode_value(bundle["graph_inputs"])
    expected = torch_values(gm, inputs, bundle["rng"])
    if args.reexport:
        actual = reexported_value(gm, node, inputs, bundle["rng"])
    else:
        with open(os.path.join(here, "model.onnx"), "rb") as f:
            data = f.read()
        actual = onnxruntime_value(data, bundle["onnx_value"], decode_value(bundle["onnx_inputs"]),
                                   bundle["onnx_input_kinds"])
    bad = report("onnxruntime vs PyTorch (same graph, same inputs)", actual, expected[node], rtol, atol)
    op_inputs = bundle["op_inputs"]
    if op_inputs is not None and not args.reexport:
        # The op alone, on the inputs onnxruntime itself computed: is this op wrong, or its inputs?
        fx_node = next(n for n in gm.graph.nodes if n.name == node)
        ort_inputs = {name: decode_value(v) for name, v in op_inputs.items()}
        look = lambda a: ort_inputs[a.name] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        with torch.no_grad():
            alone = fx_node.target(*torch.fx.node.map_arg(fx_node.args, look),
                                   **torch.fx.node.map_arg(fx_node.kwargs, look))
        report(f"onnxruntime vs PyTorch's {bundle['op']} on onnxruntime's own inputs", actual, alone, rtol, atol)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
