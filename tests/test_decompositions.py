"""ortlab's own decompositions (capture/decompositions.py) match eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortlab
from conftest import squared_loss_parity

RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize(
    "cfg",
    [dict(stride=1, padding=1, dilation=1), dict(stride=2, padding=0, dilation=2), dict(stride=3, padding=2, dilation=1),
     dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2)), dict(stride=2, padding=2, dilation=2)],
)
def test_convolution_backward_runs_in_onnxruntime_and_matches(cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, **cfg), nn.ReLU(), nn.Conv2d(5, 4, (3, 2), padding=1), nn.Flatten())
    om = squared_loss_parity(model, torch.randn(2, 3, 11, 9))  # outputs, input and parameter gradients
    assert not om.report.fallbacks
    # Note [Convolution gradients as GEMMs]: input gradients are a GEMM and a Col2Im, not ConvTranspose.
    (backward,) = [g for c in om.report.captures for g in c.graphs if g.name == "backward"]
    assert "ConvTranspose" not in backward.onnx_ops and backward.onnx_ops.get("Col2Im", 0) >= 1


@pytest.mark.parametrize("kernel,stride,padding", [(7, 2, 3), (1, 2, 0), (3, 1, 1)])
def test_resnet_shaped_convolution_gradients_match(kernel, stride, padding):
    """A ResNet's stem (7x7, stride 2: weight gradient as a convolution), its 1x1 stride-2 shortcut and a
    3x3 block (weight gradients as one GEMM over patches) against eager, input gradient included."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 8, kernel, stride, padding, bias=False)
    om = squared_loss_parity(model, torch.randn(2, 3, 17, 16))  # outputs, input and weight gradients
    assert not om.report.fallbacks


