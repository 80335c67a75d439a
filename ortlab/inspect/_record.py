"""What each graph of the compared step received, and every intermediate value on both sides.

While ``compare`` runs the ortlab step, a :class:`Recorder` (a ``GraphObserver`` set on
the ORTModule ``compare`` builds) copies the inputs of every compiled graph and of every
onnxruntime session in it. Afterwards :func:`compare_graph` runs each graph again in
PyTorch keeping every node's value, and each session's model again with every FX
node's value as an output (:func:`onnx_values`), and compares the two node by node.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Sequence
from typing import Any

import onnx
import onnx_ir as ir
import torch
import torch.fx

from ortlab.config import DebugOptions, Options
from ortlab.errors import OrtlabError, first_line
from ortlab.inspect._results import GraphRun, NodeComparison, PartRun, compare_tensors
from ortlab.onnx.export import ExportedGraph
from ortlab.onnx.interface import GraphInterface
from ortlab.provenance import module_path, op_name, source_line
from ortlab.report import GraphRecord
from ortlab.runtime.observe import GraphObserver
from ortlab.runtime.runner import OrtRunner
from ortlab.runtime.session import ThreadChoice, build_session

__all__ = ["GraphCall", "Recorder", "compare_graph", "onnx_value_names", "onnx_values"]

logger = logging.getLogger(__name__)

# Note [Recording what each graph received]
# The per-node comparison needs the exact inputs of every compiled graph: parameters and
# buffers as AOTAutograd passes them plus the user inputs (forward), the saved
# activations and incoming gradients (backward), and, when some ops fall back to
# PyTorch, what each onnxruntime partition received. The engine does not keep these, so
# ``compare`` sets a Recorder on the ORTModule it builds (``ORTModule.set_observer``, see
# Note [Observing compiled graphs] in ``ortlab.runtime.observe``). On the first call of
# each compiled graph it copies the boxed argument list and the RNG state (so PyTorch's
# reference run of a graph with dropout draws the same numbers), and on the first call
# of each onnxruntime session its inputs. Nothing global is patched: only the module
# ``compare`` builds is observed.


def _snapshot(values: Sequence[Any]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


@dataclasses.dataclass
class GraphCall:
    """The first call of one compiled graph: its inputs and the random state it ran with."""

    record: GraphRecord
    where: str
    inputs: list[Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


class Recorder(GraphObserver):
    """Copies what each graph and onnxruntime session receives on its first call.

    Attributes:
        calls: the graphs in the order they were first called.
        part_inputs: runner -> the inputs of its session's first call.
    """

    def __init__(self) -> None:
        self.calls: list[GraphCall] = []
        self.part_inputs: dict[OrtRunner, list[Any]] = {}
        self._seen: set[int] = set()  # ids of the records in ``calls``, which keeps them alive

    def graph_call(self, record: GraphRecord, where: str, args: Sequence[object]) -> None:
        if id(record) in self._seen:
            return
        self._seen.add(id(record))
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.calls.append(GraphCall(record, where, _snapshot(args), torch.get_rng_state(), cuda))

    def part_call(self, record: GraphRecord, runner: OrtRunner, args: Sequence[object]) -> None:
        if runner not in self.part_inputs:
            self.part_inputs[runner] = _snapshot(args)


class _Values(torch.fx.Interpreter):
    """Runs a graph in PyTorch, keeping every tensor-valued node's output."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output" and isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach()
        return out


def _tensor_nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}


def _onnx_names(nodes: dict[str, torch.fx.Node]) -> dict[str, str]:
    """ONNX value name -> FX node name: torch.onnx names values after FX nodes, ``x__i`` for outputs of tuples."""
    names = {name: name for name in nodes}
    for name, node in nodes.items():
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            names.setdefault(f"{node.args[0].name}__{node.args[1]}", name)
    return names


def onnx_value_names(model: ir.Model, wanted: dict[str, torch.fx.Node]) -> dict[str, str]:
    """FX node name -> name of the ONNX value (a node output of ``model``) that holds it."""
    by_name = _onnx_names(wanted)
    chosen: dict[str, str] = {}
    for node in model.graph:
        for value in node.outputs:
            fx = by_name.get(value.name or "")
            if fx is not None and fx not in chosen:
                chosen[fx] = value.name  # type: ignore[assignment]
    return chosen


