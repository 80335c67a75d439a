"""PyTorch's own op tests through ``ortlab.ORTModule``: every OpInfo sample, one outcome each.

PyTorch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``) holds,
for each of ~700 ops, the samples PyTorch tests it with: ``sample_inputs``, ``reference_inputs``
(the edge values: zeros, infinities, NaN, extremes of each dtype, empty tensors) and
``error_inputs`` (what eager must reject). :func:`run_op` runs them through an ``ORTModule``
and eager PyTorch and gives each sample one :class:`Outcome`:

==================  ==========================================================================
``matched``         ran in onnxruntime; outputs, gradients and mutated inputs as eager's
``errors_alike``    eager raises, and ortlab raises the same exception class
``routed``          ran (partly) in PyTorch with a reason ortlab reported, and matched
``known``           a documented difference (:data:`KNOWN`), with its reason
------------------  --------------------------------------------------------------------------
``different``       silently different: a value, dtype, shape, NaN or signed zero unlike eager's
``no_error``        eager raises, ortlab returned a value (silently accepted)
``error_differs``   both raise, with different exception classes
``crashed``         eager returns, ortlab raised
==================  ==========================================================================

The first four are the acceptable ones. ``different`` and ``no_error`` are silently wrong.

How a sample is compared (Note [Judging a float32 gap against float64]): integers, bools,
dtypes, shapes and NaN positions exactly; floats within the op's own tolerance (its
``toleranceOverride`` for PyTorch's decomposition and Inductor tests, else
``torch.testing.assert_close``'s defaults for the dtype); the sign of every zero eager returns
as an exact zero. A float32 value outside tolerance is judged against the same sample computed
in float64 by eager: ortlab passes when its error is no more than twice eager's own (the rule
Inductor's tests use), since then float32 rounding, not the translation, explains the gap.

Speed (Note [Many samples in one module]): a module per sample spends ~0.5 s in Dynamo,
AOTAutograd, export and sessions for a few microseconds of work. Samples of one op and dtype
run in chunks, each chunk one generated module whose ``forward`` calls the op once per
sample, each call on a line of its own: a fallback's source line names its sample, and the
chunk's outputs, gradients and mutated inputs split back per sample. Anything a chunk cannot
attribute (a capture failure, a graph break, an exception) sends its samples through one at a
time. The forward is generated Python (``forward(self, *t): return [op(t[0], 2, dim=c1), ...]``)
rather than a pytree rebuild of each sample's arguments, which Dynamo would trace: 13 s against
1 s for 40 samples of ``add``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import ortlab

__all__ = ["DTYPES", "KNOWN", "OK_OUTCOMES", "BAD_OUTCOMES", "Outcome", "op_db", "find_op", "run_op",
           "summarize"]

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
OK_OUTCOMES = ("matched", "errors_alike", "routed", "known")
BAD_OUTCOMES = ("different", "no_error", "error_differs", "crashed")

_CHUNK = 24                # samples per generated module
_CHUNK_ELEMENTS = 2 ** 22  # and at most this many input elements


def op_db() -> list:
    """PyTorch's OpInfo list (imported on first use: it needs numpy and expecttest, and takes ~5 s)."""
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def full_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def find_op(name: str) -> Any:
    """The OpInfo called ``name`` (``add``, ``nn.functional.softmax.with_dtype``)."""
    for op in op_db():
        if full_name(op) == name:
            return op
    raise KeyError(f"no OpInfo named {name!r}")


# ----------------------------------------------------------------------------- outcomes
@dataclasses.dataclass
class Outcome:
    """One sample's end.

    Attributes:
        op: the OpInfo's full name (``nn.functional.softmax.with_dtype``).
        dtype: ``float32``...
        source: ``sample``, ``reference`` or ``error`` (which OpInfo generator made it).
        index: its position in that generator.
        outcome: one of :data:`OK_OUTCOMES` or :data:`BAD_OUTCOMES`.
        detail: the reason (routed, known), the difference, or the exceptions.
        grad: whether gradients were compared too.
        sample: a short description of the sample, to reproduce it.
    """

    op: str
    dtype: str
    source: str
    index: int
    outcome: str
    detail: str = ""
    grad: bool = False
    sample: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in OK_OUTCOMES


