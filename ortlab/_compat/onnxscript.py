"""The private onnxscript APIs ortlab uses, each with why (checked on onnxscript 0.5-0.7).

Note [onnxscript's optimizer without SlicesSplit]
``onnxscript.optimizer.optimize_ir`` runs a fixed list of rewrite rules. One of them,
``SlicesSplit`` (two Slices of one tensor -> one Split), has a pattern with two output
nodes, which onnxscript's matcher finds by trying every pair of Slice nodes in the graph:
quadratic in the Slices. A ResNet-18 backward (1,200 Slices from the convolution gradients'
patches, see Note [Convolution gradients as GEMMs]) spent 12 s of its first step there,
against 0.9 s without the rule. So the rule runs only where two Slices read one tensor (it
can fire) and there are at most 64 Slices. Its matcher also walks the whole graph each time
it is tried, and onnxscript tries it at every node: quadratic in the nodes, whatever the
Slices (an LSTM unrolled by Dynamo, 64 Slices in a 5,893-node backward: 11.4 s of
optimize_ir); it is tried only at Slice nodes (Note [Only the rewrite rules that can fire]).
``optimize`` runs optimize_ir's own passes without the rules it is told to leave out;
onnxscript offers no public way to choose the rules.

Note [Folding what would be dropped]
onnxscript's constant folding evaluates a node whose inputs are constants (with numpy, through
onnx's reference implementation) and only then drops the value if it is larger than
``DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT`` (512 x 512 elements) and larger than the constants it
would replace. A Hugging Face GPT-2's backward expands a scalar to its [batch, heads, T, T]
attention shape twice: 0.6 s of numpy for values thrown away (GPT-2-small-sized, 12 layers: its
backward's optimizer 2.1-2.3 -> 1.6 s). ``should_fold`` says no to exactly those nodes, seen
from the output's static shape (known from onnxscript's shape inference before it asks): a
single output larger than the limit and than all of its constant inputs together, which
onnxscript's size rule would drop whatever its value. Its op-specific rewrites (an Expand to the same shape becoming Identity) run before
it asks, and still do; the graphs come out the same (tested).

Note [Only the rewrite rules that can fire]
The rewriter tries every rule on every node, and a failed match costs 10-40 us of set-up
whatever the node: 46 rules x 2,000 nodes x 2 rounds was 0.75 s of the GPT's first step,
though 3 rules fired. Each rule's pattern ends in one op (``Reshape`` for ReshapeReshape,
``BatchNormalization`` for the conv fusions), so each round runs only the rules whose last
op is in the graph at that point (recomputed per round, so a rule whose op a rewrite has
just produced runs in the next); rules whose pattern does not end in one named op always
run. The graph comes out the same (the GPT's forward and backward, node for node): 0.86 s
-> 0.4 s for the two graphs. Within a round, a rule is tried only at nodes of the op its
pattern's first output is made by (the node it is tried at is matched against that output
first, so no other node can match; ``_AtItsOp``): the GPT's two graphs 0.45 -> 0.36 s, the
unrolled LSTM's backward above 11.4 -> 1.2 s, the same graphs node for node (tested).
Reading a rule's pattern uses onnxscript's private ``_target_pattern``, and the filter wraps
its ``try_rewrite``; a rule whose pattern cannot be read always runs, at every node.

Note [Shape inference only where a shape is missing]
Constant folding infers each node's output types with onnx's shape inference (serializing the
node and its input types to protobuf, one call per node, on every round): on the GPT's
backward, 1,349 calls and a quarter of the optimizer's time. torch.onnx's export gives most
values a type and a static shape already, and inference cannot add to those (it merges what it
infers into the known shape). ``_FoldConstants`` skips it at nodes whose outputs all have a type
and a static shape; nodes torchlib's functions add without shapes, symbolic sizes and sequences
are inferred as before. The graphs come out the same, node for node (tested against
``optimize_ir``), with half the inference calls (the GPT's forward 658 -> 364, backward 1,349 ->
719); the two graphs' optimizer 1.51 -> 1.27 s (medians of 6 alternating standalone runs on a
noisy 2-core Xeon, each run 1.06-1.87 s). The override is of onnxscript's
private ``_do_inference``: an onnxscript without it simply infers everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import pattern

__all__ = ["optimize"]


class _FoldConstants(_constant_folding.FoldConstantsPass):
    """onnxscript's constant folding, inferring shapes only where one is missing
    (Note [Shape inference only where a shape is missing])."""

    def _do_inference(self, node: ir.Node) -> None:
        if node.outputs and all(o.type is not None and o.shape is not None and o.shape.is_static()
                                for o in node.outputs):
            return
        super()._do_inference(node)

    def replace_node(self, node: ir.Node, replacement: object, root: object) -> None:
        # A node made to replace another (SplitToSequence + SequenceAt folded into a Split)
        # carries the replaced node's metadata: its provenance (ortlab.module, ortlab.source).
        for new in replacement.new_nodes:
            for key, value in node.metadata_props.items():
                new.metadata_props.setdefault(key, value)
        super().replace_node(node, replacement, root)


def _rules_without(names: Collection[str]) -> list:
    return [rule for rule in rewriter._DEFAULT_REWRITE_RULES if getattr(rule, "name", None) not in names]


def _op(domain: str | None, op_type: str) -> tuple[str, str]:
    return ("" if domain in (None, "ai.onnx") else domain, op_type)


def _last_ops(rule: object) -> tuple[tuple[str, str], ...] | None:
    """The (domain, op type) each of the rule's pattern outputs is made by, in the pattern's order;
    None when not all are one named op."""
    try:
        ids = [node.op_identifier() for node in rule._target_pattern.output_nodes]
    except Exception:  # noqa: BLE001 - another onnxscript: the rule always runs
        return None
    if not ids or any(i is None for i in ids):
        return None
    return tuple(_op(domain, op) for domain, op, *_ in ids)


class _AtItsOp:
    """A rewrite rule tried only at nodes of the op its pattern's first output is made by
    (Note [Only the rewrite rules that can fire]); everything else is the rule's own."""

    def __init__(self, rule: object, op: tuple[str, str]) -> None:
        self.rule, self.op = rule, op

    def __getattr__(self, name: str) -> object:
        return getattr(self.rule, name)

    def try_rewrite(self, model: ir.Model, graph_or_function: object, node: ir.Node, **kwargs: object) -> object:
        if _op(node.domain, node.op_type) != self.op:
            return None
        return self.rule.try_rewrite(model, graph_or_function, node, **kwargs)


