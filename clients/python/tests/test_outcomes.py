"""Issue 32: reports carry outcomes. The adapters, against a real retryd and
real downstream servers, count how every attempt ended; the counts that
reach the wire are captured by an in-process ReportTraffic server.

The rule: an attempt is a failure when the adapter asked (or would ask)
retryd whether to retry it; every other ending is a success (a 404
included); an attempt the caller cancelled is neither."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest

from grpc_servers import abort, ok, scripted
from scripted_http import ScriptedServer, closed_port, hang, respond
from support import Server
from retryd import AmbiguousExecutionError, AsyncClient, Client, Idempotency, Traffic, TrafficReporter
from retryd.grpc import RetryInterceptor
from retryd.httpx import arequest_with_retries, request_with_retries
from retryd.v1 import retryd_pb2 as pb
from retryd.v1 import retryd_pb2_grpc as pb_grpc


class CapturedReports(pb_grpc.RetryDeciderServicer):  # type: ignore[misc]
    """Records every ReportTraffic as sent; fails the first ``failures`` of them (UNAVAILABLE)."""

    def __init__(self) -> None:
        self.failures = 0
        self.reports: list[tuple[str, list[Traffic]]] = []

    def ReportTraffic(self, request: pb.ReportTrafficRequest, context: grpc.ServicerContext) -> pb.ReportTrafficResponse:
        self.reports.append((request.report_id, [
            Traffic(t.upstream, t.requests, t.successes, t.failures, t.retry_successes, t.retry_failures)
            for t in request.traffic]))
        if len(self.reports) <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected")
        return pb.ReportTrafficResponse(accepted=len(request.traffic))

    def sent(self) -> dict[str, Traffic]:
        """The entries of the reports delivered, per upstream (each report counted once)."""
        delivered = {report_id: entries for report_id, entries in self.reports}
        total: dict[str, list[int]] = {}
        for entries in delivered.values():
            for entry in entries:
                row = total.setdefault(entry.upstream, [0] * 5)
                for i, n in enumerate(entry[1:6]):  # the counts, not the histograms
                    row[i] += n
        return {upstream: Traffic(upstream, *row) for upstream, row in total.items()}


@pytest.fixture
def capture() -> Iterator[tuple[CapturedReports, TrafficReporter]]:
    servicer = CapturedReports()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RetryDeciderServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    with Client(f"127.0.0.1:{port}", timeout=2, fallback=None) as client:
        yield servicer, TrafficReporter(client)
    grpc_server.stop(grace=None)


@pytest.fixture
def retryd(server: Server) -> Iterator[Client]:
    with Client(server.grpc, timeout=5, fallback=None) as client:
        yield client


def counts(traffic: dict[str, Traffic]) -> dict[str, Traffic]:
    """The outcome counts alone: the first attempts' latency histograms are tests/test_hedging.py's."""
    return {upstream: entry._replace(latency_successes=(), latency_failures=())
            for upstream, entry in traffic.items()}


def no_sleep(_: float) -> None:
    pass


def test_http_outcomes_reach_the_report(retryd: Client, capture: tuple[CapturedReports, TrafficReporter]) -> None:
    servicer, reporter = capture
    with httpx.Client() as http:
        def call(url: str, upstream: str, idempotency: Idempotency = Idempotency.SAFE) -> None:
            request_with_retries(http, retryd, "GET", url, upstream=upstream, idempotency=idempotency,
                                 reporter=reporter, sleep=no_sleep)

        with ScriptedServer(respond(200)) as origin:
            call(origin.url, "py-out-ok")
        with ScriptedServer(respond(503), respond(200)) as origin:
            call(origin.url, "py-out-retried")
            assert len(origin.requests) == 2
        with ScriptedServer(respond(404)) as origin:
            call(origin.url, "py-out-404")
        with ScriptedServer(respond(500)) as origin:  # asked about, denied (transient_500 = false)
            call(origin.url, "py-out-500")
            assert len(origin.requests) == 1
        with pytest.raises(httpx.ConnectError):  # not sent, retried up to max_attempts = 3
            call(f"http://127.0.0.1:{closed_port()}/", "py-out-refused", Idempotency.NON_IDEMPOTENT)
    assert reporter.flush() is True
    assert servicer.sent() == {
        "py-out-ok": Traffic("py-out-ok", 1, successes=1),
        "py-out-retried": Traffic("py-out-retried", 1, failures=1, retry_successes=1),
        "py-out-404": Traffic("py-out-404", 1, successes=1),
        "py-out-500": Traffic("py-out-500", 1, failures=1),
        "py-out-refused": Traffic("py-out-refused", 1, failures=1, retry_failures=2),
    }


def test_a_resent_report_carries_the_same_outcomes(
    retryd: Client, capture: tuple[CapturedReports, TrafficReporter],
) -> None:
    servicer, reporter = capture
    servicer.failures = 1
    with ScriptedServer(respond(503), respond(200)) as origin, httpx.Client() as http:
        request_with_retries(http, retryd, "GET", origin.url, upstream="py-out-resend",
                             idempotency=Idempotency.SAFE, reporter=reporter, sleep=no_sleep)
    assert reporter.flush() is False  # UNAVAILABLE: kept
    with ScriptedServer(respond(200)) as origin, httpx.Client() as http:
        request_with_retries(http, retryd, "GET", origin.url, upstream="py-out-resend",
                             idempotency=Idempotency.SAFE, reporter=reporter)
    assert counts(reporter.pending_traffic()) == {
        "py-out-resend": Traffic("py-out-resend", 2, successes=1, failures=1, retry_successes=1)}
    assert reporter.flush() is True
    (first_id, first), (second_id, second), (third_id, third) = servicer.reports
    assert (second_id, second) == (first_id, first)
    assert first == [Traffic("py-out-resend", 1, failures=1, retry_successes=1)]
    assert third_id != first_id and third == [Traffic("py-out-resend", 1, successes=1)]


def test_a_cancelled_attempt_counts_as_neither(server: Server, capture: tuple[CapturedReports, TrafficReporter]) -> None:
    servicer, reporter = capture
    release = threading.Event()

    async def main() -> None:
        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aretryd, httpx.AsyncClient() as http:
            with ScriptedServer(hang(release)) as origin:
                task = asyncio.ensure_future(arequest_with_retries(
                    http, aretryd, "GET", origin.url, upstream="py-out-cancel", idempotency=Idempotency.SAFE,
                    reporter=reporter))
                while not origin.requests:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                release.set()

    asyncio.run(main())
    assert counts(reporter.pending_traffic()) == {"py-out-cancel": Traffic("py-out-cancel", 1)}


def test_a_non_idempotent_failure_not_retried_is_a_failure(
    retryd: Client, capture: tuple[CapturedReports, TrafficReporter],
) -> None:
    _, reporter = capture
    with ScriptedServer(respond(503)) as origin, httpx.Client() as http:
        with pytest.raises(AmbiguousExecutionError):
            request_with_retries(http, retryd, "POST", origin.url, upstream="py-out-charge",
                                 idempotency=Idempotency.NON_IDEMPOTENT, content=b"{}", reporter=reporter)
    assert counts(reporter.pending_traffic()) == {"py-out-charge": Traffic("py-out-charge", 1, failures=1)}


def test_grpc_outcomes_reach_the_report(retryd: Client, capture: tuple[CapturedReports, TrafficReporter]) -> None:
    servicer, reporter = capture

    def call(target: str, upstream: str, idempotency: Idempotency = Idempotency.SAFE) -> None:
        interceptor = RetryInterceptor(retryd, upstream=upstream, idempotency=idempotency, reporter=reporter,
                                       sleep=no_sleep)
        with grpc.intercept_channel(grpc.insecure_channel(target), interceptor) as channel:
            channel.unary_unary("/test.Echo/Call")(b"x", timeout=5)

    with scripted(ok()) as upstream:
        call(upstream.target, "py-out-grpc-ok")
    with scripted(abort(grpc.StatusCode.UNAVAILABLE), ok()) as upstream:
        call(upstream.target, "py-out-grpc-retried")
        assert len(upstream.calls) == 2
    with scripted(abort(grpc.StatusCode.NOT_FOUND)) as upstream, pytest.raises(grpc.RpcError):
        call(upstream.target, "py-out-grpc-404")
    with scripted(abort(grpc.StatusCode.INTERNAL)) as upstream, pytest.raises(grpc.RpcError):
        call(upstream.target, "py-out-grpc-internal")  # asked about, denied
    with pytest.raises(grpc.RpcError):
        call(f"127.0.0.1:{closed_port()}", "py-out-grpc-refused", Idempotency.NON_IDEMPOTENT)
    assert reporter.flush() is True
    assert servicer.sent() == {
        "py-out-grpc-ok": Traffic("py-out-grpc-ok", 1, successes=1),
        "py-out-grpc-retried": Traffic("py-out-grpc-retried", 1, failures=1, retry_successes=1),
        "py-out-grpc-404": Traffic("py-out-grpc-404", 1, successes=1),
        "py-out-grpc-internal": Traffic("py-out-grpc-internal", 1, failures=1),
        "py-out-grpc-refused": Traffic("py-out-grpc-refused", 1, failures=1, retry_failures=2),
    }


def test_the_client_reporter_counts_outcomes_by_default_and_retryd_accepts_them(server: Server) -> None:
    with ScriptedServer(respond(503), respond(200)) as origin, httpx.Client() as http:
        with Client(server.grpc, timeout=5, fallback=None, report_interval=60) as retryd:
            request_with_retries(http, retryd, "GET", origin.url, upstream="py-out-default",
                                 idempotency=Idempotency.SAFE, sleep=no_sleep)
            assert counts(retryd.reporter.pending_traffic()) == {
                "py-out-default": Traffic("py-out-default", 1, failures=1, retry_successes=1)}
            assert retryd.reporter.flush() is True
            assert retryd.report_batch([Traffic("py-out-direct", 2, 1, 1, 0, 0), ("py-out-pair", 1)]).accepted == 2


def test_record_outcome_without_the_adapters(capture: tuple[CapturedReports, TrafficReporter]) -> None:
    servicer, reporter = capture
    reporter.record("a", 3)
    reporter.record_outcome("a", True)
    reporter.record_outcome("a", False, count=2)
    reporter.record_outcome("a", True, retry=True)
    reporter.record_outcome("a", False, retry=True, count=4)
    reporter.record_outcome("b", True, retry=True)  # a retry whose first attempt was reported earlier
    assert reporter.pending() == {"a": 3}
    assert reporter.flush() is True
    assert servicer.reports[0][1] == [Traffic("a", 3, 1, 2, 1, 4), Traffic("b", 0, 0, 0, 1, 0)]


def test_outcomes_beyond_max_upstreams_are_dropped_with_their_requests(
    capture: tuple[CapturedReports, TrafficReporter],
) -> None:
    _, base = capture
    reporter = TrafficReporter(base._client, max_upstreams=1)  # type: ignore[attr-defined]
    reporter.record_outcome("a", True)
    reporter.record("b", 2)
    reporter.record_outcome("b", False)
    assert counts(reporter.pending_traffic()) == {"a": Traffic("a", 0, successes=1)}
    assert reporter.dropped_requests == 2