# Known differences: (op full name, dtype or None for all, predicate on the sample or None, reason).
# Each is a difference that is not ortlab's to remove; anything else that differs is a defect.
def _out_overlaps_an_input(sample: Any) -> bool:
    """An error input whose ``out=`` shares memory with one of the op's own inputs."""
    out = sample.kwargs.get("out") if isinstance(getattr(sample, "kwargs", None), dict) else None
    if not isinstance(out, torch.Tensor):
        return False
    values = [sample.input, *sample.args, *(v for k, v in sample.kwargs.items() if k != "out")]
    flat = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    return any(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for t in flat)


def _has_out(sample: Any) -> bool:
    kwargs = getattr(sample, "kwargs", None)
    return isinstance(kwargs, dict) and "out" in kwargs


# An error input eager rejects for its out= (a dtype or shape it will not write into, a tensor that overlaps an
# input) is no error through Dynamo, which rewrites out= as the op into a fresh tensor and a copy.
OUT_REASON = ("an out= that eager rejects (its dtype, or its memory overlapping an input): Dynamo rewrites out= as the "
              "op into a fresh tensor and a copy (as for torch.compile), so PyTorch's checks of out= never run and the "
              "graph ortlab gets holds no trace of them")

def _nan_input(sample: Any) -> bool:
    return isinstance(sample.input, torch.Tensor) and sample.input.is_floating_point() and bool(sample.input.isnan().any())


# PyTorch's vectorized kernels and their scalar loops (a tensor's last elements, past the last full vector) treat
# a NaN input apart in some activations' gradients: elu's vector path tests ``x > 0`` and its scalar loop
# ``x <= 0`` (NaN against the incoming gradient), hardtanh's and hardshrink's blend a comparison's mask that a NaN
# fails where the scalar loop passes the gradient on. ortlab gives the vector path's answer everywhere.
VECTOR_TAIL = ("the gradient at a NaN input: PyTorch's vectorized kernel and its scalar tail (the last elements of a "
               "tensor) disagree; ortlab gives the vectorized kernel's answer everywhere")
_VECTOR_TAIL_OPS = ("nn.functional.elu", "nn.functional.celu", "nn.functional.selu", "nn.functional.hardtanh",
                    "nn.functional.relu6", "nn.functional.hardshrink", "nn.functional.softshrink")

# softshrink's band: the vector path writes +0.0, the scalar tail ``x * 0`` (-0.0 for a negative x); ortlab gives
# +0.0 everywhere (Note [softshrink's zeros as PyTorch's vector path] in ortlab.capture.float_edges). Only a
# signed zero is forgiven.
ZERO_TAIL = ("a zero's sign inside softshrink's band: PyTorch's vectorized kernel writes +0.0 and its scalar tail "
             "(the last elements of a tensor) -0.0 for a negative input; ortlab gives the vectorized kernel's +0.0")


# A layer norm over one element normalizes it to zero: eager's kernel computes ``x * (rstd * w) + (b - mean * rstd
# * w)``, a sum of opposites (+0.0), onnxruntime's LayerNormalization ``(x - mean) * rstd * w + b``, whose zero
# takes the weight's sign. Only a signed zero is forgiven.
LAYER_NORM_ZERO = ("a layer norm over one element is zero: eager's kernel writes x * (rstd * w) + (b - mean * rstd * "
                   "w), +0.0, onnxruntime's LayerNormalization (x - mean) * rstd * w + b, -0.0 under a negative weight")


def _one_element_norm(sample: Any) -> bool:
    return bool(sample.args) and math.prod(sample.args[0]) == 1


def _negative_in_band(sample: Any) -> bool:
    lambd = sample.args[0] if sample.args else sample.kwargs.get("lambd", 0.5)
    x = sample.input
    return isinstance(x, torch.Tensor) and bool(((x < 0) & (x >= -lambd)).any())


# linear_cross_entropy's chunked backward (torch.nn.modules.linear_cross_entropy) adds the ignored rows' input
# gradient as ``addmm(c, zeros, w, alpha=-1)`` with c = -0.0: PyTorch's BLAS starts the sum from beta * c and folds
# alpha into the products ((-1 * 0) * w, zeros of both signs: +0.0), onnxruntime's Gemm scales the finished sum
# (-1 * +0.0) and adds c: -0.0. Each order is IEEE; only the sign of a zero differs (the values are equal).
GEMM_ZERO = ("a zero's sign where addmm(c, a, b, alpha=-1) sums only zeros: PyTorch's BLAS starts from c and folds "
             "alpha into the products (+0.0), onnxruntime's Gemm scales the finished sum and adds c (-0.0)")


