"""An inference model cut from the eval model: the outputs asked for, parameters as initializers.

Torch-free. The eval model computes the loss and the model's outputs from parameters,
inputs and labels; the inference model keeps only the nodes the requested outputs need,
turns the parameter inputs into initializers holding their current values, and drops
whatever is left unused (the labels, the loss), so plain onnxruntime runs it on the
model's inputs alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortlab.errors import ArtifactError

__all__ = ["inference_model"]


def _subgraph_inputs(node: onnx.NodeProto) -> Iterator[str]:
    """Every name the node's subgraphs (If, Loop, Scan) read: outer values they may capture."""
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            for inner in g.node:
                yield from inner.input
                yield from _subgraph_inputs(inner)


def inference_model(eval_model: onnx.ModelProto, parameters: Mapping[str, np.ndarray],
                    outputs: Sequence[str]) -> onnx.ModelProto:
    """The part of ``eval_model`` that computes ``outputs``, with ``parameters`` baked in.

    Args:
        eval_model: the eval model ``generate_artifacts`` wrote.
        parameters: current values by input name (a ``CheckpointState.parameters``).
        outputs: the eval model's outputs to keep, in order.

    Raises:
        ArtifactError: when an output is not one of the eval model's.

    Example:
        >>> eval_model = onnx.load("artifacts/eval_model.onnx")                 # doctest: +SKIP
        >>> model = inference_model(eval_model, state.parameters, ["output"])  # doctest: +SKIP
    """
    graph = eval_model.graph
    available = [o.name for o in graph.output]
    unknown = [o for o in outputs if o not in available]
    if unknown or not outputs:
        raise ArtifactError(f"the eval model has no output {', '.join(map(repr, unknown)) or '(none asked for)'}; "
                            f"choose among {', '.join(available)}")
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    used: set[str] = set()
    kept: set[int] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in used:
            continue
        used.add(name)
        i = producer.get(name)
        if i is not None and i not in kept:
            kept.add(i)
            stack += [x for x in graph.node[i].input if x]
            stack += list(_subgraph_inputs(graph.node[i]))
    nodes = [n for i, n in enumerate(graph.node) if i in kept]
    inputs, initializers = [], [t for t in graph.initializer if t.name in used]
    for value in graph.input:
        if value.name not in used:
            continue
        if value.name in parameters:
            initializers.append(numpy_helper.from_array(np.asarray(parameters[value.name]), value.name))
        else:
            inputs.append(value)
    by_name = {o.name: o for o in graph.output}
    new_graph = helper.make_graph(nodes, graph.name.replace("eval", "inference") or "inference", inputs,
                                  [by_name[o] for o in outputs], initializers,
                                  value_info=[v for v in graph.value_info if v.name in used])
    model = helper.make_model(new_graph, opset_imports=list(eval_model.opset_import),
                              producer_name=eval_model.producer_name or "ortlab")
    model.ir_version = eval_model.ir_version
    model.functions.extend(eval_model.functions)
    return model