class _RulesThatCanFire(ir.passes.InPlacePass):
    """onnxscript's RewritePass, running only the rules whose last op is in the graph
    (Note [Only the rewrite rules that can fire])."""

    def __init__(self, rules: Sequence) -> None:
        super().__init__()
        self.rules = []
        for rule in rules:
            ops = _last_ops(rule)
            self.rules.append((rule, None) if ops is None else (_AtItsOp(rule, ops[0]), frozenset(ops)))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        present = {_op(node.domain, node.op_type) for node in ir.traversal.RecursiveGraphIterator(model.graph)}
        for function in model.functions.values():
            present.update(_op(node.domain, node.op_type) for node in function)
        rules = [rule for rule, ops in self.rules if ops is None or ops <= present]
        count = pattern.RewriteRuleSet(rules).apply_to_model(model) if rules else 0
        return ir.passes.PassResult(model, bool(count))


def _not_if_dropped_for_size(limit: int) -> Callable[[ir.Node], bool | None]:
    """onnxscript's ``should_fold``: no where it would compute a value only to drop it for its size
    (Note [Folding what would be dropped]); its own rules (None) everywhere else."""

    def should_fold(node: ir.Node) -> bool | None:
        if len(node.outputs) != 1 or (shape := node.outputs[0].shape) is None or not shape.is_static():
            return None
        size = math.prod(shape.numpy())
        inputs = sum(v.const_value.size for v in node.inputs if v is not None and v.const_value is not None)
        return False if size > limit and size > inputs else None

    return should_fold


def optimize(model: ir.Model, leave_out: Collection[str] = (), num_iterations: int = 2) -> None:
    """``onnxscript.optimizer.optimize_ir(model)`` (its passes, in its order), running only the rewrite rules
    that can fire (Note [Only the rewrite rules that can fire]) and none of those named in ``leave_out``."""
    fold = _FoldConstants(
        shape_inference=True,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        should_fold=_not_if_dropped_for_size(_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT),
    )
    passes = [
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                fold,
                _RulesThatCanFire(_rules_without(leave_out)),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=num_iterations,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    ]
    ir.passes.Sequential(*passes)(model)
