"""Issue 31, one layer retries: the lineage across a real call chain (docs/lineage.md).

edge (this test, the adapters) -> middle (a real ASGI app under uvicorn, or a
real grpcio server, with the inbound middleware) -> a back end that always
fails. The middle retries the back end under retryd; its failed answer says
so (``retryd-retried: middle``), and the edge does not retry it.

The tests of retryd's own RETRIED_BELOW / INSIDE_ENCLOSING_RETRY answers
ask the server once whether it applies the chain rule and fail on one that
does not (a stale ``$RETRYD_BIN``): every retryd of this repository does.
Others check the local rule (retryd unreachable from the edge), which
applies the same rule to what the adapter sent.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import httpx
import pytest
import uvicorn

from grpc_servers import METHOD, ScriptedGrpcServer, abort
from retryd import (
    AsyncClient,
    Client,
    DenyReason,
    Evidence,
    Idempotency,
    LineageMiddleware,
    LineageServerInterceptor,
    LocalPolicy,
    UnknownOutcome,
    Verdict,
    local_decide,
)
from retryd.grpc import RetryInterceptor, attempts_of as grpc_attempts_of, decision_of as grpc_decision_of
from retryd.httpx import arequest_with_retries, attempts_of, decision_of, request_with_retries
from retryd.lineage import (
    baggage_with_lineage,
    current_lineage,
    default_layer,
    enclosing_retry,
    lineage_from_baggage,
    normalize_lineage,
    parse_lineage,
    record_failure_after_decision,
    retried_below_of,
    serving,
)
from scripted_http import ScriptedServer, closed_port, respond
from support import Server, start_server, stop_server

# The back end's upstream has the defaults' three attempts: the middle sends
# it three requests for one of the edge's, and no more.
CHAIN_CONFIG = """
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
max_retry_after = "60s"
transient_500 = false
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "5ms", max = "20ms", jitter = "full" }
# The chain tests fail their back end on purpose, one test after another
# on the same upstreams: a recovery ramp after each (retryd's default, 5 s)
# would deny the next test's retries. The ramp has its own tests.
ramp_window = "0s"
"""

BACKEND = "py-chain-backend"
MIDDLE = "py-chain-middle"


@pytest.fixture(scope="module")
def chain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(CHAIN_CONFIG, tmp_path_factory.mktemp("retryd-chain"))
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def chain_aware(chain_server: Server) -> bool:
    """Whether this retryd applies the chain rule: asked once, about a 503 retried below."""
    with Client(chain_server.grpc, timeout=5, fallback=None) as probe:
        decision = probe.decide(upstream="py-chain-probe", idempotency=Idempotency.SAFE, attempt=1,
                                evidence=Evidence.RESPONSE_RECEIVED, http_status=503, retried_below="probe")
    return decision.deny_reason == DenyReason.RETRIED_BELOW


def needs_chain_rule(chain_aware: bool) -> None:
    if not chain_aware:
        pytest.fail("this retryd does not apply the chain rule: a stale $RETRYD_BIN?")


def baggage_of(raw: bytes) -> list[str]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    return [line.split(":", 1)[1].strip() for line in head.split("\r\n")[1:]
            if line.split(":", 1)[0].strip().lower() == "baggage"]


def lineage_sent(raw: bytes) -> str:
    values = re.findall(r"retryd\.lineage=([^,;]*)", ",".join(baggage_of(raw)))
    assert len(values) == 1, f"one retryd.lineage member expected in {baggage_of(raw)!r}"
    return values[0]


# ------------------------------------------------------------------ the middle, a real ASGI app


@dataclass
class Middle:
    """The middle service: GET / calls the back end through the httpx adapter, under retryd."""

    retryd_target: str
    backend_url: str
    served: list[str] = field(default_factory=list)

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    # AsyncClient belongs to the server's loop: made and closed in it.
                    self.retryd = AsyncClient(self.retryd_target, timeout=5, layer="middle")
                    self.http = httpx.AsyncClient(timeout=5)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.http.aclose()
                    await self.retryd.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        self.served.append(current_lineage())
        try:
            response = await arequest_with_retries(self.http, self.retryd, "GET", self.backend_url + "/item",
                                                   upstream=BACKEND, idempotency=Idempotency.SAFE, deadline=5)
            status = 503 if response.status_code >= 500 else 200
        except httpx.HTTPError:
            status = 502
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


@dataclass
class Served:
    url: str
    middle: Middle


@pytest.fixture()
def chain(chain_server: Server) -> Iterator[tuple[Served, ScriptedServer]]:
    """A failing back end, and the middle (uvicorn, in a thread of its own) in front of it."""
    backend = ScriptedServer(respond(503))
    middle = Middle(chain_server.grpc, backend.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    # Listening before uvicorn starts: the edge's connection waits in the
    # backlog until the server accepts it, so no readiness poll is needed.
    sock.listen(16)
    config = uvicorn.Config(LineageMiddleware(middle.app, layer="middle"), lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", middle), backend
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        backend.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def test_the_middle_retries_the_back_end_and_the_edge_does_not_retry_the_middle(
        chain: tuple[Served, ScriptedServer], chain_aware: bool) -> None:
    needs_chain_rule(chain_aware)
    middle, backend = chain
    with Client(middle.middle.retryd_target, timeout=5, layer="edge", fallback=None) as edge, \
            httpx.Client(timeout=10) as http:
        response = request_with_retries(http, edge, "GET", middle.url + "/", upstream=MIDDLE,
                                        idempotency=Idempotency.SAFE, deadline=10,
                                        headers={"baggage": "tenant=acme, retryd.lineage=stale:7"})
    assert response.status_code == 503
    assert response.headers["retryd-retried"] == "middle"
    decision = decision_of(response)
    assert decision is not None and not decision.fallback
    assert (decision.verdict, decision.deny_reason, decision.rule) == (Verdict.DENY, DenyReason.RETRIED_BELOW, 5)
    assert "middle" in decision.explanation
    assert attempts_of(response) == 1
    # The middle was asked once, with the edge's first attempt as its lineage.
    assert middle.middle.served == ["edge:1"]
    # It tried the back end three times (retryd's max_attempts), each attempt numbered.
    assert [lineage_sent(raw) for raw in backend.requests] == ["edge:1/middle:1", "edge:1/middle:2",
                                                               "edge:1/middle:3"]


def test_the_edge_reads_the_middles_mark_with_any_retryd(chain: tuple[Served, ScriptedServer]) -> None:
    """The edge's own entry replaces a stale member; the local rule (retryd unreachable) reads the mark."""
    middle, backend = chain
    with Client(f"127.0.0.1:{closed_port()}", timeout=0.5, layer="edge") as edge, \
            httpx.Client(timeout=10) as http:
        response = request_with_retries(http, edge, "GET", middle.url + "/", upstream=MIDDLE,
                                        idempotency=Idempotency.SAFE, deadline=10,
                                        headers={"baggage": "tenant=acme, retryd.lineage=stale:7;p=1, k=v"})
    # The request the middle served carried edge:1, not the stale member.
    assert middle.middle.served == ["edge:1"]
    # The local rule (retryd unreachable) got the middle's mark from the adapter.
    decision = decision_of(response)
    assert decision is not None and decision.fallback
    assert (decision.verdict, decision.deny_reason, decision.rule) == (Verdict.DENY, DenyReason.RETRIED_BELOW, 5)
    assert attempts_of(response) == 1
    assert len(backend.requests) == 3
    # The middle's own outbound baggage has just its member: nobody gave it others.
    assert baggage_of(backend.requests[0]) == ["retryd.lineage=edge:1/middle:1"]


