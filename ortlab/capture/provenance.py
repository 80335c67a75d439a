"""Where an FX node came from: the nn.Module path and the line of model code.

Dynamo records ``nn_module_stack`` and ``stack_trace`` on the nodes it captures and
AOTAutograd carries them onto the joint, forward and backward graphs
(``preserve_node_meta``); backward nodes also get ``fwd_nn_module_stack`` /
``fwd_source_fn_stack`` naming the forward node they differentiate.
"""

from __future__ import annotations

import re

import torch.fx

__all__ = ["module_path", "source_line", "op_name"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost nn.Module that produced ``node`` ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo names submodules like "L['self'].blocks[0].attn"; keep "blocks.0.attn".
    path = re.sub(r"^L\['[^']*'\]\.?", "", str(path))
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
    return f"{path}:{line} in {func}"


def op_name(node: torch.fx.Node) -> str:
    """A readable op name: ``aten.gelu`` for OpOverloads, the function name otherwise."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if node.op == "call_function":
        return getattr(target, "__name__", str(target))
    return node.op
