"""Graph views: netron inside the notebook, serving only the files ortlab saved.

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
  opening its properties in netron's sidebar (its ``ortlab.*`` metadata: module, file:line);
* ``browser.js`` is served with its three start-up checks (age, consent, telemetry)
  removed. If a later netron changes that code, the three measures above still hold;
  a debug log says the patch did not apply.

The model URL in the page is relative (``data/<key>/<name>``), so the page also works behind
jupyter-server-proxy (``{JUPYTERHUB_SERVICE_PREFIX}proxy/<port>/``).

Note [Large graphs]
netron lays a graph out in the browser; above a few thousand nodes that takes
minutes. Every ONNX node ortlab exports carries its nn.Module path
(``ortlab.module``), so a view of a large graph shows one module's nodes: the
subgraph of that module, with the values it reads as inputs and the values others
read as outputs, saved next to the stage (``views/``) and served like any stage file.
onnxruntime's optimized models lose the metadata; their nodes keep the exported
node's name before the first ``/``, which leads back to the exported model's metadata.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import hmac
import html
import http.server
import importlib.util
import logging
import os
import re
import secrets
import threading
import urllib.parse
import weakref
from typing import Any

from ortlab.errors import ConfigError, OrtlabError

__all__ = [
    "NetronServer",
    "NetronView",
    "ModulePicker",
    "CodeView",
    "default_server",
    "stop_default_server",
    "set_proxy",
    "proxy_prefix",
    "extract_module",
    "annotate",
    "module_counts",
    "node_modules",
    "resolve_node",
    "view_file",
    "view_stage",
    "url_for",
    "frame_name",
    "forget_folder",
    "running_default_server",
    "netron_version",
]

logger = logging.getLogger(__name__)

MAX_NODES = 5000
_STATIC_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".png": "image/png", ".ico": "image/x-icon", ".svg": "image/svg+xml",
    ".woff": "font/woff", ".woff2": "font/woff2", ".ttf": "font/ttf",
}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
SETTINGS_SCRIPT = "ortlab-settings.js"
_SETTINGS_JS = r"""// ortlab: netron offline inside a notebook (see ortlab/ui/netron_view.py).
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
  var wanted = new URLSearchParams(window.location.search).get('node');
  if (!wanted) { return; }
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
      if (value) { target.scrollTo(target.activate(value)); return; }
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


# ------------------------------------------------------------------------------- netron files
def _netron_dir() -> str:
    spec = importlib.util.find_spec("netron")
    if spec is None or not spec.submodule_search_locations:
        raise OrtlabError("graph views need netron: pip install netron (or pip install 'ortlab[notebook]').")
    return list(spec.submodule_search_locations)[0]


def netron_version() -> str:
    """The installed netron's version (read from its index.html)."""
    with open(os.path.join(_netron_dir(), "index.html"), encoding="utf-8") as f:
        m = re.search(r'<meta name="version" content="([^"]*)">', f.read())
    return m.group(1) if m else "unknown"


@functools.lru_cache(maxsize=None)
def _static(name: str) -> bytes | None:
    folder = _netron_dir()
    path = os.path.join(folder, name)
    if not _PLAIN_NAME.match(name) or os.path.splitext(name)[1] not in _STATIC_TYPES or not os.path.isfile(path):
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


def _index_html(file_name: str | None, title: str) -> bytes:
    with open(os.path.join(_netron_dir(), "index.html"), encoding="utf-8") as f:
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


