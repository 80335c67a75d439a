"""Embedding sparsity: the row-wise layers of an encoder run on the tokens that are not padding.

ONNX Runtime training's "embedding sparsity" compute optimization (its ``PaddingElimination``
graph transformer), on Dynamo's graph.

Note [Embedding sparsity]
A batch of sentences of different lengths is padded to the longest with ``padding_idx``
tokens, yet every linear layer, norm and activation of a transformer runs on every row of
``(batch, seq)``: with 30% padding, 30% of the projections' and MLPs' work (97% of a
BERT-base layer's FLOPs at T=128) is spent on rows nobody reads. When Dynamo's graph looks
a token up in an embedding with a ``padding_idx``,

    e = embedding(ids, W, padding_idx=p)            # ids: a graph input, (B, S)

the graph is rewritten to run on the kept rows: ``keep = (ids.flatten() != p).nonzero()``
(computed in PyTorch before each call, its size is known only at run time) and

    e = embedding(ids, ...).flatten(0, 1)[keep]      # (N, d): packed
    y = f(x)                                         # f row-wise: runs on packed rows
    z = g(unpack(y))                                 # g mixes rows: padded rows come back as zeros

Row-wise means each row's result depends on that row alone: linear layers, layer norms over
trailing dims, elementwise ops (dropout included) and reductions over trailing dims. An
operand of such an op that varies by token but is not packed (the position embedding,
``(1, S, d)``; the attention's output, ``(B, S, d)``) is expanded to ``(B, S, ...)`` and packed
too, so a layer goes back to packed rows as soon as attention is done. Everything else
(attention's reshapes into heads, its products, a pooler's ``h[:, 0]``, the graph's outputs)
gets the padded layout back, zeros in the padded rows. Packing is an index with ``keep``
(its gradient an index_put, exact in onnxruntime: Note in ``ortlab.torchlib.translations``),
unpacking an index_put (its gradient an index). One row-wise op keeps every row: a linear
layer a cross-entropy reads (an LM head), so that label sparsity cuts it in the rewritten
graph as in any other (Note [Label sparsity]): a masked language model's encoder then runs
on the tokens that are not padding, and its head and loss on the labelled ones.

The contract, which the caller opts into (``Options.embedding_sparsity``, off by default):
the padded tokens do not change the result of the others (the attention mask masks them
out as keys, as a tokenizer's ``attention_mask`` does) and the graph's outputs are not read
in padded rows (they are zeros there; the report names those outputs). The loss and every
gradient are then those of eager, up to float rounding, while the padded rows' work is
skipped. A model that attends to its padded tokens breaks the contract: its results would
change. So every batch with padding is checked before it runs (``check_embedding_sparsity``):

(1) on the original graph, for every value of the parameters at once, no output may read a
    padded row that ``unpack`` sets to zero, other than through ops that ignore it (a masked
    softmax, a multiplication by the padding mask, a label that does not count, an index that
    skips it): Note [Proving the padded rows unread] in ``ortlab.capture.padding_reach``. It
    reads this batch's ids, attention mask and labels, which is why each padded batch is
    checked (a sentence padded at the token a classifier reads, a collator's mask that lets
    padding in). An earlier check compared values on the first padded batch (the outputs,
    and their gradient by the padded rows), which no check on values can make sound: a gate
    initialised to 0 in front of an unmasked mean passed it, and the losses drifted from
    eager's as soon as the gate moved;
(2) on the first padded batch, the rewritten graph and the original run in PyTorch on the
    same inputs, random ops (dropout) off, and every output must agree on the kept rows
    (scalar outputs such as the loss entirely) within float32 tolerance: a check of the
    rewrite itself (an op taken for row-wise that is not), which (1) takes for granted.

When either fails the rewrite is dropped for good, with a warning and the reason in the
report, and the graph runs on every row: eager's results. A batch without padding runs the
rewritten graph (every row kept: eager's results) and checks nothing.

With dropout on, the packed rows draw their masks from the random stream in another order
than eager's padded tensor, so losses match eager's in distribution, not bit for bit.

Dynamo's graph has the batch's sizes (concrete, or symbolic after a re-capture); the packed
row count ``N`` is symbolic. The rewritten
graph takes ``keep`` as one more input and is compiled by a backend like ortlab's own (the
same report), with ``N`` marked dynamic, so a new number of padded tokens reuses it.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Sequence

import torch
import torch.fx
import torch.nn.functional as F

from ortlab._compat.torch import GELU_TARGETS, LINEAR_TARGETS, SDPA_TARGETS, pytree
from ortlab.capture.padding_reach import PaddedRowsReach
from ortlab.provenance import module_path, source_line
from ortlab.report import PaddingRecord

__all__ = ["EmbeddingSparsity", "PaddingRecord", "check_embedding_sparsity", "embedding_sparsity_off",
           "find_embedding_sparsity", "pack", "pack_dense", "traced", "unpack"]


# ------------------------------------------------------------------ the ops the graph gets
def pack(x: torch.Tensor, keep: torch.Tensor, lead: int) -> torch.Tensor:
    """The kept rows of ``x``, its first ``lead`` dims flattened into one."""
    return x.flatten(0, lead - 1)[keep] if lead > 1 else x[keep]


def pack_dense(x: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor, ndim: int) -> torch.Tensor:
    """``x``, broadcast to ``ids.shape + trailing`` (a result of ``ndim`` dims), then packed."""
    x = x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape)) if x.dim() < ndim else x
    lead = ids.dim()
    return pack(x.expand(*ids.shape, *x.shape[lead:]), keep, lead)


def unpack(p: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Packed rows back in the padded layout ``ids.shape + trailing``, zeros in the padded rows."""
    dense = p.new_zeros((ids.numel(), *p.shape[1:]))
    return torch.index_put(dense, (keep,), p).unflatten(0, ids.shape)


