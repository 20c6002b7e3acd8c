"""httpx adapter: honest evidence from httpx outcomes, and retryd-governed retries.

About 950 lines: one responsibility (an httpx call under retryd's decisions),
written twice, for ``httpx.Client`` and ``httpx.AsyncClient``, beside the
classification they share; each hedged first round describes a copy here,
and the races themselves live in :mod:`retryd.hedge_runner` (asyncio) and
:mod:`retryd.hedge_threads` (threads).

Classification (what each httpx outcome proves):

======================================  ==================  =========================
httpx outcome                           evidence            failure
======================================  ==================  =========================
``PoolTimeout``                         NOT_SENT            POOL_TIMEOUT
``ConnectTimeout``, ``ConnectError``    NOT_SENT            CONNECT
``ConnectError`` from ``socket.gaierror``  NOT_SENT         DNS
``ConnectError`` from a certificate     NOT_SENT            TLS_CERTIFICATE_INVALID
  verification error
``ConnectError`` from another TLS error NOT_SENT            PRE_REQUEST_TLS
``UnsupportedProtocol``                 NOT_SENT            PROFILE_REJECTION
HTTP/2 ``REFUSED_STREAM`` reset         NOT_SENT            HTTP2_REFUSED_STREAM
``WriteTimeout``, ``WriteError``        SENT_NO_RESPONSE    PARTIAL_WRITE
``ReadTimeout`` (before headers)        SENT_NO_RESPONSE    RESPONSE_HEADER_TIMEOUT
``ReadError``, ``RemoteProtocolError``  SENT_NO_RESPONSE    CONNECTION_RESET
  (before headers)
``LocalProtocolError``                  SENT_NO_RESPONSE    REQUEST_ENCODING
read error after the headers            PARTIAL_RESPONSE    DECODE_RESET
read timeout after the headers          PARTIAL_RESPONSE    INTERRUPTED_STREAM
any other transport error               SENT_NO_RESPONSE    GENERIC_IO
a response                              RESPONSE_RECEIVED   (status, Retry-After)
======================================  ==================  =========================

A read timeout never proves NOT_SENT: the request was written, and the
upstream may be executing it. httpcore itself re-sends a request that was
above an HTTP/2 GOAWAY's last-stream-id, so GOAWAY_UNPROCESSED never
surfaces from httpx; a GOAWAY that does surface covers our stream and is a
CONNECTION_RESET.

Retries: :func:`request_with_retries` (and :func:`arequest_with_retries` for
``httpx.AsyncClient``) send a request, ask retryd after each failure, close
the failed response (returning its connection to the pool) and only then
sleep the backoff, so no connection is held while waiting. First attempts
are counted on the client's :class:`~retryd.reporter.TrafficReporter`
(``retryd.reporter``) unless ``reporter=None``, and so is every attempt's
outcome: a failure when retryd is asked about it (a transport error, a
status in ``retry_statuses``), a success otherwise (a 404 included); an
attempt cancelled by the caller is neither. The caller's ``deadline``
bounds every phase of every attempt and every backoff; the decision about
a returned response is in ``response.extensions["retryd.decision"]``. A
call that ends with its outcome unknown (AMBIGUOUS, or a DENY with an
``unknown_outcome`` mark) raises :class:`~retryd.errors.AmbiguousExecutionError`.

Hedging: both loops hedge idempotent calls as retryd serves
(:mod:`retryd.hedging`). :func:`arequest_with_retries` races tasks
(:mod:`retryd.hedge_runner`), cancelling a loser only where httpcore's pool
survives it (:mod:`retryd._copy_gate`); :func:`request_with_retries` races
copies on worker threads (:mod:`retryd.hedge_threads`) and ends a loser by
shutting its connection's socket down, which it finds in httpcore's sync
pool (:mod:`retryd._thread_copy`; a transport whose copies it could not end
is not hedged, and counted). Every completed first attempt's latency is
recorded on the reporter.

httpx and httpcore send nothing again by themselves once any of a request
was written: httpcore takes another connection only for a request it has
not sent (a pooled connection found closed, an HTTP/2 stream above a
GOAWAY's last-stream-id), and its ``retries=`` repeats only failed
connects. tests/test_issue38.py counts reads at the server to show it.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import socket
import ssl
import time
from collections.abc import AsyncIterable, Awaitable, Iterable, Mapping
from dataclasses import dataclass
from concurrent.futures import Future, wait as wait_for_all
from typing import Any, Callable, Optional, Protocol, TypeVar, Union, cast

import httpx

from ._types import Body, Decision, Evidence, FailureKind, IdempotencyLike, Replayability
from .client import AsyncClient, Client, Seconds, _seconds
from .errors import AmbiguousExecutionError
from ._copy_gate import CopyGate as _CopyGate
from .hedge_runner import HedgePlan, HedgeRound, run_hedged
from .hedge_threads import run_hedged_blocking
from .hedging import HedgingTable
from . import _thread_copy
from .lineage import (
    RETRIED_HEADER,
    baggage_with_lineage,
    current_lineage,
    format_lineage,
    parse_lineage,
    record_failure_after_decision,
    retried_below_of,
)
from .reporter import TrafficReporter

#: Statuses worth asking retryd about; any other response is returned as is.
DEFAULT_RETRY_STATUSES = frozenset({401, 408, 425, 429, 500, 502, 503, 504})

#: A hard stop, whatever retryd or the fallback says.
_MAX_LOOP = 100


@dataclass(frozen=True)
class Outcome:
    """What happened to one attempt, in retryd's terms."""

    evidence: Evidence
    failure: FailureKind = FailureKind.UNSPECIFIED
    http_status: int = 0
    retry_after: Optional[str] = None
    #: The response's ``retryd-retried`` layer (docs/lineage.md), ``""`` when absent or invalid.
    retried_below: str = ""

    def decide_kwargs(self) -> dict[str, Any]:
        """The matching keyword arguments of :meth:`retryd.Client.decide`."""
        return {
            "evidence": self.evidence,
            "failure": self.failure,
            "http_status": self.http_status,
            "retry_after": self.retry_after,
            "retried_below": self.retried_below,
        }


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _connect_failure(exc: BaseException) -> FailureKind:
    for cause in _chain(exc):
        if isinstance(cause, socket.gaierror):
            return FailureKind.DNS
        if isinstance(cause, ssl.SSLCertVerificationError):
            return FailureKind.TLS_CERTIFICATE_INVALID
        if isinstance(cause, ssl.SSLError):
            return FailureKind.PRE_REQUEST_TLS
    text = " ".join(str(cause) for cause in _chain(exc))
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return FailureKind.TLS_CERTIFICATE_INVALID
    if "Name or service not known" in text or "nodename nor servname" in text or "getaddrinfo" in text:
        return FailureKind.DNS
    if "SSL" in text or "TLS" in text:
        return FailureKind.PRE_REQUEST_TLS
    return FailureKind.CONNECT


