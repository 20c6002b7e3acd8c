"""Client API tests: against a real retryd, and against a fake gRPC server for
the things a real one cannot show (metadata received, a slow answer)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from datetime import timedelta
from typing import Any

import grpc
import pytest

from support import VECTORS, Server, wait_for
from retryd import (
    AsyncClient,
    Body,
    Client,
    DenyReason,
    Evidence,
    FailureKind,
    Idempotency,
    InvalidRequestError,
    LocalPolicy,
    Replayability,
    ReportResult,
    RetrydUnavailableError,
    TrafficReporter,
    Verdict,
    effective_evidence,
    local_decide,
)
from retryd import _types
from retryd.v1 import retryd_pb2 as pb
from retryd.v1 import retryd_pb2_grpc as pb_grpc

# A loopback port nothing listens on (connections are refused at once).
CLOSED = "127.0.0.1:1"


# ------------------------------------------------------------------ the contract

@pytest.mark.parametrize(
    "ours, theirs, prefix",
    [
        (_types.Idempotency, "Idempotency", "IDEMPOTENCY_"),
        (_types.Evidence, "Evidence", "EVIDENCE_"),
        (_types.FailureKind, "FailureKind", "FAILURE_KIND_"),
        (_types.Replayability, "Replayability", "REPLAYABILITY_"),
        (_types.BodyKind, "BodyKind", "BODY_KIND_"),
        (_types.Verdict, "Verdict", "VERDICT_"),
        (_types.DenyReason, "DenyReason", "DENY_REASON_"),
    ],
)
def test_enums_match_the_generated_descriptors(ours: Any, theirs: str, prefix: str) -> None:
    descriptor = pb.DESCRIPTOR.enum_types_by_name[theirs]
    generated = {value.name[len(prefix):]: value.number for value in descriptor.values}
    assert {member.name: member.value for member in ours} == generated


def test_effective_evidence_agrees_with_every_vector() -> None:
    for case in json.loads(VECTORS.read_text())["cases"]:
        if "expect" not in case:
            continue
        request = case["request"]
        got = effective_evidence(
            Evidence[request.get("evidence", "EVIDENCE_UNSPECIFIED").removeprefix("EVIDENCE_")],
            FailureKind[request.get("failure", "FAILURE_KIND_UNSPECIFIED").removeprefix("FAILURE_KIND_")],
            request.get("httpStatus", 0),
            request.get("grpcRetryPushbackMs"),
        )
        assert "EVIDENCE_" + got.name == case["expect"]["effective_evidence"], case["name"]


def test_grpc_codes_match_grpcio() -> None:
    from retryd import GrpcCode

    assert {code.name: code.value for code in GrpcCode} == {
        status.name: status.value[0] for status in grpc.StatusCode if status != grpc.StatusCode.OK
    }


def test_body_replayability_table() -> None:
    assert Body.bytes().replayability == Replayability.REPLAYABLE
    assert Body.encoded_value().replayability == Replayability.REPLAYABLE
    assert Body.reopenable().replayability == Replayability.REOPENABLE
    assert Body.input_stream().replayability == Replayability.ONE_SHOT
    assert Body.publisher().replayability == Replayability.ONE_SHOT
    assert Body.publisher_factory(Replayability.REOPENABLE).replayability == Replayability.REOPENABLE
    assert Body.multipart(Body.bytes(), Body.reopenable()).replayability == Replayability.REOPENABLE
    assert Body.multipart(Body.bytes(), Body.multipart(Body.publisher())).replayability == Replayability.ONE_SHOT


# ------------------------------------------------------------------ against a real retryd

@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.grpc, timeout=5, fallback=None) as real:
        yield real


def test_decide_returns_a_typed_decision(client: Client) -> None:
    decision = client.decide(
        upstream="py-typed", operation="GET /x", idempotency=Idempotency.SAFE, attempt=1,
        failure=FailureKind.CONNECT,
    )
    assert decision.verdict is Verdict.RETRY and decision.should_retry
    assert decision.effective_evidence is Evidence.NOT_SENT
    assert decision.deny_reason is DenyReason.UNSPECIFIED
    assert 0 <= decision.backoff <= 0.010
    assert decision.rule == 9
    assert decision.decision_id and decision.explanation
    assert not decision.fallback


def test_only_retry_spends_a_token(client: Client) -> None:
    upstream = "py-spend"
    deny = client.decide(upstream=upstream, idempotency=Idempotency.SAFE, attempt=1, http_status=404)
    assert deny.verdict is Verdict.DENY
    assert client.get_budget(upstream).tokens == pytest.approx(1000.0)
    retry = client.decide(upstream=upstream, idempotency=Idempotency.SAFE, attempt=1, http_status=503)
    assert retry.verdict is Verdict.RETRY
    assert retry.tokens_remaining == pytest.approx(999.0, abs=0.5)
    ambiguous = client.decide(upstream=upstream, idempotency=Idempotency.NON_IDEMPOTENT, attempt=1,
                              failure=FailureKind.RESPONSE_HEADER_TIMEOUT)
    assert ambiguous.is_ambiguous
    assert client.get_budget(upstream).tokens < 1000.0


def test_invalid_request_names_the_field(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        client.decide(upstream="", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.CONNECT)
    assert raised.value.field == "upstream"
    with pytest.raises(InvalidRequestError) as raised:
        client.decide(upstream="py", idempotency=Idempotency.UNSPECIFIED, attempt=1, failure=FailureKind.CONNECT)
    assert raised.value.field == "idempotency"


def test_invalid_request_is_not_hidden_by_the_fallback(server: Server) -> None:
    with Client(server.grpc, timeout=5) as lenient:
        with pytest.raises(InvalidRequestError):
            lenient.decide(upstream="py", idempotency=Idempotency.SAFE, attempt=0, failure=FailureKind.CONNECT)


def test_remaining_deadline_is_passed(client: Client) -> None:
    short = client.decide(upstream="py-slow", idempotency=Idempotency.SAFE, attempt=1,
                          failure=FailureKind.CONNECT, deadline_remaining=0.2)
    assert (short.verdict, short.deny_reason, short.rule) == (Verdict.DENY, DenyReason.DEADLINE, 6)
    fits = client.decide(upstream="py-slow", idempotency=Idempotency.SAFE, attempt=1,
                         failure=FailureKind.CONNECT, deadline_remaining=timedelta(milliseconds=320))
    assert fits.verdict is Verdict.RETRY
    assert fits.backoff <= 0.020 + 1e-9  # shortened so backoff + 300ms fits in 320ms


def test_report_traffic_fills_an_empty_budget(client: Client) -> None:
    denied = client.decide(upstream="py-empty", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.DNS)
    assert denied.deny_reason is DenyReason.BUDGET_EXHAUSTED
    with TrafficReporter(client, interval=0.05) as reporter:
        for _ in range(6):
            reporter.record("py-empty")  # 6 requests x ratio 0.5 = 3 tokens
        wait_for(lambda: client.get_budget("py-empty").tokens >= 3, what="the reported traffic to fill the budget")
    assert client.get_budget("py-empty").tokens == pytest.approx(3.0)
    allowed = client.decide(upstream="py-empty", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.DNS)
    assert allowed.verdict is Verdict.RETRY
    assert allowed.tokens_remaining == pytest.approx(2.0)


def test_report_traffic_is_split_into_batches_of_1024(client: Client) -> None:
    assert client.report_traffic([("py-batch", 1)] * 1500) == 1500


def test_admin_switch(client: Client) -> None:
    assert client.set_retries_enabled("py-switch", False, "test") is True
    decision = client.decide(upstream="py-switch", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.DNS)
    assert decision.deny_reason is DenyReason.RETRIES_DISABLED
    assert client.get_budget("py-switch").retries_enabled is False
    assert client.set_retries_enabled("py-switch", True) is False
    assert "py-switch" in [budget.upstream for budget in client.list_budgets()]


def test_async_client(server: Server) -> None:
    async def main() -> None:
        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aclient:
            decision = await aclient.decide(upstream="py-async", idempotency=Idempotency.NON_IDEMPOTENT,
                                            attempt=1, failure=FailureKind.CONNECTION_RESET)
            assert decision.is_ambiguous and decision.rule == 8
            assert await aclient.report_traffic({"py-async": 3}) == 1
            with pytest.raises(InvalidRequestError):
                await aclient.decide(upstream="py-async", idempotency=Idempotency.SAFE, attempt=1)

    asyncio.run(main())


# ------------------------------------------------------------------ retryd unreachable

def test_fallback_when_retryd_is_unreachable() -> None:
    with Client(CLOSED, timeout=0.2) as client:
        sent = client.decide(upstream="u", idempotency=Idempotency.NON_IDEMPOTENT, attempt=1,
                             failure=FailureKind.RESPONSE_HEADER_TIMEOUT)
        assert sent.fallback and sent.is_ambiguous
        # Refused at once: the fallback did not wait out a timeout first.
        assert "UNAVAILABLE" in sent.explanation
        not_sent = client.decide(upstream="u", idempotency=Idempotency.NON_IDEMPOTENT, attempt=1,
                                 failure=FailureKind.CONNECT)
        assert not_sent.fallback and not_sent.should_retry
        limit = client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=2, failure=FailureKind.CONNECT)
        assert limit.deny_reason is DenyReason.MAX_ATTEMPTS


def test_reconnects_quickly_after_a_restart(tmp_path: Any) -> None:
    from scripted_http import closed_port
    from support import CLIENT_TEST_CONFIG, start_server, stop_server

    port = closed_port()
    config = CLIENT_TEST_CONFIG.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
    first = start_server(config, tmp_path)
    kwargs: dict[str, Any] = dict(upstream="py-restart", idempotency=Idempotency.SAFE, attempt=1,
                                  failure=FailureKind.CONNECT)
    with Client(first.grpc, timeout=1.0) as client:
        assert not client.decide(**kwargs).fallback
        stop_server(first)
        assert client.decide(**kwargs).fallback
        second = start_server(config, tmp_path)
        try:
            wait_for(lambda: not client.decide(**kwargs).fallback, what="a reconnect")
        finally:
            stop_server(second)


def test_fallback_can_be_disabled() -> None:
    with Client(CLOSED, timeout=0.2, fallback=None) as client:
        with pytest.raises(RetrydUnavailableError):
            client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.CONNECT)


def test_async_fallback() -> None:
    async def main() -> None:
        async with AsyncClient(CLOSED, timeout=0.2) as aclient:
            decision = await aclient.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=503)
            assert decision.fallback and decision.should_retry

    asyncio.run(main())


def test_reporter_keeps_counts_while_retryd_is_unreachable() -> None:
    with Client(CLOSED, timeout=0.2) as client:
        reporter = TrafficReporter(client)
        reporter.record("u", 5)
        assert reporter.flush() is False
        assert reporter.pending() == {"u": 5}


@pytest.mark.parametrize(
    "kwargs, verdict, rule",
    [
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, failure=FailureKind.CONNECT), Verdict.RETRY, 9),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, failure=FailureKind.GENERIC_IO, evidence=Evidence.NOT_SENT),
         Verdict.AMBIGUOUS, 8),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, http_status=503), Verdict.AMBIGUOUS, 9),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, http_status=429), Verdict.DENY, 9),
        (dict(idempotency=Idempotency.NON_IDEMPOTENT, failure=FailureKind.DECODE_RESET), Verdict.AMBIGUOUS, 9),
        (dict(idempotency=Idempotency.IDEMPOTENT, failure=FailureKind.RESPONSE_HEADER_TIMEOUT), Verdict.RETRY, 9),
        (dict(idempotency=Idempotency.SAFE, http_status=500), Verdict.DENY, 9),
        (dict(idempotency=Idempotency.SAFE, http_status=404), Verdict.DENY, 9),
        (dict(idempotency=Idempotency.SAFE, http_status=429), Verdict.RETRY, 9),
        (dict(idempotency=Idempotency.SAFE, failure=FailureKind.TLS_CERTIFICATE_INVALID), Verdict.DENY, 7),
        (dict(idempotency=Idempotency.SAFE, failure=FailureKind.CONNECT, body=Body.input_stream()), Verdict.DENY, 3),
        (dict(idempotency=Idempotency.SAFE, failure=FailureKind.CONNECT, attempt=2), Verdict.DENY, 1),
        (dict(idempotency=Idempotency.SAFE, failure=FailureKind.CONNECT, max_attempts=1), Verdict.DENY, 1),
        (dict(idempotency=Idempotency.SAFE, failure=FailureKind.CONNECT, deadline_remaining=0.01), Verdict.DENY, 6),
        (dict(idempotency=Idempotency.SAFE, http_status=429, retry_after="120"), Verdict.DENY, 6),
    ],
)
def test_local_rule(kwargs: dict[str, Any], verdict: Verdict, rule: int) -> None:
    arguments: dict[str, Any] = {"attempt": 1, **kwargs}
    decision = local_decide(policy=LocalPolicy(), **arguments)
    assert (decision.verdict, decision.rule) == (verdict, rule), decision.explanation
    assert decision.fallback


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("7", 7.0),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
        ("Sunday, 06-Nov-94 08:49:37 GMT", 0.0),
        ("Sun Nov  6 08:49:37 1994", 0.0),
        ("Wed, 01 Jan 2098 00:00:00 GMT", None),
        ("Wed Jan  1 00:00:00 2098", None),
        ("soon", "unparseable"),
        ("-1", "unparseable"),
        ("", "unparseable"),
    ],
)
def test_parse_retry_after(value: str, seconds: Any) -> None:
    from retryd.fallback import parse_retry_after

    got = parse_retry_after(value)
    if seconds == "unparseable":
        assert got is None
    elif seconds is None:
        assert got is not None and got > 60 * 365 * 86400  # far future
    else:
        assert got == seconds


def test_local_rule_backoff() -> None:
    policy = LocalPolicy(base=0.1, max_backoff=2.0)
    floor = local_decide(policy=policy, idempotency=Idempotency.SAFE, attempt=1, http_status=503, retry_after="3")
    assert floor.backoff == 3.0
    short = local_decide(policy=policy, idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.CONNECT,
                         deadline_remaining=0.07)
    assert short.should_retry and short.backoff <= 0.02 + 1e-9
    refresh = local_decide(policy=policy, idempotency=Idempotency.SAFE, attempt=1, http_status=401)
    assert refresh.should_retry and refresh.refresh_credentials and refresh.backoff == 0


# ------------------------------------------------------------------ a fake retryd

class FakeDecider(pb_grpc.RetryDeciderServicer):  # type: ignore[misc]
    """Answers DENY; with ``delay``, holds each answer that long (or until ``release`` is set)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.release = threading.Event()
        self.metadata: list[dict[str, str]] = []
        self.requests: list[pb.DecideRequest] = []
        self.time_remaining: list[float] = []

    def Decide(self, request: pb.DecideRequest, context: grpc.ServicerContext) -> pb.DecideResponse:
        self.metadata.append({key: value for key, value in context.invocation_metadata()})
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.delay:
            self.release.wait(self.delay)
        return pb.DecideResponse(verdict=pb.VERDICT_DENY, deny_reason=pb.DENY_REASON_STATUS_NOT_RETRYABLE, rule=9,
                                 effective_evidence=pb.EVIDENCE_RESPONSE_RECEIVED, decision_id="fake")


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeDecider]]:
    decider = FakeDecider()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RetryDeciderServicer_to_server(decider, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", decider
    decider.release.set()
    grpc_server.stop(grace=None)


def test_traceparent_from_the_active_span(fake: tuple[str, FakeDecider]) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    target, decider = fake
    tracer = TracerProvider().get_tracer("test")
    with Client(target, timeout=5, fallback=None) as client:
        client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=404)
        assert "traceparent" not in decider.metadata[-1]
        with tracer.start_as_current_span("outbound call") as span:
            client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=404)
            context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
    assert decider.metadata[-1]["traceparent"] == expected
    assert trace.get_current_span().get_span_context().is_valid is False