# ------------------------------------------------------------------------ row-wise ops
_EMBEDDING = inspect.signature(F.embedding)
_LAYER_NORM = inspect.signature(F.layer_norm)
# Ops of one tensor whose result at a row depends on that row alone (extra arguments are not tensors).
_UNARY_FUNCTIONS = {
    *GELU_TARGETS, F.relu, torch.relu, F.silu,
    torch.tanh, torch.sigmoid, F.dropout, torch.exp, torch.rsqrt, torch.sqrt, torch.erf, operator.neg, torch.neg,
    F.softplus, F.mish, F.hardswish, F.leaky_relu, F.elu, torch.pow, torch.square, torch.abs,
}
_UNARY_METHODS = {"float", "half", "bfloat16", "to", "contiguous", "pow", "sqrt", "rsqrt", "exp", "tanh",
                  "sigmoid", "relu", "neg", "abs", "square", "clone", "detach"}
# Elementwise ops of two operands (broadcasting).
_BINARY_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                     torch.div}
_BINARY_METHODS = {"add", "sub", "mul", "div"}
# Reductions over trailing dims (``x.pow(2).mean(-1, keepdim=True)`` of an RMSNorm).
_REDUCTIONS = {"mean", "sum", "amax", "amin"}


def _val(node: object) -> torch.Tensor | None:
    v = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _embedding_args(node: torch.fx.Node) -> dict[str, object]:
    """``F.embedding``'s arguments of ``node`` by name (empty when they do not bind)."""
    try:
        return dict(_EMBEDDING.bind(*node.args, **node.kwargs).arguments)
    except TypeError:
        return {}


