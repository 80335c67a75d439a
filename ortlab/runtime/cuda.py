"""onnxruntime's CUDA provider beside PyTorch: which stream its kernels run on, and in which precision.

Note [onnxruntime's CUDA stream and PyTorch's]
Without options, onnxruntime's CUDA provider runs its kernels on a stream of its own, created
non-blocking: it does not wait for the work PyTorch queued on its stream. A session's inputs
are PyTorch tensors whose kernels may still be queued when ``run`` starts, so onnxruntime could
read them before they are written (and PyTorch's caching allocator could hand an input's
memory to a new tensor while onnxruntime still reads it). ``user_compute_stream`` puts
onnxruntime's kernels on a stream we give it, but PyTorch's default stream has the handle 0,
which onnxruntime reads as "no stream given". So every session of a device runs on one stream
that PyTorch made for ortlab (:func:`ort_stream`), and before each run that stream waits for
the caller's current stream, and after it the caller's stream waits for onnxruntime's
(:func:`fences`: one ``cudaStreamWaitEvent`` each, the CPU does not wait). PyTorch's kernels on
the outputs then run after onnxruntime wrote them, and memory the caller frees (an input, or an
output that goes back to onnxruntime's arena) is reused only by work queued behind the other
stream's. This holds whether or not onnxruntime synchronizes its stream at the end of a run.
(The old ORTModule passed ``torch.cuda.current_stream()``; that is the handle 0 for a plain
training loop, so its kernels ran unfenced on onnxruntime's own stream.) A session is built for
PyTorch's current device (``torch.cuda.set_device``, as DDP's processes do), which must be the
graph's.

Note [TF32 as PyTorch's setting]
onnxruntime's CUDA provider computes float32 MatMuls and convolutions in TF32 by default on
GPUs that have it (``use_tf32=1``), while PyTorch computes float32 matrix products in full
float32 unless told otherwise (``torch.get_float32_matmul_precision() == "highest"``). The
two then differ by TF32's rounding (~1e-3), past the parity tolerance. The sessions follow
PyTorch's matmul setting: ``use_tf32`` is on only where the user allowed PyTorch TF32 matmuls.
onnxruntime has one switch for both; PyTorch's cuDNN convolutions have their own
(``torch.backends.cudnn.allow_tf32``, on by default), which it cannot follow separately.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ort_stream", "provider_options", "fences"]

_STREAMS: dict[int, torch.cuda.Stream] = {}


def ort_stream(index: int) -> torch.cuda.Stream:
    """The stream every onnxruntime session of CUDA device ``index`` runs on (made once)."""
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def provider_options(index: int | None = None) -> dict[str, str]:
    """The CUDA provider's options for device ``index`` (default: PyTorch's current device).

    Note [onnxruntime's CUDA stream and PyTorch's], Note [TF32 as PyTorch's setting].
    """
    index = torch.cuda.current_device() if index is None else index
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return {
        "device_id": str(index),
        "user_compute_stream": str(ort_stream(index).cuda_stream),
        "use_tf32": "1" if tf32 else "0",
    }


def fences(device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two calls to make around each run on ``device``: before it, onnxruntime's stream waits for the
    caller's current stream; after it, the caller's stream waits for onnxruntime's.

    Note [onnxruntime's CUDA stream and PyTorch's].
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = ort_stream(index)

    def before() -> None:
        current = torch.cuda.current_stream(index)
        if current.cuda_stream != stream.cuda_stream:
            stream.wait_stream(current)

    def after() -> None:
        current = torch.cuda.current_stream(index)
        if current.cuda_stream != stream.cuda_stream:
            current.wait_stream(stream)

    return before, after
