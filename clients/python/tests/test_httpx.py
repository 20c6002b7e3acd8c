"""The httpx adapter: classification of real socket failures on 127.0.0.1 (and
of the few that cannot be provoked locally, through MockTransport), and
retryd-governed retries end to end against a real retryd."""

from __future__ import annotations

import asyncio
import io
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any, Callable

import httpx
import pytest

from scripted_http import (
    ScriptedServer,
    close_without_response,
    closed_port,
    garbage,
    hang,
    reset_without_response,
    respond,
    respond_if,
    truncated_body,
)
from support import Server
from retryd import (
    AmbiguousExecutionError,
    AsyncClient,
    Body,
    BodyKind,
    Client,
    Evidence,
    FailureKind,
    Idempotency,
    Replayability,
    ReportResult,
    TrafficReporter,
)
from retryd.httpx import (
    Outcome,
    arequest_with_retries,
    body_of,
    classify_exception,
    classify_response,
    request_with_retries,
)

CLOSED_RETRYD = "127.0.0.1:1"


def failure_of(call: Callable[[], Any]) -> Outcome:
    try:
        call()
    except httpx.HTTPError as exc:
        return classify_exception(exc)
    raise AssertionError("expected an httpx error")


# ------------------------------------------------------------------ real failures

def test_connection_refused_proves_not_sent() -> None:
    url = f"http://127.0.0.1:{closed_port()}/"
    assert failure_of(lambda: httpx.get(url)) == Outcome(Evidence.NOT_SENT, FailureKind.CONNECT)


def test_read_timeout_is_not_not_sent() -> None:
    release = threading.Event()
    with ScriptedServer(hang(release)) as server:
        try:
            outcome = failure_of(lambda: httpx.get(server.url, timeout=httpx.Timeout(5, read=0.2)))
        finally:
            release.set()
    assert outcome == Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT)


def test_close_before_response_is_a_connection_reset() -> None:
    with ScriptedServer(close_without_response()) as server:
        outcome = failure_of(lambda: httpx.post(server.url, content=b"x"))
    assert outcome == Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)


def test_rst_before_response_is_a_connection_reset() -> None:
    with ScriptedServer(reset_without_response()) as server:
        outcome = failure_of(lambda: httpx.post(server.url, content=b"x"))
    assert outcome == Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)


def test_truncated_body_is_a_partial_response() -> None:
    with ScriptedServer(truncated_body(200)) as server, httpx.Client() as http:
        with http.stream("GET", server.url) as response:
            with pytest.raises(httpx.HTTPError) as raised:
                response.read()
            outcome = classify_exception(raised.value, response=response)
    assert outcome == Outcome(Evidence.PARTIAL_RESPONSE, FailureKind.DECODE_RESET, 200)


def test_pool_timeout_proves_not_sent() -> None:
    release = threading.Event()
    limits = httpx.Limits(max_connections=1)
    with ScriptedServer(truncated_body(200, hang=release)) as server, \
            httpx.Client(limits=limits, timeout=httpx.Timeout(5, pool=0.1)) as http:
        try:
            with http.stream("GET", server.url):
                outcome = failure_of(lambda: http.get(server.url))
        finally:
            release.set()
    assert outcome == Outcome(Evidence.NOT_SENT, FailureKind.POOL_TIMEOUT)


def test_tls_handshake_failure_proves_not_sent() -> None:
    with ScriptedServer(garbage(), read_request=False) as server:
        url = f"https://127.0.0.1:{server.port}/"
        outcome = failure_of(lambda: httpx.get(url))
    assert outcome == Outcome(Evidence.NOT_SENT, FailureKind.PRE_REQUEST_TLS)


def test_unsupported_scheme_is_a_profile_rejection() -> None:
    assert failure_of(lambda: httpx.get("ftp://127.0.0.1/")) == Outcome(Evidence.NOT_SENT, FailureKind.PROFILE_REJECTION)


