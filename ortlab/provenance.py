"""Where a graph node came from: its nn.Module, the line of model code, its op; and ONNX node names.

Shared ground: every stage of the pipeline and every tool reads provenance through
this module, and nothing here imports a stage.

FX side: Dynamo records ``nn_module_stack`` and ``stack_trace`` on the nodes it
captures and AOTAutograd carries them onto the joint, forward and backward graphs
(``preserve_node_meta``); backward nodes also get ``fwd_nn_module_stack`` /
``fwd_source_fn_stack`` naming the forward node they differentiate.

ONNX side: the exporter writes ``ortlab.fx_node``, ``ortlab.op``, ``ortlab.module`` and
``ortlab.source`` on every ONNX node (``ortlab.onnx.export``). onnxruntime's optimized
models drop node metadata, so the on-disk cache stores :func:`node_provenance` beside
each model, and onnxruntime renames the nodes it fuses (``node_addmm/GemmTransposeFusion/``,
``fused node_addmm``): :func:`onnx_node_of` reads the exported node back out of such a name.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from typing import Any

import torch.fx

from ortlab._compat.torch import OpOverload, aot_input_origin, dynamo_input_source

__all__ = ["module_path", "source_line", "op_name", "node_provenance", "restore_provenance", "onnx_node_of",
           "added_beside", "onnx_node_index", "PROVENANCE_KEYS", "INPUT_KEY", "source_name", "input_names",
           "name_inputs"]

# The metadata keys the exporter writes on every ONNX node.
PROVENANCE_KEYS = ("ortlab.fx_node", "ortlab.op", "ortlab.module", "ortlab.source")
# The key of a graph input's readable name: on FX placeholders' meta and ONNX graph inputs' metadata.
INPUT_KEY = "ortlab.input"

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_RESUMED = re.compile(r"^torch_dynamo_resume_in_(\w+?)_at_\d+$")
# The root module in Dynamo's sources: ``L['self']``, or ``L['args'][0]`` with an attribute after it (the module
# passed to a decorator's ``wrapper(*args)``; an input ``L['args'][0]`` is a tensor, read without attributes).
_ROOT = re.compile(r"^L\['args'\]\[0\](?=\.)\.?|^L\['[^']*'\]\.?")


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost nn.Module that produced ``node`` ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo names submodules like "L['self'].blocks[0].attn"; keep "blocks.0.attn". A decorated forward
    # (Hugging Face's ``@can_return_tuple``) is traced as ``wrapper(*args)``: the module is "L['args'][0]".
    path = re.sub(_ROOT, "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def source_line(node: torch.fx.Node) -> str:
    """``file:line in function`` of the model code behind ``node`` ("" if unknown)."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line, func = frames[-1]
    # after a graph break Dynamo traces the rest of ``forward`` as ``torch_dynamo_resume_in_forward_at_<line>``
    func = _RESUMED.sub(r"\1", func)
    return f"{path}:{line} in {func}"


def op_name(node: torch.fx.Node) -> str:
    """A readable op name: ``aten.gelu`` for OpOverloads, the function name otherwise."""
    target = node.target
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target._opname}"
    if node.op == "call_function":
        return getattr(target, "__name__", str(target))
    return node.op


def source_name(source: str) -> str:
    """A Dynamo source as a user writes it: a parameter's or buffer's dotted name, an input's name.

    Example:
        >>> source_name("L['self']._modules['blocks']._modules['0']._modules['ln1']._parameters['weight']")
        'blocks.0.ln1.weight'
        >>> source_name("L['idx']")
        'idx'
        >>> source_name("L['args'][0]._modules['model']._parameters['weight']")  # a decorated forward's module
        'model.weight'
    """
    name = re.sub(r"^L\['args'\]\[0\](?=\.)", "L['self']", source)  # a decorated forward's module (see _ROOT)
    name = re.sub(r"\._(?:modules|parameters|buffers)\[", "[", name)
    name = re.sub(r"\[(\d+)\]", r".\1", name)
    name = re.sub(r"\['([^']+)'\]", r".\1", name)
    name = re.sub(r"^[LG]\.", "", name)
    return re.sub(r"^self\.", "", name).strip(".") or source


