"""Issue 16: the client keeps every promise its README makes, and the budget
only counts what really happened. Each finding, reproduced against real
sockets and a real retryd (a frozen one is a real process under SIGSTOP)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from scripted_http import ScriptedServer, closed_port, hang, respond, trickle
from support import CLIENT_TEST_CONFIG, FakeClock, Server, handled, start_server, stopped, stop_server, wait_for
from retryd import (
    AsyncClient,
    Client,
    DenyReason,
    FailureKind,
    Idempotency,
    InvalidRequestError,
    RetrydError,
    TrafficReporter,
    Verdict,
)
from retryd.httpx import (
    ATTEMPTS_EXTENSION,
    DECISION_EXTENSION,
    DECISIONS_EXTENSION,
    arequest_with_retries,
    decision_of,
    request_with_retries,
)
from retryd.v1 import retryd_pb2 as pb
from retryd.v1 import retryd_pb2_grpc as pb_grpc

CLOSED_RETRYD = "127.0.0.1:1"


@pytest.fixture
def admin(server: Server) -> Iterator[Client]:
    with Client(server.grpc, timeout=5, fallback=None) as client:
        yield client


# ------------------------------------------------------------------ 1. reporting on by default

def test_adapter_calls_fill_the_budget_without_a_reporter_argument(server: Server, admin: Client) -> None:
    """The README's one-line example, as written, reports its first attempts."""
    with ScriptedServer(respond(503), respond(200)) as origin, httpx.Client() as http:
        with Client(server.grpc, timeout=5, fallback=None, report_interval=60) as retryd:
            for _ in range(4):
                request_with_retries(http, retryd, "GET", origin.url, upstream="py-fill",
                                     idempotency=Idempotency.SAFE, sleep=lambda _: None)
            # A 503 was retried once (the budget had nothing, so it was denied):
            # retries are never counted, only the 4 first attempts.
            assert retryd.reporter.pending() == {"py-fill": 4}
        # close() flushed the client's one reporter: 4 requests x ratio 0.5.
    assert admin.get_budget("py-fill").tokens == pytest.approx(2.0)


def test_async_adapter_reports_by_default_and_close_flushes(server: Server, admin: Client) -> None:
    async def main() -> None:
        async with httpx.AsyncClient() as http:
            with ScriptedServer(respond(200)) as origin:
                aretryd = AsyncClient(server.grpc, timeout=5, fallback=None, report_interval=60)
                for _ in range(6):
                    await arequest_with_retries(http, aretryd, "GET", origin.url, upstream="py-fill-async",
                                                idempotency=Idempotency.SAFE)
                assert aretryd.reporter.pending() == {"py-fill-async": 6}
                await aretryd.close()

    asyncio.run(main())
    assert admin.get_budget("py-fill-async").tokens == pytest.approx(3.0)


def test_reporting_can_be_switched_off(server: Server, admin: Client) -> None:
    with ScriptedServer(respond(200)) as origin, httpx.Client() as http:
        with Client(server.grpc, timeout=5, fallback=None, report_interval=60) as retryd:
            request_with_retries(http, retryd, "GET", origin.url, upstream="py-opt-out",
                                 idempotency=Idempotency.SAFE, reporter=None)
            assert retryd.reporter.pending() == {}
    assert admin.get_budget("py-opt-out").tokens == 0.0


def test_the_client_reporter_sends_on_its_own_interval(server: Server, admin: Client) -> None:
    with Client(server.grpc, timeout=5, fallback=None, report_interval=0.05) as retryd:
        retryd.reporter.record("py-fill", 2)
        wait_for(lambda: retryd.reporter.pending() == {}, what="the reporter thread to send")
    assert not any(t.name == "retryd-traffic-reporter" for t in threading.enumerate())


# ------------------------------------------------------------------ 2. the deadline bounds every attempt

def test_deadline_bounds_an_attempt_against_a_hanging_server(admin: Client) -> None:
    release = threading.Event()
    with ScriptedServer(hang(release)) as origin, httpx.Client() as http:  # httpx's default: 5 s
        started = time.monotonic()
        try:
            with pytest.raises(httpx.ReadTimeout) as raised:
                request_with_retries(http, admin, "GET", origin.url, upstream="py-e2e-hang",
                                     idempotency=Idempotency.SAFE, deadline=1.0)
        finally:
            release.set()
        elapsed = time.monotonic() - started
    assert elapsed >= 1.0, elapsed  # it did wait for the server, until the deadline
    assert_bounded_by(raised.value, 1.0)
    decision = decision_of(raised.value)
    assert decision is not None and decision.deny_reason is DenyReason.DEADLINE


