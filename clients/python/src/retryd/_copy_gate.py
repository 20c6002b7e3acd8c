"""Cancelling one asyncio httpx attempt where httpcore's connection pool survives it.

Used by :mod:`retryd.httpx` for a hedge's losers and for the deadline's cut
of an attempt; the class doc says why a plain ``task.cancel()`` is not enough.
This module only watches httpx's ``trace`` events and cancels tasks: it
never touches a connection or the pool itself.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import httpx

#: httpcore's trace events (httpx's ``trace`` extension) that mark where a
#: copy may be cancelled; see :class:`_CopyGate`.
_CONNECTING = frozenset({"connection.connect_tcp.started", "connection.connect_unix_socket.started"})
_STARTED = frozenset({"http11.send_request_headers.started", "http2.send_request_headers.started"})
_CLOSING = frozenset({"http11.response_closed.started", "http2.response_closed.started"})
_CLOSED = frozenset({"http11.response_closed.complete", "http11.response_closed.failed",
                     "http2.response_closed.complete", "http2.response_closed.failed"})


class CopyGate:
    """Cancels one async attempt only where httpcore's connection pool survives it.

    httpcore 1.0.9 loses a connection for good when a request is cancelled
    (asyncio's ``task.cancel()``) at one of two moments: after its pool
    assigned it a connection and before the request started on it
    (encode/httpcore#1093, open: the connection stays CONNECTING or NEW),
    and while the connection is being put back after the response was read
    (its state lock: the connection stays ACTIVE; anyio's shields do not
    hold off asyncio's own cancel). Such a connection is never used, closed
    or reaped, and every later request of the pool scans it. A hedge's loser
    is cancelled at exactly those moments whenever the first attempt answers
    just after its hedge was sent, which on a busy event loop is most
    hedges: in the fleet's tail scenario the Python callers' pools filled
    with them, each call cost more, the loop lagged past the 50 ms hedge
    delay, every call was hedged, and calls ran into the deadline
    (ReadTimeout) by the hundred (docs/fleet.md, the tail section).

    So a cancel is immediate before the request enters the pool, while it
    sends or waits for the response (httpcore's error path closes the
    connection: the upstream sees the request aborted), and after the
    connection was put back; in the pool it is raised at the request's next
    trace event (the connect's or the request's start, inside httpcore's
    error handling), and during the put-back it waits until that is done.
    The wait is bounded by the attempt's pool and connect timeouts.
    """

    def __init__(self, request: httpx.Request) -> None:
        #: What a cancel cancels: the copy's task, then (inside _within) its send.
        self.task: Optional[asyncio.Future[Any]] = None
        #: "before", "pool", "io", "closing", "after": where the request is.
        self.phase = "before"
        #: A cancel asked for at a moment that would lose the connection, not yet delivered.
        self.stop = False
        self._chained = request.extensions.get("trace")
        request.extensions = {**request.extensions, "trace": self._trace}

    @property
    def in_pool(self) -> bool:
        return self.phase == "pool"

    async def _trace(self, event: str, info: dict[str, Any]) -> None:
        if self._chained is not None:
            await self._chained(event, info)
        if event in _CONNECTING or event in _STARTED:
            if self.stop:
                raise asyncio.CancelledError("a hedge of this call answered first")
            if event in _STARTED:
                self.phase = "io"
        elif event in _CLOSING:
            self.phase = "closing"
        elif event in _CLOSED:
            self.phase = "after"
            if self.stop:
                self.stop = False
                self.cancel()

    def enter_pool(self) -> None:
        self.phase = "pool"

    def cancel(self) -> None:
        """Cancels the attempt now, or at its next safe moment (see the class doc)."""
        task = self.task
        if task is None or task.done():
            return
        if self.phase in ("pool", "closing"):
            self.stop = True
        else:
            task.cancel()
