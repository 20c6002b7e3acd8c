"""Issue 15: the grpcio interceptors. Classification against the real failures
on 127.0.0.1 (for the grpcio pinned in constraints.txt), and retryd-governed
retries against gRPC servers of the tests' own and a real retryd.

Tests marked "Needs retryd's gRPC rules" send a RESPONSE_RECEIVED with a
gRPC code and no HTTP status, which only a retryd with issue 15's rule 9
for gRPC codes decides (an older one rejects it as INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import grpc
import grpc.aio
import pytest

from grpc_servers import (
    METHOD,
    STREAM_METHOD,
    PrefaceRecorder,
    ResettingProxy,
    ScriptedGrpcServer,
    SilentServer,
    abort,
    hang,
    ok,
    respond_if,
    scripted,
)
from scripted_http import ScriptedServer, closed_port, garbage
from support import FakeClock, Server
from retryd import (
    AmbiguousExecutionError,
    AsyncClient,
    Client,
    DenyReason,
    Evidence,
    FailureKind,
    Idempotency,
    LocalPolicy,
    Verdict,
    local_decide,
)
from retryd.grpc import (
    AmbiguousAioRpcError,
    AmbiguousRpcError,
    AsyncRetryInterceptor,
    GrpcOutcome,
    RetryInterceptor,
    classify_rpc_error,
    decision_of,
    outcome_of,
)

HERE = Path(__file__).resolve().parent
CLOSED_RETRYD = "127.0.0.1:1"
UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED = 14, 8, 4


def failed_call(target: str, *, timeout: float = 2.0, options: Any = (), method: str = METHOD,
                credentials: Optional[grpc.ChannelCredentials] = None, **stub: Any) -> grpc.RpcError:
    if credentials is None:
        channel = grpc.insecure_channel(target, options=list(options))
    else:
        channel = grpc.secure_channel(target, credentials, options=list(options))
    with channel:
        try:
            channel.unary_unary(method, **stub)(b"request", timeout=timeout)
        except grpc.RpcError as error:
            return error
    raise AssertionError("expected the call to fail")


def test_grpcio_is_the_pinned_version() -> None:
    """The mapping below is checked for this grpcio: a new one must be re-checked."""
    pins = dict(line.split("==") for line in (HERE.parent / "constraints.txt").read_text().split()
                if "==" in line)
    assert grpc.__version__ == pins["grpcio"]


# ------------------------------------------------------------------ classification: never sent

def test_refused_port_proves_not_sent() -> None:
    error = failed_call(f"127.0.0.1:{closed_port()}")
    assert "failed to connect to all addresses" in (error.details() or "")  # type: ignore[attr-defined]
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.NOT_SENT, FailureKind.CONNECT, UNAVAILABLE)


def test_reset_before_the_handshake_proves_not_sent_and_no_request_left() -> None:
    with PrefaceRecorder() as recorder:
        error = failed_call(recorder.target)
        types = recorder.frame_types()
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.NOT_SENT, FailureKind.CONNECT, UNAVAILABLE)
    assert types and 0x1 not in types  # SETTINGS, WINDOW_UPDATE, never a HEADERS frame


def test_an_http1_server_proves_not_sent() -> None:
    with ScriptedServer(garbage(), read_request=False) as server:
        error = failed_call(f"127.0.0.1:{server.port}")
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.NOT_SENT, FailureKind.CONNECT, UNAVAILABLE)


def test_tls_handshake_failure_proves_not_sent() -> None:
    with scripted(ok()) as server:  # plaintext: the TLS handshake cannot succeed
        error = failed_call(server.target, credentials=grpc.ssl_channel_credentials())
        assert server.calls == []
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.NOT_SENT, FailureKind.PRE_REQUEST_TLS, UNAVAILABLE)


# ------------------------------------------------------------------ classification: sent, no answer

def test_a_handler_that_never_answers_is_sent_no_response() -> None:
    release = threading.Event()
    with scripted(hang(release)) as server:
        try:
            error = failed_call(server.target, timeout=0.3)
        finally:
            release.set()
        assert len(server.calls) == 1  # it was sent: never NOT_SENT
    assert classify_rpc_error(error) == GrpcOutcome(
        Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT, DEADLINE_EXCEEDED)


def test_a_server_that_accepts_and_never_speaks_is_not_proven_unsent() -> None:
    with SilentServer() as server:
        error = failed_call(server.target, timeout=0.3)
    assert classify_rpc_error(error) == GrpcOutcome(
        Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT, DEADLINE_EXCEEDED)


def test_a_reset_after_the_server_read_the_request_is_sent_no_response() -> None:
    release = threading.Event()
    with scripted(hang(release)) as server, ResettingProxy(server.port) as proxy:
        threading.Thread(target=lambda: server.entered.wait(5) and proxy.reset_clients(), daemon=True).start()
        try:
            error = failed_call(proxy.target, timeout=5)
        finally:
            release.set()
        assert len(server.calls) == 1
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET,
                                                    UNAVAILABLE)


# ------------------------------------------------------------------ classification: the server answered

def test_server_sent_unavailable_is_a_response() -> None:
    with scripted(abort(grpc.StatusCode.UNAVAILABLE, "overloaded")) as server:
        error = failed_call(server.target)
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, UNAVAILABLE)


@pytest.mark.parametrize("pushback", ["300", "0", "-1"])
def test_the_pushback_trailer_is_passed_raw(pushback: str) -> None:
    trailers = [("grpc-retry-pushback-ms", pushback)]
    with scripted(abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", trailers)) as server:
        error = failed_call(server.target)
    assert classify_rpc_error(error) == GrpcOutcome(
        Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, RESOURCE_EXHAUSTED, pushback)


def test_grpcio_turns_a_garbage_pushback_into_a_negative_one() -> None:
    """grpc-core parses this trailer itself: garbage arrives as INT64_MIN, still "do not retry"."""
    trailers = [("grpc-retry-pushback-ms", "soon")]
    with scripted(abort(grpc.StatusCode.UNAVAILABLE, "no", trailers)) as server:
        outcome = classify_rpc_error(failed_call(server.target))
    assert outcome.evidence == Evidence.RESPONSE_RECEIVED
    assert outcome.grpc_retry_pushback_ms is not None and outcome.grpc_retry_pushback_ms.startswith("-")


def test_a_server_side_deadline_is_never_a_response() -> None:
    with scripted(abort(grpc.StatusCode.DEADLINE_EXCEEDED, "its own upstream timed out")) as server:
        error = failed_call(server.target)
    assert classify_rpc_error(error).evidence == Evidence.SENT_NO_RESPONSE


def test_a_response_too_large_to_accept_was_received() -> None:
    with scripted(ok(b"x" * 5000)) as server:
        error = failed_call(server.target, options=[("grpc.max_receive_message_length", 1000)])
        assert len(server.calls) == 1
    assert classify_rpc_error(error) == GrpcOutcome(Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED,
                                                    RESOURCE_EXHAUSTED)


def test_a_request_too_large_to_send_is_an_encoding_failure() -> None:
    with scripted(ok()) as server:
        channel = grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 10)])
        with channel, pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary(METHOD)(b"y" * 100, timeout=2)
        assert server.calls == []
    assert classify_rpc_error(raised.value) == GrpcOutcome(
        Evidence.SENT_NO_RESPONSE, FailureKind.REQUEST_ENCODING, RESOURCE_EXHAUSTED)


def test_serializer_and_deserializer_failures() -> None:
    def broken(_: Any) -> Any:
        raise ValueError("codec")

    with scripted(ok()) as server:
        encoding = failed_call(server.target, request_serializer=broken)
        assert server.calls == []
        decoding = failed_call(server.target, response_deserializer=broken)
        assert len(server.calls) == 1
    assert classify_rpc_error(encoding) == GrpcOutcome(Evidence.SENT_NO_RESPONSE, FailureKind.REQUEST_ENCODING, 13)
    assert classify_rpc_error(decoding) == GrpcOutcome(Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, 13)


def test_a_stream_that_delivered_messages_is_first_byte_delivered() -> None:
    with ScriptedGrpcServer([ok()], stream_messages=2) as server, grpc.insecure_channel(server.target) as channel:
        received = 0
        with pytest.raises(grpc.RpcError) as raised:
            for _ in channel.unary_stream(STREAM_METHOD)(b"x", timeout=2):
                received += 1
    assert received == 2
    assert classify_rpc_error(raised.value, messages_received=received) == GrpcOutcome(
        Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, UNAVAILABLE, None, first_byte_delivered=True)


def test_the_aio_error_is_classified_the_same() -> None:
    async def main(target: str) -> GrpcOutcome:
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary(METHOD)(b"x", timeout=2)
        return classify_rpc_error(raised.value)

    trailers = [("grpc-retry-pushback-ms", "300")]
    with scripted(abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", trailers)) as server:
        assert asyncio.run(main(server.target)) == GrpcOutcome(
            Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, RESOURCE_EXHAUSTED, "300")
    assert asyncio.run(main(f"127.0.0.1:{closed_port()}")).evidence == Evidence.NOT_SENT


# ------------------------------------------------------------------ the local rule for gRPC codes

@pytest.mark.parametrize(
    "kwargs, verdict, reason",
    [
        (dict(idempotency=Idempotency.SAFE, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=14),
         Verdict.RETRY, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=14),
         Verdict.AMBIGUOUS, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.SAFE, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=8),
         Verdict.DENY, DenyReason.STATUS_NOT_RETRYABLE),
        (dict(idempotency=Idempotency.SAFE, grpc_status_code=8, grpc_retry_pushback_ms="100"),
         Verdict.RETRY, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.SAFE, grpc_status_code=14, grpc_retry_pushback_ms="-1"),
         Verdict.DENY, DenyReason.SERVER_PUSHBACK),
        (dict(idempotency=Idempotency.SAFE, grpc_status_code=14, grpc_retry_pushback_ms=""),
         Verdict.DENY, DenyReason.SERVER_PUSHBACK),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, failure=FailureKind.CONNECT, grpc_status_code=14),
         Verdict.RETRY, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, failure=FailureKind.RESPONSE_HEADER_TIMEOUT,
              grpc_status_code=4), Verdict.AMBIGUOUS, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.SAFE, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=16),
         Verdict.RETRY, DenyReason.UNSPECIFIED),
        (dict(idempotency=Idempotency.SAFE, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=13),
         Verdict.DENY, DenyReason.STATUS_NOT_RETRYABLE),
        (dict(idempotency=Idempotency.SAFE, evidence=Evidence.RESPONSE_RECEIVED, grpc_status_code=10),
         Verdict.DENY, DenyReason.STATUS_NOT_RETRYABLE),
    ],
)
def test_local_rule_for_grpc_codes(kwargs: dict[str, Any], verdict: Verdict, reason: DenyReason) -> None:
    decision = local_decide(policy=LocalPolicy(), attempt=1, **kwargs)
    assert (decision.verdict, decision.deny_reason) == (verdict, reason), decision.explanation
    if kwargs.get("grpc_status_code") == 16 and verdict == Verdict.RETRY:
        assert decision.refresh_credentials
    if kwargs.get("grpc_retry_pushback_ms") == "100":
        assert decision.backoff >= 0.1


# ------------------------------------------------------------------ the interceptor against a real retryd

@pytest.fixture
def retryd(server: Server) -> Iterator[Client]:
    with Client(server.grpc, timeout=5, fallback=None, report_interval=60) as client:
        yield client


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        time.sleep(seconds)


def stub(target: str, interceptor: grpc.UnaryUnaryClientInterceptor, method: str = METHOD) -> Any:
    channel = grpc.intercept_channel(grpc.insecure_channel(target), interceptor)
    return channel.unary_unary(method)


def test_refused_port_is_retried_even_for_a_non_idempotent_call(retryd: Client) -> None:
    sleeps = Sleeps()
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-refused", idempotency=Idempotency.NON_IDEMPOTENT,
                                   sleep=sleeps)
    with pytest.raises(grpc.RpcError) as raised:
        stub(f"127.0.0.1:{closed_port()}", interceptor)(b"charge", timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert len(sleeps.calls) == 2  # attempts 1 and 2 retried, attempt 3 reached max_attempts
    decision = decision_of(raised.value)
    assert decision is not None and decision.deny_reason is DenyReason.MAX_ATTEMPTS
    outcome = outcome_of(raised.value)
    assert outcome is not None and outcome.evidence == Evidence.NOT_SENT
    assert any(note.startswith("retryd: DENY (rule 1)") for note in raised.value.__notes__)
    assert retryd.reporter.pending() == {"py-grpc-refused": 1}  # the first attempt only


def test_a_hung_call_is_bounded_by_its_deadline_and_each_attempt(retryd: Client) -> None:
    release = threading.Event()
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-hang", idempotency=Idempotency.SAFE,
                                   attempt_timeout=0.3)
    with scripted(hang(release)) as server:
        started = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as raised:
                stub(server.target, interceptor)(b"x", timeout=1.0)
        finally:
            release.set()
        elapsed = time.monotonic() - started
        calls = list(server.calls)
    # Not before the caller's deadline; how soon after it is grpcio's own
    # timer on the wall clock, which a loaded machine stretches, so it is not
    # bounded here: what is checked is that the deadline, and each attempt's
    # timeout, went on the wire (the loop's own arithmetic runs on a fake
    # clock in test_each_decision_is_told_the_time_left).
    assert elapsed >= 0.9, elapsed
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert len(calls) >= 2  # a hung attempt left time for another
    # Each attempt carried its own grpc-timeout: at most the attempt timeout.
    assert all(call.time_remaining is not None and call.time_remaining <= 0.35 for call in calls)
    decision = decision_of(raised.value)
    assert decision is not None and decision.verdict is not Verdict.RETRY


def test_server_unavailable_is_retried_for_a_safe_call(retryd: Client) -> None:
    """Needs retryd's gRPC rules."""
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-503", idempotency={METHOD: Idempotency.SAFE})
    with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok(b"stock")) as server:
        assert stub(server.target, interceptor)(b"x", timeout=5) == b"stock"
        assert len(server.calls) == 2


