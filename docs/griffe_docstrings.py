"""A griffe extension for the API reference: ortlab's docstrings as markdown, without touching the code.

* ``Example:`` sections render as examples. ortlab heads its doctests ``Example:`` (STYLE.md habit 8);
  griffe's Google parser knows ``Examples:`` as the section whose ``>>>`` lines become code, and takes
  ``Example:`` for an admonition whose text is markdown, where ``>>>`` is a nested block quote.
* Sphinx roles (:func:`~ortlab.inspect.loss.default_loss`, :class:`CompareResult`) render as code,
  not as the role's literal text.

The docstrings are rewritten while griffe reads them; the source is not changed.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class OrtlabDocstrings(griffe.Extension):
    """Rename ``Example:`` to ``Examples:`` and turn Sphinx roles into code spans in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is None:
            return
        text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = _ROLE.sub(r"`\1`", text)
