"""Python client for retryd, the fleet-wide retry decision service.

Quick start::

    from retryd import Client, Idempotency, FailureKind

    client = Client("127.0.0.1:50051", timeout=0.2)
    decision = client.decide(upstream="payments-api", idempotency=Idempotency.SAFE,
                             attempt=1, failure=FailureKind.CONNECT)
    if decision.should_retry:
        time.sleep(decision.backoff)

With httpx, :func:`retryd.httpx.request_with_retries` does the whole loop.
In a call chain, :class:`LineageMiddleware` (ASGI) and
:class:`LineageServerInterceptor` (grpcio) carry the lineage that lets only
one layer retry (:mod:`retryd.lineage`, docs/lineage.md).
The generated protobuf stubs live in :mod:`retryd.v1` (built from
proto/retryd/v1/retryd.proto when the package is built).
"""

from ._types import (
    Body,
    BodyKind,
    Budget,
    Decision,
    DenyReason,
    Evidence,
    FailureKind,
    GrpcCode,
    Idempotency,
    Replayability,
    UnknownOutcome,
    Verdict,
)
from .asgi import LineageMiddleware
from .client import AsyncClient, Client
from .errors import AmbiguousExecutionError, InvalidRequestError, RetrydError, RetrydUnavailableError
from .fallback import DEFAULT_LOCAL_POLICY, LocalPolicy, effective_evidence, local_decide
from .grpc_server import AsyncLineageServerInterceptor, LineageServerInterceptor
from .lineage import current_lineage, default_layer, serving
from .reporter import AsyncTrafficReporter, ReportResult, Traffic, TrafficReporter
from .shadow import DEFAULT_SHADOW_LOG_INTERVAL

__all__ = [
    "AmbiguousExecutionError",
    "AsyncClient",
    "AsyncLineageServerInterceptor",
    "AsyncTrafficReporter",
    "Body",
    "BodyKind",
    "Budget",
    "Client",
    "DEFAULT_LOCAL_POLICY",
    "DEFAULT_SHADOW_LOG_INTERVAL",
    "Decision",
    "DenyReason",
    "Evidence",
    "FailureKind",
    "GrpcCode",
    "Idempotency",
    "InvalidRequestError",
    "LineageMiddleware",
    "LineageServerInterceptor",
    "LocalPolicy",
    "Replayability",
    "ReportResult",
    "RetrydError",
    "RetrydUnavailableError",
    "Traffic",
    "TrafficReporter",
    "UnknownOutcome",
    "Verdict",
    "current_lineage",
    "default_layer",
    "effective_evidence",
    "local_decide",
    "serving",
]
