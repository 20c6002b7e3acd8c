"""Issue 33 on the blocking grpcio interceptor: a ``.future()`` call hedged
against a real gRPC upstream whose first call is held (a controllable
latency tail) and a real retryd; the loser's RPC cancelled (the server sees
it), a fast call asking nothing, a denied hedge sending no copy."""

from __future__ import annotations

import grpc

from grpc_servers import METHOD, scripted
from support import Server, handled, hedges_won
from test_hedging import HALF, HeldFirstGrpc
from retryd import Client, DenyReason, Idempotency, Verdict
from retryd.grpc import RetryInterceptor
from retryd.hedging import Hedging


def _feed(client: Client, upstream: str, requests: int = 200) -> None:
    """As test_hedging's: 90% of first attempts at 10 ms, 10% at 100 ms (a p95 of about 100 ms)."""
    reporter = client.reporter
    reporter.record(upstream, requests)
    reporter.record_outcome(upstream, True, count=requests)
    for n in range(requests):
        reporter.record_latency(upstream, True, 0.100 if n % 10 == 0 else 0.010)
    assert reporter.flush()


def _channel(client: Client, target: str, upstream: str) -> grpc.Channel:
    interceptor = RetryInterceptor(client, upstream=upstream, idempotency=Idempotency.SAFE)
    return grpc.intercept_channel(grpc.insecure_channel(target), interceptor)


def test_served_delay_hedges_a_future_call_and_cancels_the_loser(server: Server) -> None:
    with Client(server.grpc, timeout=5, report_interval=60) as client:
        _feed(client, "py-hedged-sync-grpc")
        served = client.hedging.current("py-hedged-sync-grpc")
        assert served is not None and served.enabled, served
        before = handled(server)
        with HeldFirstGrpc() as upstream:
            channel = _channel(client, upstream.server.target, "py-hedged-sync-grpc")
            future = channel.unary_unary(METHOD).future(b"x", timeout=5)
            assert future.result(timeout=5) == b"hedge" and upstream.count == 2
            assert upstream.cancelled.wait(2), "the losing first call was not cancelled"
            first, hedge = upstream.arrivals
            assert hedge - first >= served.delay * HALF, (hedge - first, served.delay)
            channel.close()
        assert handled(server) - before == 1  # one Decide: the hedge's
        traffic = client.reporter.pending_traffic()["py-hedged-sync-grpc"]
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        assert traffic.hedges_won == 1
        [(_, count)] = traffic.latency_successes  # the cancelled first call's time, as a success
        assert count == 1
        assert client.reporter.flush()
        assert hedges_won(server, "py-hedged-sync-grpc") == 1


def test_fast_future_call_never_asks_retryd(server: Server) -> None:
    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-fast", True, 0.5, 1, frozenset({int(Idempotency.SAFE)}))])
        before = handled(server)
        with scripted(lambda request, context: b"ok") as upstream:
            channel = _channel(client, upstream.target, "py-hedge-sync-fast")
            for _ in range(5):
                assert channel.unary_unary(METHOD).future(b"x", timeout=5).result() == b"ok"
            channel.close()
        assert handled(server) == before
        traffic = client.reporter.pending_traffic()["py-hedge-sync-fast"]
        assert sum(n for _, n in traffic.latency_successes) == 5 and traffic.hedges_won == 0


def test_denied_hedge_sends_no_copy(server: Server) -> None:
    """The table says hedge; retryd has no policy for the upstream: HEDGING_OFF, no copy."""
    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-off", True, 0.05, 1, frozenset({int(Idempotency.SAFE)}))])
        before = handled(server)
        with HeldFirstGrpc(hold=0.5) as upstream:
            channel = _channel(client, upstream.server.target, "py-hedge-sync-off")
            assert channel.unary_unary(METHOD).future(b"x", timeout=5).result() == b"first"
            assert upstream.count == 1
            channel.close()
        assert handled(server) - before == 1  # the hedge was asked for, and denied
        decision = client.decide_hedge(upstream="py-hedge-sync-off", idempotency=Idempotency.SAFE, hedge=1,
                                       attempt=1)
        assert decision.verdict == Verdict.DENY and decision.deny_reason == DenyReason.HEDGING_OFF


def test_a_blocking_call_is_not_hedged(server: Server) -> None:
    """A plain blocking call has ended before the interceptor sees it: nothing to race."""
    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-off", True, 0.05, 1, frozenset({int(Idempotency.SAFE)}))])
        before = handled(server)
        with HeldFirstGrpc(hold=0.3) as upstream:
            channel = _channel(client, upstream.server.target, "py-hedge-sync-off")
            assert channel.unary_unary(METHOD)(b"x", timeout=5) == b"first" and upstream.count == 1
            channel.close()
        assert handled(server) == before
