"""Run one ONNX graph on torch tensors without copying them.

Tensors cross the boundary zero-copy: inputs are wrapped in place with
``OrtValueVector.push_back_batch`` (pointer, dtype, shape: no DLPack capsule, no
copy) and outputs, allocated by onnxruntime, are handed to torch through DLPack
(``OrtValueVector.to_dlpacks``), which takes ownership without a copy. Parameters
are inputs like any other, so no parameter is ever copied per step.
Non-contiguous inputs are made contiguous first (onnxruntime needs dense tensors).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as C

from ortlab.errors import SessionError

__all__ = ["OrtRunner", "ort_device"]

_NP_DTYPES = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}

_SCALAR_DTYPES = {"int": torch.int64, "float": torch.float32, "bool": torch.bool}


def ort_device(device: torch.device) -> C.OrtDevice:
    """onnxruntime's description of a torch device."""
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


class OrtRunner:
    """Calls an InferenceSession with torch values and returns torch values.

    Args:
        session: the session to run.
        input_kinds: kind of each input (tensor/int/float/bool), in session order.
        output_kinds: kind of each FX output; ``None`` positions return None.
        output_sources: per output, ``None`` (next onnxruntime output), ``("input", i)``
            or ``("output", j)``: see ``ExportedGraph.output_sources``.
        device: where inputs live and outputs are allocated.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        input_kinds: list[str],
        output_kinds: list[str | None],
        output_dtypes: list[torch.dtype | None],
        output_sources: list[tuple[str, int] | None],
        device: torch.device,
    ) -> None:
        self.session = session
        self._sess = session._sess
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        self.input_kinds = input_kinds
        self.output_kinds = output_kinds
        self.output_dtypes = output_dtypes
        self.output_sources = output_sources
        self.device = device
        self._ort_device = ort_device(device)
        self._in_devices = [self._ort_device] * len(self.input_names)
        self._out_devices = [self._ort_device] * len(self.output_names)
        self._run_options = C.RunOptions()
        if len(self.input_names) != len(input_kinds):
            raise SessionError(
                f"session has {len(self.input_names)} inputs but the graph has {len(input_kinds)}; "
                "onnxruntime dropped or added inputs (this is a bug in ortlab)"
            )

    def _as_tensor(self, value: object, kind: str) -> torch.Tensor:
        if kind == "tensor":
            # No detach(): onnxruntime only reads the pointer, and detach costs ~15 us a tensor.
            return value if value.is_contiguous() else value.contiguous()  # type: ignore[union-attr]
        return torch.tensor(value, dtype=_SCALAR_DTYPES[kind], device=self.device)

    def __call__(self, *args: object) -> list:
        tensors = [self._as_tensor(a, k) for a, k in zip(args, self.input_kinds)]
        inputs = C.OrtValueVector()
        inputs.reserve(len(tensors))
        try:
            np_dtypes = [_NP_DTYPES[t.dtype] for t in tensors]
        except KeyError:  # bfloat16 & co have no numpy dtype: wrap each through DLPack
            np_dtypes = None
        if np_dtypes is not None:
            inputs.push_back_batch(
                tensors, [t.data_ptr() for t in tensors], np_dtypes, [t.shape for t in tensors], self._in_devices
            )
        else:
            for t in tensors:
                inputs.push_back(C.OrtValue.from_dlpack(t.detach().__dlpack__(), t.dtype == torch.bool))
        outputs = C.OrtValueVector()
        self._sess.run_with_ortvaluevector(
            self._run_options, self.input_names, inputs, self.output_names, outputs, self._out_devices
        )
        produced = iter(outputs.to_dlpacks(torch._C._from_dlpack))
        result: list = []
        for kind, dtype, source in zip(self.output_kinds, self.output_dtypes, self.output_sources):
            if kind is None:
                result.append(None)
                continue
            if source is not None:
                where, index = source
                result.append(args[index] if where == "input" else result[index])
                continue
            t = next(produced)
            if kind == "tensor":
                result.append(t.view(torch.bool) if dtype == torch.bool and t.dtype != torch.bool else t)
            elif kind == "int":
                result.append(int(t))
            elif kind == "float":
                result.append(float(t))
            else:
                result.append(bool(t))
        return result