def _padding_embedding(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """``(ids, padding_idx)`` of an ``F.embedding`` node with a padding index, else None."""
    if node.op != "call_function" or node.target is not F.embedding:
        return None
    bound = _embedding_args(node)
    p, ids = bound.get("padding_idx"), bound.get("input")
    if not isinstance(p, int) or not isinstance(ids, torch.fx.Node):
        return None
    return ids, p


@dataclasses.dataclass
class EmbeddingSparsity:
    """A graph rewritten to run its row-wise ops on the tokens that are not padding.

    ``graph`` takes the original graph's inputs and then ``keep``; ``ids_position`` is where
    the token ids are among the inputs, ``padding_idx`` the token that is dropped.
    """

    graph: torch.fx.GraphModule
    record: PaddingRecord
    ids_position: int
    padding_idx: int
    # The proof, on the original graph, that no output reads a padded row (run on each padded batch).
    reach: PaddedRowsReach | None = None
    compared: bool = False  # the first padded batch compared both graphs' values (a check of the rewrite)

    def keep(self, args: Sequence[object]) -> torch.Tensor:
        """The flat indices of the tokens that are not padding, for one call's inputs."""
        ids = args[self.ids_position]
        assert isinstance(ids, torch.Tensor)
        keep = (ids.reshape(-1) != self.padding_idx).nonzero().squeeze(1)
        if keep.numel() < 2 <= ids.numel():
            # Dynamo specializes sizes 0 and 1 (a graph of its own for each); padded rows computed
            # like tokens change nothing (the same contract), so two rows at least are kept.
            keep = torch.cat([keep, torch.arange(2, device=keep.device)]).unique()
        return keep


def traced(graph: torch.fx.GraphModule) -> torch.nn.Module:
    """``graph`` in a module Dynamo traces whole: it does not trace into a ``GraphModule``'s own call,
    so ``torch.compile(graph)`` would run it eagerly and compile each function it calls alone.

    Dynamo hands its backend a lazily compiled ``GraphModule`` whose ``forward`` generates its code on
    the first call, a function Dynamo refuses to trace (a graph break, then the frame ran in PyTorch
    with a ``FallbackWarning``, when the original graph was compiled after the rewritten one had run).
    A copy as a plain ``GraphModule`` has its code from the start.
    """
    if type(graph) is not torch.fx.GraphModule:
        plain = torch.fx.Graph()
        plain.output(plain.graph_copy(graph.graph, {}))
        graph = torch.fx.GraphModule(graph, plain)
    return _Traced(graph)


class _Traced(torch.nn.Module):
    def __init__(self, graph: torch.fx.GraphModule) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, *args: object) -> object:
        return self.graph.forward(*args)


def embedding_sparsity_off(gm: torch.fx.GraphModule) -> PaddingRecord | None:
    """The report's line for a graph embedding sparsity could serve while it is off (None if none)."""
    for node in gm.graph.nodes:
        found = _padding_embedding(node)
        if found is not None and found[0].op == "placeholder":
            return PaddingRecord(False, f"off (embedding_sparsity=False); on, the row-wise layers would run only on "
                                        f"the tokens that are not padding_idx {found[1]}",
                                 module=module_path(node), source=source_line(node))
    return None


