"""grpcio interceptors: honest evidence from failed gRPC calls, and retryd-governed retries.

About 830 lines: the classification table, the sync interceptor and its
asyncio twin, which mirror each other line for line (grpcio's two APIs);
the asyncio one's hedged round is its ``_hedged``, the race
:mod:`retryd.hedge_runner`.

Classification (what each grpcio outcome proves; checked against the real
failures on 127.0.0.1 by tests/test_grpc.py, for the grpcio version pinned
in constraints.txt):

================================================  ==================  =========================
grpcio outcome                                    evidence            failure
================================================  ==================  =========================
UNAVAILABLE "failed to connect to all addresses"  NOT_SENT            CONNECT (PRE_REQUEST_TLS
  (no connection was ever ready: refused, reset                         when the TLS handshake
  or garbage before the HTTP/2 handshake)                               failed)
a status with a ``grpc-retry-pushback-ms``        RESPONSE_RECEIVED   (code, raw pushback)
  trailer (only the server sends it)
DEADLINE_EXCEEDED                                 SENT_NO_RESPONSE    RESPONSE_HEADER_TIMEOUT
CANCELLED                                         SENT_NO_RESPONSE    GENERIC_IO
a transport break after the channel was ready     SENT_NO_RESPONSE    CONNECTION_RESET
  ("Stream removed", "Socket closed", "Connection
  reset", "Broken pipe", GOAWAY, RST_STREAM)
"Exception serializing request!", "Sent message   SENT_NO_RESPONSE    REQUEST_ENCODING
  larger than max"                                                    (permanent)
"Exception deserializing response!", "Received    RESPONSE_RECEIVED   (code)
  message larger than max" (the response came)
any other status (the server's own)               RESPONSE_RECEIVED   (code)
================================================  ==================  =========================

The status code is always sent as ``grpc_status_code``. A deadline is never
taken for NOT_SENT, even when the channel was never ready: grpcio does not
say so, and the claim is never made without proof. grpcio 1.85 no longer
says in ``debug_error_string`` whether a status came from the peer, so the
library's own statuses are recognised by the words above; the test suite
pins them, and fails on a grpcio whose words changed. On a response stream
that already delivered messages (``messages_received`` > 0) the call is
``first_byte_delivered``, and a transport break is PARTIAL_RESPONSE.

Interceptors: :class:`RetryInterceptor` (``grpc.intercept_channel``) and
:class:`AsyncRetryInterceptor` (``grpc.aio.insecure_channel(...,
interceptors=[...])``) run a unary-unary call, ask retryd after each
failure, sleep the backoff with no call in flight, and try again, within
the call's deadline (its ``timeout=``), which bounds every attempt and every
backoff and is passed to retryd on each decision. The first attempt is
counted on the retryd client's reporter, and so is every attempt's outcome
(:data:`FAILURE_CODES` fail; any other ending succeeds; CANCELLED is
neither). With ``retries=False`` they only
classify: the error raised carries ``retryd_outcome``. A call that ends
with its outcome unknown (AMBIGUOUS, a DENY with an ``unknown_outcome``
mark, or a non-idempotent call whose deadline passed after it was sent,
decided locally) raises :class:`AmbiguousRpcError` /
:class:`AmbiguousAioRpcError`.

:class:`AsyncRetryInterceptor` also hedges unary calls to an upstream whose
hedging retryd serves (:mod:`retryd.hedge_runner`: a copy after the served
delay, granted by retryd; the loser cancelled); so does the blocking
interceptor for ``.future()`` calls (:mod:`retryd.hedge_threads`: the
copies are grpcio futures, the loser's ``cancel()`` cancels its RPC),
while a plain blocking call is over before the interceptor sees it and is
never hedged. Both record every completed first attempt's latency.

Switch off grpcio's own retries for the channels retryd governs: give no
``retryPolicy`` in the channel's service config (``grpc.service_config``)
and pass ``("grpc.service_config_disable_resolution", 1)`` so that a
resolver cannot supply one; two retry loops multiply attempts and spend
budgets twice. grpcio's transparent retries of RPCs that never left the
client are fine and stay on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union, cast

import grpc
import grpc.aio

from ._types import Body, Decision, Evidence, FailureKind, Idempotency, IdempotencyLike, Replayability
from .client import AsyncClient, Client, Seconds, _seconds
from .errors import AmbiguousExecutionError, describe_ambiguity
from .hedge_runner import HedgePlan, run_hedged
from .hedge_threads import run_hedged_blocking
from .lineage import (
    RETRIED_HEADER,
    baggage_with_lineage,
    current_lineage,
    format_lineage,
    parse_lineage,
    record_failure_after_decision,
    retried_below_of,
)

#: The trailer of gRFC A6, passed to retryd raw.
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

#: A hard stop, whatever retryd or the fallback says.
_MAX_LOOP = 100

_NOT_READY = "failed to connect to all addresses"
_TRANSPORT_BREAKS = (
    "stream removed",
    "socket closed",
    "connection reset",
    "broken pipe",
    "goaway",
    "rst_stream",
    "connection closed",
    "transport closed",
    "endpoint closing",
    "keepalive watchdog",
)
_ENCODING = ("exception serializing request", "sent message larger than max")
_DECODING = ("exception deserializing response", "received message larger than max")


@dataclass(frozen=True)
class GrpcOutcome:
    """What happened to one gRPC attempt, in retryd's terms."""

    evidence: Evidence
    failure: FailureKind
    grpc_status_code: int
    grpc_retry_pushback_ms: Optional[str] = None
    first_byte_delivered: bool = False
    #: The ``retryd-retried`` trailer's layer (docs/lineage.md), ``""`` when absent, invalid or no answer came.
    retried_below: str = ""

    def decide_kwargs(self) -> dict[str, Any]:
        """The matching keyword arguments of :meth:`retryd.Client.decide`."""
        return {
            "evidence": self.evidence,
            "failure": self.failure,
            "grpc_status_code": self.grpc_status_code,
            "grpc_retry_pushback_ms": self.grpc_retry_pushback_ms,
            "first_byte_delivered": self.first_byte_delivered,
            "retried_below": self.retried_below,
        }


