"""Label sparsity: the LM head and its loss computed only for the labels that count.

ONNX Runtime training's "label sparsity" compute optimization, on Dynamo's graph.

Note [Label sparsity]
A language model's loss ignores the labels set to ``ignore_index`` (-100: padding, the
prompt in instruction tuning, masked-LM positions that were not masked), yet the LM head
(a ``d x vocab`` matmul, ~30% of a GPT-2-small step at vocab 50257) and its gradient are
computed for every row. When Dynamo's graph ends in

    logits = linear(h, W, b)              # only used by the loss
    loss = cross_entropy(logits[.float()].reshape(-1, V), t, ignore_index=i, reduction=mean|sum)

the graph is cut before the head: the captured graph returns ``h`` and ``t`` instead of
the loss, and each step selects the rows whose label counts and runs the head and the loss
on them alone:

    keep = (t.reshape(-1) != i).nonzero()
    loss = tail(h.reshape(-1, d)[keep], t[keep], W, b)   # cross_entropy(linear(...), ...)

The loss is the same sum over the same rows (``mean`` divides by the number of counted
labels either way), and autograd carries the gradient of the kept rows back into the
captured graph's backward (``index_select``'s backward scatters zeros elsewhere, which is
what the ignored rows' gradient is). The selection runs in PyTorch (its size is known only
at run time); the tail is compiled by ortlab like any graph (the pipeline's backend, the
same report), with a symbolic row count so that a new number of kept rows reuses it. It
must run in onnxruntime, not PyTorch: on our AMD EPYC, PyTorch's GEMM for 512 x 768 x 50257
took 0.95 s forward and backward where onnxruntime took 0.39 s, which ate the whole gain.
A data-dependent row count inside the main graph would need unbacked symbolic sizes
through AOTAutograd, the partitioner and the export; cutting the graph keeps both halves
ordinary graphs.

Hugging Face models return the logits beside the loss, and their loss (``ForCausalLMLoss``)
shifts the labels, pads them with -100 and, given ``num_items_in_batch`` (as the Trainer
gives it), divides a summed loss by it. Returned logits need the head on every row, so the
forward is not cut; what is cut is the rest: the head runs for the logits in a graph of its
own, the loss runs on the kept rows of those logits (detached), and ``_HeadRows`` gives the
head's gradient for the kept rows alone (2 of the head's 3 units of work, on the kept rows).
The returned logits keep their own gradient path through the head's graph, which autograd
runs only when the user's loss uses them. Steps that scale the loss (a division by a number or
by a tensor not computed from the logits) are redone after the tail. Logits returned as
``lm_head(h).contiguous()`` (OPT), with the loss computed from that copy, count as returned:
the head's graph gives them dense already. A bias per class added to the head's output (BART's
``lm_head(h) + final_logits_bias``) is folded into the head's bias: the head computes
``h @ W.T + (b + extra)`` where eager adds in two steps (the same values up to float rounding), and a
learned ``extra`` gets its gradient through that sum. An added value that differs by row, or that
changes the logits' dtype (float32 logits plus a float64 bias), keeps every row, with its reason.

Nothing is cut when the logits are used for anything else inside the graph: every row is
then needed. The capture's report says which applied and why (``CaptureRecord.sparsity``),
and counts the rows dropped.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from ortlab._compat.torch import LINEAR_TARGETS
from ortlab.provenance import module_path, source_line
from ortlab.report import SparsityRecord

__all__ = ["LabelSparsity", "SparsityRecord", "find_label_sparsity"]

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
# A head smaller than this (weights) is not cut, and not mentioned in the report: the row
# selection and one more graph cost more than its ignored rows (ResNet-18's 512x1000
# classifier ran 3% slower cut), and a classifier's logits are no place to look for savings.
MIN_HEAD_WEIGHTS = 1 << 20
# Methods between the head and the loss that act on each row alone (HF upcasts logits with .float()).
_ROW_METHODS = {"float", "contiguous", "to"}
# What may scale the loss between the cross-entropy and the output (``loss / num_items_in_batch``).
_SCALES = {operator.truediv, operator.mul, torch.div, torch.mul}


@dataclasses.dataclass
class LabelSparsity:
    """A graph cut before its LM head: ``graph`` returns what the tail needs instead of the loss.

    ``graph`` takes the same inputs as the original graph and returns its outputs without
    the loss, then ``h`` and the labels. ``finish(args, outputs)`` computes the loss on the
    kept rows and puts it back in its place.
    """

    graph: torch.fx.GraphModule
    record: SparsityRecord
    loss_positions: list[int]
    num_outputs: int
    weight: Callable[[Sequence[object]], torch.Tensor]
    bias: Callable[[Sequence[object]], torch.Tensor | None]
    casts: list[tuple[str, tuple, dict]]
    ignore_index: int
    reduction: str
    label_smoothing: float
    # Where the head's output (the logits) was among the graph's outputs: computed again, for every
    # row, by ``head()``; empty when the graph did not return them.
    logits_positions: list[int] = dataclasses.field(default_factory=list)
    # What the graph did to the loss after the cross-entropy (Hugging Face divides a summed loss by
    # ``num_items_in_batch``): ``(op, constant)`` or ``(op, None)`` for a value the cut graph returns last.
    post: list[tuple[Callable[[object, object], object], object]] = dataclasses.field(default_factory=list)
    # Where the head and the loss were in the user's code: the ``nn_module_stack`` and ``stack_trace`` of
    # the graph's head and cross-entropy nodes, which ``origin_of`` puts on the tails' nodes (Note [A tail
    # carries its head's provenance]).
    head_meta: dict[str, object] = dataclasses.field(default_factory=dict)
    loss_meta: dict[str, object] = dataclasses.field(default_factory=dict)

    def origin_of(self, node: torch.fx.Node) -> dict[str, object]:
        """The provenance meta a node of a tail graph takes: the head's for its linear, the loss's otherwise."""
        return self.head_meta if node.op == "call_function" and node.target in LINEAR_TARGETS else self.loss_meta

    def params(self, args: Sequence[object]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's weight and bias, read from the graph's inputs before a boxed call clears them."""
        return self.weight(args), self.bias(args)

    def tail(self) -> torch.nn.Module:
        """The LM head and loss on the kept rows, as a module to compile with a symbolic row count."""
        return _Tail(self.casts, self.ignore_index, self.reduction, self.label_smoothing)

    def head(self) -> torch.nn.Module:
        """The LM head on every row, for the logits the graph returned, as a module to compile."""
        return _Head()

    def rows_loss(self) -> torch.nn.Module:
        """The loss on the kept rows' logits (given, not computed), as a module to compile."""
        return _RowsLoss(self.casts, self.ignore_index, self.reduction, self.label_smoothing)

    def finish(self, outs: Sequence[object], weight: torch.Tensor, bias: torch.Tensor | None,
               tail: Callable[..., torch.Tensor] | None, head: Callable[..., torch.Tensor] | None = None,
               rows_loss: Callable[..., torch.Tensor] | None = None) -> tuple:
        """The original graph's outputs, from the cut graph's outputs, the head's parameters and
        ``tail`` (``self.tail()`` or its compiled form); when the graph returned the logits, ``head``
        and ``rows_loss`` (``self.head()``, ``self.rows_loss()`` or their compiled forms) instead."""
        scales = list(outs[len(outs) - sum(other is None for _, other in self.post):])
        *rest, h, labels = outs[:len(outs) - len(scales)]
        labels = labels.reshape(-1)
        keep = (labels != self.ignore_index).nonzero().squeeze(1)
        rows = h.reshape(-1, h.shape[-1]).index_select(0, keep)
        logits = None
        if self.logits_positions:
            assert head is not None and rows_loss is not None
            logits = head(h, weight, bias)
            kept = logits.detach().reshape(-1, logits.shape[-1]).index_select(0, keep)
            loss = rows_loss(_HeadRows.apply(rows, weight, bias, kept), labels.index_select(0, keep))
        else:
            assert tail is not None
            loss = tail(rows, labels.index_select(0, keep), weight, bias)
        for op, other in self.post:
            loss = op(loss, scales.pop(0) if other is None else other)
        self.record.count(labels.numel(), keep.numel())
        out, it = [], iter(rest)
        for i in range(self.num_outputs):
            out.append(loss if i in self.loss_positions else logits if i in self.logits_positions else next(it))
        return tuple(out)


