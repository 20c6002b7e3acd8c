"""Issue 33 on the client: latency buckets, histograms in reports, the hedging
table, and hedged httpx calls against a real upstream on loopback whose first
request is held (a controllable latency tail) and a real retryd."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from typing import Any

import pytest

from scripted_http import ScriptedServer, respond
from support import REPO, Server, handled, hedges_won
from retryd import AsyncClient, Client, Idempotency
from retryd.hedging import Hedging, HedgingTable, LocalHedging, hedging_from_pb
from retryd.httpx import ATTEMPTS_EXTENSION, HEDGES_EXTENSION, arequest_with_retries
from retryd.latency import MAX_BUCKET, bucket, bucket_start
from retryd.reporter import Traffic

import httpx

CLOSED_RETRYD = "127.0.0.1:1"

#: A hedge reaches the upstream at least this share of the served delay after
#: the first attempt did: the two arrivals differ by the delay, retryd's
#: answer and each request's own connect, which a busy machine can delay for
#: the first one; sent at once, the gap would be near 0.
HALF = 0.5

# The brief's vectors, with 1000 us in bucket 63: e = 9, m = 1000 >> 6 = 15,
# 8 * (9 - 2) + 7 = 63, as the proto's formula and its "bucket b starts at
# (8 + b % 8) << (b / 8 - 1)" agree (bucket 63 is 960..1023 us).
VECTORS = [(0, 0), (15, 15), (16, 16), (17, 16), (18, 17), (31, 23), (32, 24), (1000, 63),
           (3_600_000_000, 237), (7_200_000_000, 237)]


def test_bucket_vectors() -> None:
    for micros, expected in VECTORS:
        assert bucket(micros) == expected, micros


def test_bucket_conformance_vectors() -> None:
    """conformance/latency_buckets.json, which retryd's own bucket function is checked against."""
    shared = json.loads((REPO / "conformance" / "latency_buckets.json").read_text())
    assert shared["max_bucket"] == MAX_BUCKET
    for micros, expected in shared["pairs"]:
        assert bucket(micros) == expected, micros
    for index, start in shared["starts"]:
        assert bucket_start(index) == start and bucket(start) == index, index


def test_every_bucket_starts_where_the_formula_says() -> None:
    for index in range(MAX_BUCKET + 1):
        start = bucket_start(index)
        assert bucket(start) == index
        if start > 0:
            assert bucket(start - 1) == index - 1


# ------------------------------------------------------------------ reporter

