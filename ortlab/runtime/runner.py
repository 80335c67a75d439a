"""Run one ONNX graph on torch tensors without copying them.

Tensors cross the boundary zero-copy: inputs are wrapped in place with
``OrtValueVector.push_back_batch`` (pointer, dtype, shape: no DLPack capsule, no
copy) and outputs, allocated by onnxruntime, are handed to torch through DLPack
(``OrtValueVector.to_dlpacks``), which takes ownership without a copy. Parameters
are inputs like any other, so no parameter is ever copied per step.
Non-contiguous inputs are made contiguous first (onnxruntime needs dense tensors).

The C binding behind this is onnxruntime's private API, reached through
``ortlab._compat.onnxruntime`` (see Note [Zero-copy runs through onnxruntime's C binding]).

A runner also keeps what its session was built from (``SessionSource``, from the
session builder), so inspection tools can build a session like it (a profiling twin,
see ``ortlab.runtime.profiling``) and swap it in between calls with
:meth:`OrtRunner.swap_session`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort
import torch

from ortlab._compat.onnxruntime import OrtValueVector, RunOptions, ort_device, session_core, value_from_dlpack
from ortlab._compat.torch import from_dlpack_capsule, unset_fake_temporarily
from ortlab._openmp import release_openmp_threads
from ortlab.errors import InternalError, SessionError
from ortlab.onnx.guards import check, check_on_device
from ortlab.onnx.interface import GraphInterface
from ortlab.runtime.cuda import fences as cuda_fences
from ortlab.runtime.session import SessionSource

__all__ = ["OrtRunner"]

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
_ONNX_NP = {f"tensor({name})": dtype for name, dtype in (
    ("float", np.dtype(np.float32)), ("double", np.dtype(np.float64)), ("float16", np.dtype(np.float16)),
    ("int64", np.dtype(np.int64)), ("int32", np.dtype(np.int32)), ("int16", np.dtype(np.int16)),
    ("int8", np.dtype(np.int8)), ("uint8", np.dtype(np.uint8)), ("bool", np.dtype(np.bool_)))}
_NP_TORCH = {v: k for k, v in _NP_DTYPES.items()}


_TRIM: list = []
_NO_OUTPUT = (None,)
# A valid host address for an empty CPU input of a CUDA graph (Note [CPU tensors among a CUDA graph's inputs]).
_CPU_NO_DATA = torch.empty(1, dtype=torch.uint8)


def _picks(kinds: list[str | None], dtypes: list[torch.dtype | None], sources: list[tuple[str, int] | None],
           made: int) -> list[tuple[int, int]] | None:
    """Where each output of a run comes from, as ``(0, j)`` (the j-th tensor onnxruntime made), ``(1, i)`` (input
    i, passed through) or ``(2, 0)`` (None); None where an output needs the general path (Note [The runner's
    plain calls]): a Python scalar, a bool tensor (DLPack may hand it over as uint8), or a count that does not
    add up to the ``made`` outputs the session returns before its guards."""
    picks: list[tuple[int, int]] = []
    produced = 0
    for kind, dtype, source in zip(kinds, dtypes, sources):
        if kind is None:
            picks.append((2, 0))
        elif dtype is not None and dtype.is_complex:  # Note [Complex values cross as float pairs]
            return None
        elif source is None:
            if kind != "tensor" or dtype == torch.bool:
                return None
            picks.append((0, produced))
            produced += 1
        elif source[0] == "input":
            picks.append((1, source[1]))
        elif source[0] == "output" and 0 <= source[1] < len(picks):
            picks.append(picks[source[1]])
        else:
            return None
    return picks if produced == made else None


# Note [Complex values cross as float pairs]
# torchlib represents a complex tensor as a float tensor with a trailing dim of 2 (real and
# imaginary parts), and the export types graph inputs and outputs that way. Where a complex
# value crosses between onnxruntime and PyTorch (a forward saving ``torch.fft.rfft``'s output for
# a backward that runs in PyTorch, a complex op between two parts) the runner hands onnxruntime
# ``view_as_real`` of it and PyTorch ``view_as_complex`` of what comes back: PyTorch's side had
# been given the float pairs as they were, and failed on their shape (``rfft(x).abs()`` could
# not train). ``view_as_real`` and ``view_as_complex`` are no ops in that form, so a complex
# value and its float view are one ONNX value, returned once (an output repeating another, or
# an input): each FX output gets its own dtype's form of it. ``torch.view_as_real(torch.polar(r,
# theta))`` returned the pairs for the complex ``polar`` the backward saves, and the backward
# failed on their shape.


def _as_complex_or_not(t: object, dtype: torch.dtype | None) -> object:
    """``t`` in ``dtype``'s form: complex, or its float pairs (Note [Complex values cross as float pairs])."""
    if not isinstance(t, torch.Tensor) or dtype is None or t.is_complex() == dtype.is_complex:
        return t
    return _complex(t) if dtype.is_complex else torch.view_as_real(t)