# ------------------------------------------------------------------------------------ server
class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "ortlab-netron"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        parsed = urllib.parse.urlparse(self.path)
        path = urllib.parse.unquote(parsed.path)
        owner = self.server.owner  # type: ignore[attr-defined]
        body, ctype, cache = None, "", "no-store"
        if path in ("/", "/index.html"):
            query = urllib.parse.parse_qs(parsed.query)
            name = query.get("file", [None])[0]
            if name is None:
                body = _index_html(None, "")
            elif owner.path_of(name) is not None and hmac.compare_digest(query.get("key", [""])[0], owner.key):
                body = _index_html(f"{owner.key}/{name}", query.get("title", [""])[0] or name)
            ctype = _STATIC_TYPES[".html"]
        elif path == "/" + SETTINGS_SCRIPT:
            body, ctype = _SETTINGS_JS.encode("utf-8"), _STATIC_TYPES[".js"]
        elif path.startswith(f"/data/{owner.key}/"):
            file = owner.path_of(path[len(f"/data/{owner.key}/"):])
            if file is not None and os.path.isfile(file):
                with open(file, "rb") as f:
                    body, ctype = f.read(), "application/octet-stream"
        elif path.count("/") == 1:
            name = path[1:]
            body = _static(name)
            ctype, cache = _STATIC_TYPES.get(os.path.splitext(name)[1], ""), "max-age=3600"
        if body is None:
            self.send_response(404)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "9")
            self.end_headers()
            if send_body:
                self.wfile.write(b"not found")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        logger.debug("netron server: " + format, *args)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: NetronServer


_SERVERS: weakref.WeakSet[NetronServer] = weakref.WeakSet()


def proxy_prefix(port: int, proxy: bool | str | None = None) -> str | None:
    """The URL path the browser reaches ``port`` at through jupyter-server-proxy, if any.

    ``proxy=None`` detects JupyterHub/Binder (``JUPYTERHUB_SERVICE_PREFIX``); ``True``
    always proxies (``/proxy/<port>/`` under that prefix, or under ``/``); ``False``
    never; a string is a template with ``{port}``, e.g. ``"https://hub/user/me/proxy/{port}/"``.

    Example:
        >>> proxy_prefix(8081, "/user/me/proxy/{port}/")
        '/user/me/proxy/8081/'
    """
    if proxy is False:
        return None
    if isinstance(proxy, str):
        if "{port}" not in proxy:
            raise ConfigError(f"proxy={proxy!r} needs a '{{port}}' placeholder, e.g. '/proxy/{{port}}/'.")
        url = proxy.format(port=port)
        return url if url.endswith("/") else url + "/"
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX")
    if prefix is None and proxy is not True:
        return None
    return f"{(prefix or '/').rstrip('/')}/proxy/{port}/"