def input_names(gm: torch.fx.GraphModule) -> list[str]:
    """Readable names of a Dynamo graph's inputs, in placeholder order (``tok.weight``, ``idx``).

    From the source Dynamo recorded for each placeholder; without one (a copy of the graph
    may not keep it), read back from the placeholder's name, which Dynamo spells from the
    source (``l_self_modules_ln_f_parameters_weight_``: ``ln_f.weight``; see Note [Where a
    graph input comes from] in ``ortlab._compat.torch``).

    Example:
        >>> input_names(dynamo_gm)[:2]     # doctest: +SKIP
        ['idx', 'tok.weight']
    """
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = dynamo_input_source(node)
        out.append(source_name(source) if source else _placeholder_name(node.name))
    return out


def _placeholder_name(name: str) -> str:
    """``l_self_modules_blocks_modules_0_modules_ln1_parameters_weight_`` -> ``blocks.0.ln1.weight``."""
    name = re.sub(r"^[lLgG]_(.+?)_?$", r"\1", name)
    name = re.sub(r"^self_(?=modules_|parameters_|buffers_)", "_", name)
    return re.sub(r"_(?:modules|parameters|buffers)_", ".", name).strip(".") or name


def name_inputs(gm: torch.fx.GraphModule, names: list[str]) -> int:
    """Record on each placeholder of an AOTAutograd graph the name of what it receives
    (``meta[INPUT_KEY]``): ``names[i]`` for the Dynamo graph's ``i``-th input, a lifted
    parameter's or buffer's target as it is. Returns how many were named.

    Example:
        >>> name_inputs(forward_gm, input_names(dynamo_gm))    # doctest: +SKIP
        20
    """
    count = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        origin = aot_input_origin(node)
        name = names[origin] if isinstance(origin, int) and 0 <= origin < len(names) else origin
        if isinstance(name, str) and name:
            node.meta[INPUT_KEY] = name
            count += 1
    return count


_KERNEL_SUFFIX = "_kernel_time"


def onnx_node_of(name: str) -> str:
    """The exported ONNX node behind a name onnxruntime gave: a fused node, a kernel event.

    onnxruntime names a fused node ``<node>/<Fusion>/`` or ``fused <node>...`` and a
    profiler event ``<node>_kernel_time``; the part before the first ``/`` is the node
    that survived the fusion. The one parser of these names.

    Example:
        >>> onnx_node_of("fused node_addmm/GemmTransposeFusion/_kernel_time")
        'node_addmm'
    """
    if name.endswith(_KERNEL_SUFFIX):
        name = name[: -len(_KERNEL_SUFFIX)]
    if name.startswith("fused "):
        name = name[len("fused "):]
    return name.split("/")[0]


def added_beside(node: str, provenance: dict[str, dict[str, str]]) -> dict[str, str] | None:
    """Provenance of a node onnxruntime added next to an exported one (``node_Reshape_3_new_reshape``):
    the exported node with the longest name that ``node`` starts with (then ``_``); None for none.

    Example:
        >>> added_beside("node_Reshape_3_new_reshape", {"node_Reshape_3": {"module": "attn"}})
        {'module': 'attn'}
    """
    best = ""
    for name, prov in provenance.items():
        if len(name) > len(best) and node.startswith(name + "_") and any(prov.values()):
            best = name
    return provenance[best] if best else None


def _nodes_of(model: Any) -> Iterable[tuple[str, dict[str, str]]]:
    """(name, metadata) of every node of an onnx_ir Model or an onnx ModelProto."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return []
    if hasattr(graph, "all_nodes"):  # onnx_ir
        return ((n.name or "", dict(n.metadata_props)) for n in graph.all_nodes())
    return ((n.name, {p.key: p.value for p in n.metadata_props}) for n in graph.node)  # ModelProto


def _inputs_of(model: Any) -> Iterable[tuple[str, str]]:
    """(name, readable name) of the graph inputs of an onnx_ir Model or ModelProto that carry one."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return []
    if hasattr(graph, "all_nodes"):  # onnx_ir
        return ((v.name, v.metadata_props[INPUT_KEY]) for v in graph.inputs if v.metadata_props.get(INPUT_KEY))
    return ((v.name, p.value) for v in graph.input for p in v.metadata_props if p.key == INPUT_KEY)