def test_the_baggage_header_of_an_attempt_keeps_other_members() -> None:
    with ScriptedServer(respond(500)) as origin, \
            Client(f"127.0.0.1:{closed_port()}", timeout=0.5, layer="edge") as edge, httpx.Client() as http:
        request_with_retries(http, edge, "GET", origin.url, upstream="x-any", idempotency=Idempotency.SAFE,
                             headers={"baggage": "tenant=acme, retryd.lineage=stale:7;p=1, k=v"})
    assert baggage_of(origin.requests[0]) == ["tenant=acme,k=v,retryd.lineage=edge:1"]


def test_without_the_chain_rule_the_request_still_carries_the_facts(
        chain: tuple[Served, ScriptedServer], chain_server: Server) -> None:
    """Any retryd: the middle marks its 503, the edge reads the mark (fallback) and sends no second attempt."""
    middle, backend = chain
    with httpx.Client(timeout=10) as http:
        direct = http.get(middle.url + "/")
    assert direct.status_code == 503
    assert direct.headers["retryd-retried"] == "middle"
    # No baggage in: the middle is the edge of its own chain.
    assert middle.middle.served == [""]
    assert [lineage_sent(raw) for raw in backend.requests] == ["middle:1", "middle:2", "middle:3"]


def test_a_call_inside_an_enclosing_retry_is_not_retried(
        chain: tuple[Served, ScriptedServer], chain_aware: bool) -> None:
    needs_chain_rule(chain_aware)
    middle, backend = chain
    with httpx.Client(timeout=10) as http:
        # As the edge's second attempt would arrive.
        response = http.get(middle.url + "/", headers={"baggage": "retryd.lineage=edge:2"})
    assert middle.middle.served == ["edge:2"]
    assert [lineage_sent(raw) for raw in backend.requests] == ["edge:2/middle:1"]
    # Denied, so it ended in failure after retryd's decision: marked too.
    assert response.status_code == 503
    assert response.headers["retryd-retried"] == "middle"