class _Recorder:
    """A report sink that keeps what it was sent (the tests of the batch's shape)."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, tuple[Traffic, ...]]] = []

    def report_batch(self, traffic: Any, *, report_id: str = "") -> Any:
        from retryd import ReportResult

        self.batches.append((report_id, tuple(traffic)))
        return ReportResult(accepted=len(traffic))


def test_reporter_sends_latency_histograms_beside_the_counts() -> None:
    from retryd import TrafficReporter

    sink = _Recorder()
    reporter = TrafficReporter(sink, interval=60)
    reporter.record("a")
    reporter.record_outcome("a", True)
    reporter.record_latency("a", True, 0.001)  # 1000 us: bucket 63
    reporter.record_latency("a", True, 0.001)
    reporter.record_latency("a", False, 0.000_017)  # bucket 16
    reporter.flush()
    [(_, entries)] = sink.batches
    assert entries == (Traffic("a", 1, 1, 0, 0, 0, ((63, 2),), ((16, 1),)),)


def test_report_with_latencies_is_accepted_by_retryd(server: Server) -> None:
    with Client(server.grpc, timeout=5, fallback=None) as client:
        entry = Traffic("py-latency", 3, 3, 0, 0, 0, ((63, 2), (80, 1)), ())
        result = client.report_batch([entry], report_id="py-latency-1")
        assert result.accepted == 1
        # Re-sent with the same id and entries: applied once.
        again = client.report_batch([entry], report_id="py-latency-1")
        assert (again.accepted, again.already_applied) == (0, 1)


def test_resent_batch_carries_the_same_histograms() -> None:
    from retryd import RetrydUnavailableError, TrafficReporter

    class Flaky(_Recorder):
        def report_batch(self, traffic: Any, *, report_id: str = "") -> Any:
            result = super().report_batch(traffic, report_id=report_id)
            if len(self.batches) == 1:
                raise RetrydUnavailableError("down", None)
            return result

    sink = Flaky()
    reporter = TrafficReporter(sink, interval=60)
    reporter.record_latency("a", True, 0.002)
    assert reporter.flush() is False
    reporter.record_latency("a", True, 0.002)  # waits: not added to the held batch
    assert reporter.flush() is True
    first, second, third = sink.batches
    assert first == second
    assert first[1][0].latency_successes == ((bucket(2000), 1),)
    assert third[1][0].latency_successes == ((bucket(2000), 1),)


def test_histograms_are_bounded_by_the_bucket_count() -> None:
    from retryd import TrafficReporter

    reporter = TrafficReporter(_Recorder(), interval=60)
    for micros in range(0, 4_000_000_000, 1_000_003):
        reporter.record_latency("a", True, micros / 1e6)
    assert len(reporter.pending_traffic()["a"].latency_successes) <= MAX_BUCKET + 1


# ------------------------------------------------------------------ hedging table

def test_table_keeps_an_entry_three_intervals_then_drops_it() -> None:
    now = [100.0]
    table = HedgingTable(keep_for=3.0, clock=lambda: now[0])
    served = Hedging("a", True, 0.05, 1, frozenset({int(Idempotency.SAFE)}))
    table.update([served])
    now[0] += 3.0
    assert table.current("a") == served
    now[0] += 0.5
    assert table.current("a") is None
    table.update([])
    assert table.snapshot() == {}


def test_table_never_hedges_non_idempotent_calls() -> None:
    from retryd.v1 import retryd_pb2 as pb

    message = pb.Hedging(upstream="a", enabled=True, max_hedges=2,
                         idempotency=[pb.IDEMPOTENCY_SAFE, pb.IDEMPOTENCY_NON_IDEMPOTENT])
    message.delay.FromMilliseconds(40)
    served = hedging_from_pb(message)
    assert served.delay == pytest.approx(0.04)
    table = HedgingTable(keep_for=3.0)
    table.update([served])
    assert table.plan("a", Idempotency.SAFE) is not None
    assert table.plan("a", Idempotency.NON_IDEMPOTENT) is None
    assert table.plan("a", Idempotency.IDEMPOTENT) is None  # not in the policy's list
    table.update([Hedging("a", False, 0.0, 2, frozenset({int(Idempotency.SAFE)}))])
    assert table.plan("a", Idempotency.SAFE) is None


# ------------------------------------------------------------------ hedged calls

class HeldFirst:
    """An upstream whose first request is held until the client goes away (at most
    ``hold`` seconds) and whose later requests are answered at once; it notes
    whether the held request's connection was closed by the client (cancelled)."""

    def __init__(self, hold: float = 5.0) -> None:
        self.hold = hold
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.count = 0
        #: When each request arrived (monotonic seconds).
        self.arrivals: list[float] = []
        self.server = ScriptedServer(self._action)

    def _action(self, conn: socket.socket, request: bytes) -> None:
        with self.lock:
            self.count += 1
            self.arrivals.append(time.monotonic())
            first = self.count == 1
        if first:
            ready, _, _ = select.select([conn], [], [], self.hold)
            if ready and conn.recv(1) == b"":
                self.cancelled.set()
                return
        respond(200, b"first" if first else b"hedge")(conn, request)

    def __enter__(self) -> HeldFirst:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.close()


async def _unreachable(client: AsyncClient) -> None:
    """A report that fails: the client now knows retryd is unreachable."""
    from retryd import RetrydError

    with pytest.raises(RetrydError):
        await client.report_batch([("py-hedge", 1)], report_id="x")


