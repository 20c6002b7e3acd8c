"""Issue 36: a denied retry never hides that the call may have happened.

A POST that the upstream applied and then sat on, with retryd's budget for
the upstream empty: retryd denies the retry (BUDGET_EXHAUSTED, rule 2) and
marks the outcome unknown, and the caller gets the ambiguous-execution
error carrying that reason, never the plain timeout. Real servers on
loopback that count what they read, and a real retryd.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import httpx
import pytest

from grpc_servers import hang as grpc_hang
from grpc_servers import scripted
from scripted_http import ScriptedServer, hang
from support import Server
from retryd import (
    DEFAULT_LOCAL_POLICY,
    AmbiguousExecutionError,
    AsyncClient,
    Client,
    DenyReason,
    Evidence,
    FailureKind,
    Idempotency,
    UnknownOutcome,
    Verdict,
    local_decide,
)
from retryd.grpc import AmbiguousRpcError, RetryInterceptor
from retryd.httpx import arequest_with_retries, request_with_retries

# httpx's own per-attempt timeout; the response is held well past it.
ATTEMPT_TIMEOUT = 0.3


@pytest.fixture
def retryd(server: Server) -> Iterator[Client]:
    # Default timeout; no fallback, so a retryd that does not answer fails the test.
    with Client(server.grpc, fallback=None) as client:
        yield client


@pytest.mark.parametrize(("idempotency", "mark"), [
    (Idempotency.NON_IDEMPOTENT, UnknownOutcome.RECONCILE),
    (Idempotency.IDEMPOTENT_WITH_KEY, UnknownOutcome.RESEND_WITH_KEY),
])
def test_an_applied_post_held_past_the_attempt_timeout_is_ambiguous_with_the_budget_reason(
        retryd: Client, idempotency: Idempotency, mark: UnknownOutcome) -> None:
    with ScriptedServer() as origin, httpx.Client(timeout=ATTEMPT_TIMEOUT) as http:
        origin.actions = [hang(origin.released)]
        with pytest.raises(AmbiguousExecutionError) as raised:
            request_with_retries(http, retryd, "POST", origin.url + "/v1/charges", content=b"charge 7",
                                 headers={"Idempotency-Key": "k-7"}, upstream="x",
                                 idempotency=idempotency, deadline=5.0)
        assert len(origin.requests) == 1  # applied once, never re-sent
    error = raised.value
    assert error.deny_reason is DenyReason.BUDGET_EXHAUSTED
    assert error.decision.verdict is Verdict.DENY and error.decision.rule == 2
    assert error.decision.unknown_outcome is mark and not error.decision.fallback
    assert error.resend_with_same_key == (mark is UnknownOutcome.RESEND_WITH_KEY)
    assert isinstance(error.__cause__, httpx.ReadTimeout)
    assert "BUDGET_EXHAUSTED" in str(error)


def test_the_async_adapter_surfaces_the_same(server: Server) -> None:
    async def main(url: str) -> AmbiguousExecutionError:
        async with AsyncClient(server.grpc, fallback=None) as aretryd, \
                httpx.AsyncClient(timeout=ATTEMPT_TIMEOUT) as http:
            with pytest.raises(AmbiguousExecutionError) as raised:
                await arequest_with_retries(http, aretryd, "POST", url, content=b"charge 8", upstream="x",
                                            idempotency=Idempotency.NON_IDEMPOTENT, deadline=5.0)
            return raised.value

    with ScriptedServer() as origin:
        origin.actions = [hang(origin.released)]
        error = asyncio.run(main(origin.url))
        assert len(origin.requests) == 1
    assert error.deny_reason is DenyReason.BUDGET_EXHAUSTED and not error.resend_with_same_key


def test_a_safe_get_denied_by_the_budget_is_the_plain_error(retryd: Client) -> None:
    """The mark is for calls that may have taken effect: a SAFE one stays a plain failure."""
    with ScriptedServer() as origin, httpx.Client(timeout=ATTEMPT_TIMEOUT) as http:
        origin.actions = [hang(origin.released)]
        with pytest.raises(httpx.ReadTimeout) as raised:
            request_with_retries(http, retryd, "GET", origin.url, upstream="x", idempotency=Idempotency.SAFE,
                                 deadline=5.0)
        assert len(origin.requests) == 1
    assert not isinstance(raised.value, AmbiguousExecutionError)
    assert raised.value.retryd_decision.deny_reason is DenyReason.BUDGET_EXHAUSTED  # type: ignore[attr-defined]


def test_a_grpc_call_held_past_the_attempt_timeout_is_ambiguous_with_the_budget_reason(retryd: Client) -> None:
    release = threading.Event()
    interceptor = RetryInterceptor(retryd, upstream="x", idempotency=Idempotency.NON_IDEMPOTENT,
                                   attempt_timeout=ATTEMPT_TIMEOUT)
    with scripted(grpc_hang(release)) as origin:
        channel = grpc.intercept_channel(grpc.insecure_channel(origin.target), interceptor)
        try:
            with pytest.raises(AmbiguousRpcError) as raised:
                channel.unary_unary("/test.Echo/Call")(b"charge", timeout=5.0)
        finally:
            release.set()
            channel.close()
        assert len(origin.calls) == 1
    error = raised.value
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # still the failed call, for `except grpc.RpcError`
    assert error.deny_reason is DenyReason.BUDGET_EXHAUSTED and error.decision.rule == 2
    assert error.decision.unknown_outcome is UnknownOutcome.RECONCILE


@pytest.mark.parametrize(("kwargs", "mark"), [
    # The local attempt limit (2) denies a second read timeout: still unknown.
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=2, failure=FailureKind.RESPONSE_HEADER_TIMEOUT),
     UnknownOutcome.RECONCILE),
    (dict(idempotency=Idempotency.IDEMPOTENT_WITH_KEY, attempt=2, failure=FailureKind.CONNECTION_RESET),
     UnknownOutcome.RESEND_WITH_KEY),
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=1, http_status=503, deadline_remaining=0.0),
     UnknownOutcome.RECONCILE),
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=1, evidence=Evidence.PARTIAL_RESPONSE,
          http_status=200, first_byte_delivered=True), UnknownOutcome.RECONCILE),
    # Settled: never sent, or a final answer, or safe to repeat.
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=2, failure=FailureKind.CONNECT), UnknownOutcome.NONE),
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=2, http_status=500), UnknownOutcome.NONE),
    (dict(idempotency=Idempotency.IDEMPOTENT, attempt=2, failure=FailureKind.RESPONSE_HEADER_TIMEOUT),
     UnknownOutcome.NONE),
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=1, grpc_status_code=14, deadline_remaining=0.0),
     UnknownOutcome.RECONCILE),
    (dict(idempotency=Idempotency.NON_IDEMPOTENT, attempt=1, grpc_status_code=13, evidence=Evidence.RESPONSE_RECEIVED),
     UnknownOutcome.NONE),
])
def test_the_local_rule_marks_a_denial_like_retryd(kwargs: dict[str, object], mark: UnknownOutcome) -> None:
    decision = local_decide(policy=DEFAULT_LOCAL_POLICY, **kwargs)  # type: ignore[arg-type]
    assert decision.verdict is not Verdict.RETRY
    assert decision.unknown_outcome is mark
    assert decision.is_outcome_unknown == (mark is not UnknownOutcome.NONE or decision.is_ambiguous)
