"""The netron server under slow clients (Note [A slow client holds no slot] in ortlab.ui._netron_server)."""

from __future__ import annotations

import select
import socket
import threading
import time

from ortlab.ui._netron_server import NetronServer

TIMEOUT = 1.5  # the servers' timeout here: short, yet far above a loaded machine's scheduling delays


def _response(port: int, path: str) -> bytes:
    """A GET of ``path`` as a browser sends it, and everything the server sends back (b"": no reply)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        out = b""
        try:
            while chunk := conn.recv(1 << 16):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def _closed(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (it never sends these clients anything)."""
    if not select.select([conn], [], [], 0)[0]:
        return False
    try:
        return conn.recv(1) == b""
    except OSError:  # reset: closed with our unread header lines in its buffer
        return True


def _wait_for_threads(count: int) -> None:
    until = time.monotonic() + 5
    while threading.active_count() < count and time.monotonic() < until:
        time.sleep(0.02)


def _at_most_threads(count: int) -> int:
    """The thread count once it is at most ``count``, or after 2 s: a cut connection's thread exits a moment
    after its slot is taken (on a busy machine, long enough to be counted)."""
    until = time.monotonic() + 2
    while threading.active_count() > count and time.monotonic() < until:
        time.sleep(0.02)
    return threading.active_count()


def test_clients_trickling_their_headers_lock_no_request_out(tmp_path):
    """Slowloris: clients that send a header line now and then, never the end of their head."""
    model = tmp_path / "m.onnx"
    model.write_bytes(b"served as it is")
    with NetronServer(timeout=TIMEOUT, max_connections=4) as server:
        port, name = server.port, server.add(str(model))
        before, start = threading.active_count(), time.monotonic()
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]  # twice the slots
        try:
            for conn in slow:
                try:
                    conn.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                except OSError:  # cut already, for a newer one
                    pass
            reply = _response(port, f"/data/{server.key}/{name}")  # at once, while they hold every slot
            assert reply.startswith(b"HTTP/1.0 200 OK") and reply.endswith(b"served as it is"), reply[:80]
            assert _at_most_threads(before + 4) - before <= 4
            # A header line every 0.25 s, far within the timeout: each is closed at its whole head's deadline.
            closed_at: dict[int, float] = {}
            while len(closed_at) < len(slow) and time.monotonic() - start < TIMEOUT + 3:
                for i, conn in enumerate(slow):
                    if i in closed_at:
                        continue
                    if _closed(conn):
                        closed_at[i] = time.monotonic() - start
                        continue
                    try:
                        conn.sendall(b"X-Trickle: 1\r\n")
                    except OSError:
                        closed_at[i] = time.monotonic() - start
                time.sleep(0.25)
            assert len(closed_at) == len(slow), f"still open after {TIMEOUT + 3} s: {set(range(8)) - set(closed_at)}"
            assert TIMEOUT <= max(closed_at.values()) < TIMEOUT + 1.5, closed_at
        finally:
            for conn in slow:
                conn.close()
        assert _response(port, f"/data/{server.key}/{name}").startswith(b"HTTP/1.0 200 OK")


def test_clients_that_stop_reading_lock_no_request_out(tmp_path):
    """Slow read: clients that ask for a large file and take none of it hold a slot mid-answer."""
    big = tmp_path / "big.onnx"
    big.write_bytes(bytes(16 << 20))  # far more than the sockets' buffers hold
    small = tmp_path / "small.onnx"
    small.write_bytes(b"small")
    with NetronServer(timeout=TIMEOUT, max_connections=4) as server:
        port, big_name, small_name = server.port, server.add(str(big)), server.add(str(small))
        before = threading.active_count()
        stalled = []
        try:
            for _ in range(4):
                conn = socket.socket()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                conn.settimeout(5)
                conn.connect(("127.0.0.1", port))
                conn.sendall(f"GET /data/{server.key}/{big_name} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
                stalled.append(conn)
            _wait_for_threads(before + 4)
            time.sleep(0.2)  # their answers fill the buffers and stall
            reply = _response(port, f"/data/{server.key}/{small_name}")
            assert reply.startswith(b"HTTP/1.0 200 OK") and reply.endswith(b"small"), reply[:80]
            assert _at_most_threads(before + 4) - before <= 4
        finally:
            for conn in stalled:
                conn.close()


def test_stop_leaves_no_thread_on_a_silent_client():
    server = NetronServer(timeout=4 * TIMEOUT, max_connections=4).start()
    before = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    try:
        _wait_for_threads(before + 4)
        assert threading.active_count() == before + 4  # each served, blocked on its client
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < TIMEOUT  # not the clients' timeout
        assert threading.active_count() < before  # no connection's thread, nor the server's
        for conn in silent:
            assert conn.recv(1) == b""
    finally:
        for conn in silent:
            conn.close()
        server.stop()
