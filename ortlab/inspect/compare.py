"""Compare one training step through ortlab with eager PyTorch, down to every intermediate value.

``compare(model, *inputs)`` runs one step (forward, loss, backward) twice from the same
state and the same random seed: in eager PyTorch, and through an ``ORTModule``. It
compares the outputs, the loss, every parameter gradient and every buffer, then every
intermediate value of the forward and backward graphs: each FX node's value as
onnxruntime computed it against the same node run by PyTorch. The result names the
first node that exceeds the tolerance, its op, module path and source line, and
aggregates node errors per module (a per-layer table, a heatmap in notebooks).

Comparators are pure functions (:func:`compare_tensors`) returning statistics; the
result objects render themselves (``str`` and ``_repr_html_``); nothing here prints.

This module runs the step on both sides; the pieces live beside it and are
re-exported here: ``_results`` (comparators and result records), ``_tables`` (their
text and HTML views) and ``_record`` (what each graph received, intermediate values).

Example:
    >>> result = compare(model, x, y)                  # doctest: +SKIP
    >>> result.first_divergence                        # doctest: +SKIP
    NodeComparison(graph='g0.forward', node='gelu', op='aten.gelu', module='mlp.act', ...)
    >>> print(result)                                  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ortlab._compat.torch import pytree
from ortlab.config import Options
from ortlab.inspect import _results
from ortlab.inspect.loss import default_loss
from ortlab.inspect._record import Recorder, compare_graph, onnx_value_names, onnx_values
from ortlab.inspect._keywords import split_keywords
from ortlab.inspect._results import (  # re-exported: the names of ortlab.inspect.compare before the split
    ATOL,
    RTOL,
    CompareResult,
    ErrorStats,
    GraphRun,
    LayerSummary,
    NodeComparison,
    PartRun,
    TensorComparison,
    compare_tensors,
)
from ortlab.ortmodule import ORTModule

__all__ = [*_results.__all__, "default_loss", "onnx_values", "onnx_value_names", "compare"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- the step


def _clone(tree: Any) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    return pytree.tree_map(one, tree)


@dataclasses.dataclass
class _Step:
    outputs: list[tuple[str, Any]]
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    input_grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    notes: list[str] = dataclasses.field(default_factory=list)


_PLAIN = (int, float, bool, str, complex, type(None))


def _held_tensors(value: Any, path: str, depth: int, seen: set[int]) -> list[tuple[str, torch.Tensor]]:
    """The tensors an object holds in its attributes, lists, tuples and dicts, by attribute path."""
    if isinstance(value, torch.Tensor):
        return [(path, value.detach())]
    if isinstance(value, _PLAIN) or depth > 6 or id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items() if not k.startswith("__")]
    else:
        return []
    return [found for p, v in items for found in _held_tensors(v, p, depth + 1, seen)]


def _output_leaves(out: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """The output's leaves by path (pytree's), an object pytree does not know (a Hugging Face ``DynamicCache``)
    by the tensors it holds, with a note for each such object: two caches are never equal as objects."""
    leaves: list[tuple[str, Any]] = []
    notes: list[str] = []
    for p, v in pytree.tree_flatten_with_path(out)[0]:
        name = f"out{pytree.keystr(p)}"
        if isinstance(v, (torch.Tensor, *_PLAIN)):
            leaves.append((name, v.detach() if isinstance(v, torch.Tensor) else v))
            continue
        held = _held_tensors(v, name, 0, set())
        leaves.extend(held)
        notes.append(f"{name} is a {type(v).__name__}: compared by the {len(held)} tensors it holds" if held else
                     f"{name} is a {type(v).__name__} holding no tensors: left out of the comparison")
    return leaves, notes


def _run_step(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], Any], seed: int) -> _Step:
    args, kwargs = _clone((args, kwargs))
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    loss = loss_fn(out)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    outputs, notes = _output_leaves(out)
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return _Step(
        outputs,
        loss.detach() if isinstance(loss, torch.Tensor) else None,
        {n: p.grad for n, p in module.named_parameters()},
        [t.grad for t in leaves],
        {n: b.detach().clone() for n, b in module.named_buffers()},
        notes,
    )


def _pair(name: str, kind: str, actual: Any, expected: Any, rtol: float, atol: float) -> TensorComparison:
    if actual is None and expected is None:
        return TensorComparison(name, kind, None)
    if actual is None or expected is None:
        side = "ortlab" if actual is None else "eager PyTorch"
        return TensorComparison(name, kind, None, f"None in {side} only")
    if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
        return TensorComparison(name, kind, compare_tensors(actual, expected, rtol=rtol, atol=atol))
    if type(actual) is not type(expected):
        return TensorComparison(name, kind, None, f"{type(actual).__name__} != expected {type(expected).__name__}")
    if actual == expected or (isinstance(expected, float) and math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol)):
        return TensorComparison(name, kind, None)
    return TensorComparison(name, kind, None, f"{actual!r} != {expected!r}")


def _compare_steps(ort: _Step, eager: _Step, rtol: float, atol: float) -> tuple[list, TensorComparison | None, list, list]:
    outputs = [_pair(n, "output", a, e, rtol, atol) for (n, a), (_, e) in zip(ort.outputs, eager.outputs)]
    if len(ort.outputs) != len(eager.outputs):
        outputs.append(TensorComparison("out", "output", None, f"{len(ort.outputs)} outputs != {len(eager.outputs)}"))
    loss = _pair("loss", "loss", ort.loss, eager.loss, rtol, atol) if eager.loss is not None else None
    grads = [_pair(n, "grad", ort.grads.get(n), g, rtol, atol) for n, g in eager.grads.items()]
    grads += [_pair(f"input_grad[{i}]", "input_grad", a, e, rtol, atol)
              for i, (a, e) in enumerate(zip(ort.input_grads, eager.input_grads))]
    buffers = [_pair(n, "buffer", ort.buffers.get(n), b, rtol, atol) for n, b in eager.buffers.items()]
    return outputs, loss, grads, buffers


# Note [Judged against float64]
# fp32 results of two correct implementations differ by rounding, and some models amplify it:
# a ResNet-18's batch norm backward (batch 16, 2x2 spatial in the last stage) gave conv1.weight
# gradients 0.2 apart (relative) between eager and ortlab, and compare called it DIVERGED.
# A float64 run of eager is the arbiter: when a value is out of tolerance, and ortlab's value
# is no further from the float64 one than eager's is (within 2x), the difference is fp32
# noise, shown as such and not counted against the step. The float64 run is trusted only if
# its loss is near eager's (random ops may draw differently in float64, and ops without a
# float64 kernel fail): otherwise a note says why it was not used.
# Below this deviation from float64 (relative to the largest element; a tenth of the default
# rtol, ~100 fp32 ulps, what a sum of a few hundred fp32 terms can drift) a value is fp32
# rounding whatever eager's own deviation happens to be.
FP32_FLOOR = 1e-5


def _has_float32(step: _Step) -> bool:
    values = [v for _, v in step.outputs] + [step.loss] + list(step.grads.values())
    return any(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in values)


def _deviation(value: Any, exact: Any) -> float | None:
    if not (isinstance(value, torch.Tensor) and isinstance(exact, torch.Tensor)) or value.shape != exact.shape:
        return None
    if not value.is_floating_point():
        return None
    scale = exact.abs().max().item() or 1.0
    return (value.double() - exact.double()).abs().nan_to_num(0.0).max().item() / scale


def _judge_against_float64(result: CompareResult, model: nn.Module, inputs: tuple, kwargs: dict,
                           loss_fn: Callable[[Any], Any], seed: int, ort: _Step, eager: _Step) -> None:
    def to64(t: Any) -> Any:
        return t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and \
            t.dtype == torch.float32 else t

    try:
        exact_model = copy.deepcopy(model).double()
        for p in exact_model.parameters():
            p.grad = None
        args64, kwargs64 = pytree.tree_map(to64, (inputs, kwargs))
        exact = _run_step(exact_model, args64, kwargs64, loss_fn, seed)
    except Exception as e:  # noqa: BLE001 - the float64 run is an aid; without it the verdict stands
        result.notes.append(f"no float64 reference (it would tell fp32 noise from divergence): {str(e)[:200]}")
        return
    if eager.loss is not None and exact.loss is not None:
        gap = _deviation(eager.loss, exact.loss)
        if gap is None or gap > 1e-3:
            result.notes.append("the float64 reference was not used: its loss differs from eager's beyond fp32 "
                                "rounding (random ops may draw other numbers in float64)")
            return
    values = {
        "output": (dict(ort.outputs), dict(eager.outputs), dict(exact.outputs)),
        "loss": ({"loss": ort.loss}, {"loss": eager.loss}, {"loss": exact.loss}),
        "grad": (ort.grads, eager.grads, exact.grads),
    }
    judged = 0
    for comparison in result.step:
        if comparison.ok or comparison.kind not in values:
            continue
        ours, theirs, exact_values = values[comparison.kind]
        mine = _deviation(ours.get(comparison.name), exact_values.get(comparison.name))
        eagers = _deviation(theirs.get(comparison.name), exact_values.get(comparison.name))
        if mine is None or eagers is None:
            continue
        judged += 1
        if mine <= max(2 * eagers, FP32_FLOOR):
            comparison.fp32_noise = (f"a float64 run shows it as exact as eager's: ortlab {mine:.3g}, eager "
                                     f"{eagers:.3g} from float64 (relative to its largest element)")
    if judged:
        result.notes.append(f"{judged} value(s) out of tolerance were judged against a float64 run of eager "
                            "(Note [Judged against float64] in ortlab.inspect.compare)")


def compare(
    model: nn.Module,
    *inputs: Any,
    forward_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    intermediates: bool = True,
    keep_values: bool = True,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    **keywords: Any,
) -> CompareResult:
    """Run one training step in eager PyTorch and through ortlab from the same state; compare all.

    The model is deep-copied for each side, so its parameters, gradients and buffers
    are untouched. Both sides use random seed ``seed``.

    Args:
        model: an ``nn.Module`` or an ``ORTModule`` (then its wrapped module and options).
        *inputs: positional inputs of the forward.
        forward_kwargs: keyword inputs of the forward.
        loss_fn: output -> scalar loss to backpropagate (default :func:`default_loss`).
        rtol: relative tolerance of every comparison.
        atol: absolute tolerance of every comparison.
        intermediates: also compare every intermediate value (slower: the graphs run
            again in PyTorch and in onnxruntime with every value as an output).
        keep_values: keep every node's two values in ``result.graphs`` (for repro).
        seed: the random seed of both steps.
        options: ORTModule options of the ortlab side (``fallback_ops`` ...).
        **keywords: the forward's keyword inputs (``input_ids=ids``) and ORTModule options by name
            (Note [Keyword inputs beside options] in ``ortlab.inspect._keywords``).

    Returns:
        A :class:`CompareResult`.

    Example:
        >>> result = compare(model, x, y, fallback_ops=["aten.gelu"])   # doctest: +SKIP
        >>> result = compare(hf_model, input_ids=ids, labels=ids)       # doctest: +SKIP
        >>> result.matches, result.first_divergence                        # doctest: +SKIP
    """
    forward_kwargs, options = split_keywords(model, keywords, tool="compare", options=options,
                                             forward_kwargs=forward_kwargs)
    if isinstance(model, ORTModule):
        options = {**model.options.as_dict(), **options}
        model = model.module
    options = {**options, "cache_dir": None}  # cached parts have no ONNX model to inspect
    opts = Options.from_kwargs(options)
    kwargs = forward_kwargs or {}
    loss_fn = loss_fn or default_loss
    eager_model, ort_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (eager_model, ort_model):
        for p in m.parameters():
            p.grad = None
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves((inputs, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    recorder = Recorder()  # see Note [Recording what each graph received]
    with torch.random.fork_rng(devices=devices):
        eager = _run_step(eager_model, inputs, kwargs, loss_fn, seed)
        om = ORTModule(ort_model, **options)
        om.set_observer(recorder)
        ort = _run_step(om, inputs, kwargs, loss_fn, seed)
    calls = recorder.calls
    outputs, loss, grads, buffers = _compare_steps(ort, eager, rtol, atol)
    result = CompareResult(rtol, atol, dict(options), outputs, loss, grads, buffers)
    result.notes.extend(eager.notes)
    if not result.matches and _has_float32(eager):
        with torch.random.fork_rng(devices=devices):
            _judge_against_float64(result, model, inputs, kwargs, loss_fn, seed, ort, eager)
    report = om.report
    if not report.captures or any(f.scope == "module" for f in report.module_fallbacks):
        result.notes.append("the step did not run through onnxruntime: " + "; ".join(map(str, report.module_fallbacks)))
    ops = collections.Counter(f"{fb.op or fb.scope}: {fb.reason}" for fb in report.fallbacks if fb.scope != "module")
    result.notes.extend(f"ran in PyTorch: {count}x {what}" for what, count in ops.items())
    if intermediates:
        graphs = sum(len(c.graphs) for c in report.captures)
        if len(calls) < graphs:
            result.notes.append(f"only {len(calls)} of {graphs} compiled graphs were recorded while the step ran; "
                                "the others have no intermediate values (this is a bug in ortlab.inspect)")
        env: dict[tuple[str, str], torch.Tensor] = {}
        for call in calls:
            nodes, run = compare_graph(call, recorder.part_inputs, env, opts, rtol, atol)
            if not keep_values:
                run.reference, run.onnx = {}, {}
            result.nodes.extend(nodes)
            result.graphs.append(run)
    logger.debug("%s", result)
    return result
