"""The rules of Note [Proving the padded rows unread] (in ``ortlab.capture.padding_reach``), op by op:
how an op maps its inputs' masks to its output's, for every value of the parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F

from ortlab._compat.torch import LINEAR_TARGETS, SDPA_TARGETS
from ortlab.capture._reach_masks import (_AV, _BINARY_SAFE, _COMPARE, _DEAD, _EXACT_DEAD, FALSE, TRUE, _any, _binary,
                                         _compact, _full, _leaves, _map, _matmul, _nd, _or, _reshape, _same, _scalar,
                                         _softmax, _tainted, _to_meta, _Unknown, _weaker)
from ortlab.capture.decompositions import sdpa_math

# ----------------------------------------------------------------------------- op names
# Functions named by what they compute (operator's and torch's spellings, in-place ones with "_").
_FUNCTION_NAMES: dict[object, str] = {
    operator.add: "add", operator.iadd: "add_", operator.sub: "sub", operator.isub: "sub_",
    operator.mul: "mul", operator.imul: "mul_", operator.truediv: "div", operator.itruediv: "div_",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.pow: "pow", operator.neg: "neg",
    operator.pos: "positive", operator.abs: "abs", operator.matmul: "matmul", operator.getitem: "getitem",
    operator.setitem: "setitem_", operator.and_: "logical_and", operator.iand: "logical_and_",
    operator.or_: "logical_or", operator.ior: "logical_or_", operator.xor: "xor", operator.invert: "logical_not",
    operator.not_: "logical_not", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", getattr: "getattr", torch.concat: "cat", torch.concatenate: "cat",
    torch.true_divide: "div", torch.divide: "div", torch.multiply: "mul", torch.subtract: "sub",
    torch.clip: "clamp", torch.absolute: "abs", torch.negative: "neg", torch.special.expit: "sigmoid",
    **{t: "linear" for t in LINEAR_TARGETS}, **{t: "sdpa" for t in SDPA_TARGETS},
    sdpa_math: "sdpa",  # SDPA in ortlab's math form (``capture.aot.rewrite_calls``): the same semantics
}


def _op(node: torch.fx.Node) -> tuple[str, bool]:
    """``(name, in_place)`` of a call: the method's or function's name, without a trailing ``_``."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        t = node.target
        name = _FUNCTION_NAMES.get(t) if _hashable(t) else None
        if name is None:
            module = getattr(t, "__module__", "") or ""
            if not (module.startswith("torch") or module in ("builtins", "_operator", "math")):
                return "", False
            name = getattr(t, "__name__", "")
    else:
        return "", False
    if name.endswith("_") and not name.startswith("_"):
        return name[:-1], True
    inplace = node.kwargs.get("inplace") is True or (name.startswith("dropout") and len(node.args) > 3
                                                     and node.args[3] is True)
    return name, inplace


def _hashable(t: object) -> bool:
    try:
        hash(t)
    except TypeError:
        return False
    return True


_CASTS = {"to", "float", "half", "bfloat16", "double", "type_as", "type", "contiguous", "clone", "detach", "positive",
          "alias", "requires_grad", "cpu", "cuda"}
# f(0) = 0 and finite in, finite out.
_ZERO = {"relu", "gelu", "silu", "tanh", "neg", "abs", "square", "sin", "erf", "leaky_relu", "elu", "selu", "celu",
         "hardswish", "mish", "hardtanh", "relu6", "sign", "sgn", "sinh", "asinh", "atan", "trunc", "round", "floor",
         "ceil", "frac", "softsign", "tanhshrink", "hardshrink", "softshrink", "expm1", "dropout", "dropout1d",
         "dropout2d", "dropout3d", "sparse_dropout"}
# Finite in, finite out, f(0) != 0.
_SMOOTH = {"exp", "exp2", "sigmoid", "cos", "cosh", "softplus", "logsigmoid", "hardsigmoid", "erfc", "clamp", "clip",
           "clamp_min", "clamp_max", "nan_to_num", "alpha_dropout", "feature_alpha_dropout", "bitwise_not",
           "logical_not", "isnan", "isinf", "isfinite", "signbit"}
