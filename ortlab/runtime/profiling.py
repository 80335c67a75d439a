"""Profiling twins: a session like a runner's, with onnxruntime's profiler switched on.

onnxruntime fixes ``enable_profiling`` when a session is created, so profiling a
running model for a few steps means building a second session from the same model
and settings (:func:`profiling_twin`, through the session builder's
``SessionSource.rebuild``) and swapping it into the runner between calls
(``OrtRunner.swap_session``). See Note [Sampling the profiler in windows] in
``ortlab.inspect.profile_window`` for why and what it costs, and Note [Unique profile
prefixes] in ``ortlab.runtime.session`` for the file names.
"""

from __future__ import annotations

import onnxruntime as ort

from ortlab.errors import SessionError
from ortlab.runtime.runner import OrtRunner
from ortlab.runtime.session import PROFILE_PREFIX, unique_profile_prefix

__all__ = ["PROFILE_PREFIX", "profiling_twin"]


def profiling_twin(runner: OrtRunner, label: str = "", folder: str | None = None) -> ort.InferenceSession:
    """A session running ``runner``'s model with the same settings and providers, profiling on.

    The twin writes its profile under ``unique_profile_prefix(label, folder)`` when
    ``twin.end_profiling()`` is called, and does not write the optimized model (or a
    cache entry) again. Swap it in with ``runner.swap_session(twin)``.

    Raises:
        SessionError: when the runner keeps no ``session_source`` (its session was not
            built by ortlab's session builder) or onnxruntime cannot build the twin.

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
            "runners built by the engine keep one: pass session_source= when building an OrtRunner by hand."
        )
    try:
        return source.rebuild(profile_prefix=unique_profile_prefix(label, folder)).session
    except SessionError as e:
        raise SessionError(f"could not build a profiling twin of {label or 'a session'}: {e}") from e
