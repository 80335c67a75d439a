"""Run an onnxruntime session that reads its inputs from, and writes its outputs into, buffers the caller owns.

The optimizers update parameters and moments in place this way (no copy in, no copy
out): each input is wrapped where it lies, and each output is given its buffer before
the run, so onnxruntime writes the result there instead of allocating. Torch-free: a
buffer is an address, a numpy dtype and a shape, from a numpy array
(:func:`numpy_buffers`) or a torch tensor (``ortlab.optim``).

The C binding behind this is onnxruntime's private API, reached through
``ortlab._compat.onnxruntime`` (see Note [Zero-copy runs through onnxruntime's C binding]);
which graphs may share an input's buffer with an output is Note [Updating in place] in
``ortlab.ondevice.optimizer_model``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from ortlab._compat.onnxruntime import OrtValueVector, RunOptions, ort_device, session_core
from ortlab.errors import SessionError, first_line

__all__ = ["Buffers", "numpy_buffers", "InPlaceRunner"]


@dataclasses.dataclass
class Buffers:
    """Tensors as onnxruntime wraps them: the owners (kept alive for the run), addresses, dtypes, shapes."""

    owners: list
    pointers: list[int]
    dtypes: list[np.dtype]
    shapes: list[Sequence[int]]

    def __len__(self) -> int:
        return len(self.pointers)


_EMPTY = np.empty(1, dtype=np.uint8)  # onnxruntime refuses address 0; an empty tensor reads nothing anyway


def numpy_buffers(arrays: Sequence[np.ndarray]) -> Buffers:
    """:class:`Buffers` over C-contiguous numpy arrays (not copied: the caller makes them contiguous)."""
    empty = _EMPTY.ctypes.data
    return Buffers(list(arrays), [a.ctypes.data if a.size else empty for a in arrays], [a.dtype for a in arrays],
                   [a.shape for a in arrays])


class InPlaceRunner:
    """Runs ``session`` on :class:`Buffers`, writing every output into the buffer given for it.

    Args:
        session: the session; inputs and outputs are fed and fetched in its order.
        device_type: where the buffers live (``cpu`` or ``cuda``).
        device_index: the CUDA device's index.
    """

    def __init__(self, session: ort.InferenceSession, device_type: str = "cpu", device_index: int = 0) -> None:
        self.session = session
        self._sess = session_core(session)
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        device = ort_device(device_type, device_index)
        self._in_devices = [device] * len(self.input_names)
        self._out_devices = [device] * len(self.output_names)
        self._run_options = RunOptions()

    def run(self, inputs: Buffers, outputs: Buffers) -> None:
        """One run: ``inputs`` in session input order, ``outputs`` receive the session's outputs in order.

        Raises:
            SessionError: when the counts differ from the session's, or onnxruntime fails.
        """
        if len(inputs) != len(self.input_names) or len(outputs) != len(self.output_names):
            raise SessionError(f"the session takes {len(self.input_names)} inputs and gives {len(self.output_names)} "
                               f"outputs; got {len(inputs)} and {len(outputs)} buffers")
        feeds = OrtValueVector()
        feeds.reserve(len(inputs))
        feeds.push_back_batch(inputs.owners, inputs.pointers, inputs.dtypes, inputs.shapes, self._in_devices)
        fetches = OrtValueVector()  # filled beforehand: onnxruntime writes into these buffers
        fetches.reserve(len(outputs))
        fetches.push_back_batch(outputs.owners, outputs.pointers, outputs.dtypes, outputs.shapes, self._out_devices)
        try:
            self._sess.run_with_ortvaluevector(self._run_options, self.input_names, feeds, self.output_names, fetches,
                                               self._out_devices)
        except Exception as e:  # onnxruntime raises its own pybind exception types
            graph = self.session.get_modelmeta().graph_name
            raise SessionError(f"onnxruntime could not run {graph!r}: {first_line(e)}") from e