def _complex(pairs: torch.Tensor) -> torch.Tensor:
    """``view_as_complex`` of float pairs; an empty one (whose strides onnxruntime leaves as they come, and
    ``view_as_complex`` wants a last stride of 1) is a new empty complex tensor."""
    if pairs.numel() == 0:
        kind = {torch.float64: torch.complex128, torch.float16: torch.complex32}.get(pairs.dtype, torch.complex64)
        return torch.empty(pairs.shape[:-1], dtype=kind, device=pairs.device)
    return torch.view_as_complex(pairs)


def give_back_freed_heap() -> None:
    """glibc's ``malloc_trim(0)``: the C heap hands the pages of its free lists back to the system.

    Called once after a provider race (Note [The race's memory goes back after it] in
    ``ortlab.runtime.race``): the export's and the losing sessions' freed memory stays in
    glibc's free lists otherwise (the GPT on the Xeon: steady RSS 876 -> 754 MiB). A no-op
    without glibc.
    """
    if not _TRIM:
        try:
            _TRIM.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
            _TRIM.append(None)
    if _TRIM[0] is not None:
        _TRIM[0](0)


class OrtRunner:
    """Calls an InferenceSession with torch values and returns torch values.

    Args:
        session: the session to run.
        interface: how its inputs are fed and its outputs read back (``GraphInterface``): the
            inputs' kinds, the outputs' kinds, dtypes and sources, the index guards among
            the session's last outputs, checked after every run (Note [Index guards] in
            ``ortlab.onnx.guards``), and the outputs' views.
        device: where inputs live and outputs are allocated.
        session_source: what the session was built from, for tools that build a
            session like it (``None``: such tools skip this runner).
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        interface: GraphInterface,
        device: torch.device,
        session_source: SessionSource | None = None,
    ) -> None:
        self.session = session
        self.session_source = session_source
        self.interface = interface
        self.guards = interface.guards
        input_kinds, output_kinds = interface.input_kinds, interface.output_kinds
        output_dtypes, output_sources = interface.output_dtypes, interface.output_sources
        # Called once, on the first call, with (runner, args): measures other execution
        # providers on the real inputs and swaps in the fastest (``ortlab.runtime.race``).
        self.race: Callable[[OrtRunner, Sequence[object]], list] | None = None
        # node name -> {fx_node, module, op, source}, set for models loaded from the on-disk
        # cache (their optimized model lost the nodes' metadata); None otherwise.
        self.provenance: dict[str, dict[str, str]] | None = None
        self._sess = session_core(session)
        self.input_names = [i.name for i in session.get_inputs()]
        self._input_np = [_ONNX_NP.get(i.type) for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        # The names the current session is fed and fetched by: the runner's own, or those of a
        # session of the same graph shared with another part (``share_session``).
        self._feed, self._fetch = self.input_names, self.output_names
        self._shared: ort.InferenceSession | None = None  # the last session shared with this runner
        self.input_kinds = input_kinds
        self.output_kinds = output_kinds
        self.output_dtypes = output_dtypes
        self.output_sources = output_sources
        self._views = [(i, shape) for i, shape in enumerate(interface.output_views) if shape is not None]
        # Note [The runner's plain calls]: what every call would otherwise work out again.
        self._all_tensors = all(k == "tensor" for k in input_kinds)
        self._input_torch = [_NP_TORCH.get(d) if d is not None else None for d in self._input_np]
        self._picks = _picks(output_kinds, output_dtypes, output_sources, len(self.output_names) - len(self.guards))
        self.device = device
        self._ort_device = ort_device(device.type, device.index or 0)
        self._in_devices = [self._ort_device] * len(self.input_names)
        # A tensor with no elements has data_ptr() == 0, which onnxruntime refuses ("data_ptr
        # was false"); it reads nothing from it, so any valid address on the device will do.
        with unset_fake_temporarily():  # runners are built while AOTAutograd traces with fake tensors
            self._no_data = torch.empty(1, dtype=torch.uint8, device=device)
        self._no_data_ptr = self._no_data.data_ptr()
        self._out_devices = [self._ort_device] * len(self.output_names)
        self._run_options = RunOptions()
        self._shrink = False  # the next run gives the arena's free regions back (shrink_arena_on_next_run)
        # While a timeline is recorded: the name of the ``torch.profiler.record_function`` span
        # each session run is wrapped in (see Note [One time axis for PyTorch and onnxruntime]
        # in ``ortlab.inspect.timeline_record``); None otherwise, at the cost of one test a call.
        self.span: str | None = None
        # Called before each run of a multi-threaded session: PyTorch's idle OpenMP threads
        # leave instead of spinning on the cores the session needs (Note [PyTorch's OpenMP
        # spin and onnxruntime] in ``ortlab._openmp``); None for single-threaded sessions.
        multi_threaded = session_source is None or session_source.threads != 1
        self._release_openmp = release_openmp_threads() if multi_threaded and device.type == "cpu" else None
        # On CUDA, onnxruntime's stream waits for the caller's before a run, and the caller's for
        # onnxruntime's after it (Note [onnxruntime's CUDA stream and PyTorch's] in ortlab.runtime.cuda).
        self._fences = cuda_fences(device) if device.type == "cuda" else None
        self._cpu_device = ort_device("cpu")
        # Index guards: read on the host, or on CUDA asserted on the GPU (Note [Index guards on CUDA]).
        self._check = check_on_device if device.type == "cuda" else check
        if len(self.input_names) != len(input_kinds):
            raise InternalError(
                f"the session has {len(self.input_names)} inputs but the graph has {len(input_kinds)} "
                "(onnxruntime dropped or added inputs)", context=session.get_modelmeta().graph_name
            )

    def release(self) -> None:
        """Free the session and what it was built from; a later call raises ``SessionError``."""
        self.session = self._sess = self.session_source = self._shared = None  # type: ignore[assignment]
        self._no_data = None  # type: ignore[assignment]

    def _retype(self, tensors: list, np_dtypes: list) -> tuple[list, list]:
        """Inputs whose dtype differs from the session's: an empty one is remade in the right dtype
        (PyTorch's dropout returns a float mask for an empty input where the graph says bool);
        anything else is ortlab's bug, reported with the input's name."""
        tensors, np_dtypes = list(tensors), list(np_dtypes)
        for i, (t, have, want) in enumerate(zip(tensors, np_dtypes, self._input_np)):
            if want is None or have == want:
                continue
            if t.numel() == 0 and want in _NP_TORCH:
                tensors[i], np_dtypes[i] = torch.empty(t.shape, dtype=_NP_TORCH[want], device=t.device), want
                continue
            raise InternalError(f"input {self.input_names[i]} is {t.dtype} where the session expects {want}",
                                context=self.session.get_modelmeta().graph_name)
        return tensors, np_dtypes

    def swap_session(self, session: ort.InferenceSession) -> ort.InferenceSession:
        """Run ``session`` from the next call on; returns the session it replaces.

        ``session`` must have the same inputs and outputs, in the same order (a twin
        built from :attr:`session_source`), or be the session another part shares with this
        one (``share_session``; the one a swap returned). Swap between calls, never while one runs; swapping
        the returned session back restores the runner exactly. The call path is the
        same for any session, so swapping costs nothing per call.

        Raises:
            SessionError: when ``session``'s inputs or outputs differ from the runner's.

        Example:
            >>> original = runner.swap_session(twin)     # doctest: +SKIP
            >>> ...                                      # doctest: +SKIP
            >>> runner.swap_session(original) is twin    # doctest: +SKIP
            True
        """
        if session is self._shared:  # swapping back the session another part shares (share_session)
            return self.share_session(session)
        inputs = [i.name for i in session.get_inputs()]
        outputs = [o.name for o in session.get_outputs()]
        if inputs != self.input_names or outputs != self.output_names:
            raise SessionError(
                f"cannot swap in a session with inputs {inputs} and outputs {outputs}: the runner's session has "
                f"inputs {self.input_names} and outputs {self.output_names}. Build the new session from "
                "runner.session_source.rebuild() (see ortlab.runtime.profiling.profiling_twin)."
            )
        old = self.session
        self.session, self._sess = session, session_core(session)
        self._feed, self._fetch = self.input_names, self.output_names
        return old

    def share_session(self, session: ort.InferenceSession) -> ort.InferenceSession:
        """Run ``session``, built from another part of the same graph, from the next call on; returns the
        session it replaces (``swap_session`` puts it back).

        Its inputs and outputs are matched by position, so they must agree with this runner's in number,
        type and shape (Note [Parts that are the same graph] in ``ortlab.runtime.race``: two parts with the
        same ``structure_key`` export the same model but for its names).

        Raises:
            SessionError: when ``session``'s inputs or outputs differ from the runner's by position.
        """
        own_in, own_out = self.session.get_inputs(), self.session.get_outputs()
        new_in, new_out = session.get_inputs(), session.get_outputs()

        def described(args: list) -> list[tuple[str, tuple]]:
            return [(a.type, tuple(a.shape)) for a in args]

        if described(own_in) != described(new_in) or described(own_out) != described(new_out):
            raise SessionError(
                f"cannot share a session with inputs {described(new_in)} and outputs {described(new_out)}: this "
                f"part's session has inputs {described(own_in)} and outputs {described(own_out)}"
            )
        old = self.session
        self.session, self._sess, self._shared = session, session_core(session), session
        self._feed, self._fetch = [i.name for i in new_in], [o.name for o in new_out]
        return old

    def shrink_arena_on_next_run(self) -> None:
        """Let the next run give the CPU arena's wholly free regions back to the system (once).

        See Note [The race's memory goes back after it] in ``ortlab.runtime.race``.
        """
        self._shrink = self.device.type == "cpu"

    def _shrinking_run(self, inputs: OrtValueVector) -> OrtValueVector:
        """The run that gives memory back (``shrink_arena_on_next_run``). onnxruntime refuses the
        shrink where the session's CPU allocator is not an arena; the run is then made without it:
        giving memory back must never fail a training step."""
        self._shrink = False
        shrink = RunOptions()
        shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        outputs = OrtValueVector()
        try:
            self._sess.run_with_ortvaluevector(
                shrink, self._feed, inputs, self._fetch, outputs, self._out_devices
            )
        except Exception:  # noqa: BLE001 - retried plainly; a real failure raises again below
            outputs = OrtValueVector()
            self._sess.run_with_ortvaluevector(
                self._run_options, self._feed, inputs, self._fetch, outputs, self._out_devices
            )
        give_back_freed_heap()
        return outputs

    # Note [The runner's plain calls]
    # A tiny model's step runs two sessions of ~50 us each, and the runner's own Python was ~35 us
    # around each (``python benchmarks/runner_overhead.py``). Most graphs take tensors only, in
    # the dtypes the session declares, and return tensors onnxruntime makes, in order: for those
    # the runner skips the per-input kind dispatch and numpy dtype lookups, and assembles the outputs
    # from picks worked out once (the n-th tensor onnxruntime made, an input passed through, None),
    # where the general path decided each output's kind and source again on every call (12 us of
    # the forward's 7 outputs). Graphs with Python scalars among their inputs or outputs, bool
    # outputs or dtypes without numpy take the general path.

    def _as_tensor(self, value: object, kind: str) -> torch.Tensor:
        if kind == "tensor":
            # No detach(): onnxruntime only reads the pointer, and detach costs ~15 us a tensor.
            return value if value.is_contiguous() else value.contiguous()  # type: ignore[union-attr]
        return torch.tensor(value, dtype=_SCALAR_DTYPES[kind], device=self.device)

    # Note [CPU tensors among a CUDA graph's inputs]
    # A CUDA graph can take CPU tensors: PyTorch lets a 0-d CPU tensor meet CUDA tensors (a plain
    # tensor attribute that ``model.cuda()`` does not move, which Dynamo lifts into an input;
    # ``ortlab.capture.aot.graph_device`` lets such graphs through). Declared as CUDA memory, onnxruntime read the host pointer on the
    # GPU ("CUDA failure 1: invalid argument" in an Identity's copy in HF's Mistral; an illegal
    # memory access in BART's). Each input is declared where it is; onnxruntime copies a CPU input
    # to the GPU where a CUDA kernel reads it.

    def _where(self, tensors: list, pointers: list) -> tuple[list, list]:
        """Each input's onnxruntime device, and a valid pointer on it for empty tensors (Note [CPU tensors
        among a CUDA graph's inputs])."""
        devices = [self._ort_device if t.is_cuda else self._cpu_device for t in tensors]
        pointers = [p if t.is_cuda or t.data_ptr() else _CPU_NO_DATA.data_ptr() for t, p in zip(tensors, pointers)]
        return devices, pointers

    def __call__(self, *args: object) -> list:
        if self._sess is None:
            raise SessionError(
                "this graph's onnxruntime session was released: its ORTModule was reconfigured (or deleted) "
                "after the forward ran. Run loss.backward() before calling reconfigure()."
            )
        if self.race is not None:  # the first real inputs: measure the candidates, keep the fastest
            race, self.race = self.race, None
            return race(self, args)
        return self.run(args)

    def run(self, args: Sequence[object]) -> list:
        """One run of the current session on ``args`` (``__call__`` without the first-call race)."""
        if self._all_tensors:
            tensors = [a if a.is_contiguous() else a.contiguous() for a in args]  # type: ignore[union-attr]
        else:
            tensors = [self._as_tensor(a, k) for a, k in zip(args, self.input_kinds)]
        inputs = OrtValueVector()
        inputs.reserve(len(tensors))
        if [t.dtype for t in tensors] == self._input_torch:  # the session's own dtypes: nothing to look up
            np_dtypes = self._input_np
        else:
            if any(t.is_complex() for t in tensors):  # Note [Complex values cross as float pairs]
                tensors = [torch.view_as_real(t).contiguous() if t.is_complex() else t for t in tensors]
            try:
                np_dtypes = [_NP_DTYPES[t.dtype] for t in tensors]
            except KeyError:  # bfloat16 & co have no numpy dtype: wrap each through DLPack
                np_dtypes = None
            if np_dtypes is not None and np_dtypes != self._input_np:
                tensors, np_dtypes = self._retype(tensors, np_dtypes)
        if np_dtypes is not None:
            devices, pointers = self._in_devices, [t.data_ptr() or self._no_data_ptr for t in tensors]
            if self._fences is not None and not all(t.is_cuda for t in tensors):
                devices, pointers = self._where(tensors, pointers)
            inputs.push_back_batch(tensors, pointers, np_dtypes, [t.shape for t in tensors], devices)
        else:
            for t in tensors:
                inputs.push_back(value_from_dlpack(t.detach().__dlpack__(), t.dtype == torch.bool))
        outputs = OrtValueVector()
        if self._release_openmp is not None:
            self._release_openmp()
        if self._fences is not None:
            self._fences[0]()
        if self._shrink:
            outputs = self._shrinking_run(inputs)
        elif self.span is None:
            self._sess.run_with_ortvaluevector(
                self._run_options, self._feed, inputs, self._fetch, outputs, self._out_devices
            )
        else:  # a timeline is being recorded: the run shows in torch.profiler's trace as a span
            with torch.profiler.record_function(self.span):
                self._sess.run_with_ortvaluevector(
                    self._run_options, self._feed, inputs, self._fetch, outputs, self._out_devices
                )
        if self._fences is not None:
            self._fences[1]()
        picks = self._picks
        if picks is not None:  # Note [The runner's plain calls]
            produced = outputs.to_dlpacks(from_dlpack_capsule)
            if self.guards:
                self._check(self.guards, produced[len(produced) - len(self.guards):])  # raises PyTorch's IndexError first
            where = (produced, args, _NO_OUTPUT)
            result = [where[w][i] for w, i in picks]
            for i, shape in self._views:  # Note [Graph outputs reshaped in PyTorch]
                result[i] = result[i].view(shape)
            return result
        produced = iter(outputs.to_dlpacks(from_dlpack_capsule))
        result: list = []
        for kind, dtype, source in zip(self.output_kinds, self.output_dtypes, self.output_sources):
            if kind is None:
                result.append(None)
                continue
            if source is not None:
                where, index = source
                result.append(_as_complex_or_not(args[index] if where == "input" else result[index], dtype))
                continue
            t = next(produced)
            if kind == "tensor" and dtype is not None and dtype.is_complex and not t.is_complex():
                result.append(_complex(t))  # Note [Complex values cross as float pairs]
            elif kind == "tensor":
                result.append(t.view(torch.bool) if dtype == torch.bool and t.dtype != torch.bool else t)
            elif kind == "int":
                result.append(int(t))
            elif kind == "float":
                result.append(float(t))
            else:
                result.append(bool(t))
        if self.guards:
            self._check(self.guards, list(produced))  # raises PyTorch's IndexError before anything is returned
        for i, shape in self._views:  # Note [Graph outputs reshaped in PyTorch]
            result[i] = result[i].view(shape)
        return result