class NetronServer:
    """A netron server on 127.0.0.1 that serves only the files given to :meth:`add`.

    Args:
        host: address to bind (keep the default: the server has no authentication).
        port: 0 picks a free port.
        proxy: how the browser reaches the server, see :func:`proxy_prefix`.

    Example:
        >>> with NetronServer() as server:                        # doctest: +SKIP
        ...     url = server.url(server.add("net_forward_exported_train.onnx"))
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, proxy: bool | str | None = None) -> None:
        self.host, self.proxy = host, proxy
        self._port = port
        # 127.0.0.1 is reachable by every user of a shared machine: pages and files need this key.
        self.key = secrets.token_urlsafe(12)
        self._files: dict[str, str] = {}
        self._lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        _SERVERS.add(self)

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> NetronServer:
        if self.running:
            return self
        _netron_dir()  # fail early, with the install hint
        httpd = _HTTPServer((self.host, self._port), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"ortlab-netron-{httpd.server_address[1]}", daemon=True)
        self._thread.start()
        logger.debug("netron server on %s", self.local_url())
        return self

    def stop(self) -> None:
        """Stop serving (the registered files are kept for a later :meth:`start`)."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._httpd is not None and self._thread is not None and self._thread.is_alive()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise OrtlabError("the netron server is not running; call start() first.")
        return int(self._httpd.server_address[1])

    def __enter__(self) -> NetronServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------- files
    def add(self, path: str, name: str | None = None) -> str:
        """Serve ``path`` (a file ortlab saved) as ``data/<name>``; returns the name."""
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise OrtlabError(f"cannot serve {path}: no such file.")
        with self._lock:
            for known, p in self._files.items():
                if p == path:
                    return known
            base = re.sub(r"[^A-Za-z0-9_.-]", "_", name or os.path.basename(path)).lstrip(".") or "model.onnx"
            stem, ext = os.path.splitext(base)
            candidate, k = base, 1
            while candidate in self._files:
                candidate, k = f"{stem}-{k}{ext}", k + 1
            self._files[candidate] = path
            return candidate

    def remove(self, name: str) -> None:
        with self._lock:
            self._files.pop(name, None)

    def forget_folder(self, folder: str) -> None:
        """Stop serving every file under ``folder``."""
        folder = os.path.abspath(folder) + os.sep
        with self._lock:
            for name in [n for n, p in self._files.items() if p.startswith(folder)]:
                del self._files[name]

    def path_of(self, name: str) -> str | None:
        with self._lock:
            return self._files.get(name)

    @property
    def files(self) -> dict[str, str]:
        with self._lock:
            return dict(self._files)

    # ----------------------------------------------------------------------------- URLs
    def _query(self, name: str | None, node: str | None, title: str | None) -> str:
        key = self.key if name else None
        params = {k: v for k, v in (("file", name), ("key", key), ("node", node), ("title", title)) if v}
        return "?" + urllib.parse.urlencode(params) if params else ""

    def local_url(self, name: str | None = None, node: str | None = None, title: str | None = None) -> str:
        """``http://127.0.0.1:<port>/?file=...``: the URL on this machine."""
        return f"http://{self.host}:{self.port}/{self._query(name, node, title)}"

    def url(self, name: str | None = None, node: str | None = None, title: str | None = None) -> str:
        """The URL a browser opens: proxied behind JupyterHub, else the local one."""
        prefix = proxy_prefix(self.port, self.proxy)
        return prefix + self._query(name, node, title) if prefix else self.local_url(name, node, title)


