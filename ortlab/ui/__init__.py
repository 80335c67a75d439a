"""Notebook views of ortlab. plotly and ipywidgets are imported only when a view is built.

Example:
    >>> from ortlab.ui import monitor          # doctest: +SKIP
    >>> mon = monitor(om, every=10)            # doctest: +SKIP
"""

from ortlab.ui.monitor import Monitor, monitor

__all__ = ["Monitor", "monitor"]