def test_pushback_300_is_honoured(retryd: Client) -> None:
    """Needs retryd's gRPC rules. The gap between the two attempts the server saw is measured."""
    trailers = [("grpc-retry-pushback-ms", "300")]
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-pushback", idempotency=Idempotency.IDEMPOTENT)
    with scripted(abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", trailers), ok()) as server:
        assert stub(server.target, interceptor)(b"x", timeout=10) == b"ok"
        first, second = server.calls
    gap = second.at - first.at
    assert 0.3 <= gap <= 2.3, gap


def test_pushback_minus_one_is_not_retried(retryd: Client) -> None:
    """Needs retryd's gRPC rules."""
    trailers = [("grpc-retry-pushback-ms", "-1")]
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-pushback", idempotency=Idempotency.SAFE)
    with scripted(abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "go away", trailers), ok()) as server:
        with pytest.raises(grpc.RpcError) as raised:
            stub(server.target, interceptor)(b"x", timeout=5)
        assert len(server.calls) == 1
    decision = decision_of(raised.value)
    assert decision is not None and decision.deny_reason is DenyReason.SERVER_PUSHBACK


def test_unauthenticated_refreshes_once(retryd: Client) -> None:
    """Needs retryd's gRPC rules."""
    refreshed: list[bool] = []

    def refresh() -> list[tuple[str, str]]:
        refreshed.append(True)
        return [("authorization", "Bearer new")]

    authorized = respond_if(lambda md: md.get("authorization") == "Bearer new", ok(b"secret"),
                            abort(grpc.StatusCode.UNAUTHENTICATED, "expired"))
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-auth", idempotency=Idempotency.SAFE,
                                   on_refresh_credentials=refresh)
    with scripted(authorized) as server:
        response = stub(server.target, interceptor)(b"x", timeout=5, metadata=[("authorization", "Bearer old")])
        assert response == b"secret" and len(server.calls) == 2 and refreshed == [True]
    plain = RetryInterceptor(retryd, upstream="py-grpc-auth", idempotency=Idempotency.SAFE)
    with scripted(authorized) as server:
        with pytest.raises(grpc.RpcError):
            stub(server.target, plain)(b"x", timeout=5)
        assert len(server.calls) == 1  # no callback: no replay


