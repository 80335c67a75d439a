"""A griffe extension for the API reference: ortlab's ``Example:`` sections render as examples.

ortlab's docstrings head their doctests ``Example:`` (STYLE.md habit 8). Griffe's Google parser knows
``Examples:`` as the section whose ``>>>`` lines become code; ``Example:`` it takes for an admonition
whose text is markdown, where ``>>>`` is a nested block quote. This renames the heading while the
docstrings are read (the code is not changed), so every example renders as Python.
"""

from __future__ import annotations

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExamplesSection(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None and "Example:" in obj.docstring.value:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
