"""The private onnxscript APIs ortlab uses, each with why (checked on onnxscript 0.5-0.7).

Note [onnxscript's optimizer without SlicesSplit]
``onnxscript.optimizer.optimize_ir`` runs a fixed list of rewrite rules. One of them,
``SlicesSplit`` (two Slices of one tensor -> one Split), has a pattern with two output
nodes, which onnxscript's matcher finds by trying every pair of Slice nodes in the graph:
quadratic. A ResNet-18 backward (1,200 Slices from the convolution gradients' patches, see
Note [Convolution gradients as GEMMs]) spent 12 s of its first step there, against 0.9 s
without the rule. ``optimize_without`` runs optimize_ir's own passes with the rules it is
told to leave out; onnxscript offers no public way to choose the rules.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding

__all__ = ["optimize_without"]


def _rules_without(names: Collection[str]) -> list:
    kept = []
    for rule in rewriter._DEFAULT_REWRITE_RULES:
        if getattr(rule, "name", None) in names:
            continue
        kept.append(rule)
    return kept


def optimize_without(model: ir.Model, names: Collection[str], num_iterations: int = 2) -> None:
    """``onnxscript.optimizer.optimize_ir(model)`` (its passes, in its order) without the rewrite rules ``names``."""
    fold = _constant_folding.FoldConstantsPass(
        shape_inference=True,
        input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        should_fold=lambda node: None,
    )
    passes = [
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                fold,
                rewriter.RewritePass(_rules_without(names)),
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