class _HeadRows(torch.autograd.Function):
    """The kept rows' logits, already computed by the full head, with the head's gradient for them alone.

    Their values come from the logits the graph returned (detached), so the head is not run a
    second time on the kept rows; the backward is the linear layer's, on the kept rows only. The
    returned logits' own gradient, if the user's loss uses them, flows through the full head's graph.
    Two GEMMs in PyTorch: on our AMD EPYC they took 0.72 s where onnxruntime's CPU provider took
    0.84 s (512 kept rows, d=768, vocab 50257), and a graph of their own would add a capture.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        # In the logits' dtype, as autocast's linear computed them (bfloat16 logits from float32
        # rows and weight), each gradient then in its input's dtype, as autocast's casts give it back.
        d_rows = (grad @ weight.to(grad.dtype)).to(rows.dtype) if ctx.needs_input_grad[0] else None
        d_weight = (grad.t() @ rows.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        d_bias = grad.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return d_rows, d_weight, d_bias, None


class _Head(torch.nn.Module):
    def forward(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(h, weight, bias)


class _RowsLoss(torch.nn.Module):
    """``cross_entropy(logits[casts], labels)`` on the kept rows' logits."""

    def __init__(self, casts: list[tuple[str, tuple, dict]], ignore_index: int, reduction: str,
                 label_smoothing: float) -> None:
        super().__init__()
        self.casts, self.ignore_index = casts, ignore_index
        self.reduction, self.label_smoothing = reduction, label_smoothing

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for method, args, kwargs in self.casts:
            logits = getattr(logits, method)(*args, **kwargs)
        if (not self.label_smoothing and logits.dtype in (torch.float32, torch.float64)
                and not torch.is_autocast_enabled(logits.device.type)):
            return _CrossEntropy.apply(logits, labels, self.ignore_index, self.reduction)
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction=self.reduction,
                               label_smoothing=self.label_smoothing)


