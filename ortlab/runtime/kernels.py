"""Ask onnxruntime which nodes of a model it has kernels for, one node at a time.

onnxruntime's own error for a missing kernel names one node, and sometimes a node
that is not in our model at all: a function op it expanded (a bf16 Relu becomes an
unnamed Max) or a node its optimizer renamed. No public API lists the registered
kernels, so for models with low-precision floats we probe: each distinct
(op type, domain, attributes, input and output dtypes) becomes a one-node model,
and a session that fails to build means no kernel. Results are cached per process.
"""

from __future__ import annotations

import functools
import logging

import onnx_ir as ir

from ortlab.config import Options
from ortlab.errors import SessionError
from ortlab.runtime.session import build_session

__all__ = ["LOW_PRECISION", "low_precision_nodes", "missing_kernels", "rejected_at_run_time"]

logger = logging.getLogger(__name__)

LOW_PRECISION = {ir.DataType.BFLOAT16, ir.DataType.FLOAT16}


def low_precision_nodes(model: ir.Model) -> list[ir.Node]:
    """Nodes that read or write bfloat16/float16 values."""
    out = []
    for node in model.graph:
        values = [v for v in (*node.inputs, *node.outputs) if v is not None]
        if any(v.dtype in LOW_PRECISION for v in values):
            out.append(node)
    return out


def _signature(node: ir.Node, opset: int) -> tuple:
    attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
    ins = tuple(v.dtype if v is not None else None for v in node.inputs)
    outs = tuple(v.dtype for v in node.outputs)
    return (node.domain, node.op_type, opset, attrs, ins, outs)


def _probe_model(node: ir.Node, opset: int) -> bytes | None:
    inputs, args = [], []
    for i, v in enumerate(node.inputs):
        if v is None:
            args.append(None)
            continue
        if v.dtype is None:
            return None
        if v.const_value is not None:  # keep constant operands (shapes, axes) constant
            args.append(ir.Value(name=f"c{i}", const_value=v.const_value, type=ir.TensorType(v.dtype)))
            continue
        value = ir.Value(name=f"i{i}", type=ir.TensorType(v.dtype), shape=v.shape)
        inputs.append(value)
        args.append(value)
    probe = ir.Node(node.domain, node.op_type, args, attributes=list(node.attributes.values()), num_outputs=len(node.outputs))
    for j, (src, dst) in enumerate(zip(node.outputs, probe.outputs)):
        if src.dtype is None:
            return None
        dst.name, dst.type = f"o{j}", ir.TensorType(src.dtype)
    graph = ir.Graph(inputs, list(probe.outputs), nodes=[probe], opset_imports={node.domain or "": opset})
    for arg in args:
        if arg is not None and arg.const_value is not None:
            graph.initializers[arg.name] = arg
    return ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()


@functools.lru_cache(maxsize=4096)
def _has_kernel(signature: tuple, model_bytes: bytes, providers: tuple[str, ...]) -> bool:
    try:
        build_session(model_bytes, Options(), providers=providers, level="disable", quiet=True)
        return True
    except SessionError as e:  # onnxruntime's NOT_IMPLEMENTED / INVALID_GRAPH
        logger.debug("no kernel for %s: %s", signature[:2], e)
        return False


def rejected_at_run_time(node: ir.Node, providers: list[str]) -> bool:
    """A node whose session builds but whose kernel refuses its dtype when it runs: the CPU provider's
    ScatterElements and ScatterND reduce (``add``, ``mul``, ``max``, ``min``) no bfloat16 or float16 ("BFloat16 data
    type is not supported with ScatterElements opset 16 when reduction is 'add'", at run time: a bf16 model's
    ``scatter_add``, ``index_add`` or gather gradient crashed the step)."""
    if not providers or providers[0] != "CPUExecutionProvider" or node.op_type not in ("ScatterElements", "ScatterND"):
        return False
    reduction = node.attributes.get("reduction")
    data = node.inputs[0] if node.inputs else None
    return (reduction is not None and reduction.value != "none" and data is not None
            and data.dtype in LOW_PRECISION)


def missing_kernels(model: ir.Model, providers: list[str]) -> list[ir.Node]:
    """Low-precision nodes of ``model`` that ``providers`` cannot run."""
    opset = model.opset_imports.get("", 18)
    missing = []
    for node in low_precision_nodes(model):
        if rejected_at_run_time(node, providers):
            missing.append(node)
            continue
        sig = _signature(node, model.opset_imports.get(node.domain or "", opset))
        data = _probe_model(node, sig[2])
        if data is not None and not _has_kernel(sig, data, tuple(providers)):
            missing.append(node)
    return missing