def assert_bounded_by(error: httpx.HTTPError, deadline: float) -> None:
    """The attempt's every wait (connect, write, read, pool) was bounded by the deadline.

    This is the latency promise, read from the timeouts the adapter gave
    httpx rather than from the wall clock, which a busy machine stretches.
    """
    timeouts = error.request.extensions["timeout"]
    assert set(timeouts) == {"connect", "write", "read", "pool"}
    assert all(0 < value <= deadline for value in timeouts.values()), timeouts


def test_async_deadline_bounds_an_attempt_against_a_hanging_server(server: Server) -> None:
    release = threading.Event()

    async def main() -> float:
        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aretryd, httpx.AsyncClient() as http:
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout) as raised:
                await arequest_with_retries(http, aretryd, "GET", origin.url, upstream="py-e2e-hang",
                                            idempotency=Idempotency.SAFE, deadline=1.0)
            decision = decision_of(raised.value)
            assert decision is not None and decision.deny_reason is DenyReason.DEADLINE
            assert_bounded_by(raised.value, 1.0)
            return time.monotonic() - started

    with ScriptedServer(hang(release)) as origin:
        try:
            elapsed = asyncio.run(main())
        finally:
            release.set()
    assert elapsed >= 1.0, elapsed


def test_async_deadline_cuts_a_trickling_server(server: Server) -> None:
    """Each read gets a byte in time, so only a cut of the whole attempt can stop it."""

    async def main(url: str) -> float:
        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aretryd, httpx.AsyncClient() as http:
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout) as raised:
                await arequest_with_retries(http, aretryd, "GET", url, upstream="py-e2e-trickle",
                                            idempotency=Idempotency.SAFE, deadline=1.0, reporter=None)
            # The adapter's own cut of the whole attempt, not one of httpx's
            # per-read timeouts (each read got its byte in time).
            assert "deadline passed during the attempt" in str(raised.value)
            return time.monotonic() - started

    # The server would trickle for 30 s: the call ending at all is the cut.
    with ScriptedServer(trickle(limit=30.0)) as origin:
        elapsed = asyncio.run(main(origin.url))
    assert elapsed >= 1.0, elapsed


