"""W3C trace context for retryd calls, from the active OpenTelemetry context.

opentelemetry-api is optional: without it (or without an active, valid span)
no metadata is added. With it, the current span's context is sent as
``traceparent`` (and ``tracestate`` when there is one), so that retryd's
``retry.decide`` span joins the caller's trace. The span is read directly
(not through the globally configured propagator), so the header is sent
whatever propagators the application configured for its own HTTP calls.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - exercised by whichever environment runs the tests
    from opentelemetry import trace as _trace
except ImportError:  # opentelemetry-api is not installed
    _trace = None  # type: ignore[assignment]


def trace_metadata() -> list[tuple[str, str]]:
    """gRPC metadata carrying the active trace context, or an empty list."""
    if _trace is None:
        return []
    span: Any = _trace.get_current_span()
    context = span.get_span_context()
    if not context.is_valid:
        return []
    # Only the sampled bit is sent. Newer SDKs also set bit 1 ("random",
    # W3C Trace Context Level 2), and some version-00 parsers (the
    # opentelemetry Rust propagator among them) reject flags above 0x02,
    # which would silently cut retryd's span out of the caller's trace.
    flags = int(context.trace_flags) & 0x01
    metadata = [
        ("traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}")
    ]
    state = context.trace_state.to_header() if context.trace_state else ""
    if state:
        metadata.append(("tracestate", state))
    return metadata
