"""The netron server: 127.0.0.1, a free port, only the files ortlab registered, behind a key.

``/data/<key>/<name>`` answers only the names registered with :meth:`NetronServer.add`,
and only with the server's random key (127.0.0.1 is reachable by every user of a shared
machine); the page and netron's static files come from ``ortlab.ui._netron_page``
(see Note [Why ortlab serves netron itself] there). One shared server per process
(:func:`default_server`) serves every graph view; it stops at exit.

Note [What the netron server answers]
The server is on 127.0.0.1, but a web page the user opens elsewhere can still reach
it, and other users of the machine can connect to it, so besides the key:

* DNS rebinding: a page at ``http://evil.example:<port>`` whose name the attacker
  then resolves to 127.0.0.1 talks to the server as its own origin. Its requests
  carry ``Host: evil.example:<port>``, so the server answers only requests whose
  ``Host`` is a loopback name (``127.0.0.1``, ``localhost``, ``[::1]``; any port, as
  an SSH tunnel or VS Code may forward another local port to it) or, when a proxy
  is configured (:func:`proxy_prefix`), that come through it: the host of a proxy
  URL, or jupyter-server-proxy's ``X-Forwarded-Prefix`` (``X-Forwarded-Context``,
  ``X-ProxyContextPath``) naming the proxy's path. Others get 403.
* Slow clients: a request's line and headers must all arrive within ``timeout``
  seconds (30) of its connection, and each 1 MiB of an answer must be taken within
  ``timeout``; at most ``max_connections`` (32) are served at once, and a connection
  beyond them closes the one that has waited longest without progress, never itself
  (Note [A slow client holds no slot]).
* Files: a registered file is resolved (:func:`os.path.realpath`) when it is
  registered; a request is answered only while the name still resolves there, and
  the file is opened with ``O_NOFOLLOW`` and must be a regular file: a file
  replaced by a symlink (or a FIFO) after it was registered is not served.
* Forks: a forked child (``multiprocessing``, a DataLoader worker) drops the
  servers it inherited (``os.register_at_fork``): it closes its copy of the
  listening socket, so ``stop()`` in the parent frees the port, and it never
  answers on the parent's port or with its key.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import hmac
import http.server
import io
import logging
import math
import os
import re
import secrets
import socket
import stat
import threading
import time
import urllib.parse
import weakref
from typing import Any

from ortlab.errors import ConfigError, OrtlabError
from ortlab.ui._netron_frame import ALIVE
from ortlab.ui._netron_page import SETTINGS_JS, SETTINGS_SCRIPT, STATIC_TYPES, index_html, netron_dir, static_file

__all__ = [
    "NetronServer",
    "proxy_prefix",
    "default_server",
    "running_default_server",
    "set_proxy",
    "stop_default_server",
    "forget_folder",
    "frame_name",
]

logger = logging.getLogger(__name__)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_FORWARDED_PREFIX = ("X-Forwarded-Prefix", "X-Forwarded-Context", "X-ProxyContextPath")
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[^:\[\]/@\s]+)(?::\d{1,5})?")  # name (or [IPv6]) and port


def host_allowed(headers: Any, port: int, proxy: bool | str | None) -> bool:
    """Whether a request with these headers may be answered (Note [What the netron server answers]).

    Example:
        >>> [host_allowed({"Host": h}, 8081, None) for h in ("127.0.0.1:8081", "evil.example:8081")]
        [True, False]
    """
    host = (headers.get("Host") or "").strip().lower()
    m = _HOST.fullmatch(host)
    if m is None:
        return False
    if m.group(1).strip("[]") in _LOOPBACK:
        return True
    try:
        prefix = proxy_prefix(port, proxy)
    except ConfigError:  # a template without {port}: no proxy can be recognised
        return False
    if prefix is None:
        return False
    url = urllib.parse.urlsplit(prefix)
    if url.netloc and host == url.netloc.lower():
        return True
    path = url.path.rstrip("/")
    return any((headers.get(h) or "").strip().rstrip("/") == path for h in _FORWARDED_PREFIX)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "ortlab-netron"
    server: _HTTPServer

    def setup(self) -> None:
        self.timeout = self.server.owner.timeout
        super().setup()
        self._conn = self.server.connection(self.request)
        # The request's line and headers are read against one deadline (Note [A slow client holds no slot]).
        self.rfile.close()  # the makefile's reader, which only a per-read timeout would bound
        self.rfile = io.BufferedReader(_HeadReader(self.connection, self._conn.head_deadline))

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _refuse(self, code: int, text: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        if send_body:
            self.wfile.write(text)

    def _answer(self, send_body: bool) -> None:
        owner = self.server.owner
        if not self.server.answering(self._conn):
            return  # cut for a newer connection while its head came in
        self.connection.settimeout(owner.timeout)  # each part of the answer, from here on
        if not host_allowed(self.headers, self.server.server_address[1], owner.proxy):
            logger.debug("netron server: refused a request for host %r", self.headers.get("Host"))
            self._refuse(403, b"forbidden: this server answers requests to 127.0.0.1 or localhost, "
                              b"or through its proxy", send_body)
            return
        parsed = urllib.parse.urlparse(self.path)
        path = urllib.parse.unquote(parsed.path)
        body, ctype, cache = None, "", "no-store"
        if path in ("/", "/index.html"):
            query = urllib.parse.parse_qs(parsed.query)
            name = query.get("file", [None])[0]
            if name is None:
                body = index_html(None, "")
            elif owner.path_of(name) is not None and hmac.compare_digest(query.get("key", [""])[0], owner.key):
                body = index_html(f"{owner.key}/{name}", query.get("title", [""])[0] or name)
            ctype = STATIC_TYPES[".html"]
        elif path == "/" + ALIVE:  # the views' liveness probe (Note [A saved notebook shows no dead frame])
            query = urllib.parse.parse_qs(parsed.query)
            if owner.path_of(query.get("file", [""])[0]) is not None and hmac.compare_digest(
                    query.get("key", [""])[0], owner.key):
                body, ctype = _PIXEL, "image/gif"
        elif path == "/" + SETTINGS_SCRIPT:
            body, ctype = SETTINGS_JS.encode("utf-8"), STATIC_TYPES[".js"]
        elif path.startswith(f"/data/{owner.key}/"):
            body, ctype = owner.read(path[len(f"/data/{owner.key}/"):]), "application/octet-stream"
        elif path.count("/") == 1:
            name = path[1:]
            body = static_file(name)
            ctype, cache = STATIC_TYPES.get(os.path.splitext(name)[1], ""), "max-age=3600"
        if body is None:
            self._refuse(404, b"not found", send_body)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if send_body:  # in parts: the socket's timeout bounds each part, not a large model as a whole
            view = memoryview(body)
            for start in range(0, len(view), 1 << 20):
                self.wfile.write(view[start:start + (1 << 20)])
                self._conn.progress = time.monotonic()  # taken: not the stalest (Note [A slow client holds no slot])

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        logger.debug("netron server: " + format, *args)


# Note [A slow client holds no slot]
# Each connection is served by a thread of its own, and threads are bounded
# (``max_connections``), so a slot must never be something a client can keep by being
# slow: 32 local connections that each sent one header line a second (slowloris)
# used to keep every slot past ``timeout``, since the socket's timeout bounded each
# read, not the request, and a connection beyond the slots was the one closed, so
# real requests got no reply for as long as the trickle went on.
#
# * The request's line and headers are read against one deadline, ``timeout`` from
#   the accept (``_HeadReader``: each read gets what is left of it), so trickling
#   bytes buys nothing. The server answers HTTP/1.0, one request a connection, so
#   the deadline is the request's.
# * When every slot is taken, a new connection cuts (``shutdown``: its blocked
#   ``recv`` or ``send`` returns at once) the connection that has gone longest
#   without progress: one still sending its head has made none since its accept (a
#   head is one small packet from a real client), an answering one since its last
#   1 MiB part was taken (a client that stops reading, the slow-read form, is cut
#   too). The newcomer waits for the cut thread to end (milliseconds, at most
#   ``_CUT_WAIT``), so threads stay at ``max_connections``; only then is a
#   newcomer closed unanswered. Whoever holds slots by being slow gives them up to
#   the next real request; only a flood of new connections, faster than a real
#   request is answered, can still crowd one out, and any local user can do worse.
# * An answer's parts keep a timeout each, not one deadline: a large model through
#   a slow proxy may take longer than ``timeout`` as a whole.
# * ``stop()`` cuts every connection and joins their threads: none is left blocked
#   on a silent client.
# The registry of connections is what makes the cut safe: a connection leaves it
# (under its lock) before its socket is closed, so a cut never reaches a closed
# socket's reused file descriptor.

_CUT_WAIT = 1.0  # seconds a new connection waits for a cut one's thread to end


@dataclasses.dataclass(eq=False)
class _Connection:
    """An accepted connection and how far it got (Note [A slow client holds no slot])."""

    sock: socket.socket
    head_deadline: float  # time.monotonic() by which the request's line and headers must be in
    progress: float  # time.monotonic() of its last progress: accepted, head in, each part of the answer taken
    thread: threading.Thread | None = None
    cut: bool = False

    def shut(self) -> None:
        """Wake its thread's blocked read or write with end-of-file; the thread then ends."""
        self.cut = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass


