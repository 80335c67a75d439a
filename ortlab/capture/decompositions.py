"""The decomposition table AOTAutograd traces with (torchlib's op list is in ``ortlab.torchlib``).

We take torch.onnx's own "ONNX-friendly" table (torch's decompositions minus the
ops torchlib translates directly) and change it in three places, each a real gap:

* ``scaled_dot_product_attention`` is CompositeImplicit: on CPU autograd records
  ``_scaled_dot_product_flash_attention_for_cpu`` whose backward has no ONNX
  translation. ``capture.aot`` rewrites it to :func:`sdpa_math` in the Dynamo
  graph, before AOTAutograd differentiates it.
* training-mode batch norm: onnxruntime's BatchNormalization kernel uses the
  running statistics even with ``training_mode=1``; torch's decomposition computes
  the batch statistics with plain reductions (the input centred once: Note [A
  training BatchNorm's mean once]).
* ``nll_loss_forward``/``nll_loss_backward``: torchlib's backward ignores
  ``total_weight`` (gradients came out ``B*T`` times too large in our spike), so we
  use torch's decompositions instead.
* fused attention reached below Dynamo (``nn.MultiheadAttention`` calls it from
  ``F.multi_head_attention_forward``, which Dynamo keeps as one call, so the rewrite
  above never sees it): on CPU, AOTAutograd records
  ``_scaled_dot_product_flash_attention_for_cpu``, whose ``logsumexp`` output torchlib
  fills with an empty placeholder. Its backward ran in PyTorch on that placeholder and
  the in-projection's gradients came out wrong by hundreds (silently).
  :func:`flash_attention_for_cpu` and :func:`flash_attention_for_cpu_backward` trace
  both halves as math, with the real ``logsumexp``.
* float64 ``native_layer_norm``: torchlib's LayerNormalization keeps the mean and
  1/std it returns in float32 (``stash_type=1``), so a float64 model's backward got
  float32 saved statistics and onnxruntime refused to run it ("Unexpected input data
  type"). In float64 the op is traced through torch's decomposition (exact float64
  math); other dtypes keep the fused LayerNormalization.
* ``native_group_norm`` of an empty batch: torchlib's form (and torch's decomposition)
  reshape to ``(N, G, -1)``, which onnxruntime cannot infer from 0 elements (a raw
  onnxruntime error in training). An empty batch is traced as a per-channel scale and
  shift with no views (:func:`native_group_norm_exact`). In float64 it goes through
  torch's decomposition, for the reason float64 LayerNorm does (above).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ortlab._compat.torch import OpOverload, aten_decompositions, legacy_reduction, onnx_friendly_decompositions
from ortlab.capture.float_edges import float_edge_decompositions
from ortlab.capture.loss_edges import loss_edge_decompositions
from ortlab.capture.ranges import arange_end_float, arange_float, linspace_integer
from ortlab.errors import pytorch_error
from ortlab.torchlib import overload, translated_ops

__all__ = ["decomposition_table", "sdpa_math", "convolution_backward", "native_layer_norm_float64",
           "flash_attention_for_cpu", "flash_attention_for_cpu_backward", "native_group_norm_exact",
           "index_put_accumulate", "as_strided_scatter_contiguous", "avg_pool2d_backward", "avg_pool3d_backward",
           "adaptive_avg_pool3d", "adaptive_avg_pool3d_backward", "max_pool3d_with_indices_backward",
           "trilinear_as_einsum", "copy_broadcast", "mv_as_mm", "addmv_as_mm", "scatter_reduce_mean", "copysign",
           "fake_quantize_cachemask", "fake_quantize_per_channel_cachemask", "replication_pad_backward",
           "slice_scatter_nothing", "mean_of_nothing", "var_of_nothing", "multilabel_margin_loss",
           "diagonal_scatter", "adaptive_avg_pool2d_backward", "weight_norm_interface_backward", "gather_empty",
           "scatter_with_reduce", "index_add_shapes",
           "arange_float", "linspace_integer", "masked_scatter_of_a_bool_mask", "index_put_of_a_byte_mask",
           "nll_loss_backward_signed",
           "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "prims_prod"]

aten = torch.ops.aten

# Note [Random ops keep their kernels]
# torch's decompositions of random ops (exponential_ as -log(1 - rand_like), normal_ as
# randn * std + mean, cauchy_, geometric_, log_normal_, uniform_) draw other numbers than
# eager's kernels, or the same numbers in another order: with the same seed, a model that
# called ``exponential_`` in its forward trained on other noise than eager and left the random
# stream elsewhere. Random ops are traced as the ops they are, and run in PyTorch
# (``ortlab.placement.is_random``).
_DRAWS = frozenset({"bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "uniform", "rand_like",
                    "randn_like", "randint_like", "multinomial", "poisson", "random"})

# Ops whose torchlib translation gives wrong results; traced through torch's decomposition.
_FORCE_DECOMPOSE = (
    # Training-mode BatchNormalization: onnxruntime's CPU kernel ignores
    # training_mode and normalizes with the running statistics (outputs and
    # running stats diverged from eager at the first step).
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
    aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
    aten.nll_loss2d_forward.default,
    aten.nll_loss2d_backward.default,
)


@functools.lru_cache(maxsize=4)
def decomposition_table(cache_dir: str | None = None) -> dict[OpOverload, Callable]:
    """Decompositions for every op torchlib cannot translate (plus the forced ones)."""
    onnx_ops = {op for name in translated_ops(cache_dir) if not name.startswith("py:") and (op := overload(name))}
    table = onnx_friendly_decompositions(onnx_ops)
    # lift_fresh's decomposition aliases the *real* constant under FakeTensorMode and
    # AOTAutograd rejects it (``h[:, 0] = 0.0`` failed to capture); AOTAutograd handles
    # lift_fresh itself.
    table.pop(aten.lift_fresh.default, None)
    # Note [Random ops keep their kernels]: a random op decomposed draws other numbers than eager's kernel.
    for op in [op for op in table if op._opname.rstrip("_") in _DRAWS]:
        del table[op]
    for op in _FORCE_DECOMPOSE:
        if op in aten_decompositions:
            table[op] = aten_decompositions[op]
    for op in (aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
               aten.native_batch_norm.default):
        if op in table:
            functional = op is aten._native_batch_norm_legit_functional.default
            table[op] = _batch_norm_with_float_statistics(_batch_norm_one_mean(table[op], functional))
    table[aten.convolution_backward.default] = convolution_backward
    table[aten.index_put.default] = _first_of(index_put_of_a_byte_mask, index_put_accumulate)
    table[aten.as_strided_scatter.default] = as_strided_scatter_contiguous
    table[aten.avg_pool2d_backward.default] = avg_pool2d_backward
    table[aten.avg_pool3d_backward.default] = avg_pool3d_backward
    table[aten._adaptive_avg_pool3d.default] = adaptive_avg_pool3d
    table[aten._adaptive_avg_pool3d_backward.default] = adaptive_avg_pool3d_backward
    table[aten.max_pool3d_with_indices_backward.default] = max_pool3d_with_indices_backward
    table[aten.adaptive_max_pool2d_backward.default] = adaptive_max_pool2d_backward
    table[aten.adaptive_max_pool3d_backward.default] = adaptive_max_pool3d_backward
    table[aten._trilinear.default] = trilinear_as_einsum
    table[aten._weight_norm_interface_backward.default] = weight_norm_interface_backward
    table[aten._adaptive_avg_pool2d_backward.default] = adaptive_avg_pool2d_backward
    table[aten.copy.default] = copy_broadcast
    table[aten._softmax_backward_data.default] = _first_of(softmax_backward_data,
                                                           table[aten._softmax_backward_data.default])
    table[aten.mv.default] = mv_as_mm
    table[aten.addmv.default] = addmv_as_mm
    table[aten.scatter_reduce.two] = _of_a_scalar(scatter_reduce_mean, aten.scatter_reduce.two)
    for op in (aten.scatter.src, aten.scatter.value, aten.scatter_add.default):
        table[op] = _of_a_scalar(None, op)
    table[aten.gather.default] = gather_empty
    table[aten.scatter.reduce] = scatter_with_reduce
    table[aten.scatter.value_reduce] = scatter_with_reduce
    if aten.index_add.default in table:
        table[aten.index_add.default] = _first_of(index_add_shapes, table[aten.index_add.default])
    table[aten.arange.start_step] = arange_float
    table[aten.nll_loss_backward.default] = nll_loss_backward_signed
    table[aten.native_dropout_backward.default] = native_dropout_backward_in_order
    table[aten.nll_loss2d_backward.default] = nll_loss_backward_signed
    table[aten.masked_scatter.default] = masked_scatter_of_a_bool_mask
    table[aten.arange.start] = arange_float
    table[aten.arange.default] = arange_end_float
    for op in (aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
               aten.linspace.Scalar_Tensor):  # torch's for a float dtype (a tensor's ends: torchlib has none)
        table[op] = _first_of(linspace_integer, table[op]) if op in table else linspace_integer
    table[aten.copysign.Tensor] = copysign
    table[aten.copysign.Scalar] = copysign
    table[aten.slice_scatter.default] = slice_scatter_nothing
    for op in (aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
               aten.replication_pad3d_backward.default):
        table[op] = replication_pad_backward
    for op in (aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default):
        table[op] = _first_of(replication_pad_with_crop, table[op]) if op in table else replication_pad_with_crop
    table[aten.fake_quantize_per_tensor_affine_cachemask.default] = fake_quantize_cachemask
    table[aten.fake_quantize_per_channel_affine_cachemask.default] = fake_quantize_per_channel_cachemask
    table[aten.mean.dim] = mean_of_nothing
    table[aten.mean.default] = mean_of_nothing
    table[torch.ops.prims.var.default] = var_of_nothing
    table[torch.ops.prims.prod.default] = prims_prod
    table[aten.diagonal_scatter.default] = diagonal_scatter
    table[aten._unsafe_index_put.default] = index_put_accumulate
    table[aten.native_layer_norm.default] = native_layer_norm_float64
    table[aten.native_group_norm.default] = native_group_norm_exact
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = flash_attention_for_cpu
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = flash_attention_for_cpu_backward
    # NaN, infinities, signed zeros, boundaries and overflow as PyTorch's kernels (ortlab.capture.float_edges);
    # where the table holds another decomposition of the op, it runs where the float one does not apply.
    for op, fn in float_edge_decompositions().items():
        table[op] = _first_of(fn, table[op]) if op in table else fn
    # A loss's checks of its inputs, and its mean over an empty batch, as PyTorch's (ortlab.capture.loss_edges).
    for op, fn in loss_edge_decompositions().items():
        table[op] = _first_of(fn, table[op]) if op in table else fn
    return table


def _first_of(first: Callable, then: Callable) -> Callable:
    """A decomposition that is ``first``'s where it applies (anything but ``NotImplemented``), else ``then``'s."""

    def decomposition(*args: object, **kwargs: object) -> object:
        out = first(*args, **kwargs)
        return then(*args, **kwargs) if out is NotImplemented else out

    return decomposition


def _attention_scores(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                      scale: float | None) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """The masked scores, the scale, and the fully masked rows (Note [Fully masked rows of attention])."""
    s = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    scores = torch.matmul(query, key.transpose(-2, -1)) * s
    bias, rows = _attention_bias(query.size(-2), key.size(-2), attn_mask, is_causal, scores.dtype, query.device)
    return (scores if bias is None else scores + bias), s, rows


# Note [Fully masked rows of attention]
# A query row whose keys are all masked (a sequence that is all padding, left padding under a causal
# mask) has scores all -inf, and softmax of them is 0/0: NaN in that row, and through softmax's backward
# NaN in every gradient, so one all-padding sequence poisoned the whole step. PyTorch's attention gives
# that row 0 (its math path's ``_safe_softmax``; the CPU flash kernel the same) and so no gradient. Here
# the rows are found on the mask's own (small) shape: where a row of the combined bias is all -inf it is
# set to 0 (softmax then finite, uniform), and the output row is selected as +0.0 (``where(empty, 0, out)``,
# a Where whose condition is the mask's small shape), which also stops its gradient. A causal mask alone
# never empties a row (row i keeps key 0), so it costs nothing; with a mask, a reduction and a select on
# the mask's shape and one broadcast select of the output (0.36 ms on [8, 12, 128, 64], forward and
# backward). A huge finite negative mask (Hugging Face's ``finfo.min``) empties nothing, as in PyTorch.
# PyTorch also zeroes a row whose scores are -inf for another reason (an overflowing dot product); that
# row stays NaN here. ``nn.MultiheadAttention`` with ``need_weights=True`` computes its own softmax, NaN
# in PyTorch too.
def _attention_bias(seq_q: int, seq_k: int, attn_mask: torch.Tensor | None, is_causal: bool, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive bias of a causal and/or given mask (Note [Attention masks as additive biases]), in the mask's
    shape, and the ``[..., L, 1]`` rows it masks fully (None without a mask)."""
    bias = None
    if is_causal:
        bias = mask_bias(torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(), dtype)
    if attn_mask is None:
        return bias, None
    given = mask_bias(attn_mask, dtype) if attn_mask.dtype == torch.bool else attn_mask
    bias = given if bias is None else bias + given
    empty = (bias == float("-inf")).all(-1, keepdim=True)  # Note [Fully masked rows of attention]
    bias = torch.where(empty, torch.zeros((), dtype=bias.dtype, device=device), bias)
    return bias, empty