def test_local_hedging_sends_a_copy_and_cancels_the_slow_first_attempt() -> None:
    async def main() -> None:
        local = LocalHedging(delay=0.1, max_extra_load=1.0)
        client = AsyncClient(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local)
        await _unreachable(client)
        with HeldFirst() as upstream:
            async with httpx.AsyncClient() as http:
                started = time.monotonic()
                response = await arequest_with_retries(http, client, "GET", upstream.server.url + "/x",
                                                       upstream="py-hedge", idempotency=Idempotency.SAFE,
                                                       deadline=5)
                took = time.monotonic() - started
            assert response.status_code == 200 and response.content == b"hedge"
            assert response.extensions[ATTEMPTS_EXTENSION] == 2
            [decision] = response.extensions[HEDGES_EXTENSION]
            assert decision.should_retry and decision.fallback
            assert upstream.cancelled.wait(2), "the losing first attempt was not cancelled"
            assert took < 2.5  # the hold is 5 s
        traffic = client.reporter.pending_traffic()["py-hedge"]
        # One first attempt, no failure: the cancelled first attempt is a
        # success latency (its elapsed time, about the delay), the hedge a
        # retry-side success, never a first attempt.
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        [(index, count)] = traffic.latency_successes
        assert count == 1 and bucket_start(index) >= 87_000  # at least about the 0.1 s delay
        assert traffic.latency_failures == ()
        await client.close()

    asyncio.run(main())


def test_without_local_hedging_an_unreachable_retryd_means_no_hedge() -> None:
    async def main() -> None:
        client = AsyncClient(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5)
        await _unreachable(client)
        with HeldFirst(hold=0.4) as upstream:
            async with httpx.AsyncClient() as http:
                response = await arequest_with_retries(http, client, "GET", upstream.server.url,
                                                       upstream="py-hedge", idempotency=Idempotency.SAFE)
            assert response.content == b"first"
            assert upstream.count == 1
        await client.close()

    asyncio.run(main())


def test_fast_call_never_asks_retryd(server: Server) -> None:
    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5)
        client.hedging.update([Hedging("py-hedge-fast", True, 0.5, 1, frozenset({int(Idempotency.SAFE)}))])
        before = handled(server)
        with ScriptedServer(respond(200, b"ok")) as upstream:
            async with httpx.AsyncClient() as http:
                for _ in range(5):
                    response = await arequest_with_retries(http, client, "GET", upstream.url,
                                                           upstream="py-hedge-fast",
                                                           idempotency=Idempotency.SAFE)
                    assert response.extensions[HEDGES_EXTENSION] == ()
            assert len(upstream.requests) == 5
        assert handled(server) == before
        traffic = client.reporter.pending_traffic()["py-hedge-fast"]
        assert sum(n for _, n in traffic.latency_successes) == 5
        await client.close()

    asyncio.run(main())


def test_non_idempotent_call_is_never_hedged(server: Server) -> None:
    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5)
        every = frozenset(int(level) for level in Idempotency if level)
        client.hedging.update([Hedging("py-hedge-post", True, 0.05, 2, every)])
        with HeldFirst(hold=0.4) as upstream:
            async with httpx.AsyncClient() as http:
                response = await arequest_with_retries(http, client, "POST", upstream.server.url,
                                                       upstream="py-hedge-post",
                                                       idempotency=Idempotency.NON_IDEMPOTENT, content=b"x")
            assert response.content == b"first" and upstream.count == 1
        await client.close()

    asyncio.run(main())


# ------------------------------------------------------------------ hedged gRPC calls

class HeldFirstGrpc:
    """A gRPC upstream whose first call is held until the client cancels it (at
    most ``hold`` seconds) and whose later calls are answered at once."""

    def __init__(self, hold: float = 5.0) -> None:
        from grpc_servers import scripted

        self.hold = hold
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.count = 0
        self.arrivals: list[float] = []
        self.server = scripted(self._action)

    def _action(self, request: bytes, context: Any) -> bytes:
        with self.lock:
            self.count += 1
            self.arrivals.append(time.monotonic())
            first = self.count == 1
        if not first:
            return b"hedge"
        ended = threading.Event()
        context.add_callback(ended.set)  # runs when the call ends, a cancel included
        if ended.wait(self.hold) and not context.is_active():
            self.cancelled.set()
        return b"first"

    def __enter__(self) -> HeldFirstGrpc:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.close()


