"""ONNX graphs for views: the node a name means, a node's source, one module's subgraph.

Note [Large graphs]
netron lays a graph out in the browser; above a few thousand nodes that takes
minutes. Every ONNX node ortlab exports carries its nn.Module path
(``ortlab.module``), so a view of a large graph shows one module's nodes: the
subgraph of that module, with the values it reads as inputs and the values others
read as outputs, saved next to the stage (``views/``) and served like any stage file.
onnxruntime's optimized models lose the metadata; their nodes keep the exported
node's name before the first ``/``, which leads back to the exported model's metadata.

Note [Named graph inputs]
AOTAutograd calls a graph's inputs ``primals_1``, ``primals_2``... (``arg0_1`` without
grad); the exporter keeps these names, which the runners, the cache and the node links
rely on. Each input also carries what it is (``ortlab.input``: ``blocks.0.ln1.weight``,
``idx``; see ``ortlab.provenance.name_inputs``), so the copy netron shows has its inputs
renamed to that (:func:`rename_inputs`); a link to an input by its old name selects the
renamed one (:func:`input_names` gives the map).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ortlab.errors import ConfigError
from ortlab.provenance import INPUT_KEY, node_provenance, onnx_node_of, restore_provenance

__all__ = ["load_model", "annotate", "node_modules", "module_counts", "extract_module", "resolve_node",
           "input_names", "rename_inputs"]


def load_model(path: str) -> Any:
    """The model at ``path``, cached while the file is unchanged (callers must not modify it)."""
    return _load_cached(os.path.abspath(path), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> Any:
    import onnx

    return onnx.load(path, load_external_data=False)


def annotate(model: Any, reference: Any) -> Any | None:
    """A copy of an onnxruntime-optimized model whose nodes carry their source again.

    onnxruntime drops node metadata; a node keeps the exported node's name before the
    first ``/``, so the ``ortlab.*`` metadata of ``reference`` is copied onto it.
    ``None`` when there is nothing to add.

    Example:
        >>> optimized = onnx.load("net_forward_ort_all_train.onnx")          # doctest: +SKIP
        >>> annotate(optimized, onnx.load("net_forward_onnxscript_train.onnx"))  # doctest: +SKIP
    """
    return restore_provenance(model, node_provenance(reference))


def node_modules(model: Any, reference: Any = None) -> dict[str, str]:
    """ONNX node name -> nn.Module path (``ortlab.module``), via ``reference`` for optimized models.

    Example:
        >>> node_modules(onnx.load("net_forward_exported_train.onnx"))["node_addmm"]   # doctest: +SKIP
        'fc1'
    """
    known: dict[str, str] = {}
    for source in ([reference] if reference is not None else []) + [model]:
        for node in source.graph.node:
            for prop in node.metadata_props:
                if prop.key == "ortlab.module":
                    known[node.name] = prop.value
    out = {}
    for node in model.graph.node:
        name = node.name
        out[name] = known.get(name, known.get(onnx_node_of(name), "?"))
    return out


def _in_module(path: str, module: str) -> bool:
    if module == "":
        return path == ""
    return path == module or path.startswith(module + ".")


def module_counts(model: Any, depth: int = 1, reference: Any = None) -> dict[str, int]:
    """Nodes per nn.Module path cut at ``depth`` parts (``""`` is the root module).

    Example:
        >>> module_counts(model, depth=2)            # doctest: +SKIP
        {'blocks.0': 410, 'blocks.1': 410, 'head': 3, '': 12}
    """
    counts: dict[str, int] = {}
    for path in node_modules(model, reference).values():
        key = path if path in ("", "?") else ".".join(path.split(".")[:depth])
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def extract_module(model: Any, module: str, reference: Any = None) -> Any:
    """The subgraph of the nodes of one nn.Module (and its children) as a model of its own.

    Its inputs are the values its nodes read from outside (weights stay initializers),
    its outputs the values the rest of the graph reads. ``module=""`` takes the nodes
    of the root module itself.

    Raises:
        ConfigError: naming the modules there are when no node belongs to ``module``.

    Example:
        >>> sub = extract_module(onnx.load("gpt_forward_exported_train.onnx"), "blocks.0.attn")  # doctest: +SKIP
    """
    import onnx
    import onnx.helper

    graph = model.graph
    modules = node_modules(model, reference)
    keep = [n for n in graph.node if _in_module(modules.get(n.name, "?"), module)]
    if not keep:
        valid = ", ".join(repr(m) for m in list(module_counts(model, 2, reference))[:12])
        raise ConfigError(f"no node of graph {graph.name!r} belongs to module {module!r}; modules: {valid}.")
    try:
        typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # contrib ops or symbolic sizes: untyped boundary values are fine for a view
        typed = model
    types = {v.name: v for v in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]}
    initializers = {t.name: t for t in graph.initializer}
    produced = {o for n in keep for o in n.output if o}
    kept = {id(n) for n in keep}
    consumed: list[str] = []
    for node in keep:
        for name in node.input:
            if name and name not in produced and name not in consumed:
                consumed.append(name)
    read_outside = {i for n in graph.node if id(n) not in kept for i in n.input} | {o.name for o in graph.output}
    outputs = [o for n in keep for o in n.output if o and o in read_outside] or [o for o in keep[-1].output if o]

    def info(name: str) -> Any:
        return types[name] if name in types else onnx.helper.make_empty_tensor_value_info(name)

    sub = onnx.helper.make_graph(
        keep,
        f"{graph.name}:{module or '<root>'}",
        [info(n) for n in consumed if n not in initializers],
        [info(n) for n in outputs],
        initializer=[initializers[n] for n in consumed if n in initializers],
        value_info=[types[n] for n in produced if n in types and n not in outputs],
    )
    out = onnx.helper.make_model(sub, opset_imports=list(model.opset_import), functions=list(model.functions))
    out.ir_version = model.ir_version
    onnx.helper.set_model_props(out, {"ortlab.module_filter": module, "ortlab.nodes_of_graph": str(len(graph.node))})
    return out


def resolve_node(model: Any, name: str, reference: Any = None) -> str | None:
    """The ONNX name to select for ``name``: a node, an FX node's ONNX node, or a value.

    ``name`` may be an ONNX node name, an FX node name (matched through the
    ``ortlab.fx_node`` metadata of ``model`` or of ``reference``, the exported model an
    optimized one came from) or a value (graph input or output) name. ``None`` when
    nothing matches.

    Example:
        >>> resolve_node(onnx.load("net_forward_exported_train.onnx"), "tanh")   # doctest: +SKIP
        'node_tanh'
    """
    nodes = list(model.graph.node)
    names = {n.name for n in nodes}
    if name in names:
        return name
    for source in [model] + ([reference] if reference is not None else []):
        found = [n.name for n in source.graph.node
                 if any(p.key == "ortlab.fx_node" and p.value == name for p in n.metadata_props)]
        if not found:
            continue
        for candidate in reversed(found):
            if candidate in names:
                return candidate
            fused = next((n for n in names if onnx_node_of(n) == candidate), None)
            if fused is not None:
                return fused
        return found[-1]
    values = {v.name for v in [*model.graph.input, *model.graph.output]} | {o for n in nodes for o in n.output}
    return name if name in values else None


def input_names(model: Any) -> dict[str, str]:
    """Graph input name -> the name netron shows for it: what it is (``ortlab.input``).

    A name another value of the graph already has is shown with the old one beside it
    (``idx (primals_1)``). Inputs without ``ortlab.input`` are left out (see Note [Named graph inputs]).

    Example:
        >>> input_names(onnx.load("gpt_forward_exported_train.onnx"))["primals_4"]   # doctest: +SKIP
        'blocks.0.ln1.weight'
    """
    graph = model.graph
    taken = {v for n in graph.node for v in [*n.input, *n.output]} | {t.name for t in graph.initializer}
    taken |= {v.name for v in [*graph.input, *graph.output]}
    out: dict[str, str] = {}
    for value in graph.input:
        readable = next((p.value for p in value.metadata_props if p.key == INPUT_KEY), "")
        if not readable or readable == value.name:
            continue
        if readable in taken or readable in out.values():
            readable = f"{readable} ({value.name})"
        out[value.name] = readable
    return out


def rename_inputs(model: Any, names: dict[str, str]) -> Any:
    """A copy of ``model`` whose graph inputs (and every use of them) are renamed by ``names``.

    Example:
        >>> shown = rename_inputs(model, input_names(model))    # doctest: +SKIP
    """
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)

    def rename(graph: Any) -> None:  # subgraphs (If, Loop) may read the outer graph's inputs
        for value in [*graph.input, *graph.output, *graph.value_info]:
            value.name = names.get(value.name, value.name)
        for node in graph.node:
            node.input[:] = [names.get(i, i) for i in node.input]
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    rename(sub)

    rename(out.graph)
    return out
