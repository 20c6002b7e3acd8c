"""grpcio server interceptors: the inbound end of a call chain's lineage (docs/lineage.md).

::

    server = grpc.server(executor, interceptors=[LineageServerInterceptor(layer="middle")])
    server = grpc.aio.server(interceptors=[AsyncLineageServerInterceptor(layer="middle")])

Each call's handler runs with the ``retryd.lineage`` member of the inbound
``baggage`` metadata in its context (:mod:`retryd.lineage`), so the
interceptors' and the httpx adapter's outbound calls carry it on. When one
of those calls ended in failure after retryd's decision and the handler's
status is not OK (an ``abort``, a ``set_code``, an exception), the trailers
get ``retryd-retried: <layer>`` and ``grpc-retry-pushback-ms: -1``, so that
neither a retryd-governed caller nor a plain gRPC client (gRFC A6) retries
what this layer already retried (or was denied).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, Callable, Optional

import grpc
import grpc.aio

from .lineage import PUSHBACK_TRAILER, RETRIED_HEADER, Inbound, check_layer, serving


def _baggage(handler_call_details: Any) -> list[str]:
    values = []
    for key, value in handler_call_details.invocation_metadata or ():
        if key.lower() == "baggage":
            values.append(value if isinstance(value, str) else bytes(value).decode("latin-1"))
    return values


def _failed(context: Any) -> bool:
    code = context.code()
    return code is not None and code != grpc.StatusCode.OK and code != 0


def _signal(layer: str, trailers: Any) -> list[tuple[str, Any]]:
    """The trailers with the upward signal, replacing any of the same keys."""
    ours = {RETRIED_HEADER, PUSHBACK_TRAILER}
    kept = [(key, value) for key, value in (trailers or ()) if key.lower() not in ours]
    return kept + [(RETRIED_HEADER, layer), (PUSHBACK_TRAILER, "-1")]


def _wrap(handler: Any, unary: Callable[..., Any], stream: Callable[..., Any]) -> Any:
    """The handler with each behaviour wrapped (``unary`` for unary responses, ``stream`` for streams)."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), handler.request_deserializer,
                                                     handler.response_serializer)
    return handler


class LineageServerInterceptor(grpc.ServerInterceptor):
    """A sync grpcio server interceptor: the lineage in, the ``retryd-retried`` trailer out.

    ``layer`` is this service's layer name (by default
    :func:`retryd.lineage.default_layer`); use the retryd client's ``layer``.
    """

    def __init__(self, *, layer: Optional[str] = None) -> None:
        self.layer = check_layer(layer)

    def _mark(self, state: Inbound, context: Any, failed: bool) -> None:
        # grpcio sends the trailers held by the context with the status, also
        # after an abort() or an exception, so setting them here is in time.
        if failed and state.failed_after_decision:
            context.set_trailing_metadata(_signal(self.layer, context.trailing_metadata()))

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        baggage = _baggage(handler_call_details)

        def unary(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            def run(request: Any, context: Any) -> Any:
                with serving(baggage=baggage) as state:
                    try:
                        response = behavior(request, context)
                    except BaseException:
                        self._mark(state, context, True)
                        raise
                    self._mark(state, context, _failed(context))
                    return response

            return run

        def stream(behavior: Callable[[Any, Any], Iterator[Any]]) -> Callable[[Any, Any], Iterator[Any]]:
            def run(request: Any, context: Any) -> Iterator[Any]:
                with serving(baggage=baggage) as state:
                    try:
                        yield from behavior(request, context)
                    except BaseException:
                        self._mark(state, context, True)
                        raise
                    self._mark(state, context, _failed(context))

            return run

        return _wrap(handler, unary, stream)


class _MarkingContext:
    """A grpc.aio context whose ``abort`` adds the upward signal first.

    grpc.aio sends the status (and trailers) inside ``abort`` itself, so the
    trailers cannot be added after it returns, as the sync interceptor does.
    """

    def __init__(self, context: Any, state: Inbound, layer: str) -> None:
        self._context = context
        self._state = state
        self._layer = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if self._state.failed_after_decision and code != grpc.StatusCode.OK:
            # grpc.aio's abort takes a tuple, not a list.
            trailing_metadata = tuple(_signal(self._layer, tuple(trailing_metadata) or self._context.trailing_metadata()))
        await self._context.abort(code, details, trailing_metadata)


class AsyncLineageServerInterceptor(grpc.aio.ServerInterceptor):
    """The ``grpc.aio`` twin of :class:`LineageServerInterceptor`."""

    def __init__(self, *, layer: Optional[str] = None) -> None:
        self.layer = check_layer(layer)

    def _mark(self, state: Inbound, context: Any, failed: bool) -> None:
        if failed and state.failed_after_decision:
            context.set_trailing_metadata(tuple(_signal(self.layer, context.trailing_metadata())))

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        baggage = _baggage(handler_call_details)

        def unary(behavior: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
            async def run(request: Any, context: Any) -> Any:
                with serving(baggage=baggage) as state:
                    try:
                        response = await behavior(request, _MarkingContext(context, state, self.layer))
                    except grpc.aio.AbortError:
                        raise  # the status and trailers are sent
                    except BaseException:
                        self._mark(state, context, True)
                        raise
                    self._mark(state, context, _failed(context))
                    return response

            return run

        def stream(behavior: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
            async def run(request: Any, context: Any) -> AsyncIterator[Any]:
                with serving(baggage=baggage) as state:
                    try:
                        async for response in behavior(request, _MarkingContext(context, state, self.layer)):
                            yield response
                    except grpc.aio.AbortError:
                        raise
                    except BaseException:
                        self._mark(state, context, True)
                        raise
                    self._mark(state, context, _failed(context))

            return run

        return _wrap(handler, unary, stream)


__all__ = ["AsyncLineageServerInterceptor", "LineageServerInterceptor"]