# ------------------------------------------------------------------ failures that need a mock

def raising(exc: Exception) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return httpx.Client(transport=httpx.MockTransport(handler))


def chained(outer: Exception, cause: BaseException) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    "exc, outcome",
    [
        (chained(httpx.ConnectError("[Errno -2] Name or service not known"), socket.gaierror(-2, "Name or service not known")),
         Outcome(Evidence.NOT_SENT, FailureKind.DNS)),
        (chained(httpx.ConnectError("certificate verify failed"), ssl.SSLCertVerificationError(1, "certificate verify failed")),
         Outcome(Evidence.NOT_SENT, FailureKind.TLS_CERTIFICATE_INVALID)),
        (httpx.ConnectTimeout("timed out"), Outcome(Evidence.NOT_SENT, FailureKind.CONNECT)),
        (httpx.PoolTimeout("pool"), Outcome(Evidence.NOT_SENT, FailureKind.POOL_TIMEOUT)),
        (httpx.RemoteProtocolError("<StreamReset stream_id:1, error_code:ErrorCodes.REFUSED_STREAM, remote_reset:True>"),
         Outcome(Evidence.NOT_SENT, FailureKind.HTTP2_REFUSED_STREAM)),
        (httpx.RemoteProtocolError("<ConnectionTerminated error_code:0, last_stream_id:5, additional_data:None>"),
         Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)),
        (httpx.WriteTimeout("write"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.PARTIAL_WRITE)),
        (httpx.WriteError("broken pipe"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.PARTIAL_WRITE)),
        (httpx.ReadTimeout("read"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT)),
        (httpx.ReadError("reset"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)),
        (httpx.LocalProtocolError("bad header"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.REQUEST_ENCODING)),
        (httpx.ProxyError("proxy"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.GENERIC_IO)),
        (httpx.CloseError("close"), Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.GENERIC_IO)),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.failure.name,
)
def test_mocked_failures(exc: Exception, outcome: Outcome) -> None:
    with raising(exc) as http:
        assert failure_of(lambda: http.get("http://127.0.0.1/")) == outcome


def test_errors_while_reading_a_body() -> None:
    response = httpx.Response(503, headers={"retry-after": "4"})
    assert classify_exception(httpx.ReadTimeout("t"), response=response) == Outcome(
        Evidence.PARTIAL_RESPONSE, FailureKind.INTERRUPTED_STREAM, 503, "4")
    assert classify_exception(httpx.ReadError("r"), response=response).failure == FailureKind.DECODE_RESET
    assert classify_exception(httpx.DecodingError("gzip"), response=response) == Outcome(
        Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, 503, "4")


def test_classify_response() -> None:
    assert classify_response(httpx.Response(429, headers={"Retry-After": "7"})) == Outcome(
        Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, 429, "7")
    assert classify_response(httpx.Response(200)).retry_after is None


def test_body_of() -> None:
    assert body_of() is None
    assert body_of(content=b"x") == Body.bytes()
    assert body_of(content="x") == Body.bytes()
    assert body_of(json={"a": 1}) == Body.encoded_value()
    assert body_of(data={"a": "1"}) == Body.encoded_value()
    assert body_of(content=iter([b"x"])) == Body.input_stream()
    multipart = body_of(files={"a": io.BytesIO(b"x"), "b": ("b.txt", b"y")}, data={"c": "z"})
    assert multipart is not None and multipart.kind == BodyKind.MULTIPART
    assert [part.kind for part in multipart.parts] == [BodyKind.REOPENABLE_SUPPLIER, BodyKind.BYTES, BodyKind.ENCODED_VALUE]
    assert multipart.replayability == Replayability.REOPENABLE


# ------------------------------------------------------------------ retries through a real retryd

@pytest.fixture
def retryd(server: Server) -> Iterator[Client]:
    with Client(server.grpc, timeout=5, fallback=None) as client:
        yield client