def _ignores_a_target(sample: Any) -> bool:
    ignore = sample.kwargs.get("ignore_index")
    target = sample.args[1] if len(sample.args) > 1 else None
    return ignore is not None and isinstance(target, torch.Tensor) and bool((target == ignore).any())


# op None: every op.
KNOWN: list[tuple[str | None, str | None, Callable[[Any], bool] | None, str]] = [
    (None, None, _out_overlaps_an_input, OUT_REASON),
    *((op, None, _nan_input, VECTOR_TAIL) for op in _VECTOR_TAIL_OPS),
    ("nn.functional.softshrink", None, _negative_in_band, ZERO_TAIL),
    ("native_layer_norm", None, _one_element_norm, LAYER_NORM_ZERO),
    ("nn.functional.linear_cross_entropy.chunked_none", None, _ignores_a_target, GEMM_ZERO),
]
# Reasons that forgive only a zero's sign.
SIGN_ONLY = (ZERO_TAIL, LAYER_NORM_ZERO, GEMM_ZERO)


def _known(op: str, dtype: str, sample: Any) -> str:
    for name, dt, pred, reason in KNOWN:
        if name in (None, op) and dt in (None, dtype) and (pred is None or pred(sample)):
            return reason
    return ""


# ----------------------------------------------------------------------------- samples
@dataclasses.dataclass
class _Case:
    source: str
    index: int
    sample: Any                      # SampleInput
    error_type: type | None = None   # for error_inputs: what eager must raise
    eager: Any = None                # eager's result (outputs, grads, inputs after)
    eager_error: BaseException | None = None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _sample_values(sample: Any) -> tuple:
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def _capturable(sample: Any) -> str:
    """Why a sample cannot go through ORTModule ("" when it can)."""
    for t in _tensors(_sample_values(sample)):
        if t.layout != torch.strided:
            return f"a {t.layout} tensor"
        if t.device.type != "cpu":
            return "a tensor not on the CPU"
        if t.is_complex() or t.dtype.is_floating_point and t.dtype not in (torch.float32, torch.float64):
            return f"a {t.dtype} tensor"
        if t.is_quantized:
            return "a quantized tensor"
    return ""


def _key(sample: Any) -> str:
    """Content of a sample, to drop reference inputs that repeat sample inputs."""
    h = hashlib.sha1()

    def add(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}{v.stride()}{v.storage_offset()}{v.requires_grad}".encode())
            if v.numel():
                h.update(v.detach().reshape(-1).clone().numpy().tobytes())  # numpy takes at most 64 dims
        elif isinstance(v, (list, tuple)):
            h.update(b"(" if isinstance(v, tuple) else b"[")
            for x in v:
                add(x)
            h.update(b")")
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                add(v[k])
        else:
            h.update(repr(v).encode())

    add(_sample_values(sample))
    return h.hexdigest()


def _describe(sample: Any) -> str:
    def d(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"T{list(v.shape)}{'' if v.is_contiguous() else 'nc'}"
        if isinstance(v, (list, tuple)):
            s = ", ".join(d(x) for x in v)
            return f"[{s}]" if isinstance(v, list) else f"({s})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}={d(x)}" for k, x in v.items()) + "}"
        r = repr(v)
        return r if len(r) < 40 else r[:37] + "..."

    inp, args, kwargs = _sample_values(sample)
    return ", ".join([d(inp), *(d(a) for a in args), *(f"{k}={d(v)}" for k, v in kwargs.items())])


def _wants_grad(op: Any, dtype: torch.dtype) -> bool:
    return bool(op.supports_autograd and dtype.is_floating_point and dtype in op.supported_backward_dtypes("cpu"))


