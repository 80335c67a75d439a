"""The private onnxscript APIs ortlab uses, each with why (checked on onnxscript 0.5-0.7).

Note [Pattern constants matched exactly]
onnxscript's matcher takes a graph's constant for a pattern's number when ``math.isclose(value,
number, rel_tol=1e-5, abs_tol=1e-8)`` (the defaults of ``_pattern_ir.Constant``, read by
``_matcher.SimplePatternMatcher._match_constant``). To the no-op rules (``rules/common/_no_op.py``)
``x + 1e-8`` was ``x + 0`` and became ``x``: a norm's ``+ eps`` vanished, ``x / (|x| + 1e-8)`` on a zero
row gave NaN where eager gives 0 (a loss of 2.476 became NaN), float64's ``x + 1e-12`` returned ``x``,
and ``x * 1.000001`` and ``x / 1.0000001`` returned ``x`` (``x * 1.000001 - x`` at 1000: 0, eager 0.001).
Every rule with a number in its pattern reads it so: the GELU fusions' 0.5, 1, sqrt(2), 0.044715
and sqrt(2/pi) fuse a formula an ulp away from the standard one into the standard kernel. So every
rule ortlab runs (``optimize`` below; the CPU provider's GELU fusions through ``exact_rules``) is a
copy of onnxscript's with ``_ExactMatcher``: a constant matches a pattern's number only when it is
that number as the constant's own type stores it (float32's sqrt(2) is 1.4142135381698608,
torchlib's constant and ``math.sqrt(2)`` rounded to float32; float64's is ``math.sqrt(2)``); an
integer matches only an equal integer. The rest of the matching is onnxscript's. A rule onnxscript
matches with another matcher class, or an onnxscript whose matcher has no ``_match_constant`` to
override, is left out (logged): it could match approximately. Private: ``_matcher``,
``SimplePatternMatcher._match_constant`` and a rule's ``_matcher`` and ``_target_pattern``
(onnxscript 0.7.2). ``tests/test_exact_constants.py`` shows the behaviour on plain onnxscript and
says when an upgrade has changed it.

Note [Adding zero keeps the sign of zero]
Even matched exactly, onnxscript's ``x + 0 -> x`` is not exact: -0.0 + 0.0 is +0.0 (IEEE, and
eager), so ``1 / (x + 0)`` is +inf where ``1 / x`` is -inf; ``x - (-0.0)`` likewise. ``x + (-0.0)``
and ``x - 0.0`` are ``x`` for every ``x``. ortlab's own no-op rules (``_NO_OP_RULES``) take the place of
onnxscript's arithmetic ones: ``x * 1``, ``1 * x``, ``x / 1``, ``x + (-0.0)``, ``(-0.0) + x`` and
``x - 0.0`` become ``x`` (integers: any zero); the two Dropout rules stay onnxscript's (their
ratio and mode are attributes, compared exactly). Finding onnxscript's arithmetic rules reads its
private ``rules.common._no_op`` (the objects of its ``rules`` set); an onnxscript without it runs its
own beside ortlab's, matched exactly, and only the sign of a zero is at risk again.

Note [Casts through float32 that round twice]
onnxscript's CastCast turns ``Cast(Cast(x, to=FLOAT), to=FLOAT16 or BFLOAT16)`` into one Cast. For a
float64 x that rounds once where the graph rounds twice: 1 + 2^-11 + 2^-40 is 1 + 2^-11 in
float32, a tie that float16 rounds to even, 1.0; cast directly it is 1.0009765625 (int32/int64
past 2^24 likewise into bfloat16). ortlab's rule (``_CastOnce``) casts once only where the first cast
is exact, for an x of a type float32 holds exactly (float16, bfloat16, float32, 8- and 16-bit
integers, bool), and takes the place of onnxscript's.

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

import copy
import functools
import logging
import math
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import _matcher, pattern

__all__ = ["exact_rules", "optimize"]

logger = logging.getLogger(__name__)


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


def _is_number(array: np.ndarray, number: float | int | list) -> bool:
    """Whether ``array`` holds exactly ``number`` as its own type stores it (Note [Pattern constants matched
    exactly])."""
    if array.dtype.kind in "iub":  # integers (and bool) match equal integers only: 0.5 is no int's value
        return array.tolist() == number
    try:
        expected = np.asarray(number, dtype=np.float64).astype(array.dtype)
    except (TypeError, ValueError):
        return False
    return bool(np.array_equal(array, expected))


class _ExactMatcher(_matcher.SimplePatternMatcher):
    """onnxscript's matcher with a pattern's constants compared exactly (Note [Pattern constants matched exactly])."""

    def _match_constant(self, pattern_constant: object, value: ir.Value) -> bool:
        tensor = value.const_value
        number = pattern_constant.value
        if tensor is None:
            return self.fail(f"Value {value.name} is not a constant, expecting {number}.")
        try:
            array = tensor.numpy()
        except FileNotFoundError:
            return self.fail(f"Constant value of {value.name} not available.")
        shape = (len(number),) if isinstance(number, list) else ()
        if array.shape != shape:
            return self.fail(f"Value {value.name} has shape {array.shape}, expecting {shape}.")
        if not _is_number(array, number):
            return self.fail(f"Constant value mismatch: expected exactly {number}, got {array.tolist()}.")
        return True


# onnxscript's own override point: where it is gone, an exact matcher cannot be had.
_CAN_MATCH_EXACTLY = callable(getattr(_matcher.SimplePatternMatcher, "_match_constant", None))


def _exact(rule: object) -> object | None:
    """A copy of ``rule`` matched by ``_ExactMatcher``, or None when it cannot be (Note [Pattern constants matched
    exactly])."""
    if not _CAN_MATCH_EXACTLY or type(getattr(rule, "_matcher", None)) is not _matcher.SimplePatternMatcher:
        logger.info("ortlab: onnxscript's rule %s left out: its constants cannot be matched exactly",
                    getattr(rule, "name", None) or rule)
        return None
    exact = copy.copy(rule)
    exact._matcher = _ExactMatcher(rule._target_pattern)
    return exact


def exact_rules(rules: Iterable) -> list:
    """onnxscript rewrite rules (or a RewriteRuleSet) as copies whose pattern constants match only exactly; a rule
    that cannot be so matched is left out (Note [Pattern constants matched exactly])."""
    return [exact for exact in map(_exact, rules) if exact is not None]


def _scalar(value: ir.Value | None) -> np.ndarray | None:
    """``value``'s rank-0 constant, if it is one."""
    tensor = value.const_value if value is not None else None
    if tensor is None:
        return None
    try:
        array = tensor.numpy()
    except Exception:  # noqa: BLE001 - external data out of reach: not a constant to rewrite by
        return None
    return array if array.shape == () else None


