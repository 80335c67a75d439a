"""netron's page, offline: its static files, with the start-up checks and requests taken out.

Note [Why ortlab serves netron itself]
``netron.serve(file)`` answers ``/data/<path>`` with *any* file under the served
file's folder, configures the root logger when it has no handler, and its page,
offline, (1) asks ipinfo.io where the user is and then blocks on a cookie-consent
dialog (a ``consent`` cookie skips it), (2) sends Google Analytics events with
``navigator.sendBeacon``, and (3) once its build date is 180 days old shows a
"Please update" dialog in an endless loop: a pinned netron stops working six months
after its release. So ortlab serves netron's static files from its package folder
on 127.0.0.1 (a free port) with its own small HTTP server:

* ``/data/<key>/<name>`` answers only the names registered with :meth:`NetronServer.add`,
  and only with the server's random key (127.0.0.1 is reachable by every user of a
  shared machine); static files only from netron's folder, by plain name and known
  extension;
* ``index.html`` gets today's date as its build date (no update dialog), a CSP with
  ``connect-src 'self'`` (no request can leave the page: no analytics, no ipinfo),
  and a settings script (same origin: netron's CSP forbids inline scripts) that
  sets the consent cookie, stubs ``sendBeacon`` and selects the node named in ``?node=``,
  opening its properties in netron's sidebar, scrolled down to its ``ortlab.*`` metadata
  (module, file:line) when the frame is too short to show them; it also keeps the frame
  from moving the notebook around it: no scroll chaining out of the graph
  (``overscroll-behavior: contain``), and netron's focus on start-up does not scroll the
  notebook (``preventScroll``);
* ``browser.js`` is served with its three start-up checks (age, consent, telemetry)
  removed. If a later netron changes that code, the three measures above still hold;
  a debug log says the patch did not apply.

The model URL in the page is relative (``data/<key>/<name>``), so the page also works behind
jupyter-server-proxy (``{JUPYTERHUB_SERVICE_PREFIX}proxy/<port>/``).

This module makes the page and the static files; ``ortlab.ui._netron_server`` serves them.
"""

from __future__ import annotations

import datetime
import functools
import html
import importlib.util
import logging
import os
import re
import urllib.parse

from ortlab.errors import OrtlabError

__all__ = ["SETTINGS_SCRIPT", "SETTINGS_JS", "STATIC_TYPES", "netron_dir", "netron_version", "index_html",
           "static_file"]

logger = logging.getLogger(__name__)

STATIC_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".png": "image/png", ".ico": "image/x-icon", ".svg": "image/svg+xml",
    ".woff": "font/woff", ".woff2": "font/woff2", ".ttf": "font/ttf",
}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
SETTINGS_SCRIPT = "ortlab-settings.js"
SETTINGS_JS = r"""// ortlab: netron offline inside a notebook (see ortlab/ui/_netron_page.py).
(function () {
  'use strict';
  try {
    document.cookie = 'consent=' + Date.now() + ';path=/;max-age=315360000;SameSite=Lax';
  } catch (e) { /* cookies may be blocked in a frame: browser.js is patched too */ }
  try {
    if (window.Navigator && window.Navigator.prototype.sendBeacon) {
      window.Navigator.prototype.sendBeacon = function () { return true; };
    }
  } catch (e) { /* the CSP blocks the request anyway */ }
  // Inside a notebook: the wheel over the graph never scrolls the notebook around it, even at the
  // graph's edge (see Note [A frame that lets the notebook scroll] in ortlab/ui/_netron_frame.py).
  try { document.documentElement.style.overscrollBehavior = 'contain'; } catch (e) { }
  // netron focuses its graph when it opens: a focus scrolls every scroller around the frame,
  // the notebook's too. Focus without scrolling.
  [window.HTMLElement, window.SVGElement].forEach(function (type) {
    var focus = type && type.prototype.focus;
    if (!focus) { return; }
    type.prototype.focus = function (options) {
      return focus.call(this, Object.assign({}, options || {}, { preventScroll: true }));
    };
  });
  window.addEventListener('DOMContentLoaded', function () {
    var target = document.getElementById('target');
    if (target) { target.style.overscrollBehavior = 'contain'; }
    if (document.body) { document.body.style.overscrollBehavior = 'contain'; }
  });
  var wanted = new URLSearchParams(window.location.search).get('node');
  if (!wanted) { return; }
  // In a short frame the sidebar's metadata (below the node's inputs and outputs) is out of
  // sight: scroll the sidebar just enough to show ortlab.module and ortlab.source.
  var showSource = function (tries) {
    var source = document.querySelector("#sidebar-content input[title='ortlab.source']");
    var item = source && source.closest('.sidebar-item');
    var box = item && item.closest('.sidebar-object');
    if (!box) {
      if (tries < 50) { window.setTimeout(function () { showSource(tries + 1); }, 100); }
      return;
    }
    var below = item.getBoundingClientRect().bottom - box.getBoundingClientRect().bottom + 12;
    if (below > 0) { box.scrollTop += below; }
  };
  var reveal = function (view, target) {
    try {
      var exact = null, fused = null;
      target._table.forEach(function (element, value) {
        var name = value && typeof value.name === 'string' ? value.name : null;
        if (name === null) { return; }
        if (name === wanted) { exact = exact || value; }
        else if (name.indexOf(wanted + '/') === 0 || name.indexOf('fused ' + wanted + '/') === 0) { fused = fused || value; }
      });
      var value = exact || fused;
      // activate, as a click does: select it and open its properties (name, ortlab.module, ortlab.source).
      if (value) { target.scrollTo(target.activate(value)); showSource(0); return; }
    } catch (e) { /* fall back to netron's find sidebar */ }
    try { view._find = { query: wanted, node: true, connection: true, weight: false }; view.find(); } catch (e) { }
  };
  var tries = 0;
  var timer = window.setInterval(function () {
    tries += 1;
    var view = window.__view__;
    var target = view && view._target;
    if (target && target._table && target._table.size > 0) {
      window.clearInterval(timer);
      window.setTimeout(function () { reveal(view, target); }, 50);
    } else if (tries > 1200) {
      window.clearInterval(timer);
    }
  }, 100);
})();
"""