def test_a_success_or_an_unmarked_failure_gets_no_mark(chain_server: Server) -> None:
    """The mark needs both: an outbound failure after a decision, and a 5xx of our own."""

    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def fails_alone(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def recovers(scope: Any, receive: Any, send: Any) -> None:
        record_failure_after_decision()  # a dependency failed, but the handler answered anyway
        await ok(scope, receive, send)

    for app, status in ((ok, 200), (fails_alone, 500), (recovers, 200)):
        transport = httpx.ASGITransport(app=LineageMiddleware(app, layer="middle"))

        async def call() -> httpx.Response:
            async with httpx.AsyncClient(transport=transport, base_url="http://middle") as http:
                return await http.get("/")

        response = asyncio.run(call())
        assert response.status_code == status
        assert "retryd-retried" not in response.headers


# ------------------------------------------------------------------ the same chain over gRPC


def _channel(target: str, interceptor: RetryInterceptor) -> grpc.Channel:
    return grpc.intercept_channel(
        grpc.insecure_channel(target, options=[("grpc.service_config_disable_resolution", 1)]), interceptor)


@dataclass
class GrpcMiddle:
    retryd: Client
    backend: str
    served: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        interceptor = RetryInterceptor(self.retryd, upstream=BACKEND, idempotency=Idempotency.SAFE, deadline=5)
        self._channel = _channel(self.backend, interceptor)
        self._call = self._channel.unary_unary(METHOD)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  interceptors=[LineageServerInterceptor(layer="middle")])
        handler = grpc.unary_unary_rpc_method_handler(self._handle)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Echo", {"Call": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.served.append(current_lineage())
        try:
            reply: bytes = self._call(request, timeout=5)
            return reply
        except grpc.RpcError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the back end is down")
            raise

    def close(self) -> None:
        self.server.stop(grace=None)
        self._channel.close()


@pytest.fixture()
def grpc_chain(chain_server: Server) -> Iterator[tuple[GrpcMiddle, ScriptedGrpcServer]]:
    with Client(chain_server.grpc, timeout=5, layer="middle") as retryd, \
            ScriptedGrpcServer([abort(grpc.StatusCode.UNAVAILABLE)]) as backend:
        middle = GrpcMiddle(retryd, backend.target)
        try:
            yield middle, backend
        finally:
            middle.close()


