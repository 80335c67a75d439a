"""Where each op of a graph runs, onnxruntime or PyTorch, and why: the one home of that decision.

An op runs in PyTorch when (the ``kind`` of its :class:`Placement`):

* ``random``: a random op (dropout). Kept in PyTorch so the random stream is eager's:
  same seed, same masks, same result.
* ``known_wrong``: torchlib has a translation that gives wrong results in onnxruntime
  (see :data:`KNOWN_WRONG`).
* ``untranslatable``: torchlib (and ortlab's own translations) have none.
* ``user``: named in ``fallback_ops`` (``aten.gelu``, or ``aten.gelu@blocks.0`` for one module).
* ``translation_failed``: the translator raised on this node.
* ``kernel``: onnxruntime has no kernel for it on this provider and dtype (bf16 MatMul on CPU).

The first four are known before anything is exported (:func:`initial_placement`); the
last two come back from a failed export or session (:func:`culprits`), and the engine
retries without them. The toggles and ``fallback_ops`` use the same matcher
(:func:`selector_matches`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx

from ortlab._compat.torch import OpOverload, unset_fake_temporarily
from ortlab.errors import ExportError, FallbackError, SessionError, first_line
from ortlab.provenance import module_path, op_name, source_line
from ortlab.torchlib import is_translated
from ortlab.torchlib.translations import is_single_index_accumulate

__all__ = [
    "Placement",
    "KINDS",
    "RANDOM_OPS",
    "is_random",
    "KNOWN_WRONG",
    "normalize_op",
    "selector_matches",
    "matches",
    "initial_placement",
    "culprits",
    "check_raise",
]

# What each kind of decision means, for tables and docs.
KINDS: dict[str, str] = {
    "random": "random op: runs in PyTorch so the random stream matches eager PyTorch",
    "known_wrong": "torchlib's translation gives wrong results in onnxruntime",
    "untranslatable": "no ONNX translation in torchlib",
    "user": "named in fallback_ops",
    "translation_failed": "the ONNX translation failed on this node",
    "kernel": "onnxruntime has no kernel for it on this provider and dtype",
}

RANDOM_OPS = frozenset({
    "aten.native_dropout", "aten.bernoulli", "aten.rand", "aten.rand_like", "aten.randn", "aten.randn_like",
    "aten.randint", "aten.randperm", "aten.multinomial",
    # AOTAutograd's wrappers around a checkpointed region's random op (torch.utils.checkpoint, Hugging Face's
    # gradient checkpointing): the forward saves the generator's state and draws, the backward's recomputation
    # draws again from that state; both draw from PyTorch's generator, in order.
    "run_and_save_rng_state", "run_with_rng_state",
})


def is_random(node: torch.fx.Node) -> bool:
    """Does ``node`` draw from PyTorch's random stream? ``RANDOM_OPS``, and every op PyTorch tags as seeded
    (``normal``, ``exponential``, ``randint_like``, ``poisson``, ``rrelu_with_noise``...): run anywhere else, it
    would draw other numbers than eager's, silently (Note [Random ops keep their kernels] in
    ``ortlab.capture.decompositions``)."""
    target = node.target
    return node.op == "call_function" and (
        op_name(node) in RANDOM_OPS
        or (isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded in target.tags))


def _accumulating_index_put(node: torch.fx.Node) -> bool:
    accumulate = node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False)
    return bool(accumulate) and not is_single_index_accumulate(node)


def _output_padding_past_stride(node: torch.fx.Node) -> bool:
    """A transposed convolution whose output_padding reaches its stride (PyTorch allows it below the dilation)."""
    args = node.args
    if len(args) < 9 or not args[6]:
        return False
    stride, output_padding = args[3], args[7]
    return any(isinstance(p, int) and isinstance(s, int) and p >= s for p, s in zip(output_padding, stride))


_OUTPUT_PADDING = ("onnxruntime's ConvTranspose rejects an output_padding at least the stride (\"output_padding may "
                   "be too large for stride\"), which PyTorch allows below the dilation")


def _uses_secondary_outputs(node: torch.fx.Node) -> bool:
    """Something reads an output after the first (``getitem(node, i)`` with ``i >= 1``)."""
    return any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users)


# Note [topk's ties]
# Among equal values ONNX TopK returns the lowest index first; PyTorch's topk returns indices of its own
# choosing (its CPU kernel's heap order: the top 3 of ten zeros are at 8, 6 and 7). Ties are what users
# hit: zeros after a ReLU, masked -inf, small integers. The values agree whichever is chosen, but the
# indices, and where topk's gradient goes, do not: a topk whose indices are read (by the model, or by its
# backward) runs in PyTorch. The whole-sweep run found it (int64 samples with repeated values).
_TOPK_TIES = ("among equal values PyTorch's topk picks indices of its own (the top 3 of ten zeros are at 8, 6, 7) "
              "where ONNX TopK takes the lowest first: its indices, and where its gradient goes, would differ on ties")
_EMPTY_STATS = ("torchlib returns an empty placeholder for this attention kernel's logsumexp and other "
                "statistics, which its backward reads")
_ZERO_BAGS = ("torchlib fills embedding_bag's offset2bag, bag_size and max_indices with zeros of their shapes, and its "
              "backward reads them (mean and max bags' gradients came out wrong)")
_SCATTER_RACE = "onnxruntime's ScatterND(reduction=add) races on repeated indices (wrong, non-deterministic sums)"


def _inexact_in_float32(value: object) -> bool:
    return isinstance(value, float) and not math.isnan(value) and float(torch.tensor(value, dtype=torch.float32)) != value


# Ops whose translations hold constants of their own in float32 (1/6, selu's alpha, pi, pi/180, ln 2,
# ln 10) or compute in float32 (torchlib's celu casts to float32 for ONNX's Celu): in float64, sinc was
# off by 2e-6 relative and celu by 3e-7, deg2rad, log2 and log10 by 1e-8.
_FLOAT64_CONSTANTS = ("aten.selu", "aten.hardsigmoid", "aten.hardswish", "aten.celu", "aten.sinc",
                      "aten.special_sinc", "aten.deg2rad", "aten.rad2deg", "aten.log2", "aten.log10")
# p-norms, with where their p is (argument position, keyword; 2 when absent): torchlib's
# ``sum(|x|^p)^(1/p)`` holds 1/p as a float32 constant (F.normalize(p=3) and torch.dist(p=1.5) in
# float64 were off by 1e-7).
_P_NORMS = {"aten.linalg_vector_norm": (1, "ord"), "aten.norm": (1, "p"), "aten.dist": (2, "p"),
            "aten.renorm": (1, "p")}


def _inexact_p_norm(node: torch.fx.Node, where: tuple[int, str]) -> bool:
    position, keyword = where
    p = node.args[position] if len(node.args) > position else node.kwargs.get(keyword, 2)
    if p is None or not isinstance(p, (int, float)) or p in (0, 1, 2) or math.isinf(p) or math.isnan(p):
        return False  # ReduceL1, ReduceL2, counts, maxima: no constant
    return _inexact_in_float32(float(p)) or _inexact_in_float32(1 / p)


def _float64_with_numbers(node: torch.fx.Node) -> bool:
    """A float64 result the translation would compute with float32 numbers.

    Numbers float32 holds exactly (``0.0``, ``-inf``, ``0.5``) lose nothing; the ops of
    ``_FLOAT64_CONSTANTS`` carry constants of their own, and p-norms hold ``1/p``.
    """
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0] if val else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float64:
        return False
    name = op_name(node)
    if name in _FLOAT64_CONSTANTS:
        return True
    if name in _P_NORMS and _inexact_p_norm(node, _P_NORMS[name]):
        return True
    if name in ("aten.add", "aten.sub"):  # exact unless scaled by alpha
        return _inexact_in_float32(node.kwargs.get("alpha"))
    if name == "aten.pow":  # x ** 1.3 keeps its exponent exact; 1.3 ** x did not
        return bool(node.args) and _inexact_in_float32(node.args[0])
    return any(_inexact_in_float32(a) for a in (*node.args, *node.kwargs.values()))


# Note [float64 sine and cosine stay in PyTorch]
# onnxruntime's float64 Sin and Cos (CPU provider) reduce their argument less carefully than libm: near the
# functions' zeros they are up to 290,000 ulp off (200,000 uniform draws on [-10, 10]), cos(pi/2) is 0.0 and
# cos(-pi/2) -0.0 where libm (and PyTorch) give 6.1e-17, sin(pi) 0.0 where they give 1.2e-16; so polar(0, -pi/2)
# had a -0.0 real part. Their median is 1 ulp, float32's at most 1.4; exp, log, tanh and sqrt are within 6 ulp.
# A float64 sin or cos runs in PyTorch, and so does a complex128 polar (torchlib's is Cos and Sin).
_FLOAT64_TRIG = ("onnxruntime's float64 Sin and Cos are up to 290,000 ulp off near the functions' zeros "
                 "(cos(pi/2) is 0.0, cos(-pi/2) -0.0, where PyTorch gives 6.1e-17)")


def _float64_result(node: torch.fx.Node) -> bool:
    val = _node_val(node)
    return isinstance(val, torch.Tensor) and val.dtype in (torch.float64, torch.complex128)


_FLOAT32_NUMBERS = ("torchlib's ONNX form holds this op's Python numbers in float32 (an ONNX float attribute or "
                    "a float32 constant): in a float64 model that is an error of about 1e-8")
# Ops whose translations keep Python numbers in float32 (probed one by one against eager in
# float64; the others take ``ortlab.torchlib.translations.scalar_tensor``'s exact constants).
_FLOAT64_INEXACT = (
    "aten.full", "aten.full_like", "aten.fill", "aten.masked_fill", "aten.pow", "aten.leaky_relu", "aten.elu",
    "aten.hardtanh", "aten.softplus",
    "aten.threshold", "aten.addcmul", "aten.addcdiv", "aten.lerp", "aten.arange", "aten.linspace", "aten.add",
    "aten.sub", "aten.rrelu_with_noise",
    # Gemm's alpha and beta are float attributes: addmm(beta=0.3) in float64 was off by 7e-7 (addmv is mm and
    # exact multiplies already: ``addmv_as_mm``)
    "aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.addr",
    *_FLOAT64_CONSTANTS, *_P_NORMS,
)

# Note [Integers and empty reductions in PyTorch]
# What ortlab's exact integer translations (Note [Integer arithmetic stays integer] in
# ``ortlab.torchlib.integers``) and its guards cannot do, PyTorch does:
# * an integer ``pow`` with a tensor exponent: onnxruntime's Pow computes it in float64 (``3 ** 35`` off by 3,
#   ``3 ** 40`` saturated where PyTorch wraps); square-and-multiply over a tensor exponent is 63 rounds;
# * an integer ``prod`` over a size known only at run time (the exact translation multiplies halves pairwise
#   over a static size);
# * a reduction that PyTorch refuses over no elements (``x.max()`` of an empty tensor, ``x.max(1)`` over a
#   size-0 dim): onnxruntime returned NaN, -2**63 or failed in ArgMax with its own message. Dynamo
#   specializes sizes 0 and 1, so a size-0 dim is static: run in PyTorch, the op raises PyTorch's error;
# * ``argmax``/``argmin`` of bool, which PyTorch refuses and onnxruntime computed;
# * a Python number that the integer dtype cannot hold (``full(..., 2**40, dtype=int32)``,
#   ``masked_fill(int32_mask, 2**31)``): PyTorch raises "value cannot be converted to type int without
#   overflow", the translation wrapped it silently. Checked by converting it as PyTorch does, at capture.
_INT_POW = ("onnxruntime's Pow computes integer powers in float64: inexact above 2**53, saturating where "
            "PyTorch wraps")
_INT_PROD = ("onnxruntime's ReduceProd computes integer products in float64 (inexact above 2**53, saturating where "
             "PyTorch wraps), and ortlab's exact product needs a size known before the run")
_REDUCES_NOTHING = ("onnxruntime reduces no elements to NaN or the dtype's lowest value (or fails), where PyTorch "
                    "raises; runs in PyTorch, which raises PyTorch's error")
_BOOL_ARG = "PyTorch refuses argmax/argmin of bool (onnxruntime computed one); runs in PyTorch, which raises its error"
_UNREPRESENTABLE = ("a Python number this op's integer dtype cannot hold: PyTorch raises \"value cannot be converted "
                    "... without overflow\" (onnxruntime wrapped it); runs in PyTorch, which raises its error")


def _node_val(node: object) -> Any:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val[0] if isinstance(val, (tuple, list)) and val else val


def _integer_result(node: torch.fx.Node) -> bool:
    val = _node_val(node)
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex() \
        and val.dtype != torch.bool


def _integer_power_of_tensor(node: torch.fx.Node) -> bool:
    """An integer ``pow`` whose exponent is a tensor (``pow.Tensor_Scalar`` has an exact translation)."""
    return _integer_result(node) and getattr(node.target, "_overloadname", "") != "Tensor_Scalar"


def _integer_prod_of_unknown_size(node: torch.fx.Node) -> bool:
    from ortlab.torchlib.integers import static_reduced_size

    val = _node_val(node.args[0]) if node.args else None
    if not _integer_result(node) or not isinstance(val, torch.Tensor):
        return False
    dim = node.args[1] if len(node.args) > 1 and not isinstance(node.args[1], bool) else node.kwargs.get("dim")
    return static_reduced_size(tuple(val.shape), dim) is None


# Reductions PyTorch refuses over no elements: where their dim is (position, keyword); None: every dim.
_NOTHING_TO_REDUCE: dict[str, tuple[int, str] | None] = {
    "aten.max.default": None, "aten.min.default": None, "aten.max.dim": (1, "dim"), "aten.min.dim": (1, "dim"),
    "aten.amax": (1, "dim"), "aten.amin": (1, "dim"), "aten.argmax": (1, "dim"), "aten.argmin": (1, "dim"),
    "aten.aminmax": (1, "dim"), "aten.median.dim": (1, "dim"), "aten.nanmedian.dim": (1, "dim"),
    "aten.mode": (1, "dim"), "aten.kthvalue": (2, "dim"),
}


_REDUCTIONS_OF_SOMETHING = ("aten.max", "aten.min", "aten.amax", "aten.amin", "aten.argmax", "aten.argmin",
                            "aten.aminmax", "aten.median", "aten.nanmedian", "aten.mode", "aten.kthvalue")


def _reduces_nothing(node: torch.fx.Node) -> bool:
    """A reduction PyTorch refuses: over a dim of static size 0, or over every dim of a tensor with no elements."""
    name = op_name(node)
    key = name if name in _NOTHING_TO_REDUCE else f"{name}.{getattr(node.target, '_overloadname', '')}"
    if key not in _NOTHING_TO_REDUCE:
        return False
    val = _node_val(node.args[0]) if node.args else None
    if not isinstance(val, torch.Tensor):
        return False
    where = _NOTHING_TO_REDUCE[key]
    dim = None if where is None else (node.args[where[0]] if len(node.args) > where[0] else
                                      node.kwargs.get(where[1], -1 if name in ("aten.mode", "aten.kthvalue") else None))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return isinstance(val.numel(), int) and val.numel() == 0
    if val.dim() == 0:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim)
    return any(isinstance(val.shape[d], int) and val.shape[d] == 0 for d in dims)


def _argmax_of_bool(node: torch.fx.Node) -> bool:
    val = _node_val(node.args[0]) if node.args else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _unrepresentable_number(node: torch.fx.Node) -> bool:
    """A Python number among the node's arguments that its integer result's dtype cannot hold, as PyTorch
    converts it (``torch.scalar_tensor`` raises where ``full`` and ``masked_fill`` do)."""
    val = _node_val(node)
    if not _integer_result(node):
        return False
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            continue
        try:
            with unset_fake_temporarily():  # placement runs under AOTAutograd's FakeTensorMode, which converts anything
                torch.scalar_tensor(a, dtype=val.dtype)
        except RuntimeError:
            return True
    return False


_CONVERTS_NUMBERS = ("aten.full", "aten.full_like", "aten.new_full", "aten.fill", "aten.masked_fill",
                     "aten.scalar_tensor", "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.where",
                     "aten.index_fill")

_NAN_SIGN = ("reads the sign bit of a NaN (signbit(-nan) is True, copysign(1, -nan) is -1 in PyTorch; x86 makes 0/0 "
             "a -nan), which no ONNX operator reads: torchlib's form gave False and 1")


def _floating_input(node: torch.fx.Node) -> bool:
    """The op's last tensor argument (``signbit``'s input, ``copysign``'s ``other``) is floating."""
    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    val = tensors[-1].meta.get("val") if tensors else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


