"""``arange`` and ``linspace`` as PyTorch's kernels count and fill them: a float ``arange``'s length, an integer
``linspace``'s values and the numbers it refuses.

Note [Ranges as PyTorch counts them]
ONNX's Range computes its length from float32 start, end and step when the output is float32:
``arange(0.1, 1.1)`` had 2 elements (float32's 1.1 - 0.1 is 1.0000000223), PyTorch's 1 (its length is
``ceil((end - start) / step)`` in double), so the output's size differed from the graph's. A float arange of
Python numbers is the integer ``arange`` of PyTorch's length, times the step, plus the start (in double, then
the dtype; the numbers as float64 constants, which a Python float beside a float64 tensor is not). Its values
are within a rounding of eager's, not always eager's: PyTorch's vectorized loop adds ``i * step`` to each
vector's first element (``arange(0.1, 1.1, 0.1, dtype=torch.float64)[6]`` is 0.7 in eager, 0.7000000000000001
here), which depends on the CPU's vector width.
``linspace`` into an integer dtype is PyTorch's integer kernel (Note [Integer linspace as PyTorch's kernel]).

Note [Integer linspace as PyTorch's kernel]
PyTorch's CPU kernel (``linspace_kernel`` in ATen's RangeFactoriesKernel.cpp) converts start and end to the
integer dtype as ``Scalar::to<T>()`` does, which raises "value cannot be converted to type int8_t without
overflow" for NaN, infinities and numbers out of the dtype's range (a uint8 takes integers down to -255, wrapped)
and truncates the rest; then ``step = (double(end) - double(start)) / (steps - 1)``, and element ``i`` is
``start + step * i`` in the first half (``i < steps / 2``) and ``end - step * (steps - 1 - i)`` in the second,
in double, truncated. The AVX2 build of that kernel is compiled with the product and the sum contracted into
one fused multiply-add (AVX512, aarch64 and CUDA builds are taken to be alike: their compilers contract by
default; only AVX2 was measured), rounded once: rounded twice (ONNX's Mul then
Add) the sum lands on an integer where the exact one lies just below it, and 114 of 3,000 random integer
linspaces differed from eager by one somewhere. Here the product is split exactly (Dekker's two-product:
``p + e == step * i``), the sum ``start + p`` too (Knuth's two-sum: ``s + t``), and ``s + (t + e)`` rounded
last: the fused result (checked against exact rationals on about 900,000 elements where the two roundings
differ, none apart; ``t + e`` would have to round at a midpoint). Constants are float64 ``scalar_tensor``s (a
Python float beside a float64 tensor becomes a float32 constant, and Dekker's 2**27 + 1 is not one). x86's
DEFAULT build (no FMA) rounds twice, and so does the form here on such a machine (``fused_multiply_add``).
``steps == 1`` is ``fill_(start)`` (end is never converted); ``steps == 0`` converts nothing.
"""

from __future__ import annotations

import math
import platform

import torch

from ortlab._compat.torch import assert_on_device
from ortlab.errors import pytorch_error

__all__ = ["arange_float", "arange_end_float", "linspace_integer", "fused_multiply_add"]

# c10's names for the integer types, in "value cannot be converted to type ... without overflow"
_C_NAMES = {torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int",
            torch.int64: "int64_t"}


def arange_float(start: object, end: object, step: object = 1, *, dtype: torch.dtype | None = None,
                 layout: object = None, device: object = None, pin_memory: object = None) -> object:
    """A float ``arange`` of Python numbers with PyTorch's length (Note [Ranges as PyTorch counts them])."""
    numbers = (start, end, step)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return NotImplemented
    kind = dtype if dtype is not None else (torch.get_default_dtype() if any(isinstance(v, float) for v in numbers)
                                            else torch.int64)
    if not kind.is_floating_point or step == 0 or not all(math.isfinite(float(v)) for v in numbers):
        return NotImplemented  # (PyTorch's errors: the op's)
    n = max(0, math.ceil((float(end) - float(start)) / float(step)))
    counts = torch.arange(n, dtype=torch.int64, device=device).to(torch.float64)
    return (counts * _double(step, device) + _double(start, device)).to(kind)