# Note [The vocabulary-wide loss gradient in three passes]
# AOTAutograd differentiates cross_entropy as log_softmax + nll_loss, and their decompositions
# give a backward of seven passes over the (rows x vocab) logits: zeros, a scatter of -1 at
# each label, a multiply by the row's weight, a row sum of that, exp, another multiply and a
# subtraction. At vocab 50257 that tensor is 206 MB for 1024 rows. The gradient is
# (softmax - onehot(label)) * w, w the row's weight (grad / counted labels for "mean", grad for
# "sum", 0 for an ignored label): exp of the saved log-probabilities, -1 added at each label
# (a scatter-add of one value per row, onto the exp's copy), and the multiply: three passes.
# The tail's backward at vocab 50257, 1024 rows, symbolic row count, standalone sessions in turns
# (``python benchmarks/loss_gradient.py``, 2-core Xeon): the CPU provider's kernels other than
# the head's two GEMMs 303-365 -> 107-118 ms, the whole run 1.82-2.00 -> 1.57-1.66 s in the
# second of two runs; OpenVINO 2.03-2.14 -> 1.85-1.90 s in the second, within the noise in the
# first (``benchmarks/results/xeon-avx512/loss_gradient.txt``). Written instead as
# ``(exp - (classes == label)) * w`` (a comparison with the class index, no scatter) it was
# 210-239 ms on the CPU provider. The same comparison
# in the dense graph's nll_loss_backward decomposition gained nothing on either provider and
# was not kept.
class _CrossEntropy(torch.autograd.Function):
    """``cross_entropy(logits, labels, ignore_index, reduction)`` ("mean" or "sum", no label
    smoothing or class weights), with its gradient in three passes (Note above)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,  # type: ignore[override]
                reduction: str) -> torch.Tensor:
        log_probs = logits.log_softmax(-1)
        ctx.save_for_backward(log_probs, labels)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return F.nll_loss(log_probs, labels, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        log_probs, labels = ctx.saved_tensors
        counted = labels != ctx.ignore_index
        if ctx.reduction == "mean":
            grad = grad / counted.sum().to(grad.dtype)
        weight = torch.where(counted, grad, torch.zeros_like(grad))
        target = torch.where(counted, labels, torch.zeros_like(labels)).unsqueeze(-1)
        minus_one = torch.full_like(target, -1, dtype=log_probs.dtype)
        # softmax - onehot: -1 added at each row's label (an ignored row's lands on class 0, times w = 0).
        return log_probs.exp().scatter_add(-1, target, minus_one) * weight.unsqueeze(-1), None, None, None


class _Tail(_RowsLoss):
    """``cross_entropy(linear(rows, W, b)[casts], labels)``: every row's label counts."""

    def forward(self, rows: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None) -> torch.Tensor:
        return super().forward(F.linear(rows, weight, bias), labels)