def _call_middle(port: int, edge: Client, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.RpcError:
    interceptor = RetryInterceptor(edge, upstream=MIDDLE, idempotency=Idempotency.SAFE, deadline=10)
    channel = _channel(f"127.0.0.1:{port}", interceptor)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary(METHOD)(b"x", timeout=10, metadata=metadata)
    finally:
        channel.close()
    return raised.value


def _trailers(error: grpc.RpcError) -> dict[str, str]:
    return {key: value for key, value in error.trailing_metadata()}  # type: ignore[attr-defined]


def test_grpc_the_middle_retries_and_the_edge_does_not(
        grpc_chain: tuple[GrpcMiddle, ScriptedGrpcServer], chain_aware: bool, chain_server: Server) -> None:
    needs_chain_rule(chain_aware)
    middle, backend = grpc_chain
    with Client(chain_server.grpc, timeout=5, layer="edge", fallback=None) as edge:
        error = _call_middle(middle.port, edge, (("baggage", "tenant=acme"),))
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    trailers = _trailers(error)
    assert trailers["retryd-retried"] == "middle"
    assert trailers["grpc-retry-pushback-ms"] == "-1"
    decision = grpc_decision_of(error)
    assert decision is not None and not decision.fallback
    assert (decision.verdict, decision.deny_reason, decision.rule) == (Verdict.DENY, DenyReason.RETRIED_BELOW, 5)
    assert grpc_attempts_of(error) == 1
    assert middle.served == ["edge:1"]
    assert [call.metadata["baggage"] for call in backend.calls] == [
        f"retryd.lineage=edge:1/middle:{n}" for n in (1, 2, 3)]


def test_grpc_the_edge_reads_the_trailer_with_any_retryd(
        grpc_chain: tuple[GrpcMiddle, ScriptedGrpcServer]) -> None:
    middle, backend = grpc_chain
    with Client(f"127.0.0.1:{closed_port()}", timeout=0.5, layer="edge") as edge:
        error = _call_middle(middle.port, edge, (("baggage", "tenant=acme,retryd.lineage=stale:3"),))
    decision = grpc_decision_of(error)
    assert decision is not None and decision.fallback
    # Rule 5 comes before the pushback of -1 (rule 9): the reason names the layer.
    assert (decision.verdict, decision.deny_reason) == (Verdict.DENY, DenyReason.RETRIED_BELOW)
    assert grpc_attempts_of(error) == 1
    assert middle.served == ["edge:1"]
    assert len(backend.calls) == 3
    assert _trailers(error)["retryd-retried"] == "middle"


def _set_code(context: grpc.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.UNAVAILABLE)
    return b""


def _raise(context: grpc.ServicerContext) -> bytes:
    raise RuntimeError("the handler broke")


def _abort(context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.UNAVAILABLE, "down")
    raise AssertionError("unreachable")


def _succeed(context: grpc.ServicerContext) -> bytes:
    return b"ok"


@pytest.mark.parametrize(("end", "code"), [(_set_code, grpc.StatusCode.UNAVAILABLE),
                                           (_raise, grpc.StatusCode.UNKNOWN),
                                           (_abort, grpc.StatusCode.UNAVAILABLE),
                                           (_succeed, None)])
def test_grpc_every_way_of_failing_is_marked(end: Any, code: Optional[grpc.StatusCode]) -> None:
    """A handler whose governed call failed: set_code, an exception and abort all carry the trailers; a success none."""

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        record_failure_after_decision()  # as the interceptor does after retryd's last decision
        reply: bytes = end(context)
        return reply

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         interceptors=[LineageServerInterceptor(layer="middle")])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handle)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary(METHOD)
            if code is None:  # the handler answered: its own success is never marked
                reply, call = method.with_call(b"x", timeout=5)
                assert reply == b"ok"
                assert "retryd-retried" not in {key for key, _ in call.trailing_metadata()}
                return
            with pytest.raises(grpc.RpcError) as raised:
                method(b"x", timeout=5)
    finally:
        server.stop(grace=None)
    assert raised.value.code() == code  # type: ignore[attr-defined]
    trailers = _trailers(raised.value)
    assert (trailers["retryd-retried"], trailers["grpc-retry-pushback-ms"]) == ("middle", "-1")


def test_grpc_a_failure_without_a_governed_call_is_not_marked(chain_server: Server) -> None:
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "no dependency involved")
        raise AssertionError("unreachable")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         interceptors=[LineageServerInterceptor(layer="middle")])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handle)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(METHOD)(b"x", timeout=5)
    finally:
        server.stop(grace=None)
    assert "retryd-retried" not in _trailers(raised.value)


# ------------------------------------------------------------------ parsing, shortening, the local rule


def test_valid_lineages_parse() -> None:
    assert parse_lineage("edge:2/middle:1") == [("edge", 2), ("middle", 1)]
    assert parse_lineage("a.b-c_D9:1000") == [("a.b-c_D9", 1000)]
    assert parse_lineage("...:3/x:1") == [("...", 3), ("x", 1)]
    assert normalize_lineage(" edge:02 ") == "edge:2"
    assert parse_lineage("") == []


@pytest.mark.parametrize("value", [
    "edge", "edge:", ":1", "edge:0", "edge:1001", "edge:-1", "edge:+1", "ed ge:1", "edge:1/", "/edge:1",
    "edge:1//x:1", "é:1", "edge:١", "x" * 65 + ":1", "edge:1/bad layer:2",
])
def test_an_invalid_lineage_is_ignored_as_a_whole(value: str) -> None:
    assert parse_lineage(value) == []
    assert lineage_from_baggage([f"retryd.lineage={value}"]) == ""