def node_provenance(model: Any) -> dict[str, dict[str, str]]:
    """Map each ONNX node name of ``model`` to its ortlab provenance, and each named graph input to its name.

    Args:
        model: an ``onnx_ir.Model`` (``ExportedGraph.model``) or an ``onnx.ModelProto``.

    Returns:
        ``{node name: {"fx_node", "module", "op", "source"}}``; nodes without ortlab
        metadata map to empty strings. A graph input that carries ``ortlab.input`` (what
        it is: ``blocks.0.ln1.weight``) maps to ``{"input": name}``.

    Example:
        >>> prov = node_provenance(exported.model)       # doctest: +SKIP
        >>> prov["node_addmm"]["module"]                 # doctest: +SKIP
        'net.0'
    """
    out: dict[str, dict[str, str]] = {}
    for name, meta in _nodes_of(model):
        out[name] = {
            "fx_node": meta.get("ortlab.fx_node", ""),
            "module": meta.get("ortlab.module", ""),
            "op": meta.get("ortlab.op", ""),
            "source": meta.get("ortlab.source", ""),
        }
    for name, readable in _inputs_of(model):
        out.setdefault(name, {"input": readable})
    return out


def restore_provenance(model: Any, provenance: dict[str, dict[str, str]]) -> Any | None:
    """A copy of an ``onnx.ModelProto`` whose nodes (and graph inputs) carry their ``ortlab.*`` metadata again.

    onnxruntime's optimized models drop node metadata; a node keeps the exported node's
    name (see :func:`onnx_node_of`), so ``provenance`` (a :func:`node_provenance` map,
    what the on-disk cache stores) gives it back. ``None`` when there is nothing to add.

    Example:
        >>> restore_provenance(onnx.load(entry.model_path), runner.provenance)   # doctest: +SKIP
    """
    import onnx

    def entries(prov: dict[str, str]) -> list[tuple[str, str]]:
        return [(f"ortlab.{k}", v) for k, v in prov.items() if v and f"ortlab.{k}" in PROVENANCE_KEYS]

    props = {name: entries(prov) for name, prov in provenance.items()}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    added = 0
    for node in out.graph.node:
        if any(p.key in PROVENANCE_KEYS for p in node.metadata_props):
            continue
        name = onnx_node_of(node.name)
        if name not in props:
            beside = added_beside(name, provenance)
            if beside is not None:
                props[name] = entries(beside)
        for key, value in props.get(name, []):
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
            added += 1
    for value_info in out.graph.input:
        readable = provenance.get(value_info.name, {}).get("input")
        if readable and not any(p.key == INPUT_KEY for p in value_info.metadata_props):
            entry = value_info.metadata_props.add()
            entry.key, entry.value = INPUT_KEY, readable
            added += 1
    return out if added else None


@functools.lru_cache(maxsize=64)
def _node_index_cached(path: str, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    found: dict[str, str] = {}
    producers: dict[str, str] = {}
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == "ortlab.fx_node":
                found[prop.value] = node.name  # the last ONNX node of an FX node makes its value
        for value in node.output:
            producers.setdefault(value, node.name)
    # Values keep their FX names: getitem_3 (an output of a multi-output op) -> its producer;
    # a value made outside this graph (by an op running in PyTorch) -> the input itself.
    for value, node_name in producers.items():
        found.setdefault(value, node_name)
    for value in model.graph.input:
        found.setdefault(value.name, value.name)
    return tuple(found.items())


def onnx_node_index(path: str) -> dict[str, str]:
    """FX node name -> name of the (last) ONNX node exported for it, read from a model's ``ortlab.fx_node``.

    FX values without a node of their own (``getitem_3`` of a multi-output op) map to
    the ONNX node that produces the value of that name, and graph inputs to themselves.
    The model is read once per version of the file (cached by path and modification time).

    Example:
        >>> onnx_node_index("net_forward_exported_train.onnx")["tanh"]    # doctest: +SKIP
        'node_tanh'
    """
    return dict(_node_index_cached(os.path.abspath(path), os.stat(path).st_mtime_ns))