def find_embedding_sparsity(gm: torch.fx.GraphModule) -> EmbeddingSparsity | PaddingRecord | None:
    """Rewrite ``gm`` to skip padded tokens (see Note [Embedding sparsity]).

    Returns the rewritten graph, a ``PaddingRecord`` saying why an embedding with a
    ``padding_idx`` could not be used, or None when the graph has no such embedding.
    """
    seeds = [(n, *found) for n in gm.graph.nodes if (found := _padding_embedding(n)) is not None]
    if not seeds:
        return None
    emb, ids, padding_idx = seeds[0]
    where = dict(module=module_path(emb), source=source_line(emb))
    if ids.op != "placeholder":
        return PaddingRecord(False, "the token ids are computed in the graph (only ids given to it are used)", **where)
    ids_val = _val(ids)
    if ids_val is None or ids_val.dim() < 1:
        return PaddingRecord(False, "the token ids' sizes are unknown", **where)
    weight = _embedding_args(emb)["weight"]
    for other in gm.graph.find_nodes(op="call_function", target=F.embedding):
        if other is not emb and (a := _embedding_args(other)).get("weight") is weight and a.get("input") is not ids:
            # Tensors are matched to the tokens by their leading sizes: a decoder of as many tokens
            # would have its rows dropped by the encoder's padding.
            return PaddingRecord(False, "the embedding also looks up a second token sequence (an encoder-decoder's "
                                        "decoder), whose rows the first one's padding does not describe", **where)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    ids_position = placeholders.index(ids)

    # Work on a copy: the original graph is what runs when the rewrite is dropped.
    graph = torch.fx.Graph()
    node_of: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, node_of))
    new = torch.fx.GraphModule(gm, graph)
    graph = new.graph
    ids = node_of[ids]
    seeds_new = {node_of[s] for s, i, p in seeds if i is seeds[0][1] and p == padding_idx}
    lead = ids_val.dim()
    lead_shape = tuple(ids_val.shape)
    original = {copy: orig for orig, copy in node_of.items()}
    with graph.inserting_after(node_of[placeholders[-1]]):
        keep = graph.placeholder("padding_keep")

    heads = _lm_heads(graph)
    packed: dict[torch.fx.Node, torch.fx.Node] = {}  # original node -> its packed value
    unpacked: dict[torch.fx.Node, torch.fx.Node] = {}
    packed_ops = 0

    def token_shaped(n: object) -> bool:
        v = _val(n)
        return v is not None and v.dim() > lead and all(_same_size(a, b) for a, b in zip(v.shape, lead_shape))

    def unpack_of(n: torch.fx.Node) -> torch.fx.Node:
        if n not in unpacked:
            with graph.inserting_after(packed[n]):
                u = graph.call_function(unpack, (packed[n], keep, ids))
            u.meta.update(n.meta)
            unpacked[n] = u
        return unpacked[n]

    def pack_operand(a: object, at: torch.fx.Node, ndim: int) -> object:
        """``a`` as an operand of a packed op at ``at`` (packed, row-uniform, or packed now)."""
        if isinstance(a, torch.fx.Node) and a in packed:
            return packed[a]
        v = _val(a)
        if v is None or v.dim() <= ndim - lead:  # a number, or broadcast over trailing dims only
            return a
        with graph.inserting_before(at):
            return graph.call_function(pack_dense, (a, keep, ids, ndim))

    for node in list(graph.nodes):
        if node.op == "output":
            continue
        if node in seeds_new:
            with graph.inserting_after(node):
                p = graph.call_function(pack, (node, keep, lead))
            packed[node] = p
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        out = _val(node)
        args_nodes = [a for a in node.all_input_nodes if a is not keep]
        any_packed = any(a in packed for a in args_nodes)
        rowwise = out is not None and token_shaped(node) and _rowwise(node, lead, out.dim()) and node not in heads
        # A linear layer or norm of a token-shaped input goes back to packed rows (after attention).
        enters = rowwise and not any_packed and (node.target in LINEAR_TARGETS or node.target is F.layer_norm) \
            and packed and token_shaped(node.args[0])
        if rowwise and (any_packed or enters):
            ndim = out.dim()
            with graph.inserting_after(node):
                if node.op == "call_function" and node.target not in _BINARY_FUNCTIONS:
                    # A linear layer's or norm's input: its weights are the same for every row.
                    p = graph.call_function(node.target, (pack_operand(node.args[0], node, ndim), *node.args[1:]),
                                            dict(node.kwargs))
                elif node.op == "call_function":
                    new_args = tuple(pack_operand(a, node, ndim) if isinstance(a, torch.fx.Node) else a
                                     for a in node.args)
                    p = graph.call_function(node.target, new_args, dict(node.kwargs))
                else:
                    self_ = pack_operand(node.args[0], node, ndim)
                    rest = tuple(pack_operand(a, node, ndim) if isinstance(a, torch.fx.Node) else a
                                 for a in node.args[1:])
                    p = graph.call_method(node.target, (self_, *rest), dict(node.kwargs))
            p.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
            packed[node] = p
            packed_ops += 1
            continue
        # Not row-wise: every packed input goes back to the padded layout.
        for a in args_nodes:
            if a in packed:
                node.replace_input_with(a, unpack_of(a))
    out_node = next(iter(graph.find_nodes(op="output")))
    zeroed = [i for i, o in enumerate(pytree.tree_leaves(out_node.args[0])) if o in packed]
    for a in list(out_node.all_input_nodes):
        if a in packed:
            out_node.replace_input_with(a, unpack_of(a))
    # The dense originals that their packed forms replaced (not a general dead-code pass: the
    # graph may update buffers in place with results nobody reads).
    for node in reversed(list(graph.nodes)):
        if node in packed and node not in seeds_new and not node.users:
            graph.erase_node(node)
    if packed_ops == 0:
        return PaddingRecord(False, "no row-wise op follows the embedding", **where)
    new.recompile()
    reason = f"padding_idx {padding_idx} of the graph input {ids.target} {tuple(lead_shape)}"
    if zeroed:
        reason += (f"; output{'s' if len(zeroed) > 1 else ''} {', '.join(map(str, zeroed))} laid out by token "
                   f"{'hold' if len(zeroed) > 1 else 'holds'} zeros in the padded rows (eager's values there are "
                   "not computed)")
    record = PaddingRecord(True, reason, packed_ops=packed_ops, unpacks=len(unpacked), **where)
    reach = PaddedRowsReach(gm, {original[n].name for n in packed if n in original}, ids_position)
    return EmbeddingSparsity(new, record, ids_position, padding_idx, reach)


