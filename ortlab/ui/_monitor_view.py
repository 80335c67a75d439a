"""The monitor's views in a notebook: a live FigureWidget, or a plain figure redrawn in place.

Where widgets render, the view is an ipywidgets VBox (a status line over a plotly
``FigureWidget``), as wide as the output, updated in one ``batch_update`` per redraw;
elsewhere (Colab, VS Code, no ipywidgets, ``mode="static"``) a plain figure, titled
with the status line, is displayed as a raw mime bundle with a display id and
replaced in place. The status line alone changes while a step compiles
(:meth:`MonitorView.show_status`). After each notebook cell the view draws what the
budget held back. The figure itself is ``_monitor_figure``'s; what to draw comes from
the monitor's :class:`~ortlab.ui._monitor_data.StepLog`.

Example:
    >>> view = MonitorView(log, lambda: mon.steps, mon.status, mode="auto", max_points=1000,  # doctest: +SKIP
    ...                    top=10, module_depth=None, timed=lambda s: None, kernels=lambda: "")
    >>> view.show()                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ortlab.ui import _monitor_figure as plots
from ortlab.ui._monitor_data import StepLog

__all__ = ["MonitorView"]

logger = logging.getLogger(__name__)


class MonitorView:
    """Draws a monitor's log: the live view, static figures, the notebook hooks.

    Attributes:
        log: what is drawn.
        mode: ``"auto"``, ``"widget"`` or ``"static"`` (see ``ortlab.ui.monitor``).
        max_points, top, module_depth: drawing options (see ``ortlab.ui.monitor``).
        figure_widget: the live ``FigureWidget``, once :meth:`widget` built one.
        status_widget: the ipywidgets HTML status line above it.
    """

    def __init__(
        self,
        log: StepLog,
        steps: Callable[[], int],
        status: Callable[[], str],
        *,
        mode: str,
        max_points: int,
        top: int,
        module_depth: int | None,
        timed: Callable[[float], None],
        kernels: Callable[[], str],
        cell_ended: Callable[[], None] = lambda: None,
    ) -> None:
        self.log, self._steps, self._status, self._timed = log, steps, status, timed
        self._kernels, self._cell_ended = kernels, cell_ended
        self.mode, self.max_points, self.top, self.module_depth = mode, max_points, top, module_depth
        self.figure_widget: Any = None
        self.status_widget: Any = None
        self._box: Any = None
        self._static_figure: Any = None
        self._handles: list[Any] = []
        self._shown_in: int | None = None
        self._cell_callback: Callable | None = None
        self._drawn = -1

    # ----------------------------------------------------------------------- drawing
    def figure(self) -> Any:
        """A plain plotly Figure of everything recorded.

        Example:
            >>> view.figure().write_html("run.html")     # doctest: +SKIP
        """
        return plots.figure(self._series(), self._status(), self._kernels())

    def _series(self) -> dict[str, tuple]:
        return plots.series(self.log, self._steps(), self.max_points, self.top, self.module_depth)

    def redraw(self) -> None:
        """Push the current data to every view, each figure in one ``batch_update``."""
        self._drawn = self._steps()
        s, status, kernels = self._series(), self._status(), self._kernels()
        if self.figure_widget is not None:
            if self.status_widget is not None:  # first: the front end renders it before the slower figure
                self.status_widget.value = _status_html(status)
            plots.update_traces(self.figure_widget, s, "", kernels)
        if self._handles:
            plots.update_traces(self._static_figure, s, status, kernels)
            shown = plots.bundle(self._static_figure, status)
            for handle in self._handles:
                handle.update(shown, raw=True)

    def show_status(self, text: str) -> None:
        """Show ``text`` as the status line now, the plots unchanged (a step compiling).

        The live view's status line changes; a plain figure is sent again with ``text``
        as its title.
        """
        if self.status_widget is not None:
            self.status_widget.value = _status_html(text)
        if self._handles:
            self._static_figure.layout.title.text = plots.wrap(text)
            shown = plots.bundle(self._static_figure, text)
            for handle in self._handles:
                handle.update(shown, raw=True)

    def refresh(self) -> None:
        """Redraw now, whatever the budget."""
        if self.has_view():
            self.redraw()

    def has_view(self) -> bool:
        """Whether anything is shown that a redraw would update."""
        return self.figure_widget is not None or bool(self._handles)

    # ----------------------------------------------------------------------- display
    def widget(self) -> Any:
        """The live view, an ipywidgets VBox (status line, FigureWidget), or None.

        None where plotly's FigureWidget cannot be built or does not render (no
        ipywidgets/anywidget, Colab, VS Code, ``mode="static"``): :meth:`show` then
        draws a plain figure and updates it in place.

        Example:
            >>> view.widget()      # doctest: +SKIP
        """
        if self._box is not None:
            return self._box
        if self.mode == "static" or (self.mode == "auto" and not plots.widgets_render_here()):
            return None
        try:
            import ipywidgets
            import plotly.graph_objects as go

            s, kernels = self._series(), self._kernels()
            self.figure_widget = go.FigureWidget(plots.figure(s, "", kernels))
            self.figure_widget._config = plots.WIDGET_CONFIG
            self.status_widget = ipywidgets.HTML(value=_status_html(self._status()),
                                                 layout=ipywidgets.Layout(width="100%"))
            self._box = ipywidgets.VBox([self.status_widget, self.figure_widget],
                                        layout=ipywidgets.Layout(width="100%"))
        except Exception as e:  # ImportError, or anywidget/ipywidgets failing to start
            logger.info("ortlab monitor: no FigureWidget (%s); drawing a plain figure updated in place", e)
            self.figure_widget = self.status_widget = self._box = None
            return None
        self._time_redraw()
        return self._box

    def _time_redraw(self) -> None:
        """Redraw to learn what a redraw costs in this front end (the budget's estimate).

        The first sets every property of the new figure; a redraw while training sets the
        growing lines only (``_monitor_figure.update_traces``): the second is timed.
        """
        self.redraw()
        start = time.perf_counter()
        self.redraw()
        self._timed(time.perf_counter() - start)

    def show(self) -> None:
        """Display the live view in the notebook (the widget, or a figure updated in place).

        Example:
            >>> view.show()      # doctest: +SKIP
        """
        from IPython.display import display

        box = self.widget()
        if box is not None:
            from ortlab.ui._snapshot import Snapshot

            display(box)
            # what a reopened notebook shows: the figure as plain output (ortlab.ui._snapshot)
            self._snapshot = Snapshot("the monitor", figure=lambda: plots.bundle(self.figure(), self._status()))
            self._snapshot.show()
        else:
            if self._static_figure is None:
                self._static_figure = self.figure()
            self._handles.append(display(plots.bundle(self._static_figure, self._status()), raw=True, display_id=True))
            self._time_redraw()
        shell = plots.in_kernel()
        if shell is not None:
            self._shown_in = shell.execution_count
            if self._cell_callback is None:
                self._cell_callback = self._after_cell
                shell.events.register("post_run_cell", self._cell_callback)

    def _after_cell(self, *args: Any) -> None:
        """When a cell ends: the step in progress ends too (the monitor's ``cell_ended``); draw what the
        budget held back."""
        self._cell_ended()
        if self._steps() != self._drawn:
            self.refresh()

    def close(self) -> None:
        """Stop drawing after each cell (the views stay as last drawn)."""
        shell = plots.in_kernel()
        if self._cell_callback is not None and shell is not None:
            with contextlib.suppress(ValueError):
                shell.events.unregister("post_run_cell", self._cell_callback)
        self._cell_callback = None

    def ipython_display(self) -> None:
        """Show the view, unless ``monitor()`` showed it in this cell already."""
        shell = plots.in_kernel()
        if shell is not None and self._shown_in == shell.execution_count:
            return  # monitor() showed it in this cell already
        self.show()

    def html(self) -> str:
        """The figure as HTML (a status line where plotly is missing)."""
        try:
            return self.figure().to_html(full_html=False, include_plotlyjs="cdn")
        except ImportError:
            return f"<pre>{self._status()}</pre>"


def _status_html(text: str) -> str:
    """The status line as the live view's HTML: wrapped at its separators, never cut."""
    import html

    return ('<div class="ortlab-monitor-status" style="font-family: var(--jp-code-font-family, monospace); '
            f'font-size: 12px; white-space: normal; overflow-wrap: anywhere">{html.escape(text)}</div>')