def _code_number(code: Optional[grpc.StatusCode]) -> int:
    if code is None:
        return 2  # UNKNOWN: grpcio gave no code at all
    number = code.value[0]
    return int(number)


def _trailer(trailers: Any, name: str) -> Optional[str]:
    for key, value in trailers or ():
        if key.lower() == name:
            return value if isinstance(value, str) else bytes(value).decode("latin-1")
    return None


def _pushback(trailers: Any) -> Optional[str]:
    return _trailer(trailers, PUSHBACK_TRAILER)


def classify_rpc_error(error: grpc.RpcError, *, messages_received: int = 0) -> GrpcOutcome:
    """What a failed grpcio call proves; see the module table.

    ``error`` is a sync ``grpc.RpcError`` that is also a ``grpc.Call`` (what
    grpcio raises) or a ``grpc.aio.AioRpcError``. ``messages_received`` is
    how many response messages a streaming call had already delivered.
    """
    call = cast(grpc.Call, error)
    code = call.code()
    number = _code_number(code)
    details = (call.details() or "").lower()
    delivered = messages_received > 0
    trailers = call.trailing_metadata()
    pushback = _pushback(trailers)
    below = retried_below_of(_trailer(trailers, RETRIED_HEADER))

    def outcome(evidence: Evidence, failure: FailureKind = FailureKind.UNSPECIFIED) -> GrpcOutcome:
        # retryd takes retried_below only with an answer (any other is INVALID_ARGUMENT).
        answered = evidence in (Evidence.RESPONSE_RECEIVED, Evidence.PARTIAL_RESPONSE)
        return GrpcOutcome(evidence, failure, number, pushback, delivered, below if answered else "")

    if pushback is not None:
        return outcome(Evidence.RESPONSE_RECEIVED)
    if code == grpc.StatusCode.UNAVAILABLE and _NOT_READY in details and not delivered:
        # grpcio's picker failed the call because no connection ever became
        # ready: no stream was opened, so the request never left.
        if "certificate_verify_failed" in details:
            return outcome(Evidence.NOT_SENT, FailureKind.TLS_CERTIFICATE_INVALID)
        if "handshake" in details or "ssl" in details or "tls" in details:
            return outcome(Evidence.NOT_SENT, FailureKind.PRE_REQUEST_TLS)
        return outcome(Evidence.NOT_SENT, FailureKind.CONNECT)
    if any(marker in details for marker in _ENCODING):
        return outcome(Evidence.SENT_NO_RESPONSE, FailureKind.REQUEST_ENCODING)
    if any(marker in details for marker in _DECODING):
        return outcome(Evidence.RESPONSE_RECEIVED)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if delivered:
            return outcome(Evidence.PARTIAL_RESPONSE, FailureKind.INTERRUPTED_STREAM)
        return outcome(Evidence.SENT_NO_RESPONSE, FailureKind.RESPONSE_HEADER_TIMEOUT)
    if any(marker in details for marker in _TRANSPORT_BREAKS) or code == grpc.StatusCode.CANCELLED:
        if delivered:
            return outcome(Evidence.PARTIAL_RESPONSE, FailureKind.INTERRUPTED_STREAM)
        if code == grpc.StatusCode.CANCELLED:
            return outcome(Evidence.SENT_NO_RESPONSE, FailureKind.GENERIC_IO)
        return outcome(Evidence.SENT_NO_RESPONSE, FailureKind.CONNECTION_RESET)
    return outcome(Evidence.RESPONSE_RECEIVED)