def _lm_heads(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Linear layers whose output a cross-entropy loss reads (through reshapes and casts).

    They keep every row: label sparsity (Note [Label sparsity]) then runs the head on the rows
    whose label counts, which leaves out the padded ones too when they are labelled -100 (a
    masked language model's), and keeps the loss as eager's whatever the padded rows' labels.
    """
    heads = set()
    for ce in graph.nodes:
        if ce.op != "call_function" or ce.target is not F.cross_entropy or not ce.args:
            continue
        node = ce.args[0]
        while isinstance(node, torch.fx.Node) and node.op == "call_method" and \
                node.target in ("view", "reshape", "float", "to", "contiguous"):
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.target in LINEAR_TARGETS:
            heads.add(node)
    return heads


def _same_size(a: int | torch.SymInt, b: int | torch.SymInt) -> bool:
    """Sizes known equal at trace time: equal ints, or the same symbolic expression (comparing
    them with ``==`` would add a guard to Dynamo's shape environment)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def _rowwise(node: torch.fx.Node, lead: int, ndim: int) -> bool:
    """Whether ``node``'s result at a token depends on that token's row alone."""
    t = node.target
    if node.op == "call_function":
        if t in LINEAR_TARGETS:
            return True
        if t is F.layer_norm:
            try:
                shape = _LAYER_NORM.bind(*node.args, **node.kwargs).arguments["normalized_shape"]
            except TypeError:
                return False
            return isinstance(shape, (tuple, list, torch.Size)) and len(shape) <= ndim - lead
        if t in _UNARY_FUNCTIONS:
            return all(not isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values()))
        if t in _BINARY_FUNCTIONS:
            return len(node.args) == 2 and all(_broadcasts(a, node, lead) for a in node.args)
        return False
    if t in _UNARY_METHODS:
        return all(not isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values()))
    if t in _BINARY_METHODS:
        return len(node.args) == 2 and not node.kwargs and all(_broadcasts(a, node, lead) for a in node.args)
    if t in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = (dims,) if isinstance(dims, int) else dims
        keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        src = _val(node.args[0])
        return (isinstance(dims, (tuple, list)) and bool(dims) and src is not None
                and all(isinstance(d, int) and -src.dim() + lead <= d < 0 for d in dims) and bool(keepdim)
                and ndim == src.dim())
    return False


def _broadcasts(a: object, node: torch.fx.Node, lead: int) -> bool:
    """An operand that does not change the result's token dims by broadcasting into them."""
    v = _val(a)
    out = _val(node)
    if v is None or out is None:
        return not isinstance(a, torch.fx.Node)
    return v.dim() <= out.dim()



# ------------------------------------------------------------------------- the check
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}
# The project's parity tolerance (float32 outputs against eager).
_RTOL, _ATOL = 1e-4, 1e-5