def test_non_idempotent_unavailable_after_the_server_read_it_is_ambiguous(retryd: Client) -> None:
    """Needs retryd's gRPC rules."""
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-charge", idempotency=Idempotency.NON_IDEMPOTENT)
    with scripted(abort(grpc.StatusCode.UNAVAILABLE, "lost the ledger"), ok()) as server:
        with pytest.raises(AmbiguousRpcError) as raised:
            stub(server.target, interceptor)(b"charge", timeout=5)
        assert len(server.calls) == 1  # never re-sent
    error = raised.value
    assert isinstance(error, grpc.RpcError) and isinstance(error, AmbiguousExecutionError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and error.decision.is_ambiguous


def test_a_reset_non_idempotent_call_is_ambiguous(retryd: Client) -> None:
    release = threading.Event()
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-charge", idempotency=Idempotency.NON_IDEMPOTENT)
    with scripted(hang(release)) as server, ResettingProxy(server.port) as proxy:
        threading.Thread(target=lambda: server.entered.wait(5) and proxy.reset_clients(), daemon=True).start()
        try:
            with pytest.raises(AmbiguousRpcError) as raised:
                stub(proxy.target, interceptor)(b"charge", timeout=5)
        finally:
            release.set()
        assert len(server.calls) == 1
    assert raised.value.decision.rule == 8


def test_classify_only(retryd: Client) -> None:
    interceptor = RetryInterceptor(retryd, upstream="py-grpc-classify", idempotency=Idempotency.SAFE, retries=False)
    with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok()) as server:
        with pytest.raises(grpc.RpcError) as raised:
            stub(server.target, interceptor)(b"x", timeout=5)
        assert len(server.calls) == 1
    assert outcome_of(raised.value) == GrpcOutcome(Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, UNAVAILABLE)
    assert decision_of(raised.value) is None
    assert retryd.reporter.pending() == {}  # classify-only cannot tell a retry from a first attempt