def decision_of(error: BaseException) -> Optional[Decision]:
    """The decision retryd made about a failed call raised by an interceptor, if any."""
    decision = getattr(error, "decision", None) or getattr(error, "retryd_decision", None)
    return decision if isinstance(decision, Decision) else None


def outcome_of(error: BaseException) -> Optional[GrpcOutcome]:
    """The classification an interceptor attached to a failed call, if any."""
    outcome = getattr(error, "retryd_outcome", None)
    return outcome if isinstance(outcome, GrpcOutcome) else None


def attempts_of(error: BaseException) -> Optional[int]:
    """How many attempts an interceptor sent for a failed call (None if it did not say)."""
    attempts = getattr(error, "retryd_attempts", None)
    return attempts if isinstance(attempts, int) else None


def _attach(error: BaseException, outcome: GrpcOutcome, decision: Optional[Decision], attempts: int) -> None:
    try:
        error.retryd_outcome = outcome  # type: ignore[attr-defined]
        error.retryd_attempts = attempts  # type: ignore[attr-defined]
        if decision is not None:
            error.retryd_decision = decision  # type: ignore[attr-defined]
    except AttributeError:  # an error type with __slots__
        return
    if decision is not None:
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(f"retryd: {decision.verdict.name} (rule {decision.rule}): {decision.explanation}")


if TYPE_CHECKING:  # the stubs make Future generic; grpcio's class is not
    _Future = grpc.Future[Any]
else:
    _Future = grpc.Future


class AmbiguousRpcError(AmbiguousExecutionError, grpc.RpcError, grpc.Call, _Future):
    """An unknown outcome from a sync interceptor (AMBIGUOUS, or a DENY with a mark): the call may have taken effect.

    Both an :class:`~retryd.AmbiguousExecutionError` (``.decision``) and the
    failed call (``code()``, ``details()``, ``trailing_metadata()``, and
    ``__cause__``), so ``except grpc.RpcError`` still sees it.
    """

    def __init__(self, decision: Decision, call: grpc.RpcError) -> None:
        AmbiguousExecutionError.__init__(self, decision, None)
        self.call = call
        self.__cause__ = call
        self.retryd_attempts = attempts_of(call)

    def _call(self) -> Any:
        return self.call

    def code(self) -> grpc.StatusCode:
        return cast(grpc.StatusCode, self._call().code())

    def details(self) -> str:
        return cast(str, self._call().details() or "")

    def initial_metadata(self) -> Any:
        return self._call().initial_metadata()

    def trailing_metadata(self) -> Any:
        return self._call().trailing_metadata()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float] = None) -> Any:
        raise self

    def exception(self, timeout: Optional[float] = None) -> Optional[Exception]:
        return self

    def traceback(self, timeout: Optional[float] = None) -> Any:
        return self.__traceback__

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