def test_remaining_deadline_shrinks_on_each_decision() -> None:
    """What retryd is told on each decision: the time left, never the original deadline."""
    seen: list[float] = []

    class Decider(pb_grpc.RetryDeciderServicer):  # type: ignore[misc]
        def Decide(self, request: pb.DecideRequest, context: grpc.ServicerContext) -> pb.DecideResponse:
            seen.append(request.deadline_remaining.seconds + request.deadline_remaining.nanos / 1e9)
            return pb.DecideResponse(verdict=pb.VERDICT_RETRY, rule=9, decision_id="fake",
                                     backoff={"nanos": 250_000_000})

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RetryDeciderServicer_to_server(Decider(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        with ScriptedServer(respond(503)) as origin, httpx.Client() as http, \
                Client(f"127.0.0.1:{port}", timeout=5, fallback=None) as fake:
            # Connected first: the client's wait for its first connection runs on the real clock.
            fake.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1, http_status=503)
            seen.clear()
            clock = FakeClock()
            response = request_with_retries(http, fake, "GET", origin.url, upstream="u",
                                            idempotency=Idempotency.SAFE, deadline=1.0, reporter=None,
                                            clock=clock, sleep=clock.sleep)
    finally:
        grpc_server.stop(grace=None)
    # On the fake clock only the backoffs take time: 250 ms each, told to
    # retryd to the millisecond, until the fourth one reaches the deadline.
    assert seen == [1.0, 0.75, 0.5, 0.25]
    assert clock.sleeps == [0.25] * 4
    assert response.status_code == 503 and response.extensions[ATTEMPTS_EXTENSION] == 4


# ------------------------------------------------------------------ 3. the decision on every outcome

def test_the_decision_is_on_the_returned_response(admin: Client) -> None:
    with ScriptedServer(respond(503)) as origin, httpx.Client() as http:
        response = request_with_retries(http, admin, "GET", origin.url, upstream="py-drained",
                                        idempotency=Idempotency.SAFE, reporter=None)
    assert response.status_code == 503
    decision = response.extensions[DECISION_EXTENSION]
    assert decision is decision_of(response)
    assert decision.verdict is Verdict.DENY and decision.deny_reason is DenyReason.BUDGET_EXHAUSTED
    assert decision.decision_id
    assert response.extensions[ATTEMPTS_EXTENSION] == 1
    assert response.extensions[DECISIONS_EXTENSION] == (decision,)


def test_a_response_returned_without_asking_says_so(admin: Client) -> None:
    with ScriptedServer(respond(503), respond(200)) as origin, httpx.Client() as http:
        response = request_with_retries(http, admin, "GET", origin.url, upstream="py-e2e-asked",
                                        idempotency=Idempotency.SAFE, reporter=None, sleep=lambda _: None)
    assert response.status_code == 200
    assert decision_of(response) is None  # nobody asked retryd about this 200
    assert [d.verdict for d in response.extensions[DECISIONS_EXTENSION]] == [Verdict.RETRY]
    assert response.extensions[ATTEMPTS_EXTENSION] == 2


def test_the_decision_is_on_a_raised_error(admin: Client) -> None:
    with httpx.Client() as http, pytest.raises(httpx.ConnectError) as raised:
        request_with_retries(http, admin, "GET", f"http://127.0.0.1:{closed_port()}/", upstream="py-drained",
                             idempotency=Idempotency.SAFE, reporter=None)
    decision = decision_of(raised.value)
    assert decision is not None and decision.deny_reason is DenyReason.BUDGET_EXHAUSTED


# ------------------------------------------------------------------ 6. a frozen retryd spends nothing

FROZEN_CONFIG = CLIENT_TEST_CONFIG + """
[upstreams."py-frozen"]
budget = { capacity = 2.0, initial = 2.0, ratio = 0.0, min_per_second = 0.0 }
"""


def test_a_decision_the_client_gave_up_on_spends_nothing(tmp_path: Path) -> None:
    """retryd must check the caller's grpc-timeout before its store call (issue 16, finding 6)."""
    frozen = start_server(FROZEN_CONFIG, tmp_path)
    try:
        with Client(frozen.grpc, timeout=0.2) as client:
            assert client.get_budget("py-frozen").tokens == 2.0  # connected, and the budget is full
            handled_before = handled(frozen)
            frozen.process.send_signal(signal.SIGSTOP)
            # The signal is delivered asynchronously: a request retryd still
            # decided before every thread stopped would rightly spend.
            wait_for(lambda: stopped(frozen.process.pid), what="every retryd thread to stop")
            try:
                for _ in range(3):
                    decision = client.decide(upstream="py-frozen", idempotency=Idempotency.SAFE, attempt=1,
                                             failure=FailureKind.CONNECT)
                    # Ended by the call's own deadline (its 200 ms timeout), not by a wait of any other kind.
                    assert decision.fallback and decision.should_retry
                    assert "DEADLINE_EXCEEDED" in decision.explanation
            finally:
                frozen.process.send_signal(signal.SIGCONT)
            # retryd now reads the three requests, whose grpc-timeout (200 ms) has passed.
            wait_for(lambda: handled(frozen) >= handled_before + 3, timeout=10,
                     what="retryd to account for the three late requests in its metrics")
            assert client.get_budget("py-frozen").tokens == 2.0
    finally:
        stop_server(frozen)


# ------------------------------------------------------------------ 7. the reporter: ids, drops, dedup

class FlakyReports(pb_grpc.RetryDeciderServicer):  # type: ignore[misc]
    """A retryd stand-in whose first ReportTraffic fails after it was read."""

    def __init__(self, fail_with: grpc.StatusCode, failures: int = 1) -> None:
        self.fail_with = fail_with
        self.failures = failures
        self.reports: list[tuple[str, list[tuple[str, int]]]] = []

    def ReportTraffic(self, request: pb.ReportTrafficRequest, context: grpc.ServicerContext) -> pb.ReportTrafficResponse:
        self.reports.append((request.report_id, [(t.upstream, t.requests) for t in request.traffic]))
        if len(self.reports) <= self.failures:
            context.abort(self.fail_with, "injected")
        return pb.ReportTrafficResponse(accepted=len(request.traffic))


@pytest.fixture
def flaky() -> Iterator[tuple[str, FlakyReports]]:
    servicer = FlakyReports(grpc.StatusCode.UNAVAILABLE)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RetryDeciderServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(grace=None)


def test_the_reporter_warns_once_per_outage_and_once_when_delivered_again(
    flaky: tuple[str, FlakyReports], caplog: pytest.LogCaptureFixture,
) -> None:
    target, servicer = flaky
    servicer.failures = 4
    with Client(target, timeout=1) as client, caplog.at_level(logging.WARNING, logger="retryd"):
        reporter = TrafficReporter(client)
        reporter.record("a", 7)
        for _ in range(4):
            assert reporter.flush() is False  # each kept for a re-send
        assert reporter.flush() is True
    lines = [r.getMessage() for r in caplog.records if "traffic reports" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "unreachable" in lines[0] and "report of 7 requests kept for a re-send" in lines[0]
    assert "reachable again" in lines[1] and "4 failed sends" in lines[1], lines[1]
    assert "delivered the held batch of 7 requests" in lines[1]


def test_a_resent_batch_keeps_its_id_and_entries(flaky: tuple[str, FlakyReports]) -> None:
    target, servicer = flaky
    with Client(target, timeout=1) as client:
        reporter = TrafficReporter(client)
        reporter.record("a", 3)
        reporter.record("b")
        assert reporter.flush() is False  # UNAVAILABLE: kept
        reporter.record("a", 10)  # new traffic waits, it does not change the batch
        assert reporter.pending() == {"a": 13, "b": 1}
        assert reporter.flush() is True
    (first_id, first), (second_id, second), (third_id, third) = servicer.reports
    assert first_id and len(first_id) <= 128 and first_id.isascii()
    assert (second_id, second) == (first_id, first) == (first_id, [("a", 3), ("b", 1)])
    assert third_id != first_id and third == [("a", 10)]
    assert reporter.dropped_requests == 0


def test_the_client_reporter_keeps_the_id_across_its_interval(flaky: tuple[str, FlakyReports]) -> None:
    target, servicer = flaky
    with Client(target, timeout=1, report_interval=0.05) as client:
        client.reporter.record("a", 2)
        wait_for(lambda: len(servicer.reports) >= 2, what="the re-send")
    assert servicer.reports[0] == servicer.reports[1]


def test_a_batch_not_delivered_within_the_resend_window_is_dropped(
    flaky: tuple[str, FlakyReports], caplog: pytest.LogCaptureFixture,
) -> None:
    """Re-sent after retryd forgot its id, a batch could be counted twice: dropped instead."""
    target, servicer = flaky
    with Client(target, timeout=1) as client, caplog.at_level(logging.WARNING, logger="retryd"):
        reporter = TrafficReporter(client, resend_window=0.0)
        reporter.record("a", 5)
        assert reporter.flush() is False
        reporter.record("b", 1)
        assert reporter.flush() is True
    assert (reporter.dropped_batches, reporter.dropped_requests) == (1, 5)
    assert [entries for _, entries in servicer.reports] == [[("a", 5)], [("b", 1)]]
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1


def test_async_reporter_keeps_the_id_and_drops_on_permanent_errors(flaky: tuple[str, FlakyReports]) -> None:
    target, servicer = flaky

    async def main() -> None:
        async with AsyncClient(target, timeout=1) as aclient:
            reporter = aclient.reporter
            reporter.record("a", 2)
            assert await reporter.flush() is False
            assert await reporter.flush() is True
            servicer.fail_with, servicer.failures = grpc.StatusCode.PERMISSION_DENIED, 10
            reporter.record("b", 3)
            assert await reporter.flush() is True
            assert (reporter.dropped_batches, reporter.dropped_requests) == (1, 3)

    asyncio.run(main())
    assert servicer.reports[0] == servicer.reports[1]


AUTH_KEY = "py-reporter-test-key-0123456789"
AUTH_CONFIG = f"""
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
shutdown_grace = "1s"

[limits]
max_upstreams = 2

[[auth.principals]]
name = "py-tests"
api_keys_sha256 = ["{hashlib.sha256(AUTH_KEY.encode()).hexdigest()}"]
upstreams = ["py-*"]
admin = true
"""


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(AUTH_CONFIG, tmp_path_factory.mktemp("strict"))
    yield started
    stop_server(started)


@pytest.mark.parametrize(
    "entries, code",
    [
        ([("py-" + "x" * 300, 3)], "INVALID_ARGUMENT"),
        ([("not-mine", 3)], "PERMISSION_DENIED"),
        ([("py-new-1", 1), ("py-new-2", 1), ("py-new-3", 1)], "RESOURCE_EXHAUSTED"),
    ],
)
def test_a_permanent_error_drops_the_batch_with_one_warning(
    strict_server: Server, caplog: pytest.LogCaptureFixture, entries: list[tuple[str, int]], code: str,
) -> None:
    with Client(strict_server.grpc, timeout=1, metadata=[("authorization", f"Bearer {AUTH_KEY}")]) as client:
        with pytest.raises(RetrydError) as raised:
            client.report_batch(entries)  # what retryd answers this report, directly
        error = raised.value
        assert ("INVALID_ARGUMENT" if isinstance(error, InvalidRequestError) else error.code.name) == code  # type: ignore[attr-defined]
        reporter = TrafficReporter(client)
        for upstream, n in entries:
            reporter.record(upstream, n)
        with caplog.at_level(logging.WARNING, logger="retryd"):
            assert reporter.flush() is True  # nothing is kept for a re-send
            assert reporter.flush() is True  # and nothing is sent again
        assert reporter.pending() == {}
        assert reporter.dropped_batches == 1
        assert reporter.dropped_requests == sum(n for _, n in entries)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped" in warnings[0].getMessage()


class HoldingProxy:
    """A TCP proxy that can hold retryd's answers back (a response lost in flight)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.holding = threading.Event()
        self.released = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(4)
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if answers and self.holding.is_set():
                    self.released.wait(30)  # bytes stay in order: HTTP/2 framing survives
                sink.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        self.released.set()
        self._listener.close()
        for sock in self._sockets:  # retryd would wait out its shutdown grace for them
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def test_a_report_resent_after_a_lost_answer_deposits_once(server: Server, admin: Client) -> None:
    """retryd applies a report id at most once (issue 16, finding 7)."""
    proxy = HoldingProxy(server.grpc)
    try:
        with Client(proxy.target, timeout=0.2) as client:
            assert client.get_budget("py-dedup").tokens == 0.0  # connected through the proxy
            reporter = TrafficReporter(client)
            reporter.record("py-dedup", 4)
            proxy.holding.set()
            assert reporter.flush() is False  # no answer within 1 s: kept, same id
            # retryd did apply it: 4 requests x ratio 0.5.
            assert admin.get_budget("py-dedup").tokens == pytest.approx(2.0)
            proxy.released.set()
            assert reporter.flush() is True
            assert reporter.pending() == {}
    finally:
        proxy.close()
    assert admin.get_budget("py-dedup").tokens == pytest.approx(2.0)


def test_report_batch_with_an_id_is_applied_once(admin: Client) -> None:
    """retryd applies a report id at most once, and says so in already_applied."""
    first = admin.report_batch([("py-dedup-direct", 4)], report_id="py-test-report-1")
    again = admin.report_batch([("py-dedup-direct", 4)], report_id="py-test-report-1")
    assert (first.accepted, first.already_applied) == (1, 0)
    assert (again.accepted, again.already_applied) == (0, 1)
    assert admin.get_budget("py-dedup-direct").tokens == pytest.approx(2.0)


def test_report_batch_refuses_more_than_1024_entries(admin: Client) -> None:
    with pytest.raises(ValueError, match="1024"):
        admin.report_batch([("py-batch", 1)] * 1025)


# ------------------------------------------------------------------ one warning per outage

def test_the_fallback_warns_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    with Client(CLOSED_RETRYD, timeout=0.2) as client, caplog.at_level(logging.DEBUG, logger="retryd"):
        for _ in range(5):
            decision = client.decide(upstream="u", idempotency=Idempotency.SAFE, attempt=1,
                                     failure=FailureKind.CONNECT)
            assert decision.fallback
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_new_outage_warns_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One warning when retryd goes, one when it is back (with the count), one for the next outage."""
    port = closed_port()
    config = CLIENT_TEST_CONFIG.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
    kwargs: dict[str, Any] = dict(upstream="py-outage", idempotency=Idempotency.SAFE, attempt=1,
                                  failure=FailureKind.CONNECT)
    local_decisions = 0

    def decided_by_retryd() -> bool:
        nonlocal local_decisions
        fallback = client.decide(**kwargs).fallback
        local_decisions += fallback
        return not fallback

    with Client(f"127.0.0.1:{port}", timeout=1.0) as client, caplog.at_level(logging.INFO, logger="retryd"):
        for _ in range(3):
            assert client.decide(**kwargs).fallback  # outage 1: nothing listens yet
        local_decisions = 3
        running = start_server(config, tmp_path)
        try:
            wait_for(decided_by_retryd, what="the client to reach retryd")
        finally:
            stop_server(running)
        for _ in range(3):
            assert client.decide(**kwargs).fallback  # outage 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    assert "unreachable" in warnings[0] and "unreachable" in warnings[2]
    assert "reachable again" in warnings[1]
    assert f"decisions: {local_decisions} made by the local rule during the outage" in warnings[1], warnings[1]
    assert client.outage.outages == 2
