"""The netron frame in a notebook's output: it lets the page scroll, and never shows a dead server.

Every graph view (``NetronView``, the frames under the kernel and toggle tables, the
stepper's) is the HTML :func:`frame_html` makes; table links into it come from
:func:`frame_link`.

Note [A frame that lets the notebook scroll]
An IFrame takes every wheel event over it: a 720 px netron view in a notebook at
1280x800 is a wall the notebook cannot be scrolled past. So a transparent shield lies
over the frame: the wheel over it scrolls the notebook, a click removes it (the graph
then zooms and pans), and it comes back when the pointer leaves the frame. The shield
is plain HTML with inline handlers, which run both in a trusted ``text/html`` output
and in an ipywidgets ``HTML`` (set through ``innerHTML``, where ``<script>`` never runs).

Note [A saved notebook shows no dead frame]
A notebook saved with a graph view and opened once its kernel (and the netron server in
it) is gone showed 720 px of the browser's "cannot connect" page. The output's HTML
therefore shows, as it is, a one-line message ("re-run this cell to open the graph")
and a hidden box with an IFrame without ``src``. A 1x1 image from the server
(``/ortlab-alive.gif``, answered only for a file the server still serves and with its
key, never cached) swaps the box in when it loads: only then does the IFrame get its
URL. A server that is gone never answers, so the message stays; an output rendered
without its handlers (an untrusted notebook, whose HTML is sanitized) shows the message
too. Links into a view that is not live scroll to its message instead of navigating.
"""

from __future__ import annotations

import html
import urllib.parse

__all__ = ["ALIVE", "probe_url", "frame_html", "FOCUS_JS", "OFF_MESSAGE"]

ALIVE = "ortlab-alive.gif"
OFF_MESSAGE = ("Graph view: its netron server is not running (the kernel that opened it stopped). "
               "Re-run this cell to open the graph.")
_SHIELD_TITLE = "Click to zoom and pan the graph; until then the mouse wheel scrolls the notebook"

# Scroll the notebook just enough that the view ``c`` is in sight: its bottom in view, its top
# never closer than 48 px to the top (the button or table above it stays readable). The
# notebook's scroller is the nearest scrolling ancestor (JupyterLab's, VS Code's or the page).
_INTO_SIGHT = (
    "var s=c.parentElement;"
    "while(s&&!(s.scrollHeight>s.clientHeight&&/auto|scroll/.test(getComputedStyle(s).overflowY))){s=s.parentElement;}"
    "s=s||document.scrollingElement;var r=c.getBoundingClientRect(),"
    "v=s===document.scrollingElement?{top:0,bottom:window.innerHeight}:s.getBoundingClientRect();"
    "s.scrollTop+=r.top<v.top+48?r.top-v.top-48:Math.min(r.top-v.top-48,Math.max(0,r.bottom-v.bottom));"
)
# The probe loaded: the server serves this file. Show the frame, load it, bring it into sight if asked.
_ON_ALIVE = (
    "var c=this.closest('.ortlab-netron');if(!c){return;}"
    "var f=c.querySelector('iframe');"
    "c.querySelector('.ortlab-netron-off').style.display='none';"
    "c.querySelector('.ortlab-netron-box').style.display='block';"
    "if(!f.getAttribute('src')){f.setAttribute('src',f.getAttribute('data-src'));}"
    "if(c.getAttribute('data-scroll')){" + _INTO_SIGHT + "}"
)
# The pointer left the frame: the shield is back, the wheel scrolls the notebook again.
_ON_LEAVE = "var s=this.querySelector('.ortlab-netron-shield');if(s){s.style.display='flex';}"
_ON_SHIELD_CLICK = "this.style.display='none';"
# Note [A link opens in the frame showing its graph]
# Every view's frame has a name of its own: the family's (``frame_name``: a lab's folder) and a number. A table
# link names the family (``data-frames``); on a click it picks, among the family's live frames, the one showing
# the link's graph file (``?file=``: the frame's last link, else its first page), else the last one opened, and
# retargets itself there, so the stepper's "View graph" frame no longer takes the table's links to a graph it
# does not show. No frame of the family: the link opens a tab of its own; frames not live (their message
# shows) are not navigated.
FOCUS_JS = (
    "var p=this.getAttribute('data-frames')||this.target,want=null;"
    "try{want=new URL(this.href).searchParams.get('file');}catch(e){}"
    "var fs=[].slice.call(document.querySelectorAll('iframe')).filter(function(f){"
    "return f.name===p||f.name.indexOf(p+'_')===0;});"
    "if(!fs.length){return true;}"
    "var live=fs.filter(function(f){var b=f.closest('.ortlab-netron');b=b&&b.querySelector('.ortlab-netron-box');"
    "return b&&b.style.display!=='none';});"
    "if(!live.length){return false;}"
    "var f=live.filter(function(f){var u=f.getAttribute('data-shown')||f.getAttribute('src')||f.getAttribute('data-src');"
    "try{return new URL(u,location.href).searchParams.get('file')===want;}catch(e){return false;}})[0]"
    "||live[live.length-1];"
    "this.target=f.name;f.setAttribute('data-shown',this.href);var c=f.closest('.ortlab-netron');"
    + _INTO_SIGHT +
    "return true;"
)