class AmbiguousAioRpcError(AmbiguousExecutionError, grpc.aio.AioRpcError):
    """AMBIGUOUS from the asyncio interceptor; an ``AioRpcError`` too."""

    def __init__(self, decision: Decision, call: grpc.aio.AioRpcError) -> None:
        grpc.aio.AioRpcError.__init__(self, call.code(), call.initial_metadata(), call.trailing_metadata(),
                                      call.details(), call.debug_error_string())
        self.decision = decision
        self.response = None
        self.__cause__ = call
        self.retryd_attempts = attempts_of(call)

    def __str__(self) -> str:
        return describe_ambiguity(self.decision)


#: How an interceptor learns each method's idempotency: one value for every
#: method, a mapping by full method name ("/pkg.Service/Method"; a method
#: not in it is NON_IDEMPOTENT), or a function of the method name.
IdempotencyRule = Union[IdempotencyLike, Mapping[str, IdempotencyLike], Callable[[str], IdempotencyLike]]

#: A refresh callback may return metadata entries that replace the call's
#: entries of the same keys on the replay (a new ``authorization``, say).
RefreshResult = Optional[Sequence[tuple[str, str]]]


class _UseClientReporter:
    def __repr__(self) -> str:
        return "CLIENT_REPORTER"


#: ``reporter=CLIENT_REPORTER`` (the default) counts first attempts on the
#: retryd client's reporter; ``reporter=None`` opts out.
CLIENT_REPORTER: Any = _UseClientReporter()


#: The codes that make an attempt a *failure* in the reporter's outcome
#: counts: those the retry tables can retry (UNAVAILABLE and DEADLINE_EXCEEDED
#: as 502-504 and "no response"; RESOURCE_EXHAUSTED as 429; UNAUTHENTICATED
#: as 401; INTERNAL and UNKNOWN as 500), the twins of the HTTP statuses the
#: httpx adapter asks about. Every other code is a success (the upstream
#: answered, as a 404), except CANCELLED: the caller's own, counted as neither.
FAILURE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
})


def attempt_succeeded(error: Optional[BaseException]) -> Optional[bool]:
    """How an attempt that ended with ``error`` (None: a response) counts: True a
    success, False a failure, None neither (cancelled, or no RPC's error)."""
    if error is None:
        return True
    if not isinstance(error, grpc.RpcError):
        return None
    code = error.code()
    if code == grpc.StatusCode.CANCELLED:
        return None
    return code not in FAILURE_CODES


def _method_name(method: Union[str, bytes]) -> str:
    return method.decode() if isinstance(method, bytes) else method