def _zero_with_sign(negative: bool) -> Callable[..., bool]:
    """A rule's check: ``c`` is a rank-0 zero whose sign leaves ``x`` as it is (Note [Adding zero keeps the sign of
    zero]): -0.0 for an addition, +0.0 for a subtraction; any zero of an integer type."""

    def check(context: object, x: ir.Value, c: ir.Value, **_: object) -> bool:
        array = _scalar(c)
        if array is None or array.dtype.kind == "c" or array.item() != 0:
            return False
        return array.dtype.kind in "iub" or (math.copysign(1.0, float(array.item())) < 0) == negative

    return check


def _one(context: object, x: ir.Value, c: ir.Value, **_: object) -> bool:
    array = _scalar(c)
    return array is not None and array.dtype.kind != "c" and array.item() == 1


def _identity(op: object, x: ir.Value, **_: object) -> ir.Value:
    return op.Identity(x)


_NO_OP_RULES = (
    pattern.RewriteRule(lambda op, x, c: op.Mul(x, c), _identity, _one, name="ExactMulByOne"),
    pattern.RewriteRule(lambda op, x, c: op.Mul(c, x), _identity, _one, name="ExactOneMul"),
    pattern.RewriteRule(lambda op, x, c: op.Div(x, c), _identity, _one, name="ExactDivByOne"),
    pattern.RewriteRule(lambda op, x, c: op.Add(x, c), _identity, _zero_with_sign(True), name="ExactAddNegativeZero"),
    pattern.RewriteRule(lambda op, x, c: op.Add(c, x), _identity, _zero_with_sign(True), name="ExactNegativeZeroAdd"),
    pattern.RewriteRule(lambda op, x, c: op.Sub(x, c), _identity, _zero_with_sign(False), name="ExactSubZero"),
)