def _cases(op: Any, dtype: torch.dtype, sources: Sequence[str]) -> tuple[list[_Case], list[Outcome]]:
    """The op's samples for ``dtype`` (reference inputs that repeat a sample input dropped)."""
    name, grad = full_name(op), _wants_grad(op, dtype)
    cases, skipped, seen = [], [], set()
    gens = {"sample": lambda: op.sample_inputs("cpu", dtype, requires_grad=grad),
            "reference": lambda: op.reference_inputs("cpu", dtype, requires_grad=grad),
            "error": lambda: op.error_inputs("cpu")}
    for source in sources:
        if source == "reference" and op.reference_inputs_func is None:
            continue  # reference_inputs would repeat sample_inputs
        if source == "error" and (op.error_inputs_func is None or dtype != _error_dtype(op)):
            continue  # error inputs choose their own dtypes: run them once, with the op's first dtype
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = list(gens[source]())
        except Exception:  # noqa: BLE001 - PyTorch's own generator failed: nothing to run
            continue
        for i, s in enumerate(made):
            sample, error_type = (s.sample_input, s.error_type) if source == "error" else (s, None)
            if (why := _capturable(sample)):
                continue  # outside what ortlab takes: counted by the sweep, not as an outcome
            key = _key(sample)
            if source != "error":
                if key in seen:
                    continue
                seen.add(key)
            cases.append(_Case(source, i, sample, error_type))
    return cases, skipped


def _error_dtype(op: Any) -> torch.dtype:
    for dt in DTYPES:
        if dt in op.supported_dtypes("cpu"):
            return dt
    return torch.float32


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- the generated module
class _Program:
    """A generated module calling ``op`` once per sample, each call on its own source line."""

    def __init__(self, op: Any, cases: Sequence[_Case], tag: str) -> None:
        consts: dict[str, Any] = {"__op": op.op}
        self.tensors: list[torch.Tensor] = []
        self.slots: list[list[int]] = []   # per case: indices into self.tensors
        index: dict[int, int] = {}

        def expr(v: Any, mine: list[int]) -> str:
            if isinstance(v, torch.Tensor):
                if id(v) not in index:  # a tensor passed twice stays one input
                    index[id(v)] = len(self.tensors)
                    self.tensors.append(v)
                mine.append(index[id(v)])
                return f"t[{index[id(v)]}]"
            if type(v) in (list, tuple):
                inner = ", ".join(expr(x, mine) for x in v)
                return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
            if type(v) is dict:
                return "{" + ", ".join(f"{k!r}: {expr(x, mine)}" for k, x in v.items()) + "}"
            if type(v) in (int, bool, str) or v is None:
                return repr(v)
            if type(v) is float and math.isfinite(v):
                return repr(v)
            name = f"c{len(consts)}"
            consts[name] = v
            return name

        calls = []
        for case in cases:
            mine: list[int] = []
            inp, args, kwargs = _sample_values(case.sample)
            parts = [expr(inp, mine), *(expr(a, mine) for a in args),
                     *(f"{k}={expr(v, mine)}" for k, v in kwargs.items())]
            calls.append(f"        __op({', '.join(parts)}),")
            self.slots.append(sorted(set(mine)))
        self.first_line = 3
        src = "def forward(self, *t):\n    return [\n" + "\n".join(calls) + "\n    ]\n"
        self.filename = f"<opinfo {tag}>"
        namespace = dict(consts)
        exec(compile(src, self.filename, "exec"), namespace)  # noqa: S102 - our own generated code
        self.cls = type("OpInfoCase", (nn.Module,), {"forward": namespace["forward"]})
        self.cases = list(cases)

    def case_of_source(self, source: str) -> int | None:
        """The case whose call is on the line a fallback's ``file:line in fn`` names."""
        m = re.match(r"(.*):(\d+) in ", source or "")
        if not m or m.group(1) != self.filename:
            return None
        i = int(m.group(2)) - self.first_line
        return i if 0 <= i < len(self.cases) else None


def _clone(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in ts:
        c = t.detach().clone()
        if t.requires_grad:
            c.requires_grad_(True)
        out.append(c)
    return out


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for k in value for x in _leaves(value[k])]
    return [value]


def _cotangent(t: torch.Tensor, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)


@dataclasses.dataclass
class _Run:
    outputs: list[Any]                # per case: its op's result
    grads: list[list[Any]] | None     # per case: grads of its tensor inputs (None where no grad)
    inputs_after: list[list[torch.Tensor]]  # per case: its inputs after the call
    error: BaseException | None = None
    grad_error: BaseException | None = None
    module: Any = None


