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