def classify_response(response: httpx.Response) -> Outcome:
    """A response that arrived: its status, Retry-After and ``retryd-retried``."""
    return Outcome(
        evidence=Evidence.RESPONSE_RECEIVED,
        http_status=response.status_code,
        retry_after=response.headers.get("retry-after"),
        retried_below=retried_below_of(response.headers.get(RETRIED_HEADER)),
    )


def classify_exception(exc: BaseException, *, response: Optional[httpx.Response] = None) -> Outcome:
    """What an exception from httpx proves; see the module table.

    Pass ``response`` when the exception was raised while reading the body
    of a response whose headers had already arrived.
    """
    if response is not None:
        status = response.status_code
        retry_after = response.headers.get("retry-after")
        below = retried_below_of(response.headers.get(RETRIED_HEADER))
        if isinstance(exc, httpx.DecodingError):
            # Every byte arrived; they just could not be decoded.
            return Outcome(Evidence.RESPONSE_RECEIVED, FailureKind.UNSPECIFIED, status, retry_after, below)
        if isinstance(exc, httpx.TimeoutException):
            failure = FailureKind.INTERRUPTED_STREAM
        elif isinstance(exc, (httpx.ReadError, httpx.RemoteProtocolError)):
            failure = FailureKind.DECODE_RESET
        else:
            failure = FailureKind.GENERIC_IO
        return Outcome(Evidence.PARTIAL_RESPONSE, failure, status, retry_after, below)

    if isinstance(exc, httpx.PoolTimeout):
        return Outcome(Evidence.NOT_SENT, FailureKind.POOL_TIMEOUT)
    if isinstance(exc, httpx.ConnectTimeout):
        return Outcome(Evidence.NOT_SENT, FailureKind.CONNECT)
    if isinstance(exc, httpx.ConnectError):
        return Outcome(Evidence.NOT_SENT, _connect_failure(exc))
    if isinstance(exc, httpx.UnsupportedProtocol):
        return Outcome(Evidence.NOT_SENT, FailureKind.PROFILE_REJECTION)
    if isinstance(exc, (httpx.WriteTimeout, httpx.WriteError)):
        return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.PARTIAL_WRITE)
    if isinstance(exc, httpx.ReadTimeout):
        return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT)
    if isinstance(exc, httpx.RemoteProtocolError):
        if "REFUSED_STREAM" in str(exc):
            return Outcome(Evidence.NOT_SENT, FailureKind.HTTP2_REFUSED_STREAM)
        return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)
    if isinstance(exc, httpx.ReadError):
        return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)
    if isinstance(exc, httpx.LocalProtocolError):
        return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.REQUEST_ENCODING)
    return Outcome(Evidence.SENT_NO_RESPONSE, FailureKind.GENERIC_IO)