# The types whose every value float32 holds exactly (Note [Casts through float32 that round twice]).
_EXACT_IN_FLOAT32 = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.INT8,
                               ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.BOOL})


class _CastOnce(pattern.RewriteRuleClassBase):
    """``Cast(Cast(x, to=FLOAT), to=FLOAT16|BFLOAT16)`` as ``Cast(x, to=...)`` where the first cast is exact
    (Note [Casts through float32 that round twice]); onnxscript's CastCast otherwise."""

    def pattern(self, op: object, x: ir.Value, to: ir.Attr, to_ignored: ir.Attr) -> ir.Value:
        return op.Cast(op.Cast(x, to=to_ignored), to=to)

    def check(self, context: object, x: ir.Value, to: ir.Attr, to_ignored: ir.Attr) -> rewriter.MatchResult:
        result = rewriter.MatchResult()
        if to_ignored.as_int() != ir.DataType.FLOAT or to.as_int() not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            return result.fail("Not a cast to float16 or bfloat16 through float32.")
        if x.dtype not in _EXACT_IN_FLOAT32:
            return result.fail(f"Casting {x.dtype} to float32 rounds: the two casts round twice.")
        return result

    def rewrite(self, op: object, x: ir.Value, to: ir.Attr, to_ignored: ir.Attr) -> ir.Value:
        return op.Cast(x, to=to)


def _replaced_by_ortlab() -> frozenset[int]:
    """The ids of onnxscript's default rules that ortlab's own exact ones replace: its arithmetic no-op rules
    (Note [Adding zero keeps the sign of zero]) and CastCast (Note [Casts through float32 that round twice])."""
    replaced = {id(rule) for rule in rewriter._DEFAULT_REWRITE_RULES if getattr(rule, "name", None) == "CastCast"}
    try:
        from onnxscript.rewriter.rules.common import _no_op
    except ImportError:  # another onnxscript: its rules still run, matched exactly
        return frozenset(replaced)
    dropouts = {id(getattr(_no_op, name, None)) for name in ("dropout_zero_rule", "dropout_inference_rule")}
    return frozenset(replaced | ({id(rule) for rule in _no_op.rules} - dropouts))


@functools.lru_cache(maxsize=1)
def _exact_default_rules() -> tuple:
    """onnxscript's default rules as ortlab runs them: ortlab's exact no-op and cast rules in place of onnxscript's,
    every rule matched exactly (Notes [Pattern constants matched exactly], [Adding zero keeps the sign of zero] and
    [Casts through float32 that round twice])."""
    replaced = _replaced_by_ortlab()
    kept = [rule for rule in rewriter._DEFAULT_REWRITE_RULES if id(rule) not in replaced]
    return tuple(exact_rules([*_NO_OP_RULES, _CastOnce.rule(name="CastCast"), *kept]))


def _rules_without(names: Collection[str]) -> list:
    return [rule for rule in _exact_default_rules() if getattr(rule, "name", None) not in names]


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
    """``onnxscript.optimizer.optimize_ir(model)`` (its passes, in its order), its rewrite rules matched exactly (Note
    [Pattern constants matched exactly]), ortlab's exact no-op and cast rules in place of onnxscript's (Notes [Adding
    zero keeps the sign of zero], [Casts through float32 that round twice]), running only the rules that can fire
    (Note [Only the rewrite rules that can fire]) and none of those named in ``leave_out``."""
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