def onnx_values(
    exported: ExportedGraph, inputs: Sequence[Any], wanted: dict[str, torch.fx.Node], options: Options, device: torch.device
) -> dict[str, torch.Tensor]:
    """Run a copy of ``exported``'s model that outputs the value of every FX node in ``wanted``.

    Returns FX node name -> value for the nodes the ONNX model computes (a node folded
    away or aliased to an input has no value of its own). The copy runs with the same
    options; onnxruntime cannot fuse away a value that is an output, so a fused kernel
    may be split where the original session ran it whole.

    Example:
        >>> values = onnx_values(exported, inputs, {"gelu": gelu_node}, Options(), torch.device("cpu"))  # doctest: +SKIP
    """
    model = ir.serde.deserialize_model(onnx.load_from_string(exported.to_bytes()))
    names = onnx_value_names(model, wanted)
    if not names:
        return {}
    values = {v.name: v for node in model.graph for v in node.outputs}
    model.graph.outputs.clear()
    for onnx_name in names.values():
        model.graph.outputs.append(values[onnx_name])
    dtypes: list[torch.dtype | None] = [wanted[fx].meta["val"].dtype for fx in names]
    data = ir.to_proto(model).SerializeToString()
    threads = options.intra_op_num_threads or 1
    built = build_session(data, options, DebugOptions(), device_type=device.type,
                          threads=ThreadChoice(threads, "an inspection copy of a graph"))
    kinds: list[str | None] = ["tensor"] * len(names)
    interface = GraphInterface(exported.interface.input_kinds, kinds, dtypes, [None] * len(names))
    runner = OrtRunner(built.session, interface, device)
    return dict(zip(names, runner(*inputs)))