def netron_dir() -> str:
    """netron's package folder (its static files); raises with the install hint without netron."""
    spec = importlib.util.find_spec("netron")
    if spec is None or not spec.submodule_search_locations:
        raise OrtlabError("graph views need netron: pip install netron (or pip install 'ortlab[notebook]').")
    return list(spec.submodule_search_locations)[0]


def netron_version() -> str:
    """The installed netron's version (read from its index.html)."""
    with open(os.path.join(netron_dir(), "index.html"), encoding="utf-8") as f:
        m = re.search(r'<meta name="version" content="([^"]*)">', f.read())
    return m.group(1) if m else "unknown"


@functools.lru_cache(maxsize=None)
def static_file(name: str) -> bytes | None:
    """A file of netron's folder by plain name and known extension (``browser.js`` patched), else None."""
    folder = netron_dir()
    path = os.path.join(folder, name)
    if not _PLAIN_NAME.match(name) or os.path.splitext(name)[1] not in STATIC_TYPES or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    if name == "browser.js":
        data = _patch_browser_js(data.decode("utf-8")).encode("utf-8")
    return data


def _patch_browser_js(text: str) -> str:
    patched, count = re.subn(r"await\s+(age|consent|telemetry)\(\);", r"/* ortlab: no \1 check offline */", text)
    if count != 3:
        logger.debug("netron's browser.js changed (%d of 3 start-up checks found); relying on the build date, "
                     "the consent cookie and the CSP instead", count)
    return patched


def _csp(policy: str) -> str:
    """netron's policy with requests limited to this server (no analytics, no ipinfo.io)."""
    kept = [d.strip() for d in policy.split(";") if d.strip() and not d.strip().startswith("connect-src")]
    return "; ".join([*kept, "connect-src 'self' data: blob:"])


def index_html(file_name: str | None, title: str) -> bytes:
    """netron's index.html with today's build date, the CSP, the model ``data/<file_name>`` and our settings script."""
    with open(os.path.join(netron_dir(), "index.html"), encoding="utf-8") as f:
        text = f.read()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    text = re.sub(r'<meta name="date" content="[^"]*">', lambda _: f'<meta name="date" content="{now}">', text)
    if '<meta name="date"' not in text:
        text = text.replace("<title>", f'<meta name="date" content="{now}">\n<title>', 1)
    csp = re.compile(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">')
    if csp.search(text) is None:
        text = text.replace("<title>", '<meta http-equiv="Content-Security-Policy" content="">\n<title>', 1)
    text = csp.sub(lambda m: f'<meta http-equiv="Content-Security-Policy" content="{_csp(m.group(1))}">', text, count=1)
    meta = ['<meta name="type" content="Python">']
    if file_name:
        quoted = html.escape(urllib.parse.quote(file_name))
        base = html.escape(file_name.rsplit("/", 1)[-1])
        meta += [f'<meta name="file" content="data/{quoted}">',
                 f'<meta name="identifier" content="{base}">',
                 f'<meta name="name" content="{html.escape(title) if title else base}">']
    text = re.sub(r'(<meta name="version" content="[^"]*">)',
                  lambda m: m.group(1) + "\n" + "\n".join(meta), text, count=1)
    index_js = '<script type="text/javascript" src="index.js">'
    settings = f'<script type="text/javascript" src="{SETTINGS_SCRIPT}"></script>\n'
    text = text.replace(index_js, settings + index_js, 1)
    return text.encode("utf-8")

