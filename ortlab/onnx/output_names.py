"""Names for the graph outputs of a model exported for plain onnxruntime.

torch.onnx names a graph output after the FX node that computed it (``linear_14``), and
``session.run`` results are read by those names. ``ORTModule.export_onnx`` names them after
what the module returns instead:

* one tensor: ``output``;
* a tuple or list: ``output_0``, ``output_1``, ...;
* a dict, a Hugging Face ``ModelOutput`` or a namedtuple: its keys (``logits``);
* nested containers: the keys on the way joined with ``.`` (``past_key_values.0.1``).

Example:
    >>> default_output_names(program.exported_program.call_spec.out_spec, 1)   # doctest: +SKIP
    ['output']
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx_ir as ir
import torch
from onnx_ir.passes.common import NameFixPass

from ortlab._compat.torch import pytree
from ortlab.errors import ConfigError

__all__ = ["default_output_names", "name_outputs"]

logger = logging.getLogger(__name__)

ORIGINAL_NAME_KEY = "pkg.torch.onnx.original_node_name"
"""Metadata key on a renamed output holding torch.onnx's name for it (the key torch.onnx's own renaming uses)."""


def _numbered(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def _key_name(key: object) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key).strip(".[]'\"")


def default_output_names(out_spec: pytree.TreeSpec | None, count: int) -> list[str]:
    """Names for ``count`` flat outputs of a module that returns the structure ``out_spec`` describes.

    Falls back to ``output`` / ``output_0..`` when the structure cannot be rebuilt or does not
    flatten to ``count`` leaves (an output torch.export keeps out of the graph).

    Args:
        out_spec: the exported program's output tree (``exported_program.call_spec.out_spec``).
        count: the number of graph outputs.

    Example:
        >>> default_output_names(pytree.tree_structure({"logits": 0, "aux": (0, 0)}), 3)   # doctest: +SKIP
        ['logits', 'aux.0', 'aux.1']
    """
    if out_spec is None:
        return _numbered(count)
    try:
        # Tensors as leaves: containers such as ModelOutput look at their first field's type.
        tree = pytree.tree_unflatten([torch.empty(0) for _ in range(out_spec.num_leaves)], out_spec)
        paths = [path for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    except Exception as e:  # a container that cannot be rebuilt from placeholders
        logger.debug("output names numbered: %s could not be rebuilt (%s)", out_spec, e)
        return _numbered(count)
    if len(paths) != count or not paths or not paths[0]:
        return _numbered(count)
    names = [".".join(_key_name(k) for k in path) for path in paths]
    if isinstance(paths[0][0], pytree.SequenceKey):
        names = [f"output_{name}" for name in names]
    return names if len(set(names)) == len(names) else _numbered(count)


# Note [Outputs that are inputs]
# onnx_ir's OutputFixPass gives an output that is also a graph input an Identity too, but it moves the
# input's name to the Identity and renames the input (``x`` -> ``x_orig``): it keeps output names
# stable, and we rename outputs to keep input names (``forward``'s parameters) stable. So the
# Identity's output is the one renamed here.
def _give_outputs_values_of_their_own(graph: ir.Graph) -> None:
    """An Identity for each output that is a graph input, an initializer or returned before."""
    seen: set[ir.Value] = set()
    for i, value in enumerate(graph.outputs):
        if value.is_graph_input() or value.is_initializer() or value in seen:
            identity = ir.node("Identity", inputs=[value])
            alias = identity.outputs[0]
            alias.name, alias.shape, alias.type = value.name, value.shape, value.type
            graph.append(identity)
            graph.outputs[i] = alias
        seen.add(graph.outputs[i])


def name_outputs(model: ir.Model, names: Sequence[str]) -> None:
    """Rename ``model``'s graph outputs to ``names``, in place, keeping every name in the graph unique.

    An output that is also a graph input, or a value returned twice, gets an Identity of its own
    first, so renaming it leaves the input's name alone. Another value that already has one of
    the names is renamed instead (graph inputs and outputs keep theirs). Each renamed output
    keeps torch.onnx's name under ``pkg.torch.onnx.original_node_name`` in its metadata.

    Raises:
        ConfigError: ``names`` has another length than the outputs, or a name twice.
    """
    names = list(names)
    outputs = model.graph.outputs
    if len(names) != len(outputs):
        raise ConfigError(
            f"output_names has {len(names)} name(s) {names} but the exported model has {len(outputs)} output(s); "
            f"pass one name per output tensor, in the order the module returns them"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"output_names names {repeated} more than once; each output needs a name of its own")
    _give_outputs_values_of_their_own(model.graph)
    for value, name in zip(model.graph.outputs, names):
        if value.name != name:
            value.metadata_props[ORIGINAL_NAME_KEY] = str(value.name)
            value.name = name
    NameFixPass()(model)
