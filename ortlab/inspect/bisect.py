"""Find the smallest set of ops whose fallback to PyTorch removes a divergence; write a repro.

The search is predicate-driven (Polygraphy's ``debug reduce``): the predicate is "with
these ops in ``fallback_ops`` the step matches eager PyTorch within tolerance", and
:func:`~ortlab.inspect.reduce.minimize` reduces the candidates with it (the op of the
first diverging node alone, then bisect, then linear), so the result is 1-minimal:
dropping any op of it brings the divergence back.

:func:`write_repro` leaves a folder with a runnable ``repro.py``: the ONNX model of the
diverging node's session exactly as onnxruntime ran it, the inputs it received and the
FX graph with its inputs (saved with their node names, see :func:`graph_to_dict`), so
the divergence reproduces without the notebook session that found it.

Example:
    >>> found = bisect_fallbacks(model, x, y)        # doctest: +SKIP
    >>> found.ops, found.repro                       # doctest: +SKIP
    (['aten.gelu'], '/tmp/ortlab_repro_k2j/repro.py')
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from ortlab.errors import FallbackWarning, OrtlabError
from ortlab.inspect.compare import ATOL, RTOL, CompareResult, NodeComparison, compare
from ortlab.inspect.reduce import Trial, minimize
from ortlab.ortmodule import ORTModule

__all__ = ["BisectResult", "bisect_fallbacks", "write_repro", "graph_to_dict", "graph_from_dict"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the search


@dataclasses.dataclass
class BisectResult:
    """What :func:`bisect_fallbacks` found.

    Attributes:
        ops: the smallest set of ops whose fallback removes the divergence (empty when
            there was none, or when no set of candidates removes it: see ``found``).
        found: whether falling back ``ops`` makes the step match.
        baseline: the comparison without extra fallbacks.
        candidates: the ops that were searched.
        trials: every evaluation of the predicate.
        repro: path of the repro script, when a node diverged.
        reason: a sentence on the outcome.
        base_ops: the ``fallback_ops`` every trial kept in PyTorch anyway.
    """

    ops: list[str]
    found: bool
    baseline: CompareResult
    candidates: list[str]
    trials: list[Trial]
    repro: str | None
    reason: str
    base_ops: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ortlab bisect: {self.reason}"]
        first = self.baseline.first_divergence
        if first is not None:
            lines.append(f"first divergence: {first.describe()}")
        if self.found and self.ops:
            lines.append(f"fix for now: ORTModule(model, fallback_ops={self.base_ops + self.ops!r})")
        if self.repro:
            lines.append(f"repro: {sys.executable} {self.repro}")
        if self.trials:
            seconds = sum(t.seconds for t in self.trials)
            lines.append(f"{len(self.trials)} trials ({seconds:.1f} s), ops run in PyTorch -> step matches eager:")
            lines.extend(f"  {'yes' if t.passed else 'no '}  {', '.join(t.ops) or '(none)'}" for t in self.trials)
        return "\n".join(lines)


def _candidates(result: CompareResult, diverged_only: bool) -> list[str]:
    """aten ops that ran in onnxruntime, ops of diverged nodes first, in execution order."""
    ops: list[str] = []
    for n in result.diverged_nodes + ([] if diverged_only else result.nodes):
        if n.runtime != "pytorch" and "." in n.op and n.op not in ops:
            ops.append(n.op)
    return ops


def bisect_fallbacks(
    model: nn.Module,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    candidates: Sequence[str] | None = None,
    repro_dir: str | None = None,
    max_trials: int = 64,
    seed: int = 0,
    **options: Any,
) -> BisectResult:
    """The smallest set of ops whose fallback to PyTorch makes one step match eager PyTorch.

    Runs :func:`~ortlab.inspect.compare.compare` once with every intermediate value,
    then once per trial (step-level only). By default the candidates are the ops of the
    nodes out of tolerance, widened to every op that ran in onnxruntime when those are
    not enough. A repro script is written to ``repro_dir`` (a fresh temporary folder by
    default) for the first diverging node.

    Args:
        model, *inputs, forward_kwargs, loss_fn, rtol, atol, seed, **options: as for
            ``compare``; ``options["fallback_ops"]`` stay in PyTorch in every trial.
        candidates: op names to search (``aten.gelu``); default as above.
        repro_dir: folder of the repro; created if missing.
        max_trials: stop with an error after this many trials (each captures the model).

    Example:
        >>> found = bisect_fallbacks(model, x, y)         # doctest: +SKIP
        >>> print(found)                                  # doctest: +SKIP
        ortlab bisect: falling back ['aten.gelu'] to PyTorch removes the divergence
    """
    base_ops = list(options.pop("fallback_ops", ()) or ())
    if isinstance(model, ORTModule):
        base_ops = list(model.options.fallback_ops) + base_ops
    options["fallback"] = "warn"  # trials must be able to fall back
    common: dict[str, Any] = dict(forward_kwargs=forward_kwargs, loss_fn=loss_fn, rtol=rtol, atol=atol, seed=seed)
    baseline = compare(model, *inputs, fallback_ops=base_ops, **common, **options)
    repro = None
    if baseline.first_divergence is not None:
        repro = write_repro(baseline, repro_dir or tempfile.mkdtemp(prefix="ortlab_repro_"), model=model,
                            inputs=inputs, forward_kwargs=forward_kwargs)
    if baseline.matches:
        why = "the step matches eager PyTorch: nothing to bisect"
        if baseline.first_divergence is not None:
            why += " (intermediate values diverge but the outputs and gradients stay within tolerance)"
        return BisectResult([], True, baseline, [], [], repro, why, base_ops)

    trials: list[Trial] = []
    memo: dict[frozenset[str], bool] = {}

    def passes(ops: list[str]) -> bool:
        key = frozenset(ops)
        if key not in memo:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                result = compare(model, *inputs, fallback_ops=base_ops + ops, intermediates=False, **common, **options)
            if any(n.startswith("the step did not run through onnxruntime") for n in result.notes):
                raise OrtlabError(f"a trial with fallback_ops={ops} did not run through onnxruntime: {result.notes[0]}")
            memo[key] = result.matches
            trials.append(Trial(tuple(ops), result.matches, time.perf_counter() - start))
        return memo[key]

    first = baseline.first_divergence
    hints = [first.op] if first is not None else []
    pool = list(candidates) if candidates is not None else _candidates(baseline, diverged_only=True)
    if candidates is None and (not pool or not passes(pool)):
        pool = _candidates(baseline, diverged_only=False)
    if not pool:
        return BisectResult([], False, baseline, [], trials, repro, "no op ran in onnxruntime: nothing to fall back",
                            base_ops)
    if not passes(pool):
        why = (f"the step still diverges with all {len(pool)} candidate ops in PyTorch: the difference comes from "
               "elsewhere (ops that always run in PyTorch, or the graph split itself)")
        return BisectResult([], False, baseline, pool, trials, repro, why, base_ops)
    ops, _ = minimize(pool, passes, hints=hints, max_trials=max_trials)
    why = f"falling back {ops} to PyTorch removes the divergence"
    return BisectResult(ops, True, baseline, pool, trials, repro, why, base_ops)


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
    if isinstance(t, torch._ops.OpOverload):
        return ("op", f"{t.namespace}.{t._opname}.{t._overloadname}")
    if isinstance(t, torch._ops.HigherOrderOperator):
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

from ortlab.inspect.bisect import graph_from_dict
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