def test_slow_retryd_falls_back_within_the_timeout(fake: tuple[str, FakeDecider]) -> None:
    target, decider = fake
    decider.delay = 1.0
    with Client(target, timeout=0.1) as client:
        client.decide(upstream="warm", idempotency=Idempotency.SAFE, attempt=1, http_status=404, timeout=5)
        decision = client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.CONNECT)
        assert decision.fallback and decision.should_retry
        assert "DEADLINE_EXCEEDED" in decision.explanation
    # The call carried the client's 100 ms as its deadline (what retryd saw,
    # rounded up on the wire), so it could not take longer, however busy the machine.
    assert 0 < decider.time_remaining[-1] <= 0.11


def test_caller_deadline_bounds_the_call(fake: tuple[str, FakeDecider]) -> None:
    target, decider = fake
    decider.delay = 1.0
    with Client(target, timeout=5) as client:
        client.decide(upstream="warm", idempotency=Idempotency.SAFE, attempt=1, http_status=404,
                      deadline_remaining=0.5)  # connected: no wait for the first connection below
        decision = client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1,
                                 failure=FailureKind.CONNECT, deadline_remaining=0.1)
        assert decision.fallback and "DEADLINE_EXCEEDED" in decision.explanation
    # The caller's 100 ms, not the client's 5 s, was the call's deadline.
    assert 0 < decider.time_remaining[-1] <= 0.11