def test_a_long_lineage_drops_the_outermost_entries_keeping_their_retry() -> None:
    entries = [(f"l{n}", 1) for n in range(40)]
    entries[3] = ("l3", 4)
    entries[5] = ("l5", 2)
    shortened = parse_lineage("/".join(f"{layer}:{attempt}" for layer, attempt in entries))
    assert len(shortened) == 32
    assert shortened[0] == ("...", 4)
    assert shortened[1:] == entries[-31:]
    assert enclosing_retry("/".join(f"{layer}:{attempt}" for layer, attempt in entries))


def test_a_long_lineage_of_first_attempts_is_just_cut() -> None:
    entries = [(f"l{n}", 1) for n in range(40)]
    assert parse_lineage("/".join(f"{layer}:{attempt}" for layer, attempt in entries)) == entries[-32:]


def test_a_lineage_over_1024_bytes_is_shortened_by_bytes() -> None:
    entries = [("x" * 60 + f"{n:02d}", 1 if n else 9) for n in range(20)]  # 65 bytes each with ":1/"
    value = "/".join(f"{layer}:{attempt}" for layer, attempt in entries)
    assert len(value) > 1024
    shortened = normalize_lineage(value)
    assert len(shortened) <= 1024
    assert shortened.startswith("...:9/")
    assert shortened.endswith(f"{entries[-1][0]}:1")


def test_the_baggage_member_is_found_among_others_and_decoded() -> None:
    assert lineage_from_baggage(["a=1", "b=2, retryd.lineage=edge:2/middle:1;prop=x"]) == "edge:2/middle:1"
    # An OpenTelemetry propagator percent-encodes ':' and '/'.
    assert lineage_from_baggage(["retryd.lineage=edge%3A2%2Fmiddle%3A1"]) == "edge:2/middle:1"
    assert lineage_from_baggage(["retryd.lineages=edge:1", "xretryd.lineage=edge:1"]) == ""
    assert baggage_with_lineage(["a=1, retryd.lineage=old:1", "b=2;p"], "edge:1") == "a=1,b=2;p,retryd.lineage=edge:1"
    assert baggage_with_lineage([], "edge:1") == "retryd.lineage=edge:1"


def test_retried_below_takes_only_layer_names() -> None:
    assert retried_below_of(" middle ") == "middle"
    assert retried_below_of(None) == ""
    assert retried_below_of("mid dle") == ""
    assert retried_below_of("x" * 65) == ""


def test_the_default_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "checkout")
    assert default_layer() == "checkout"
    with Client(f"127.0.0.1:{closed_port()}") as client:
        assert client.layer == "checkout"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "not a layer")
    monkeypatch.setattr("sys.argv", ["/srv/bin/order service.py"])
    assert default_layer() == "order-service"
    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/site-packages/gunicorn/__main__.py"])
    assert default_layer() == "gunicorn"
    monkeypatch.setattr("sys.argv", ["-c"])
    assert default_layer() == "service"
    monkeypatch.setattr("sys.argv", ["/tmp/!!!"])
    assert default_layer() == "service"
    with pytest.raises(ValueError, match="layer"):
        Client(f"127.0.0.1:{closed_port()}", layer="bad layer")


def test_the_context_is_shared_with_threads_and_reset_after() -> None:
    async def handler() -> bool:
        with serving(baggage=["retryd.lineage=edge:1"]) as state:
            seen = await asyncio.to_thread(current_lineage)
            await asyncio.to_thread(record_failure_after_decision)
            assert seen == "edge:1"
            return state.failed_after_decision

    assert asyncio.run(handler()) is True
    assert current_lineage() == ""


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"retried_below": "middle"}, DenyReason.RETRIED_BELOW),
    ({"lineage": "edge:2/middle:1"}, DenyReason.INSIDE_ENCLOSING_RETRY),
    ({"lineage": "...:2/middle:1"}, DenyReason.INSIDE_ENCLOSING_RETRY),
])
def test_the_local_rule_applies_the_chain_rule_at_rule_5(kwargs: dict[str, Any], reason: DenyReason) -> None:
    decision = local_decide(policy=LocalPolicy(max_attempts=5), idempotency=Idempotency.NON_IDEMPOTENT,
                            attempt=1, evidence=Evidence.RESPONSE_RECEIVED, http_status=503, **kwargs)
    assert (decision.verdict, decision.deny_reason, decision.rule) == (Verdict.DENY, reason, 5)
    # The mark is kept: a 503 of a POST may have taken effect.
    assert decision.unknown_outcome == UnknownOutcome.RECONCILE