_DEFAULT: NetronServer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_server(proxy: bool | str | None = None) -> NetronServer:
    """The process's shared netron server, started on first use, stopped at exit.

    Example:
        >>> default_server().url(default_server().add("lab/net_forward_exported_train.onnx"))  # doctest: +SKIP
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = NetronServer(proxy=proxy)
        elif proxy is not None:
            _DEFAULT.proxy = proxy
        return _DEFAULT.start()


def running_default_server() -> NetronServer | None:
    """The shared server if it is running (never starts one)."""
    return _DEFAULT if _DEFAULT is not None and _DEFAULT.running else None


def set_proxy(proxy: bool | str | None) -> None:
    """How the browser reaches graph views (see :func:`proxy_prefix`).

    Example:
        >>> set_proxy(True)      # doctest: +SKIP
    """
    default_server(proxy=proxy)


def stop_default_server() -> None:
    """Stop the shared server (graph views already shown go blank).

    Example:
        >>> stop_default_server()                    # doctest: +SKIP
    """
    if _DEFAULT is not None:
        _DEFAULT.stop()


def forget_folder(folder: str) -> None:
    """Stop serving the files of a lab folder (``Lab.close`` calls this)."""
    for server in list(_SERVERS):
        server.forget_folder(folder)


@atexit.register
def _stop_all() -> None:
    for server in list(_SERVERS):
        server.stop()


def frame_name(folder: str) -> str:
    """The iframe name a lab's views use, so table links open in the lab's view.

    Example:
        >>> frame_name("/tmp/lab").startswith("ortlab_netron_")
        True
    """
    return "ortlab_netron_" + hashlib.sha1(os.path.abspath(folder).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------------- subgraphs
def _load(path: str) -> Any:
    """The model at ``path``, cached while the file is unchanged (callers must not modify it)."""
    return _load_cached(os.path.abspath(path), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> Any:
    import onnx

    return onnx.load(path, load_external_data=False)


_PROVENANCE = ("ortlab.module", "ortlab.source", "ortlab.fx_node", "ortlab.op")


def annotate(model: Any, reference: Any) -> Any | None:
    """A copy of an onnxruntime-optimized model whose nodes carry their source again.

    onnxruntime drops node metadata; a node keeps the exported node's name before the
    first ``/``, so the ``ortlab.*`` metadata of ``reference`` is copied onto it.
    ``None`` when there is nothing to add.

    Example:
        >>> optimized = onnx.load("net_forward_ort_all_train.onnx")          # doctest: +SKIP
        >>> annotate(optimized, onnx.load("net_forward_onnxscript_train.onnx"))  # doctest: +SKIP
    """
    import onnx

    props = {n.name: [(p.key, p.value) for p in n.metadata_props if p.key in _PROVENANCE] for n in reference.graph.node}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    added = 0
    for node in out.graph.node:
        if any(p.key in _PROVENANCE for p in node.metadata_props):
            continue
        base = node.name[len("fused "):] if node.name.startswith("fused ") else node.name
        for key, value in props.get(base.split("/")[0], []):
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
            added += 1
    return out if added else None


def node_modules(model: Any, reference: Any = None) -> dict[str, str]:
    """ONNX node name -> nn.Module path (``ortlab.module``), via ``reference`` for optimized models.

    Example:
        >>> node_modules(onnx.load("net_forward_exported_train.onnx"))["node_addmm"]   # doctest: +SKIP
        'fc1'
    """
    known: dict[str, str] = {}
    for source in ([reference] if reference is not None else []) + [model]:
        for node in source.graph.node:
            for prop in node.metadata_props:
                if prop.key == "ortlab.module":
                    known[node.name] = prop.value
    out = {}
    for node in model.graph.node:
        name = node.name
        base = name[len("fused "):] if name.startswith("fused ") else name
        out[name] = known.get(name, known.get(base.split("/")[0], "?"))
    return out


def _in_module(path: str, module: str) -> bool:
    if module == "":
        return path == ""
    return path == module or path.startswith(module + ".")


def module_counts(model: Any, depth: int = 1, reference: Any = None) -> dict[str, int]:
    """Nodes per nn.Module path cut at ``depth`` parts (``""`` is the root module).

    Example:
        >>> module_counts(model, depth=2)            # doctest: +SKIP
        {'blocks.0': 410, 'blocks.1': 410, 'head': 3, '': 12}
    """
    counts: dict[str, int] = {}
    for path in node_modules(model, reference).values():
        key = path if path in ("", "?") else ".".join(path.split(".")[:depth])
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def extract_module(model: Any, module: str, reference: Any = None) -> Any:
    """The subgraph of the nodes of one nn.Module (and its children) as a model of its own.

    Its inputs are the values its nodes read from outside (weights stay initializers),
    its outputs the values the rest of the graph reads. ``module=""`` takes the nodes
    of the root module itself.

    Raises:
        ConfigError: naming the modules there are when no node belongs to ``module``.

    Example:
        >>> sub = extract_module(onnx.load("gpt_forward_exported_train.onnx"), "blocks.0.attn")  # doctest: +SKIP
    """
    import onnx
    import onnx.helper

    graph = model.graph
    modules = node_modules(model, reference)
    keep = [n for n in graph.node if _in_module(modules.get(n.name, "?"), module)]
    if not keep:
        valid = ", ".join(repr(m) for m in list(module_counts(model, 2, reference))[:12])
        raise ConfigError(f"no node of graph {graph.name!r} belongs to module {module!r}; modules: {valid}.")
    try:
        typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # contrib ops or symbolic sizes: untyped boundary values are fine for a view
        typed = model
    types = {v.name: v for v in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]}
    initializers = {t.name: t for t in graph.initializer}
    produced = {o for n in keep for o in n.output if o}
    kept = {id(n) for n in keep}
    consumed: list[str] = []
    for node in keep:
        for name in node.input:
            if name and name not in produced and name not in consumed:
                consumed.append(name)
    read_outside = {i for n in graph.node if id(n) not in kept for i in n.input} | {o.name for o in graph.output}
    outputs = [o for n in keep for o in n.output if o and o in read_outside] or [o for o in keep[-1].output if o]

    def info(name: str) -> Any:
        return types[name] if name in types else onnx.helper.make_empty_tensor_value_info(name)

    sub = onnx.helper.make_graph(
        keep,
        f"{graph.name}:{module or '<root>'}",
        [info(n) for n in consumed if n not in initializers],
        [info(n) for n in outputs],
        initializer=[initializers[n] for n in consumed if n in initializers],
        value_info=[types[n] for n in produced if n in types and n not in outputs],
    )
    out = onnx.helper.make_model(sub, opset_imports=list(model.opset_import), functions=list(model.functions))
    out.ir_version = model.ir_version
    onnx.helper.set_model_props(out, {"ortlab.module_filter": module, "ortlab.nodes_of_graph": str(len(graph.node))})
    return out


def resolve_node(model: Any, name: str, reference: Any = None) -> str | None:
    """The ONNX name to select for ``name``: a node, an FX node's ONNX node, or a value.

    ``name`` may be an ONNX node name, an FX node name (matched through the
    ``ortlab.fx_node`` metadata of ``model`` or of ``reference``, the exported model an
    optimized one came from) or a value (graph input or output) name. ``None`` when
    nothing matches.

    Example:
        >>> resolve_node(onnx.load("net_forward_exported_train.onnx"), "tanh")   # doctest: +SKIP
        'node_tanh'
    """
    nodes = list(model.graph.node)
    names = {n.name for n in nodes}
    if name in names:
        return name
    for source in [model] + ([reference] if reference is not None else []):
        found = [n.name for n in source.graph.node
                 if any(p.key == "ortlab.fx_node" and p.value == name for p in n.metadata_props)]
        if not found:
            continue
        for candidate in reversed(found):
            if candidate in names:
                return candidate
            fused = next((n for n in names if n.split("/")[0] in (candidate, "fused " + candidate)), None)
            if fused is not None:
                return fused
        return found[-1]
    values = {v.name for v in [*model.graph.input, *model.graph.output]} | {o for n in nodes for o in n.output}
    return name if name in values else None


# ------------------------------------------------------------------------------------ views
class NetronView:
    """A graph in netron, shown in the notebook as an IFrame (``_repr_html_``).

    Attributes:
        url: the page, with ``?file=`` and ``?node=``; ``path``: the file shown;
        node: the node selected; ``info``: what is shown (a module's subgraph...).
    """

    def __init__(self, server: NetronServer, name: str, path: str, node: str | None = None,
                 height: int = 600, info: str = "", frame: str | None = None) -> None:
        self.server, self.name, self.path, self.node = server, name, path, node
        self.height, self.info, self.frame = height, info, frame or frame_name(os.path.dirname(path))
        self.url = server.url(name, node)

    def _repr_html_(self) -> str:
        info = f" &middot; {html.escape(self.info)}" if self.info else ""
        node = f" &middot; node <code>{html.escape(self.node)}</code>" if self.node else ""
        url = html.escape(self.url, quote=True)
        return (
            f'<div class="ortlab-netron"><div style="font:12px sans-serif;margin:2px 0">'
            f"netron: <b>{html.escape(os.path.basename(self.path))}</b>{info}{node} &middot; "
            f'<a href="{url}" target="_blank" rel="noopener">open in a new tab</a></div>'
            f'<iframe name="{self.frame}" src="{url}" width="100%" height="{int(self.height)}" '
            f'style="border:1px solid #ccc" loading="lazy"></iframe></div>'
        )

    def iframe(self) -> Any:
        """An ``IPython.display.IFrame`` of the view."""
        from IPython.display import IFrame

        return IFrame(self.url, width="100%", height=self.height)

    def close(self) -> None:
        """Stop serving this view's file."""
        self.server.remove(self.name)

    def __repr__(self) -> str:
        return f"NetronView({self.url})"


class ModulePicker:
    """Shown instead of a graph too large for netron: its modules, to view one at a time."""

    def __init__(self, path: str, nodes: int, counts: dict[str, int], call: str, max_nodes: int) -> None:
        self.path, self.nodes, self.counts, self.call, self.max_nodes = path, nodes, counts, call, max_nodes

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><code>{html.escape(m or '<root>')}</code></td><td style='text-align:right'>{n}</td></tr>"
            for m, n in list(self.counts.items())[:40]
        )
        example = next((m for m in self.counts if m not in ("", "?")), "")
        return (
            f"<div style='font:12px sans-serif'><p><b>{html.escape(os.path.basename(self.path))}</b> has "
            f"{self.nodes} nodes (netron lays out more than {self.max_nodes} slowly). View one module: "
            f"<code>{html.escape(self.call)}(module={example!r})</code>, or all of it with "
            f"<code>force=True</code>.</p><table><tr><th>module</th><th>nodes</th></tr>{rows}</table></div>"
        )

    def __repr__(self) -> str:
        return f"ModulePicker({self.path}: {self.nodes} nodes, modules {list(self.counts)[:8]})"