# May be non-finite for a finite input (0 among them).
_SINGULAR = {"rsqrt", "reciprocal", "log", "log2", "log10", "log1p", "sqrt", "acos", "asin", "tan", "atanh",
             "erfinv", "digamma", "lgamma", "arccos", "arcsin"}
_BINARY_SINGULAR = {"floor_divide", "remainder", "fmod", "atan2", "arctan2", "xlogy", "float_power"}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "ravel"}
_PERMUTES = {"transpose", "permute", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "mT"}
_EXPANDS = {"expand", "expand_as", "broadcast_to"}
# Ops that move elements (or drop them), applied to the masks as they are to values.
_ROUTES = {"flip", "roll", "repeat", "tile", "repeat_interleave", "narrow", "select", "diagonal", "tril", "triu",
           "index_select", "gather", "take_along_dim", "unfold", "rot90", "fliplr", "flipud"}
_SPLITS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split", "hsplit", "vsplit"}
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "prod", "logsumexp", "var", "std",
               "all", "any", "argmax", "argmin", "count_nonzero", "norm", "median", "nanmedian", "aminmax"}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"}
_POOLS = {"avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
          "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
          "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices"}
_SHAPE_QUERIES = {"size", "dim", "numel", "ndimension", "nelement", "stride", "is_contiguous", "is_floating_point",
                  "is_complex", "element_size", "get_device", "storage_offset"}
_CREATES = {"new_ones": True, "new_zeros": False, "new_empty": True, "new_full": None, "new_tensor": True,
            "zeros_like": False, "ones_like": True, "empty_like": True, "full_like": None, "rand_like": True,
            "randn_like": True, "randint_like": True}
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "normal",
           "multinomial", "poisson", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random",
           "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu",
           "native_dropout", "sparse_dropout"}
# Ops that mix rows: the ones a failure names (whichever first carries the padded rows into the others).
_LOSSES = {"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
           "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
           "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss", "margin_ranking_loss",
           "cosine_embedding_loss", "multilabel_soft_margin_loss"}
_SIGNATURES: dict[str, inspect.Signature] = {}
for _name in ("cross_entropy", "nll_loss", "layer_norm", "rms_norm", "pad", *_LOSSES):
    if (_f := getattr(F, _name, None)) is not None:
        try:
            _SIGNATURES[_name] = inspect.signature(_f)
        except (TypeError, ValueError):
            pass
_SDPA = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False: None)


def _bind(name: str, args: tuple, kwargs: dict) -> dict[str, object]:
    sig = _SDPA if name == "sdpa" else _SIGNATURES.get(name)
    if sig is None:
        raise _Unknown
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise _Unknown from e
    bound.apply_defaults()
    return dict(bound.arguments)


_VIEWS = _RESHAPES | _PERMUTES | _EXPANDS | _SPLITS | {"getitem", "narrow", "select", "diagonal", "unfold", "detach",
                                                       "alias", "contiguous", "to", "real", "imag", "as_strided"}