def test_successful_calls_fill_the_budget(server: Server) -> None:
    with scripted(ok()) as origin:
        with Client(server.grpc, timeout=5, fallback=None, report_interval=60) as client:
            interceptor = RetryInterceptor(client, upstream="py-fill-grpc", idempotency=Idempotency.SAFE)
            for _ in range(4):
                stub(origin.target, interceptor)(b"x", timeout=5)
        with Client(server.grpc, timeout=5, fallback=None) as admin:
            assert admin.get_budget("py-fill-grpc").tokens == pytest.approx(2.0)


def test_the_local_rule_governs_when_retryd_is_down() -> None:
    with Client(CLOSED_RETRYD, timeout=0.2) as down:
        interceptor = RetryInterceptor(down, upstream="u", idempotency=Idempotency.SAFE, reporter=None)
        with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok()) as server:
            assert stub(server.target, interceptor)(b"x", timeout=5) == b"ok"
            assert len(server.calls) == 2
        charge = RetryInterceptor(down, upstream="u", idempotency=Idempotency.NON_IDEMPOTENT, reporter=None)
        with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok()) as server:
            with pytest.raises(AmbiguousRpcError) as raised:
                stub(server.target, charge)(b"x", timeout=5)
            assert len(server.calls) == 1
        assert raised.value.decision.fallback