def _zero_rows(empty: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` with the fully masked rows +0.0 (Note [Fully masked rows of attention])."""
    if empty is None:
        return value
    return torch.where(empty, torch.zeros((), dtype=value.dtype, device=value.device), value)


# Note [Attention masks as additive biases]
# A boolean attention mask (``is_causal``'s triangle, or a bool ``attn_mask``) was applied as
# ``scores.masked_fill(~keep, -inf)``: an ONNX ``Where`` over the whole ``[B, H, L, S]`` score
# tensor in the forward, and another (the gradient's ``masked_fill(~keep, 0)``) in the backward.
# onnxruntime's CPU ``Where`` is a slow single-threaded select: 0.41 ms on ``[8, 4, 128, 128]``
# against 0.05 ms for a broadcast ``Add`` of a ``[128, 128]`` bias, ~4.5 ms of the 4-layer GPT's
# step in eight of them. So the mask becomes a bias of the mask's own (small) shape, 0 where kept
# and -inf where masked, added to the scores, as torch's own reference math attention does
# (``convert_boolean_attn_mask`` in ATen's ``_scaled_dot_product_attention_math``). For finite
# scores the results are the same bits: ``x + 0 == x`` (a -0.0 score becomes +0.0, which exp
# cannot tell apart), ``x + -inf == -inf``, and the backward's gradient at a masked position is
# ``p * (...)`` with ``p == exp(-inf) == 0``, the zero ``masked_fill`` wrote. They differ only
# where a masked score is itself +inf or NaN, as torch's math path does.
def mask_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep`` is True and -inf where it is False, in ``dtype`` and ``keep``'s shape."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(keep.logical_not(), float("-inf"))


def flash_attention_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> object:
    """CPU flash attention as math, returning the real ``logsumexp`` (see the module docstring)."""
    if dropout_p != 0.0 or query.size(1) != key.size(1):
        return NotImplemented
    scores, _, rows = _attention_scores(query, key, attn_mask, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value)
    out = _zero_rows(rows, out)  # Note [Fully masked rows of attention]
    # The flash kernel's output is laid out so that permute(2, 0, 1, 3) is contiguous, and
    # nn.MultiheadAttention views it that way; keep the same layout.
    out = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    return out, lse


def flash_attention_for_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> object:
    """The backward of :func:`flash_attention_for_cpu`: softmax attention's gradients from ``logsumexp``."""
    if dropout_p != 0.0 or query.size(1) != key.size(1):
        return NotImplemented
    scores, s, rows = _attention_scores(query, key, attn_mask, is_causal, scale)
    grad_out = _zero_rows(rows, grad_out)  # a fully masked row's output is 0, whatever its gradient
    attn = torch.exp(scores - logsumexp.unsqueeze(-1))
    grad_value = torch.matmul(attn.transpose(-2, -1), grad_out)
    grad_attn = torch.matmul(grad_out, value.transpose(-2, -1))
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = attn * (grad_attn - delta)
    grad_query = torch.matmul(grad_scores, key) * s
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query) * s
    return grad_query, grad_key, grad_value


# Note [Mixed-precision norms keep float32 statistics]
# Under autocast a norm takes a bf16 (or fp16) input with float32 weights or running statistics.
# PyTorch's CPU kernels then compute in float32 and return the output in the input's dtype but the
# saved mean and rstd in float32; torch's decompositions (and meta kernels) round those to the
# input's dtype, and the backward used the rounded ones: a BatchNorm's weight gradient, a sum of
# dy * (x - mean) that nearly cancels, came out 0.2% to many times off eager's under bf16 autocast,
# silently. Such a norm is decomposed as PyTorch's kernel computes it: in float32, the output cast
# back, the statistics kept in float32.
def _mixed_precision(input: torch.Tensor, *params: torch.Tensor | None) -> bool:
    return input.dtype in (torch.bfloat16, torch.float16) and any(
        isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)


# Note [A training BatchNorm's mean once]
# torch's decomposition computes a training BatchNorm's statistics with ``var_mean``, which torchlib
# writes as two means (``ReduceMean`` inside the variance, ``ReduceSum`` and ``Div`` for the mean it
# returns), then subtracts the mean from the input a second time for the output: onnxruntime merges
# neither. Here the input is centred once, for the variance and the output; the rest is torch's
# decomposition op for op (rsqrt, the weight, the bias), so the results are the same bits: ReduceMean,
# Sub, Mul, ReduceMean, Mul, Mul, Add, seven passes over the activation where there were nine.
# ResNet-18's forward (batch 16, 64x64, AMD EPYC Zen 4): 41.4 -> 39.8 ms.
#
# Tried: the output from onnxruntime's fused BatchNormalization kernel (inference mode, fed the
# batch's statistics), one pass instead of three (alone 38 against 84 us on [16, 64, 16, 16]). It
# gave the same forward time in the model, and it rounds as ``x * (w * rstd) + (b - mean * w * rstd)``:
# on ResNet-18's 2x2 maps, where a channel's variance is tiny, gradients then moved up to 340 times
# the parity tolerance away from eager's (closer to float64's, as it happened, but eager is the
# reference). The input gradient as two such kernels measured no faster either.
def _batch_norm_one_mean(decomposition: Callable, functional: bool) -> Callable:
    """torch's batch-norm decomposition, a training call's input centred once (Note [A training BatchNorm's mean
    once]); ``functional`` for ``_native_batch_norm_legit_functional``, which returns the new running statistics
    instead of writing them."""

    def batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                   momentum: float, eps: float) -> object:
        if not training:  # eager saves no statistics in eval: empty ones, where torch's decomposition has [C]
            out = decomposition(input, weight, bias, running_mean, running_var, training, momentum, eps)
            if isinstance(out, (tuple, list)) and len(out) >= 3:
                out = (out[0], out[1].new_empty((0,)), out[2].new_empty((0,)), *out[3:])
            return out
        if input.dtype not in (torch.float32, torch.float64):
            return decomposition(input, weight, bias, running_mean, running_var, training, momentum, eps)
        dims = [0, *range(2, input.dim())]
        per_channel = [1, input.shape[1]] + [1] * (input.dim() - 2)
        mean = torch.mean(input, dims, keepdim=True)
        centred = input - mean
        var = torch.mean(centred * centred, dims, keepdim=True)
        rstd = torch.rsqrt(var + eps)
        output = centred * rstd  # then the weight and the bias, rounded as torch's decomposition rounds them
        if weight is not None:
            output = output * weight.reshape(per_channel)
        if bias is not None:
            output = output + bias.reshape(per_channel)
        save_mean, save_rstd = mean.reshape(input.shape[1]), rstd.reshape(input.shape[1])
        new_mean, new_var = running_mean, running_var
        if running_mean is not None:
            new_mean = momentum * save_mean + (1 - momentum) * running_mean
        if running_var is not None:
            n = input.numel() / input.shape[1]
            new_var = momentum * (var.reshape(input.shape[1]) * (n / (n - 1))) + (1 - momentum) * running_var
        if functional:
            return output, save_mean, save_rstd, new_mean, new_var
        if running_mean is not None:
            running_mean.copy_(new_mean)
        if running_var is not None:
            running_var.copy_(new_var)
        return output, save_mean, save_rstd

    return batch_norm


def _batch_norm_with_float_statistics(decomposition: Callable) -> Callable:
    """torch's batch-norm decomposition, in float32 for a mixed-precision call (Note [Mixed-precision norms keep
    float32 statistics])."""

    def batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   *args: object) -> object:
        stats = [a for a in args[:2] if isinstance(a, torch.Tensor)]  # running_mean, running_var (when given)
        if not _mixed_precision(input, weight, bias, *stats):
            return decomposition(input, weight, bias, *args)
        out = decomposition(input.float(), weight, bias, *args)
        return (out[0].to(input.dtype), *out[1:])

    return batch_norm


def native_layer_norm_float64(
    input: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> object:
    """``native_layer_norm`` through torch's decomposition in float64 (see the module docstring), and in float32
    for a mixed-precision call (Note [Mixed-precision norms keep float32 statistics])."""
    decomposition = aten_decompositions[aten.native_layer_norm.default]
    if _mixed_precision(input, weight, bias):
        out, mean, rstd = decomposition(input.float(), normalized_shape, weight, bias, eps)
        return out.to(input.dtype), mean, rstd
    if input.dtype != torch.float64:
        return NotImplemented
    return decomposition(input, normalized_shape, weight, bias, eps)


def native_group_norm_exact(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                            n: int, c: int, hxw: int, group: int, eps: float) -> object:
    """``native_group_norm`` of an empty batch, without views (see the module docstring).

    With no elements, any form with the right shapes is exact: the output is the
    input scaled and shifted per channel (empty), the weight's and bias's gradients are
    sums over nothing (zeros, as eager's), and the statistics are empty ``(0, G)``.
    """
    if not (isinstance(input.shape[0], int) and input.shape[0] == 0):
        decomposition = aten_decompositions[aten.native_group_norm.default]
        if _mixed_precision(input, weight, bias):  # Note [Mixed-precision norms keep float32 statistics]
            out, mean, rstd = decomposition(input.float(), weight, bias, n, c, hxw, group, eps)
            return out.to(input.dtype), mean, rstd
        if input.dtype == torch.float64:  # GroupNormalization keeps its statistics in float32, as LayerNorm
            return decomposition(input, weight, bias, n, c, hxw, group, eps)
        return NotImplemented
    shape = [1, c] + [1] * (input.dim() - 2)
    out = input * weight.reshape(shape) if weight is not None else input.clone()
    if bias is not None:
        out = out + bias.reshape(shape)
    stats = input.new_zeros((0, group))
    return out, stats, stats.clone()


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: list[int] | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
    output_mask: list[bool],
) -> object:
    """``convolution_backward`` in ops onnxruntime runs well (torch has no decomposition).

    Without it, every CNN's backward sends each convolution's gradient to PyTorch. A transposed
    convolution's gradients are those of its adjoint, the ordinary convolution of dy. For 2-D
    convolutions, grad_input is a GEMM and a col2im, and grad_weight (kernels up to 3x3) one
    GEMM over the input's patches (see Note [Convolution gradients as GEMMs]). Otherwise
    grad_input is the transposed convolution of grad_output with the same weight, and
    grad_weight a convolution of the input with grad_output, batch and channels swapped
    (stride and dilation trade places). Grouped convolutions keep PyTorch's kernel
    (``NotImplemented`` leaves the op as it is).

    Grouped (depthwise) gradients were tried as the same GEMMs per group (batched MatMul, or
    for depthwise an outer product and a dot product per channel, over the kh*kw strided
    patches): correct, and the whole backward in one session, but a MobileNetV2's backward
    (batch 8, 96x96) took 300-400 ms against 210 ms with PyTorch's depthwise kernels between
    onnxruntime parts (eager: ~100 ms): the patches' strided Slices and their Concat alone
    cost ~80 ms a step. As convolutions (the input gradient a grouped ConvTranspose, the weight
    gradient one grouped convolution of the input with dy, batch and channels swapped within each
    group) they are exact too, and slower still: a MobileNetV2-shaped net's step 170 ms against
    100 ms split (eager 73-97 ms; both providers measured, the Xeon without AMX, 2026-11-27).
    They stay in PyTorch until a faster formulation exists.
    1x1 convolutions through batched GEMMs per image (no Pad, patches or Col2Im: 2-3x fewer
    copies) were no faster either: MobileNetV2 0.98x, a ResNet-50-shaped net 0.90x the
    step with one GEMM over the whole batch (MLAS runs one large GEMM better than B small ones).
    """
    if groups != 1:
        return NotImplemented
    spatial = list(range(2, grad_output.dim()))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0] and transposed:
        # conv_transpose(x, W) is the adjoint of conv(., W) with the same stride, padding and dilation:
        # x's gradient is conv(dy, W); an output_padding only adds positions no input reaches, cut off
        # (one at least the stride, allowed below the dilation, leaves one the convolution's floor keeps).
        grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, False,
                                              [0] * len(spatial), 1)
        for d in spatial:
            grad_input = grad_input.narrow(d, 0, input.shape[d])
    elif output_mask[0] and len(spatial) == 2:
        grad_input = _conv2d_input_grad(grad_output, input.shape, weight, stride, padding, dilation)
    elif output_mask[0]:
        out_pad = [
            input.shape[d] - ((grad_output.shape[d] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (weight.shape[d] - 1) + 1)
            for i, d in enumerate(spatial)
        ]
        grad_input = aten.convolution.default(
            grad_output, weight, None, stride, padding, dilation, True, out_pad, groups
        )
    if output_mask[1]:
        # A transposed convolution's weight gradient is that of conv(dy, W), x its output gradient.
        grad_weight = (_weight_grad(input, grad_output, weight.shape, stride, padding, dilation) if transposed
                       else _weight_grad(grad_output, input, weight.shape, stride, padding, dilation))
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *spatial])
    return grad_input, grad_weight, grad_bias


def _weight_grad(grad_output: torch.Tensor, input: torch.Tensor, weight_shape: torch.Size, stride: list[int],
                 padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The weight gradient of ``conv(input, W)`` given its output's gradient: one GEMM over the input's patches for
    2-D kernels up to 3x3 (Note [Convolution gradients as GEMMs]), otherwise a convolution of the input with
    grad_output, batch and channels swapped (stride and dilation trade places)."""
    spatial = list(range(2, grad_output.dim()))
    if len(spatial) == 2 and weight_shape[2] * weight_shape[3] <= 9:
        return _conv2d_weight_grad(grad_output, input, weight_shape, stride, padding, dilation)
    swapped = aten.convolution.default(
        input.transpose(0, 1), grad_output.transpose(0, 1), None, dilation, padding, stride, False,
        [0] * len(spatial), 1,
    )
    for d in spatial:
        swapped = swapped.narrow(d, 0, weight_shape[d])
    return swapped.transpose(0, 1)


# Note [Accumulating index_put as one scatter-add]
# ``index_put(self, indices, values, accumulate=True)`` is the backward of every gather by
# tensor indices: ``F.interpolate``'s (bilinear and nearest upsampling index with
# ``[None, None, rows[:, None], cols]``), advanced indexing ``h[:, :, i, j]``. torchlib
# translates it to ScatterND(reduction="add"), which onnxruntime's CPU kernel runs in
# parallel with no care for repeated indices (wrong sums; ``KNOWN_WRONG`` in
# ``ortlab.placement`` sends it to PyTorch and cuts the graph there: an upsampling's backward
# was two parts, four ``_unsafe_index_put`` between them for a bilinear one). Where the
# indexed dims are consecutive and the indices are integers, the same sums are one
# scatter-add along one dim: view ``self`` with the indexed dims as one, ``sum_j i_j *
# stride_j`` (negative indices wrapped as PyTorch wraps them) the index into it, and
# ``scatter_add`` (ScatterElements(reduction="add"), which adds repeated indices in turn) along
# it. Other forms (bool masks, indexed dims apart, symbolic sizes, a single index on dim 0,
# which torchlib's own translation already takes to ScatterElements) keep the op.


def index_put_accumulate(self: torch.Tensor, indices: list, values: torch.Tensor,
                         accumulate: bool = False) -> torch.Tensor:
    """``index_put(..., accumulate=True)`` as one ``scatter_add`` (Note [Accumulating index_put as one
    scatter-add]); ``NotImplemented`` for the forms it leaves to the op."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if (not accumulate or not dims or (len(indices) == 1 and dims == [0])
            or dims != list(range(dims[0], dims[-1] + 1))
            or any(indices[d].dtype in (torch.bool, torch.uint8) for d in dims)
            or any(not isinstance(n, int) for n in (*self.shape, *values.shape, *(n for d in dims
                                                                                   for n in indices[d].shape)))):
        return NotImplemented
    first, end = dims[0], dims[-1] + 1
    index = torch.broadcast_tensors(*(indices[d] for d in dims))
    count = math.prod(index[0].shape)
    if count == 0 or self.numel() == 0:  # nothing to add; empty tensors inside a graph are what plugins trip on
        return NotImplemented
    flat = None
    for d, i in zip(range(first, end), index):
        i = i.to(torch.int64)  # int32 indices, whose flat index could overflow; scatter_add takes int64
        i = torch.where(i < 0, i + self.shape[d], i)
        flat = i if flat is None else flat * self.shape[d] + i
    lead, rest = list(self.shape[:first]), list(self.shape[end:])
    shape = [*lead, *index[0].shape, *rest]
    v = values.expand(shape).reshape(*lead, count, *rest)
    where = flat.reshape([1] * len(lead) + [count] + [1] * len(rest)).expand(v.shape)
    summed = self.reshape(*lead, math.prod(self.shape[first:end]), *rest).scatter_add(first, where, v)
    return summed.reshape(self.shape)


# Note [Multilabel margin loss with its target slots masked]
# torch's decomposition of ``multilabel_margin_loss_forward`` (registered as the op's Python kernel
# at the Autograd key, so AOTAutograd differentiates it: ortlab's table never sees the op) gathers
# the input at every target slot, the slots after the first -1 included (read at index 0), and
# never masks them out: with any -1 in the target, which is the usual case (targets are padded
# with -1), the loss and its gradient came out other numbers than eager's (6.4 against 1.8),
# silently. ``capture.aot`` replaces ``F.multilabel_margin_loss`` in Dynamo's graph by
# :func:`multilabel_margin_loss`, the same math with the slots past the end masked, before
# AOTAutograd traces it.


def multilabel_margin_loss(input: torch.Tensor, target: torch.Tensor, size_average: bool | None = None,
                           reduce: bool | None = None, reduction: str | int = "mean") -> torch.Tensor:
    """``F.multilabel_margin_loss`` as math (Note [Multilabel margin loss with its target slots masked]): for each
    sample, the hinge ``max(0, 1 - (x[j] - x[k])) / C`` summed over its targets j (the slots before the first -1)
    and the classes k that are not targets; its gradient as PyTorch's kernel's (Note [Margin losses' gradients as
    PyTorch's kernels])."""
    name = _reduction_name(size_average, reduce, reduction)
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    per_sample = _MultilabelMargin.apply(x, t, name)
    if name == "none":
        return per_sample.reshape(input.shape[:-1])
    return per_sample


def _multilabel_terms(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hinges ``1 - x[j] + x[k]`` [N, slots, classes], where each counts (a target slot before the first -1
    against a class that is no target), and the slots' targets (0 past the end)."""
    classes = x.shape[-1]
    slot = torch.arange(classes, device=x.device)
    end = torch.amin(torch.where(t == -1, slot, classes), dim=-1, keepdim=True)
    counted = slot < end  # [N, slots]: the target slots before the first -1
    targets = torch.where(counted, t, 0)
    is_target = (torch.where(counted, t, -1).unsqueeze(-1) == slot).any(dim=1)  # [N, classes]
    hinge = 1.0 - torch.gather(x, -1, targets).unsqueeze(-1) + x.unsqueeze(1)  # [N, slots, classes]
    return hinge, counted.unsqueeze(-1) & ~is_target.unsqueeze(1), targets


class _MultilabelMargin(torch.autograd.Function):
    """The per-sample (``none``) or reduced multilabel margin loss of [N, C] inputs, with PyTorch's kernel's
    gradient: ``g`` for each active hinge at its class, ``-g`` at its target, times the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: torch.Tensor, reduction: str) -> torch.Tensor:  # noqa: ANN001
        hinge, counts, _ = _multilabel_terms(x, t)
        per_sample = torch.where(counts, hinge.clamp_min(0), 0.0).sum(dim=(1, 2)) / x.shape[-1]
        ctx.save_for_backward(x, t)
        ctx.reduction = reduction
        if reduction == "mean":
            return per_sample.mean()
        return per_sample.sum() if reduction == "sum" else per_sample

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:  # noqa: ANN001
        x, t = ctx.saved_tensors
        frames, classes = x.shape
        g = 1.0 / (frames * classes) if ctx.reduction == "mean" else 1.0 / classes
        hinge, counts, targets = _multilabel_terms(x, t)
        active = (counts & (hinge > 0)).to(x.dtype)  # [N, slots, classes]
        up = active.sum(1) * g  # each class k: g per active hinge against it
        down = torch.zeros_like(x).scatter_add(1, targets, active.sum(2) * g)  # each target: g per active hinge
        local = up - down
        go = grad_output.reshape(-1, 1) if ctx.reduction == "none" else grad_output
        return local * go, None, None


# Note [Margin losses' gradients as PyTorch's kernels]
# PyTorch's ``multi_margin_loss_backward`` and ``multilabel_margin_loss_backward`` kernels build each
# sample's gradient from the hinge terms (+0.0 where no hinge is active) and multiply it by the incoming
# gradient last, so a zero of the input's gradient has the sign of the incoming gradient: -0.0 for a
# negative one. Autograd through the losses' math (torch's decompositions run at the Autograd key, and
# Note [Multilabel margin loss with its target slots masked]) selects +0.0 there instead, and torch's
# ``multi_margin_loss`` of a 0-dim input with ``reduction="none"`` had shape [1] where eager's is [].
# Both losses are an autograd Function here whose backward is the kernel's: the hinge terms, the target's
# ``0 - sum``, then the product with the incoming gradient. AOTAutograd traces its forward and backward
# like any other code.


def _reduction_name(size_average: bool | None, reduce: bool | None, reduction: str | int) -> str:
    if size_average is not None or reduce is not None:
        return legacy_reduction(size_average, reduce)
    return ("none", "mean", "sum")[reduction] if isinstance(reduction, int) else reduction


class _MultiMargin(torch.autograd.Function):
    """``multi_margin_loss`` with PyTorch's kernel's gradient (Note [Margin losses' gradients as PyTorch's
    kernels]); the input is [N, C], the target [N]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, p: int, margin: float,  # noqa: ANN001
                weight: torch.Tensor | None, reduction: str) -> torch.Tensor:
        classes = x.shape[1]
        t = target.unsqueeze(1)
        z = margin - torch.gather(x, 1, t) + x
        active = (z > 0) & (torch.arange(classes, device=x.device) != t)
        h = z if p == 1 else z * z
        if weight is not None:
            h = h * weight[t]
        per_sample = torch.where(active, h, 0).sum(1) / classes
        ctx.save_for_backward(x, target, weight)
        ctx.p, ctx.margin, ctx.reduction = p, margin, reduction
        if reduction == "mean":
            return per_sample.mean()
        return per_sample.sum() if reduction == "sum" else per_sample

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:  # noqa: ANN001
        x, target, weight = ctx.saved_tensors
        frames, classes = x.shape
        g = 1.0 / (frames * classes) if ctx.reduction == "mean" else 1.0 / classes
        t = target.unsqueeze(1)
        z = ctx.margin - torch.gather(x, 1, t) + x
        others = torch.arange(classes, device=x.device) != t
        h = torch.ones_like(z) * g if ctx.p == 1 else 2 * g * z  # (full_like holds g in float32)
        if weight is not None:
            h = h * weight[t]
        local = torch.where((z > 0) & others, h, 0)
        local = torch.where(others, local, 0 - local.sum(1, keepdim=True))
        go = grad_output.reshape(-1, 1) if ctx.reduction == "none" else grad_output
        return local * go, None, None, None, None, None


def multi_margin_loss(input: torch.Tensor, target: torch.Tensor, p: int = 1, margin: float = 1.0,
                      weight: torch.Tensor | None = None, size_average: bool | None = None,
                      reduce: bool | None = None, reduction: str | int = "mean") -> torch.Tensor:
    """``F.multi_margin_loss`` with eager's shapes and gradient (Note [Margin losses' gradients as PyTorch's
    kernels]); PyTorch's own op for what it would reject."""
    name = _reduction_name(size_average, reduce, reduction)
    x, t = torch.atleast_2d(input), torch.atleast_1d(target)
    if (p not in (1, 2) or x.dim() != 2 or x.shape[1] == 0 or t.dim() != 1 or t.shape[0] != x.shape[0]
            or (weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[1]))
            or not x.is_floating_point() or name not in ("none", "mean", "sum")):
        return torch.nn.functional.multi_margin_loss(input, target, p, margin, weight, reduction=name)
    out = _MultiMargin.apply(x, t, p, margin, weight, name)
    return out.reshape(target.shape) if name == "none" and input.dim() < 2 else out  # eager's: the target's


def multi_margin_loss_c(input: torch.Tensor, target: torch.Tensor, p: int = 1, margin: float = 1.0,
                        weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """:func:`multi_margin_loss` in ``torch._C._nn.multi_margin_loss``'s signature (an int reduction)."""
    return multi_margin_loss(input, target, p, margin, weight, reduction=reduction)


# Note [prod's gradient as eager's]
# PyTorch's ``prod_backward`` chooses its formula by the data: with no zero in the input, ``g * (result / x)``;
# a full product with two or more zeros, zeros (+0.0); otherwise the zero-safe one, ``g`` times the products
# of the elements before and after each (``prod_safe_zeros_backward``); over one dim, the plain formula unless
# the tensor holds any zero. A traced graph (FakeTensors, torch.compile too) always takes the zero-safe one:
# equal values where nothing overflows, but zeros of other signs ([2, 3, 0, 0]: eager +0.0 everywhere, the
# traced graph ``g * 0``, -0.0 under a negative ``g``) and where ``result`` overflows or underflows other values.
# ``prod`` of a floating tensor that needs a gradient is an autograd Function here whose backward computes
# every formula and selects eager's by the data (the backward's graph runs all of them).


def _prod_safe_zeros_backward(grad: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """PyTorch's ``prod_safe_zeros_backward``: ``grad`` times the products before and after each element."""
    n = x.shape[dim]
    if n == 1:
        return grad.expand_as(x)
    ones = torch.ones_like(x.narrow(dim, 0, 1))
    before = torch.cat([ones, x.narrow(dim, 0, n - 1)], dim).cumprod(dim)
    after = torch.cat([ones, x.narrow(dim, 1, n - 1).flip(dim)], dim).cumprod(dim).flip(dim)
    return grad * (before * after)


class _Prod(torch.autograd.Function):
    """``prod`` (all elements, or over ``dim``) with eager's data-dependent gradient (Note [prod's gradient as
    eager's])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int | None, keepdim: bool,  # noqa: ANN001
                dtype: torch.dtype | None) -> torch.Tensor:
        out = torch.prod(x, dtype=dtype) if dim is None else torch.prod(x, dim, keepdim, dtype=dtype)
        ctx.save_for_backward(x, out)
        ctx.dim, ctx.keepdim = dim, keepdim
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        x, result = ctx.saved_tensors
        inp = x.to(grad.dtype)
        if inp.dim() == 0:
            return grad.to(x.dtype), None, None, None
        # The formula is chosen by indexing a stack of them, a Gather: a where would lose a -0.0 from its first
        # branch on onnxruntime's CPU provider (Note [A -0.0 from Where's first branch] in ortlab.runtime.cpu_rewrites).
        if ctx.dim is None:
            zeros = (inp == 0).sum()
            plain = grad * (result / inp)
            safe = _prod_safe_zeros_backward(grad, inp.reshape(-1), 0).view_as(inp)
            which = (zeros > 0).long() + (zeros > 1).long()  # no zero, one, more
            out = torch.stack([plain, safe, torch.zeros_like(inp)]).index_select(0, which.reshape(1))[0]
        else:
            dim = ctx.dim % inp.dim()
            g, r = (grad, result) if ctx.keepdim else (grad.unsqueeze(dim), result.unsqueeze(dim))
            plain, safe = (g * (r / inp)).expand_as(inp), _prod_safe_zeros_backward(g, inp, dim)
            out = torch.stack([plain, safe]).index_select(0, (inp == 0).any().long().reshape(1))[0]
        return out.to(x.dtype), None, None, None


def prod_call(input: torch.Tensor, dim: int | None = None, keepdim: bool = False, *,  # noqa: A002
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.prod``/``Tensor.prod`` with eager's gradient (Note [prod's gradient as eager's]); PyTorch's own op
    where no gradient is wanted, for other dtypes and for empty tensors."""
    if (not isinstance(input, torch.Tensor) or not input.requires_grad or not input.is_floating_point()
            or input.numel() == 0 or not isinstance(dim, (int, type(None))) or isinstance(dim, bool)
            or (dtype is not None and not dtype.is_floating_point)):
        if dim is None:
            return torch.prod(input, dtype=dtype)
        return torch.prod(input, dim, keepdim, dtype=dtype)
    return _Prod.apply(input, dim, keepdim, dtype)


# Note [softmax's gradient in eager's form]
# PyTorch's CPU kernel computes softmax's input gradient as ``y * (g - sum(g * y))``; torch's decomposition
# as ``g * y - y * sum(g * y)``. Where ``y`` is 0 (an exp that underflowed, a masked position) the first is
# ``0 * (g - s)``, a zero of the sign of ``g - s``, the second a difference of two zeros, mostly +0.0: the
# gradient's zeros under a fully masked or far-out position took other signs than eager's. Eager's form here,
# which also rounds as the kernel does.


def softmax_backward_data(grad_output: torch.Tensor, output: torch.Tensor, dim: int,
                          input_dtype: torch.dtype) -> object:
    """``_softmax_backward_data`` in eager's form (Note [softmax's gradient in eager's form]); ``NotImplemented``
    (torch's decomposition) for mixed or low-precision dtypes."""
    if grad_output.dtype != output.dtype or output.dtype not in (torch.float32, torch.float64) \
            or input_dtype != output.dtype:
        return NotImplemented
    return output * (grad_output - torch.sum(grad_output * output, dim=dim, keepdim=True))


# Note [mv as a matrix product]
# onnxruntime's CPU provider (1.32, optimization level 2 and above) fuses a Transpose into the MatMul
# it feeds (FusedMatMul with transA) and gets the product wrong when the other operand is a vector:
# ``torch.mv(W.t(), v)`` came out other numbers than eager's, silently, and so did every ``mv``'s
# backward (its vector's gradient is ``mv(A.t(), grad)``): spectral norm's power iteration
# (``torch.mv(W.H, u)``) trained on a sigma hundreds of times off. Checked on bare onnxruntime
# graphs: ``Transpose(A[5, 4]) @ b[5]`` and its batched form are wrong with the optimizations on
# and right with them off; a 1-D first operand, and a ``[5, 1]`` second, are right. ``mv`` is
# traced as ``mm`` of the vector as a one-column matrix, which the fusion gets right.


def mv_as_mm(self: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """``mv`` as ``mm`` with a one-column matrix (Note [mv as a matrix product])."""
    return torch.mm(self, vec.unsqueeze(1)).squeeze(1)


def addmv_as_mm(self: torch.Tensor, mat: torch.Tensor, vec: torch.Tensor, *, beta: complex = 1,
                alpha: complex = 1) -> torch.Tensor:
    """``addmv`` (torchlib: ``MatMul(mat, vec)``, the same fused Transpose) with its product as ``mm``
    (Note [mv as a matrix product]); ``beta == 0`` ignores ``self``, NaN included, as PyTorch does."""
    if not (mat.is_floating_point() or mat.is_complex()):  # integer addmv takes beta and alpha as integers
        beta, alpha = int(beta), int(alpha)  # (0.2 -> 0, as PyTorch's Scalar.to<int64_t>())
    product = mv_as_mm(mat, vec)
    product = product if alpha == 1 else product * alpha
    if beta == 0:
        return product
    return (self if beta == 1 else self * beta) + product


# Note [copysign as a where on the sign]
# torch's decomposition of ``copysign`` takes the sign from ``prims.signbit``, which has no ONNX
# translation and runs in PyTorch, and whose fake kernel says float32 where the op returns bool: the
# onnxruntime part after it expected a float input and ``torch.copysign`` crashed ortlab. With a Python
# number or an integer ``other`` the same ``where`` on ``other < 0`` keeps the graph whole. A floating
# ``other`` may hold a -0.0 or a -nan (x86 makes ``0 / 0`` one), and no ONNX operator reads a NaN's sign
# bit (``copysign(x, -nan)`` had been ``|x|``, PyTorch's ``-|x|``): that op stays whole and runs in
# PyTorch (``ortlab.placement.KNOWN_WRONG``).


def copysign(self: torch.Tensor, other: torch.Tensor | float) -> torch.Tensor:
    """``copysign`` as ``where(other is negative, -|self|, |self|)`` (Note [copysign as a where on the sign])."""
    out = torch.result_type(self, other)
    if not (out.is_floating_point or out.is_complex):  # integers and bools give the default float, as the op's
        out = torch.get_default_dtype()
    if isinstance(other, torch.Tensor) and other.is_floating_point():  # its NaNs' signs: the op, in PyTorch
        return NotImplemented
    magnitude = self.to(out).abs()
    if not isinstance(other, torch.Tensor):
        return magnitude.neg() if math.copysign(1.0, other) < 0 else magnitude
    # -|x| in Where's second branch: onnxruntime's Where writes a -0.0 from its first as +0.0 (copysign(0, -1) is
    # -0.0; Note [Where keeps -0.0 from its second branch only] in ortlab.capture.float_edges)
    return torch.where(other >= 0, magnitude, magnitude.neg())


# Note [scatter_reduce's mean as sums and counts]
# torchlib translates ``scatter_reduce(..., "mean")`` as a plain scatter (ONNX's ScatterElements has
# no mean): each target came out the last source written there, not the mean, silently
# (``torch_scatter``-style pooling of graph nodes, a mean over segments). PyTorch's kernel sums the
# sources (and ``self`` when ``include_self``) and divides by their count, floor division for
# integers; a target no source reaches keeps ``self``. The same with two ``scatter_add``.


def scatter_reduce_mean(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduce: str,
                        *, include_self: bool = True) -> object:
    """``scatter_reduce`` with ``reduce="mean"`` (Note [scatter_reduce's mean as sums and counts]), and a bool one
    in int32; ``NotImplemented`` for the other reductions, which torchlib translates right."""
    if self.dtype == torch.bool and src.dtype == torch.bool and reduce in ("amax", "amin", "sum", "prod"):
        # onnxruntime's CPU ScatterElements has no bool kernel with a reduction: as 0/1 in int32 (or, and)
        out = torch.scatter_reduce(self.to(torch.int32), dim, index, src.to(torch.int32), reduce,
                                   include_self=include_self)
        return out != 0
    if reduce != "mean":
        return NotImplemented
    if self.dtype == torch.bool:
        raise pytorch_error(NotImplementedError(  # Note [PyTorch's errors found at capture]
            "\"scatter_gather_tensor_cpu_reduce_mean\" not implemented for 'Bool'"))
    count = torch.zeros_like(self).scatter_add(dim, index, torch.ones_like(src))
    total = torch.zeros_like(self).scatter_add(dim, index, src)
    if include_self:
        total, count = total + self, count + 1
    else:
        total, count = torch.where(count > 0, total, self), count.clamp_min(1)
    if self.is_floating_point() or self.is_complex():
        return total / count
    return torch.div(total, count, rounding_mode="floor")


# Note [Scatters of a 0-dim tensor]
# PyTorch scatters into and gathers from a 0-dim tensor as into one of one element (dim 0 or -1), and
# accepts an index of another rank when it is empty. ONNX's ScatterElements and GatherElements want
# data and indices of one rank, at least 1: the backward of every ``max(dim)``, ``kthvalue``, ``median``,
# ``cummax``, ``sort``, ``topk`` and ``gather`` of a 0-dim tensor (a scatter of its gradient) failed in
# onnxruntime ("axis out of range"), as did those ops' forward. A 0-dim tensor's scatter is the scatter
# of its one-element view, with the index and source flattened (the source cut to the index's length);
# an empty index of another rank scatters nothing (``self``) and gathers nothing (an empty tensor of the
# index's shape). A source larger than the index (PyTorch reads its leading index-sized block) is cut to
# the index's shape, which ScatterElements requires (onnxruntime refused such a scatter).
# An empty index of the same rank does the same: PyTorch checks an index's dtype only when it has
# elements, so ``gather(x, 0, torch.tensor([], dtype=torch.uint8))`` runs in eager, and its gradient's
# ScatterElements with uint8 indices was refused by onnxruntime (the op then ran in PyTorch, "onnxruntime
# rejects ONNX ScatterElements on FLOAT", and with it every other scatter_add of the graph).


def _of_a_scalar(inner: Callable[..., object] | None, op: OpOverload) -> Callable[..., object]:
    """``op`` (a scatter) decomposed for a 0-dim ``self`` or an empty index of another rank (Note [Scatters of a 0-dim
    tensor]); ``inner(...)`` (or ``NotImplemented``, the op itself) otherwise."""

    def scatter(self: torch.Tensor, dim: int, index: torch.Tensor, src: object, *rest: object,
                **kwargs: object) -> object:
        if index.numel() == 0:  # of any rank and index dtype: nothing to write
            return self.clone()
        if self.dim() == 0:
            flat = index.reshape(-1)
            source = src.reshape(-1)[: flat.shape[0]] if isinstance(src, torch.Tensor) and src.dim() else src
            if isinstance(source, torch.Tensor) and source.dim() == 0:
                source = source.reshape(1)
            return op(self.reshape(1), 0, flat, source, *rest, **kwargs).reshape(())
        if isinstance(src, torch.Tensor) and src.dim() == index.dim() and src.shape != index.shape:
            # PyTorch reads the source's leading index-sized block; ScatterElements wants them alike
            src = src[tuple(slice(0, n) for n in index.shape)]
            return op(self, dim, index, src, *rest, **kwargs)
        return inner(self, dim, index, src, *rest, **kwargs) if inner is not None else NotImplemented

    return scatter


def gather_empty(self: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False) -> object:
    """``gather`` with an empty index: an empty tensor of the index's shape (Note [Scatters of a 0-dim tensor]);
    ``NotImplemented`` (torchlib's translation) otherwise."""
    if index.numel() == 0:
        return self.new_zeros(index.shape)
    return NotImplemented


def scatter_with_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, src: object, *, reduce: str) -> object:
    """``scatter(..., reduce="add" | "multiply")`` (deprecated, a tensor's or a number's), which torchlib does not
    translate (it ran in PyTorch), as ``scatter_add`` and ``scatter_reduce(..., "prod")``; a number is converted to
    ``self``'s dtype first, as PyTorch's kernel does (``value.to<scalar_t>()``)."""
    if reduce not in ("add", "multiply") or self.dtype == torch.bool:
        return NotImplemented
    if not isinstance(src, torch.Tensor):
        src = torch.scalar_tensor(src, dtype=self.dtype, device=self.device).expand(index.shape)
    if reduce == "add":
        return torch.scatter_add(self, dim, index, src)
    return torch.scatter_reduce(self, dim, index, src, "prod", include_self=True)


def index_add_shapes(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
                     alpha: object = 1) -> object:
    """``index_add``'s last check, PyTorch's (``index_func_meta_impl``), which torch's decomposition leaves out: a
    source whose shape but ``dim`` is not ``self``'s raised onnxruntime's error, or ran (``[3, 2]`` and ``[2, 2, 1]``,
    or a 0-dim ``self`` and a ``[1]`` source); ``NotImplemented`` (the decomposition, whose checks come first in
    PyTorch's order) otherwise."""
    if index.dim() > 1 or index.dtype not in (torch.int64, torch.int32) or self.dtype != source.dtype:
        return NotImplemented
    dim = dim % max(self.dim(), 1)
    if not (dim == 0 or dim < source.dim()) or index.numel() != (1 if source.dim() == 0 else source.shape[dim]):
        return NotImplemented
    self_sizes, source_sizes = list(self.shape), list(source.shape)
    if self.dim() and source.dim():
        del self_sizes[dim], source_sizes[dim]
    if self_sizes != source_sizes:
        raise pytorch_error(RuntimeError(  # Note [PyTorch's errors found at capture]
            "source tensor shape must match self tensor shape, excluding the specified dimension. "
            f"Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}"))
    return NotImplemented


# Note [Ranges as PyTorch counts them] and Note [Integer linspace as PyTorch's kernel]: ortlab.capture.ranges

# Note [Dropout's backward in eager's order]
# PyTorch's kernel computes ``(grad * mask) * scale``; its decomposition (and torchlib) computes
# ``grad * (mask * scale)``. For an integer gradient the two differ in the sign of a zero: eager's
# ``-8 * 0`` is the integer 0, then +0.0 once scaled, where ``-8 * 0.0`` is -0.0.


def native_dropout_backward_in_order(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``native_dropout_backward`` as PyTorch's kernel: the mask first, in the gradient's dtype, then the scale."""
    masked = grad_output * mask.to(grad_output.dtype)
    return masked * scale


# Note [nll_loss's gradient zero where eager's kernel writes nothing]
# PyTorch's CPU kernel fills the input's gradient with zeros and writes ``-weight * grad`` at each kept
# target. torch's decomposition scatters -1 into zeros (an ignored row's at class 0) and multiplies by the
# gradient, zeroed for ignored rows: ``-1 * 0`` and ``0 * -g`` are -0.0, so float64 cross-entropy's gradient
# had -0.0 where eager has +0.0 (an ignored row's class 0). Here the kept targets are a mask, and the
# gradient ``where(mask, -grad * weight, 0)``: eager's value at each target, +0.0 elsewhere. That ``where`` ran
# over the whole [N, classes] gradient (1.2 ms a step for the GPT benchmark's 1024 x 1000, a pass over
# 200 MB for a 50257-word vocabulary); now each row's one value, ``where(kept, -grad * weight[target], 0)``,
# is scattered into zeros (an ignored row writes +0.0 at class 0): the same floats, signs of zero
# included, from a fill and N writes, as eager's kernel does.


def nll_loss_backward_signed(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                             weight: torch.Tensor | None, reduction: int, ignore_index: int,
                             total_weight: torch.Tensor) -> torch.Tensor:
    """``nll_loss_backward`` and ``nll_loss2d_backward`` with eager's zeros (Note [nll_loss's gradient zero where
    eager's kernel writes nothing])."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:  # mean
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:
        target = target[0]
    target = target.unsqueeze(channel_dim)
    kept = target != ignore_index
    safe = torch.where(kept, target, 0)
    if self.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    value = -grad_output
    if weight is not None:
        value = value * weight[safe]
    value = torch.where(kept, value.expand(safe.shape).to(self.dtype), 0.0)
    return torch.zeros_like(self).scatter(channel_dim, safe, value)


_C10_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
              torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double"}


def masked_scatter_of_a_bool_mask(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> object:
    """``masked_scatter`` raises eager's error for a mask that is not bool (its fake kernel and torch's decomposition
    take a uint8 mask as one, silently); ``NotImplemented`` (torch's decomposition) otherwise."""
    if mask.dtype != torch.bool:
        raise pytorch_error(RuntimeError("masked_scatter_ only supports boolean masks, but got mask with dtype "
                                         f"{_C10_NAMES.get(mask.dtype, str(mask.dtype))}"))
    return NotImplemented


# Note [uint8 indices are masks]
# PyTorch takes a uint8 index tensor as a bool mask (deprecated, with a warning), and ``index_put`` with one such
# index and a one-element value on the CPU goes to ``masked_fill_``, which refuses a uint8 mask ("masked_fill_
# only supports boolean masks, but got mask with dtype unsigned char"). torchlib's ``index_put`` takes a uint8
# index for positions, which onnxruntime refused (ScatterND's and ScatterElements' indices are int64): the op ran
# in PyTorch after a failed session, reported as onnxruntime having no kernel. Here a uint8 index is the bool mask
# it stands for (torchlib's mask form, in onnxruntime), and the masked_fill case raises PyTorch's error at capture.


def index_put_of_a_byte_mask(self: torch.Tensor, indices: list, values: torch.Tensor,
                             accumulate: bool = False) -> object:
    """``index_put`` with uint8 indices as bool masks (Note [uint8 indices are masks]); ``NotImplemented``
    otherwise."""
    if not any(i is not None and i.dtype == torch.uint8 for i in indices):
        return NotImplemented
    defined = [(d, i) for d, i in enumerate(indices) if i is not None]
    if not accumulate and values.numel() == 1 and values.device.type == "cpu" and len(defined) == 1:
        d, mask = defined[0]  # PyTorch's canDispatchToMaskedFill: the mask's shape checked first, as there
        if mask.device == self.device and tuple(mask.shape) == tuple(self.shape[d:d + mask.dim()]):
            raise pytorch_error(RuntimeError("masked_fill_ only supports boolean masks, but got mask with dtype "
                                             "unsigned char"))
    masks = [i.bool() if i is not None and i.dtype == torch.uint8 else i for i in indices]
    return aten.index_put.default(self, masks, values, accumulate)


# Note [diagonal_scatter as a scatter into the flattened matrices]
# torch's decomposition of ``diagonal_scatter`` (the backward of every ``diagonal``, ``diag_embed``)
# writes through ``prims.copy_to`` into a view, which AOTAutograd refuses in a functional graph:
# the whole graph of a model taking a matrix's diagonal (a covariance loss's ``c.diagonal()``, a
# trace) ran in PyTorch. The diagonal of each matrix (``dim1`` rows, ``dim2`` columns, moved last)
# is a strided run of its flattened elements, from ``offset`` (above the main diagonal) or
# ``-offset * columns`` (below) in steps of ``columns + 1``: one ``scatter`` along the flattened
# dim writes ``src`` there (ScatterElements; each index once).


def diagonal_scatter(input: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0,
                     dim2: int = 1) -> object:
    """``diagonal_scatter`` as one scatter into the flattened matrices (Note [diagonal_scatter as a scatter into
    the flattened matrices]); torch's decomposition for symbolic or empty sizes."""
    if any(not isinstance(n, int) for n in (*input.shape, *src.shape)) or src.numel() == 0:
        return aten_decompositions[aten.diagonal_scatter.default](input, src, offset, dim1, dim2)
    x = input.movedim((dim1, dim2), (-2, -1))
    rows, cols = x.shape[-2:]
    start = offset if offset >= 0 else -offset * cols
    index = start + torch.arange(src.shape[-1], device=input.device) * (cols + 1)
    flat = x.reshape(*x.shape[:-2], rows * cols)
    flat = flat.scatter(-1, index.expand(src.shape), src.to(input.dtype))
    return flat.reshape(x.shape).movedim((-2, -1), (dim1, dim2))


# Note [A copy broadcasts its source]
# ``dst.copy_(src)`` (and ``dst[...] = src``, which functionalization turns into ``copy``) broadcasts
# ``src`` to ``dst``'s shape. torchlib translates ``copy`` as ``CastLike(src, dst)``, which keeps
# ``src``'s shape: ``torch.empty(4, 3).copy_(v)`` of a ``[3]`` vector came out ``[3]``, and its sum
# was a quarter of eager's (silently); ``F.affine_grid``'s base grid (``base[..., 0].copy_(linspace)``)
# crashed onnxruntime in its backward. A copy whose source has another shape is traced as the source
# cast and expanded to the destination's shape; an equal shape keeps the op.


def copy_broadcast(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> object:
    """``copy`` of a source of another shape as a cast and an expand (Note [A copy broadcasts its source]);
    ``NotImplemented`` (the op) where the shapes are equal."""
    if src.dim() == self.dim() and all(statically_known_true(a == b) for a, b in zip(src.shape, self.shape)):
        return NotImplemented  # symbolic sizes compared without a guard; unknown ones expand, which is exact anyway
    return src.to(dtype=self.dtype, device=self.device).expand(self.shape).clone()


# Note [An empty slice_scatter writes nothing]
# The gradient of a slice that selects nothing (``x[:0].sum(0)``, a loop's empty first window) is a
# ``slice_scatter`` of an empty source. torchlib's translation builds ScatterND indices from the
# slice's range, and onnxruntime rejected the empty update ("updates tensor should have shape equal
# to indices.shape[:-1] + ..."): the step crashed. Nothing is written: the result is ``self``.


def slice_scatter_nothing(self: torch.Tensor, src: torch.Tensor, dim: int = 0, start: int | None = None,
                          end: int | None = None, step: int = 1) -> object:
    """``slice_scatter`` of an empty source as ``self`` (Note [An empty slice_scatter writes nothing]);
    ``NotImplemented`` (the op) otherwise."""
    if any(isinstance(n, int) and n == 0 for n in src.shape):
        return self.clone()
    return NotImplemented


# Note [The mean of nothing is NaN]
# PyTorch's mean and variance over dims holding no elements (an empty batch's mean loss, ``x[:0].var(0)``)
# are NaN, 0 / 0; onnxruntime's ReduceMean gives 0 and torchlib's variance -0.0, a finite loss where
# eager's is NaN, silently. Where the reduced count is known to be 0 the result is NaN of the reduction's
# shape (its sum, plus NaN); any other count keeps the op.


def _reduced_count(self: torch.Tensor, dim: object) -> object:
    dims = range(self.dim()) if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else (
        [dim] if isinstance(dim, int) else dim)
    return math.prod(self.shape[d] for d in dims)


def mean_of_nothing(self: torch.Tensor, dim: object = None, keepdim: bool = False, *,
                    dtype: torch.dtype | None = None) -> object:
    """``mean`` over dims holding no elements as NaN (Note [The mean of nothing is NaN]); ``NotImplemented``
    (the op) otherwise."""
    count = _reduced_count(self, dim)
    if not (isinstance(count, int) and count == 0):
        return NotImplemented
    total = torch.sum(self, dim if dim is not None else [], keepdim=keepdim, dtype=dtype)
    return total + float("nan")


def var_of_nothing(self: torch.Tensor, dims: list[int] | None, correction: float = 1.0, *,
                   output_dtype: torch.dtype | None = None) -> object:
    """``prims.var`` over dims holding no elements as NaN (Note [The mean of nothing is NaN]); ``NotImplemented``
    (the op) otherwise."""
    count = _reduced_count(self, dims)
    if not (isinstance(count, int) and count == 0) or output_dtype is not None:
        return NotImplemented
    return torch.sum(self, dims if dims is not None else []) + float("nan")


# Note [A contiguous as_strided_scatter is a slice_scatter]
# AOTAutograd writes a gradient into a view it cannot name otherwise as ``as_strided_scatter``
# (``AdaptiveAvgPool1d``'s backward under Hugging Face Swin's pooler): torch decomposes it to
# ``prims.as_strided_scatter``, which has no ONNX translation, so the backward was cut around it
# in PyTorch. Where the base is contiguous and the view's strides are the contiguous ones of its
# size, the view is the flat elements ``[offset, offset + numel)`` of the base, and the scatter
# is a ``slice_scatter`` of the flattened source there (a reshape where it covers the whole
# base). Any other view keeps torch's decomposition.


def as_strided_scatter_contiguous(self: torch.Tensor, src: torch.Tensor, size: list[int], stride: list[int],
                                  storage_offset: int | None = None) -> torch.Tensor:
    """``as_strided_scatter`` of a contiguous view of a contiguous base as a ``slice_scatter`` (Note [A contiguous
    as_strided_scatter is a slice_scatter]); torch's decomposition otherwise."""
    offset = storage_offset or 0
    numel = math.prod(size)
    expected, step = [], 1
    for n in reversed(size):
        expected.insert(0, step)
        step *= n
    if (any(not isinstance(n, int) for n in (*self.shape, *self.stride(), *size, *stride, offset))
            or not self.is_contiguous() or self.storage_offset() != 0
            or any(s != e for n, s, e in zip(size, stride, expected) if n != 1)
            or offset + numel > self.numel() or numel == 0):
        return aten_decompositions[aten.as_strided_scatter.default](self, src, size, stride, storage_offset)
    flat = src.reshape(numel)
    if numel == self.numel():
        return flat.reshape(self.shape)
    return self.reshape(-1).slice_scatter(flat, 0, offset, offset + numel).reshape(self.shape)


# Note [Fake quantization as PyTorch's kernel computes it]
# ``fake_quantize_per_tensor_affine`` and ``..._per_channel_affine`` (quantization-aware training:
# ``torch.ao.quantization``'s observers and FakeQuantize) have no ONNX translation, so each cut the graph
# around it in PyTorch. PyTorch's CPU kernel computes ``q = zero_point + nearbyint(x * (1.0f / scale))``
# in float32, the output ``(clamp(q, quant_min, quant_max) - zero_point) * scale`` and the mask
# ``quant_min <= q <= quant_max`` (which the gradient is multiplied by); the same ops here, rounding half
# to even as ``nearbyint`` does, give its values bit for bit. float32 inputs only; others keep the op.


def _fake_quantized(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | float, quant_min: int,
                    quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and mask of PyTorch's fake quantization kernel, ``scale`` a float32 tensor that broadcasts to ``x``."""
    q = torch.round(x * (1.0 / scale)) + zero
    return (q.clamp(quant_min, quant_max) - zero) * scale, (q >= quant_min) & (q <= quant_max)


def _check_quant_range(quant_min: int, quant_max: int) -> None:
    """PyTorch's check of a fake quantization's range, with its message."""
    if quant_min > quant_max:
        raise pytorch_error(RuntimeError("`quant_min` should be less than or equal to `quant_max`."))


def fake_quantize_cachemask(self: torch.Tensor, scale: float, zero_point: int, quant_min: int,
                            quant_max: int) -> object:
    """``fake_quantize_per_tensor_affine_cachemask`` as math (Note [Fake quantization as PyTorch's kernel computes
    it]); ``NotImplemented`` (the op) for inputs other than float32."""
    if self.dtype != torch.float32:
        return NotImplemented
    _check_quant_range(quant_min, quant_max)
    if not quant_min <= zero_point <= quant_max:
        raise pytorch_error(RuntimeError("`zero_point` must be between `quant_min` and `quant_max`."))
    return _fake_quantized(self, torch.full((), scale, dtype=torch.float32), float(zero_point), quant_min, quant_max)


def fake_quantize_per_channel_cachemask(self: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                                        axis: int, quant_min: int, quant_max: int) -> object:
    """``fake_quantize_per_channel_affine_cachemask`` as math (Note [Fake quantization as PyTorch's kernel computes
    it]); ``NotImplemented`` (the op) for inputs other than float32."""
    if self.dtype != torch.float32 or scale.dtype != torch.float32 or zero_point.dtype not in (torch.int32,
                                                                                               torch.int64):
        return NotImplemented  # (a float zero_point, and the checks of its range, are the op's)
    _check_quant_range(quant_min, quant_max)
    shape = [1] * self.dim()
    shape[axis] = -1
    return _fake_quantized(self, scale.reshape(shape), zero_point.reshape(shape).to(torch.float32), quant_min,
                           quant_max)


# Note [Replication padding's backward as edge sums]
# ``replication_pad{1,2,3}d_backward`` has no ONNX translation, so a ``padding_mode="replicate"``
# convolution (or ``F.pad(mode="replicate")``) cut its backward around the op in PyTorch. Each padded
# element copies the input's edge element along one dim, so, one dim at a time from the last: the
# gradient of the kept middle, with the sums of the left and right pads added to the first and last
# element. Negative padding (a crop): the transpose of its gather, an index_add per dim (Note [Replication
# padding with a crop]).


def replication_pad_backward(grad_output: torch.Tensor, self: torch.Tensor, padding: list[int]) -> object:
    """``replication_pad{1,2,3}d_backward`` as slices and edge sums (Note [Replication padding's backward as edge
    sums]); ``NotImplemented`` (the op) for symbolic padding and sizes."""
    if any(not isinstance(p, int) for p in padding) or any(not isinstance(n, int) for n in self.shape):
        return NotImplemented
    if any(p < 0 for p in padding):  # a crop: the gather's transpose (Note [Replication padding with a crop])
        if 0 in self.shape:
            return NotImplemented
        grad = grad_output
        for k in range(len(padding) // 2):
            d = self.dim() - 1 - k
            left, right, n = padding[2 * k], padding[2 * k + 1], self.shape[d]
            if left or right:
                index = torch.clamp(torch.arange(n + left + right, device=grad.device) - left, 0, n - 1)
                shape = list(grad.shape)
                shape[d] = n
                grad = grad.new_zeros(shape).index_add(d, index, grad)
        return grad
    grad = grad_output
    for k in range(len(padding) // 2):
        d = self.dim() - 1 - k
        left, right, n = padding[2 * k], padding[2 * k + 1], self.shape[d]
        middle = grad.narrow(d, left, n)
        if n == 0 or (left == 0 and right == 0):
            grad = middle
            continue
        later = [0, 0] * (grad.dim() - 1 - d)  # F.pad's (before, after) pairs for the dims past ``d``
        for size, start, at in ((left, 0, 0), (right, left + n, n - 1)):
            if size:  # the pad's sum, laid on the edge element (zeros elsewhere along ``d``)
                total = grad.narrow(d, start, size).sum(d, keepdim=True)
                middle = middle + torch.nn.functional.pad(total, [*later, at, n - 1 - at])
        grad = middle
    return grad


# Note [Replication padding with a crop]
# A negative pad crops. onnxruntime's edge Pad crops first and then replicates the cropped edge, as
# PyTorch does, until the crop leaves nothing: then it fails ("Pad: invalid mode: 2 with zero effective
# input extent"), where PyTorch's kernel reads every output element at its index clamped into the input
# (``F.pad(x, (-4, 5), "replicate")`` of a width 4 is five copies of the last element). Any negative pad
# is done as PyTorch's kernel does it: one gather per padded dim at ``clamp(arange(out) - left, 0, n - 1)``.


def replication_pad_with_crop(self: torch.Tensor, padding: list[int]) -> object:
    """``replication_pad{1,2,3}d`` with a negative pad, as PyTorch's kernel indexes (Note [Replication padding with
    a crop]); ``NotImplemented`` (the op) for non-negative or symbolic padding, or an empty dim."""
    if any(not isinstance(p, int) for p in padding) or all(p >= 0 for p in padding):
        return NotImplemented
    out = self
    for k in range(len(padding) // 2):
        d = self.dim() - 1 - k
        left, right, n = padding[2 * k], padding[2 * k + 1], self.shape[d]
        if not isinstance(n, int) or n == 0:
            return NotImplemented  # PyTorch's own checks: keep the op
        if left == 0 and right == 0:
            continue
        index = torch.clamp(torch.arange(n + left + right, device=self.device) - left, 0, n - 1)
        out = torch.index_select(out, d, index)
    return out


# Note [Average pooling's backward as repeats and shifted sums]
# ``avg_pool2d_backward`` has no ONNX translation in torchlib and no decomposition in torch, so
# every average pooling (``F.avg_pool1d``/``avg_pool2d``: Funnel's sequence pooling, DenseNet's
# transitions, Inception's 3x3 branches) cut its graph's backward around the op in PyTorch.
# The gradient is each output's gradient divided by its window's divisor and added to every
# input of its window, and windows are products of one window per spatial dim, so it is done
# one dim at a time (H, then W), in plain ops every engine runs well:
# * the divisor map first: ``divisor_override``, or per output the window's size clipped to the
#   padded input (``count_include_pad``) or to the input itself, as PyTorch's kernel counts it;
#   a product of a row and a column, built from ``arange`` (constants the optimizer folds);
# * along a dim with kernel k and stride s, output o covers padded positions [o*s, o*s + k):
#   k == s is a repeat (expand and reshape), k < s a repeat and s - k zeros, k > s a sum of k
#   shifted copies of the gradient spread s apart (zeros between);
# * then the padding's rows are cut off, and rows no window covers (the last ones, without
#   ceil_mode) are zeros.
# A grouped ConvTranspose with a ones kernel says the same, but onnxruntime's CPU kernel runs a
# GEMM per channel, and a Col2Im runs on OpenVINO's reference kernel (Note [Input gradients of
# convolutions for OpenVINO] in ortlab.runtime.openvino).


def _pool_window_sizes(n_in: int, n_out: int, kernel: int, stride: int, pad: int,
                       count_include_pad: bool, like: torch.Tensor) -> torch.Tensor:
    """Per output position along one dim, how many positions its window counts (PyTorch's avg_pool2d)."""
    start = torch.arange(n_out, device=like.device) * stride - pad
    end = torch.clamp(start + kernel, max=n_in + pad)
    if count_include_pad:
        return end - start
    return torch.clamp(end, max=n_in) - torch.clamp(start, min=0)


def _pool_spread(grad: torch.Tensor, dim: int, n_in: int, kernel: int, stride: int, pad: int) -> torch.Tensor:
    """Each position of ``grad`` along ``dim`` added to its window's ``kernel`` inputs (Note [Average pooling's
    backward as repeats and shifted sums]): the input-sized gradient along ``dim``."""
    n_out, shape = grad.shape[dim], list(grad.shape)
    after = [0, 0] * (grad.dim() - 1 - dim)  # F.pad's (before, after) pairs for the dims past ``dim``
    taps = kernel if kernel <= stride else 1  # positions each output fills before the next output's
    # Each output laid over ``stride`` positions: its value on the first ``taps``, zeros on the rest.
    spread = grad.unsqueeze(dim + 1).expand(*shape[:dim + 1], taps, *shape[dim + 1:])
    if taps < stride:
        spread = torch.cat([spread, spread.new_zeros(*shape[:dim + 1], stride - taps, *shape[dim + 1:])], dim + 1)
    spread = spread.reshape(*shape[:dim], n_out * stride, *shape[dim + 1:])
    length = stride * (n_out - 1) + kernel  # the padded positions the windows reach
    if kernel <= stride:
        spread = spread.narrow(dim, 0, length)
    else:  # overlapping windows: ``kernel`` copies, each shifted one further
        spread = spread.narrow(dim, 0, stride * (n_out - 1) + 1)
        shifted = [torch.nn.functional.pad(spread, [*after, i, kernel - 1 - i]) for i in range(kernel)]
        spread = functools.reduce(torch.add, shifted)
    if pad + n_in > length:  # inputs past the last window (ceil_mode off) get no gradient
        spread = torch.nn.functional.pad(spread, [*after, 0, pad + n_in - length])
    return spread.narrow(dim, pad, n_in)


def _avg_pool_backward(spatial: int, grad_output: torch.Tensor, self: torch.Tensor, kernel_size: list[int],
                       stride: list[int], padding: list[int], count_include_pad: bool,
                       divisor_override: int | None) -> object:
    """``avg_pool{2,3}d_backward`` over the last ``spatial`` dims as repeats and shifted sums (Note [Average pooling's
    backward as repeats and shifted sums]); ``NotImplemented`` (the op in PyTorch) for symbolic or empty sizes."""
    if any(not isinstance(n, int) for n in (*grad_output.shape, *self.shape)) or self.numel() == 0:
        return NotImplemented
    kernel = list(kernel_size) * (spatial // len(kernel_size))
    step = list(stride or kernel) * (spatial // len(stride or kernel))
    pad = list(padding) * (spatial // len(padding))
    sizes, outs = self.shape[-spatial:], grad_output.shape[-spatial:]
    if divisor_override:
        grad = grad_output / divisor_override
    else:  # the window's count is the product of its count along each dim
        divisor = None
        for d in range(spatial):
            counts = _pool_window_sizes(sizes[d], outs[d], kernel[d], step[d], pad[d], count_include_pad,
                                        grad_output).reshape([-1] + [1] * (spatial - 1 - d))
            divisor = counts if divisor is None else divisor * counts
        grad = grad_output / divisor.to(grad_output.dtype)
    for d in range(spatial):
        grad = _pool_spread(grad, grad.dim() - spatial + d, sizes[d], kernel[d], step[d], pad[d])
    return grad


def avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: list[int], stride: list[int],
                        padding: list[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> object:
    """``avg_pool2d_backward`` as repeats and shifted sums (Note [Average pooling's backward as repeats and shifted
    sums]); ``NotImplemented`` (the op in PyTorch) for symbolic or empty sizes."""
    return _avg_pool_backward(2, grad_output, self, kernel_size, stride, padding, count_include_pad,
                              divisor_override)


def avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: list[int], stride: list[int],
                        padding: list[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> object:
    """``avg_pool3d_backward`` (video and volume nets' ``nn.AvgPool3d``), as the 2-D one over three dims."""
    return _avg_pool_backward(3, grad_output, self, kernel_size, stride, padding, count_include_pad,
                              divisor_override)


def max_pool3d_with_indices_backward(grad_output: torch.Tensor, self: torch.Tensor, kernel_size: list[int],
                                     stride: list[int], padding: list[int], dilation: list[int], ceil_mode: bool,
                                     indices: torch.Tensor) -> object:
    """``max_pool3d_with_indices_backward`` (no translation; torch decomposes only the 2-D one) as torch's 2-D
    decomposition does it: each output's gradient added at its index, flat over the volume of its plane
    (ScatterElements(add), which adds repeated indices in turn). ``NotImplemented`` (the op) for symbolic or empty
    sizes and low-precision floats (whose sums PyTorch's kernel keeps in float32)."""
    return _added_at_indices(grad_output, self, indices, 3)


def adaptive_max_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor, indices: torch.Tensor) -> object:
    """``adaptive_max_pool2d_backward`` (no translation; ``nn.AdaptiveMaxPool2d``, global max pooling in attention
    and pooling heads): as a max pool's, each output's gradient added at its index, flat over its plane, repeated
    indices of overlapping windows in turn as PyTorch's kernel adds them."""
    return _added_at_indices(grad_output, self, indices, 2)


def adaptive_max_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor, indices: torch.Tensor) -> object:
    """``adaptive_max_pool3d_backward``: as the 2-D one, flat over the volume of each plane."""
    return _added_at_indices(grad_output, self, indices, 3)


def _added_at_indices(grad_output: torch.Tensor, self: torch.Tensor, indices: torch.Tensor, dims: int) -> object:
    """A max pool's gradient: ``grad_output`` added at ``indices``, flat over the last ``dims`` dims of ``self``
    (ScatterElements(add), which adds repeated indices in turn). ``NotImplemented`` (the op) for symbolic or empty
    sizes and low-precision floats (whose sums PyTorch's kernel keeps in float32)."""
    if (any(not isinstance(n, int) for n in (*grad_output.shape, *self.shape)) or self.numel() == 0
            or grad_output.numel() == 0 or self.dtype not in (torch.float32, torch.float64)):
        return NotImplemented
    lead = list(self.shape[:-dims])
    flat = grad_output.new_zeros(*lead, math.prod(self.shape[-dims:]))
    return flat.scatter_add(-1, indices.reshape(*lead, -1), grad_output.reshape(*lead, -1)).reshape(self.shape)


def trilinear_as_einsum(i1: torch.Tensor, i2: torch.Tensor, i3: torch.Tensor, expand1: list[int], expand2: list[int],
                        expand3: list[int], sumdim: list[int], unroll_dim: int = 1) -> object:
    """``_trilinear`` (``nn.Bilinear``, ``F.bilinear``; no ONNX translation, so it and its two gradients ran in
    PyTorch) as the einsum it is: each input laid over the common dims but its ``expand`` ones, the product summed
    over ``sumdim``. torch's einsum decomposes into the same batched products PyTorch's kernel runs."""
    rank = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    if rank > len(letters):
        return NotImplemented
    subs = ["".join(letters[d] for d in range(rank) if d not in expand) for expand in (expand1, expand2, expand3)]
    out = "".join(letters[d] for d in range(rank) if d not in sumdim)
    return torch.einsum(f"{subs[0]},{subs[1]},{subs[2]}->{out}", i1, i2, i3)


def weight_norm_interface_backward(grad_w: torch.Tensor, saved_v: torch.Tensor, saved_g: torch.Tensor,
                                   saved_norms: torch.Tensor, dim: int) -> object:
    """``_weight_norm_interface_backward`` (weight normalization, ``w = g * v / ||v||``; no ONNX translation, so
    the weight's gradient cut the graph around PyTorch) as PyTorch's kernel computes it, in the norms' dtype
    (float32 for half weights): with ``a = sum(dw * v)`` over every dim but ``dim``, ``dg = a / ||v||`` and
    ``dv = g / ||v|| * (dw - v * a / ||v||^2)``."""
    dim = dim % saved_v.dim() if saved_v.dim() else 0
    dims = [d for d in range(saved_v.dim()) if d != dim]
    acc = saved_norms.dtype
    v, g, dw = saved_v.to(acc), saved_g.to(acc), grad_w.to(acc)
    norms = saved_norms.reshape(g.shape)
    a = (dw * v).sum(dims, keepdim=True) if dims else dw * v
    grad_g = (a / norms).to(saved_g.dtype)
    grad_v = (g / norms * (dw - v * (a / (norms * norms)))).to(saved_v.dtype)
    return grad_v, grad_g


def prims_prod(inp: torch.Tensor, dims: list[int] | None, *, output_dtype: torch.dtype | None = None) -> object:
    """``prims.prod`` (no translation; the gradients of ``prod`` and ``cumprod`` multiply through it, so each cut the
    backward around PyTorch) as ``prod`` over one dim at a time (ReduceProd); ``NotImplemented`` (the op) for empty
    or symbolic sizes."""
    if inp.numel() == 0 or any(not isinstance(n, int) for n in inp.shape):
        return NotImplemented
    out = inp
    for d in sorted({d % inp.dim() for d in (range(inp.dim()) if dims is None else dims)}, reverse=True):
        out = torch.prod(out, d)
    return out.to(output_dtype) if output_dtype is not None else out


def _dividing_kernel(sizes: Sequence[object], out: Sequence[object]) -> list[int] | None:
    """The kernel (and stride) of the average pool an adaptive one is where each output size divides its input's;
    None for other, empty or symbolic sizes."""
    if any(not isinstance(n, int) or n == 0 for n in (*sizes, *out)) or any(n % o for n, o in zip(sizes, out)):
        return None
    return [n // o for n, o in zip(sizes, out)]


def adaptive_avg_pool3d(self: torch.Tensor, output_size: list[int]) -> object:
    """``_adaptive_avg_pool3d`` (no ONNX translation) where the output divides the input: ``avg_pool3d`` with the
    quotients as kernel and stride; ``NotImplemented`` (the op) otherwise."""
    kernel = _dividing_kernel(self.shape[-3:], list(output_size))
    return NotImplemented if kernel is None else torch.nn.functional.avg_pool3d(self, kernel, kernel)


def adaptive_avg_pool3d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> object:
    """``_adaptive_avg_pool3d_backward`` where the output divides the input: average pooling's gradient;
    ``NotImplemented`` (the op) otherwise."""
    kernel = _dividing_kernel(self.shape[-3:], grad_output.shape[-3:])
    if kernel is None:
        return NotImplemented
    return avg_pool3d_backward(grad_output, self, kernel, kernel, [0, 0, 0], False, True, None)


def _adaptive_windows(n_in: int, n_out: int, like: torch.Tensor) -> torch.Tensor:
    """``[n_out, n_in]``: each adaptive pooling window's inputs along one dim, 1/size in them (PyTorch's windows:
    from ``floor(o * n_in / n_out)`` to ``ceil((o + 1) * n_in / n_out)``)."""
    out = torch.arange(n_out, device=like.device)
    start, end = (out * n_in) // n_out, ((out + 1) * n_in + n_out - 1) // n_out
    inputs = torch.arange(n_in, device=like.device)
    inside = (inputs[None, :] >= start[:, None]) & (inputs[None, :] < end[:, None])
    return inside.to(like.dtype) / (end - start)[:, None].to(like.dtype)


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, self: torch.Tensor) -> object:
    """``_adaptive_avg_pool2d_backward`` (``nn.AdaptiveAvgPool2d`` to anything but one pixel: VGG's 7x7, a pyramid
    pooling's 2x2 and 3x3, ``F.interpolate(mode="area")``), which had run in PyTorch between onnxruntime parts.

    Where the output divides the input the windows tile it, and the gradient is average pooling's
    (Note [Average pooling's backward as repeats and shifted sums]). Otherwise windows overlap and
    vary in size; they are products of one window per dim, so the gradient is ``R^T @ dy @ C``
    with R and C each dim's windows weighted by 1/size (``_adaptive_windows``, constants once
    folded): two small MatMuls. ``NotImplemented`` (the op) for symbolic or empty sizes."""
    if any(not isinstance(n, int) for n in (*grad_output.shape, *self.shape)) or self.numel() == 0:
        return NotImplemented
    (h, w), (oh, ow) = self.shape[-2:], grad_output.shape[-2:]
    if h % oh == 0 and w % ow == 0:
        kernel = [h // oh, w // ow]
        return avg_pool2d_backward(grad_output, self, kernel, kernel, [0, 0], False, True, None)
    rows, cols = _adaptive_windows(h, oh, grad_output), _adaptive_windows(w, ow, grad_output)
    return torch.matmul(torch.matmul(rows.t(), grad_output), cols)


def _conv2d_input_grad(grad_output: torch.Tensor, input_shape: torch.Size, weight: torch.Tensor,
                       stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """A 2-D convolution's input gradient as a GEMM and a col2im (see Note [Convolution gradients as GEMMs]).

    Each output position's gradient times the weight gives its patch's share of the input's
    gradient, (Ci*kh*kw, Co) @ (Co, Ho*Wo) per image; ``fold`` (ONNX ``Col2Im``) sums the
    patches back into the image. onnxruntime's ConvTranspose took 48 ms of a ResNet-18 step
    (batch 16, 64x64) for these.
    """
    batch, cout, ho, wo = grad_output.shape
    kh, kw = weight.shape[2], weight.shape[3]
    # One GEMM over every image (a broadcast matmul would become Expand + batched GEMM).
    go = grad_output.transpose(0, 1).reshape(cout, batch * ho * wo)
    cols = torch.mm(weight.reshape(cout, -1).t(), go).reshape(-1, batch, ho * wo).transpose(0, 1)
    return torch.nn.functional.fold(cols, (input_shape[2], input_shape[3]), (kh, kw), dilation=dilation,
                                    padding=padding, stride=stride)


def _conv2d_weight_grad(grad_output: torch.Tensor, input: torch.Tensor, weight_shape: torch.Size,
                        stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """A 2-D convolution's weight gradient as one GEMM over the input's patches (im2col).

    Note [Convolution gradients as GEMMs]
    The weight gradient is the correlation of the input with grad_output. As a convolution
    (batch and channels swapped, grad_output as the kernel) onnxruntime's CPU provider runs it
    with a kernel as large as the output, which its Conv handles poorly: in a ResNet-18 step
    (batch 16, 64x64) these convolutions took 77 ms, against 83 ms for eager's whole step.
    Gathering the input's kh*kw shifted (strided) views into one (B*Ho*Wo, Ci*kh*kw) matrix
    and multiplying by grad_output as (Co, B*Ho*Wo) is the same sum as one GEMM, which is
    what MLAS does best. The patches cost kh*kw copies of the input (``F.unfold`` would make
    the same matrix, but its export is two Gathers, 6x slower here than these slices).
    The input gradient goes the other way: a GEMM, then ``Col2Im`` sums the patches.

    The windows are taken from the input with batch and channels swapped, ``(Ci, B, H, W)``, and
    stacked as ``(Ci, kh*kw, B, Ho, Wo)``: that is already the (Ci*kh*kw, B*Ho*Wo) matrix, which
    the GEMM reads transposed. Stacked from the input as it is, ``(B, Ci, kh*kw, Ho, Wo)``, the
    patches needed a permute that moved every float on its own (ResNet-18, batch 16, 64x64:
    backward 128.5 -> 117.1 ms, Transpose 15.4 -> 8.2 ms, the step 1.054x; the same GEMM, the
    same gradients bit for bit). Swapping the input's first two dims moves rows of H*W floats.
    """
    kh, kw = weight_shape[2], weight_shape[3]
    batch, cout, ho, wo = grad_output.shape
    cin = input.shape[1]
    x = torch.nn.functional.pad(input.transpose(0, 1), (padding[1], padding[1], padding[0], padding[0]))
    patches = []
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            patches.append(x[:, :, top:top + stride[0] * (ho - 1) + 1:stride[0],
                             left:left + stride[1] * (wo - 1) + 1:stride[1]])
    cols = torch.stack(patches, dim=1).reshape(cin * kh * kw, batch * ho * wo)  # (Ci, kh*kw, B, Ho, Wo)
    go = grad_output.permute(1, 0, 2, 3).reshape(cout, batch * ho * wo)
    return torch.mm(go, cols.t()).reshape(cout, cin, kh, kw)


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` in its math form, differentiable op by op.

    Same semantics as torch's reference math implementation (including GQA).
    """
    seq_q, seq_k = query.size(-2), key.size(-2)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        rep = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    # Note [Attention masks as additive biases], Note [Fully masked rows of attention]
    bias, rows = _attention_bias(seq_q, seq_k, attn_mask, is_causal, scores.dtype, query.device)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs, value)
    return _zero_rows(rows, out)