def test_request_fields_and_call_deadline(fake: tuple[str, FakeDecider]) -> None:
    target, decider = fake
    with Client(target, timeout=2.0, fallback=None) as client:
        # Connected first: a decision that waited for the first connection
        # tells retryd that much less of the caller's deadline.
        client.decide(upstream="warm", idempotency=Idempotency.SAFE, attempt=1, http_status=404)
        client.decide(upstream="u", operation="PUT /x", idempotency=Idempotency.IDEMPOTENT_WITH_KEY, attempt=2,
                      evidence=Evidence.SENT_NO_RESPONSE, failure=FailureKind.PARTIAL_WRITE, http_status=0,
                      retry_after="3", deadline_remaining=1.5, previous_backoff=timedelta(milliseconds=250),
                      body=Body.multipart(Body.bytes(), Body.publisher_factory(Replayability.REOPENABLE)),
                      first_byte_delivered=True, runtime_draining=True, auth_refresh_attempted=True, max_attempts=4)
    request = decider.requests[-1]
    assert (request.upstream, request.operation, request.attempt, request.max_attempts) == ("u", "PUT /x", 2, 4)
    assert (request.idempotency, request.evidence, request.failure) == (
        pb.IDEMPOTENCY_IDEMPOTENT_WITH_KEY, pb.EVIDENCE_SENT_NO_RESPONSE, pb.FAILURE_KIND_PARTIAL_WRITE)
    assert (request.deadline_remaining.seconds, request.deadline_remaining.nanos) == (1, 500_000_000)
    assert (request.previous_backoff.seconds, request.previous_backoff.nanos) == (0, 250_000_000)
    assert request.retry_after == "3"
    assert request.first_byte_delivered and request.runtime_draining and request.auth_refresh_attempted
    assert request.body.kind == pb.BODY_KIND_MULTIPART
    assert [part.kind for part in request.body.parts] == [pb.BODY_KIND_BYTES, pb.BODY_KIND_PUBLISHER_FACTORY]
    assert request.body.parts[1].declared == pb.REPLAYABILITY_REOPENABLE
    # The call's own deadline is the client timeout, bounded by the caller's deadline.
    assert 0 < decider.time_remaining[-1] <= 1.6  # grpc-timeout is rounded up on the wire
    with Client(target, timeout=2.0, fallback=None) as client:
        client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=404)
    assert not decider.requests[-1].HasField("deadline_remaining")
    assert not decider.requests[-1].HasField("body")
    assert 1.6 < decider.time_remaining[-1] <= 2.1


def test_metadata_is_sent(fake: tuple[str, FakeDecider]) -> None:
    target, decider = fake
    with Client(target, timeout=5, metadata=[("authorization", "Bearer t")]) as client:
        client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=404)
    assert decider.metadata[-1]["authorization"] == "Bearer t"


def test_reporter_thread_is_stopped_by_close() -> None:
    sent: list[dict[str, int]] = []

    class Recorder:
        def report_batch(self, traffic: Any, *, report_id: str = "") -> ReportResult:
            sent.append({entry.upstream: entry.requests for entry in traffic})  # Traffic entries
            return ReportResult(len(traffic))

    reporter = TrafficReporter(Recorder(), interval=60).start()
    reporter.record("a")
    reporter.record("a", 2)
    reporter.record("b")
    reporter.close()
    assert sent == [{"a": 3, "b": 1}]
    assert not any(thread.name == "retryd-traffic-reporter" for thread in threading.enumerate())
