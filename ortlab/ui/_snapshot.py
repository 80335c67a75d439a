"""Static snapshots of live views, saved in the notebook beside the widgets.

A widget lives in the kernel: a reopened notebook (no kernel, or a new one) shows only
"Error displaying widget: model not found" where the monitor, the stepper or the toggles were,
and ipywidgets has no fallback (its JupyterLab renderer stops there). So each view also writes
a plain output after its widget: HTML, or a plotly figure, that JupyterLab renders without a
kernel. It is redrawn when each cell ends (IPython's ``post_run_cell``), so the saved notebook
holds the view's last state, with a line saying it is a snapshot.

Note [A snapshot hides while its widget lives]: beside a working widget the snapshot would show
the same thing twice. Its HTML carries a style rule (``:has()``, Chromium 105+, Firefox 121+)
hiding a snapshot that follows a rendered widget (``.widget-box``) in the same output area; a
widget that failed to render leaves only its error text, so the snapshot shows. Where the rule
does not apply (an untrusted notebook strips styles, VS Code), both show, the snapshot labelled.
"""

from __future__ import annotations

import html
import logging
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Snapshot", "snapshot_note", "attach"]

logger = logging.getLogger(__name__)

_STYLE = (
    "<style>"
    ".jp-OutputArea-child:has(.widget-box) ~ .jp-OutputArea-child:has(.ortlab-snapshot){display:none}"
    ".jp-OutputArea-child:has(.widget-box) ~ .jp-OutputArea-child:has(.ortlab-snapshot-figure)"
    " + .jp-OutputArea-child{display:none}"
    "</style>"
)
_LIVE: weakref.WeakSet[Snapshot] = weakref.WeakSet()
_REGISTERED: list[Any] = []  # the shell whose post_run_cell refreshes the snapshots


def snapshot_note(what: str, figure: bool = False) -> str:
    """The line over a snapshot: what it shows, and that it is not live."""
    cls = "ortlab-snapshot ortlab-snapshot-figure" if figure else "ortlab-snapshot"
    return (f"{_STYLE}<div class='{cls}' style='font-size:12px;color:#555;border-left:3px solid #bbb;"
            f"padding:2px 8px;margin:4px 0'><b>Snapshot</b> of {html.escape(what)} as last drawn, saved with the "
            "notebook (the live view needs its kernel: run the cell again to get it back)</div>")


def _in_kernel() -> Any:
    from ortlab.ui._monitor_figure import in_kernel

    return in_kernel()


class Snapshot:
    """A plain output after a live view, redrawn when each cell ends.

    Args:
        what: the view, in words ("the recompute toggles").
        render: the view's state as HTML, or None when ``figure`` draws it.
        figure: the view's state as a plotly mime bundle (``_monitor_figure.bundle``).
    """

    def __init__(self, what: str, render: Callable[[], str] | None = None,
                 figure: Callable[[], dict[str, Any]] | None = None) -> None:
        self.what, self.render, self.figure = what, render, figure
        self._handles: list[Any] = []
        self._last: list[Any] = []

    def _bundles(self) -> list[dict[str, Any]]:
        if self.figure is not None:
            return [{"text/html": snapshot_note(self.what, figure=True), "text/plain": f"snapshot of {self.what}"},
                    self.figure()]
        body = self.render() if self.render is not None else ""
        return [{"text/html": snapshot_note(self.what) + f"<div class='ortlab-snapshot'>{body}</div>",
                 "text/plain": f"snapshot of {self.what}"}]

    def show(self) -> None:
        """Display the snapshot under the live view (in a notebook kernel; elsewhere nothing)."""
        from IPython.display import display

        shell = _in_kernel()
        if shell is None:
            return
        bundles = self._bundles()
        self._handles = [display(b, raw=True, display_id=True) for b in bundles]
        self._last = bundles
        _LIVE.add(self)
        if not _REGISTERED or _REGISTERED[0] is not shell:
            shell.events.register("post_run_cell", _refresh_all)
            _REGISTERED[:] = [shell]

    def refresh(self) -> None:
        """Redraw the saved copy from the view's state now, if it changed."""
        if not self._handles:
            return
        bundles = self._bundles()
        for handle, new, old in zip(self._handles, bundles, self._last):
            if new != old:
                handle.update(new, raw=True)
        self._last = bundles


def _refresh_all(*_: Any) -> None:
    for snap in list(_LIVE):
        try:
            snap.refresh()
        except Exception as e:  # noqa: BLE001 - a view gone wrong keeps its last snapshot, said in the log
            logger.info("ortlab: snapshot of %s not redrawn: %s", snap.what, e)


def attach(box: Any, snapshot: Snapshot) -> Any:
    """Make displaying ``box`` (an ipywidgets box) show the widget, then ``snapshot`` under it."""
    def display_both(**_: Any) -> None:
        from IPython.display import display

        display(box._repr_mimebundle_(), raw=True)
        snapshot.show()

    box._ipython_display_ = display_both
    box.ortlab_snapshot = snapshot
    return box