# ------------------------------------------------------------------ the asyncio interceptor

def run_async(target: str, make: Callable[[AsyncClient], AsyncRetryInterceptor], retryd_target: str,
              **call: Any) -> Any:
    async def main() -> Any:
        async with AsyncClient(retryd_target, timeout=5, fallback=None, report_interval=60) as aretryd:
            async with grpc.aio.insecure_channel(target, interceptors=[make(aretryd)]) as channel:
                try:
                    return await channel.unary_unary(METHOD)(b"x", **call)
                except grpc.aio.AioRpcError as error:
                    return error

    return asyncio.run(main())


def test_async_refused_port_is_retried(server: Server) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    error = run_async(f"127.0.0.1:{closed_port()}",
                      lambda c: AsyncRetryInterceptor(c, upstream="py-grpc-async", idempotency=Idempotency.SAFE,
                                                      sleep=sleep), server.grpc, timeout=5)
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
    assert len(slept) == 2
    decision = decision_of(error)
    assert decision is not None and decision.deny_reason is DenyReason.MAX_ATTEMPTS


def test_async_hung_call_is_bounded(server: Server) -> None:
    release = threading.Event()
    with scripted(hang(release)) as origin:
        started = time.monotonic()
        try:
            error = run_async(origin.target,
                              lambda c: AsyncRetryInterceptor(c, upstream="py-grpc-async", idempotency=Idempotency.SAFE,
                                                              attempt_timeout=0.3), server.grpc, timeout=1.0)
        finally:
            release.set()
        elapsed = time.monotonic() - started
        calls = list(origin.calls)
    assert len(calls) >= 2
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # As in the synchronous test: not before the deadline, and the deadline
    # and each attempt's timeout on the wire, rather than a wall-clock ceiling.
    assert elapsed >= 0.9, elapsed
    assert all(call.time_remaining is not None and call.time_remaining <= 0.35 for call in calls)