class CodeView:
    """An FX stage's code (netron does not read FX graphs), with a node's line marked."""

    def __init__(self, path: str, node: str | None = None) -> None:
        self.path, self.node = path, node
        with open(path, encoding="utf-8") as f:
            self.code = f.read()

    def line_of(self, node: str) -> int | None:
        """1-based line that defines ``node`` (``name: "f32[..]" = ...`` or ``name = ...``)."""
        pattern = re.compile(rf"^\s+{re.escape(node)}(?:: \"[^\"]*\")? = ")
        return next((i for i, line in enumerate(self.code.splitlines(), 1) if pattern.match(line)), None)

    def _repr_html_(self) -> str:
        mark = self.line_of(self.node) if self.node else None
        lines = []
        for i, line in enumerate(self.code.splitlines(), 1):
            style = " style='background:#fff3b0'" if i == mark else ""
            lines.append(f"<span id='L{i}'{style}>{html.escape(line)}</span>")
        return (f"<div style='font:12px sans-serif'><b>{html.escape(os.path.basename(self.path))}</b></div>"
                f"<pre style='max-height:500px;overflow:auto;font-size:11px'>{chr(10).join(lines)}</pre>")


def _reference_path(path: str) -> str | None:
    """The exported (or onnxscript) model an optimized stage file came from, if saved next to it."""
    for stage in ("onnxscript", "exported"):
        candidate = re.sub(r"_(ort_basic|ort_extended|ort_all|execution|onnxscript)_(train|eval)\.onnx$",
                           rf"_{stage}_\2.onnx", path)
        if candidate != path and os.path.exists(candidate):
            return candidate
    return None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "root"