def _execute(program: _Program, module_of: Callable[[nn.Module], nn.Module], grad: bool, seed: int = 0) -> _Run:
    ts = _clone(program.tensors)
    torch.manual_seed(seed)
    module = module_of(program.cls())
    run = _Run([], None, [], module=module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outs = module(*ts)
        except Exception as e:  # noqa: BLE001 - the outcome records it
            run.error = e
            return run
        run.outputs = list(outs)
        run.inputs_after = [[ts[j].detach() for j in slots] for slots in program.slots]
        if grad:
            leaves = [(k, o) for k, out in enumerate(run.outputs) for o in _leaves(out)
                      if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]
            wrt = [t for t in ts if t.requires_grad]
            if leaves and wrt:
                try:
                    got = torch.autograd.grad([o for _, o in leaves], wrt,
                                              [_cotangent(o, i) for i, (_, o) in enumerate(leaves)],
                                              allow_unused=True)
                except Exception as e:  # noqa: BLE001
                    run.grad_error = e
                    return run
                by_input = dict(zip([id(t) for t in wrt], got))
                run.grads = [[by_input.get(id(ts[j])) for j in slots if ts[j].requires_grad]
                             for slots in program.slots]
    return run


# ----------------------------------------------------------------------------- comparing
def _tolerances(op: Any) -> Callable[[torch.dtype], tuple[float, float]]:
    """(rtol, atol) by an output's dtype: the op's own for PyTorch's decomposition/compile tests, else
    assert_close's."""
    return lambda dtype: _tolerance(op, dtype)


def _tolerance(op: Any, dtype: torch.dtype) -> tuple[float, float]:
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    rtol, atol = {torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}.get(dtype, (0.0, 0.0))
    for d in op.decorators:
        if not isinstance(d, DecorateInfo) or d.device_type not in (None, "cpu"):
            continue
        if (d.cls_name, d.test_name) not in {("TestDecomp", "test_comprehensive"), ("TestDecomp", "test_quick"),
                                             ("TestInductorOpInfo", "test_comprehensive"), ("TestCommon", None),
                                             ("TestCommon", "test_noncontiguous_samples")}:
            continue
        for dec in d.decorators:
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                rtol, atol = max(rtol, dec.d[dtype].rtol), max(atol, dec.d[dtype].atol)
    return rtol, atol


def _differs(expected: Any, actual: Any, tols: Callable[[torch.dtype], tuple[float, float]], what: str) -> str:
    """Why ``actual`` is not ``expected`` ("" when it is)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{what}: a {type(actual).__name__} where eager returns a tensor"
        if expected.dtype != actual.dtype:
            return f"{what}: dtype {actual.dtype} where eager's is {expected.dtype}"
        if expected.shape != actual.shape:
            return f"{what}: shape {tuple(actual.shape)} where eager's is {tuple(expected.shape)}"
        e, a = expected.detach(), actual.detach()
        if e.layout != a.layout:
            return f"{what}: layout {a.layout} where eager's is {e.layout}"
        if e.layout != torch.strided:  # sparse: the same layout, then the values where they stand
            return _differs(e.to_dense(), a.to_dense(), tols, what)
        if e.is_complex():  # the real and imaginary parts, each as a float of the complex's precision
            return _differs(torch.view_as_real(e.resolve_conj()), torch.view_as_real(a.resolve_conj()), tols, what)
        if e.is_floating_point():
            tol = tols(e.dtype)
            if not bool(torch.isclose(a, e, rtol=tol[0], atol=tol[1], equal_nan=True).all()):
                return f"{what}: {_first_mismatch(e, a, tol=tol)}"
            zero = (e == 0) & (a == 0)
            if bool((torch.signbit(e) != torch.signbit(a))[zero].any()):
                return f"{what}: signed zero differs: {_first_mismatch(e, a, signed=True)}"
            return ""
        if not torch.equal(e, a):
            return f"{what}: {_first_mismatch(e, a)}"
        return ""
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"{what}: {type(actual).__name__} where eager returns a {type(expected).__name__} of {len(expected)}"
        for i, (x, y) in enumerate(zip(expected, actual)):
            if (why := _differs(x, y, tols, f"{what}[{i}]")):
                return why
        return ""
    if isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected) and math.isnan(actual):
        return ""
    if expected != actual:
        return f"{what}: {actual!r} where eager returns {expected!r}"
    return ""


def _first_mismatch(e: torch.Tensor, a: torch.Tensor, signed: bool = False,
                    tol: tuple[float, float] = (0.0, 0.0)) -> str:
    if signed:
        bad = (e == 0) & (a == 0) & (torch.signbit(e) != torch.signbit(a))
    elif e.is_floating_point():
        bad = ~torch.isclose(a, e, rtol=tol[0], atol=tol[1], equal_nan=True)
    else:
        bad = e != a
    idx = bad.nonzero()
    if not len(idx):
        return "values differ"
    i = tuple(idx[0].tolist())
    ev, av = e[i].item(), a[i].item()
    if signed:
        ev, av = f"{ev!r}{'(-)' if torch.signbit(e[i]) else ''}", f"{av!r}{'(-)' if torch.signbit(a[i]) else ''}"
    return f"{int(bad.sum())} of {e.numel()} elements differ, first at {list(i)}: eager {ev}, ortlab {av}"


def _float64_judge(op: Any, case: _Case, expected: Any, actual: Any, grads_e: Any, grads_a: Any, grad: bool) -> bool:
    """Does float32 rounding explain the gap? (Note [Judging a float32 gap against float64])."""
    promotes = bool(getattr(op, "promotes_int_to_float", False))

    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            widen = v.dtype == torch.float32 or (promotes and not v.dtype.is_floating_point and v.dtype != torch.bool)
            w = v.detach().to(torch.float64) if widen else (
                v.detach().to(torch.complex128) if v.dtype == torch.complex64 else v.detach().clone())
            return w.requires_grad_(v.requires_grad) if w.is_floating_point() else w
        if isinstance(v, list):
            return [up(x) for x in v]
        if isinstance(v, tuple):
            return tuple(up(x) for x in v)
        if isinstance(v, dict):
            return {k: up(x) for k, x in v.items()}
        return v

    values = _sample_values(case.sample)
    if not any(t.dtype == torch.float32 or (promotes and not t.dtype.is_floating_point and t.dtype != torch.bool)
               for t in _tensors(values)):
        return False  # float64 already: eager is the reference
    inp, args, kwargs = up(values)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            ref = op.op(inp, *args, **kwargs)
            ref_grads = None
            if grad:
                ins = [t for t in _tensors((inp, args, kwargs)) if t.requires_grad]
                outs = [o for o in _leaves(ref) if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs and ins:
                    cot = [_cotangent(o, i).to(torch.float32).to(torch.float64) for i, o in enumerate(outs)]
                    ref_grads = torch.autograd.grad(outs, ins, cot, allow_unused=True)
    except Exception:  # noqa: BLE001 - no float64 reference: no excuse
        return False

    def close(e: Any, a: Any, r: Any) -> bool:
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor):
            if e.is_complex() and a.is_complex() and r.is_complex():
                e, a, r = (torch.view_as_real(t.detach().resolve_conj()) for t in (e, a, r))
            if not e.is_floating_point():
                return torch.equal(e, a)
            e64, a64, r64 = e.detach().double(), a.detach().double(), r.detach().double()
            if e64.shape != r64.shape or not torch.equal(e64.isnan(), a64.isnan()):
                return False
            fin = r64.isfinite() & e64.isfinite() & a64.isfinite()
            if not torch.equal(e64[~fin].nan_to_num(), a64[~fin].nan_to_num()):
                return False  # an infinity eager has and ortlab has not is no rounding error
            if not fin.any():
                return True
            err_e = (e64[fin] - r64[fin]).pow(2).mean().sqrt()
            err_a = (a64[fin] - r64[fin]).pow(2).mean().sqrt()
            return bool(err_a <= 2 * err_e + 1e-6)  # Inductor's same(fp64_ref): 2x eager's error, tol/10
        if isinstance(e, (list, tuple)) and isinstance(a, (list, tuple)) and isinstance(r, (list, tuple)):
            return len(e) == len(a) == len(r) and all(close(x, y, z) for x, y, z in zip(e, a, r))
        if e is None and a is None:
            return True
        return e == a

    if not close(expected, actual, ref):
        return False
    if grad and grads_e is not None:
        if ref_grads is None or grads_a is None:
            return False
        return close(list(grads_e), list(grads_a), list(ref_grads))
    return True


# ----------------------------------------------------------------------------- running an op
def _fallback_reasons(module: Any, program: _Program) -> tuple[dict[int, list[str]], list[str]]:
    """Fallback reasons per case (by source line) and those no case can be named for."""
    per: dict[int, list[str]] = {}
    loose: list[str] = []
    report = module.report
    for fb in report.fallbacks:
        i = program.case_of_source(fb.source) if fb.scope == "op" else None
        text = f"{fb.op or fb.scope}: {fb.reason}"
        if i is None:
            loose.append(text)
        else:
            per.setdefault(i, []).append(text)
    for reason in report.graph_breaks:
        text = f"graph break: {reason}"
        if text not in loose:
            loose.append(text)
    return per, loose


def _classify(op: Any, dtype: torch.dtype, case: _Case, ort: _Run, k: int, fallbacks: list[str],
              grad: bool) -> Outcome:
    name = full_name(op)
    base = Outcome(name, _dt(dtype), case.source, case.index, "", grad=grad, sample=_describe(case.sample))
    known = _known(name, _dt(dtype), case.sample)
    if case.eager_error is not None:
        if ort.error is None:
            base.outcome, base.detail = "no_error", f"eager raises {type(case.eager_error).__name__}: " \
                                                    f"{_line(case.eager_error)}; ortlab returned a value"
        elif _same_error(case.eager_error, ort.error):
            base.outcome, base.detail = "errors_alike", f"{type(ort.error).__name__}: {_line(ort.error)}"
        else:
            base.outcome, base.detail = "error_differs", (
                f"eager raises {type(case.eager_error).__name__}: {_line(case.eager_error)}; ortlab raises "
                f"{type(ort.error).__name__}: {_line(ort.error)}")
        if base.outcome != "errors_alike" and known:
            base.outcome, base.detail = "known", known
        elif base.outcome == "no_error" and _has_out(case.sample) and "out" in _line(case.eager_error).lower():
            base.outcome, base.detail = "known", OUT_REASON
        return base
    if ort.error is not None or ort.grad_error is not None:
        err = ort.error or ort.grad_error
        where = "forward" if ort.error is not None else "backward"
        base.outcome, base.detail = "crashed", f"{where}: {type(err).__name__}: {_line(err)}"
        if known:
            base.outcome, base.detail = "known", known
        return base
    expected_out, expected_grads, expected_after = case.eager
    tol = _tolerances(op)
    actual_out = ort.outputs[k]
    if name in UNDEFINED_VALUES:  # their values are whatever memory held: dtypes and shapes only
        expected_out, actual_out = _blank(expected_out), _blank(actual_out)
    why = _differs(expected_out, actual_out, tol, "output")
    if not why and grad and expected_grads is not None:
        got = ort.grads[k] if ort.grads is not None else None
        if got is None:
            why = "gradients: none where eager has them"
        else:
            why = _differs(list(expected_grads), list(got), tol, "gradient")
    if not why:
        why = _differs(expected_after, ort.inputs_after[k], tol, "input after the call")
    if why and "dtype" not in why and "shape" not in why and "signed zero" not in why:
        got = ort.grads[k] if ort.grads is not None else None
        if _float64_judge(op, case, expected_out, actual_out, expected_grads, got, grad):
            why = ""
    if why and known in SIGN_ONLY and not why.startswith(("output: signed zero", "output[0]: signed zero",
                                                          "gradient[0]: signed zero")):
        known = ""  # only a zero's sign is forgiven there
    if why:
        base.outcome, base.detail = ("known", known) if known else ("different", why)
    elif fallbacks:
        base.outcome, base.detail = "routed", "; ".join(dict.fromkeys(fallbacks))
    else:
        base.outcome = "matched"
    return base


# Ops whose outputs are uninitialized memory (PyTorch's own OpInfo tests skip their values too).
UNDEFINED_VALUES = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                              "new_empty_strided"})


def _blank(v: Any) -> Any:
    """``v`` with every tensor's values zeroed (dtype and shape kept)."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v.detach())
    if isinstance(v, (list, tuple)):
        return type(v)(_blank(x) for x in v)
    return v


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:200]