def _attr(text: str) -> str:
    return html.escape(text, quote=True)


def probe_url(url: str) -> str:
    """The URL of the server's liveness image for the view at ``url`` (same file and key).

    Example:
        >>> probe_url("http://127.0.0.1:8081/?file=m.onnx&key=k&node=n")
        'http://127.0.0.1:8081/ortlab-alive.gif?file=m.onnx&key=k'
    """
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    keep = urllib.parse.urlencode([(k, query[k][0]) for k in ("file", "key") if k in query])
    path = parts.path.rsplit("/", 1)[0] + "/" + ALIVE
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, keep, ""))


def frame_html(url: str, frame: str, height: int, header: str = "", scroll: bool = False) -> str:
    """A netron IFrame named ``frame`` that shows ``url`` while its server answers, under ``header``.

    See Note [A frame that lets the notebook scroll] and Note [A saved notebook shows no dead frame].

    Args:
        url: the view's page (``NetronServer.url``).
        frame: the IFrame's name: links with this target open in it.
        height: of the IFrame, in pixels.
        header: HTML above the frame.
        scroll: bring the view into sight once it opens (a view the user just asked for).
    """
    top = f'<div style="font:12px sans-serif;margin:2px 0">{header}</div>' if header else ""
    height = int(height)
    scrolls = ' data-scroll="1"' if scroll else ""
    shield = (
        f'<div class="ortlab-netron-shield" title="{_attr(_SHIELD_TITLE)}" onclick="{_attr(_ON_SHIELD_CLICK)}" '
        'style="position:absolute;top:0;left:0;right:0;bottom:0;display:flex;justify-content:center;'
        'align-items:flex-start;cursor:pointer;background:transparent">'
        '<span style="margin-top:6px;padding:1px 8px;font:11px sans-serif;color:#57606a;'
        'background:rgba(255,255,255,.9);border:1px solid #d0d7de;border-radius:10px">'
        "click to zoom and pan the graph</span></div>"
    )
    return (
        f'<div class="ortlab-netron"{scrolls}>{top}'
        '<div class="ortlab-netron-off" style="font:12px sans-serif;color:#57606a;padding:6px 8px;'
        f'border:1px dashed #d0d7de;border-radius:4px">{html.escape(OFF_MESSAGE)}</div>'
        f'<div class="ortlab-netron-box" style="display:none;position:relative;height:{height}px" '
        f'onmouseleave="{_attr(_ON_LEAVE)}">'
        f'<iframe name="{_attr(frame)}" data-src="{_attr(url)}" width="100%" height="{height}" '
        'style="border:1px solid #ccc;display:block;width:100%;height:100%;box-sizing:border-box"></iframe>'
        f"{shield}</div>"
        f'<img src="{_attr(probe_url(url))}" alt="" width="1" height="1" style="display:none" '
        f'onload="{_attr(_ON_ALIVE)}"></div>'
    )