def compare_graph(
    call: GraphCall,
    part_inputs: dict[OrtRunner, list[Any]],
    env: dict[tuple[str, str], torch.Tensor],
    options: Options,
    rtol: float,
    atol: float,
) -> tuple[list[NodeComparison], GraphRun]:
    """Every tensor node of one recorded graph, onnxruntime's value against PyTorch's.

    ``env`` carries PyTorch's values from graph to graph (see Note [Chained reference]);
    ``part_inputs`` are the Recorder's copies of each session's inputs.
    """
    record, gm = call.record, call.record.graph_module
    label = record.label
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # See Note [Chained reference]: a backward input that is a forward value of the
    # same capture takes PyTorch's forward value, not onnxruntime's.
    inputs = []
    for node, recorded in zip(placeholders, call.inputs):
        ref = env.get((call.where, node.name))
        same = isinstance(ref, torch.Tensor) and isinstance(recorded, torch.Tensor) and ref.shape == recorded.shape \
            and ref.dtype == recorded.dtype
        inputs.append(ref if same else recorded)
    device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cuda = list(range(len(call.cuda_rng))) if call.cuda_rng is not None else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.set_rng_state(call.rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state_all(call.cuda_rng)
        interp = _Values(gm)
        interp.run(*inputs)
    reference = interp.values
    for name, value in reference.items():
        env[(call.where, name)] = value
    nodes = _tensor_nodes(gm)
    onnx_vals: dict[str, torch.Tensor] = {}
    parts: list[PartRun] = []
    for part in record.parts:
        runner, exported = part.runner, part.exported
        recorded = part_inputs.get(runner)
        if exported is None or recorded is None:
            logger.warning("no inputs were recorded for a session of %s; its values are not compared", label)
            continue
        try:
            got = onnx_values(exported, recorded, nodes, options, device)
        except OrtlabError as e:
            logger.warning("could not read intermediate values of %s: %s", label, first_line(e))
            got = {}
        onnx_vals.update(got)
        names = onnx_value_names(exported.model, nodes)
        parts.append(PartRun(exported, recorded, {fx: names[fx] for fx in got}))
    # Values computed by PyTorch that an onnxruntime part received are compared too.
    crossing: dict[str, Any] = {}
    for part in parts:
        for name, value in zip(part.exported.input_names, part.inputs):
            if name in nodes and name not in onnx_vals and isinstance(value, torch.Tensor):
                crossing[name] = value
    in_torch = {fb.node for fb in record.fallbacks if fb.node} if record.parts else set(nodes)
    in_torch |= {n for n, node in nodes.items() if node.target is operator.getitem and str(node.args[0]) in in_torch}
    placeholder_values = dict(zip((p.name for p in placeholders), zip(call.inputs, inputs)))

    def values(arg: torch.fx.Node) -> tuple[object, object]:
        """An FX value's (onnxruntime, PyTorch) values; a placeholder's are what each side's graph received."""
        if arg.name in placeholder_values:
            return placeholder_values[arg.name]
        return onnx_vals.get(arg.name, crossing.get(arg.name)), reference.get(arg.name)

    result = []
    for index, node in enumerate(gm.graph.nodes):
        if node.name not in nodes:
            continue
        info = dict(graph=label, index=index, node=node.name, op=op_name(node), module=module_path(node),
                    source=source_line(node))
        runtime = "pytorch" if node.name in in_torch else "onnxruntime"
        actual, expected = onnx_vals.get(node.name, crossing.get(node.name)), reference.get(node.name)
        if actual is None or expected is None:
            status = "pytorch" if runtime == "pytorch" else "absent"
            result.append(NodeComparison(status=status, runtime=runtime, **info))
            continue
        stats = compare_tensors(actual, expected, rtol=rtol, atol=atol)
        note = ""
        if not stats.allclose and not (expected.is_floating_point() or expected.is_complex()):
            note = _decided_on_equal_inputs(node, actual, stats.mismatched, values, rtol, atol)
        result.append(NodeComparison(status="ok" if stats.allclose else "diverged", stats=stats, runtime=runtime,
                                     note=note, **info))
    run = GraphRun(call.where, record.name, gm, inputs, parts, reference, onnx_vals, call.rng)
    return result, run


# Note [Decided the other way on equal inputs]
# A comparison (a ReLU's gradient mask ``x <= 0``, ``x == y``), an argmax or a max pool's
# indices, a float cast to an integer: their result jumps where their input crosses a
# threshold or two inputs tie. Two float32 computations of the same input that agree within
# the tolerance can still fall on either side of it, and then the result differs outright
# (max abs 1, "inf x tol"), and so does everything computed from it: in a ResNet-18 step one
# element of 262,144 in a block's ReLU mask flipped, and the stem's weight gradient came out
# 700 times the tolerance from eager's, while float64 sided with eager on that batch and with
# ortlab on another. Such a node is not a wrong translation but the model's float32
# conditioning, and its comparison says so (``NodeComparison.note``) when both hold:
# * every tensor it reads agrees with PyTorch's within the tolerance, and
# * PyTorch's own op, run on onnxruntime's inputs, gives onnxruntime's result exactly: so the
#   op is translated right, and the difference comes from inputs within rounding of each other.
# A translation that decides ties otherwise (``lt`` for ``le``, the last maximum's index for the
# first) fails the second test and gets no such note. Aliases and views onnxruntime keeps no value
# of (``detach``, ``view``) are recomputed from what they read.
def _decided_on_equal_inputs(node: torch.fx.Node, actual: torch.Tensor, flipped: int,
                             values: Any, rtol: float, atol: float) -> str:
    """The note of a diverged bool or integer ``node`` (onnxruntime's value ``actual``) whose inputs agree within
    tolerance and which PyTorch's op computes from onnxruntime's inputs (Note [Decided the other way on equal
    inputs]); "" otherwise. ``values(arg)`` gives an FX argument's (onnxruntime, PyTorch) values."""
    getitem = node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
    op = node.args[0] if getitem else node

    def ortlab_value(arg: torch.fx.Node, depth: int = 0) -> object:
        value = values(arg)[0]
        if isinstance(value, torch.Tensor) or arg.op != "call_function" or op_name(arg) not in _ALIASES or depth > 8:
            return value
        read = {a: ortlab_value(a, depth + 1) for a in _node_args(arg)}
        if not all(isinstance(v, torch.Tensor) for v in read.values()):
            return None
        args, kwargs = torch.fx.node.map_arg((arg.args, arg.kwargs), read.__getitem__)
        return arg.target(*args, **kwargs)

    floats = 0
    for arg in _node_args(op):
        mine, expected = ortlab_value(arg), values(arg)[1]
        if not isinstance(mine, torch.Tensor) or not isinstance(expected, torch.Tensor):
            return ""
        if not compare_tensors(mine, expected, rtol=rtol, atol=atol).allclose:
            return ""
        floats += expected.is_floating_point()
    if not floats or not callable(op.target):
        return ""
    try:
        with torch.no_grad():
            args, kwargs = torch.fx.node.map_arg((op.args, op.kwargs), ortlab_value)
            again = op.target(*args, **kwargs)
            again = again[node.args[1]] if getitem else again
    except Exception:  # an op that does not run on these values as they are: no verdict
        return ""
    if not isinstance(again, torch.Tensor) or again.shape != actual.shape or not torch.equal(again, actual.to(again)):
        return ""
    return (f"decided the other way at {flipped} element(s) on inputs that agree within tolerance, as PyTorch's op "
            "decides on onnxruntime's inputs: values within float32 rounding of a threshold or a tie, where the op's "
            "result jumps (the model's float32 conditioning, not a wrong translation; Note [Decided the other way on "
            "equal inputs])")


# Ops whose result holds its input's elements as they are (in another shape or order).
_ALIASES = frozenset({"aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.reshape", "aten.clone",
                      "aten.t", "aten.transpose", "aten.permute", "aten.squeeze", "aten.unsqueeze", "aten.expand"})


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The FX nodes among ``node``'s arguments (in lists and dicts too)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


# Note [Chained reference]
# PyTorch's reference for the backward graph takes the saved activations from
# PyTorch's run of the forward graph (placeholders of the backward graph carry the
# names of the forward nodes they come from: both graphs are cut from one joint
# graph), and the incoming gradients from the recorded call. So every node is compared
# with an all-PyTorch run of the same decomposition, errors accumulate the way they do
# in training, and the first node out of tolerance is where the divergence starts.
