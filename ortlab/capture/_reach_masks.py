"""The abstract values of Note [Proving the padded rows unread] (in ``ortlab.capture.padding_reach``)
and the arithmetic of their masks: what each value may be, in the original graph and in the one
on the kept rows, whatever the parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

FALSE, TRUE = torch.tensor(False), torch.tensor(True)
_DEAD = -1e4  # at most this: a masked-out score (Note above)
_BIG = 1e3
_EXACT_DEAD = -1e30  # at most this: weight 0 whatever the finite scores (finfo.min, -inf)
# Mask products up to this many multiply-adds are exact; larger ones over-approximate (``_contract``).
_EXACT_CONTRACTION = 1 << 22


# Comparisons, and binary ops finite and zero-preserving (both 0 in, 0 out), named as ``_op`` names them.
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "equal", "isclose", "greater", "less", "greater_equal",
            "less_equal", "not_equal"}
_BINARY_SAFE = {"maximum", "minimum", "fmax", "fmin", "logical_or", "xor", "logical_xor", "bitwise_or",
                "bitwise_xor", "hypot", "copysign"}


class _Unknown(Exception):
    """A rule that cannot apply (a shape it needs is unknown): the op counts as one without a rule."""


@dataclasses.dataclass
class _AV:
    """The abstract value of a tensor whose values the check does not compute (Note above)."""

    meta: torch.Tensor | None  # its shape and dtype, on the meta device (None: unknown)
    t: torch.Tensor = FALSE
    n: torch.Tensor = TRUE
    nf: torch.Tensor = FALSE
    dead: torch.Tensor = FALSE
    big: torch.Tensor = FALSE
    sign: str = ""  # ">0" or ">=0" everywhere, in F and G, whatever the parameters ("" if unknown)

    def shape(self) -> tuple[int, ...]:
        if self.meta is None:
            raise _Unknown
        return tuple(self.meta.shape)



def _scalar(x: object) -> _AV:
    """A number (or a data value) as an abstract value: its masks from its value."""
    v = x if isinstance(x, torch.Tensor) else torch.tensor(x)
    meta = v.to("meta") if isinstance(x, torch.Tensor) else None
    if v.dtype == torch.bool:
        return _AV(meta, n=v, sign=">=0")
    if v.is_complex():
        return _AV(meta, n=v != 0, big=~torch.isfinite(v) | (v.abs() >= _BIG))
    fin = torch.isfinite(v)
    sign = ">0" if bool((v > 0).all()) else ">=0" if bool((v >= 0).all()) else ""
    return _AV(meta, n=(v != 0) | ~fin, dead=v <= _DEAD, big=~fin | (v.abs() >= _BIG), sign=sign)


def _weaker(*signs: str) -> str:
    """The sign all of ``signs`` have."""
    return ">0" if all(s == ">0" for s in signs) else ">=0" if all(s for s in signs) else ""


# ----------------------------------------------------------------------------- masks
def _nd(m: torch.Tensor, ndim: int) -> torch.Tensor:
    """``m`` with exactly ``ndim`` dims (size-1 dims in front), broadcasting as before."""
    if m.dim() == 0 or m.dim() == ndim:
        return m if m.dim() == ndim or ndim == 0 else m.reshape((1,) * ndim)
    if m.dim() > ndim:
        m = m.reshape(m.shape[m.dim() - ndim:]) if all(d == 1 for d in m.shape[:m.dim() - ndim]) else m
        if m.dim() > ndim:
            raise _Unknown
        return m
    return m.reshape((1,) * (ndim - m.dim()) + tuple(m.shape))


def _full(m: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return _nd(m, len(shape)).expand(tuple(shape))


def _squash(m: torch.Tensor) -> torch.Tensor:
    """A mask with no true element as the constant false (keeps later ops cheap)."""
    return FALSE if m.dim() and not bool(m.any()) else m


def _any(m: torch.Tensor, dims: Sequence[int], shape: Sequence[int], keepdim: bool) -> torch.Tensor:
    """``m.any(dims)`` of a mask broadcast to ``shape`` (a broadcast dim needs no reduction)."""
    nd = len(shape)
    dims = sorted({d % nd for d in dims}) if nd else []
    if any(shape[d] == 0 for d in dims):
        m = FALSE
    if m.dim() == 0:
        if keepdim or not dims:
            return m
        return m
    m = _nd(m, nd)
    real = tuple(d for d in dims if m.shape[d] != 1)
    if real:
        m = m.any(dim=real, keepdim=True)
    if not keepdim and dims:
        m = m.squeeze(tuple(dims))
    return m


def _contract(a: torch.Tensor, b: torch.Tensor, ash: Sequence[int], bsh: Sequence[int]) -> torch.Tensor:
    """``any_k(a[..., i, k] & b[..., k, j])``: which elements of ``A @ B`` the masks reach."""
    ash, bsh = list(ash), list(bsh)
    squeeze = []
    if len(ash) == 1:
        ash, a = [1, ash[0]], _nd(a, 1).unsqueeze(0) if a.dim() else a
        squeeze.append(-2)
    if len(bsh) == 1:
        bsh, b = [bsh[0], 1], _nd(b, 1).unsqueeze(1) if b.dim() else b
        squeeze.append(-1)
    k = ash[-1]
    if k == 0:
        out = FALSE
    elif a.dim() == 0 and b.dim() == 0:
        out = a & b
    elif b.dim() == 0:
        aa = _nd(a, len(ash))
        out = (aa.any(-1, keepdim=True) if aa.shape[-1] != 1 else aa) & b
    elif a.dim() == 0:
        bb = _nd(b, len(bsh))
        out = a & (bb.any(-2, keepdim=True) if bb.shape[-2] != 1 else bb)
    else:
        aa, bb = _nd(a, len(ash)), _nd(b, len(bsh))
        if aa.shape[-1] == 1 and bb.shape[-2] == 1:
            out = aa & bb
        else:
            batch = torch.broadcast_shapes(aa.shape[:-2], bb.shape[:-2])
            if math.prod(batch) * aa.shape[-2] * k * bb.shape[-1] > _EXACT_CONTRACTION:
                # any_k(a & b) <= any_k(a) & any_k(b): more taint, never less. Exact where either is the
                # same along k (a padded query's row against every key); what needs the exact form, the
                # attention's weights against the values, has 1s for the heads and the values' width.
                out = aa.any(-1, keepdim=True) & bb.any(-2, keepdim=True)
            else:
                if aa.shape[-1] == 1:
                    aa = aa.expand(*aa.shape[:-1], k)
                if bb.shape[-2] == 1:
                    bb = bb.expand(*bb.shape[:-2], k, bb.shape[-1])
                out = (aa.float() @ bb.float()) > 0
    for d in squeeze:
        if out.dim() >= 2:
            out = out.squeeze(d) if out.shape[d] == 1 else out
    return out


def _reshape(m: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    """``m`` (broadcast to ``src``) reshaped to ``dst``, keeping broadcast dims where a group of
    dims that reshape together is broadcast whole (the logits' vocab dim in ``view(-1, V)``)."""
    if m.dim() == 0:
        return m
    src, dst = list(src), list(dst)
    if 0 in src or 0 in dst:
        return FALSE
    m = _nd(m, len(src))
    if list(m.shape) == src:
        return m.reshape(dst)
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        i0, j0, ps, pd = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                ps, i = ps * src[i], i + 1
            else:
                pd, j = pd * dst[j], j + 1
        groups.append([i0, i, j0, j])
    if not groups:
        return m.reshape(dst)
    groups[-1][1], groups[-1][3] = len(src), len(dst)  # trailing size-1 dims join the last group
    expand, out = [], []
    for i0, i1, j0, j1 in groups:
        if all(m.shape[d] == 1 for d in range(i0, i1)):
            expand += [1] * (i1 - i0)
            out += [1] * (j1 - j0)
        else:
            expand += src[i0:i1]
            out += dst[j0:j1]
    return m.expand(expand).reshape(out)


def _leaves(x: object) -> list[object]:
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in _leaves(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in _leaves(item)]
    if isinstance(x, slice):
        return _leaves((x.start, x.stop, x.step))
    return [x]


def _fits(av: _AV) -> bool:
    """Whether each of ``av``'s masks broadcasts to its value's shape."""
    masks = (av.t, av.n, av.nf, av.dead, av.big)
    if av.meta is None:
        return all(m.dim() == 0 for m in masks)
    shape = tuple(av.meta.shape)
    return all(m.dim() <= len(shape) and all(a in (1, b) for a, b in zip(reversed(m.shape), reversed(shape)))
               for m in masks)


def _tainted(av: _AV) -> bool:
    return bool(av.t.any())


def _map(a: _AV, meta: object, f: Callable[[torch.Tensor], torch.Tensor]) -> _AV:
    return _AV(meta if isinstance(meta, torch.Tensor) or meta is None else None,
               f(a.t), f(a.n), f(a.nf), f(a.dead), f(a.big), a.sign)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return False
    return shape == a.shape == b.shape and torch.equal(a, b)


def _compact(m: torch.Tensor) -> torch.Tensor:
    """A mask expanded by ``_full`` back to size-1 dims where it did not vary."""
    for d in range(m.dim()):
        if m.stride(d) == 0 and m.shape[d] > 1:
            m = m.narrow(d, 0, 1)
    return m


def _or(*ms: torch.Tensor) -> torch.Tensor:
    """``|`` of masks, with the constants folded (a true constant wins, a false one drops out)."""
    out = FALSE
    for m in ms:
        if m.dim() == 0:
            if bool(m):
                return TRUE
            continue
        out = m if out.dim() == 0 else out | m
    return out


def _and(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() == 0:
        return b if bool(a) else FALSE
    if b.dim() == 0:
        return a if bool(b) else FALSE
    return a & b


def _binary(name: str, a: _AV, b: _AV, meta: object) -> _AV:
    meta = meta if isinstance(meta, torch.Tensor) else None
    big = _or(a.big, b.big)
    if name in ("add", "sub"):
        # A masked score stays masked plus a bounded value, or plus another mask (-big + -big).
        dead = _and(a.dead, _or(b.dead, ~_or(b.big, b.nf)) if name == "add" else ~_or(b.big, b.nf)) \
            if a.dead.dim() or bool(a.dead) else FALSE
        if name == "add" and (b.dead.dim() or bool(b.dead)):
            dead = _or(dead, _and(b.dead, _or(a.dead, ~_or(a.big, a.nf))))
        sign = "" if name == "sub" else ">0" if _weaker(a.sign, b.sign) and ">0" in (a.sign, b.sign) else \
            _weaker(a.sign, b.sign)
        return _AV(meta, _or(a.t, b.t), _or(a.n, b.n), _or(a.nf, b.nf), dead, big, sign)
    if name == "mul" or name in ("logical_and", "bitwise_and"):
        # 0 * x is 0 wherever the 0 is in both graphs and x is finite in G.
        t = _or(_and(a.t, _or(b.n, a.nf)), _and(b.t, _or(a.n, b.nf)))
        return _AV(meta, t, _or(_and(a.n, b.n), a.nf, b.nf), _or(a.nf, b.nf), FALSE, big, _weaker(a.sign, b.sign))
    if name in ("div", "true_divide"):
        if b.sign == ">0":  # a positive divisor, in G too: no division by 0
            return _AV(meta, _or(a.t, b.t), a.n, _or(a.nf, b.nf), FALSE, big, _weaker(a.sign, b.sign))
        return _AV(meta, _or(a.t, b.t), _or(a.n, ~b.n, b.t), _or(a.nf, b.nf, b.t), FALSE, big)
    if name in _COMPARE:
        return _AV(meta, _or(a.t, b.t), TRUE, FALSE, FALSE, FALSE)
    if name in _BINARY_SAFE:
        return _AV(meta, _or(a.t, b.t), _or(a.n, b.n), _or(a.nf, b.nf), FALSE, big)
    t = _or(a.t, b.t)
    return _AV(meta, t, TRUE, t, FALSE, big)


def _matmul(a: _AV, b: _AV, ash: Sequence[int], bsh: Sequence[int], meta: object) -> _AV:
    c = lambda x, y: _contract(x, y, ash, bsh) if (x.dim() or bool(x)) and (y.dim() or bool(y)) else FALSE  # noqa: E731
    nf = _or(c(a.nf, TRUE), c(TRUE, b.nf))
    t = _or(c(a.t, b.n), c(a.n, b.t), nf)
    return _AV(meta if isinstance(meta, torch.Tensor) else None, t, _or(c(a.n, b.n), nf), _and(t, nf), FALSE,
               _or(c(a.big, TRUE), c(TRUE, b.big)))


def _softmax(x: _AV, dim: int, shape: Sequence[int], log: bool, meta: object) -> _AV:
    """A row's dead positions weigh exactly 0, untainted, when the row has a live one; its live
    positions carry the taint of every live position (and of every position, if none lives)."""
    nd = len(shape)
    dim %= nd
    meta = meta if isinstance(meta, torch.Tensor) else None
    if shape[dim] == 0:
        return _AV(meta)
    tt = x.t | x.nf
    alive = ~_nd(x.dead, nd) if x.dead.dim() else ~x.dead
    has_alive = _any(alive, [dim], shape, True)
    row = _any(tt & alive, [dim], shape, True) | (~has_alive & _any(tt, [dim], shape, True))
    nf = _any(x.nf, [dim], shape, True)
    if log:
        t = row | x.t
        return _AV(meta, t, TRUE, t & (nf | x.nf), FALSE, x.big)
    t = row & (alive | ~has_alive)
    return _AV(meta, t, alive | ~has_alive, t & nf, FALSE, FALSE, ">=0")


def _to_meta(x: object) -> object:
    if isinstance(x, _AV):
        if x.meta is None:
            raise _Unknown
        return x.meta
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_to_meta(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: ("meta" if k == "device" else _to_meta(v)) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_to_meta(x.start), _to_meta(x.stop), _to_meta(x.step))
    return x