class Sleeps:
    def __init__(self, during: Callable[[], None] = lambda: None) -> None:
        self.calls: list[float] = []
        self.during = during

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.during()


def test_retries_503_until_success(retryd: Client) -> None:
    sleeps = Sleeps()
    with ScriptedServer(respond(503), respond(503), respond(200, b"ok")) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-503",
                                        idempotency=Idempotency.SAFE, sleep=sleeps)
        assert response.status_code == 200 and response.content == b"ok"
        assert len(server.requests) == 3
    assert len(sleeps.calls) == 2 and all(0 <= s <= 0.050 for s in sleeps.calls)


def test_backoff_is_slept_with_no_connection_held(retryd: Client) -> None:
    limits = httpx.Limits(max_connections=1)
    with ScriptedServer(respond(503), respond(200)) as server, ScriptedServer(respond(204)) as other, \
            httpx.Client(limits=limits, timeout=httpx.Timeout(5, pool=0.2)) as http:
        # While sleeping, the only pooled connection must be free for others.
        sleeps = Sleeps(during=lambda: http.get(other.url).raise_for_status())
        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-pool",
                                        idempotency=Idempotency.SAFE, sleep=sleeps)
    assert response.status_code == 200
    assert len(sleeps.calls) == 1 and len(other.requests) == 1


def test_not_sent_is_retried_even_for_a_payment(retryd: Client) -> None:
    sleeps = Sleeps()
    with httpx.Client() as http, pytest.raises(httpx.ConnectError) as raised:
        request_with_retries(http, retryd, "POST", f"http://127.0.0.1:{closed_port()}/charges",
                             upstream="py-e2e-refused", idempotency=Idempotency.NON_IDEMPOTENT,
                             content=b"{}", sleep=sleeps)
    assert len(sleeps.calls) == 2  # attempts 1 and 2 retried, attempt 3 hits max_attempts
    assert any("MAX_ATTEMPTS" in note or "DENY" in note for note in getattr(raised.value, "__notes__", []))


def test_payment_without_response_is_ambiguous(retryd: Client) -> None:
    with ScriptedServer(close_without_response()) as server, httpx.Client() as http:
        with pytest.raises(AmbiguousExecutionError) as raised:
            request_with_retries(http, retryd, "POST", server.url + "/charges", upstream="py-e2e-ambiguous",
                                 idempotency=Idempotency.NON_IDEMPOTENT, content=b"{}", sleep=Sleeps())
        assert len(server.requests) == 1
    assert raised.value.decision.rule == 8
    assert isinstance(raised.value.__cause__, httpx.RemoteProtocolError)


def test_payment_with_truncated_response_is_ambiguous(retryd: Client) -> None:
    with ScriptedServer(truncated_body(201)) as server, httpx.Client() as http:
        with pytest.raises(AmbiguousExecutionError) as raised:
            request_with_retries(http, retryd, "POST", server.url, upstream="py-e2e-partial",
                                 idempotency=Idempotency.NON_IDEMPOTENT, json={"amount": 1}, sleep=Sleeps())
    assert raised.value.decision.effective_evidence == Evidence.PARTIAL_RESPONSE
    assert raised.value.response is not None and raised.value.response.status_code == 201


def test_payment_502_is_ambiguous_with_the_response(retryd: Client) -> None:
    with ScriptedServer(respond(502)) as server, httpx.Client() as http:
        with pytest.raises(AmbiguousExecutionError) as raised:
            request_with_retries(http, retryd, "POST", server.url, upstream="py-e2e-502",
                                 idempotency=Idempotency.NON_IDEMPOTENT, content=b"{}", sleep=Sleeps())
    assert raised.value.response.status_code == 502


def test_other_statuses_are_returned_at_once(retryd: Client) -> None:
    with ScriptedServer(respond(404)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-404",
                                        idempotency=Idempotency.SAFE)
        assert response.status_code == 404 and len(server.requests) == 1