def test_grouped_convolution_backward_stays_in_pytorch_with_reason():
    torch.manual_seed(0)
    model = nn.Conv2d(4, 4, 3, groups=2)
    om = ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(1, 4, 6, 6)
    with pytest.warns(ortlab.FallbackWarning, match="convolution_backward"):
        om(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(om.weight.grad, model.weight.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("indices", [
    "upsample",        # [None, None, rows[:, None], cols]: F.interpolate's, each index repeated
    "negative",        # negative indices wrap
    "middle",          # the indexed dims between others: [None, i, j] on a 4-D tensor, one index int32
    "three",           # three consecutive indexed dims
    "broadcast_values",
])
def test_accumulating_index_put_as_one_scatter_add_matches_eager(indices):
    """Note [Accumulating index_put as one scatter-add]: the decomposition against the op itself, repeated indices
    summed."""
    from ortlab.capture.decompositions import index_put_accumulate

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    rows, cols = torch.arange(10) // 2, torch.arange(12) // 2
    idx, vshape = {
        "upsample": ([None, None, rows[:, None], cols], (2, 3, 10, 12)),
        "negative": ([None, None, -1 - rows[:, None], cols - 6], (2, 3, 10, 12)),
        "middle": ([None, torch.tensor([0, 2, 2, 1], dtype=torch.int32), torch.tensor([4, 4, 4, 0])], (2, 4, 6)),
        "three": ([None, torch.tensor([1, 1]), torch.tensor([[0], [4]]), torch.tensor([5, 5])], (2, 2, 2)),
        "broadcast_values": ([None, None, rows[:, None], cols], (12,)),
    }[indices]
    values = torch.randn(vshape, generator=g, dtype=torch.float64)
    expected = torch.ops.aten.index_put.default(base, idx, values, True)
    got = index_put_accumulate(base, idx, values, True)
    torch.testing.assert_close(got, expected)
    empty = [None, None, rows[:0, None], cols[:0]]
    assert index_put_accumulate(base, empty, base[:, :, :0, :0], True) is NotImplemented


def _one_part_per_graph_beside_eager(model: nn.Module, x: torch.Tensor) -> None:
    """One step beside eager: the same loss and gradients, nothing in PyTorch, one onnxruntime part per graph."""
    om = ortlab.ORTModule(copy.deepcopy(model))
    out, ref = om(x), model(x)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
    assert not om.report.fallbacks
    assert [len(g.parts) for c in om.report.captures for g in c.graphs] == [1, 1]


class _ConvThen(nn.Module):
    """A 3x3 convolution, ``op`` on its output (a function, or a module whose parameters train too), and a loss
    whose gradient differs at every element."""

    def __init__(self, op: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.op(self.conv(x))
        return (h * h.detach().sin()).sum()


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "indexing"])
def test_gathers_by_index_keep_their_backward_in_onnxruntime(mode):
    """An upsampling's backward had been cut around PyTorch's index_put (two parts, ScatterND's race kept out)."""

    def gather(h: torch.Tensor) -> torch.Tensor:
        if mode == "indexing":
            return h[:, :, torch.tensor([0, 2, 2, 1, -1])[:, None], torch.tensor([1, 1, 3, 3])]
        return nn.functional.interpolate(h, scale_factor=2, mode=mode)

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(_ConvThen(gather), torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize(("size", "stride", "offset"), [
    ([2, 32], [32, 1], 0),       # the whole base (AdaptiveAvgPool1d's backward under Swin's pooler)
    ([3, 4, 1], [4, 1, 1], 10),  # a contiguous run inside it
    ([4, 3], [1, 4], 0),         # a transposed view: torch's decomposition
])
def test_contiguous_as_strided_scatter_is_a_slice_scatter(size, stride, offset):
    """Note [A contiguous as_strided_scatter is a slice_scatter]: the same result as the op."""
    from ortlab.capture.decompositions import as_strided_scatter_contiguous

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g)
    src = torch.randn(size, generator=g)
    expected = torch.as_strided_scatter(base, src, size, stride, offset)
    torch.testing.assert_close(as_strided_scatter_contiguous(base, src, size, stride, offset), expected)


def test_adaptive_average_pool_1d_backward_runs_in_onnxruntime():
    """Swin's pooler (AdaptiveAvgPool1d over a transposed sequence) had cut its backward around as_strided_scatter."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.pool = nn.AdaptiveAvgPool1d(1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(self.lin(x).transpose(1, 2)).flatten(1).square().sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Pooled(), torch.randn(2, 5, 8))


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor"), [
    ((2, 2), None, (0, 0), False, True, None),    # DenseNet's transition: non-overlapping windows, a repeat
    ((3, 3), (1, 1), (1, 1), False, False, None),  # Inception's branch: overlapping, the padding left out
    ((2, 1), (2, 1), (0, 0), True, True, None),   # Funnel's sequence pooling, an odd length: ceil_mode
    ((3, 2), (2, 3), (1, 0), True, False, None),  # overlapping along H, gaps along W, the last rows uncovered
    ((3, 3), (2, 2), (1, 1), False, True, 5),     # divisor_override
])
def test_average_pooling_backward_as_repeats_and_shifted_sums(kernel, stride, padding, ceil_mode, count_include_pad,
                                                              divisor):
    """Note [Average pooling's backward as repeats and shifted sums]: the decomposition against the op."""
    from ortlab.capture.decompositions import avg_pool2d_backward

    g = torch.Generator().manual_seed(0)
    for shape in [(2, 3, 9, 7), (3, 8, 8)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        args = (kernel, stride or [], padding, ceil_mode, count_include_pad, divisor)
        grad = torch.randn(torch.ops.aten.avg_pool2d.default(x, *args).shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(avg_pool2d_backward(grad, x, *args),
                                   torch.ops.aten.avg_pool2d_backward.default(grad, x, *args))


@pytest.mark.parametrize("pool", ["densenet", "inception", "funnel", "avg_pool1d"])
def test_average_pooling_keeps_its_backward_in_onnxruntime(pool):
    """avg_pool2d_backward had no translation: every average pooling cut its backward around it in PyTorch."""

    def pooled(h: torch.Tensor) -> torch.Tensor:
        if pool == "densenet":
            return nn.functional.avg_pool2d(h, 2)
        if pool == "inception":
            return nn.functional.avg_pool2d(h, 3, stride=1, padding=1, count_include_pad=False)
        if pool == "funnel":  # Funnel's pooling of a [batch, 1, tokens, d] view, tokens odd
            return nn.functional.avg_pool2d(h.flatten(2).unsqueeze(1)[:, :, :-1], (2, 1), stride=(2, 1), ceil_mode=True)
        return nn.functional.avg_pool1d(h.flatten(2), 3, stride=2, padding=1)

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(_ConvThen(pooled), torch.randn(2, 3, 7, 6))


def test_diagonal_scatter_as_one_scatter_matches_the_op():
    """Note [diagonal_scatter as a scatter into the flattened matrices]: every offset and pair of dims."""
    from ortlab.capture.decompositions import diagonal_scatter

    g = torch.Generator().manual_seed(0)
    for shape in [(5, 7), (7, 5), (2, 3, 4)]:
        for dim1, dim2 in [(0, 1), (1, 0), (-1, -2), (0, -1)]:
            for offset in (-2, 0, 3):
                x = torch.randn(shape, generator=g, dtype=torch.float64)
                src = torch.randn(torch.diagonal(x, offset, dim1, dim2).shape, generator=g, dtype=torch.float64)
                if src.numel():
                    torch.testing.assert_close(diagonal_scatter(x, src, offset, dim1, dim2),
                                               torch.diagonal_scatter(x, src, offset, dim1, dim2))


def test_a_covariance_loss_on_a_diagonal_runs_in_onnxruntime():
    """Barlow Twins' loss (the cross-correlation's diagonal and the rest): torch's diagonal_scatter wrote through
    copy_to, AOTAutograd refused it, and the whole graph ran in PyTorch."""

    class Twins(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.proj(x), self.proj(x.flip(0))
            c = (a - a.mean(0)).t() @ (b - b.mean(0)) / x.shape[0]
            on = (c.diagonal() - 1).square().sum()
            off = (c - torch.diag_embed(c.diagonal())).square().sum()
            return on + 0.1 * off + torch.diagonal(c, 1).sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Twins(), torch.randn(8, 6))


@pytest.mark.parametrize("cfg", [
    dict(kernel_size=2, stride=2),                                     # UNet's up-convolution
    dict(kernel_size=4, stride=2, padding=1),                          # DCGAN's (weight gradient as a convolution)
    dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(kernel_size=3, stride=1, padding=2, dilation=3, output_padding=2),  # output_padding above the stride
])
def test_transposed_convolution_backward_runs_in_onnxruntime_and_matches(cfg):
    """A transposed convolution's gradients had run in PyTorch: x's is the convolution of dy with the same weight,
    W's that convolution's weight gradient."""
    from ortlab.capture.decompositions import convolution_backward

    g = torch.Generator().manual_seed(0)
    conv = nn.ConvTranspose2d(3, 4, **cfg).double()
    x = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    args = ([conv.stride[0]] * 2, [conv.padding[0]] * 2, [conv.dilation[0]] * 2, True, [conv.output_padding[0]] * 2, 1)
    dy = torch.randn(conv(x).shape, generator=g, dtype=torch.float64)
    expected = torch.ops.aten.convolution_backward.default(dy, x, conv.weight, [4], *args, [True, True, True])
    got = convolution_backward(dy, x, conv.weight.detach(), [4], *args, [True, True, True])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)

    torch.manual_seed(0)
    model = _ConvThen(nn.Sequential(nn.ReLU(), nn.ConvTranspose2d(4, 4, **cfg)))
    if cfg.get("output_padding", 0) < cfg["stride"]:
        _one_part_per_graph_beside_eager(model, torch.randn(2, 3, 5, 6))
        return
    # onnxruntime's ConvTranspose rejects this output_padding: the forward's runs in PyTorch, said why
    om = ortlab.ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 3, 5, 6)
    with pytest.warns(ortlab.FallbackWarning, match="output_padding"):
        out = om(x)
    out.backward()
    model(x).backward()
    for p, q in zip(model.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
    assert [(f.op, f.kind) for f in om.report.fallbacks] == [("aten.convolution", "known_wrong")]


@pytest.mark.parametrize("out", [(3, 2), (1, 1), (4, 4), "area"])
def test_adaptive_average_pooling_keeps_its_backward_in_onnxruntime(out):
    """_adaptive_avg_pool2d_backward had run in PyTorch between parts: tiling windows (8x8 to 4x4) are average
    pooling's gradient, overlapping ones (8x6 to 3x2, F.interpolate's area mode to 5x5) two MatMuls with each dim's
    windows."""
    from ortlab.capture.decompositions import adaptive_avg_pool2d_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 9, generator=g, dtype=torch.float64)
    for size in [(3, 2), (7, 9), (4, 5), (1, 1)]:
        dy = torch.randn(2, 3, *size, generator=g, dtype=torch.float64)
        torch.testing.assert_close(adaptive_avg_pool2d_backward(dy, x),
                                   torch.ops.aten._adaptive_avg_pool2d_backward.default(dy, x))

    def pooled(h: torch.Tensor) -> torch.Tensor:
        if out == "area":
            return nn.functional.interpolate(h, size=(5, 5), mode="area")
        return nn.functional.adaptive_avg_pool2d(h, out)

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(_ConvThen(pooled), torch.randn(2, 3, 8, 6 if out != (4, 4) else 8))


def test_a_one_dimensional_transposed_convolution_trains_in_onnxruntime():
    """A 1-D transposed convolution (a vocoder's or a sequence decoder's upsampling): its gradients are those of the
    ordinary convolution of dy, as in 2-D."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1),
                          nn.Flatten(), nn.Linear(2 * 14, 1))
    _one_part_per_graph_beside_eager(nn.Sequential(model, nn.Flatten(0)), torch.randn(1, 3, 7))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_replication_padding_backward_as_edge_sums_matches_the_op(dims):
    """Note [Replication padding's backward as edge sums]: against the op, pads of 0, 1 and past the input's size."""
    import itertools

    from ortlab.capture.decompositions import replication_pad_backward

    op = getattr(torch.ops.aten, f"replication_pad{dims}d_backward").default
    gen = torch.Generator().manual_seed(dims)
    for shape in ([2, 3] + [1] * dims, [2, 3] + [4, 5, 3][:dims], [1, 2] + [2, 1, 6][:dims]):
        for pads in itertools.product([0, 1, 7], repeat=2 * dims):
            if dims == 3 and len(set(pads)) > 2:
                continue
            x = torch.randn(shape, dtype=torch.float64, generator=gen)
            grad = torch.randn(nn.functional.pad(x, list(pads), mode="replicate").shape, dtype=torch.float64,
                               generator=gen)
            torch.testing.assert_close(replication_pad_backward(grad, x, list(pads)), op(grad, x, list(pads)))


def test_a_replicate_padded_convolution_keeps_its_backward_in_onnxruntime():
    """replication_pad2d_backward had no translation: ``padding_mode="replicate"`` cut the backward in PyTorch."""
    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(
        _ConvThen(nn.Conv2d(4, 4, 3, padding=2, padding_mode="replicate")), torch.randn(2, 3, 7, 6))


def test_fake_quantization_runs_in_onnxruntime_bit_for_bit():
    """Note [Fake quantization as PyTorch's kernel computes it]: quantization-aware training's fake quantization (per
    tensor and per channel) had no translation and cut the graph; now the same values, bit for bit, and gradients."""

    class QAT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scales", torch.rand(8, generator=torch.Generator().manual_seed(3)) * 0.2 + 0.01)
            self.register_buffer("zeros", torch.arange(8, dtype=torch.int32) % 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.fake_quantize_per_channel_affine(self.lin.weight, self.scales, self.zeros, 0, -128, 127)
            h = nn.functional.linear(torch.fake_quantize_per_tensor_affine(x, 0.1234567, 3, 0, 255), w, self.lin.bias)
            return torch.fake_quantize_per_tensor_affine(h, 0.05, 0, -128, 127)

    torch.manual_seed(0)
    eager = QAT()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.randn(16, 8) * 4
    x[0] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 0.0, 40.0]) * 0.1234567  # ties round to even; clamped
    out, ref = om(x), eager(x)
    assert torch.equal(out, ref)
    (out * torch.linspace(0, 1, out.numel()).view_as(out)).sum().backward()
    (ref * torch.linspace(0, 1, ref.numel()).view_as(ref)).sum().backward()
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
    assert not om.report.fallbacks
    from ortlab.capture.decompositions import fake_quantize_cachemask

    with pytest.raises(RuntimeError, match="`zero_point` must be between `quant_min` and `quant_max`"):
        fake_quantize_cachemask(x, 0.1, 300, 0, 255)  # eager's own check, where it would have raised


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor"), [
    (2, 2, 0, False, True, None), (3, 2, 1, True, False, None), ((1, 3, 2), (1, 2, 2), (0, 1, 1), False, True, None),
    (3, 1, 1, False, True, 5), (2, 3, 0, True, True, None),
])
def test_average_pooling_3d_backward_matches_the_op(kernel, stride, padding, ceil_mode, count_include_pad, divisor):
    """avg_pool3d_backward, as the 2-D one over three dims (Note [Average pooling's backward as repeats and shifted
    sums]): against the op, windows that overlap, skip, pad and run past the input."""
    from ortlab.capture.decompositions import avg_pool3d_backward

    x = torch.randn(2, 3, 5, 6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = nn.functional.avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    k, s, p = ([v] * 3 if isinstance(v, int) else list(v) for v in (kernel, stride, padding))
    args = (k, s, p, ceil_mode, count_include_pad, divisor)
    torch.testing.assert_close(avg_pool3d_backward(grad, x, *args),
                               torch.ops.aten.avg_pool3d_backward.default(grad, x, *args))


def test_three_dimensional_average_pooling_keeps_its_backward_in_onnxruntime():
    """avg_pool3d_backward, max_pool3d_with_indices_backward and adaptive 3-D pooling (to a divisor of the input) had
    no translation: a video net's poolings cut its backward, and its adaptive pooling its forward too, around
    PyTorch."""

    class Video(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv3d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = nn.functional.avg_pool3d(torch.relu(self.conv(x)), (1, 2, 2))
            h = nn.functional.max_pool3d(h, 2, stride=1, padding=1)  # overlapping windows: repeated indices
            h = nn.functional.adaptive_avg_pool3d(h, (5, 5, 2))
            return (h * h.detach().sin()).sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Video(), torch.randn(2, 3, 4, 8, 6))


def test_max_pooling_3d_backward_matches_the_op():
    """max_pool3d_with_indices_backward as a scatter-add at the indices: against the op, ties and overlaps included."""
    import itertools

    from ortlab.capture.decompositions import max_pool3d_with_indices_backward

    gen = torch.Generator().manual_seed(0)
    for k, s, p, d, ceil in itertools.product([2, 3], [1, 2], [0, 1], [1, 2], [False, True]):
        x = torch.randn(2, 3, 6, 7, 5, dtype=torch.float64, generator=gen)
        x[0, 0, :2, :2, :2] = 1.0  # a tie
        out, idx = nn.functional.max_pool3d(x, k, s, p, d, ceil, return_indices=True)
        grad = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        args = ([k] * 3, [s] * 3, [p] * 3, [d] * 3, ceil, idx)
        torch.testing.assert_close(max_pool3d_with_indices_backward(grad, x, *args),
                                   torch.ops.aten.max_pool3d_with_indices_backward.default(grad, x, *args))


def test_bilinear_layers_run_in_onnxruntime():
    """``_trilinear`` (nn.Bilinear) had no translation: it and its two gradients ran in PyTorch between parts; now
    the einsum it is, checked against the op on the forward's and the gradients' calls."""
    from ortlab.capture.decompositions import trilinear_as_einsum

    gen = torch.Generator().manual_seed(0)
    x1, x2, w, g = (torch.randn(*shape, dtype=torch.float64, generator=gen) for shape in ((5, 3), (5, 4), (2, 3, 4),
                                                                                           (5, 2)))
    for args in ((x1, w, x2, [1, 3], [0], [1, 2], [2, 3]), (g, w, x2, [2, 3], [0], [1, 2], [1, 3]),
                 (x1, g, x2, [1, 3], [2, 3], [1, 2], [0])):
        torch.testing.assert_close(trilinear_as_einsum(*args), torch.ops.aten._trilinear.default(*args))

    class Pairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bilinear = nn.Bilinear(5, 5, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bilinear(x, x.flip(1).tanh())  # [batch, tokens, features]: leading dims broadcast
            return (h * h.detach().sin()).sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Pairs(), torch.randn(2, 3, 5))


@pytest.mark.parametrize("kind", ["linear", "conv1d_last_dim"])
def test_weight_norm_backward_runs_in_onnxruntime(kind):
    """``_weight_norm_interface_backward`` (weight normalization's gradient; Wav2Vec2's positional convolution,
    vocoders) had no translation and cut the backward around PyTorch; now the kernel's math, checked against the op
    on the first and last dims in float32 and float64."""
    from ortlab.capture.decompositions import weight_norm_interface_backward

    gen = torch.Generator().manual_seed(0)
    for shape, dim in (((6, 8), 0), ((6, 8), 1), ((4, 3, 5), 0), ((4, 3, 5), 2)):
        for dtype in (torch.float32, torch.float64):
            v = torch.randn(shape, dtype=dtype, generator=gen)
            g = torch.randn([n if d == dim else 1 for d, n in enumerate(shape)], dtype=dtype, generator=gen)
            w, norms = torch.ops.aten._weight_norm_interface(v, g, dim)
            dw = torch.randn(w.shape, dtype=dtype, generator=gen)
            expected = torch.ops.aten._weight_norm_interface_backward(dw, v, g, norms, dim)
            for got, ref in zip(weight_norm_interface_backward(dw, v, g, norms, dim), expected):
                torch.testing.assert_close(got, ref)

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "linear":
                self.layer = nn.utils.parametrizations.weight_norm(nn.Linear(5, 6))
            else:  # Wav2Vec2's positional embedding: weight_norm(conv, dim=2)
                self.layer = nn.utils.parametrizations.weight_norm(nn.Conv1d(5, 6, 3, padding=1), dim=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.layer(x if kind == "linear" else x.transpose(1, 2))
            return (h * h.detach().sin()).sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Normed(), torch.randn(2, 4, 5))


def test_adaptive_max_pooling_backward_runs_in_onnxruntime():
    """``adaptive_max_pool{2,3}d_backward`` had no translation and cut the backward around PyTorch; now a scatter-add
    at the indices, bit for bit the op's on ties, overlapping windows (7 -> 4, 5 -> 7) and unbatched inputs."""
    from ortlab.capture.decompositions import adaptive_max_pool2d_backward, adaptive_max_pool3d_backward

    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    for shape, out in (((2, 3, 8, 8), (3, 3)), ((2, 3, 7, 5), (4, 2)), ((3, 7, 5), (4, 3)), ((2, 3, 5, 5), (7, 7)),
                       ((2, 3, 9, 9), (1, 1))):
        x = torch.randint(0, 3, shape, generator=gen).to(torch.float32)  # many ties
        y, idx = aten.adaptive_max_pool2d(x, out)
        grad = torch.randn(y.shape, generator=gen)
        torch.testing.assert_close(adaptive_max_pool2d_backward(grad, x, idx),
                                   aten.adaptive_max_pool2d_backward(grad, x, idx), rtol=0, atol=0)
    for shape, out in (((2, 3, 4, 8, 8), (3, 3, 3)), ((3, 4, 5, 6), (2, 4, 5))):  # the second unbatched
        x = torch.randn(shape, generator=gen)
        y, idx = aten.adaptive_max_pool3d(x, out)
        grad = torch.randn(y.shape, generator=gen)
        torch.testing.assert_close(adaptive_max_pool3d_backward(grad, x, idx),
                                   aten.adaptive_max_pool3d_backward(grad, x, idx), rtol=0, atol=0)

    torch.manual_seed(0)  # global max pooling after a convolution (CBAM-style heads): one part per graph
    _one_part_per_graph_beside_eager(_ConvThen(nn.AdaptiveMaxPool2d((2, 4))), torch.randn(2, 3, 8, 8))


def test_products_keep_their_backward_in_onnxruntime():
    """``prims.prod`` (no translation) is what the gradients of ``prod`` and ``cumprod`` multiply through; it cut
    the backward around PyTorch. Now ReduceProd one dim at a time; rows with one zero and with several (after a
    ReLU) take the gradient's zero-safe path."""

    class Products(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.lin(x)) * 2 + x.sum(-1, keepdim=True).tanh().relu()
            return h.prod(-1).sum() + h.prod() + h[:, :3].prod(0).sum()

    torch.manual_seed(0)
    x = torch.randn(6, 5)
    x[0] = 10.0  # a row of large activations: no zero
    _one_part_per_graph_beside_eager(Products(), x)


def test_max_and_argmax_of_bool_and_int16_run_in_onnxruntime():
    """onnxruntime has no ArgMax/ArgMin/ReduceMax/ReduceMin for bool or int16; they reduce as int32 (exact), the
    values back in their dtype. ``cumprod``'s gradient finds each row's first zero with a ``max(dim)`` over a bool
    mask: with ``prims.prod`` translated too, its backward is one onnxruntime part."""

    class Reductions(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple:
            m, s = x > 0, (x * 3).short()
            return (m.max(1, keepdim=True), m.amax(0), m.min(), s.argmax(1), s.argmin(), s.max(0), s.amin(1))

    x = torch.randn(5, 7)
    om = ortlab.ORTModule(Reductions())
    for got, ref in zip(om(x), Reductions()(x)):
        for g, r in zip(got, ref) if isinstance(ref, tuple) else ((got, ref),):
            assert g.dtype == r.dtype and torch.equal(g, r)
    assert not om.report.fallbacks

    class Cumulative(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)).cumprod(-1).sum()

    torch.manual_seed(0)
    _one_part_per_graph_beside_eager(Cumulative(), torch.randn(6, 5))


class _ThreeAttentions(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional.scaled_dot_product_attention
        return (f(q, q, q, is_causal=True, dropout_p=0.1) + f(q, q, q, attn_mask=mask, dropout_p=0.1)
                + f(q, q, q, attn_mask=mask))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_dropout_on_cuda_keeps_pytorchs_kernel_where_it_takes_no_mask(device):
    """Note [Attention dropout on CUDA stays in PyTorch's kernel]: on CUDA eager's fused kernel draws the mask,
    so an SDPA with dropout and no mask is kept; one with a mask takes the math form, and a hint says its
    masks are not eager's. On the CPU, eager's SDPA with dropout is the math form: all three are rewritten."""
    from ortlab._compat.torch import SDPA_TARGETS
    from ortlab.capture.aot import rewrite_calls

    gm = torch.fx.symbolic_trace(_ThreeAttentions())
    hints: list[str] = []
    assert rewrite_calls(gm, torch.device(device), hints) == (3 if device == "cpu" else 2)
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    if device == "cpu":
        assert not kept and not hints
    else:
        assert len(kept) == 1 and kept[0].kwargs.get("is_causal") is True
        assert len(hints) == 1 and hints[0].startswith("on CUDA, 1 attention call(s) with dropout and a mask")


@pytest.mark.parametrize("mask", ["causal", "bool", "bool-broadcast", "float"])
def test_attention_masks_are_added_as_biases_and_match_eager(mask):
    """A boolean mask was a Where over the whole score tensor in the forward and another in the backward, and
    onnxruntime's Where is ~8x slower than a broadcast Add (Note [Attention masks as additive biases])."""
    f = nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    masks = {"causal": None, "bool": torch.rand(6, 6, generator=g) > 0.3,
             "bool-broadcast": torch.rand(2, 1, 1, 6, generator=g) > 0.3, "float": torch.randn(6, 6, generator=g)}
    m = masks[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0] = True  # no row without a key to attend to (a NaN row in eager and here alike)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return f(q, k, v, attn_mask=m, is_causal=mask == "causal")

    om = squared_loss_parity(Attention(), torch.randn(2, 6, 8, generator=g))
    assert not om.report.fallbacks
    graphs = {gr.name: gr for c in om.report.captures for gr in c.graphs}
    assert [len(gr.parts) for gr in graphs.values()] == [1, 1]
    # the backward masks nothing (p == 0 where masked); with a mask, one Where of condition [..., L, 1] zeroes
    # the gradient of fully masked rows (Note [Fully masked rows of attention])
    assert graphs["backward"].onnx_ops.get("Where", 0) == (0 if m is None else 1)
    assert graphs["forward"].onnx_ops.get("Add", 0) >= 1


def test_weight_gradients_are_viewed_in_pytorch_not_copied_by_a_reshape(tmp_path):
    """onnxruntime copied a Reshape's input into a graph output (a convolution's weight gradient, a GEMM viewed as
    [Co, Ci, kh, kw], every step): the output is the GEMM's, viewed by the runner (Note [Graph outputs reshaped in
    PyTorch]); from the on-disk cache too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3), nn.Flatten())
    x = torch.randn(2, 3, 6, 6)
    for hit in (False, True):
        om = ortlab.ORTModule(copy.deepcopy(model), cache_dir=str(tmp_path))
        out, ref = om(x), model(x)
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
        out.pow(2).sum().backward()
        model.zero_grad()
        ref.pow(2).sum().backward()
        for p, q in zip(model.parameters(), om.parameters()):
            assert q.grad.shape == p.grad.shape
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)
        (backward,) = [p for c in om.report.captures for g in c.graphs if g.name == "backward" for p in g.parts]
        # The large weight's gradient is a view; the small one's (under 256 KiB) is copied, cheaper than a view.
        views = backward.runner.interface.output_views
        assert views.count((128, 64, 3, 3)) == 1 and (64, 3, 3, 3) not in views
        assert sum(g.cached for c in om.report.captures for g in c.graphs) == (2 if hit else 0)
        if not hit:
            graph = backward.exported.model.graph
            (gemm,) = [v for v in graph.outputs if v.shape is not None and tuple(v.shape.dims) == (128, 64 * 9)]
            assert gemm.producer().op_type not in ("Reshape", "Squeeze", "Unsqueeze", "Flatten")
        model.zero_grad()