def test_grpc_local_hedging_cancels_the_slow_first_call() -> None:
    import grpc.aio

    from grpc_servers import METHOD
    from retryd.grpc import AsyncRetryInterceptor

    async def main() -> None:
        local = LocalHedging(delay=0.1, max_extra_load=1.0)
        client = AsyncClient(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local)
        await _unreachable(client)
        with HeldFirstGrpc() as upstream:
            interceptor = AsyncRetryInterceptor(client, upstream="py-hedge-grpc", idempotency=Idempotency.SAFE)
            async with grpc.aio.insecure_channel(upstream.server.target, interceptors=[interceptor]) as channel:
                started = time.monotonic()
                answer = await channel.unary_unary(METHOD)(b"x", timeout=5)
                took = time.monotonic() - started
            assert answer == b"hedge" and upstream.count == 2
            assert upstream.cancelled.wait(2), "the losing first call was not cancelled"
            assert took < 2.5
        traffic = client.reporter.pending_traffic()["py-hedge-grpc"]
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        [(index, count)] = traffic.latency_successes
        assert count == 1 and bucket_start(index) >= 87_000
        await client.close()

    asyncio.run(main())


def test_grpc_hedge_denied_hedging_off_sends_no_copy(server: Server) -> None:
    """The table says hedge (an entry retryd no longer serves), retryd has no
    policy for the upstream: the hedge is denied HEDGING_OFF and no copy goes."""
    import grpc.aio

    from grpc_servers import METHOD
    from retryd import DenyReason
    from retryd.grpc import AsyncRetryInterceptor

    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5)
        client.hedging.update([Hedging("py-hedge-off", True, 0.05, 1, frozenset({int(Idempotency.SAFE)}))])
        with HeldFirstGrpc(hold=0.5) as upstream:
            interceptor = AsyncRetryInterceptor(client, upstream="py-hedge-off", idempotency=Idempotency.SAFE)
            async with grpc.aio.insecure_channel(upstream.server.target, interceptors=[interceptor]) as channel:
                call = channel.unary_unary(METHOD)(b"x", timeout=5)
                answer = await call
            assert answer == b"first" and upstream.count == 1
        await client.close()

    asyncio.run(main())
    # The decision itself, through the same client call the adapters make.
    async def ask() -> None:
        client = AsyncClient(server.grpc, timeout=5)
        decision = await client.decide_hedge(upstream="py-hedge-off", idempotency=Idempotency.SAFE, hedge=1,
                                             attempt=1)
        assert decision.deny_reason == DenyReason.HEDGING_OFF, decision
        await client.close()

    asyncio.run(ask())


# ------------------------------------------------------------------ against retryd's hedging

async def _feed(client: AsyncClient, upstream: str, requests: int = 200) -> None:
    """Reports, through the client's own reporter, first attempts with a tail:
    90% at 10 ms, 10% at 100 ms, so retryd's p95 (its hedge delay) is about
    100 ms; the report's answer fills the client's hedging table."""
    reporter = client.reporter
    reporter.record(upstream, requests)
    reporter.record_outcome(upstream, True, count=requests)
    for n in range(requests):
        reporter.record_latency(upstream, True, 0.100 if n % 10 == 0 else 0.010)
    assert await reporter.flush()


