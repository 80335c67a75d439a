"""The CUDA path: same zero-copy exchange with onnxruntime-gpu's CUDA provider (skipped without a GPU)."""

from __future__ import annotations

import copy

import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortlab

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs a CUDA device and onnxruntime-gpu (pip install 'ortlab[gpu]')",
    ),
]


def test_cuda_training_step_matches_eager():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 16, device="cuda")
    out, ref = om(x), eager(x)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(eager.parameters(), om.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    assert om.report.captures[0].graphs[0].ort_partitions == 1


def test_mixed_devices_raise():
    om = ortlab.ORTModule(nn.Linear(4, 4).cuda())
    with pytest.raises(ortlab.DeviceError, match="must share one device"):
        om(torch.randn(2, 4))


@pytest.fixture
def full_fp32():
    """PyTorch's float32 convolutions in full float32, as onnxruntime's are where PyTorch's matmuls are
    (Note [TF32 as PyTorch's setting] in ortlab.runtime.cuda)."""
    old = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cudnn.allow_tf32 = old[0]
    torch.set_float32_matmul_precision(old[1])


def _train_side_by_side(eager: nn.Module, batches: list, steps_opt=torch.optim.SGD, **options) -> ortlab.ORTModule:
    om = ortlab.ORTModule(copy.deepcopy(eager), **options)
    opt_e = steps_opt(eager.parameters(), lr=1e-2)
    opt_o = steps_opt(om.parameters(), lr=1e-2)
    for step, batch in enumerate(batches):
        torch.manual_seed(step)
        ref = eager(*batch)
        torch.manual_seed(step)
        out = om(*batch)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        ref.backward()
        out.backward()
        for (name, p), q in zip(eager.named_parameters(), om.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        opt_e.step()
        opt_o.step()
        opt_e.zero_grad()
        opt_o.zero_grad()
    return om


def test_cuda_gpt_trains_like_eager(full_fp32):
    from ortlab.models import GPT, GPTConfig, make_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, block_size=32)
    eager = GPT(cfg).cuda()
    g = torch.Generator().manual_seed(0)
    batches = [make_batch("gpt", 4, g, vocab=cfg.vocab, block_size=cfg.block_size, device="cuda") for _ in range(3)]
    om = _train_side_by_side(eager, batches)
    providers = {p.runner.session.get_providers()[0] for c in om.report.captures for gr in c.graphs
                 for p in gr.parts if p.runner.session}
    assert providers == {"CUDAExecutionProvider"}


def test_cuda_dropout_and_ignored_labels_train_like_eager(full_fp32):
    """Dropout draws in PyTorch on the GPU's generator; ignored labels are skipped (label sparsity)."""
    from ortlab.models import GPT, GPTConfig, make_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, block_size=32, dropout=0.1)
    eager = GPT(cfg).cuda()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        idx, targets = make_batch("gpt", 4, g, vocab=cfg.vocab, block_size=cfg.block_size)
        targets = targets.masked_fill(torch.rand(targets.shape, generator=g) < 0.5, -100)
        batches.append((idx.cuda(), targets.cuda()))
    _train_side_by_side(eager, batches)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x).mean(dim=(2, 3))), y)


def test_cuda_batch_norm_trains_like_eager_with_its_running_statistics(full_fp32):
    torch.manual_seed(0)
    eager = _ConvNet().cuda()
    batches = [(torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda"))
               for _ in range(3)]
    om = _train_side_by_side(eager, batches)
    for (name, a), b in zip(eager.state_dict().items(), om.state_dict().values()):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(a, b), name


def test_cuda_runs_on_the_callers_stream(full_fp32):
    """Inputs made on a side stream are read only once written, and outputs used there only once written
    (Note [onnxruntime's CUDA stream and PyTorch's])."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    om = ortlab.ORTModule(copy.deepcopy(eager))
    om(torch.randn(64, 512, device="cuda"))  # the first call builds the sessions
    side = torch.cuda.Stream()
    base = torch.randn(64, 512, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy, so an unfenced read sees stale memory
        x = base * 2 + 1
        out = om(x)
        total = out.sum() * 1.0
    side.synchronize()
    ref = eager(base * 2 + 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(total, ref.sum(), rtol=1e-4, atol=1e-3)


def test_cuda_sessions_follow_pytorchs_tf32_setting():
    from ortlab.runtime.cuda import provider_options

    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert provider_options()["use_tf32"] == "0"
        torch.set_float32_matmul_precision("high")
        assert provider_options()["use_tf32"] == "1"
    finally:
        torch.set_float32_matmul_precision(old)
    assert int(provider_options()["user_compute_stream"]) != 0  # 0 would mean onnxruntime's own stream


class _ScaledByCpuScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.tensor(0.5)  # a plain attribute: model.cuda() leaves it on the CPU, as eager allows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale).relu().sum()


def test_cuda_graph_takes_a_cpu_scalar(full_fp32):
    """Note [CPU tensors among a CUDA graph's inputs]: a 0-d CPU tensor among a CUDA graph's inputs is declared
    where it is (onnxruntime read its host pointer on the GPU: HF Mistral and BART crashed)."""
    torch.manual_seed(0)
    eager = _ScaledByCpuScalar().cuda()
    assert eager.scale.device.type == "cpu"
    _train_side_by_side(eager, [(torch.randn(4, 8, device="cuda"),) for _ in range(2)])