def _is_ce(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.cross_entropy


def _val(node: object) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def _input_getter(gm: torch.fx.GraphModule, node: object,
                  placeholders: list[torch.fx.Node]) -> Callable[[Sequence[object]], torch.Tensor | None] | None:
    if node is None:
        return lambda args: None
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "placeholder":
        i = placeholders.index(node)
        return lambda args: args[i]
    if node.op == "get_attr":
        owner, name = gm, str(node.target)
        return lambda args: _attr(owner, name)
    return None


def _attr(gm: torch.fx.GraphModule, dotted: str) -> torch.Tensor:
    obj: object = gm
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def find_label_sparsity(gm: torch.fx.GraphModule) -> LabelSparsity | SparsityRecord | None:
    """Cut ``gm`` before its LM head when its loss ignores labels (see Note [Label sparsity]).

    Returns the cut graph, or a ``SparsityRecord`` saying why a cross-entropy loss with
    ignored labels could not be cut, or None when the graph has no such loss.
    """
    losses = [n for n in gm.graph.nodes if _is_ce(n)]
    if not losses:
        return None
    if len(losses) > 1:
        return SparsityRecord(False, f"{len(losses)} cross-entropy losses in one graph (only one is cut)")
    ce = losses[0]
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    where = dict(module=module_path(ce), source=source_line(ce))

    def no(reason: str, at: torch.fx.Node = ce) -> SparsityRecord:
        return SparsityRecord(False, reason, module=module_path(at), source=source_line(at))

    if any(a[k] is not None for k in ("weight", "size_average", "reduce")):
        return no("the loss has class weights or legacy reduction arguments")
    if a["reduction"] not in ("mean", "sum"):
        return no(f"reduction={a['reduction']!r} returns one loss per row (only 'mean' and 'sum' are cut)")
    if any(isinstance(a[k], torch.fx.Node) for k in ("ignore_index", "reduction", "label_smoothing")):
        return no("ignore_index, reduction or label_smoothing is computed in the graph")
    target_val = _val(a["target"])
    if target_val is None or target_val.dtype.is_floating_point or target_val.dim() != 1:
        return no("the labels are not one class index per row")
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    # Steps from the loss to the output that scale it (Hugging Face's loss divides a summed loss
    # by num_items_in_batch), redone after the tail on values the cut graph returns.
    post: list[tuple[Callable[[object, object], object], object]] = []
    scales: list[torch.fx.Node] = []
    loss = ce
    while list(loss.users) != [out_node]:
        (step, *others) = loss.users
        if (others or step.op != "call_function" or step.target not in _SCALES or step.kwargs
                or len(step.args) != 2 or step.args[0] is not loss):
            return no("the loss is used inside the graph (only a loss returned as it is, or scaled, can be cut)",
                      step)
        other = step.args[1]
        if isinstance(other, torch.fx.Node):
            scales.append(other)
        elif not isinstance(other, (int, float)):
            return no("the loss is scaled by something other than a number or a tensor", step)
        post.append((step.target, None if isinstance(other, torch.fx.Node) else other))
        loss = step
    # Walk from the loss's input back to the head through row-wise steps.
    casts: list[tuple[str, tuple, dict]] = []
    chain: list[torch.fx.Node] = []
    node = a["input"]
    problem: tuple[str, torch.fx.Node] | None = None
    while isinstance(node, torch.fx.Node) and node.op == "call_method":
        if node.target in ("reshape", "view"):
            shape = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (tuple, list)) \
                else tuple(node.args[1])
            src = _val(node.args[0])
            if src is None or len(shape) != 2 or shape[-1] != src.shape[-1]:
                return no("the logits are reshaped in a way that mixes rows", node)
        elif node.target in _ROW_METHODS:
            casts.insert(0, (str(node.target), tuple(node.args[1:]), dict(node.kwargs)))
        else:
            return no(f"the logits pass through .{node.target}() before the loss", node)
        if len(node.users) != 1 and problem is None:
            problem = ("the logits are used elsewhere (every row is needed)", node)
        chain.append(node)
        node = node.args[0]
    # A per-class bias added after the head (BART's ``lm_head(h) + final_logits_bias``) is folded
    # into the head's bias: the logits are the head's with that bias.
    offset = _class_offset(gm, node)
    if isinstance(offset, str):
        return no(offset, node)
    if offset is not None:
        logits_node, node = node, offset.head
    if not _is_linear(node):
        return no("the loss's input is not a linear layer's output")
    head = node
    if offset is None:
        logits_node = head
    elif len(head.users) != 1:
        return no("the LM head's output is used elsewhere (every row is needed)", head)
    # The logits may be returned as ``lm_head(h).contiguous()`` (OPT): the same values as the
    # head's, which the head graph returns dense, so that node stands for the head's output.
    copies = [n for n in reversed(chain) if n.target == "contiguous" and not n.kwargs]
    if copies and copies[0].args[0] is logits_node:
        last = next(i for i, n in enumerate(copies) if i + 1 == len(copies) or copies[i + 1].args[0] is not n)
        returned_as = copies[last]
        if len(logits_node.users) == 1 and out_node in returned_as.users and len(returned_as.users) == 2 \
                and problem == ("the logits are used elsewhere (every row is needed)", returned_as) \
                and all(len(n.users) == 1 for n in copies[:last]):
            problem = None
        else:
            returned_as = logits_node
    else:
        returned_as = logits_node
    h, w = head.args[0], head.args[1]
    w_val = _val(w)
    if w_val is not None and w_val.numel() < MIN_HEAD_WEIGHTS:
        return None  # a classifier: its rows cost little (a line in every report would be noise)
    # The logits may also be returned (Hugging Face models return them): the head then runs on
    # every row for them, and only its gradient and the loss are cut to the kept rows.
    returned = out_node in returned_as.users
    if len(logits_node.users) != 1 + (out_node in logits_node.users) and problem is None:
        problem = ("the logits are used elsewhere in the graph (every row is needed)", logits_node)
    if problem is not None:
        return no(*problem)
    removed = {ce, head, *chain, *_post_nodes(ce, loss), *(offset.nodes if offset is not None else ())}
    if any(_depends_on(n, removed) for n in scales):
        return no("the loss is scaled by a value computed from the logits", loss)
    b = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    weight, bias = _input_getter(gm, w, placeholders), _input_getter(gm, b, placeholders)
    if weight is None or bias is None or not isinstance(h, torch.fx.Node):
        return no("the head's weight is computed in the graph", head)
    if offset is not None:
        added = _input_getter(gm, offset.source, placeholders)
        if added is None:
            return no("the bias added to the logits is computed in the graph", logits_node)
        bias = _with_offset(bias, added, offset.methods)
    h_val = _val(h)
    if h_val is None or h_val.dim() < 1 or w_val is None:
        return no("the head's input has no known shape", head)

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    (outputs,) = out_node.args
    flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for n in gm.graph.nodes:
        if n in removed or n is out_node:
            continue
        env[n] = graph.node_copy(n, lambda x: env[x])
    loss_positions = [i for i, o in enumerate(flat) if o is loss]
    logits_positions = [i for i, o in enumerate(flat) if o is returned_as]
    new_outputs = [env[o] if isinstance(o, torch.fx.Node) else o for o in flat
                   if o is not loss and o is not returned_as]
    new_outputs += [env[h], env[a["target"]], *(env[n] for n in scales)]
    graph.output(tuple(new_outputs))
    cut = torch.fx.GraphModule(gm, graph)
    if returned:
        reason = (f"the loss and the LM head's gradient run only on the rows whose label is not "
                  f"{a['ignore_index']} (the returned logits need the head on every row), in graphs of their own")
    else:
        reason = (f"the LM head and the loss run only on the rows whose label is not {a['ignore_index']}, "
                  "in a graph of their own with a symbolic row count")
    if offset is not None:
        reason += "; the per-class bias added to the head's output is folded into the head's bias"
    record = SparsityRecord(True, reason, module=module_path(head) or where["module"],
                            source=source_line(head) or where["source"])
    return LabelSparsity(cut, record, loss_positions, len(flat), weight, bias, casts, int(a["ignore_index"]),
                         str(a["reduction"]), float(a["label_smoothing"]), logits_positions, post,
                         _provenance_meta(head), _provenance_meta(ce))