def _same_error(eager: BaseException, ort: BaseException) -> bool:
    return type(eager) is type(ort) or isinstance(ort, type(eager))


def _eager(program: _Program, grad: bool) -> _Run:
    return _execute(program, lambda m: m, grad)


def run_op(op: Any, dtype: torch.dtype, *, sources: Sequence[str] = ("sample", "reference", "error"),
           limit: int | None = None, chunk: int = _CHUNK,
           wrap: Callable[[nn.Module], nn.Module] | None = None) -> list[Outcome]:
    """Every sample of ``op`` in ``dtype`` through ORTModule and eager; one :class:`Outcome` each.

    Args:
        op: an OpInfo (:func:`find_op`).
        dtype: one of :data:`DTYPES` the op supports.
        sources: which OpInfo generators to take samples from.
        limit: at most this many samples (a quick run), in the generators' order.
        chunk: samples per generated module.
        wrap: what runs the module instead of eager (``ortlab.ORTModule``; tests of the harness
            pass a wrong one).
    """
    wrap = wrap or ortlab.ORTModule
    name = full_name(op)
    grad = _wants_grad(op, dtype)
    cases, outcomes = _cases(op, dtype, sources)
    if limit is not None:
        cases = cases[:limit]
    # eager alone, one sample at a time: which raise (those go through ortlab alone too)
    batchable: list[_Case] = []
    for i, case in enumerate(cases):
        solo = _Program(op, [case], f"{name} {_dt(dtype)} eager {i}")
        run = _eager(solo, grad and case.error_type is None)
        if run.error is not None:
            case.eager_error = run.error
        elif case.error_type is not None:
            continue  # an error input eager takes here (it raises on other devices): nothing to compare
        elif run.grad_error is not None:
            case.eager = (run.outputs[0], None, run.inputs_after[0])
        if case.eager_error is None:
            batchable.append(case)
        else:
            solo_ort = _execute(solo, wrap, False)
            outcomes.append(_classify(op, dtype, case, solo_ort, 0, [], False))
    # the rest in chunks; anything a chunk cannot attribute goes through alone
    queue = _chunks(batchable, chunk)
    n = 0
    while queue:
        group = queue.pop(0)
        n += 1
        program = _Program(op, group, f"{name} {_dt(dtype)} chunk {n}")
        case_grads = [grad and (c.eager is None or c.eager[1] is not None) for c in group]
        use_grad = grad and all(case_grads)
        eager = _eager(program, use_grad)
        if eager.error is not None or (use_grad and eager.grad_error is not None):
            if len(group) > 1:
                queue[:0] = [[c] for c in group]
                continue
            if eager.error is not None:  # random op drew differently: record as crash-free eager error
                group[0].eager_error = eager.error
            use_grad = False
            eager = _eager(program, False)
        ort = _execute(program, wrap, use_grad)
        per, loose = ({}, []) if ort.module is None or not hasattr(ort.module, "report") else \
            _fallback_reasons(ort.module, program)
        # A session onnxruntime refused routes every node of the refused op and dtype (ortlab.placement), the
        # chunk-mates' too: each case then runs alone, so that its outcome is its own.
        refused = any("onnxruntime rejects" in r or "onnxruntime has no" in r for rs in per.values() for r in rs)
        if len(group) > 1 and (ort.error is not None or ort.grad_error is not None or loose or refused):
            queue[:0] = [[c] for c in group]
            continue
        for k, case in enumerate(group):
            if case.eager_error is None:
                grads = eager.grads[k] if (use_grad and eager.grads is not None) else None
                case.eager = (eager.outputs[k], grads, eager.inputs_after[k])
            out = _classify(op, dtype, case, ort, k, per.get(k, []) + loose, use_grad and case.eager[1] is not None
                            if case.eager_error is None else False)
            if len(group) > 1 and not out.ok:  # make sure: alone, nothing else in the graph
                queue.insert(0, [case])
                continue
            outcomes.append(out)
    return outcomes


def _chunks(cases: list[_Case], size: int) -> list[list[_Case]]:
    out: list[list[_Case]] = []
    cur: list[_Case] = []
    elements = 0
    for c in cases:
        n = sum(t.numel() for t in _tensors(_sample_values(c.sample)))
        if cur and (len(cur) >= size or elements + n > _CHUNK_ELEMENTS):
            out.append(cur)
            cur, elements = [], 0
        cur.append(c)
        elements += n
    if cur:
        out.append(cur)
    return out


def summarize(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counts = {k: 0 for k in (*OK_OUTCOMES, *BAD_OUTCOMES)}
    for o in outcomes:
        counts[o.outcome] += 1
    return counts