def test_one_shot_body_is_not_replayed(retryd: Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"part"

    with ScriptedServer(respond(503)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "PUT", server.url, upstream="py-e2e-oneshot",
                                        idempotency=Idempotency.IDEMPOTENT, content=chunks(), sleep=Sleeps())
        assert response.status_code == 503 and len(server.requests) == 1


def test_401_refreshes_credentials_once(retryd: Client) -> None:
    token = {"value": "old"}

    def refresh() -> None:
        token["value"] = "new"

    authorized = respond_if(lambda request: b"authorization: bearer new" in request.lower(), respond(200), respond(401))
    with ScriptedServer(authorized) as server, httpx.Client() as http:
        def auth(request: httpx.Request) -> httpx.Request:
            request.headers["Authorization"] = f"Bearer {token['value']}"
            return request

        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-401",
                                        idempotency=Idempotency.SAFE, auth=auth, on_refresh_credentials=refresh)
        assert response.status_code == 200 and len(server.requests) == 2

    with ScriptedServer(respond(401)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-401",
                                        idempotency=Idempotency.SAFE)
        assert response.status_code == 401 and len(server.requests) == 1


def test_deadline_covers_the_whole_call(retryd: Client) -> None:
    with ScriptedServer(respond(503)) as server, httpx.Client() as http:
        # py-slow needs 300ms for an attempt: less than that is left.
        response = request_with_retries(http, retryd, "GET", server.url, upstream="py-slow",
                                        idempotency=Idempotency.SAFE, deadline=0.25)
        assert response.status_code == 503 and len(server.requests) == 1


def test_only_first_attempts_are_reported(retryd: Client) -> None:
    class Recorder:
        def report_batch(self, traffic: Any, *, report_id: str = "") -> ReportResult:
            return ReportResult(len(traffic))

    reporter = TrafficReporter(Recorder())
    with ScriptedServer(respond(503), respond(200)) as server, httpx.Client() as http:
        request_with_retries(http, retryd, "GET", server.url, upstream="py-e2e-report",
                             idempotency=Idempotency.SAFE, reporter=reporter, sleep=Sleeps())
    assert reporter.pending() == {"py-e2e-report": 1}


def test_local_rule_when_retryd_is_down() -> None:
    sleeps = Sleeps()
    with Client(CLOSED_RETRYD, timeout=0.2) as down, httpx.Client() as http:
        with pytest.raises(httpx.ConnectError):
            request_with_retries(http, down, "GET", f"http://127.0.0.1:{closed_port()}/",
                                 upstream="u", idempotency=Idempotency.SAFE, sleep=sleeps)
        with ScriptedServer(close_without_response()) as server, pytest.raises(AmbiguousExecutionError) as raised:
            request_with_retries(http, down, "POST", server.url, upstream="u",
                                 idempotency=Idempotency.NON_IDEMPOTENT, content=b"{}", sleep=sleeps)
    assert len(sleeps.calls) == 1  # the local limit of 2 attempts
    assert raised.value.decision.fallback


def test_async_retries(server: Server) -> None:
    async def main() -> None:
        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        async with AsyncClient(server.grpc, timeout=5, fallback=None) as aretryd, httpx.AsyncClient() as http:
            with ScriptedServer(respond(503), respond(200, b"ok")) as origin:
                response = await arequest_with_retries(http, aretryd, "GET", origin.url, upstream="py-e2e-async",
                                                       idempotency=Idempotency.SAFE, sleep=sleep)
                assert response.status_code == 200 and len(origin.requests) == 2
            with ScriptedServer(close_without_response()) as origin, pytest.raises(AmbiguousExecutionError):
                await arequest_with_retries(http, aretryd, "POST", origin.url, upstream="py-e2e-async",
                                            idempotency=Idempotency.NON_IDEMPOTENT, content=b"{}", sleep=sleep)
        assert len(slept) == 1

    asyncio.run(main())