# Note [A tail carries its head's provenance]
# The tails are graphs of ortlab's own modules (``_Tail``, ``_Head``, ``_RowsLoss``): Dynamo records
# their nodes as the root module's, at lines of this file, so the LM head's kernels were reported as
# "<root> sparsity.py:253 in forward" and compare_speed set 96 ms of them against nothing on the ortlab
# side and eager's 124 ms of ``lm_head`` against nothing on the other (a Phi-3 config, 2026-11-29).
# The backend compiling a tail puts the head node's ``nn_module_stack`` and ``stack_trace`` on the
# tail's linear and the cross-entropy node's on its other nodes, before anything reads them, so the
# report, the netron views, the timelines and compare_speed name the user's head module and lines.
_PROVENANCE_KEYS = ("nn_module_stack", "stack_trace")


def _provenance_meta(node: torch.fx.Node) -> dict[str, object]:
    return {k: node.meta[k] for k in _PROVENANCE_KEYS if node.meta.get(k)}


@dataclasses.dataclass
class _ClassOffset:
    """``logits = head(h) + source.methods(...)``: a bias per class added after the head."""

    head: torch.fx.Node
    source: torch.fx.Node
    methods: list[tuple[str, tuple, dict]]
    nodes: list[torch.fx.Node]  # the add and the methods on the source, removed with the head


