"""A hedge's loser is cancelled without breaking httpx's connection pool.

httpcore 1.0.9 loses a connection for good when a request is cancelled after
its pool assigned it one and before the request started on it
(encode/httpcore#1093): the fleet's tail scenario found it as Python callers'
pools filling with connections stuck CONNECTING or NEW while every call got
slower (docs/fleet.md, the tail section). The adapter cancels a copy only
where httpcore cleans up after it (retryd.httpx._CopyGate); these tests cancel
copies at every moment of their first loop iterations, against a real
upstream on loopback, and look into the pool afterwards (its private list of
connections: what the bug leaves behind is visible nowhere else).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import httpx
import pytest

from scripted_http import ScriptedServer, respond
from retryd import Idempotency
from retryd.httpx import _acopy, _CopyGate, _Loop

#: Loop iterations a copy is given before its cancel: beyond the pool's
#: assignment, the connect and the request's start (about ten on loopback).
MOMENTS = 60


def _stuck(http: httpx.AsyncClient) -> list[Any]:
    """Connections that are neither reusable nor closed: never used again, never reaped."""
    pool = http._transport._pool  # type: ignore[attr-defined]
    return [c for c in pool.connections if not (c.is_idle() or c.is_closed())]


def _loop(deadline: Optional[float]) -> _Loop:
    return _Loop(upstream="py-gate", idempotency=Idempotency.SAFE, operation="GET /", body=None,
                 deadline=deadline, max_attempts=0, reporter=None, clock=time.monotonic, layer="py")


@pytest.mark.parametrize("deadline", [None, 5.0])
def test_a_copy_cancelled_at_any_moment_leaves_no_connection_behind(deadline: Optional[float]) -> None:
    async def main() -> None:
        with ScriptedServer(respond(200, b"ok")) as upstream:
            async with httpx.AsyncClient() as http:
                for moment in range(MOMENTS):
                    request = http.build_request("GET", upstream.url)
                    gate = _CopyGate(request)
                    task = asyncio.ensure_future(_acopy(http, request, {}, _loop(deadline), frozenset(), gate))
                    gate.task = task
                    for _ in range(moment):
                        await asyncio.sleep(0)
                    gate.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    assert _stuck(http) == [], moment
                # And the pool still serves.
                response = await http.get(upstream.url)
                assert response.content == b"ok"

    asyncio.run(main())


def test_a_deferred_cancel_still_ends_the_copy() -> None:
    """Cancelled while it waits in the pool for a connection, a copy ends at its
    request's first trace event, before anything is sent."""
    async def main() -> None:
        with ScriptedServer(respond(200, b"ok")) as upstream:
            async with httpx.AsyncClient() as http:
                request = http.build_request("GET", upstream.url)
                gate = _CopyGate(request)
                task = asyncio.ensure_future(_acopy(http, request, {}, _loop(5.0), frozenset(), gate))
                gate.task = task
                while not gate.in_pool:
                    await asyncio.sleep(0)
                gate.cancel()
                assert gate.stop and not task.done()  # deferred, not dropped
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert _stuck(http) == []
            assert upstream.requests == []

    asyncio.run(main())