def _module_file(path: str, model: Any, module: str, reference: Any) -> str:
    import onnx

    folder = os.path.join(os.path.dirname(path), "views")
    out = os.path.join(folder, f"{os.path.splitext(os.path.basename(path))[0]}.{_safe(module)}.onnx")
    if not (os.path.exists(out) and os.stat(out).st_mtime_ns >= os.stat(path).st_mtime_ns):
        os.makedirs(folder, exist_ok=True)
        annotated = annotate(model, reference) if reference is not None else None
        onnx.save(extract_module(annotated or model, module, reference), out)
    return out


def _annotated_file(path: str, model: Any, reference: Any) -> str:
    """``path``, or a copy under ``views/`` whose nodes carry their source (see :func:`annotate`)."""
    import onnx

    out = os.path.join(os.path.dirname(path), "views", os.path.basename(path))
    if os.path.exists(out) and os.stat(out).st_mtime_ns >= os.stat(path).st_mtime_ns:
        return out
    annotated = annotate(model, reference)
    if annotated is None:
        return path
    os.makedirs(os.path.dirname(out), exist_ok=True)
    onnx.save(annotated, out)
    return out


def url_for(path: str, node: str | None = None, server: NetronServer | None = None,
            max_nodes: int = MAX_NODES) -> str:
    """The URL of a view of ``path`` with ``node`` selected (for links in tables).

    A graph larger than ``max_nodes`` links to the subgraph of the node's module.

    Example:
        >>> url_for("lab/net_forward_exported_train.onnx", "tanh")     # doctest: +SKIP
        'http://127.0.0.1:40123/?file=net_forward_exported_train.onnx&node=node_tanh&title=...'
    """
    server = server or default_server()
    view = view_file(path, node=node, server=server, max_nodes=max_nodes)
    if isinstance(view, ModulePicker):  # a node of no known module: the whole graph
        return server.url(server.add(path), node)
    return view.url


