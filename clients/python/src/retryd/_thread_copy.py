"""Ending one blocking httpx attempt from another thread, where httpcore's pool survives it.

Used by :func:`retryd.httpx.request_with_retries` for a hedge's losers. A
blocking read can only be ended by its socket: each copy of a hedged call
runs on a worker thread (:data:`WORKERS`), and a loser is ended by shutting
its connection's socket down (the upstream sees the connection closed; the
worker's read returns at once and httpcore's own error path closes the
connection and takes it out of the pool). httpx does not expose which
connection a pooled request was given, so :class:`ThreadCopyGate` reads it
from httpcore 1.0's sync pool, on the request's own thread, at its
``send_request_headers`` trace event (:func:`socket_of`:
``ConnectionPool._requests`` → ``PoolRequest.connection`` →
``HTTPConnection._connection`` → ``HTTP11Connection._network_stream``).
:func:`unhedgeable` checks, before a call is hedged, that the transport is
one whose internals these are (tests/test_hedging_httpx_sync.py fails when
they change); anything else is not hedged, and counted.

Why no connection is lost (encode/httpcore#1093 is asyncio's cancel
arriving anywhere; here nothing arrives asynchronously): a cancel is

- before the pool, or while waiting in it or connecting: a flag, raised as
  :class:`Withdrawn` at the copy's next start event (``connect_tcp.started``
  or ``send_request_headers.started``), which httpcore's own ``except``
  blocks handle (the connection is marked failed or closed, the request
  leaves the pool's queue); nothing of the request was sent;
- from ``send_request_headers`` until ``response_closed`` starts: the
  socket is shut down, under the gate's lock, which the ``response_closed``
  event takes too, so the socket is never shut once the connection may be
  put back (and a response read in full just before the shutdown leaves an
  IDLE connection whose socket reads EOF, which the pool closes as expired
  on its next look);
- after that: nothing (the copy has answered; its response is closed).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, TypeVar, Union

import httpx

_CONNECTING = frozenset({"connection.connect_tcp.started", "connection.connect_unix_socket.started"})
_STARTED = frozenset({"http11.send_request_headers.started"})
_CLOSING = frozenset({"http11.response_closed.started"})

log = logging.getLogger("retryd")

T = TypeVar("T")


class Withdrawn(Exception):
    """A copy cancelled before any of it was sent (raised inside httpcore's own error handling)."""


def _probe() -> Optional[str]:
    """None when httpcore's sync internals have the shape :func:`socket_of` reads, else what differs."""
    try:
        import httpcore
        from httpcore._sync.connection_pool import PoolRequest

        pool = httpcore.ConnectionPool()
        if not isinstance(vars(pool).get("_requests"), list):
            return "ConnectionPool._requests is not a list"
        if not isinstance(vars(pool).get("_http2"), bool):
            return "ConnectionPool._http2 is not a bool"
        request = httpcore.Request("GET", "http://127.0.0.1/")
        pending = PoolRequest(request)
        if vars(pending).get("request") is not request or "connection" not in vars(pending):
            return "PoolRequest has no request and connection"
        origin = httpcore.Origin(b"http", b"127.0.0.1", 80)
        if "_connection" not in vars(httpcore.HTTPConnection(origin)):
            return "HTTPConnection has no _connection"
        stream = httpcore.MockStream([])
        if vars(httpcore.HTTP11Connection(origin, stream)).get("_network_stream") is not stream:
            return "HTTP11Connection has no _network_stream"
        return None
    except Exception as error:  # an import or a constructor that changed
        return f"{type(error).__name__}: {error}"


_PROBED: list[Optional[str]] = []


def internals_changed() -> Optional[str]:
    """What about httpcore differs from what this module reads (None: nothing); probed once."""
    if not _PROBED:
        _PROBED.append(_probe())
    return _PROBED[0]


def pool_of(http: httpx.Client, url: Union[httpx.URL, str]) -> Union[Any, str]:
    """The httpcore pool a request to ``url`` goes through, or why its copies could not be ended.

    Only httpx's own ``HTTPTransport`` over a plain ``httpcore.ConnectionPool``
    (no proxy) without HTTP/2 qualifies: a shutdown on an HTTP/2 connection
    would end every stream on it, and other transports' internals are unknown.
    """
    import httpcore

    changed = internals_changed()
    if changed is not None:
        return "httpcore"
    transport = http._transport_for_url(httpx.URL(url))
    if type(transport) is not httpx.HTTPTransport:
        return "transport"
    pool = getattr(transport, "_pool", None)
    if type(pool) is not httpcore.ConnectionPool:
        return "transport"
    if pool._http2:
        return "http2"
    return pool


def socket_of(pool: Any, request: Any) -> Optional[socket.socket]:
    """The socket of the connection ``pool`` assigned to the httpcore ``request`` (None if not found)."""
    try:
        for pending in list(pool._requests):
            if pending.request is request:
                connection = pending.connection
                http11 = getattr(connection, "_connection", None)
                stream = getattr(http11, "_network_stream", None)
                found = stream.get_extra_info("socket") if stream is not None else None
                return found if isinstance(found, socket.socket) else None
    except (AttributeError, TypeError):
        pass
    return None


class ThreadCopyGate:
    """Ends one blocking attempt from another thread: a flag before it is sent, a socket shutdown after.

    Installs itself as the request's httpx ``trace`` extension (chained to
    the caller's). ``cancel()`` may be called from any thread, any number of
    times; see the module doc for what it does in each phase.
    """

    def __init__(self, request: httpx.Request, pool: Any, *, hedge: bool = False) -> None:
        self._pool = pool
        #: A hedge whose socket is not found is withdrawn unsent; a first attempt goes on.
        self._hedge = hedge
        self._lock = threading.Lock()
        #: "before" (not yet on a connection), "io" (sending or reading), "closing" (answered).
        self.phase = "before"
        self.stop = False
        #: False when the copy's socket could not be found (it could not be ended).
        self.cancellable = True
        self._socket: Optional[socket.socket] = None
        self._chained = request.extensions.get("trace")
        request.extensions = {**request.extensions, "trace": self._trace}

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        if self._chained is not None:
            self._chained(event, info)
        if event in _CONNECTING:
            with self._lock:
                if self.stop:
                    raise Withdrawn("a hedge of this call answered first")
        elif event in _STARTED:
            found = socket_of(self._pool, info.get("request"))
            with self._lock:
                if self.stop:
                    raise Withdrawn("a hedge of this call answered first")
                if found is None:
                    # Never in practice (internals_changed() checked the
                    # shape); should it happen, no copy is raced that
                    # could not be ended.
                    self.cancellable = False
                    log.warning("retryd: the socket of a hedged httpx attempt was not found; %s",
                                "the hedge is withdrawn unsent" if self._hedge else
                                "no hedge is sent while it runs")
                    if self._hedge:
                        raise Withdrawn("its socket was not found: it could not be ended")
                self._socket = found
                self.phase = "io"
        elif event in _CLOSING:
            with self._lock:
                self.phase = "closing"

    def cancel(self) -> None:
        """Ends the copy: at its next start event, or now by its socket (see the module doc)."""
        with self._lock:
            self.stop = True
            if self.phase == "io" and self._socket is not None:
                try:
                    # socket.socket's own shutdown, also for an SSLSocket:
                    # the descriptor's shutdown is all that ends the read;
                    # SSLSocket's override also sets its SSL object to None,
                    # which the worker's thread may be reading through.
                    socket.socket.shutdown(self._socket, socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the upstream or by httpcore


class Workers:
    """Daemon threads for the copies of hedged calls: an idle one is reused, else one is started.

    No queue in front of them, so a copy never waits for another call's to
    finish; a thread idle for ``idle_for`` seconds ends. Daemon threads, so
    a copy hung on a server without timeouts cannot hold the interpreter's exit.
    """

    def __init__(self, idle_for: float = 30.0) -> None:
        self.idle_for = idle_for
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]] = []

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), daemon=True, name="retryd-httpx-copy").start()
        inbox.put((job, future))
        return future

    def _work(self, inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            try:
                job, future = inbox.get(timeout=self.idle_for)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                continue  # taken just now by submit: its job is on the way
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as error:  # handed to the caller's thread
                    future.set_exception(error)
            del job, future
            with self._lock:
                self._idle.append(inbox)


#: The workers every blocking hedged call shares.
WORKERS = Workers()