# Note [Fourier transforms stay in PyTorch]
# onnxruntime's DFT accumulates float32 sums less carefully than PyTorch's pocketfft: fft of a [5, 6, 7]
# tensor of unit normals was off by up to 1.7e-5 (a few times eager's own error against float64), in 19 of 420
# elements past the OpInfo tolerance; and in float64 a zero imaginary part came out -0.0 where pocketfft's is
# +0.0 (the fft of one element). Transforms run in PyTorch.
_FFT = ("onnxruntime's DFT is less accurate than PyTorch's pocketfft in float32 (1.7e-5 on unit values, several "
        "times eager's error against float64) and gives zero imaginary parts as -0.0 where PyTorch gives +0.0")
_FFTS = ("aten._fft_r2c", "aten._fft_c2c", "aten._fft_c2r", "aten.stft")


# torchlib translates antialiased upsampling as ONNX Resize with ``antialias=1``, whose weights are not PyTorch's
# (every one of 162 outputs of a 10x20 -> 3x3 bilinear resize differed, -2.30 against -0.34).
_ANTIALIAS = ("onnxruntime's antialiased Resize weighs the input otherwise than PyTorch's antialiased interpolation "
              "(values off by up to 2 on unit inputs)")

# Note [Complex constants stay in PyTorch]
# onnxruntime has no complex type. torchlib carries a complex tensor as float pairs (a trailing dim of 2, real
# and imaginary: Note [Complex values cross as float pairs] in ortlab.runtime.runner), and its complex ops
# translate on those pairs; but a complex Python number (``torch.where(c, 2j, x)``, ``z.masked_fill(m, 1j)``) or
# a new complex tensor (``torch.zeros(3, dtype=torch.complex64)``, ``torch.full((3,), 1 + 2j)``) became a
# complex64 ONNX constant, which onnxruntime refused when building the session: the whole graph then ran in
# PyTorch, or the op as a kernel failure. Such an op runs in PyTorch, and the graph around it in onnxruntime.
_COMPLEX_CONSTANT = ("a complex number or a new complex tensor: onnxruntime has no complex type, and torchlib's form "
                     "of complex tensors (real and imaginary parts as float pairs) has no complex constants")