def view_file(
    path: str,
    node: str | None = None,
    module: str | None = None,
    height: int = 600,
    max_nodes: int = MAX_NODES,
    force: bool = False,
    server: NetronServer | None = None,
    frame: str | None = None,
    call: str = "view",
) -> NetronView | ModulePicker:
    """Show a saved ONNX file in netron; a large one a module at a time.

    Args:
        path: an ONNX file ortlab saved.
        node: select this node (see :func:`resolve_node`).
        module: show only this nn.Module's nodes (see :func:`extract_module`).
        height: of the IFrame, in pixels.
        max_nodes: above this many nodes show a module (the node's, when ``node`` is
            given) or, without one, a :class:`ModulePicker`.
        force: show the whole graph however large.
        server: default :func:`default_server`.
        frame: the IFrame's name (links with this target open in it).
        call: how the picker tells the user to call again.

    Example:
        >>> view_file("lab/net_forward_exported_train.onnx", node="addmm")    # doctest: +SKIP
    """
    model = _load(path)
    ref_path = _reference_path(path)
    reference = _load(ref_path) if ref_path else None
    target = resolve_node(model, node, reference) if node else None
    nodes = len(model.graph.node)
    info = f"{nodes} nodes"
    if module is None and nodes > max_nodes and not force:
        modules = node_modules(model, reference)
        if target is not None and target not in modules:  # a value: its producer's module
            target_node = next((n.name for n in model.graph.node if target in n.output), None)
            module = modules.get(target_node or "")
        else:
            module = modules.get(target or "") if target else None
        if module in (None, "?"):
            return ModulePicker(path, nodes, module_counts(model, 2, reference), call, max_nodes)
    if module is not None:
        sub = _module_file(path, model, module, reference)
        info = f"module {module or '<root>'} of {os.path.basename(path)} ({nodes} nodes)"
        path = sub
    elif reference is not None:
        path = _annotated_file(path, model, reference)
    server = server or default_server()
    return NetronView(server, server.add(path), path, target or node, height, info, frame)


def view_stage(stage: Any, graph: str | None = None, node: str | None = None, module: str | None = None,
               **kwargs: Any) -> NetronView | ModulePicker | CodeView:
    """Show a stage's graph (see ``Stage.view``); FX stages show their code.

    Example:
        >>> view_stage(lab["ort_all"], graph="g0.backward", node="mm")   # doctest: +SKIP
    """
    if not stage.artifacts:
        raise OrtlabError(f"stage {stage.name!r} has no saved graph (status: {stage.status}).")
    label = graph
    if label is None and node is not None:
        label = _label_with(stage, node)
    path = stage.artifact(label)
    if stage.kind == "fx":
        return CodeView(path, node)
    kwargs.setdefault("frame", frame_name(stage.root))
    kwargs.setdefault("call", f"lab[{stage.name!r}].view")
    return view_file(path, node=node, module=module, **kwargs)


def _label_with(stage: Any, node: str) -> str | None:
    """The first artifact of the stage that has ``node`` (by name, FX name or value)."""
    for label in stage.artifacts:
        path = stage.artifact(label)
        if stage.kind == "fx":
            if CodeView(path).line_of(node) is not None:
                return label
            continue
        ref = _reference_path(path)
        if resolve_node(_load(path), node, _load(ref) if ref else None) is not None:
            return label
    return None