def arange_end_float(end: object, *, dtype: torch.dtype | None = None, layout: object = None,
                     device: object = None, pin_memory: object = None) -> object:
    """``arange(end)`` as :func:`arange_float` from 0."""
    return arange_float(0, end, 1, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


def _double(value: float, device: object) -> torch.Tensor:
    return torch.scalar_tensor(float(value), dtype=torch.float64, device=device)


def fused_multiply_add(device: object) -> bool:
    """Does PyTorch's linspace kernel on ``device`` round ``start + step * i`` once (Note [Integer linspace as
    PyTorch's kernel])? Its x86 DEFAULT build (no FMA instructions) rounds twice; its AVX2 build contracts the two,
    and AVX512, aarch64 and CUDA builds are taken to."""
    if torch.device(device if device is not None else "cpu").type != "cpu":
        return True
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return not (x86 and torch.backends.cpu.get_cpu_capability() == "DEFAULT")


def _overflows(value: int | float, dtype: torch.dtype) -> bool:
    """c10's ``overflows<T>(value)``: what ``Scalar::to<T>()`` refuses."""
    info = torch.iinfo(dtype)
    if isinstance(value, float):
        return math.isnan(value) or value < info.min or value > float(info.max)
    if info.min == 0:  # an unsigned type takes negative integers down to -max, wrapped
        return value > info.max or -value > info.max
    return not info.min <= value <= info.max


def _wrapped(value: int, dtype: torch.dtype) -> int:
    """``value`` (in range, or down to -255 for uint8) as the integer dtype holds it."""
    bits = torch.iinfo(dtype).bits
    value %= 1 << bits
    return value - (1 << bits) if torch.iinfo(dtype).min < 0 and value >= 1 << (bits - 1) else value


def _converted(value: object, dtype: torch.dtype, device: object) -> torch.Tensor:
    """``Scalar::to<T>()`` of a linspace end, a 0-d tensor of ``dtype``; PyTorch's error for a number it refuses
    (a tensor's, as a guard checked after the run)."""
    message = f"value cannot be converted to type {_C_NAMES[dtype]} without overflow"
    if not isinstance(value, torch.Tensor):
        if _overflows(value, dtype):
            raise pytorch_error(RuntimeError(message))
        whole = int(value) if isinstance(value, int) else (math.trunc(value) if value < 2 ** 63 else -2 ** 63)
        return torch.scalar_tensor(_wrapped(whole, dtype), dtype=dtype, device=device)
    info = torch.iinfo(dtype)
    if value.dtype == torch.bool:
        return value.to(dtype)
    if value.is_floating_point():  # item() is a double
        v = value.to(torch.float64)
        ok = (v >= _double(info.min, device)) & (v <= _double(info.max, device))  # (NaN fails both)
        assert_on_device(ok, message)
        return v.trunc().to(torch.int64).to(dtype)
    v = value.to(torch.int64)  # item() is an int64
    lowest = -info.max if info.min == 0 else info.min
    assert_on_device((v >= lowest) & (v <= info.max), message)
    return v.to(dtype)


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Veltkamp's split: ``a == high + low``, each with at most 26 significant bits."""
    c = a * _double(2.0 ** 27 + 1, a.device)
    high = c - (c - a)
    return high, a - high


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once, in float64 (Note [Integer linspace as PyTorch's kernel])."""
    p = a * b
    (ah, al), (bh, bl) = _split(a), _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl  # a * b == p + e exactly
    s = c + p
    back = s - c
    t = (c - (s - back)) + (p - back)  # c + p == s + t exactly
    return s + (t + e)


def linspace_integer(start: object, end: object, steps: int, *, dtype: torch.dtype | None = None,
                     layout: object = None, device: object = None, pin_memory: object = None) -> object:
    """``linspace`` into an integer dtype as PyTorch's kernel computes it (Note [Integer linspace as PyTorch's
    kernel]); ``NotImplemented`` for other dtypes and for no steps."""
    if dtype not in _C_NAMES or not isinstance(steps, int) or steps < 1:
        return NotImplemented
    for v in (start, end):
        if not (isinstance(v, torch.Tensor) or (isinstance(v, (int, float)) and not isinstance(v, bool))):
            return NotImplemented  # (a symbolic number: the op)
    if isinstance(start, torch.Tensor) and device is None:
        device = start.device
    first = _converted(start, dtype, device)
    if steps == 1:
        return first.reshape(1)
    first, last = first.to(torch.float64), _converted(end, dtype, device).to(torch.float64)
    step = (last - first) / _double(steps - 1, device)
    idx = torch.arange(steps, dtype=torch.int64, device=device)
    up = idx < steps // 2
    base = torch.where(up, first, last)
    times = torch.where(up, step, -step)
    count = torch.where(up, idx, steps - 1 - idx).to(torch.float64)
    value = _fma(times, count, base) if fused_multiply_add(device) else base + times * count
    return value.trunc().to(torch.int64).to(dtype)
