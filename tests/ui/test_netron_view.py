"""The netron server (127.0.0.1, free port, only saved files, offline page) and module subgraphs."""

from __future__ import annotations

import datetime
import html
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import warnings

import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from ortlab.errors import ConfigError
from ortlab.ui import netron_view
from ortlab.ui.netron_view import (
    SETTINGS_SCRIPT,
    ModulePicker,
    NetronServer,
    annotate,
    NetronView,
    extract_module,
    module_counts,
    proxy_prefix,
    resolve_node,
    view_file,
)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _node(op: str, inputs: list[str], outputs: list[str], name: str, module: str, fx: str) -> onnx.NodeProto:
    node = oh.make_node(op, inputs, outputs, name=name)
    for key, value in (("ortlab.module", module), ("ortlab.fx_node", fx), ("ortlab.source", "model.py:3 in forward")):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    return node


def _layered_model() -> onnx.ModelProto:
    """x -> blocks.0 (Relu, Add w0) -> blocks.1 (Relu, Add w1) -> head (Neg) -> y, 5 nodes."""
    nodes = [
        _node("Relu", ["x"], ["r0"], "node_relu", "blocks.0.act", "relu"),
        _node("Add", ["r0", "w0"], ["a0"], "node_add", "blocks.0", "add"),
        _node("Relu", ["a0"], ["r1"], "node_relu_1", "blocks.1.act", "relu_1"),
        _node("Add", ["r1", "w1"], ["a1"], "node_add_1", "blocks.1", "add_1"),
        _node("Neg", ["a1"], ["y"], "node_neg", "head", "neg"),
    ]
    f = TensorProto.FLOAT
    graph = oh.make_graph(
        nodes, "forward",
        [oh.make_tensor_value_info("x", f, [2, 3])],
        [oh.make_tensor_value_info("y", f, [2, 3])],
        initializer=[oh.make_tensor("w0", f, [3], [1.0, 2.0, 3.0]), oh.make_tensor("w1", f, [3], [4.0, 5.0, 6.0])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "net_forward_exported_train.onnx"
    onnx.save(_layered_model(), str(path))
    (tmp_path / "secret.txt").write_text("not an ortlab file")
    return path


@pytest.fixture
def server():
    s = NetronServer().start()
    yield s
    s.stop()


# ------------------------------------------------------------------------------------ server
def test_server_serves_only_registered_files_on_localhost(server, saved):
    assert server.host == "127.0.0.1" and server.port > 0 and server.running
    name = server.add(str(saved))
    assert server.add(str(saved)) == name  # registered once
    base = f"http://127.0.0.1:{server.port}/"
    data = f"data/{server.key}/"
    status, body = _get(base + data + name)
    assert status == 200 and body == saved.read_bytes()
    status, page = _get(server.local_url(name))
    assert status == 200 and f'content="{data}{name}"'.encode() in page
    # Without the key, a file next to it, netron's own Python files, traversal, unknown files: 404.
    for path in ("data/" + name, f"data/wrong/{name}", f"?file={name}", f"?file={name}&key=wrong",
                 data + "secret.txt", data + "../secret.txt", data + "%2e%2e/secret.txt", "server.py",
                 "__init__.py", "..%2Fserver.py", f"?file=secret.txt&key={server.key}", data + str(saved)):
        assert _get(base + path)[0] == 404, path
    assert _get(base + "index.js")[0] == 200  # netron's static files are served
    server.remove(name)
    assert _get(base + data + name)[0] == 404


def test_page_handles_consent_update_and_analytics_offline(server, saved):
    name = server.add(str(saved))
    status, body = _get(server.local_url(name, node="node_add"))
    page = body.decode()
    assert status == 200
    # The model URL is relative (works behind jupyter-server-proxy) and names the file.
    assert f'<meta name="file" content="data/{server.key}/{name}">' in page
    # Build date = today: netron's 180-day "Please update" dialog never shows.
    date = re.search(r'<meta name="date" content="([^"]+)">', page).group(1)
    age = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) - datetime.datetime.fromisoformat(date)
    assert abs(age.total_seconds()) < 120
    # No request can leave the page (analytics, ipinfo.io), and our settings script loads first.
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    assert "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert page.index(SETTINGS_SCRIPT) < page.index('src="index.js"')
    status, settings = _get(f"http://127.0.0.1:{server.port}/{SETTINGS_SCRIPT}")
    assert status == 200 and b"consent=" in settings and b"sendBeacon" in settings and b"node" in settings
    # browser.js: the start-up age, consent and telemetry checks are gone.
    status, js = _get(f"http://127.0.0.1:{server.port}/browser.js")
    assert status == 200
    for check in (b"await age();", b"await consent();", b"await telemetry();"):
        assert check not in js
    assert js.count(b"ortlab: no") == 3


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run netron's browser.js")
def test_netron_host_starts_without_dialog_or_network(server, tmp_path):
    """Run the served browser.js in node with a stub DOM: no dialog, no fetch, no analytics.

    The build date given is from 2000 (far past the 180-day limit) and there is no cookie.
    """
    base = f"http://127.0.0.1:{server.port}/"
    for name in ("browser.js", "base.js"):
        (tmp_path / name).write_bytes(_get(base + name)[1])
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / SETTINGS_SCRIPT).write_bytes(_get(base + SETTINGS_SCRIPT)[1])
    (tmp_path / "run.mjs").write_text(r"""
const calls = { message: 0, fetch: 0, telemetry: 0, beacon: 0 };
const element = () => ({ getAttribute: () => 'https://github.com/lutzroeder/netron', href: '',
  addEventListener() {}, setAttribute() {}, style: {}, innerText: '' });
const metas = [['version', '9.3.3'], ['date', '2000-01-01 00:00:00']].map(([name, content]) => ({ name, content }));
globalThis.window = {
  navigator: { platform: 'Linux', userAgent: 'Chrome/120', sendBeacon: () => { calls.beacon++; return true; } },
  document: { title: 'Netron', cookie: '', getElementsByTagName: () => metas, getElementById: element,
    documentElement: { style: { scrollBehavior: 'auto' } },
    body: { classList: { remove() {}, add() {} }, getAttribute: () => '', setAttribute() {} } },
  location: { hostname: '127.0.0.1', href: 'http://127.0.0.1/', search: '' },
  addEventListener() {}, screen: { width: 1, height: 1 },
};
globalThis.document = window.document;
const { Host } = await import('./browser.js');
const host = new Host();
host.message = async () => { calls.message++; };
host._fetch = async () => { calls.fetch++; return '{}'; };
const start = host._telemetry.start.bind(host._telemetry);
host._telemetry.start = async (...a) => { calls.telemetry++; return start(...a); };
await Promise.race([host.view({}), new Promise((_, no) => setTimeout(() => no(new Error('view() hangs')), 3000).unref())]);
console.log(JSON.stringify(calls));
""")
    out = subprocess.run(["node", "run.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"message": 0, "fetch": 0, "telemetry": 0, "beacon": 0}
    check = subprocess.run(["node", "--check", str(tmp_path / SETTINGS_SCRIPT)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_server_stops_and_frees_the_port(saved):
    server = NetronServer().start()
    port = server.port
    assert _get(f"http://127.0.0.1:{port}/")[0] == 200
    server.stop()
    assert not server.running
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    _bind(port)  # the port is free for another server
    with NetronServer() as again:  # context manager: started, then stopped
        assert again.running
    assert not again.running


def test_proxy_urls_for_jupyterhub(monkeypatch, server, saved):
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    assert proxy_prefix(8123) is None and proxy_prefix(8123, True) == "/proxy/8123/"
    assert proxy_prefix(8123, "https://hub.example/user/me/proxy/{port}") == "https://hub.example/user/me/proxy/8123/"
    with pytest.raises(ConfigError, match="placeholder"):
        proxy_prefix(8123, "/proxy/")
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/me/")
    assert proxy_prefix(8123) == "/user/me/proxy/8123/"
    assert proxy_prefix(8123, False) is None
    name = server.add(str(saved))
    assert server.url(name).startswith(f"/user/me/proxy/{server.port}/?file=")
    assert server.local_url(name).startswith(f"http://127.0.0.1:{server.port}/?file=")


def _bind(port: int) -> None:
    """Listen on ``port`` as a new server would (SO_REUSEADDR: closed connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def _status(port: int, path: str, host: str | None, **headers: str) -> int:
    """The status of a GET of ``path`` sent with this ``Host`` header (None: none at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for key, value in ({"Host": host} if host is not None else {}).items() | headers.items():
            conn.putheader(key.replace("_", "-"), value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_requests_for_other_hosts_are_refused(server, saved, monkeypatch):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host."""
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    port, name = server.port, server.add(str(saved))
    data = f"/data/{server.key}/{name}"
    for path in ("/", data, "/index.js", f"/?file={name}&key={server.key}"):
        assert _status(port, path, f"127.0.0.1:{port}") == 200, path
        assert _status(port, path, f"localhost:{port}") == 200, path
        for host in (f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "evil.example", f"localhost.:{port}x",
                     f"127.0.0.1@evil.example:{port}", "", None):
            assert _status(port, path, host) == 403, (path, host)
    assert _status(port, data, "LOCALHOST:9000") == 200  # a tunnel from another local port
    # Behind jupyter-server-proxy: the hub's host, and the proxy's path in X-Forwarded-Prefix.
    server.proxy = "/user/me/proxy/{port}/"
    assert _status(port, data, "hub.example", X_Forwarded_Prefix=f"/user/me/proxy/{port}") == 200
    assert _status(port, data, "hub.example", X_ProxyContextPath=f"/user/me/proxy/{port}/") == 200
    assert _status(port, data, "hub.example") == 403
    assert _status(port, data, "hub.example", X_Forwarded_Prefix=f"/user/other/proxy/{port}") == 403
    server.proxy = "https://hub.example/user/me/proxy/{port}/"
    assert _status(port, data, "hub.example") == 200 and _status(port, data, "evil.example") == 403
    server.proxy = None
    assert _status(port, data, "hub.example", X_Forwarded_Prefix=f"/user/me/proxy/{port}") == 403


@pytest.mark.parametrize("path", [
    "data/{key}/..%2fsecret.txt", "data/{key}/%2e%2e%2fsecret.txt", "data/{key}/..%5csecret.txt",
    "data/{key}/%252e%252e%252fsecret.txt", "data/{key}/{dir}/secret.txt", "data/{key}/%2F{dir}%2Fsecret.txt",
    "data/{key}//{dir}/secret.txt", "data/{key}/./{name}/../secret.txt", "data/{key}/{name}/..", "data/{key}/",
    "data/{key}", "data/{key}/.", "%2e%2e/%2e%2e/etc/passwd", "..%2f..%2fetc%2fpasswd", "/etc/passwd",
    "data/{key}/{name}%00", "data/{key}/{name}/", "index.js/../../server.py", ".%2fserver.py", "%2fetc%2fpasswd",
])
def test_traversal_variants_stay_not_found(server, saved, path):
    name = server.add(str(saved))
    url = f"http://127.0.0.1:{server.port}/" + path.format(key=server.key, name=name, dir=str(saved.parent).lstrip("/"))
    assert _get(url)[0] == 404


def test_a_registered_file_swapped_for_a_link_is_not_served(server, saved, tmp_path):
    name = server.add(str(saved))
    url = f"http://127.0.0.1:{server.port}/data/{server.key}/{name}"
    assert _get(url) == (200, saved.read_bytes())
    original = saved.read_bytes()
    saved.unlink()
    saved.symlink_to(tmp_path / "secret.txt")
    assert _get(url)[0] == 404
    saved.unlink()
    os.mkfifo(saved)  # a FIFO would block a reader: refused at once
    assert _get(url)[0] == 404
    saved.unlink()
    saved.write_bytes(original)  # written again where it was: served again
    assert _get(url) == (200, original)
    # A folder on the way swapped for a link to another folder with a file of that name.
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "g.onnx").write_bytes(original)
    name = server.add(str(sub / "g.onnx"))
    url = f"http://127.0.0.1:{server.port}/data/{server.key}/{name}"
    assert _get(url)[0] == 200
    other = tmp_path / "other"
    other.mkdir()
    (other / "g.onnx").write_text("secret")
    sub.rename(tmp_path / "sub_was")
    sub.symlink_to(other)
    assert _get(url)[0] == 404


def test_idle_connections_time_out_and_are_bounded():
    with NetronServer(timeout=1, max_connections=4) as server:
        port = server.port
        before, start = threading.active_count(), time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        try:
            idle[0].settimeout(0.8)
            assert idle[0].recv(1) == b""  # past max_connections: the stalest is cut for the newest at once
            assert threading.active_count() - before <= 4  # 4 served (silent), no thread for the rest
            for s in idle:
                assert s.recv(1) == b""  # all closed by the server, the last 4 served after 1 s of silence
            assert 0.9 < time.monotonic() - start < 3
        finally:
            for s in idle:
                s.close()
        assert _get(f"http://127.0.0.1:{port}/")[0] == 200  # the slots are free again
        time.sleep(0.2)
        assert threading.active_count() <= before
    with pytest.raises(ConfigError, match="timeout=0 must be a positive number"):
        NetronServer(timeout=0)
    with pytest.raises(ConfigError, match="max_connections=0 must be a whole number >= 1"):
        NetronServer(max_connections=0)


def test_a_forked_child_lets_the_port_go_when_the_parent_stops(saved):
    server = NetronServer().start()
    port, name = server.port, server.add(str(saved))
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process with threads
        pid = os.fork()
    if pid == 0:  # the child: say what it holds, wait for the parent, leave without cleanup
        try:
            os.write(report_w, b"1" if server._httpd is None and not server.running else b"0")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(report_r, 1) == b"1"
        assert _get(f"http://127.0.0.1:{port}/data/{server.key}/{name}")[0] == 200  # the parent still serves
        server.stop()
        _bind(port)  # free, though the child still lives
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (report_r, report_w, go_r, go_w):
            os.close(fd)


# --------------------------------------------------------------------------------- subgraphs
def test_extract_module_subgraph():
    model = _layered_model()
    assert module_counts(model, depth=1) == {"blocks": 4, "head": 1}
    assert module_counts(model, depth=2) == {"blocks.0": 2, "blocks.1": 2, "head": 1}
    sub = extract_module(model, "blocks.1")
    onnx.checker.check_model(sub)
    assert [n.name for n in sub.graph.node] == ["node_relu_1", "node_add_1"]
    assert [v.name for v in sub.graph.input] == ["a0"]  # read from outside
    assert [t.name for t in sub.graph.initializer] == ["w1"]  # its weight stays a weight
    assert [v.name for v in sub.graph.output] == ["a1"]  # read by the head
    assert sub.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # typed by shape inference
    # A prefix takes the children (blocks.0.act) but not blocks.0x or blocks.1.
    assert [n.name for n in extract_module(model, "blocks.0").graph.node] == ["node_relu", "node_add"]
    with pytest.raises(ConfigError, match="modules: 'blocks.0'"):
        extract_module(model, "blocks.7")


def test_resolve_node_by_onnx_fx_and_fused_names():
    model = _layered_model()
    assert resolve_node(model, "node_add") == "node_add"
    assert resolve_node(model, "add_1") == "node_add_1"  # FX node name via ortlab.fx_node
    assert resolve_node(model, "a0") == "a0"  # a value
    assert resolve_node(model, "nothing") is None
    # An onnxruntime-optimized model keeps no metadata but the fused node's name prefix.
    optimized = onnx.ModelProto()
    optimized.CopyFrom(model)
    del optimized.graph.node[:]
    optimized.graph.node.append(oh.make_node("Relu", ["a0"], ["r1"], name="node_relu_1/ReluFusion/"))
    assert resolve_node(optimized, "relu_1", reference=model) == "node_relu_1/ReluFusion/"
    # A view of it shows the node's source again (copied from the exported model).
    (node,) = annotate(optimized, model).graph.node
    props = {p.key: p.value for p in node.metadata_props}
    assert props["ortlab.module"] == "blocks.1.act" and props["ortlab.source"] == "model.py:3 in forward"
    assert annotate(model, model) is None  # nothing to add


def test_large_graph_views_one_module(server, saved):
    picker = view_file(str(saved), max_nodes=3, server=server)
    assert isinstance(picker, ModulePicker) and picker.nodes == 5
    assert "blocks.0" in picker._repr_html_() and "force=True" in picker._repr_html_()
    # Asking for a node shows that node's module, saved under views/ and served.
    view = view_file(str(saved), node="add_1", max_nodes=3, server=server)
    assert isinstance(view, NetronView) and view.node == "node_add_1"
    assert os.path.dirname(view.path) == str(saved.parent / "views") and view.path.endswith(".blocks.1.onnx")
    assert [n.name for n in onnx.load(view.path).graph.node] == ["node_relu_1", "node_add_1"]
    assert _get(server.local_url(view.name))[0] == 200
    assert "module blocks.1" in view.info and f'name="{view.frame}"' in view._repr_html_()
    # force shows everything; a module can be asked for directly.
    assert len(onnx.load(view_file(str(saved), max_nodes=3, force=True, server=server).path).graph.node) == 5
    head = view_file(str(saved), module="head", server=server)
    assert [n.name for n in onnx.load(head.path).graph.node] == ["node_neg"]


def test_module_picker_escapes_module_names_from_the_file(server, tmp_path):
    evil = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"
    model = _layered_model()
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == "ortlab.module":
                prop.value = evil
    path = tmp_path / "net_forward_exported_train.onnx"
    onnx.save(model, str(path))
    picker = view_file(str(path), max_nodes=3, server=server)
    page = picker._repr_html_()
    assert isinstance(picker, ModulePicker) and "<script" not in page and "<img" not in page
    assert html.escape(f"view(module={evil!r})") in page


def test_views_are_never_written_or_read_outside_the_graphs_folder(server, saved, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    os.symlink(outside, saved.parent / "views")  # views/ leads out of the lab folder
    with pytest.raises(ConfigError, match="leads outside the graph's folder"):
        view_file(str(saved), module="head", server=server)
    assert os.listdir(outside) == []
    # A reference model next to an optimized one that is a link out of the folder is not read.
    optimized = saved.parent / "net_forward_ort_all_train.onnx"
    onnx.save(_layered_model(), str(optimized))
    onnx.save(_layered_model(), str(outside / "elsewhere.onnx"))
    os.symlink(outside / "elsewhere.onnx", saved.parent / "net_forward_onnxscript_train.onnx")
    os.remove(saved)
    assert netron_view._reference_path(str(optimized)) is None


def test_default_server_is_shared_and_stoppable(saved):
    s1 = netron_view.default_server()
    try:
        assert netron_view.default_server() is s1 and netron_view.running_default_server() is s1
        name = s1.add(str(saved))
        netron_view.forget_folder(str(saved.parent))
        assert s1.path_of(name) is None
    finally:
        netron_view.stop_default_server()
    assert netron_view.running_default_server() is None


# ------------------------------------------------------------------------ the frame in a notebook
def _named_inputs(model: onnx.ModelProto, names: dict[str, str]) -> onnx.ModelProto:
    for value in model.graph.input:
        if value.name in names:
            entry = value.metadata_props.add()
            entry.key, entry.value = "ortlab.input", names[value.name]
    return model


def test_a_view_shows_its_message_until_its_server_answers(server, saved):
    view = view_file(str(saved), node="add", server=server)
    page = view.html(scroll=True)
    # As saved in a notebook: the message shows, the frame box is hidden and the frame has no URL.
    assert "Re-run this cell to open the graph" in page
    assert 'class="ortlab-netron-box" style="display:none' in page
    frame = re.search(r"<iframe [^>]*>", page).group(0)
    assert " src=" not in frame and f'data-src="{html.escape(view.url, quote=True)}"' in frame
    assert f'name="{view.frame}"' in frame and 'data-scroll="1"' in page and 'data-scroll="1"' not in view._repr_html_()
    # The probe image that swaps the frame in: answered while the server serves the file, never cached.
    probe = html.unescape(re.search(r'<img src="([^"]+)"', page).group(1))
    assert probe == view.url.split("?")[0] + f"ortlab-alive.gif?file={view.name}&key={server.key}"
    with urllib.request.urlopen(probe, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "image/gif" and r.read().startswith(b"GIF89a")
        assert r.headers["Cache-Control"] == "no-store"
    assert _get(probe.replace(server.key, "wrong"))[0] == 404  # another server's key (a new kernel on the port)
    server.remove(view.name)
    assert _get(probe)[0] == 404  # a file no longer served (its lab closed)
    server.stop()
    with pytest.raises(urllib.error.URLError):  # a server gone: the image never loads, the message stays
        urllib.request.urlopen(probe, timeout=5)


def test_the_frame_lets_the_wheel_scroll_the_page_until_clicked(server, saved):
    page = view_file(str(saved), server=server)._repr_html_()
    box = re.search(r'<div class="ortlab-netron-box"[^>]*>(.*)</div><img', page).group(0)
    shield = re.search(r'<div class="ortlab-netron-shield"[^>]*>', box).group(0)
    # A shield covers the frame (the wheel over it scrolls the notebook); a click removes it,
    # leaving the frame re-arms it.
    assert "position:absolute;top:0;left:0;right:0;bottom:0" in shield
    assert "onclick=\"this.style.display=&#x27;none&#x27;;\"" in shield
    assert "onmouseleave=" in box and "display=&#x27;flex&#x27;" in box


def test_table_links_bring_their_frame_into_sight(server, saved):
    from ortlab.ui._links import Linker

    linker = Linker(lambda: [("g0.forward", str(saved))], "ortlab_netron_x")
    linker.server = server
    url = linker.url(str(saved), "relu")
    anchor = linker.link("<code>relu</code>", url)
    assert "target='ortlab_netron_x'" in anchor and "onclick='" in anchor
    assert "scrollTop+=" in html.unescape(anchor) and "this.target=f.name" in html.unescape(anchor)
    assert "data-frames='ortlab_netron_x'" in anchor  # Note [A link opens in the frame showing its graph]
    assert 'name="ortlab_netron_x_' in linker.viewer(url, 300)


def test_views_name_graph_inputs_after_what_they_are(server, tmp_path):
    model = _named_inputs(_layered_model(), {"x": "blocks.0.ln1.weight"})
    path = tmp_path / "net_forward_exported_train.onnx"
    onnx.save(model, str(path))
    view = view_file(str(path), server=server)
    shown = onnx.load(view.path)
    assert view.path != str(path) and os.path.dirname(view.path) == str(tmp_path / "views")
    assert [i.name for i in shown.graph.input] == ["blocks.0.ln1.weight"]
    assert shown.graph.node[0].input[0] == "blocks.0.ln1.weight"  # its uses follow
    onnx.checker.check_model(shown)
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["x"]  # the saved file is left as it is
    # A link to the input by its exported name selects the renamed input; nodes keep their names.
    assert view_file(str(path), node="x", server=server).node == "blocks.0.ln1.weight"
    assert view_file(str(path), node="relu", server=server).node == "node_relu"
    # A module's subgraph names them too.
    sub = onnx.load(view_file(str(path), module="blocks.0", server=server).path)
    assert [i.name for i in sub.graph.input] == ["blocks.0.ln1.weight"]


def test_an_input_name_another_value_has_keeps_the_old_one_beside_it():
    model = _named_inputs(_layered_model(), {"x": "r0"})  # r0 is a node's output
    assert netron_view.input_names(model) == {"x": "r0 (x)"}
    assert netron_view.input_names(_layered_model()) == {}