def test_served_delay_hedges_the_slow_first_attempt(server: Server) -> None:
    from retryd import Verdict

    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5, report_interval=60)
        await _feed(client, "py-hedged")
        served = client.hedging.current("py-hedged")
        assert served is not None and served.enabled, served
        assert 0.0875 <= served.delay <= 0.1125, served
        # GetBudget shows the same hedging.
        assert (await client.get_budget("py-hedged")).hedging == served
        before = client.reporter.pending_traffic().get("py-hedged")
        assert before is None
        with HeldFirst() as upstream:
            async with httpx.AsyncClient() as http:
                started = time.monotonic()
                response = await arequest_with_retries(http, client, "GET", upstream.server.url,
                                                       upstream="py-hedged", idempotency=Idempotency.SAFE,
                                                       deadline=5)
                took = time.monotonic() - started
            assert response.content == b"hedge" and upstream.count == 2
            [decision] = response.extensions[HEDGES_EXTENSION]
            assert decision.verdict == Verdict.RETRY and not decision.fallback, decision
            assert upstream.cancelled.wait(2), "the losing first attempt was not cancelled"
            # The hedge reached the upstream after the served delay, not before it.
            first, hedge = upstream.arrivals
            assert hedge - first >= served.delay * HALF, (hedge - first, served.delay)
            assert took < 2.5
        traffic = client.reporter.pending_traffic()["py-hedged"]
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        [(index, count)] = traffic.latency_successes
        assert count == 1 and bucket_start(index) >= 0.8 * served.delay * 1e6
        assert traffic.hedges_won == 1  # the hedge answered: counted once, by default
        # retryd accepts the report of it, and counts the win.
        assert await client.reporter.flush()
        assert hedges_won(server, "py-hedged") == 1
        await client.close()

    asyncio.run(main())


def test_served_delay_hedges_a_grpc_call(server: Server) -> None:
    import grpc.aio

    from grpc_servers import METHOD
    from retryd.grpc import AsyncRetryInterceptor

    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5, report_interval=60)
        await _feed(client, "py-hedged-grpc")
        assert client.hedging.plan("py-hedged-grpc", Idempotency.SAFE) is not None
        with HeldFirstGrpc() as upstream:
            interceptor = AsyncRetryInterceptor(client, upstream="py-hedged-grpc", idempotency=Idempotency.SAFE)
            async with grpc.aio.insecure_channel(upstream.server.target, interceptors=[interceptor]) as channel:
                answer = await channel.unary_unary(METHOD)(b"x", timeout=5)
            assert answer == b"hedge" and upstream.count == 2
            assert upstream.cancelled.wait(2), "the losing first call was not cancelled"
            first, hedge = upstream.arrivals
            served = client.hedging.current("py-hedged-grpc")
            assert served is not None and hedge - first >= served.delay * HALF, (hedge - first, served)
        # Two calls reached the server: retryd granted the hedge (a denied one sends none).
        traffic = client.reporter.pending_traffic()["py-hedged-grpc"]
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        assert traffic.hedges_won == 1
        assert await client.reporter.flush()
        assert hedges_won(server, "py-hedged-grpc") == 1
        await client.close()

    asyncio.run(main())


def test_hedge_beyond_the_cap_sends_no_copy(server: Server) -> None:
    from retryd import DenyReason, Verdict

    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5, report_interval=60)
        await _feed(client, "py-hedge-cap", requests=100)  # 5% of 100: five hedges
        for _ in range(5):
            granted = await client.decide_hedge(upstream="py-hedge-cap", idempotency=Idempotency.SAFE,
                                                hedge=1, attempt=1)
            assert granted.verdict == Verdict.RETRY, granted
        with HeldFirst(hold=0.4) as upstream:
            async with httpx.AsyncClient() as http:
                response = await arequest_with_retries(http, client, "GET", upstream.server.url,
                                                       upstream="py-hedge-cap", idempotency=Idempotency.SAFE)
            assert response.content == b"first" and upstream.count == 1
            [decision] = response.extensions[HEDGES_EXTENSION]
            assert decision.deny_reason == DenyReason.HEDGE_CAP, decision
        await client.close()

    asyncio.run(main())


def test_shadow_hedge_answer_is_not_acted_on(server: Server) -> None:
    from retryd import DenyReason, Verdict

    async def main() -> None:
        client = AsyncClient(server.grpc, timeout=5, report_interval=60)
        await _feed(client, "py-hedge-shadow")
        decision = await client.decide_hedge(upstream="py-hedge-shadow", idempotency=Idempotency.SAFE,
                                             hedge=1, attempt=1)
        # retryd would have hedged; without local hedging the client does not.
        assert decision.shadow and not decision.fallback
        assert decision.retryd_decision is not None and decision.retryd_decision.verdict == Verdict.RETRY
        assert decision.verdict == Verdict.DENY and decision.deny_reason == DenyReason.HEDGING_OFF
        await client.close()

    asyncio.run(main())
