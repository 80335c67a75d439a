"""Where notebook views register themselves, so inspection records can show themselves rich.

Nothing in ``ortlab.inspect`` imports ``ortlab.ui``: a record (a lab, a stage) asks this
registry for its view by name, and ``ortlab.ui``'s modules register theirs when they
are imported. ``ortlab.explore`` and the other notebook entry points of ``ortlab``
import ``ortlab.ui`` first, so a notebook user gets the rich views; a record used
without them falls back to text (``_repr_html_`` returns ``None``) or says what to
import.

Views by name: ``stage_html`` and ``lab_html`` (``(record) -> str``), ``stage_view``
(netron: ``(stage, graph, node, module, **kw) -> view``), ``lab_widget`` (``(lab) -> widget``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ortlab.errors import OrtlabError

__all__ = ["register_view", "find_view", "view"]

_VIEWS: dict[str, Callable[..., Any]] = {}


def register_view(name: str, fn: Callable[..., Any]) -> None:
    """Register (or replace) the view called ``name``.

    Example:
        >>> register_view("stage_html", lambda stage: f"<b>{stage.name}</b>")   # doctest: +SKIP
    """
    _VIEWS[name] = fn


def find_view(name: str) -> Callable[..., Any] | None:
    """The view called ``name``, or None when no view module registered it."""
    return _VIEWS.get(name)


def view(name: str) -> Callable[..., Any]:
    """The view called ``name``.

    Raises:
        OrtlabError: when ``ortlab.ui`` was not imported (it registers the views).
    """
    fn = _VIEWS.get(name)
    if fn is None:
        raise OrtlabError(
            f"the notebook view {name!r} is not loaded: `import ortlab.ui` first "
            "(ortlab.explore and ortlab.monitor load it for you)."
        )
    return fn