class _Rules:
    """The op rules of ``PaddedRowsReach``, on the state of the batch it checks."""

    static: dict[torch.fx.Node, object]  # values on the meta device, where Dynamo's sizes are concrete
    device: torch.device  # the inputs' device (the data's, and the parameters')
    problems: list[tuple[str, torch.fx.Node | None]]  # side effects that fail the check
    memo: list[tuple[tuple, list[torch.Tensor], _AV]]  # attention's answers on this batch
    weakest_mask: float | None  # the weakest finite mask value taken as masking
    # In-place ops: whether a later op or the caller sees the update, and the nodes sharing its storage.
    aliases: dict[torch.fx.Node, tuple[bool, list[torch.fx.Node]]]

    def _run(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> object:
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]

    def _meta(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> object:
        static = self.static.get(node)
        if static is not None:
            return static
        try:
            return self._run(node, _to_meta(args), _to_meta(kwargs))
        except Exception:  # noqa: BLE001 - its shape is unknown
            return None

    def _update(self, node: torch.fx.Node, name: str, args: tuple, out: object, env: dict) -> None:
        """An in-place op with abstract inputs: its target's aliases read by later ops take on its taint."""
        visible, group = self.aliases[node]
        if not visible:
            return
        sources = [out] if isinstance(out, _AV) else [x for x in _leaves(args[1:]) if isinstance(x, _AV)]
        t = any(_tainted(s) for s in sources)
        nf = TRUE if any(bool(s.nf.any()) for s in sources) else FALSE
        if t and any(n.op in ("placeholder", "get_attr") for n in group):
            self.problems.append(("updates an input in place with values computed from the padded tokens", node))
        for n in group:
            if n in env and (isinstance(env[n], _AV) or isinstance(env[n], torch.Tensor)):
                old = env[n] if isinstance(env[n], _AV) else self._data(env[n])
                env[n] = _AV(old.meta, t=TRUE if t else old.t, n=TRUE, nf=_or(old.nf, nf), big=TRUE)

    def _data(self, v: object) -> _AV:
        """A data value (computed on this batch) as an abstract value."""
        if isinstance(v, _AV):
            return v
        if isinstance(v, (bool, int, float)) or isinstance(v, torch.Tensor):
            av = _scalar(v)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                weak = v[(v <= _DEAD) & (v > _EXACT_DEAD)]
                if weak.numel():
                    w = float(weak.max())
                    self.weakest_mask = w if self.weakest_mask is None else max(self.weakest_mask, w)
            return av
        raise _Unknown

    def _rule(self, node: torch.fx.Node, name: str, args: tuple, kwargs: dict) -> object:
        meta = lambda: self._meta(node, args, kwargs)  # noqa: E731
        x = args[0] if args else None
        if name == "getattr":
            return self._getattr(node, x, args[1])
        if name in _SHAPE_QUERIES:
            if name == "get_device":
                return self.device.index if self.device.type != "cpu" else -1
            return self._run(node, _to_meta(args), _to_meta(kwargs))
        if name in _CREATES:
            fill = _CREATES[name]
            if fill is None:
                value = args[2] if name == "new_full" else args[1] if len(args) > 1 else kwargs.get("fill_value")
                if isinstance(value, _AV):
                    raise _Unknown
                return dataclasses.replace(self._data(value), meta=meta())
            return _AV(meta(), n=TRUE if fill else FALSE)
        if name == "sdpa":
            return self._sdpa(_bind(name, args, kwargs), meta())
        if name in ("cross_entropy", "nll_loss"):
            return self._cross_entropy(_bind(name, args, kwargs), meta())
        if name == "linear":
            w = self._data(args[1] if len(args) > 1 else kwargs["weight"])
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            a = self._data(x)
            ws = w.shape()
            wt = _AV(None, *(_nd(m, 2).transpose(0, 1) if m.dim() else m for m in (w.t, w.n, w.nf, w.dead, w.big)))
            out = _matmul(a, wt, a.shape(), (ws[1], ws[0]) if len(ws) == 2 else ws, meta())
            return out if b is None else _binary("add", out, self._data(b), out.meta)
        if name in ("matmul", "bmm", "mm"):
            a, b = self._data(x), self._data(args[1])
            return _matmul(a, b, a.shape(), b.shape(), meta())
        if name == "einsum":
            return self._einsum(args, meta())
        if name in ("softmax", "log_softmax", "_softmax"):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if not isinstance(dim, int):
                raise _Unknown
            a = self._data(x)
            return _softmax(a, dim, a.shape(), name == "log_softmax", meta())
        if name in ("layer_norm", "rms_norm", "normalize", "group_norm", "instance_norm", "batch_norm"):
            return self._norm(node, name, args, kwargs, meta())
        if name in ("where", "masked_fill"):
            return self._where(name, args, kwargs, meta())
        if name == "pow":
            return self._pow(args, meta())
        if name in ("type_as", "to") and not isinstance(x, _AV) and isinstance(x, torch.Tensor) and \
                len(args) == 2 and not kwargs and isinstance(args[1], _AV) and args[1].meta is not None:
            return x.to(self.device, args[1].meta.dtype)  # data cast like a parameter's value: still data
        if name in _CASTS or name in _ZERO or name in _SMOOTH or name in _SINGULAR:
            if name not in _CASTS and any(isinstance(v, _AV) for v in _leaves((args[1:], kwargs))):
                raise _Unknown  # a cast's other tensor (``type_as``) gives only a dtype
            a, m = self._data(x), meta()
            if name in _CASTS:
                floating = isinstance(m, torch.Tensor) and m.is_floating_point()
                return _AV(m, a.t, a.n, a.nf, a.dead if floating else FALSE, a.big, a.sign)
            if name in _ZERO:
                sign = ">=0" if name in ("relu", "abs", "square", "relu6") else a.sign if name.startswith("dropout") \
                    else ""
                return _AV(m, a.t, a.n, a.nf, FALSE, a.big, sign)
            if name in _SMOOTH:
                return _AV(m, a.t, TRUE, a.nf, FALSE, a.big, ">=0" if name in ("exp", "sigmoid", "softplus") else "")
            # rsqrt(x.pow(2).mean(-1) + eps) is finite: a positive input, in G too, keeps it so.
            finite = a.sign == ">0" or (a.sign == ">=0" and name == "sqrt")
            sign = a.sign if name in ("rsqrt", "sqrt", "reciprocal") else ""
            return _AV(m, a.t, a.n if name == "sqrt" else TRUE, a.nf if finite else a.t, FALSE, a.big, sign)
        if name in ("add", "sub", "rsub", "mul", "div", "true_divide") or name in _COMPARE or \
                name in _BINARY_SAFE or name in _BINARY_SINGULAR or name in ("logical_and", "bitwise_and"):
            if len(args) < 2 or any(isinstance(v, _AV) for v in _leaves(kwargs)) or kwargs.get("alpha", 1) != 1:
                raise _Unknown
            if kwargs.get("rounding_mode") is not None:
                name = "floor_divide"  # may divide by a padded row's 0 like any division, and floors
            a, b = args[0], args[1]
            if name == "rsub":
                name, a, b = "sub", b, a
            if name == "sub" and not isinstance(b, _AV) and not isinstance(a, _AV):
                raise _Unknown
            if name == "sub" and not isinstance(b, _AV):
                name, b = "add", -b  # ``scores - 1e6 * (1 - mask)`` (Funnel's): a mask's -1e6, dead
            return _binary(name, self._data(a), self._data(b), meta())
        if name in _RESHAPES:
            a, m = self._data(x), meta()
            return _map(a, m, lambda v: _reshape(v, a.shape(), tuple(m.shape)))
        if name in _PERMUTES:
            a = self._data(x)
            nd = len(a.shape())
            return _map(a, meta(), lambda v: getattr(_nd(v, nd), name)(*args[1:], **kwargs) if v.dim() else v)
        if name in _EXPANDS:
            a, m = self._data(x), meta()
            return _map(a, m, lambda v: _nd(v, m.dim()) if v.dim() else v)
        if name == "getitem":
            return self._getitem(x, args[1], meta)
        if name in ("cat", "stack"):
            return self._cat(name, args, kwargs, meta())
        if name in _ROUTES or name in _SPLITS:
            a = self._data(x)
            if any(isinstance(v, _AV) for v in _leaves((args[1:], kwargs))):
                raise _Unknown
            shape = a.shape()
            route = lambda v: getattr(_full(v, shape), name)(*args[1:], **kwargs)  # noqa: E731
            m = meta()
            if name in _SPLITS:
                parts = [route(v) if v.dim() else None for v in (a.t, a.n, a.nf, a.dead, a.big)]
                metas = m if isinstance(m, (tuple, list)) else [None] * len(next(p for p in parts if p is not None)) \
                    if any(p is not None for p in parts) else None
                if metas is None:
                    raise _Unknown
                return tuple(_AV(mm, *(_compact(p[i]) if p is not None else v
                                       for p, v in zip(parts, (a.t, a.n, a.nf, a.dead, a.big))))
                             for i, mm in enumerate(metas))
            return _map(a, m, lambda v: _compact(route(v)) if v.dim() else v)
        if name == "pad":
            return self._pad(args, kwargs, meta())
        if name in _REDUCTIONS:
            return self._reduce(name, args, kwargs, meta)
        if name in _SCANS:
            a = self._data(x)
            dim = args[1] if len(args) > 1 else kwargs["dim"]
            shape = a.shape()
            scan = lambda v: (_full(v, shape).float().cumsum(dim) > 0) if v.dim() else v  # noqa: E731
            out = _AV(None, scan(a.t), TRUE, scan(a.nf), FALSE, scan(a.big))
            m = meta()
            if isinstance(m, (tuple, list)):
                return (dataclasses.replace(out, meta=m[0]), dataclasses.replace(out, meta=m[1]))
            return dataclasses.replace(out, meta=m)
        if name in _POOLS:
            a, m = self._data(x), meta()
            if not isinstance(m, torch.Tensor) or any(isinstance(v, _AV) for v in _leaves((args[1:], kwargs))):
                raise _Unknown
            shape = a.shape()
            def pool(v: torch.Tensor) -> torch.Tensor:  # max or mean over windows of 0s and 1s: any
                return node.target(_full(v, shape).float(), *args[1:], **kwargs) > 0 if v.dim() else v

            return _AV(m, pool(a.t), pool(a.n), pool(a.nf), FALSE, pool(a.big))
        raise _Unknown

    def _getattr(self, node: torch.fx.Node, x: object, attr: object) -> object:
        if isinstance(x, (tuple, list)) and attr in ("values", "indices"):
            return x[0 if attr == "values" else 1]
        if not isinstance(x, _AV) or not isinstance(attr, str):
            raise _Unknown
        if attr == "device":
            return self.device
        if attr == "is_cuda":
            return self.device.type == "cuda"
        if attr in ("shape", "dtype", "ndim", "layout", "is_sparse", "is_quantized", "is_meta", "is_floating_point"):
            if x.meta is None:
                raise _Unknown
            return getattr(x.meta, attr)
        if attr in ("T", "mT") and x.meta is not None:
            nd = x.meta.dim()
            flip = (lambda v: _nd(v, nd).permute(*reversed(range(nd))) if v.dim() else v) if attr == "T" else \
                (lambda v: _nd(v, nd).transpose(-2, -1) if v.dim() else v)
            return _map(x, getattr(x.meta, attr), flip)
        raise _Unknown

    def _getitem(self, x: object, idx: object, meta: Callable[[], object]) -> object:
        if isinstance(x, (tuple, list)):
            return x[idx]  # type: ignore[index]
        a = self._data(x)
        comps = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(c, _AV) for c in _leaves(comps)):
            raise _Unknown  # indices computed from the parameters: no rule
        shape = a.shape()
        if all(c is None or c is Ellipsis or isinstance(c, (int, slice)) and not isinstance(c, bool) for c in comps):
            consumed = sum(isinstance(c, (int, slice)) for c in comps)
            full: list[object] = []
            for c in comps:
                full += [slice(None)] * (len(shape) - consumed) if c is Ellipsis else [c]
            if Ellipsis not in comps:
                full += [slice(None)] * (len(shape) - consumed)

            def index(v: torch.Tensor) -> torch.Tensor:
                if not v.dim():
                    return v
                v = _nd(v, len(shape))
                out, d = [], 0
                for c in full:
                    if c is None:
                        out.append(None)
                        continue
                    if v.shape[d] == 1 and shape[d] != 1:
                        if isinstance(c, int):
                            c = 0
                        else:
                            c = slice(None) if len(range(*c.indices(shape[d]))) else slice(0, 0)
                    out.append(c)
                    d += 1
                return v[tuple(out)]

            return _map(a, meta(), index)
        device = next((c.device for c in _leaves(comps) if isinstance(c, torch.Tensor)), self.device)
        route = lambda v: _compact(_full(v.to(device), shape)[idx]) if v.dim() else v  # noqa: E731
        m = meta()
        if not isinstance(m, torch.Tensor):
            m = torch.empty(_full(TRUE.to(device), shape)[idx].shape, dtype=a.meta.dtype, device="meta")
        return _map(a, m, route)

    def _cat(self, name: str, args: tuple, kwargs: dict, meta: object) -> _AV:
        items = [self._data(v) for v in (args[0] if args else kwargs["tensors"])]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        shapes = [it.shape() for it in items]
        if name == "stack":
            d = dim % (len(shapes[0]) + 1)
            shapes = [s[:d] + (1,) + s[d:] for s in shapes]
            items = [_map(it, None, lambda v, d=d: _nd(v, len(s) - 1).unsqueeze(d) if v.dim() else v)
                     for it, s in zip(items, shapes)]
            dim = d
        nd = len(shapes[0])
        dim %= nd

        def cat(ms: list[torch.Tensor]) -> torch.Tensor:
            if all(m.dim() == 0 for m in ms) and len({bool(m) for m in ms}) == 1:
                return ms[0]
            ms = [_nd(m.reshape(()) if m.dim() == 0 else m, nd) if m.dim() else m.reshape((1,) * nd) for m in ms]
            ms = [m.to(self.device) for m in ms]
            if all(m.shape[dim] == 1 for m in ms) and all(_same(m, ms[0]) for m in ms[1:]):
                return ms[0]  # the same along ``dim`` in every part (rotary's halves): the same in the whole
            wide = {d for d in range(nd) if d != dim and any(m.shape[d] != 1 for m in ms)}
            return torch.cat([m.expand([s[d] if d == dim or d in wide else 1 for d in range(nd)])
                              for m, s in zip(ms, shapes)], dim)

        return _AV(meta, *(cat([getattr(it, f) for it in items]) for f in ("t", "n", "nf", "dead", "big")),
                   _weaker(*(it.sign for it in items)))

    def _pad(self, args: tuple, kwargs: dict, meta: object) -> _AV:
        a = self._data(args[0])
        pad = args[1] if len(args) > 1 else kwargs["pad"]
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
        value = args[3] if len(args) > 3 else kwargs.get("value")
        value = 0.0 if value is None else value
        if any(isinstance(v, _AV) for v in _leaves((pad, value))):
            raise _Unknown
        shape = a.shape()
        full = lambda v: _full(v.to(self.device), shape)  # noqa: E731
        if mode == "constant":
            fill = self._data(value)
            return _AV(meta, *(F.pad(full(getattr(a, f)).to(torch.uint8), pad, value=int(bool(getattr(fill, f))))
                               .bool() for f in ("t", "n", "nf", "dead", "big")))
        return _map(a, meta, lambda v: F.pad(full(v).float(), pad, mode=mode) > 0.5)

    def _reduce(self, name: str, args: tuple, kwargs: dict, meta: Callable[[], object]) -> object:
        a = self._data(args[0])
        if name in ("max", "min") and len(args) > 1 and isinstance(args[1], (_AV, torch.Tensor)):
            return _binary("maximum", a, self._data(args[1]), meta())
        rest = list(args[1:])
        if name == "norm":
            rest = rest[1:] if rest else []  # norm(p, dim, keepdim)
        dim = rest[0] if rest else kwargs.get("dim", kwargs.get("axis"))
        at = 2 if name in ("var", "std") else 1  # var(dim, unbiased, keepdim)
        keepdim = rest[at] if len(rest) > at else kwargs.get("keepdim", False)
        if not isinstance(keepdim, bool):
            raise _Unknown
        if any(isinstance(v, _AV) for v in _leaves((rest, kwargs))):
            raise _Unknown
        shape = a.shape()
        dims = list(range(len(shape))) if dim is None else [dim] if isinstance(dim, int) else list(dim)
        if not all(isinstance(d, int) for d in dims):
            raise _Unknown
        red = lambda v: _any(v, dims, shape, bool(keepdim))  # noqa: E731
        out_t, out_nf, out_big = red(a.t), red(a.nf), red(a.big)
        m = meta()
        keeps_sign = ("sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "median", "prod")
        sign = ">=0" if name in ("norm", "var", "std", "count_nonzero", "all", "any") or (
            a.sign and name in keeps_sign) else ""
        values = _AV(m[0] if isinstance(m, (tuple, list)) else m, out_t,
                     TRUE if name in ("logsumexp", "argmax", "argmin") else red(a.n), out_nf, FALSE, out_big, sign)
        if isinstance(m, (tuple, list)):
            return (values, _AV(m[1], out_t, TRUE))
        return values

    def _where(self, name: str, args: tuple, kwargs: dict, meta: object) -> _AV:
        if name == "where":
            if len(args) != 3:
                raise _Unknown
            cond, x, y = args
        else:
            x, cond = args[0], args[1] if len(args) > 1 else kwargs["mask"]
            y = args[2] if len(args) > 2 else kwargs["value"]
            cond, x, y = cond, y, x  # masked_fill(x, c, v) = where(c, v, x)
        a, b = self._data(x), self._data(y)
        if isinstance(cond, torch.Tensor):
            c = cond.bool()
            sel = lambda f: torch.where(c, getattr(a, f).to(c.device), getattr(b, f).to(c.device))  # noqa: E731
            return _AV(meta, *(sel(f) for f in ("t", "n", "nf", "dead", "big")), _weaker(a.sign, b.sign))
        c = self._data(cond)
        return _AV(meta, a.t | b.t | c.t, a.n | b.n, a.nf | b.nf, a.dead & b.dead, a.big | b.big,
                   _weaker(a.sign, b.sign))

    def _pow(self, args: tuple, meta: object) -> _AV:
        base, e = args[0], args[1]
        if isinstance(base, _AV) and isinstance(e, (int, float)):
            even = float(e).is_integer() and int(e) % 2 == 0
            sign = ">0" if base.sign == ">0" else ">=0" if even or base.sign else ""
            if e == 0:
                return _AV(meta, big=base.big, sign=">0")
            if e > 0:
                finite = float(e).is_integer() or base.sign
                return _AV(meta, base.t, base.n, base.nf if finite else base.t, FALSE, base.big, sign)
            return _AV(meta, base.t, TRUE, base.nf if base.sign == ">0" else base.t, FALSE, base.big, sign)
        a, b = self._data(base), self._data(e)
        return _binary("atan2", a, b, meta)  # a singular binary op

    def _einsum(self, args: tuple, meta: object) -> _AV:
        eq, *ops = args
        if len(ops) == 1 and isinstance(ops[0], (tuple, list)):
            ops = list(ops[0])
        avs = [self._data(o) for o in ops]
        shapes = [a.shape() for a in avs]
        full = [lambda v, s=s: _full(v.to(self.device), s).float() for s in shapes]
        if len(avs) == 1:
            (a,) = avs
            e = lambda v: torch.einsum(eq, full[0](v)) > 0 if v.dim() else v  # noqa: E731
            return _AV(meta, e(a.t), e(a.n), e(a.nf), FALSE, e(a.big))
        if len(avs) != 2:
            raise _Unknown
        a, b = avs

        def e(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if (u.dim() == 0 and not bool(u)) or (v.dim() == 0 and not bool(v)):
                return FALSE
            if u.dim() == 0 and v.dim() == 0 and 0 not in (*shapes[0], *shapes[1]):
                return TRUE
            return torch.einsum(eq, full[0](u), full[1](v)) > 0
        t = e(a.t, b.n) | e(a.n, b.t) | e(a.nf, TRUE) | e(TRUE, b.nf)
        return _AV(meta, t, e(a.n, b.n) | e(a.nf, TRUE) | e(TRUE, b.nf), t & (e(a.nf, TRUE) | e(TRUE, b.nf)),
                   FALSE, e(a.big, TRUE) | e(TRUE, b.big))

    def _norm(self, node: torch.fx.Node, name: str, args: tuple, kwargs: dict, meta: object) -> _AV:
        a = self._data(args[0])
        shape = a.shape()
        params: list[object] = []
        if name in ("layer_norm", "rms_norm"):
            bound = _bind(name, args, kwargs)
            ns = bound["normalized_shape"]
            dims = list(range(len(shape) - (1 if isinstance(ns, int) else len(ns)), len(shape)))
            params = [bound.get("weight"), bound.get("bias")]
            zero = bound.get("bias") is None
        elif name == "normalize":
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 1)
            dims, zero = [dim], True
        elif name == "batch_norm":
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            params = list(args[1:5])
            if not training:  # running statistics: per channel, row by row
                return _AV(meta, a.t, TRUE, a.nf, FALSE, a.big)
            dims, zero = [d for d in range(len(shape)) if d != 1], False
            if (args[1] if len(args) > 1 else kwargs.get("running_mean")) is not None and _tainted(a):
                self.problems.append(("updates BatchNorm's running statistics from the padded tokens' rows", node))
        else:  # group_norm, instance_norm
            dims, zero = list(range(1 if name == "group_norm" else 2, len(shape))), False
            params = list(args[1:])
        red = lambda v: _any(v, dims, shape, True)  # noqa: E731
        t = red(a.t)
        for p in params:
            if isinstance(p, _AV) and _tainted(p):
                t = TRUE
        return _AV(meta, t, red(a.n) if zero else TRUE, red(a.nf), FALSE, red(a.big))

    def _sdpa(self, a: dict, meta: object) -> _AV:
        q, k, v = (self._data(a[n]) for n in ("query", "key", "value"))
        qs, ks, vs = q.shape(), k.shape(), v.shape()
        if len(qs) < 2 or len(ks) != len(vs):
            raise _Unknown
        # Every layer attends with the same mask, its inputs tainted alike: the first layer's answer serves.
        masks = [getattr(x, f) for x in (q, k, v) for f in ("t", "n", "nf", "big")]
        key = (id(a["attn_mask"]), bool(a["is_causal"]), bool(a["enable_gqa"]), qs, ks, vs)
        for seen, inputs, out in self.memo:
            if seen == key and all(_same(x, y) for x, y in zip(masks, inputs)):
                return dataclasses.replace(out, meta=meta if isinstance(meta, torch.Tensor) else None)
        out = self._attend(a, q, k, v, qs, ks, vs, meta)
        self.memo.append((key, masks, out))
        return out

    def _attend(self, a: dict, q: _AV, k: _AV, v: _AV, qs: tuple, ks: tuple, vs: tuple, meta: object) -> _AV:

        def heads(x: _AV, s: tuple) -> tuple[_AV, tuple]:
            if a["enable_gqa"] and len(s) >= 3 and len(qs) >= 3 and s[-3] != qs[-3]:
                rep = qs[-3] // s[-3]
                x = _map(x, None, lambda m: (_nd(m, len(s)).repeat_interleave(rep, dim=-3)
                                            if m.dim() and _nd(m, len(s)).shape[-3] != 1 else m))
                s = s[:-3] + (qs[-3],) + s[-2:]
            return x, s

        k, ks = heads(k, ks)
        v, vs = heads(v, vs)
        kt = _map(k, None, lambda m: _nd(m, len(ks)).transpose(-2, -1) if m.dim() else m)
        kts = ks[:-2] + (ks[-1], ks[-2])
        ss = tuple(torch.broadcast_shapes(qs[:-2], ks[:-2])) + (qs[-2], ks[-2])
        scores = _matmul(q, kt, qs, kts, None)
        mask = a["attn_mask"]
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            scores.dead = ~mask & ~scores.nf & ~scores.big  # False: -inf
        elif isinstance(mask, _AV) and mask.meta is not None and mask.meta.dtype == torch.bool:
            scores.t = scores.t | mask.t
        elif mask is not None:
            scores = _binary("add", scores, self._data(mask), None)
        if a["is_causal"]:
            causal = torch.ones(ss[-2], ss[-1], dtype=torch.bool, device=self.device).triu(1)
            scores.dead = scores.dead | (causal & ~scores.nf & ~scores.big)
        p = _softmax(scores, -1, ss, False, None)
        return _matmul(p, v, ss, vs, meta)

    def _cross_entropy(self, a: dict, meta: object) -> _AV:
        x = self._data(a["input"])
        shape = x.shape()
        cdim = 1 if len(shape) >= 2 else 0
        rows = _any(x.t | x.nf, [cdim], shape, False)
        target = a["target"]
        if isinstance(target, torch.Tensor) and not target.is_floating_point():
            rows = rows & (target != a["ignore_index"])  # a label that does not count reads nothing
        else:
            tv = self._data(target)
            rows = rows | (tv.t if tv.meta is None or tv.meta.dim() < len(shape) else _any(tv.t, [cdim], shape, False))
        for w in (a.get("weight"),):
            if isinstance(w, _AV) and _tainted(w):
                rows = TRUE
        t = rows if a["reduction"] == "none" else rows.any()
        return _AV(meta, t, TRUE, t, FALSE, FALSE)