def _without_dropout(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose dropouts pass their input through (packed rows draw other masks)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPOUTS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in SDPA_TARGETS:
            if len(node.args) > 4:
                node.args = (*node.args[:4], 0.0, *node.args[5:])
            else:
                node.kwargs = {**node.kwargs, "dropout_p": 0.0}
    return torch.fx.GraphModule(gm, graph)


def check_embedding_sparsity(gm: torch.fx.GraphModule, found: EmbeddingSparsity, args: Sequence[object],
                             keep: torch.Tensor) -> str | None:
    """Whether skipping the padded rows could change ``gm``'s results on ``args`` (see Note [Embedding
    sparsity]); called on every batch with padding, before the rewritten graph runs it.

    Two questions:

    - can a padded row reach an output, for any value of the parameters? Decided on the graph,
      with this batch's ids, attention mask and labels (Note [Proving the padded rows unread]
      in ``ortlab.capture.padding_reach``). This is what makes skipping them sound;
    - on the first padded batch only: do the rewritten graph and the original agree on the
      kept rows, run in PyTorch (dropout off, from the same random state, on copies of the
      inputs that are not parameters: a BatchNorm updates its buffers in place)? A check of
      the rewrite itself (an op taken for row-wise that is not would show here), not of the
      padded rows' influence, which values on one batch cannot show.

    Returns the first problem, in words, or None.
    """
    assert found.reach is not None
    problem = found.reach.check(args, keep)
    if problem is not None:
        return problem
    weakest = found.reach.weakest_mask
    if weakest is not None:  # what the proof assumes, in the report (Note [Proving the padded rows unread])
        base = found.record.reason.split("; mask values down to")[0]
        found.record.reason = (f"{base}; mask values down to {weakest:g} taken as masking (a masked score's weight "
                               f"is exactly 0 while no score exceeds another by {abs(weakest) - 104:g}, as eager's "
                               "masking assumes)")
    if found.compared:
        return None
    found.compared = True
    return _compare(gm, found, args, keep)


def _compare(gm: torch.fx.GraphModule, found: EmbeddingSparsity, args: Sequence[object],
             keep: torch.Tensor) -> str | None:
    """Whether the rewritten graph gives the original's outputs on the kept rows, on ``args``."""
    ids = args[found.ids_position]
    assert isinstance(ids, torch.Tensor)
    lead = ids.dim()

    def copies() -> list[object]:
        return [a.detach().clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) else a
                for a in args]

    def kept(t: torch.Tensor) -> torch.Tensor:
        return pack(t, keep, lead) if t.dim() >= lead and tuple(t.shape[:lead]) == tuple(ids.shape) else t

    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        rng = torch.get_rng_state()
        ref = _without_dropout(gm)(*copies())
        torch.set_rng_state(rng)
        got = _without_dropout(found.graph)(*copies(), keep)
    for i, (r, g) in enumerate(zip(pytree.tree_leaves(ref), pytree.tree_leaves(got))):
        if not isinstance(r, torch.Tensor):
            continue
        r, g = kept(r), kept(g)
        if r.is_floating_point() or r.is_complex():
            if not torch.allclose(g, r, rtol=_RTOL, atol=_ATOL, equal_nan=True):
                diff = (g - r).abs().max().item()
                return (f"output {i} changed by up to {diff:.3g} on the tokens that are not padding, where the "
                        "padded tokens were proven not to reach it: the rewrite computed something else (please "
                        "report)")
        elif not torch.equal(g, r):
            return f"output {i} (integers) changed on the tokens that are not padding (please report)"
    return None