def test_the_local_rule_retries_a_first_attempt_chain() -> None:
    decision = local_decide(policy=LocalPolicy(), idempotency=Idempotency.SAFE, attempt=1,
                            evidence=Evidence.RESPONSE_RECEIVED, http_status=503, lineage="edge:1/middle:1")
    assert decision.verdict == Verdict.RETRY
    # Rules 1-4 come first: the attempt limit still says MAX_ATTEMPTS.
    limited = local_decide(policy=LocalPolicy(), idempotency=Idempotency.SAFE, attempt=2,
                           http_status=503, retried_below="middle")
    assert limited.deny_reason == DenyReason.MAX_ATTEMPTS


def test_retryd_accepts_the_lineage_the_adapters_send(chain_server: Server) -> None:
    """A timeout carries the lineage and no retried_below (retryd refuses one without a response)."""
    with Client(chain_server.grpc, timeout=5, fallback=None) as retryd:
        decision = retryd.decide(upstream="py-chain-probe", idempotency=Idempotency.SAFE, attempt=1,
                                 evidence=Evidence.SENT_NO_RESPONSE, lineage="edge:1")
    assert decision.verdict == Verdict.RETRY



# ------------------------------------------------------------------ grpc.aio: the same middle, async


def test_grpc_aio_middle_marks_its_failure(chain_server: Server) -> None:
    """An asyncio middle (grpc.aio server, AsyncRetryInterceptor): the lineage in, the trailers out."""
    from retryd import AsyncLineageServerInterceptor
    from retryd.grpc import AsyncRetryInterceptor

    served: list[str] = []
    ready = threading.Event()
    stop: dict[str, Any] = {}

    async def serve(backend: str) -> None:
        async with AsyncClient(chain_server.grpc, timeout=5, layer="middle") as retryd:
            interceptor = AsyncRetryInterceptor(retryd, upstream=BACKEND, idempotency=Idempotency.SAFE, deadline=5)
            channel = grpc.aio.insecure_channel(backend, interceptors=[interceptor],
                                                options=[("grpc.service_config_disable_resolution", 1)])
            call = channel.unary_unary(METHOD)

            async def handle(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
                served.append(current_lineage())
                try:
                    reply: bytes = await call(request, timeout=5)
                    return reply
                except grpc.RpcError:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the back end is down")
                    raise

            server = grpc.aio.server(interceptors=[AsyncLineageServerInterceptor(layer="middle")])
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handle)}),))
            stop["port"] = server.add_insecure_port("127.0.0.1:0")
            stop["loop"] = asyncio.get_running_loop()
            stop["done"] = asyncio.Event()
            await server.start()
            ready.set()
            await stop["done"].wait()
            await server.stop(grace=None)
            await channel.close()

    with ScriptedGrpcServer([abort(grpc.StatusCode.UNAVAILABLE)]) as backend:
        thread = threading.Thread(target=lambda: asyncio.run(serve(backend.target)), daemon=True)
        thread.start()
        try:
            assert ready.wait(30), "the grpc.aio middle did not start"
            with Client(f"127.0.0.1:{closed_port()}", timeout=0.5, layer="edge") as edge:
                error = _call_middle(stop["port"], edge, (("baggage", "tenant=acme"),))
        finally:
            if "loop" in stop:
                stop["loop"].call_soon_threadsafe(stop["done"].set)
            thread.join(10)
        assert not thread.is_alive()
        assert served == ["edge:1"]
        assert [call.metadata["baggage"] for call in backend.calls] == [
            f"retryd.lineage=edge:1/middle:{n}" for n in (1, 2, 3)]
        trailers = _trailers(error)
        assert (trailers["retryd-retried"], trailers["grpc-retry-pushback-ms"]) == ("middle", "-1")
        decision = grpc_decision_of(error)
        assert decision is not None and decision.deny_reason == DenyReason.RETRIED_BELOW
        assert grpc_attempts_of(error) == 1