def _file_part(value: Any) -> Body:
    if isinstance(value, tuple):  # (filename, file[, content_type[, headers]])
        value = value[1] if len(value) > 1 else None
    if value is None or isinstance(value, (bytes, str)):
        return Body.bytes()
    if hasattr(value, "seek") and hasattr(value, "read"):
        seekable = getattr(value, "seekable", None)
        if seekable is None or seekable():
            return Body.reopenable()  # httpx seeks a file back to 0 before sending it
    return Body.input_stream()


def body_of(
    *,
    content: Any = None,
    data: Any = None,
    files: Any = None,
    json: Any = None,
) -> Optional[Body]:
    """The replayability of a body given as httpx request arguments.

    bytes/str content are BYTES; ``json`` and form ``data`` are an
    ENCODED_VALUE; ``files`` make a MULTIPART whose file parts are REOPENABLE
    when seekable (httpx rewinds them), else one-shot; an iterator or file
    as ``content`` is an INPUT_STREAM (httpx refuses to replay it).
    """
    if files:
        items = files.items() if isinstance(files, Mapping) else files
        parts = [_file_part(value) for _, value in items]
        if data:
            parts.append(Body.encoded_value())
        return Body.multipart(*parts)
    if content is not None:
        if isinstance(content, (bytes, str)):
            return Body.bytes()
        return Body.input_stream()
    if json is not None or data:
        return Body.encoded_value()
    return None


_BUILD_KEYS = {"content", "data", "files", "json", "params", "headers", "cookies", "timeout", "extensions"}


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    build = {key: value for key, value in kwargs.items() if key in _BUILD_KEYS}
    send = {key: value for key, value in kwargs.items() if key not in _BUILD_KEYS}
    return build, send


#: The key of ``response.extensions`` holding the decision retryd made about
#: that response (None when the response was returned without asking).
DECISION_EXTENSION = "retryd.decision"
#: The key of ``response.extensions`` holding every decision of the call, in order.
DECISIONS_EXTENSION = "retryd.decisions"
#: The key of ``response.extensions`` holding the number of attempts made.
ATTEMPTS_EXTENSION = "retryd.attempts"
#: The key of ``response.extensions`` holding retryd's answers to the call's hedge requests.
HEDGES_EXTENSION = "retryd.hedges"


class _UseClientReporter:
    """The default of ``reporter=``: the retryd client's own reporter."""

    def __repr__(self) -> str:
        return "CLIENT_REPORTER"


#: ``reporter=CLIENT_REPORTER`` (the default) counts first attempts on
#: ``retryd.reporter``; ``reporter=None`` opts out.
CLIENT_REPORTER: Any = _UseClientReporter()


class _Records(Protocol):
    def record(self, upstream: str, requests: int = 1) -> None: ...


def decision_of(outcome: Union[httpx.Response, BaseException]) -> Optional[Decision]:
    """The decision retryd made about a returned response or a raised error, if any."""
    if isinstance(outcome, httpx.Response):
        decision = outcome.extensions.get(DECISION_EXTENSION)
    else:
        decision = getattr(outcome, "decision", None) or getattr(outcome, "retryd_decision", None)
    return decision if isinstance(decision, Decision) else None


def attempts_of(outcome: Union[httpx.Response, BaseException]) -> Optional[int]:
    """How many attempts the adapter sent for a returned response or a raised error (None if unknown)."""
    if isinstance(outcome, httpx.Response):
        attempts = outcome.extensions.get(ATTEMPTS_EXTENSION)
    else:
        attempts = getattr(outcome, "retryd_attempts", None)
    return attempts if isinstance(attempts, int) else None


def _capped(timeout: httpx.Timeout, remaining: Optional[float]) -> httpx.Timeout:
    """Every phase of an attempt waits at most what is left of the deadline."""
    if remaining is None:
        return timeout

    def cap(value: Optional[float]) -> float:
        return remaining if value is None else min(value, remaining)

    return httpx.Timeout(connect=cap(timeout.connect), read=cap(timeout.read), write=cap(timeout.write),
                         pool=cap(timeout.pool))


