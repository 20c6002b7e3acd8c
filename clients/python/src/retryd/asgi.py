"""ASGI middleware: the inbound end of a call chain's lineage (docs/lineage.md).

Pure ASGI (no framework imported): wrap any ASGI app, under Starlette,
FastAPI or any ASGI server::

    app = LineageMiddleware(app, layer="middle")        # or app.add_middleware(LineageMiddleware, layer=...)

For each HTTP request it reads the ``retryd.lineage`` member of the
inbound ``baggage`` into the request's context (:mod:`retryd.lineage`), so
the adapters' outbound calls carry it on; and when one of those calls ended
in failure after retryd's decision and the response is a 5xx, it adds
``retryd-retried: <layer>``, so that the caller above does not retry what
this layer already retried (or was denied).
"""

from __future__ import annotations

from collections.abc import Awaitable, MutableMapping
from typing import Any, Callable, Optional

from .lineage import RETRIED_HEADER, check_layer, serving

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_RETRIED = RETRIED_HEADER.encode("ascii")


class LineageMiddleware:
    """Reads the inbound lineage into the context; marks a 5xx whose outbound call retryd already governed.

    ``layer`` is this service's layer name (by default
    :func:`retryd.lineage.default_layer`: ``OTEL_SERVICE_NAME``, else the
    program's name); use the same name as the retryd client's ``layer``.
    WebSocket connections get the lineage too; other scopes pass through.
    """

    def __init__(self, app: ASGIApp, *, layer: Optional[str] = None) -> None:
        self.app = app
        self.layer = check_layer(layer)
        self._layer = self.layer.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        baggage = [value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == b"baggage"]
        with serving(baggage=baggage) as state:

            async def send_marked(message: Message) -> None:
                # Read when the response starts: the handler's outbound calls
                # are over by then for any non-streaming response.
                if (message["type"] == "http.response.start" and int(message.get("status", 200)) >= 500
                        and state.failed_after_decision):
                    headers = [(key, value) for key, value in message.get("headers", ())
                               if key.lower() != _RETRIED]
                    message = {**message, "headers": headers + [(_RETRIED, self._layer)]}
                await send(message)

            await self.app(scope, receive, send_marked)


__all__ = ["LineageMiddleware"]
