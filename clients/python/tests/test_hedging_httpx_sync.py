"""Issue 33 on the blocking httpx adapter: ``request_with_retries`` hedges.

Against real upstreams on loopback (one whose first request is held: a
controllable latency tail; keep-alive ones to watch the pool) and a real
retryd: the hedge sent after the served delay, the faster answer winning,
the loser's connection seen closed by the server, the pool losing no
connection over many cancels at every moment of a copy, fast calls never
asking retryd, retryd stopped (a fixed local delay, or no hedge), and the
transports whose copies could not be ended not hedged, and counted. The
httpcore internals the adapter reads are checked first: this file fails
when they change (retryd._thread_copy).
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import wait
from typing import Any

import httpcore
import httpx
import pytest

from scripted_http import KeepAliveServer, ok_keep_alive
from support import Server, handled, hedges_won, wait_for
from test_hedging import CLOSED_RETRYD, HALF, HeldFirst
from test_hedging_sync import _feed
from retryd import Client, DenyReason, Idempotency, RetrydError, Verdict
from retryd import _thread_copy
from retryd.hedging import Hedging, LocalHedging
from retryd.httpx import ATTEMPTS_EXTENSION, HEDGES_EXTENSION, _copy, request_with_retries
from retryd.latency import bucket_start

SAFE = frozenset({int(Idempotency.SAFE)})


def _pool(http: httpx.Client) -> Any:
    return http._transport._pool  # type: ignore[attr-defined]


def _stuck(http: httpx.Client) -> list[Any]:
    """Connections that are neither reusable nor closed: never used again, never reaped."""
    return [c for c in _pool(http).connections if not (c.is_idle() or c.is_closed())]


def _unreachable(client: Client) -> None:
    """A report that fails: the client now knows retryd is unreachable."""
    with pytest.raises(RetrydError):
        client.report_batch([("py-hedge-sync", 1)], report_id="x")


# ------------------------------------------------------------------ the internals relied on

def test_httpcore_internals_are_those_the_adapter_reads() -> None:
    """Fails when httpcore's sync pool no longer has the shape retryd._thread_copy reads:
    then the adapter hedges nothing (counted as "httpcore") until it is re-checked."""
    assert httpcore.__version__ == "1.0.9", "re-check retryd/_thread_copy.py against this httpcore"
    assert _thread_copy.internals_changed() is None
    with KeepAliveServer(ok_keep_alive()) as upstream, httpx.Client() as http:
        pool = _thread_copy.pool_of(http, upstream.url)
        assert pool is _pool(http)
        found: list[Any] = []

        def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                found.append(_thread_copy.socket_of(pool, info["request"]))

        for _ in range(2):  # a new connection, then the pooled one
            assert http.get(upstream.url, extensions={"trace": trace}).content == b"ok"
        assert len(found) == 2 and found[0] is found[1]
        sock = found[0]
        assert isinstance(sock, socket.socket) and sock.getpeername()[1] == upstream.port
        assert upstream.connections == 1


def test_only_a_plain_pool_without_http2_qualifies() -> None:
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as mocked:
        assert _thread_copy.pool_of(mocked, "http://127.0.0.1/") == "transport"
    with httpx.Client(proxy="http://127.0.0.1:1") as proxied:
        assert _thread_copy.pool_of(proxied, "http://127.0.0.1/") == "transport"
    with httpx.Client() as http:
        # http2=True needs the h2 package to build; a pool that may speak HTTP/2 is refused.
        http._transport._pool = httpcore.ConnectionPool(http2=True)  # type: ignore[attr-defined]
        assert _thread_copy.pool_of(http, "http://127.0.0.1/") == "http2"


# ------------------------------------------------------------------ hedged calls

def test_served_delay_hedges_the_slow_first_attempt_and_closes_the_loser(server: Server) -> None:
    with Client(server.grpc, timeout=5, report_interval=60) as client:
        _feed(client, "py-hedged-sync-http")
        served = client.hedging.current("py-hedged-sync-http")
        assert served is not None and served.enabled, served
        before = handled(server)
        with HeldFirst() as upstream, httpx.Client() as http:
            started = time.monotonic()
            response = request_with_retries(http, client, "GET", upstream.server.url,
                                            upstream="py-hedged-sync-http", idempotency=Idempotency.SAFE,
                                            deadline=5)
            took = time.monotonic() - started
            assert response.content == b"hedge" and upstream.count == 2
            assert response.extensions[ATTEMPTS_EXTENSION] == 2
            [decision] = response.extensions[HEDGES_EXTENSION]
            assert decision.verdict == Verdict.RETRY and not decision.fallback, decision
            # The loser was ended, not abandoned: the server saw its connection closed.
            assert upstream.cancelled.wait(2), "the losing first attempt's connection was not closed"
            first, hedge = upstream.arrivals
            assert hedge - first >= served.delay * HALF, (hedge - first, served.delay)
            assert took < 2.5  # the hold is 5 s
            assert _stuck(http) == []
        assert handled(server) - before == 1  # one Decide: the hedge's
        traffic = client.reporter.pending_traffic()["py-hedged-sync-http"]
        # The cancelled first attempt is no outcome, its time a success
        # latency; the hedge a retry-side success, never a first attempt.
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 0, 0)
        assert (traffic.retry_successes, traffic.retry_failures) == (1, 0)
        [(index, count)] = traffic.latency_successes
        assert count == 1 and bucket_start(index) >= 0.8 * served.delay * 1e6
        assert traffic.hedges_won == 1
        assert client.reporter.flush()
        assert hedges_won(server, "py-hedged-sync-http") == 1


def test_fast_calls_never_ask_retryd_and_keep_their_connection(server: Server) -> None:
    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-fast", True, 0.5, 1, SAFE)])
        before = handled(server)
        with KeepAliveServer(ok_keep_alive()) as upstream, httpx.Client() as http:
            for _ in range(20):
                response = request_with_retries(http, client, "GET", upstream.url, upstream="py-hedge-sync-fast",
                                                idempotency=Idempotency.SAFE)
                assert response.content == b"ok" and response.extensions[HEDGES_EXTENSION] == ()
            assert len(upstream.requests) == 20 and upstream.connections == 1  # pooled as before
        assert handled(server) == before
        traffic = client.reporter.pending_traffic()["py-hedge-sync-fast"]
        assert (traffic.requests, traffic.successes) == (20, 20)
        assert sum(n for _, n in traffic.latency_successes) == 20 and traffic.hedges_won == 0


def test_a_denied_hedge_sends_no_copy(server: Server) -> None:
    """The table says hedge; retryd has no policy for the upstream: HEDGING_OFF, no copy."""
    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-off", True, 0.05, 1, SAFE)])
        with HeldFirst(hold=0.4) as upstream, httpx.Client() as http:
            response = request_with_retries(http, client, "GET", upstream.server.url,
                                            upstream="py-hedge-sync-off", idempotency=Idempotency.SAFE)
            assert response.content == b"first" and upstream.count == 1
        [decision] = response.extensions[HEDGES_EXTENSION]
        assert decision.verdict == Verdict.DENY and decision.deny_reason == DenyReason.HEDGING_OFF


def test_non_idempotent_call_is_never_hedged(server: Server) -> None:
    with Client(server.grpc, timeout=5) as client:
        every = frozenset(int(level) for level in Idempotency if level)
        client.hedging.update([Hedging("py-hedge-sync-post", True, 0.05, 2, every)])
        before = handled(server)
        with HeldFirst(hold=0.4) as upstream, httpx.Client() as http:
            response = request_with_retries(http, client, "POST", upstream.server.url, content=b"x",
                                            upstream="py-hedge-sync-post",
                                            idempotency=Idempotency.NON_IDEMPOTENT)
            assert response.content == b"first" and upstream.count == 1
        assert handled(server) == before


def test_retryd_stopped_hedges_at_the_fixed_local_delay() -> None:
    local = LocalHedging(delay=0.1, max_extra_load=1.0)
    with Client(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local) as client:
        _unreachable(client)
        with HeldFirst() as upstream, httpx.Client() as http:
            started = time.monotonic()
            response = request_with_retries(http, client, "GET", upstream.server.url, upstream="py-hedge-sync",
                                            idempotency=Idempotency.SAFE, deadline=5)
            took = time.monotonic() - started
            assert response.content == b"hedge" and response.extensions[ATTEMPTS_EXTENSION] == 2
            [decision] = response.extensions[HEDGES_EXTENSION]
            assert decision.should_retry and decision.fallback
            assert upstream.cancelled.wait(2), "the losing first attempt's connection was not closed"
            first, hedge = upstream.arrivals
            assert hedge - first >= 0.1 * HALF and took < 2.5
        traffic = client.reporter.pending_traffic()["py-hedge-sync"]
        assert (traffic.requests, traffic.successes, traffic.retry_successes, traffic.hedges_won) == (1, 0, 1, 1)


def test_retryd_stopped_without_local_hedging_means_no_hedge() -> None:
    with Client(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5) as client:
        _unreachable(client)
        with HeldFirst(hold=0.4) as upstream, httpx.Client() as http:
            response = request_with_retries(http, client, "GET", upstream.server.url, upstream="py-hedge-sync",
                                            idempotency=Idempotency.SAFE)
            assert response.content == b"first" and upstream.count == 1
            assert response.extensions[HEDGES_EXTENSION] == ()


def test_a_transport_whose_copies_cannot_be_ended_is_not_hedged_and_counted(server: Server) -> None:
    calls: list[float] = []

    def slow(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        time.sleep(0.2)  # past the 50 ms delay
        return httpx.Response(200, content=b"slow")

    with Client(server.grpc, timeout=5) as client:
        client.hedging.update([Hedging("py-hedge-sync-mock", True, 0.05, 1, SAFE)])
        before = handled(server)
        with httpx.Client(transport=httpx.MockTransport(slow)) as http:
            for _ in range(2):
                response = request_with_retries(http, client, "GET", "http://upstream.test/",
                                                upstream="py-hedge-sync-mock", idempotency=Idempotency.SAFE)
                assert response.content == b"slow"
        assert len(calls) == 2 and handled(server) == before
        assert client.hedging.not_hedged() == {"transport": 2}


# ------------------------------------------------------------------ the pool survives every cancel

def _copy_cancelled_at(http: httpx.Client, url: str, moment: int) -> list[str]:
    """Sends one copy on a worker thread and cancels it (from that thread) right after
    its ``moment``-th trace event; returns the events it saw."""
    events: list[str] = []
    request = http.build_request("GET", url)
    holder: list[_thread_copy.ThreadCopyGate] = []

    def trace(event: str, info: dict[str, Any]) -> None:
        events.append(event)
        if len(events) == moment + 1:
            holder[0].cancel()

    request.extensions = {**request.extensions, "trace": trace}
    gate = _thread_copy.ThreadCopyGate(request, _pool(http))
    holder.append(gate)
    if moment < 0:
        gate.cancel()  # before the pool
    future = _thread_copy.WORKERS.submit(lambda: _copy(http, request, {}, frozenset()))
    wait([future], timeout=10)
    _close(future)
    return events


def _close(future: Any) -> None:
    """Closes what an ended copy left open (a response it read in full before its cancel)."""
    assert future.done()
    response = future.result().response if future.exception() is None else None
    if response is not None:
        response.close()


@pytest.mark.parametrize("reused", [False, True])
def test_a_copy_cancelled_at_any_event_leaves_no_connection_behind(reused: bool) -> None:
    with KeepAliveServer(ok_keep_alive()) as upstream, httpx.Client() as http:
        if reused:
            assert http.get(upstream.url).content == b"ok"  # a pooled connection to reuse
        full = _copy_cancelled_at(http, upstream.url, 10_000)  # not cancelled: every event
        assert "http11.response_closed.complete" in full
        for moment in range(-1, len(full) + 1):
            if reused:
                # Each round starts from one idle pooled connection.
                assert http.get(upstream.url).content == b"ok"
            _copy_cancelled_at(http, upstream.url, moment)
            assert _stuck(http) == [], (moment, full[moment] if 0 <= moment < len(full) else moment)
            assert len(_pool(http).connections) <= 1
            # And the pool still serves.
            assert http.get(upstream.url).content == b"ok", moment
        assert _stuck(http) == []


def test_copies_cancelled_from_another_thread_at_many_moments_lose_no_connection() -> None:
    """The race as it happens: the cancel comes from the caller's thread while the
    copy runs on its worker, at 60 offsets from 0 to about 3 ms."""
    with KeepAliveServer(ok_keep_alive()) as upstream, httpx.Client() as http:
        for moment in range(60):
            request = http.build_request("GET", upstream.url)
            gate = _thread_copy.ThreadCopyGate(request, _pool(http))
            future = _thread_copy.WORKERS.submit(lambda: _copy(http, request, {}, frozenset()))
            give_up = time.perf_counter() + moment * 50e-6
            while time.perf_counter() < give_up:
                pass
            gate.cancel()
            wait([future], timeout=10)
            _close(future)
            assert _stuck(http) == [], moment
            assert len(_pool(http).connections) <= 1
        assert http.get(upstream.url).content == b"ok"
        assert _stuck(http) == []


def test_many_hedged_calls_leave_the_pool_whole() -> None:
    """Hedged calls whose first attempt answers around the hedge's send (local
    hedging at 5 ms, so that every slow call is hedged): every loser, wherever
    it is, ends; no connection is stuck, and the pool still serves."""
    local = LocalHedging(delay=0.005, max_extra_load=1.0, capacity=100.0)
    with Client(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local) as client:
        _unreachable(client)

        class Tail:
            def __init__(self) -> None:
                self.n = 0
                self.lock = threading.Lock()

            def __call__(self, conn: socket.socket, request: bytes) -> bool:
                with self.lock:
                    self.n += 1
                    n = self.n
                time.sleep((n % 7) * 0.002)  # 0 to 12 ms: about the 5 ms delay
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                return True

        with KeepAliveServer(Tail()) as upstream, httpx.Client() as http:
            hedged = 0
            for _ in range(60):
                response = request_with_retries(http, client, "GET", upstream.url, upstream="py-hedge-sync-many",
                                                idempotency=Idempotency.SAFE, deadline=5)
                assert response.content == b"ok"
                hedged += bool(response.extensions[HEDGES_EXTENSION])
                assert _stuck(http) == []
            assert hedged > 0
            # Calls one after another, two copies at most: a loser's connection
            # is closed with it, so the pool never holds more than two.
            assert len(_pool(http).connections) <= 2
            assert http.get(upstream.url).content == b"ok"


def test_a_copy_cancelled_while_it_waits_for_the_pool_is_withdrawn_unsent() -> None:
    """The moment encode/httpcore#1093 is about (a request queued for a
    connection): the cancel is a flag, raised when the copy gets one, before
    any of it is sent; the pool keeps serving."""
    limits = httpx.Limits(max_connections=1)
    with KeepAliveServer(ok_keep_alive()) as upstream, httpx.Client(limits=limits) as http:
        holder = http.send(http.build_request("GET", upstream.url), stream=True)  # the one connection, held
        request = http.build_request("GET", upstream.url + "/copy")
        gate = _thread_copy.ThreadCopyGate(request, _pool(http))
        future = _thread_copy.WORKERS.submit(lambda: _copy(http, request, {}, frozenset()))
        pool = _pool(http)
        give_up = time.monotonic() + 5
        while len(pool._requests) < 2 and time.monotonic() < give_up:  # queued behind the holder
            time.sleep(0.001)
        assert len(pool._requests) == 2
        gate.cancel()
        assert not future.done()  # deferred, not dropped
        holder.read()
        holder.close()
        wait([future], timeout=10)
        assert isinstance(future.exception(), _thread_copy.Withdrawn)
        assert [r.split(b" ")[1] for r in upstream.requests] == [b"/"]  # the copy sent nothing
        assert _stuck(http) == []
        assert http.get(upstream.url).content == b"ok"


def test_an_https_loser_is_ended_too(tmp_path: Any) -> None:
    """Over TLS the copy's socket is an SSLSocket, shut down under the
    worker's read: the server sees the connection closed, and the pool
    keeps serving over TLS."""
    import select
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    cancelled = threading.Event()
    count = [0]
    lock = threading.Lock()

    def handle(raw: socket.socket) -> None:
        try:
            with served.wrap_socket(raw, server_side=True) as conn:
                while True:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    with lock:
                        count[0] += 1
                        first = count[0] == 1
                    if first:
                        ready, _, _ = select.select([conn], [], [], 5)
                        if ready and conn.recv(1) == b"":
                            cancelled.set()
                        return
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhedge")
        except (OSError, ssl.SSLError):
            pass

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(raw,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    local = LocalHedging(delay=0.1, max_extra_load=1.0)
    try:
        with Client(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local) as client, \
                httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            _unreachable(client)
            url = f"https://127.0.0.1:{port}/"
            response = request_with_retries(http, client, "GET", url, upstream="py-hedge-sync",
                                            idempotency=Idempotency.SAFE, deadline=5)
            assert response.content == b"hedge" and response.extensions[ATTEMPTS_EXTENSION] == 2
            assert cancelled.wait(2), "the losing first attempt's TLS connection was not closed"
            assert _stuck(http) == []
            assert http.get(url).content == b"hedge"  # the hedge's pooled TLS connection, reused
            assert count[0] == 3
    finally:
        listener.close()


@pytest.mark.parametrize("lost", ["first", "hedge"])
def test_a_copy_whose_socket_is_not_found_is_never_raced(lost: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the pool not show a copy's socket after all (the probe rules it out):
    with the first attempt's lost, no hedge is asked for while it runs; with the
    hedge's lost, the hedge is withdrawn before any of it is sent. Either way the
    first attempt answers, nothing is raced that could not be ended, and it is counted."""
    real = _thread_copy.socket_of
    looked: list[int] = []

    def socket_of(pool: Any, request: Any) -> Any:
        looked.append(1)
        return None if lost == "first" or len(looked) > 1 else real(pool, request)

    monkeypatch.setattr(_thread_copy, "socket_of", socket_of)
    local = LocalHedging(delay=0.05, max_extra_load=1.0)
    with Client(CLOSED_RETRYD, timeout=0.5, connect_timeout=0.5, local_hedging=local) as client:
        _unreachable(client)
        with HeldFirst(hold=0.4) as upstream, httpx.Client() as http:
            response = request_with_retries(http, client, "GET", upstream.server.url, upstream="py-hedge-sync",
                                            idempotency=Idempotency.SAFE, deadline=5)
            assert response.content == b"first"
            # One request read; a withdrawn hedge's connection carried not a byte.
            wait_for(lambda: len(upstream.server.requests) == (2 if lost == "hedge" else 1), what="the reads")
            assert [r[:3] for r in upstream.server.requests] == [b"GET"] + ([b""] if lost == "hedge" else [])
            assert not upstream.cancelled.is_set()
            asked = response.extensions[HEDGES_EXTENSION]
            assert len(asked) == (0 if lost == "first" else 1)
            assert _stuck(http) == []
        assert client.hedging.not_hedged() == {"socket": 1}
        traffic = client.reporter.pending_traffic()["py-hedge-sync"]
        assert (traffic.requests, traffic.successes, traffic.failures) == (1, 1, 0)
        assert (traffic.retry_successes, traffic.retry_failures, traffic.hedges_won) == (0, 0, 0)
