"""The private onnxruntime APIs ortlab uses, each with why and since when (checked on 1.20-1.32).

Note [Zero-copy runs through onnxruntime's C binding]
The public ``InferenceSession.run`` takes and returns numpy arrays (a copy each way),
and ``run_with_iobinding`` costs a binding call per tensor. onnxruntime's own training
wrapper (ORTModule) ran sessions through the C binding instead: an ``OrtValueVector`` of
inputs wrapped in place (``push_back_batch``: pointer, dtype, shape; no copy) and
``run_with_ortvaluevector``, whose outputs go to torch through DLPack without a copy.
These live in ``onnxruntime.capi._pybind_state`` (1.14+) and on the session's
``_sess`` attribute; nothing public offers the same.
A fetch vector filled beforehand (``push_back_batch`` on the caller's buffers) makes
``run_with_ortvaluevector`` write each output into its buffer (onnxruntime's
pre-allocated outputs): the optimizers update parameters in place this way
(``ortlab.ondevice.inplace``; checked on 1.32).
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

__all__ = ["OrtValueVector", "RunOptions", "ort_device", "session_core", "value_from_dlpack"]

OrtValueVector = _C.OrtValueVector
RunOptions = _C.RunOptions


def session_core(session: ort.InferenceSession) -> Any:
    """The C session behind an ``InferenceSession`` (``session._sess``): it has ``run_with_ortvaluevector``."""
    return session._sess


def ort_device(device_type: str, index: int = 0) -> Any:
    """onnxruntime's ``OrtDevice`` for a torch device type (``cpu`` or ``cuda``)."""
    kind = _C.OrtDevice.cuda() if device_type == "cuda" else _C.OrtDevice.cpu()
    return _C.OrtDevice(kind, _C.OrtDevice.default_memory(), index if device_type == "cuda" else 0)


# onnxruntime < 1.32 takes (capsule, is_bool_tensor); 1.32 reads the dtype from the capsule alone.
_DLPACK_BOOL_ARG = "is_bool_tensor" in (_C.OrtValue.from_dlpack.__doc__ or "")


def value_from_dlpack(capsule: Any, is_bool: bool) -> Any:
    """An ``OrtValue`` sharing the memory of a DLPack capsule (for dtypes numpy lacks: bfloat16)."""
    if _DLPACK_BOOL_ARG:
        return _C.OrtValue.from_dlpack(capsule, is_bool)
    return _C.OrtValue.from_dlpack(capsule)
