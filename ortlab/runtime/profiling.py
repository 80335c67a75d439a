"""Profiling twins: a session like a runner's, with onnxruntime's profiler switched on.

onnxruntime fixes ``enable_profiling`` when a session is created, so profiling a
running model for a few steps means building a second session from the same model
and options (:func:`profiling_twin`) and swapping it into the runner between calls
(``OrtRunner.swap_session``). See Note [Sampling the profiler in windows] in
``ortlab.inspect.profile`` for why and what it costs.

Note [Unique profile prefixes]
onnxruntime names a profile ``{prefix}_{date}_{time}_{ms}.json`` when the session
starts profiling. Twins are built less than a millisecond apart: with one
prefix, two of them wrote the same file (seen while building the profile window). So
every twin gets a prefix no other session of the process uses: the process id, a
counter and the graph's label (``ortlab_profile_4242_7_g0.backward``).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile

import onnxruntime as ort

from ortlab.errors import SessionError
from ortlab.runtime.runner import OrtRunner

__all__ = ["PROFILE_PREFIX", "profile_prefix", "profiling_twin"]

PROFILE_PREFIX = "ortlab_profile"
_COUNTER = itertools.count()
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def profile_prefix(label: str = "", folder: str | None = None) -> str:
    """A profile file prefix no other call in this process returns (see Note [Unique profile prefixes]).

    Args:
        label: the graph the session runs (``g0.forward``); other characters than
            letters, digits, ``_``, ``.`` and ``-`` become ``_``.
        folder: where the profile goes; the temp dir by default.

    Example:
        >>> os.path.basename(profile_prefix("g0.forward")).startswith(f"ortlab_profile_{os.getpid()}_")
        True
    """
    name = f"{PROFILE_PREFIX}_{os.getpid()}_{next(_COUNTER)}"
    safe = _UNSAFE.sub("_", label).strip("_")
    if safe:
        name += f"_{safe}"
    return os.path.join(folder or tempfile.gettempdir(), name)


def profiling_twin(runner: OrtRunner, label: str = "", folder: str | None = None) -> ort.InferenceSession:
    """A session running ``runner``'s model with the same options and providers, profiling on.

    The twin writes its profile under :func:`profile_prefix` ``(label, folder)`` when
    ``twin.end_profiling()`` is called, and does not write the optimized model (or a
    cache entry) again. Swap it in with ``runner.swap_session(twin)``.

    Raises:
        SessionError: when the runner keeps no ``session_source`` (its session was not
            built by ``ortlab.runtime.graph``) or onnxruntime cannot build the twin.

    Example:
        >>> twin = profiling_twin(runner, "g0.forward")       # doctest: +SKIP
        >>> original = runner.swap_session(twin)               # doctest: +SKIP
        >>> ...train a few steps...                            # doctest: +SKIP
        >>> runner.swap_session(original)                      # doctest: +SKIP
        >>> path = twin.end_profiling()                        # doctest: +SKIP
    """
    source = runner.session_source
    if source is None:
        raise SessionError(
            "this runner keeps no session_source (what its session was built from), so no twin can be built; "
            "runners made by ortlab.runtime.graph keep one: pass session_source= when building an OrtRunner by hand."
        )
    so = source.sess_options
    # The options object is the session's own: change it for the twin, then put it back.
    saved = (so.enable_profiling, so.profile_file_prefix, so.optimized_model_filepath)
    so.enable_profiling = True
    so.profile_file_prefix = profile_prefix(label, folder)
    so.optimized_model_filepath = ""
    try:
        return ort.InferenceSession(
            source.model, sess_options=so, providers=source.providers, provider_options=source.provider_options
        )
    except Exception as e:  # onnxruntime raises its own pybind exception types
        raise SessionError(f"onnxruntime could not build a profiling twin of {label or 'a session'}: {e}") from e
    finally:
        so.enable_profiling, so.profile_file_prefix, so.optimized_model_filepath = saved