# torchlib's complex add, sub, mul and div take a complex number as ``other`` (``z + 1j``, ``x / 1j``), not as
# ``self`` (``1j - x`` failed in the exporter) nor as ``alpha`` (``torch.add(z, z, alpha=2j)`` was silently
# wrong).
_COMPLEX_OTHER = ("aten.add", "aten.sub", "aten.mul", "aten.div")


def _makes_complex_constant(node: torch.fx.Node) -> bool:
    """A complex Python number among the node's arguments (but ``other`` of :data:`_COMPLEX_OTHER`), or a complex
    tensor made from no tensor."""
    args = [*node.args, *node.kwargs.values()]
    if op_name(node) in _COMPLEX_OTHER and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
        args = [node.args[0], *node.kwargs.values()]
    flat = [v for a in args for v in (a if isinstance(a, (list, tuple)) else (a,))]
    if any(isinstance(v, complex) for v in flat):
        return True
    val = _node_val(node)
    return (isinstance(val, torch.Tensor) and val.is_complex()
            and not any(isinstance(v, torch.fx.Node) and isinstance(_node_val(v), torch.Tensor) for v in flat))


def _any_node(node: torch.fx.Node) -> bool:
    return True


# Translations that exist but give wrong results in onnxruntime: (op, predicate, reason).
# ScatterND(reduction="add") on onnxruntime's CPU provider loses updates when indices
# repeat: we measured grads off by 10-30 on repeated tokens, different on every run.
# The embedding form has our own exact translation (ortlab/torchlib/translations.py);
# the others stay in PyTorch.
# Fused attention kernels: torchlib fills their secondary outputs with empty
# placeholders (``_aten__scaled_dot_product_flash_attention_fillin_empty_outputs``);
# a backward reading them in PyTorch computed gradients wrong by hundreds. The CPU
# kernel is traced as math (ortlab.capture.decompositions); should one reach export,
# it runs in PyTorch whole. ``embedding_bag``'s translation does the same with its bags' offsets,
# sizes and argmaxes: an EmbeddingBag(mode="mean") trained with every index's gradient
# equal, silently; it runs in PyTorch where anything reads them.
KNOWN_WRONG: tuple[tuple[str, Callable[[torch.fx.Node], bool], str], ...] = (
    ("aten._unsafe_index_put", _accumulating_index_put, _SCATTER_RACE),
    ("aten.index_put", _accumulating_index_put, _SCATTER_RACE),
    ("aten._scaled_dot_product_flash_attention_for_cpu", _uses_secondary_outputs, _EMPTY_STATS),
    ("aten._scaled_dot_product_flash_attention", _uses_secondary_outputs, _EMPTY_STATS),
    ("aten._scaled_dot_product_efficient_attention", _uses_secondary_outputs, _EMPTY_STATS),
    ("aten._scaled_dot_product_cudnn_attention", _uses_secondary_outputs, _EMPTY_STATS),
    ("aten.convolution", _output_padding_past_stride, _OUTPUT_PADDING),
    *((op, _uses_secondary_outputs, _ZERO_BAGS)
      for op in ("aten._embedding_bag", "aten.embedding_bag", "aten._embedding_bag_forward_only")),
    *((op, _float64_with_numbers, _FLOAT32_NUMBERS) for op in _FLOAT64_INEXACT),
    ("aten.topk", _uses_secondary_outputs, _TOPK_TIES),  # Note [topk's ties]
    *((op, _float64_result, _FLOAT64_TRIG) for op in ("aten.sin", "aten.cos", "aten.polar")),  # Note [float64 sine and cosine ...]
    # Note [Integers and empty reductions in PyTorch]
    ("aten.pow", _integer_power_of_tensor, _INT_POW),
    ("aten.prod", _integer_prod_of_unknown_size, _INT_PROD),
    *((op, _reduces_nothing, _REDUCES_NOTHING) for op in _REDUCTIONS_OF_SOMETHING),
    ("aten.argmax", _argmax_of_bool, _BOOL_ARG),
    ("aten.argmin", _argmax_of_bool, _BOOL_ARG),
    *((op, _unrepresentable_number, _UNREPRESENTABLE) for op in _CONVERTS_NUMBERS),
    # Note [Signs of NaN and of zero] in ortlab.capture.float_edges
    ("aten.signbit", _floating_input, _NAN_SIGN),
    ("aten.copysign", _floating_input, _NAN_SIGN),
    *((op, _any_node, _FFT) for op in _FFTS),  # Note [Fourier transforms stay in PyTorch]
    *((op, _any_node, _ANTIALIAS) for op in ("aten._upsample_bilinear2d_aa", "aten._upsample_bicubic2d_aa")),
)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The decision that one FX node runs in PyTorch, with its reason.

    Attributes:
        node: the FX node name.
        op: its op (``aten.native_dropout``).
        kind: one of :data:`KINDS`.
        reason: why, in words a user can act on.
        module: nn.Module path of the node; ``source``: the model code line.
    """

    node: str
    op: str
    kind: str
    reason: str
    module: str = ""
    source: str = ""

    @classmethod
    def of(cls, node: torch.fx.Node, kind: str, reason: str) -> Placement:
        return cls(node.name, op_name(node), kind, reason, module_path(node), source_line(node))


# --------------------------------------------------------------------------------- selectors
def normalize_op(name: str) -> str:
    """``gelu``, ``aten::gelu`` and ``aten.gelu`` all mean ``aten.gelu``.

    Example:
        >>> normalize_op("aten::gelu"), normalize_op("gelu")
        ('aten.gelu', 'aten.gelu')
    """
    name = name.replace("::", ".")
    return name if "." in name else f"aten.{name}"


def selector_matches(op: str, module: str, selector: str, target: str = "") -> bool:
    """Does a ``fallback_ops`` entry (``op`` or ``op@module.path``) select an op in a module?

    ``op`` may also name an overload (``aten.gelu.default``, compared with ``target``);
    ``@path`` selects that module and everything inside it.

    Example:
        >>> selector_matches("aten.gelu", "blocks.0.mlp", "gelu@blocks.0")
        True
    """
    wanted, _, scope = selector.partition("@")
    if scope and module != scope and not module.startswith(scope + "."):
        return False
    wanted = normalize_op(wanted)
    return op == wanted or (bool(target) and target == wanted)


def matches(node: torch.fx.Node, selector: str) -> bool:
    """Does ``selector`` (a ``fallback_ops`` entry) select FX node ``node``?"""
    return selector_matches(op_name(node), module_path(node), selector, str(node.target))


# ----------------------------------------------------------------------- decisions up front
def initial_placement(gm: torch.fx.GraphModule, fallback_ops: Sequence[str] = (),
                      cache_dir: str | None = None) -> dict[str, Placement]:
    """The nodes of ``gm`` that run in PyTorch before anything is exported, each with its reason."""
    out: dict[str, Placement] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        # random draws moved ahead (ortlab.pipeline.random_draws) carry their reason, on the node or its target
        drawn = node.meta.get("ortlab_random") or getattr(node.target, "_ortlab_random", None)
        if drawn is not None or is_random(node):
            out[node.name] = Placement.of(node, "random", drawn or KINDS["random"])
            continue
        wrong = next((reason for op, predicate, reason in KNOWN_WRONG if name == op and predicate(node)), None)
        if wrong is not None:
            out[node.name] = Placement.of(node, "known_wrong", wrong)
            continue
        if _makes_complex_constant(node):  # Note [Complex constants stay in PyTorch]
            out[node.name] = Placement.of(node, "known_wrong", _COMPLEX_CONSTANT)
            continue
        if not is_translated(node.target, cache_dir):
            out[node.name] = Placement.of(node, "untranslatable", f"no ONNX translation for {node.target} in torchlib")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for selector in fallback_ops:
            if matches(node, selector):
                out[node.name] = Placement.of(node, "user", f"named in fallback_ops ({selector!r})")
                break
    return out


# ------------------------------------------------------------------------- decisions after
_FAILED_NODE = re.compile(r"translating node %?(\w+)")
_NODE_IN_ERROR = re.compile(r"node with name '([^']+)'|[Nn]ode \(([^)]+)\)")


def failing_onnx_node(message: str) -> str | None:
    """The exported ONNX node an onnxruntime error message points at, if any."""
    from ortlab.provenance import onnx_node_of

    m = _NODE_IN_ERROR.search(message)
    name = next((g for g in m.groups() if g), None) if m else None
    return onnx_node_of(name) if name else None


def _value_dtype(node: Any) -> Any:
    """The dtype a kernel is chosen by: the first output's (Where's input is a bool mask)."""
    values = [v for v in node.outputs if v is not None] or [v for v in node.inputs if v is not None]
    return values[0].dtype if values else None


def culprits(
    error: Exception,
    nodes: dict[str, torch.fx.Node],
    model: Any = None,
    missing_kernels: Callable[[Any], Iterable[Any]] | None = None,
) -> dict[str, Placement]:
    """The FX nodes a failed export or session points at, each with its reason.

    Args:
        error: an ``ExportError`` (the translator names the node) or a ``SessionError``.
        nodes: the graph's FX nodes by name.
        model: the ONNX IR model the session was built from (session errors).
        missing_kernels: ``model -> nodes onnxruntime has no kernel for`` (probing each
            low-precision node; ``ortlab.runtime.kernels``), or None.

    A missing kernel (MatMul for bfloat16 on CPU) blocks every node of that ONNX op
    type and dtype at once, not one node per retry.
    """
    if isinstance(error, ExportError):
        m = _FAILED_NODE.search(f"{error} {error.__cause__ or ''}")
        if not m or m.group(1) not in nodes:
            return {}
        cause = error.__cause__
        root = cause.__cause__ if cause is not None and cause.__cause__ is not None else cause
        return {m.group(1): Placement.of(nodes[m.group(1)], "translation_failed",
                                         f"ONNX translation failed: {first_line(root or error)}")}
    if not isinstance(error, SessionError) or model is None:
        return {}
    found: dict[str, Placement] = {}
    if missing_kernels is not None:
        for n in missing_kernels(model):
            fx = n.metadata_props.get("ortlab.fx_node")
            if fx in nodes:
                found.setdefault(fx, Placement.of(nodes[fx], "kernel",
                                                  f"onnxruntime has no {n.op_type} kernel for {_value_dtype(n)}"))
        if found:
            return found
    text = f"{error} {error.__cause__ or ''}"
    onnx_name = failing_onnx_node(text)
    graph_nodes = list(model.graph) if onnx_name else []
    bad = next((n for n in graph_nodes if n.name == onnx_name), None)
    if bad is None:
        return {}
    dtype = _value_dtype(bad)
    verb = "has no kernel for" if "NOT_IMPLEMENTED" in text else "rejects"
    if dtype is None:  # no dtype to name: onnxruntime's own words (what "on None" said nothing about)
        status = re.search(r"Status Message: ([^\n]*)", text)
        said = status.group(1) if status else first_line(error)
        reason = f"onnxruntime {verb} ONNX {bad.op_type} ({bad.name}): {said[:200]}"
    else:
        reason = f"onnxruntime {verb} ONNX {bad.op_type} on {dtype}"
    for n in graph_nodes:
        fx = n.metadata_props.get("ortlab.fx_node")
        if n.op_type == bad.op_type and _value_dtype(n) == dtype and fx in nodes:
            found[fx] = Placement.of(nodes[fx], "kernel", reason)
    return found


def check_raise(placements: dict[str, Placement], where: str, fallback: str) -> None:
    """Raise ``FallbackError`` listing every op and why when ``fallback="raise"`` and any runs in PyTorch."""
    if not placements or fallback != "raise":
        return
    lines = [f"  {p.op} ({p.node}) at {p.module or '<root>'}: {p.reason}" for p in placements.values()]
    raise FallbackError(
        f"{len(placements)} op(s) of graph {where} would run in PyTorch, and fallback='raise':\n"
        + "\n".join(lines)
        + "\nRemove them from fallback_ops, change the model, or use fallback='warn'."
    )
