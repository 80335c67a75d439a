"""Errors raised by ortlab: one root, one subclass per pipeline stage.

Every message says what happened, what was expected and what to do next.
``InternalError`` marks a bug in ortlab itself rather than in the user's model.
"""

from __future__ import annotations

__all__ = [
    "OrtlabError",
    "ConfigError",
    "CaptureError",
    "ExportError",
    "SessionError",
    "FallbackError",
    "UnsupportedInputError",
    "DeviceError",
    "ArtifactError",
    "InternalError",
]


class OrtlabError(RuntimeError):
    """Root of every error ortlab raises on purpose."""


class ConfigError(OrtlabError, ValueError):
    """An option or environment variable has a value ortlab does not accept."""


class CaptureError(OrtlabError):
    """Dynamo or AOTAutograd could not capture the module."""


class ExportError(OrtlabError):
    """An FX graph could not be translated to ONNX."""


class SessionError(OrtlabError):
    """onnxruntime could not build or run a session for an exported graph."""


class FallbackError(OrtlabError):
    """Something would have run in PyTorch instead of onnxruntime while ``fallback="raise"``."""


class UnsupportedInputError(OrtlabError, TypeError):
    """An input to an ORTModule has a type ortlab cannot feed to onnxruntime."""


class DeviceError(OrtlabError):
    """Inputs and parameters live on devices ortlab cannot run together."""


class ArtifactError(OrtlabError):
    """An on-device training artifact (model, checkpoint) is missing, malformed, or does not fit the call.

    Raised by ``ortlab.ondevice``: the message names the file or the input and says
    what was expected (and, for a missing file, how to make it: ``generate_artifacts``).
    """


class InternalError(OrtlabError):
    """A bug in ortlab itself, not in the user's model or options.

    The message always ends with "please report" and the context: what ortlab was
    doing and which graph it was working on, so a report can be acted on.

    Example:
        >>> raise InternalError("the session has 3 inputs, the graph 4", context="g0.forward")  # doctest: +SKIP
    """

    def __init__(self, message: str, context: str = "") -> None:
        where = f" (while working on {context})" if context else ""
        super().__init__(
            f"{message}{where}. This is a bug in ortlab, not in your model: please report it with this "
            "message, the versions of torch, onnxruntime and ortlab, and the model that triggered it."
        )


class FallbackWarning(UserWarning):
    """Part of the model runs in PyTorch instead of onnxruntime; the message says why."""


__all__.append("FallbackWarning")


class ParityWarning(UserWarning):
    """ortlab's numbers will differ from eager PyTorch's; the message says how and why."""


__all__.append("ParityWarning")


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` of an exception, for reasons and reports."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(error).__name__}: {text[:limit]}" if text else type(error).__name__


# Note [PyTorch's errors found at capture]
# Some inputs PyTorch refuses are known from what a capture sees: a dtype (``masked_scatter`` with a uint8
# mask), a Python number (``linspace(300, 0, 5, dtype=torch.int8)``). A decomposition raises PyTorch's own
# exception, with PyTorch's message, marked by :func:`pytorch_error`; the backend then runs that graph in
# PyTorch, which raises the same error at the same op, after whatever ran before it. Nothing failed in ortlab
# (the program fails in eager too), so there is no FallbackWarning and, under ``fallback="raise"``, no
# ``CaptureError`` in its place; the report lists the graph with the error.
_PYTORCH_ERROR = "_ortlab_pytorch_error"


def pytorch_error(error: Exception) -> Exception:
    """``error``, marked as the one PyTorch raises for these inputs (Note [PyTorch's errors found at capture]).

    Example:
        >>> raise pytorch_error(RuntimeError("masked_scatter_ only supports boolean masks, ..."))  # doctest: +SKIP
    """
    setattr(error, _PYTORCH_ERROR, True)
    return error


def is_pytorch_error(error: BaseException | None) -> bool:
    """Is ``error``, or an error it was raised from or during, marked by :func:`pytorch_error`?"""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if getattr(error, _PYTORCH_ERROR, False):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


__all__ += ["pytorch_error", "is_pytorch_error"]
