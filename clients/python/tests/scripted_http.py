"""A tiny HTTP/1.1 server on 127.0.0.1 that misbehaves on cue.

Each accepted connection serves exactly one request with the next scripted
action (the last one repeats), then closes. Actions produce the real socket
events an HTTP client meets: a response, a close or a reset before any
response, a hang, a truncated body.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable, Optional

Action = Callable[[socket.socket, bytes], None]


def respond(status: int, body: bytes = b"", headers: Optional[dict[str, str]] = None) -> Action:
    def action(conn: socket.socket, request: bytes) -> None:
        lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{key}: {value}" for key, value in (headers or {}).items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    return action


def respond_if(predicate: Callable[[bytes], bool], yes: Action, no: Action) -> Action:
    def action(conn: socket.socket, request: bytes) -> None:
        (yes if predicate(request) else no)(conn, request)

    return action


def close_without_response() -> Action:
    def action(conn: socket.socket, request: bytes) -> None:
        pass  # the caller closes the socket

    return action


def reset_without_response() -> Action:
    def action(conn: socket.socket, request: bytes) -> None:
        # SO_LINGER with a zero timeout turns close() into a TCP RST.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return action


def truncated_body(status: int = 200, hang: Optional[threading.Event] = None) -> Action:
    """Headers announcing 100 bytes, 10 bytes, then a close (or a hang until ``hang`` is set)."""

    def action(conn: socket.socket, request: bytes) -> None:
        conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: 100\r\n\r\n".encode() + b"0123456789")
        if hang is not None:
            hang.wait(10)

    return action


def hang(until: threading.Event) -> Action:
    def action(conn: socket.socket, request: bytes) -> None:
        until.wait(10)

    return action


def trickle(interval: float = 0.1, limit: float = 5.0) -> Action:
    """A status line sent one byte per ``interval``: every read gets a byte in time."""

    def action(conn: socket.socket, request: bytes) -> None:
        line = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n" + b"X-Pad: " + b"a" * 200
        give_up = time.monotonic() + limit
        for byte in line:
            if time.monotonic() > give_up:
                return
            conn.sendall(bytes([byte]))
            time.sleep(interval)

    return action


def garbage() -> Action:
    """Plain-text bytes where a TLS client expects a ServerHello."""

    def action(conn: socket.socket, request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    return action


class ScriptedServer:
    def __init__(self, *actions: Action, read_request: bool = True) -> None:
        self.actions = list(actions)
        self.read_request = read_request
        self.requests: list[bytes] = []
        self.released = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            request = self._read(conn) if self.read_request else b""
            index = min(len(self.requests), len(self.actions) - 1)
            self.requests.append(request)
            self.actions[index](conn, request)
        except OSError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _read(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
            if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                while not body.endswith(b"0\r\n\r\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                return head + b"\r\n\r\n" + body
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body

    def close(self) -> None:
        self._closed = True
        self.released.set()
        self._sock.close()

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def closed_port() -> int:
    """A loopback port with no listener (connections to it are refused)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port: int = probe.getsockname()[1]
    probe.close()
    return port


# ------------------------------------------------------------------ keep-alive connections

#: What a keep-alive server does with one request it has read: answer and
#: keep the connection (True), or not (False: it is closed or reset).
KeepAliveAction = Callable[[socket.socket, bytes], bool]


def ok_keep_alive(body: bytes = b"ok") -> KeepAliveAction:
    def action(conn: socket.socket, request: bytes) -> bool:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        return True

    return action


def reset_after_read() -> KeepAliveAction:
    """The request was read in full; the connection is reset without a byte of answer."""

    def action(conn: socket.socket, request: bytes) -> bool:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False

    return action


def hold(until: threading.Event) -> KeepAliveAction:
    def action(conn: socket.socket, request: bytes) -> bool:
        until.wait(10)
        return False

    return action


class KeepAliveServer:
    """An HTTP/1.1 server that keeps connections open between requests, and counts.

    Every request read (on any connection) takes the next scripted action
    (the last one repeats). ``requests`` is what was read, in order, and
    ``connections`` how many TCP connections were accepted: a client that
    re-sent a request by itself would show as one more read than the
    attempts it decided, and usually one more connection.
    """

    def __init__(self, *actions: KeepAliveAction) -> None:
        self.actions = list(actions)
        self.requests: list[bytes] = []
        self.connections = 0
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            while True:
                request = ScriptedServer._read(conn)
                if not request:
                    return  # the client closed an idle connection
                with self._lock:
                    index = min(len(self.requests), len(self.actions) - 1)
                    self.requests.append(request)
                if not self.actions[index](conn, request):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        self.released.set()
        self._sock.close()

    def __enter__(self) -> KeepAliveServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
