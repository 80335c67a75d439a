"""The HTML pieces every ortlab table is made of: escaping, tables, sizes, badges, links.

Tables render as plain HTML (``_repr_html_``, ipywidgets ``HTML``), styled inline so
they look the same in JupyterLab, classic Notebook, VS Code and a saved page.

Note [Links that look like links]
JupyterLab styles ``code`` inside rendered HTML with its own text color and links
without an underline, so a node name in ``<code>`` inside an ``<a>`` reads as plain
text. :func:`link` colors and underlines the link itself and lets the ``code`` in it
inherit the link's color.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["esc", "badge", "table", "fmt_seconds", "fmt_bytes", "link", "LINK_STYLE"]

_STATUS = {"done": ("#1a7f37", "done"), "pending": ("#6e7781", "pending"),
           "skipped": ("#9a6700", "skipped"), "failed": ("#cf222e", "failed")}
_TABLE = "border-collapse:collapse;font-size:12px;margin:4px 0"
_CELL = "padding:2px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top"
LINK_STYLE = "color:var(--jp-content-link-color,#0969da);text-decoration:underline;cursor:pointer"


def esc(value: Any) -> str:
    """``str(value)``, HTML-escaped."""
    return html.escape(str(value))


def badge(status: str) -> str:
    """A colored status chip (``done``, ``pending``, ``skipped``, ``failed``)."""
    color, text = _STATUS.get(status, ("#6e7781", status))
    return (f"<span style='background:{color};color:#fff;border-radius:8px;padding:0 7px;"
            f"font-size:11px'>{esc(text)}</span>")


def table(header: list[str], rows: list[list[str]], limit: int | None = None) -> str:
    """An HTML table; cells are already escaped. Rows past ``limit`` fold into <details>."""
    def body(part: list[list[str]]) -> str:
        return "".join("<tr>" + "".join(f"<td style='{_CELL}'>{c}</td>" for c in r) + "</tr>" for r in part)

    head = "<tr>" + "".join(f"<th style='{_CELL}'>{esc(h)}</th>" for h in header) + "</tr>"
    if limit is None or len(rows) <= limit:
        return f"<table style='{_TABLE}'>{head}{body(rows)}</table>"
    return (f"<table style='{_TABLE}'>{head}{body(rows[:limit])}</table>"
            f"<details><summary style='font-size:12px'>{len(rows) - limit} more</summary>"
            f"<table style='{_TABLE}'>{head}{body(rows[limit:])}</table></details>")


def fmt_seconds(s: float | None) -> str:
    """``12.3 ms`` or ``1.23 s``; "" for None."""
    if s is None:
        return ""
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``3.0 MiB``..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def link(text: str, url: str | None, frame: str, onclick: str = "") -> str:
    """``text`` (already HTML) as a link to a netron view opening in the frame ``frame``.

    See Note [Links that look like links]. ``url=None``: ``text`` as it is. ``onclick``: JavaScript run on a click.

    Example:
        >>> link("<code>node_mm</code>", "http://127.0.0.1:1/?node=node_mm", "f")  # doctest: +ELLIPSIS
        "<a href='http://127.0.0.1:1/?node=node_mm' target='f' data-frames='f' title='open in netron' style='...'><code style='color:inherit'>node_mm</code></a>"
    """
    if url is None:
        return text
    text = text.replace("<code>", "<code style='color:inherit'>")
    handler = f" onclick='{html.escape(onclick, quote=True)}'" if onclick else ""
    return (f"<a href='{html.escape(url, quote=True)}' target='{html.escape(frame, quote=True)}' "
            f"data-frames='{html.escape(frame, quote=True)}' "
            f"title='open in netron' style='{LINK_STYLE}'{handler}>{text}</a>")