def _is_linear(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in LINEAR_TARGETS


def _class_offset(gm: torch.fx.GraphModule, node: object) -> _ClassOffset | str | None:
    """``node`` as a linear layer's output plus one value per class (BART's ``final_logits_bias``,
    moved with ``.to(device)``); a string says why such an add cannot be folded into the head's
    bias; None when ``node`` is no such add."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target in (operator.add, torch.add) and len(node.args) == 2 and not node.kwargs):
        return None
    lin, other = node.args if _is_linear(node.args[0]) else reversed(node.args)
    if not _is_linear(lin):
        return None
    if not isinstance(other, torch.fx.Node):
        return "a number is added to the logits after the head"
    logits, head, added = _val(node), _val(lin), _val(other)
    if logits is None or head is None or added is None:
        return "the value added to the logits has no known shape"
    if added.shape[-1:] != head.shape[-1:] or any(d != 1 for d in added.shape[:-1]) or added.dim() > head.dim():
        return "the value added to the logits is not one number per class (it would differ by row)"
    if not (logits.dtype == head.dtype == added.dtype):
        return f"adding the bias after the head changes the logits' dtype ({head.dtype} + {added.dtype})"
    methods: list[tuple[str, tuple, dict]] = []
    nodes = [node]
    source = other
    while source.op == "call_method" and source.target == "to" and len(source.users) == 1:
        if any(isinstance(x, torch.fx.Node) for x in (*source.args[1:], *source.kwargs.values())):
            return "the bias added to the logits is moved by a value computed in the graph"
        methods.insert(0, ("to", tuple(source.args[1:]), dict(source.kwargs)))
        nodes.append(source)
        source = source.args[0]
    return _ClassOffset(lin, source, methods, nodes)


def _with_offset(bias: Callable[[Sequence[object]], torch.Tensor | None],
                 added: Callable[[Sequence[object]], torch.Tensor | None],
                 methods: list[tuple[str, tuple, dict]]) -> Callable[[Sequence[object]], torch.Tensor]:
    """The head's bias with the per-class value added after the head folded in."""

    def get(args: Sequence[object]) -> torch.Tensor:
        extra = added(args)
        for method, margs, kwargs in methods:
            extra = getattr(extra, method)(*margs, **kwargs)
        extra = extra.reshape(-1)
        b = bias(args)
        return extra if b is None else b + extra

    return get


def _post_nodes(ce: torch.fx.Node, loss: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from ``ce`` (excluded) to ``loss``: each has one user, the next."""
    nodes, node = [], ce
    while node is not loss:
        node = next(iter(node.users))
        nodes.append(node)
    return nodes


def _depends_on(node: torch.fx.Node, targets: set[torch.fx.Node]) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False
