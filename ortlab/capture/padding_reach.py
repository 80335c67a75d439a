"""Whether a graph's padded rows can reach its results: the proof embedding sparsity rests on.

Note [Proving the padded rows unread]
Embedding sparsity (Note [Embedding sparsity] in ``ortlab.capture.padding``) computes the
row-wise ops on the kept rows only; wherever rows go back to the padded layout (``unpack``),
the padded rows hold zeros where eager holds what its row-wise ops computed from the
padding token. The rewritten graph G gives eager's (F's) results exactly when no output
reads those rows, other than through ops that ignore them. A check on values cannot show
that: a gate initialised to 0 (``h[:, 0] + gate * h.mean(1)``) hides an unmasked mean on
the first batch, and its gradient, then the losses, drift once the gate moves. So the
check is on the graph, for every parameter value at once.

Every value of F's graph gets five boolean masks, each broadcastable to its shape, and a sign:

    t     G's value may differ from F's here
    n     may be nonzero (or non-finite) here, in F or in G
    nf    tainted (t) and possibly non-finite in G (a division by a padded row's zero)
    dead  at most -1e4 in both (a masked-out attention score), whatever the parameters
    big   may hold a large value taken from the inputs (|x| >= 1e3), so adding it to a
          dead score may bring it back
    sign  ">0" or ">=0" everywhere, in both (``x.pow(2).mean(-1) + eps``: its rsqrt is finite
          even where G has zeros)

Parameters, and anything that requires grad, are unknowns: ``t`` false, ``n`` true. Values
computed from the other inputs alone (token ids, the attention mask, labels, positions:
"data") are computed, on the batch at hand, and give their masks exactly; they are the
same in F and G and, needing no gradient, fix no parameter's gradient either. A row-wise
op that G runs on the kept rows (``packed``) gets ``t |= pad & n``: G has zeros in its
padded rows, F its own values. Each op maps its inputs' masks to its output's by a rule
that holds for every value of the unknowns: ``a * b`` is untainted where ``b`` is 0 in
both (``h * mask``: a masked mean); a softmax gives exactly 0, untainted, at its dead
positions as long as its row has a live one, and the row's taint is that of its live
positions (an attention mask of -inf, False or finfo.min over the padded keys); a
product contracts the masks (``p @ v`` is clean where ``p`` is 0 at the padded keys);
cross-entropy reads only the rows whose label counts; reshapes, transposes, slices,
indexing with data indices, concatenations and pooling route the masks as they route
values. An op without a rule (a custom autograd function, a higher-order op such as
activation checkpointing) taints all of its output when any input is tainted, and only
then; so does a rule whose masks do not fit its value's shape. An in-place update seen by
a later op or by the caller taints the whole of what it writes to when it writes tainted
values, and fails the check when that is an input (a buffer).

The check passes when every output is untainted, except in the padded rows of outputs
laid out by token (G returns zeros there, the documented contract, named in the report).
F and G then agree on those outputs as functions of the parameters, on a neighbourhood of
every value: so do their gradients, for any loss of them. A failure names the first op
whose taint leaves the padded tokens' own positions (``h.mean(1)``, an attention without a
mask, a cross-entropy counting labels on padded tokens, ``h[:, 0]`` on a padded token).

Each padded batch is checked: the masks depend on its ids, attention mask and labels.
About one bool op per graph op, the attention's ``[B, 1, L, S]`` masks the largest; every
layer attends with the same mask, so the first layer's answer serves the others (a memo
on the inputs' masks). Products of masks past 2**22 multiply-adds (the scores' ``q @ k.T``)
take ``any_k(a) & any_k(b)``, more taint, never less, exact where either is constant along
``k``. A BERT-base graph (12 layers, 544 nodes, batch 8 x 128): 37 ms on one thread of this
2-core machine; 200 ms on two threads while other jobs held the cores (bool ops of 131k
elements waiting for OpenMP's threads), against an eager step of 18 s under the same load.

What the proof assumes, and does not show:

* parameters' values are finite, and so are eager's values in the padded rows (an
  overflow there makes eager's loss NaN through ``0 * inf``, not ortlab's);
* a score of at most -1e4 gets exactly 0 weight: true for -inf, boolean masks and
  finfo.min (Hugging Face's) whatever the finite scores, and for a finite mask ``M``
  (-10000, Funnel's -1e6) while no score exceeds another by ``|M| - 104`` (float32's exp
  is 0 below -104), which eager's own masking assumes too (the report says when such a
  mask was used, and its value);
* random ops (dropout) draw other values in G (the contract says so: equal in
  distribution);
* the rewrite itself: that the ops it runs on the kept rows are row-wise. The first padded
  batch compares both graphs' values for that (``check_embedding_sparsity``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from ortlab._compat.torch import pytree
from ortlab.capture._reach_masks import _AV, FALSE, TRUE, _fits, _leaves, _squash, _tainted, _Unknown
from ortlab.capture._reach_rules import _RANDOM, _VIEWS, _op, _Rules
from ortlab.provenance import module_path, source_line

__all__ = ["PaddedRowsReach"]


def _static_meta(node: torch.fx.Node) -> object:
    """The node's value on the meta device when Dynamo's example has concrete sizes (else None)."""

    def one(v: object) -> object:
        if isinstance(v, torch.Tensor):
            if all(isinstance(d, int) for d in v.shape):
                return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            return None
        if isinstance(v, (tuple, list)):
            items = [one(x) for x in v]
            return None if any(i is None and isinstance(x, torch.Tensor) for i, x in zip(items, v)) else tuple(items)
        return None

    return one(node.meta.get("example_value"))


def _describe(node: torch.fx.Node) -> str:
    op = f".{node.target}()" if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    op = "scaled_dot_product_attention" if _op(node)[0] == "sdpa" else op
    where = ", ".join(w for w in (module_path(node), source_line(node)) if w)
    return f"{op} ({where})" if where else op


class PaddedRowsReach(_Rules):
    """Whether the padded rows of ``gm``'s row-wise ops named in ``packed`` reach its outputs
    (Note [Proving the padded rows unread]). Built once per graph; ``check`` per padded batch.
    """

    def __init__(self, gm: torch.fx.GraphModule, packed: set[str], ids_position: int) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.packed = packed
        self.ids_position = ids_position
        self.static = {n: _static_meta(n) for n in self.nodes if n.op not in ("output", "placeholder", "get_attr")}
        self.aliases = {n: self._aliases(n) for n in self.nodes if n.op.startswith("call") and _op(n)[1]}
        # The weakest finite mask value taken as masking (-10000; None: only -inf, False, finfo.min).
        self.weakest_mask: float | None = None

    # ------------------------------------------------------------------ in-place updates
    def _aliases(self, node: torch.fx.Node) -> tuple[bool, list[torch.fx.Node]]:
        """``(visible, group)`` for an in-place op: the nodes sharing its target's storage (through
        view-like ops), and whether the update is seen by a later op or by the caller."""
        target = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if target is None:
            return True, []
        root = target
        while root.op.startswith("call") and _op(root)[0] in _VIEWS and root.args and \
                isinstance(root.args[0], torch.fx.Node):
            root = root.args[0]
        group, todo = [], [root]
        while todo:
            n = todo.pop()
            if n in group:
                continue
            group.append(n)
            todo += [u for u in n.users if u.op.startswith("call") and _op(u)[0] in _VIEWS and u.args
                     and u.args[0] is n]
        at = self.order[node]
        visible = any(n.op in ("placeholder", "get_attr") for n in group) or any(
            self.order[u] > at for n in group for u in n.users if u is not node)
        return visible, group

    # ------------------------------------------------------------------ the walk
    def check(self, args: Sequence[object], keep: torch.Tensor) -> str | None:
        """Whether an output of the graph reads a padded row on this batch (None: none does, for
        every value of the parameters). ``keep``: the flat indices of the rows computed."""
        ids = args[self.ids_position]
        assert isinstance(ids, torch.Tensor)
        pad = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
        pad[keep] = False
        if not bool(pad.any()):
            return None
        self.pad, self.ids_shape, self.device = pad.reshape(ids.shape), tuple(ids.shape), ids.device
        self.problems: list[tuple[str, torch.fx.Node | None]] = []
        self.memo: list[tuple[tuple, list[torch.Tensor], _AV]] = []  # attention's answers on this batch
        env: dict[torch.fx.Node, object] = {}
        placeholders = iter(args)
        clone = bool(self.aliases)  # an in-place op on the inputs runs on copies
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = self._input(next(placeholders), clone)
            elif node.op == "get_attr":
                obj: object = self.gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                env[node] = self._input(obj, clone)
            elif node.op == "output":
                return self._outputs(node, env)
            else:
                env[node] = self._call(node, env)
        return None

    def _input(self, a: object, clone: bool) -> object:
        if isinstance(a, torch.Tensor):
            if isinstance(a, torch.nn.Parameter) or a.requires_grad:
                return _AV(torch.empty(tuple(a.shape), dtype=a.dtype, device="meta"))
            return a.detach().clone() if clone else a
        return a

    def _padb(self, ndim: int) -> torch.Tensor:
        lead = len(self.ids_shape)
        return self.pad.reshape(self.ids_shape + (1,) * (ndim - lead))

    def _call(self, node: torch.fx.Node, env: dict[torch.fx.Node, object]) -> object:
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        name, inplace = _op(node)
        abstract = [x for x in _leaves((args, kwargs)) if isinstance(x, _AV)]
        if not abstract and name not in _RANDOM:
            try:
                return self._run(node, args, kwargs)  # data: computed, on this batch
            except Exception:  # noqa: BLE001 - an op that does not run here counts as one without a rule
                pass
        try:
            out = self._rule(node, name, args, kwargs)
            if not all(_fits(x) for x in _leaves(out) if isinstance(x, _AV)):
                raise _Unknown  # a rule whose masks do not broadcast to the value: not trusted
        except Exception:  # noqa: BLE001 - _Unknown, or a rule that does not fit this call
            out = self._generic(node, args, kwargs)
        if isinstance(out, _AV) and node.name in self.packed:
            if out.meta is None:
                out = dataclasses.replace(out, t=TRUE)
            else:
                # G's padded rows: zeros, once unpacked (finite, never a masked score); F's: its own.
                padb = self._padb(out.meta.dim())
                out = dataclasses.replace(out, t=out.t | (padb & out.n), nf=out.nf & ~padb, dead=out.dead & ~padb)
        if isinstance(out, _AV):
            out.t, out.nf, out.dead = _squash(out.t), _squash(out.nf), _squash(out.dead)
        if inplace:
            self._update(node, name, args, out, env)
        return out

    def _generic(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> object:
        """An op without a rule: all of its output is tainted when an input is, else none."""
        meta = self._meta(node, args, kwargs)
        avs = [x for x in _leaves((args, kwargs)) if isinstance(x, _AV)]
        if not isinstance(meta, torch.Tensor) and meta is not None and not isinstance(meta, (tuple, list)):
            return meta  # a size, a dtype: from shapes alone
        tainted = any(_tainted(x) for x in avs)
        big = TRUE if any(bool(x.big.any()) for x in avs) else FALSE
        one = (lambda m: _AV(m, t=TRUE, nf=TRUE, big=big)) if tainted else (lambda m: _AV(m, big=big))
        if isinstance(meta, (tuple, list)):
            return tuple(one(m) if isinstance(m, torch.Tensor) or m is None else m for m in meta)
        return one(meta)

    def _outputs(self, node: torch.fx.Node, env: dict) -> str | None:
        flat = pytree.tree_leaves(node.args[0])
        for i, leaf in enumerate(flat):
            if not isinstance(leaf, torch.fx.Node):
                continue
            for val in _leaves(env[leaf]):
                if not isinstance(val, _AV) or not _tainted(val):
                    continue
                t = val.t
                token = val.meta is not None and tuple(val.meta.shape[:len(self.ids_shape)]) == self.ids_shape
                if token:
                    t = t & ~self._padb(val.meta.dim())  # zeros there: the contract
                if bool(t.any()):
                    return self._explain(i, leaf, env, token)
        for what, at in self.problems:
            return f"{_describe(at)} {what}" if at is not None else what
        return None

    def _escaped(self, av: _AV) -> bool:
        """Whether ``av``'s taint reaches beyond the padded tokens' own positions (a padded query's row of
        attention stays on them; a mean over every token does not)."""
        if not _tainted(av):
            return False
        if av.meta is None:
            return True
        shape = tuple(av.meta.shape)
        nd, lead = len(shape), len(self.ids_shape)
        allowed = FALSE
        flat = self.pad.reshape(-1)
        for ax in range(nd):
            if shape[ax] == flat.numel():
                allowed = allowed | flat.reshape((-1,) + (1,) * (nd - ax - 1))
        if lead == 2 and nd and shape[0] == self.ids_shape[0]:
            for ax in range(1, nd):
                if shape[ax] == self.ids_shape[1]:
                    allowed = allowed | self.pad.reshape((self.ids_shape[0],) + (1,) * (ax - 1) +
                                                         (self.ids_shape[1],) + (1,) * (nd - ax - 1))
        elif lead == 1:
            for ax in range(nd):
                if shape[ax] == self.ids_shape[0]:
                    allowed = allowed | self.pad.reshape((-1,) + (1,) * (nd - ax - 1))
        return bool((av.t & ~allowed).any())

    def _explain(self, i: int, leaf: torch.fx.Node, env: dict, token: bool) -> str:
        """The problem, naming the first op that carries the padded rows into the others."""
        ancestors, todo = set(), [leaf]
        while todo:
            n = todo.pop()
            if n not in ancestors:
                ancestors.add(n)
                todo += n.all_input_nodes
        def escaped(n: torch.fx.Node) -> bool:  # a tuple's (``max(1)``'s values and indices) too
            return any(self._escaped(x) for x in _leaves(env.get(n)) if isinstance(x, _AV))

        blame = leaf
        for n in self.nodes:
            if n in ancestors and escaped(n) and not any(escaped(m) for m in n.all_input_nodes):
                blame = n
                break
        name = _op(blame)[0]
        why = {"sdpa": ", which does not mask them out as keys (is an attention mask masking them out?)",
               "softmax": ", which does not mask them out (is an attention mask masking them out?)",
               "cross_entropy": ", which counts labels on padded tokens",
               "getitem": ", which reads padded positions"}.get(name, ", which mixes them into the others' results")
        where = " on the tokens that are not padding" if token else ""
        return (f"output {i}{where} depends on the padded tokens through {_describe(blame)}{why}, whatever the "
                f"parameters' values: the padded tokens change the others' results")
