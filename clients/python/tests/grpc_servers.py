"""Real gRPC servers of the tests' own on 127.0.0.1, misbehaving on cue.

``ScriptedGrpcServer`` serves one unary-unary method, ``/test.Echo/Call``,
on raw bytes (no codegen needed): each call runs the next scripted action
(the last one repeats) and is recorded with its arrival time and metadata,
so a test can count what the server really received. ``ResettingProxy``
sits between a client and a server and resets the client's TCP connection
on cue. ``PrefaceRecorder`` accepts connections, records what the client
sent before the HTTP/2 handshake could finish, and resets them.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc

METHOD = "/test.Echo/Call"
STREAM_METHOD = "/test.Echo/Stream"

Action = Callable[[bytes, grpc.ServicerContext], bytes]


def ok(payload: bytes = b"ok") -> Action:
    def action(request: bytes, context: grpc.ServicerContext) -> bytes:
        return payload

    return action


def abort(code: grpc.StatusCode, details: str = "", trailers: Sequence[tuple[str, str]] = ()) -> Action:
    """The server's own status, with trailers (a pushback, say)."""

    def action(request: bytes, context: grpc.ServicerContext) -> bytes:
        if trailers:
            context.set_trailing_metadata(tuple(trailers))
        context.abort(code, details or code.name.lower())
        raise AssertionError("unreachable")  # context.abort raises

    return action


def hang(release: threading.Event, limit: float = 10.0) -> Action:
    """Never answers (until released, or the bounded limit)."""

    def action(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(limit)
        return b"late"

    return action


def respond_if(predicate: Callable[[dict[str, str]], bool], yes: Action, no: Action) -> Action:
    def action(request: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = {key: value for key, value in context.invocation_metadata()}
        return (yes if predicate(metadata) else no)(request, context)

    return action


@dataclass
class Received:
    request: bytes
    metadata: dict[str, str]
    at: float
    time_remaining: Optional[float]


@dataclass
class ScriptedGrpcServer:
    actions: list[Action]
    options: Sequence[tuple[str, object]] = ()
    stream_messages: int = 1
    stream_then: Optional[grpc.StatusCode] = grpc.StatusCode.UNAVAILABLE
    calls: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.entered = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=list(self.options))
        handlers = {
            "Call": grpc.unary_unary_rpc_method_handler(self._call),
            "Stream": grpc.unary_stream_rpc_method_handler(self._stream),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            index = min(len(self.calls), len(self.actions) - 1)
            self.calls.append(Received(request, {k: v for k, v in context.invocation_metadata()},
                                       time.monotonic(), context.time_remaining()))
        self.entered.set()
        return self.actions[index](request, context)

    def _stream(self, request: bytes, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        with self._lock:
            self.calls.append(Received(request, {}, time.monotonic(), context.time_remaining()))
        for n in range(self.stream_messages):
            yield f"message {n}".encode()
        if self.stream_then is not None:
            context.abort(self.stream_then, "stream broke")

    def close(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> ScriptedGrpcServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def scripted(*actions: Action, **kwargs: object) -> ScriptedGrpcServer:
    return ScriptedGrpcServer(list(actions), **kwargs)  # type: ignore[arg-type]


def _rst(sock: socket.socket) -> None:
    # SO_LINGER with a zero timeout turns the last close into a TCP RST;
    # shutdown(SHUT_RD) first wakes a thread blocked in recv on the socket,
    # which would otherwise keep it open (and the RST unsent).
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    sock.close()


class ResettingProxy:
    """A TCP proxy on 127.0.0.1 that can reset every client connection on cue."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass

    def reset_clients(self) -> None:
        """Resets every client connection (the upstream side is closed too)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream in pairs:
            _rst(client)
            upstream.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.reset_clients()

    def __enter__(self) -> ResettingProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class PrefaceRecorder:
    """Accepts, records what the client sends before any server byte, then resets.

    A gRPC client may write only its connection preface before the server's
    SETTINGS arrive; the test checks that no HEADERS frame (no request) was
    among the bytes.
    """

    def __init__(self, wait: float = 0.3) -> None:
        self.received: list[bytes] = []
        self._wait = wait
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.settimeout(self._wait)
            data = b""
            try:
                while chunk := conn.recv(65536):
                    data += chunk
            except OSError:  # the timeout: the client has sent all it will
                pass
            self.received.append(data)
            _rst(conn)

    def frame_types(self) -> list[int]:
        """HTTP/2 frame types of every connection's bytes, after the 24-byte preface."""
        types: list[int] = []
        for data in self.received:
            assert data.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), data[:30]
            rest = data[24:]
            while len(rest) >= 9:
                length = int.from_bytes(rest[:3], "big")
                types.append(rest[3])
                rest = rest[9 + length:]
        return types

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> PrefaceRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SilentServer:
    """Accepts TCP connections and never sends a byte (until closed)."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._held.append(conn)

    def accepted(self) -> int:
        """Connections accepted so far."""
        return len(self._held)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