def _merge(metadata: Any, replace: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
    keys = {key.lower() for key, _ in replace}
    kept = [(key, value) for key, value in (metadata or ()) if key.lower() not in keys]
    return kept + list(replace)


class _Policy:
    """What both interceptors share: configuration and the per-call loop state."""

    def __init__(
        self,
        retryd: Union[Client, AsyncClient],
        *,
        upstream: str,
        idempotency: IdempotencyRule,
        retries: bool,
        deadline: Optional[Seconds],
        attempt_timeout: Optional[Seconds],
        max_attempts: int,
        body: Optional[Body],
        reporter: Any,
    ) -> None:
        if not upstream:
            raise ValueError("upstream: required")
        self.retryd = retryd
        self.upstream = upstream
        self.idempotency = idempotency
        self.retries = retries
        self.deadline = _seconds(deadline)
        self.attempt_timeout = _seconds(attempt_timeout)
        if self.attempt_timeout is not None and self.attempt_timeout <= 0:
            raise ValueError(f"attempt_timeout: must be positive, got {self.attempt_timeout!r}")
        self.max_attempts = max_attempts
        self.body = body
        self._reporter = reporter

    def idempotency_of(self, method: str) -> IdempotencyLike:
        rule = self.idempotency
        if isinstance(rule, Mapping):
            return rule.get(method, Idempotency.NON_IDEMPOTENT)
        if callable(rule):
            return rule(method)
        return rule

    def _chosen_reporter(self) -> Any:
        return self.retryd.reporter if self._reporter is CLIENT_REPORTER else self._reporter

    def record_first_attempt(self) -> None:
        reporter = self._chosen_reporter()
        if reporter is not None:
            reporter.record(self.upstream)

    def record_outcome(self, attempt: int, error: Optional[BaseException], elapsed: Optional[float] = None,
                       *, retry: Optional[bool] = None) -> None:
        """Counts how an attempt ended (``error`` None: a response); see :data:`FAILURE_CODES`.

        A first attempt's ``elapsed`` seconds go in the latency histograms
        (``retry`` overrides ``attempt > 1``: a hedge is never a first attempt).
        """
        if not self.retries:
            return  # classifying only: the caller counts its own traffic
        success = attempt_succeeded(error)
        if success is None:
            return
        later = attempt > 1 if retry is None else retry
        reporter = self._chosen_reporter()
        record_outcome = getattr(reporter, "record_outcome", None)
        if record_outcome is not None:
            record_outcome(self.upstream, success, retry=later)
        if not later and elapsed is not None:
            self.record_first_latency(success, elapsed)

    def record_hedge_won(self) -> None:
        """Counts a call answered by a hedge (``hedges_won``; only the caller knows which copy won)."""
        record_hedge_won = getattr(self._chosen_reporter(), "record_hedge_won", None)
        if record_hedge_won is not None:
            record_hedge_won(self.upstream)

    def record_first_latency(self, success: bool, elapsed: float) -> None:
        record_latency = getattr(self._chosen_reporter(), "record_latency", None)
        if record_latency is not None:
            record_latency(self.upstream, success, elapsed)


class _Call:
    """One intercepted call across its attempts."""

    def __init__(self, policy: _Policy, method: str, timeout: Optional[float],
                 clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.method = method
        self.idempotency = policy.idempotency_of(method)
        total = timeout if timeout is not None else policy.deadline
        self.deadline_at = None if total is None else clock() + total
        self.attempt = 0
        self.previous_backoff: Optional[float] = None
        self.auth_refresh_attempted = False
        # The request being served when the call starts (docs/lineage.md).
        self.lineage = current_lineage()
        self.sent_at = clock()
        #: retryd's answers to this call's hedge requests.
        self.hedge_decisions: list[Decision] = []

    def elapsed(self) -> float:
        return self.clock() - self.sent_at

    def remaining(self) -> Optional[float]:
        return None if self.deadline_at is None else max(0.0, self.deadline_at - self.clock())

    def carry_lineage(self, metadata: Any) -> list[tuple[str, Any]]:
        """The attempt's metadata with ``<lineage>/<layer>:<attempt>`` in its baggage, other members untouched."""
        pairs = list(metadata or ())
        baggage = [value if isinstance(value, str) else bytes(value).decode("latin-1")
                   for key, value in pairs if key.lower() == "baggage"]
        sent = format_lineage(parse_lineage(self.lineage) + [(self.policy.retryd.layer, self.attempt)])
        return [(key, value) for key, value in pairs if key.lower() != "baggage"] + [
            ("baggage", baggage_with_lineage(baggage, sent))]

    def begin(self) -> Optional[float]:
        """Counts the attempt; returns its timeout (the rest of the deadline, or less)."""
        self.attempt += 1
        if self.attempt == 1 and self.policy.retries:
            self.policy.record_first_attempt()
        self.sent_at = self.clock()
        remaining = self.remaining()
        limit = self.policy.attempt_timeout
        if limit is None:
            return remaining
        return limit if remaining is None else min(limit, remaining)

    def decide_kwargs(self, outcome: GrpcOutcome) -> dict[str, Any]:
        return dict(
            upstream=self.policy.upstream,
            idempotency=self.idempotency,
            attempt=self.attempt,
            operation=self.method,
            body=self.policy.body,
            deadline_remaining=self.remaining(),
            auth_refresh_attempted=self.auth_refresh_attempted,
            previous_backoff=self.previous_backoff,
            max_attempts=self.policy.max_attempts,
            lineage=self.lineage,
            **outcome.decide_kwargs(),
        )

    def retrying(self, decision: Decision) -> bool:
        return decision.should_retry and self.attempt < _MAX_LOOP

    def backoff(self, decision: Decision) -> float:
        self.previous_backoff = decision.backoff or None
        if decision.refresh_credentials:
            self.auth_refresh_attempted = True
        remaining = self.remaining()
        return decision.backoff if remaining is None else min(decision.backoff, remaining)

    def out_of_time(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0


class _Details(NamedTuple):
    method: str
    timeout: Optional[float]
    metadata: Any
    credentials: Optional[grpc.CallCredentials]
    wait_for_ready: Optional[bool]
    compression: Any


class _SyncDetails(_Details, grpc.ClientCallDetails):
    """grpc.ClientCallDetails is abstract; grpcio reads these attributes."""


class RetryInterceptor(grpc.UnaryUnaryClientInterceptor):
    """A grpcio unary-unary client interceptor governed by retryd.

    ``retryd`` is a :class:`retryd.Client`; ``upstream`` names the budget;
    ``idempotency`` says, per method, how safe a replay is (required: see
    :data:`IdempotencyRule`). ``deadline`` (seconds) is used for calls made
    without ``timeout=``; ``attempt_timeout`` bounds each attempt, so that a
    hung attempt leaves time for another. ``on_refresh_credentials`` is
    called before the one replay retryd allows after UNAUTHENTICATED; it may
    return metadata entries to replace on the replay. ``retries=False``
    only classifies. A unary request is a message with a deterministic
    codec, so ``body`` defaults to ENCODED_VALUE (replayable). ``sleep``
    waits the backoffs and ``clock`` (monotonic seconds) measures the
    deadline: replace both to run the loop on a fake clock (tests).

    A denied call raises grpcio's own error, carrying ``retryd_decision``
    and ``retryd_outcome`` (see :func:`decision_of`); AMBIGUOUS raises
    :class:`AmbiguousRpcError`. ``.future()`` calls block until the last
    attempt is over.
    """

    def __init__(
        self,
        retryd: Client,
        *,
        upstream: str,
        idempotency: IdempotencyRule,
        retries: bool = True,
        deadline: Optional[Seconds] = None,
        attempt_timeout: Optional[Seconds] = None,
        max_attempts: int = 0,
        body: Optional[Body] = Body.encoded_value(),
        reporter: Any = CLIENT_REPORTER,
        on_refresh_credentials: Optional[Callable[[], RefreshResult]] = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = _Policy(retryd, upstream=upstream, idempotency=idempotency, retries=retries,
                               deadline=deadline, attempt_timeout=attempt_timeout, max_attempts=max_attempts,
                               body=body, reporter=reporter)
        self._retryd = retryd
        self._refresh = on_refresh_credentials
        self._sleep = sleep
        self._clock = clock

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        state = _Call(self._policy, _method_name(client_call_details.method), client_call_details.timeout,
                      self._clock)
        metadata = client_call_details.metadata
        table = self._retryd.hedging
        body = self._policy.body
        plan = (table.plan(self._policy.upstream, state.idempotency)
                if self._policy.retries and (body is None or body.replayability != Replayability.ONE_SHOT) else None)

        def send() -> Any:
            timeout = state.begin()
            details = _SyncDetails(
                client_call_details.method,
                timeout,
                state.carry_lineage(metadata),
                client_call_details.credentials,
                client_call_details.wait_for_ready,
                getattr(client_call_details, "compression", None),
            )
            return continuation(details, request)

        while True:
            first = state.attempt == 0
            if first:
                table.first_attempt()
            outcome = send()
            # A .future() call comes back still running, and can be cancelled:
            # that is the one a blocking interceptor can hedge (a blocking
            # call has already ended here).
            if first and plan is not None and not outcome.done():
                outcome = self._hedged(state, plan, outcome, send)
                error = outcome.exception()
            else:
                error = outcome.exception()
                self._policy.record_outcome(state.attempt, error, state.elapsed())
            if error is None or not isinstance(error, grpc.RpcError):
                return outcome  # a response, or a failure that is no RPC's (passed through)
            classified = classify_rpc_error(error)
            if not self._policy.retries:
                _attach(error, classified, None, state.attempt)
                return outcome
            decision = (self._retryd.decide_past_deadline(**state.decide_kwargs(classified))
                        if state.out_of_time() else self._retryd.decide(**state.decide_kwargs(classified)))
            _attach(error, classified, decision, state.attempt)
            retry = state.retrying(decision)
            if retry and decision.refresh_credentials:
                if self._refresh is None:
                    retry = False
                else:
                    replace = self._refresh()
                    if replace:
                        metadata = _merge(metadata, replace)
            if retry:
                wait = state.backoff(decision)
                if wait > 0:
                    self._sleep(wait)  # no call is in flight while waiting
                retry = not state.out_of_time()
            if not retry:
                record_failure_after_decision()
                # An unknown outcome (AMBIGUOUS, or a DENY with a mark) is never the plain failure.
                return AmbiguousRpcError(decision, error) if decision.is_outcome_unknown else outcome

    def _hedged(self, state: _Call, plan: HedgePlan, first: Any, send: Callable[[], Any]) -> Any:
        """The first call and its hedges (retryd.hedge_threads), every copy that answered counted."""
        sent_at = state.sent_at

        def ask(hedge: int) -> Decision:
            return self._retryd.decide_hedge(upstream=self._policy.upstream, idempotency=state.idempotency,
                                             hedge=hedge, attempt=state.attempt, operation=state.method,
                                             deadline_remaining=state.remaining(), body=self._policy.body,
                                             lineage=state.lineage)

        def final(future: Any) -> bool:
            error = future.exception()
            return error is None or attempt_succeeded(error) is not False

        def on_end(copy: int, future: Any, elapsed: float) -> None:
            self._policy.record_outcome(state.attempt, future.exception(), elapsed, retry=copy > 0)

        hedged = run_hedged_blocking(plan=plan, first=first, start_copy=lambda copy: send(), is_final=final,
                                     ask=ask, on_end=on_end,
                                     on_first_cancelled=lambda elapsed: self._policy.record_first_latency(True, elapsed),
                                     clock=state.clock, remaining=state.remaining, first_sent_at=sent_at)
        state.hedge_decisions.extend(hedged.decisions)
        if hedged.copy > 0 and final(hedged.result):
            self._policy.record_hedge_won()
        return hedged.result


class AsyncRetryInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """The asyncio twin of :class:`RetryInterceptor`, for ``grpc.aio`` channels.

    ``retryd`` is a :class:`retryd.AsyncClient`. AMBIGUOUS raises
    :class:`AmbiguousAioRpcError`; a denied call raises grpcio's
    ``AioRpcError`` with ``retryd_decision`` and ``retryd_outcome``.
    ``on_refresh_credentials`` may be a coroutine function.
    """

    def __init__(
        self,
        retryd: AsyncClient,
        *,
        upstream: str,
        idempotency: IdempotencyRule,
        retries: bool = True,
        deadline: Optional[Seconds] = None,
        attempt_timeout: Optional[Seconds] = None,
        max_attempts: int = 0,
        body: Optional[Body] = Body.encoded_value(),
        reporter: Any = CLIENT_REPORTER,
        on_refresh_credentials: Optional[Callable[[], Union[RefreshResult, Awaitable[RefreshResult]]]] = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = _Policy(retryd, upstream=upstream, idempotency=idempotency, retries=retries,
                               deadline=deadline, attempt_timeout=attempt_timeout, max_attempts=max_attempts,
                               body=body, reporter=reporter)
        self._retryd = retryd
        self._refresh = on_refresh_credentials
        self._sleep = sleep
        self._clock = clock

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        state = _Call(self._policy, _method_name(client_call_details.method), client_call_details.timeout,
                      self._clock)
        metadata = client_call_details.metadata
        table = self._retryd.hedging
        # A unary call with a replayable request (the default body) may be hedged.
        body = self._policy.body
        plan = (table.plan(self._policy.upstream, state.idempotency)
                if self._policy.retries and (body is None or body.replayability != Replayability.ONE_SHOT) else None)

        async def attempt() -> tuple[Any, Optional[grpc.aio.AioRpcError]]:
            details = grpc.aio.ClientCallDetails(
                client_call_details.method,
                state.begin(),
                grpc.aio.Metadata(*state.carry_lineage(metadata)),
                client_call_details.credentials,
                client_call_details.wait_for_ready,
            )
            call = await continuation(details, request)
            try:
                await call
            except grpc.aio.AioRpcError as error:
                return call, error
            except asyncio.CancelledError:
                call.cancel()  # a hedge answered first: the upstream sees the call cancelled
                raise
            return call, None

        while True:
            if state.attempt == 0:
                table.first_attempt()
            hedged = state.attempt == 0 and plan is not None
            if hedged:
                assert plan is not None
                # Every copy that answered is counted inside the round.
                call, error = await self._hedged(state, plan, attempt)
            else:
                call, error = await attempt()
                if error is not None:
                    self._policy.record_outcome(state.attempt, error, state.elapsed())
            if error is not None:
                classified = classify_rpc_error(error)
                if not self._policy.retries:
                    _attach(error, classified, None, state.attempt)
                    raise error
                decision = (self._retryd.decide_past_deadline(**state.decide_kwargs(classified))
                            if state.out_of_time() else await self._retryd.decide(**state.decide_kwargs(classified)))
                _attach(error, classified, decision, state.attempt)
                retry = state.retrying(decision)
                if retry and decision.refresh_credentials:
                    if self._refresh is None:
                        retry = False
                    else:
                        result = self._refresh()
                        replace = await result if inspect.isawaitable(result) else result
                        if replace:
                            metadata = grpc.aio.Metadata(*_merge(metadata, replace))
                if retry:
                    wait = state.backoff(decision)
                    if wait > 0:
                        await self._sleep(wait)
                    retry = not state.out_of_time()
                if not retry:
                    record_failure_after_decision()
                    if decision.is_outcome_unknown:
                        raise AmbiguousAioRpcError(decision, error) from error
                    raise error
            else:
                if not hedged:
                    self._policy.record_outcome(state.attempt, None, state.elapsed())
                return call

    async def _hedged(self, state: _Call, plan: HedgePlan,
                      attempt: Callable[[], Awaitable[tuple[Any, Optional[grpc.aio.AioRpcError]]]]
                      ) -> tuple[Any, Optional[grpc.aio.AioRpcError]]:
        """The first attempt and its hedges (retryd.hedge_runner), every copy that answered counted."""

        def ask(hedge: int) -> Awaitable[Decision]:
            return self._retryd.decide_hedge(upstream=self._policy.upstream, idempotency=state.idempotency,
                                             hedge=hedge, attempt=state.attempt, operation=state.method,
                                             deadline_remaining=state.remaining(), body=self._policy.body,
                                             lineage=state.lineage)

        def on_end(copy: int, result: tuple[Any, Optional[grpc.aio.AioRpcError]], elapsed: float) -> None:
            self._policy.record_outcome(state.attempt, result[1], elapsed, retry=copy > 0)

        def final(result: tuple[Any, Optional[grpc.aio.AioRpcError]]) -> bool:
            error = result[1]
            return error is None or attempt_succeeded(error) is not False

        hedged = await run_hedged(plan=plan, start_copy=lambda copy: attempt(), is_final=final, ask=ask,
                                  on_end=on_end,
                                  on_first_cancelled=lambda elapsed: self._policy.record_first_latency(True, elapsed),
                                  clock=state.clock, remaining=state.remaining)
        state.hedge_decisions.extend(hedged.decisions)
        if hedged.copy > 0 and final(hedged.result):
            self._policy.record_hedge_won()
        return hedged.result


__all__ = [
    "AmbiguousAioRpcError",
    "AmbiguousRpcError",
    "AsyncRetryInterceptor",
    "CLIENT_REPORTER",
    "FAILURE_CODES",
    "GrpcOutcome",
    "IdempotencyRule",
    "PUSHBACK_TRAILER",
    "RetryInterceptor",
    "attempts_of",
    "classify_rpc_error",
    "decision_of",
    "attempt_succeeded",
    "outcome_of",
]
