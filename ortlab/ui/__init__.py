"""Notebook views of ortlab. plotly and ipywidgets are imported only when a view is built.

Importing this package registers the views that inspection records show themselves
with (``ortlab.inspect.views``): the stepper's HTML and widget, netron graph views.
``ortlab.explore`` and ``ortlab.monitor`` import it for you.

Example:
    >>> from ortlab.ui import monitor          # doctest: +SKIP
    >>> mon = monitor(om, every=10)            # doctest: +SKIP
"""

from ortlab.ui import compare_view, netron_view, speed_view, stepper  # noqa: F401  (they register their views)
from ortlab.ui.monitor import Monitor, monitor

__all__ = ["Monitor", "monitor"]