class _Loop:
    """The state of one call across attempts, shared by the sync and async loops."""

    def __init__(
        self,
        *,
        upstream: str,
        idempotency: IdempotencyLike,
        operation: str,
        body: Optional[Body],
        deadline: Optional[Seconds],
        max_attempts: int,
        reporter: Optional[_Records],
        clock: Callable[[], float],
        layer: str,
    ) -> None:
        self.upstream = upstream
        self.layer = layer
        # The request being served when the call starts (docs/lineage.md).
        self.lineage = current_lineage()
        self.clock = clock
        self.idempotency = idempotency
        self.operation = operation
        self.body = body
        self.max_attempts = max_attempts
        self.reporter = reporter
        seconds = _seconds(deadline)
        if seconds is not None and seconds < 0:
            raise ValueError(f"deadline: must not be negative, got {seconds!r}")
        self.deadline_at = None if seconds is None else clock() + seconds
        self.attempt = 0
        self.previous_backoff: Optional[float] = None
        self.auth_refresh_attempted = False
        self.decisions: list[Decision] = []
        self.hedge_decisions: list[Decision] = []
        #: When the current attempt was sent (its latency is measured from here).
        self.sent_at = 0.0

    def remaining(self) -> Optional[float]:
        return None if self.deadline_at is None else max(0.0, self.deadline_at - self.clock())

    def begin(self, build: dict[str, Any], default_timeout: httpx.Timeout) -> dict[str, Any]:
        """Counts the attempt (the first one on the reporter) and bounds its timeouts."""
        self.attempt += 1
        if self.attempt == 1 and self.reporter is not None:
            self.reporter.record(self.upstream)
        self.sent_at = self.clock()
        given = build.get("timeout", httpx.USE_CLIENT_DEFAULT)
        base = default_timeout if given is httpx.USE_CLIENT_DEFAULT else httpx.Timeout(given)
        return {**build, "timeout": _capped(base, self.remaining())}

    def ended(self, success: bool) -> None:
        """Counts how the attempt ended on the reporter: a failure is one retryd is asked about.

        A reporter of the caller's own without ``record_outcome`` counts requests only.
        """
        self.copy_ended(success, retry=self.attempt > 1, elapsed=self.clock() - self.sent_at)

    def copy_ended(self, success: bool, *, retry: bool, elapsed: float) -> None:
        """Counts how one attempt ended; a first attempt's latency goes in the histograms too."""
        record_outcome = getattr(self.reporter, "record_outcome", None)
        if record_outcome is not None:
            record_outcome(self.upstream, success, retry=retry)
        if not retry:
            self.first_latency(success, elapsed)

    def hedge_won(self) -> None:
        """Counts a call whose final answer came from a hedge (a reporter without the count records none)."""
        record_hedge_won = getattr(self.reporter, "record_hedge_won", None)
        if record_hedge_won is not None:
            record_hedge_won(self.upstream)

    def hedge_plan(self, table: HedgingTable) -> Optional[HedgePlan]:
        """How to hedge this call's first attempt (None: do not); one-shot bodies never are."""
        if self.body is not None and self.body.replayability == Replayability.ONE_SHOT:
            return None
        return table.plan(self.upstream, self.idempotency)

    def hedge_kwargs(self, hedge: int) -> dict[str, Any]:
        """The keyword arguments of ``decide_hedge`` asking for the ``hedge``-th hedge."""
        return dict(upstream=self.upstream, idempotency=self.idempotency, hedge=hedge, attempt=self.attempt,
                    operation=self.operation, deadline_remaining=self.remaining(), body=self.body,
                    lineage=self.lineage)

    def copy_answered(self, copy: int, result: _Copy, elapsed: float) -> None:
        """Counts a copy of a hedged round that answered (its outcome; a hedge is never a first attempt)."""
        self.copy_ended(result.outcome is None, retry=copy > 0, elapsed=elapsed)

    def round_ended(self, hedged: HedgeRound[Any], result: _Copy) -> None:
        """Keeps the round's hedge decisions and counts a win by a hedge."""
        self.hedge_decisions.extend(hedged.decisions)
        if hedged.copy > 0 and result.outcome is None:
            self.hedge_won()

    def first_latency(self, success: bool, elapsed: float) -> None:
        """Records the first attempt's latency (a reporter without histograms records none)."""
        record_latency = getattr(self.reporter, "record_latency", None)
        if record_latency is not None:
            record_latency(self.upstream, success, elapsed)

    def carry_lineage(self, request: httpx.Request) -> httpx.Request:
        """Puts ``<lineage>/<layer>:<attempt>`` in the attempt's baggage, other members untouched."""
        sent = format_lineage(parse_lineage(self.lineage) + [(self.layer, self.attempt)])
        request.headers["baggage"] = baggage_with_lineage(request.headers.get_list("baggage"), sent)
        return request

    def decide_kwargs(self, outcome: Outcome) -> dict[str, Any]:
        return dict(
            upstream=self.upstream,
            idempotency=self.idempotency,
            attempt=self.attempt,
            operation=self.operation,
            body=self.body,
            deadline_remaining=self.remaining(),
            auth_refresh_attempted=self.auth_refresh_attempted,
            previous_backoff=self.previous_backoff,
            max_attempts=self.max_attempts,
            lineage=self.lineage,
            **outcome.decide_kwargs(),
        )

    def decided(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def finish(self, response: httpx.Response, decision: Optional[Decision]) -> httpx.Response:
        response.extensions[DECISION_EXTENSION] = decision
        response.extensions[DECISIONS_EXTENSION] = tuple(self.decisions)
        response.extensions[ATTEMPTS_EXTENSION] = self.attempt
        response.extensions[HEDGES_EXTENSION] = tuple(self.hedge_decisions)
        return response

    def end(self, decision: Decision, response: Optional[httpx.Response],
            error: Optional[BaseException]) -> httpx.Response:
        """The call's result when it is not retried: the response, or the error to raise.

        A call whose outcome is unknown (AMBIGUOUS, or a DENY carrying a mark)
        raises :class:`AmbiguousExecutionError`, never the plain failure.
        Either way the call ended in failure after retryd's decision: the
        inbound middleware marks the handler's failed response (docs/lineage.md).
        """
        record_failure_after_decision()
        if decision.is_outcome_unknown:
            if response is not None:
                self.finish(response, decision)
            ambiguous = AmbiguousExecutionError(decision, response)
            ambiguous.retryd_attempts = self.attempt  # type: ignore[attr-defined]
            raise ambiguous from error
        if error is not None:
            raise self.fail(error, decision)
        assert response is not None
        return self.finish(response, decision)

    def fail(self, error: BaseException, decision: Decision) -> BaseException:
        _note(error, decision)
        try:
            error.retryd_decision = decision  # type: ignore[attr-defined]
            error.retryd_attempts = self.attempt  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            pass
        return error

    def backoff(self, decision: Decision) -> float:
        """The wait before the next attempt: the decision's, never past the deadline."""
        self.previous_backoff = decision.backoff or None
        if decision.refresh_credentials:
            self.auth_refresh_attempted = True
        remaining = self.remaining()
        return decision.backoff if remaining is None else min(decision.backoff, remaining)

    def out_of_time(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0


def _note(exc: BaseException, decision: Decision) -> None:
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(f"retryd: {decision.verdict.name} (rule {decision.rule}): {decision.explanation}")


def _reporter_for(retryd: Union[Client, AsyncClient], reporter: Any) -> Optional[_Records]:
    if reporter is CLIENT_REPORTER:
        chosen: _Records = retryd.reporter
        return chosen
    return cast(Optional[_Records], reporter)


def request_with_retries(
    http: httpx.Client,
    retryd: Client,
    method: str,
    url: Union[httpx.URL, str],
    *,
    upstream: str,
    idempotency: IdempotencyLike,
    operation: Optional[str] = None,
    body: Optional[Body] = None,
    deadline: Optional[Seconds] = None,
    max_attempts: int = 0,
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES,
    reporter: Optional[TrafficReporter] = CLIENT_REPORTER,
    on_refresh_credentials: Optional[Callable[[], None]] = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    **kwargs: Any,
) -> httpx.Response:
    """Sends a request with httpx, retrying as retryd decides.

    ``kwargs`` are those of ``httpx.Client.request``. ``idempotency`` is
    required: the method alone never decides. ``body`` overrides the
    replayability derived from ``content``/``data``/``files``/``json``.

    ``deadline`` (seconds) covers the whole call: every connect, write, read
    and pool wait of every attempt is bounded by what is left of it (below
    the client's own timeouts), every backoff too, and retryd is told the
    remaining time on each decision.

    The first attempt is counted on ``retryd.reporter`` (the client's own
    traffic reporter), so the upstream's budget fills from real traffic;
    pass ``reporter=None`` if you report traffic some other way, or a
    reporter of your own.

    Returns the final response (read in full) when it succeeds, when retryd
    denies a retry of an error response, or when the status is not in
    ``retry_statuses``; ``response.extensions["retryd.decision"]`` is the
    decision about that response (None if retryd was not asked), and
    :func:`decision_of` reads it. Re-raises the last transport error when
    retryd denies retrying it (the decision is in its notes and in
    ``decision_of(error)``) and the outcome is settled. Raises
    :class:`~retryd.errors.AmbiguousExecutionError` when the call ends with
    its outcome unknown: an AMBIGUOUS answer, or a decision carrying an
    ``unknown_outcome`` mark (a DENY such as BUDGET_EXHAUSTED, or an attempt
    the caller's deadline ended after it was sent, which is decided locally
    without asking retryd). :func:`attempts_of` says how many attempts were
    sent. After a 401 retryd may ask to refresh credentials:
    ``on_refresh_credentials`` is called before the replay (if it is not
    given, the 401 response is returned).

    For an idempotent call to an upstream whose hedging retryd serves, the
    first attempt and its hedges run on worker threads, raced as in
    :func:`arequest_with_retries`; a loser's connection is shut down (the
    upstream sees it closed) and the loser waited for before this returns.
    Only httpx's own ``HTTPTransport`` without a proxy or HTTP/2 is hedged;
    other calls are counted in ``retryd.hedging.not_hedged()``.

    ``sleep`` waits the backoffs and ``clock`` (monotonic seconds) measures
    the deadline: replace both to run the loop on a fake clock (tests).
    """
    build, send = _split(kwargs)
    loop = _Loop(
        upstream=upstream,
        idempotency=idempotency,
        operation=operation or f"{method.upper()} {httpx.URL(url).path}",
        body=body if body is not None else body_of(**{k: build.get(k) for k in ("content", "data", "files", "json")}),
        deadline=deadline,
        max_attempts=max_attempts,
        reporter=_reporter_for(retryd, reporter),
        clock=clock,
        layer=retryd.layer,
    )
    table = retryd.hedging
    plan = loop.hedge_plan(table)
    pool: Any = None
    if plan is not None:
        pool = _thread_copy.pool_of(http, url)
        if isinstance(pool, str):
            table.count_not_hedged(pool)
            plan = None
    while True:
        if loop.attempt == 0:
            table.first_attempt()
        if loop.attempt == 0 and plan is not None:
            copy = _hedged_round(http, retryd, loop, plan, pool, method, url, build, send, retry_statuses)
        else:
            request = loop.carry_lineage(http.build_request(method, url, **loop.begin(build, http.timeout)))
            copy = _copy(http, request, send, retry_statuses)
            loop.ended(copy.outcome is None)
        response, error, outcome = copy.response, copy.error, copy.outcome
        if outcome is None:
            assert response is not None
            return loop.finish(response, None)

        decision = (retryd.decide_past_deadline(**loop.decide_kwargs(outcome)) if loop.out_of_time()
                    else retryd.decide(**loop.decide_kwargs(outcome)))
        loop.decided(decision)
        retry = decision.should_retry and loop.attempt < _MAX_LOOP
        if retry and decision.refresh_credentials:
            if on_refresh_credentials is None:
                retry = False
            else:
                on_refresh_credentials()
        if retry:
            if response is not None:
                response.close()  # give the connection back before waiting
            wait = loop.backoff(decision)
            if wait > 0:
                sleep(wait)
            retry = not loop.out_of_time()
        if not retry:
            return loop.end(decision, response, error)


def _copy(http: httpx.Client, request: httpx.Request, send: dict[str, Any],
          retry_statuses: frozenset[int]) -> _Copy:
    """Sends one blocking attempt and reads its response in full."""
    try:
        response = http.send(request, stream=True, **send)
    except httpx.TransportError as exc:
        return _Copy(None, exc, classify_exception(exc))
    try:
        response.read()
    except (httpx.TransportError, httpx.DecodingError) as exc:
        response.close()
        return _Copy(response, exc, classify_exception(exc, response=response))
    if response.status_code not in retry_statuses:
        return _Copy(response, None, None)
    return _Copy(response, None, classify_response(response))


class _ThreadCopy:
    """One copy of a blocking hedged round, on a worker thread: a ``hedge_threads`` copy.

    ``cancel()`` ends it through its gate (:mod:`retryd._thread_copy`).
    An exception other than a transport error (a bad URL, an event hook's)
    is final: it ends the round and is raised to the caller.
    """

    def __init__(self, future: Future[_Copy], gate: _thread_copy.ThreadCopyGate) -> None:
        self.future = future
        self.gate = gate

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self.future.add_done_callback(lambda _: fn(self))

    def cancel(self) -> bool:
        self.gate.cancel()
        return True

    @property
    def raised(self) -> Optional[BaseException]:
        return self.future.exception()

    @property
    def withdrawn(self) -> bool:
        """Ended before any of it was sent (cancelled, or a hedge whose socket was not found)."""
        return isinstance(self.raised, _thread_copy.Withdrawn)

    def is_final(self) -> bool:
        raised = self.raised
        if raised is not None:
            return not isinstance(raised, _thread_copy.Withdrawn)
        return self.future.result().outcome is None


def _hedged_round(http: httpx.Client, retryd: Client, loop: _Loop, plan: HedgePlan, pool: Any, method: str,
                  url: Union[httpx.URL, str], build: dict[str, Any], send: dict[str, Any],
                  retry_statuses: frozenset[int]) -> _Copy:
    """The blocking first attempt and its hedges, each on a worker thread (retryd.hedge_threads).

    Every copy has ended, its connection closed or back in the pool,
    before this returns: a loser is cancelled (its socket shut down, or
    withdrawn before it was sent) and waited for.
    """
    copies: list[_ThreadCopy] = []
    # The caller's context (its span, the request it serves) goes with every
    # copy and hedge decision, each on a thread of its own.
    caller = contextvars.copy_context()

    def start_copy(copy: int) -> _ThreadCopy:
        request = loop.carry_lineage(http.build_request(method, url, **loop.begin(build, http.timeout)))
        gate = _thread_copy.ThreadCopyGate(request, pool, hedge=copy > 0)
        context = caller.copy()
        started = _ThreadCopy(_thread_copy.WORKERS.submit(
            lambda: context.run(_copy, http, request, send, retry_statuses)), gate)
        copies.append(started)
        return started

    def ask(hedge: int) -> Decision:
        return caller.copy().run(retryd.decide_hedge, **loop.hedge_kwargs(hedge))

    def on_end(copy: int, result: _ThreadCopy, elapsed: float) -> None:
        if result.raised is None:
            loop.copy_answered(copy, result.future.result(), elapsed)

    try:
        first = start_copy(0)
        hedged = run_hedged_blocking(
            plan=plan, first=first, start_copy=start_copy, is_final=_ThreadCopy.is_final,
            ask=ask, on_end=on_end,
            on_first_cancelled=lambda elapsed: loop.first_latency(True, elapsed), clock=loop.clock,
            remaining=loop.remaining, first_sent_at=loop.sent_at,
            may_hedge=lambda: all(copy.gate.cancellable for copy in copies))
    except BaseException:
        # The caller's thread was interrupted: no copy outlives the call.
        for copy in copies:
            copy.cancel()
        _settle(copies, None)
        raise
    winner = hedged.result
    if winner.withdrawn:
        # Every copy failed and the last to end was a hedge withdrawn unsent:
        # the first attempt's failure is the one the retry path decides about.
        winner = copies[0]
    _settle(copies, winner)
    if not all(copy.gate.cancellable for copy in copies):
        retryd.hedging.count_not_hedged("socket")
    raised = winner.raised
    if raised is not None:
        raise raised
    result = winner.future.result()
    loop.round_ended(hedged, result)
    return result


def _settle(copies: list[_ThreadCopy], winner: Optional[_ThreadCopy]) -> None:
    """Waits for every copy but ``winner`` to end and closes what it left open."""
    for copy in copies:
        if copy is winner:
            continue
        # Bounded: a cancelled copy's socket is shut (it ends at once) or it
        # was withdrawn at its next event (within its pool and connect timeouts).
        wait_for_all([copy.future])
        if copy.raised is None:
            response = copy.future.result().response
            if response is not None:
                response.close()


async def arequest_with_retries(
    http: httpx.AsyncClient,
    retryd: AsyncClient,
    method: str,
    url: Union[httpx.URL, str],
    *,
    upstream: str,
    idempotency: IdempotencyLike,
    operation: Optional[str] = None,
    body: Optional[Body] = None,
    deadline: Optional[Seconds] = None,
    max_attempts: int = 0,
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES,
    reporter: Optional[_Records] = CLIENT_REPORTER,
    on_refresh_credentials: Optional[Callable[[], Union[None, Awaitable[None]]]] = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    **kwargs: Any,
) -> httpx.Response:
    """The asyncio twin of :func:`request_with_retries`, which also hedges.

    For an idempotent call to an upstream whose hedging retryd serves
    (``retryd.hedging``, learned from the reporter's answers), the first
    attempt is raced against copies sent after the served delay, each one
    granted by retryd (:mod:`retryd.hedge_runner`); the losers are aborted,
    and retryd's answers to the hedge requests are in
    ``response.extensions["retryd.hedges"]``.

    Here the deadline also cuts an attempt as a whole (a server trickling
    bytes cannot stretch it): an attempt still running when the deadline
    passes fails as a read timeout, before or after the response headers.
    """
    build, send = _split(kwargs)
    content = build.get("content")
    loop = _Loop(
        upstream=upstream,
        idempotency=idempotency,
        operation=operation or f"{method.upper()} {httpx.URL(url).path}",
        body=body if body is not None else (
            Body.input_stream() if isinstance(content, AsyncIterable)
            else body_of(**{k: build.get(k) for k in ("content", "data", "files", "json")})
        ),
        deadline=deadline,
        max_attempts=max_attempts,
        reporter=_reporter_for(retryd, reporter),
        clock=clock,
        layer=retryd.layer,
    )
    table = retryd.hedging
    # One-shot bodies and streamed content are never hedged: a copy could not be sent.
    plan = loop.hedge_plan(table)
    while True:
        if loop.attempt == 0:
            table.first_attempt()
        if loop.attempt == 0 and plan is not None:
            copy = await _ahedged_round(http, retryd, loop, plan, method, url, build, send, retry_statuses)
        else:
            request = loop.carry_lineage(http.build_request(method, url, **loop.begin(build, http.timeout)))
            copy = await _acopy(http, request, send, loop, retry_statuses)
            loop.ended(copy.outcome is None)
        response, error, outcome = copy.response, copy.error, copy.outcome
        if outcome is None:
            assert response is not None
            return loop.finish(response, None)

        decision = (retryd.decide_past_deadline(**loop.decide_kwargs(outcome)) if loop.out_of_time()
                    else await retryd.decide(**loop.decide_kwargs(outcome)))
        loop.decided(decision)
        retry = decision.should_retry and loop.attempt < _MAX_LOOP
        if retry and decision.refresh_credentials:
            if on_refresh_credentials is None:
                retry = False
            else:
                result = on_refresh_credentials()
                if inspect.isawaitable(result):
                    await result
        if retry:
            if response is not None:
                await response.aclose()
            wait = loop.backoff(decision)
            if wait > 0:
                await sleep(wait)
            retry = not loop.out_of_time()
        if not retry:
            return loop.end(decision, response, error)


@dataclass(frozen=True)
class _Copy:
    """How one async attempt ended: ``outcome`` None for a final response (returned as is)."""

    response: Optional[httpx.Response]
    error: Optional[BaseException]
    outcome: Optional[Outcome]


async def _acopy(http: httpx.AsyncClient, request: httpx.Request, send: dict[str, Any], loop: _Loop,
                 retry_statuses: frozenset[int], gate: Optional[_CopyGate] = None) -> _Copy:
    """Sends one attempt and reads its response in full; cancelling it (through ``gate``) aborts the request."""
    if gate is None:
        gate = _CopyGate(request)
    response: Optional[httpx.Response] = None
    try:
        try:
            response = await _within(loop.remaining(), _sending(http, request, send, gate), request, gate)
        except httpx.TransportError as exc:
            return _Copy(None, exc, classify_exception(exc))
        try:
            await _within(loop.remaining(), response.aread(), request, gate)
        except (httpx.TransportError, httpx.DecodingError) as exc:
            await response.aclose()
            return _Copy(response, exc, classify_exception(exc, response=response))
    except asyncio.CancelledError:
        # A hedge answered first: close this copy's stream, so that its
        # connection is dropped (the upstream sees the request aborted).
        if response is not None:
            await response.aclose()
        raise
    if response.status_code not in retry_statuses:
        return _Copy(response, None, None)
    return _Copy(response, None, classify_response(response))


async def _sending(http: httpx.AsyncClient, request: httpx.Request, send: dict[str, Any],
                   gate: _CopyGate) -> httpx.Response:
    # From here until the request starts on a connection, a cancel waits (see _CopyGate).
    gate.enter_pool()
    return await http.send(request, stream=True, **send)


async def _ahedged_round(http: httpx.AsyncClient, retryd: AsyncClient, loop: _Loop, plan: HedgePlan,
                         method: str, url: Union[httpx.URL, str], build: dict[str, Any],
                         send: dict[str, Any], retry_statuses: frozenset[int]) -> _Copy:
    """The first attempt and its hedges (retryd.hedge_runner); counts every copy that answered."""
    gates: dict[asyncio.Future[Any], _CopyGate] = {}

    def start_copy(copy: int) -> Awaitable[_Copy]:
        request = loop.carry_lineage(http.build_request(method, url, **loop.begin(build, http.timeout)))
        gate = _CopyGate(request)
        task = asyncio.ensure_future(_acopy(http, request, send, loop, retry_statuses, gate))
        gate.task = task
        gates[task] = gate
        return task

    def cancel_copy(task: asyncio.Future[Any]) -> None:
        gates[task].cancel()

    hedged = await run_hedged(plan=plan, start_copy=start_copy, is_final=lambda result: result.outcome is None,
                              ask=lambda hedge: retryd.decide_hedge(**loop.hedge_kwargs(hedge)),
                              on_end=loop.copy_answered,
                              on_first_cancelled=lambda elapsed: loop.first_latency(True, elapsed),
                              clock=loop.clock, remaining=loop.remaining, cancel_copy=cancel_copy)
    loop.round_ended(hedged, hedged.result)
    return hedged.result


#: Added to the remaining deadline before an async attempt is cut, so that
#: httpx's own (equal) timeouts fire first and name the phase that hung.
_CUT_GRACE = 0.05

_T = TypeVar("_T")


async def _within(remaining: Optional[float], awaitable: Awaitable[_T], request: httpx.Request,
                  gate: Optional[_CopyGate] = None) -> _T:
    if remaining is None:
        return await awaitable
    if gate is None:
        try:
            return await asyncio.wait_for(awaitable, remaining + _CUT_GRACE)
        except asyncio.TimeoutError:
            raise _cut(request) from None
    # Cut through the gate, not by wait_for's cancel: a cancel at the wrong
    # moment would leave a connection in the pool (see _CopyGate).
    inner = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({inner}, timeout=remaining + _CUT_GRACE)
    except asyncio.CancelledError:
        gate.task = inner
        gate.cancel()
        await asyncio.gather(inner, return_exceptions=True)
        if not inner.cancelled() and isinstance(inner.exception() or inner.result(), httpx.Response):
            # The response came as the copy was cancelled: nobody else will close it.
            await cast(httpx.Response, inner.result()).aclose()
        raise
    if done:
        return inner.result()
    gate.task = inner
    gate.cancel()
    try:
        await inner
    except asyncio.CancelledError:
        raise _cut(request) from None
    return inner.result()


def _cut(request: httpx.Request) -> httpx.ReadTimeout:
    # Cut by the caller's deadline: the request may have been written, so
    # this is a read timeout, never proof of NOT_SENT.
    return httpx.ReadTimeout("the call's deadline passed during the attempt", request=request)


__all__ = [
    "ATTEMPTS_EXTENSION",
    "CLIENT_REPORTER",
    "DECISIONS_EXTENSION",
    "DECISION_EXTENSION",
    "DEFAULT_RETRY_STATUSES",
    "HEDGES_EXTENSION",
    "Outcome",
    "arequest_with_retries",
    "attempts_of",
    "body_of",
    "classify_exception",
    "classify_response",
    "decision_of",
    "request_with_retries",
]