def test_async_unavailable_then_ok(server: Server) -> None:
    """Needs retryd's gRPC rules."""
    with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok(b"stock")) as origin:
        result = run_async(origin.target,
                           lambda c: AsyncRetryInterceptor(c, upstream="py-grpc-async", idempotency=Idempotency.SAFE),
                           server.grpc, timeout=5)
        assert result == b"stock" and len(origin.calls) == 2


def test_async_non_idempotent_is_ambiguous(server: Server) -> None:
    """Needs retryd's gRPC rules."""
    async def main(target: str) -> None:
        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aretryd:
            interceptor = AsyncRetryInterceptor(aretryd, upstream="py-grpc-async",
                                                idempotency=Idempotency.NON_IDEMPOTENT)
            async with grpc.aio.insecure_channel(target, interceptors=[interceptor]) as channel:
                with pytest.raises(AmbiguousAioRpcError) as raised:
                    await channel.unary_unary(METHOD)(b"charge", timeout=5)
        assert isinstance(raised.value, grpc.aio.AioRpcError) and raised.value.decision.is_ambiguous

    with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok()) as origin:
        asyncio.run(main(origin.target))
        assert len(origin.calls) == 1


def test_async_pushback_minus_one_is_not_retried(server: Server) -> None:
    """Needs retryd's gRPC rules."""
    trailers = [("grpc-retry-pushback-ms", "-1")]
    with scripted(abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no", trailers), ok()) as origin:
        error = run_async(origin.target,
                          lambda c: AsyncRetryInterceptor(c, upstream="py-grpc-async", idempotency=Idempotency.SAFE),
                          server.grpc, timeout=5)
        assert len(origin.calls) == 1
    decision = decision_of(error)
    assert decision is not None and decision.deny_reason is DenyReason.SERVER_PUSHBACK


def test_each_decision_is_told_the_time_left() -> None:
    """A stand-in retryd that always says RETRY after 250 ms records what it is told."""
    from concurrent import futures

    from retryd.v1 import retryd_pb2 as pb
    from retryd.v1 import retryd_pb2_grpc as pb_grpc

    seen: list[pb.DecideRequest] = []

    class Decider(pb_grpc.RetryDeciderServicer):  # type: ignore[misc]
        def Decide(self, request: pb.DecideRequest, context: grpc.ServicerContext) -> pb.DecideResponse:
            seen.append(request)
            return pb.DecideResponse(verdict=pb.VERDICT_RETRY, rule=9, decision_id="fake",
                                     backoff={"nanos": 250_000_000})

    decider = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RetryDeciderServicer_to_server(Decider(), decider)
    port = decider.add_insecure_port("127.0.0.1:0")
    decider.start()
    trailers = [("grpc-retry-pushback-ms", "150")]
    # The deadline runs on a fake clock that only the backoffs move, so the
    # promise (the loop ends within the caller's 1 s, each decision told
    # what is left of it) is checked exactly, not against the wall.
    clock = FakeClock()
    try:
        with Client(f"127.0.0.1:{port}", timeout=5, fallback=None) as fake, \
                scripted(abort(grpc.StatusCode.UNAVAILABLE, "busy", trailers)) as origin:
            interceptor = RetryInterceptor(fake, upstream="u", idempotency=Idempotency.SAFE, reporter=None,
                                           clock=clock, sleep=clock.sleep)
            with pytest.raises(grpc.RpcError):
                stub(origin.target, interceptor)(b"x", timeout=1.0)
    finally:
        decider.stop(grace=None)
    assert sum(clock.sleeps) <= 1.0, clock.sleeps
    left = [r.deadline_remaining.seconds + r.deadline_remaining.nanos / 1e9 for r in seen]
    assert len(left) >= 3 and left[0] <= 1.0
    assert all(later < earlier for earlier, later in zip(left, left[1:]))
    first = seen[0]
    assert (first.grpc_status_code, first.grpc_retry_pushback_ms, first.evidence) == (
        UNAVAILABLE, "150", Evidence.RESPONSE_RECEIVED)
    assert first.HasField("grpc_retry_pushback_ms") and first.operation == METHOD
    assert first.body.kind == 2  # ENCODED_VALUE: a message and a deterministic codec