class _HeadReader(io.RawIOBase):
    """A socket's reads, each given what is left until ``deadline`` (Note [A slow client holds no slot])."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's line and headers did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _HTTPServer(http.server.ThreadingHTTPServer):
    """One thread per connection, at most ``owner.max_connections`` at once; a connection beyond
    them cuts the stalest (Note [A slow client holds no slot])."""

    daemon_threads = True
    block_on_close = False  # stop() cuts the connections, then joins their threads (close_connections)
    request_queue_size = 64  # listen() backlog: a page opens many connections at once

    def __init__(self, owner: NetronServer, address: tuple[str, int]) -> None:
        self.owner = owner
        self._open: dict[socket.socket, _Connection] = {}
        self._changed = threading.Condition()  # guards _open and _closing; notified when one leaves
        self._closing = False
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        accepted = time.monotonic()
        with self._changed:
            until = accepted + _CUT_WAIT
            while not self._closing and len(self._open) >= self.owner.max_connections:
                live = [c for c in self._open.values() if not c.cut]
                leaving, needed = len(self._open) - len(live), len(self._open) - self.owner.max_connections + 1
                if live and leaving < needed:  # else: those cut already make room once their threads end
                    stalest = min(live, key=lambda c: c.progress)
                    logger.debug("netron server: %d connections open; cutting one %.1f s without progress",
                                 len(self._open), accepted - stalest.progress)
                    stalest.shut()
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if self._closing or len(self._open) >= self.owner.max_connections:
                logger.debug("netron server: no slot for a connection from %s; closed", client_address)
                self.shutdown_request(request)
                return
            conn = self._open[request] = _Connection(request, accepted + self.owner.timeout, accepted)
            conn.thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                           name=f"{threading.current_thread().name}-conn", daemon=True)
            try:
                conn.thread.start()
            except BaseException:
                del self._open[request]
                self.shutdown_request(request)
                raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._changed:  # out of the registry before closed: a cut never meets a reused descriptor
                self._open.pop(request, None)
                self._changed.notify_all()
            self.shutdown_request(request)

    def connection(self, request: socket.socket) -> _Connection:
        with self._changed:
            return self._open[request]

    def answering(self, conn: _Connection) -> bool:
        """Its head is in: progress, unless it was cut meanwhile."""
        with self._changed:
            conn.progress = time.monotonic()
            return not conn.cut

    def close_connections(self, timeout: float) -> None:
        """Take no more connections, cut every open one and wait (at most ``timeout``) for their threads."""
        with self._changed:
            self._closing = True
            for conn in self._open.values():
                conn.shut()
            threads = [c.thread for c in self._open.values() if c.thread is not None]
            self._changed.notify_all()
        until = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client gone, cut or silent past the timeout mid-answer: a debug line, not a traceback on stderr.
        logger.debug("netron server: a connection from %s failed", client_address, exc_info=True)


_SERVERS: weakref.WeakSet[NetronServer] = weakref.WeakSet()
# A transparent 1x1 GIF: what the liveness probe answers.
_PIXEL = bytes.fromhex("47494638396101000100800000000000ffffff21f90401000000002c00000000010001000002024401003b")


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
        timeout: seconds a request's line and headers may take to arrive from its connection, and
            each 1 MiB of an answer to be taken.
        max_connections: connections served at once; one more cuts the stalest (see Note [A slow
            client holds no slot]).

    Example:
        >>> with NetronServer() as server:                        # doctest: +SKIP
        ...     url = server.url(server.add("net_forward_exported_train.onnx"))
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, proxy: bool | str | None = None,
                 timeout: float = 30.0, max_connections: int = 32) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds (default 30).")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(f"max_connections={max_connections!r} must be a whole number >= 1 (default 32).")
        self.host, self.proxy = host, proxy
        self.timeout, self.max_connections = float(timeout), max_connections
        self._port = port
        # 127.0.0.1 is reachable by every user of a shared machine: pages and files need this key.
        self.key = secrets.token_urlsafe(12)
        self._files: dict[str, tuple[str, str]] = {}  # name -> (path, where it resolved when registered)
        self._lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        _SERVERS.add(self)

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> NetronServer:
        if self.running:
            return self
        netron_dir()  # fail early, with the install hint
        httpd = _HTTPServer(self, (self.host, self._port))
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
            httpd.close_connections(timeout=5)  # none left blocked on a client (Note [A slow client holds no slot])
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited listening socket and drop the state (see Note
        [What the netron server answers]); the parent's server is untouched."""
        httpd = self._httpd
        self._httpd = self._thread = None
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        if httpd is not None:
            try:
                httpd.socket.close()
            except OSError:
                pass

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
            for known, (p, _) in self._files.items():
                if p == path:
                    return known
            base = re.sub(r"[^A-Za-z0-9_.-]", "_", name or os.path.basename(path)).lstrip(".") or "model.onnx"
            stem, ext = os.path.splitext(base)
            candidate, k = base, 1
            while candidate in self._files:
                candidate, k = f"{stem}-{k}{ext}", k + 1
            self._files[candidate] = (path, os.path.realpath(path))
            return candidate

    def remove(self, name: str) -> None:
        with self._lock:
            self._files.pop(name, None)

    def forget_folder(self, folder: str) -> None:
        """Stop serving every file under ``folder``."""
        folder = os.path.abspath(folder) + os.sep
        with self._lock:
            for name in [n for n, (p, _) in self._files.items() if p.startswith(folder)]:
                del self._files[name]

    def path_of(self, name: str) -> str | None:
        with self._lock:
            entry = self._files.get(name)
        return entry[0] if entry is not None else None

    def read(self, name: str) -> bytes | None:
        """The bytes of the file registered as ``name``; None when there is none, or it no longer
        resolves where it did when registered, or is not a regular file (Note [What the netron
        server answers])."""
        with self._lock:
            entry = self._files.get(name)
        if entry is None:
            return None
        path, real = entry
        if os.path.realpath(path) != real:
            logger.debug("netron server: %s no longer leads to %s; not served", path, real)
            return None
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(real, flags)
        except OSError as e:  # gone, or a symlink now (ELOOP)
            logger.debug("netron server: cannot open %s: %s", real, e)
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read()

    @property
    def files(self) -> dict[str, str]:
        with self._lock:
            return {name: path for name, (path, _) in self._files.items()}

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


def _forget_servers_in_child() -> None:
    """After a fork, in the child: drop every inherited server (Note [What the netron server answers])."""
    global _DEFAULT, _DEFAULT_LOCK
    for server in list(_SERVERS):
        server._forget_after_fork()
    _DEFAULT, _DEFAULT_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_servers_in_child)


def frame_name(folder: str) -> str:
    """The iframe name a lab's views use, so table links open in the lab's view.

    Example:
        >>> frame_name("/tmp/lab").startswith("ortlab_netron_")
        True
    """
    return "ortlab_netron_" + hashlib.sha1(os.path.abspath(folder).encode()).hexdigest()[:10]
