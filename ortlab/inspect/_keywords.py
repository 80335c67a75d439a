"""A tool's keywords split into the model's keyword inputs and ORTModule options.

Note [Keyword inputs beside options]
Hugging Face users call their models with keywords (``model(input_ids=ids, labels=ids)``), and the tools
that run a model (``compare``, ``bisect_fallbacks``, ``explore``) take them the same way:
``compare(model, input_ids=ids, labels=ids)``. A keyword is an ORTModule option when it names one
(``recompute``, ``fallback_ops``...) and the forward takes no parameter of that name; otherwise it is an
input of the forward. A name that is both is an error that says how to pass it (``options=`` or
``forward_kwargs=``), as is a keyword that is neither (a forward without ``**kwargs``), which names the
forward's parameters and the options. ``options=`` and ``forward_kwargs=`` take either explicitly.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ortlab.config import Options
from ortlab.errors import ConfigError

__all__ = ["split_keywords"]


def _forward_parameters(model: nn.Module) -> tuple[set[str], bool]:
    """The forward's keyword parameter names, and whether it takes ``**kwargs``."""
    forward = getattr(model, "module", model).forward  # an ORTModule's wrapped module
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: anything may be an input
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def split_keywords(model: nn.Module, keywords: dict[str, Any], *, tool: str,
                   options: dict[str, Any] | None = None,
                   forward_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the forward's keyword inputs, ORTModule options) from a tool's ``**keywords`` (Note [Keyword inputs
    beside options]), with ``forward_kwargs=`` and ``options=`` added.

    Raises:
        ConfigError: a keyword that is both an option and a forward parameter, one that is neither, or one given
            twice.

    Example:
        >>> split_keywords(model, {"input_ids": ids, "recompute": "auto"}, tool="compare")  # doctest: +SKIP
        ({'input_ids': tensor(...)}, {'recompute': 'auto'})
    """
    inputs, opts = dict(forward_kwargs or {}), dict(options or {})
    names, takes_any = _forward_parameters(model)
    valid = Options.names()
    for key, value in keywords.items():
        is_option, is_input = key in valid, key in names
        if is_option and is_input:
            raise ConfigError(
                f"{tool}: {key!r} is both an ORTModule option and a parameter of "
                f"{type(getattr(model, 'module', model)).__name__}.forward; pass it as "
                f"options={{{key!r}: ...}} or forward_kwargs={{{key!r}: ...}}.")
        target = opts if is_option and not is_input else inputs
        if not is_option and not is_input and not takes_any:
            raise ConfigError(
                f"{tool}: {key!r} is neither a parameter of {type(getattr(model, 'module', model)).__name__}.forward "
                f"({', '.join(sorted(names)) or 'none by name'}) nor an ORTModule option ({', '.join(sorted(valid))}).")
        if key in target:
            raise ConfigError(f"{tool}: {key!r} is given twice (as a keyword and in "
                              f"{'options' if target is opts else 'forward_kwargs'}=).")
        target[key] = value
    return inputs, opts
