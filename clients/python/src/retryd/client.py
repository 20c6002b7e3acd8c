"""Blocking and asyncio clients of retryd.v1.

About 970 lines because the blocking and asyncio clients are written out side
by side (the same calls, one with ``await``), so that each reads on its own;
their shared request building and answers are helpers here (a hedge's
request and local answer are :mod:`retryd.hedging`'s).

Both clients put a short timeout on every decision (``timeout``, 200 ms by
default, further bounded by the caller's own remaining deadline), attach the
active OpenTelemetry trace context, and fall back to the conservative local
rule of :mod:`retryd.fallback` when retryd cannot answer in time (logging
one warning per outage, not one per decision). An invalid request is never
hidden by the fallback: it raises :class:`~retryd.errors.InvalidRequestError`.
A shadow answer (an upstream with ``enforce = false``) is not acted on: the
same local rule decides, and differences are counted and logged
(:mod:`retryd.shadow`).
Each client owns one traffic reporter (``reporter``), closed with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import grpc
import grpc.aio
from google.protobuf import duration_pb2

from ._types import (
    Body,
    Budget,
    Decision,
    DenyReason,
    Evidence,
    EvidenceLike,
    FailureKind,
    FailureKindLike,
    GrpcCodeLike,
    IdempotencyLike,
    UnknownOutcome,
    Verdict,
)
from .errors import InvalidRequestError, RetrydError, RetrydUnavailableError
from .fallback import DEFAULT_LOCAL_POLICY, LocalPolicy, local_decide
from .hedging import (
    HedgingTable,
    LocalHedging,
    check_hedge_args,
    hedge_request,
    hedging_from_pb,
    local_hedge_decision,
)
from .lineage import check_layer
from .outage import Outage
from .reporter import MAX_TRAFFIC_ENTRIES, AsyncTrafficReporter, ReportResult, Traffic, TrafficReporter
from .shadow import DEFAULT_SHADOW_LOG_INTERVAL, ShadowDivergences, differs
from .tracing import trace_metadata
from .v1 import retryd_pb2 as pb
from .v1 import retryd_pb2_grpc as pb_grpc

log = logging.getLogger("retryd")

#: Seconds, or a timedelta.
Seconds = Union[float, int, timedelta]

#: Codes of a report that say retryd could not be reached (local hedging may start).
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

#: The least time a decision call gets when the caller's deadline is nearly over.
_MIN_CALL_TIMEOUT = 0.05

#: How long after a client is built a decision may wait for its first
#: connection to retryd, before its own ``timeout`` starts (seconds).
DEFAULT_CONNECT_TIMEOUT = 1.0

#: Connectivity states that end the wait for the first connection: ready, or
#: failed (nothing listens: waiting longer would only delay the fallback).
_SETTLED = frozenset({grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                      grpc.ChannelConnectivity.SHUTDOWN})

#: Channel options the clients start from: reconnect quickly after retryd
#: restarts (gRPC's own default backs off up to two minutes, all of which the
#: fallback would have to cover). Options passed by the caller win.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def _channel_options(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    merged = dict(DEFAULT_CHANNEL_OPTIONS)
    merged.update(dict(options))
    return list(merged.items())


def _seconds(value: Optional[Seconds]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def _duration(value: Optional[Seconds]) -> Optional[duration_pb2.Duration]:
    """A protobuf Duration; negative values are sent as they are (retryd rejects them)."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        total_nanos = (value.days * 86_400 + value.seconds) * 10**9 + value.microseconds * 1000
    else:
        total_nanos = round(float(value) * 1e9)
    seconds = int(total_nanos / 10**9)  # toward zero, so nanos share the sign
    return duration_pb2.Duration(seconds=seconds, nanos=total_nanos - seconds * 10**9)


def _from_duration(value: duration_pb2.Duration) -> float:
    return float(value.seconds) + value.nanos / 1e9


def _body_message(body: Body) -> pb.Body:
    message = pb.Body(kind=int(body.kind), declared=int(body.declared or 0))  # type: ignore[arg-type]
    message.parts.extend(_body_message(part) for part in body.parts)
    return message


def _enum(enum_type: Any, value: int) -> Any:
    try:
        return enum_type(value)
    except ValueError:  # a value newer than this client
        return enum_type(0)


def _decision(response: pb.DecideResponse) -> Decision:
    return Decision(
        verdict=_enum(Verdict, response.verdict),
        backoff=_from_duration(response.backoff),
        deny_reason=_enum(DenyReason, response.deny_reason),
        refresh_credentials=response.refresh_credentials,
        rule=response.rule,
        effective_evidence=_enum(Evidence, response.effective_evidence),
        evidence_adjusted=response.evidence_adjusted,
        decision_id=response.decision_id,
        tokens_remaining=response.tokens_remaining,
        explanation=response.explanation,
        shadow=response.shadow,
        unknown_outcome=_unknown_outcome(response.unknown_outcome),
    )


def _unknown_outcome(value: int) -> UnknownOutcome:
    try:
        return UnknownOutcome(value)
    except ValueError:  # a mark newer than this client: still "it may have happened"
        return UnknownOutcome.RECONCILE


def _budget(message: pb.Budget) -> Budget:
    return Budget(
        upstream=message.upstream,
        tokens=message.tokens,
        capacity=message.capacity,
        ratio=message.ratio,
        min_per_second=message.min_per_second,
        retries_enabled=message.retries_enabled,
        tracked=message.tracked,
        hedging=hedging_from_pb(message.hedging) if message.HasField("hedging") else None,
    )


def _upstream_traffic(entry: Union[Traffic, tuple[str, int]]) -> pb.UpstreamTraffic:
    """One entry: a :class:`Traffic`, or a plain ``(upstream, requests)`` pair (no outcomes)."""
    t = Traffic(*entry)
    message = pb.UpstreamTraffic(upstream=t.upstream, requests=t.requests, successes=t.successes,
                                 failures=t.failures, retry_successes=t.retry_successes,
                                 retry_failures=t.retry_failures, hedges_won=t.hedges_won)
    # Absent, not empty, when nothing was recorded: "this caller reports no latency".
    if t.latency_successes:
        message.latency_successes.counts.update(dict(t.latency_successes))
    if t.latency_failures:
        message.latency_failures.counts.update(dict(t.latency_failures))
    return message


def _report_result(response: pb.ReportTrafficResponse, table: HedgingTable) -> ReportResult:
    """The answer to a report; its hedging goes into the client's table on the way."""
    hedging = tuple(hedging_from_pb(entry) for entry in response.hedging)
    table.update(hedging)
    return ReportResult(accepted=response.accepted, already_applied=response.already_applied, hedging=hedging)


def _report_request(traffic: Sequence[Union[Traffic, tuple[str, int]]], report_id: str) -> pb.ReportTrafficRequest:
    if len(traffic) > MAX_TRAFFIC_ENTRIES:
        raise ValueError(f"traffic: at most {MAX_TRAFFIC_ENTRIES} entries per report, got {len(traffic)}")
    return pb.ReportTrafficRequest(traffic=[_upstream_traffic(entry) for entry in traffic], report_id=report_id)


def _traffic_requests(
    counts: Union[Mapping[str, int], Iterable[tuple[str, int]]],
) -> list[pb.ReportTrafficRequest]:
    items = list(counts.items() if isinstance(counts, Mapping) else counts)
    entries = [pb.UpstreamTraffic(upstream=upstream, requests=n) for upstream, n in items if n > 0]
    return [
        pb.ReportTrafficRequest(traffic=entries[start : start + MAX_TRAFFIC_ENTRIES])
        for start in range(0, len(entries), MAX_TRAFFIC_ENTRIES)
    ]


class _ConnectWindow:
    """The bound on waiting for the first connection, shared by both clients.

    Both clients start connecting when they are built (a connection is
    otherwise made by the first call, whose short ``timeout`` it would
    spend: on a busy host the first decision would then be the fallback's).
    A decision made while that first connection is being set up waits for
    it, up to ``connect_timeout`` after the client was built and never past
    the caller's own remaining deadline; then its own ``timeout`` starts.
    """

    def __init__(self, connect_timeout: float) -> None:
        if not connect_timeout >= 0:
            raise ValueError(f"connect_timeout: must be at least 0 seconds, got {connect_timeout!r}")
        self.connect_by = time.monotonic() + connect_timeout

    def wait_limit(self, deadline_remaining: Optional[float]) -> float:
        wait = self.connect_by - time.monotonic()
        if deadline_remaining is not None:
            wait = min(wait, deadline_remaining)
        return max(0.0, wait)

    @staticmethod
    def left(deadline_remaining: Optional[float], since: float) -> Optional[float]:
        """The caller's remaining deadline, less the time waited since ``since``."""
        if deadline_remaining is None:
            return None
        return max(0.0, deadline_remaining - (time.monotonic() - since))


#: How often a decision waiting for the first connection looks at the channel.
_CONNECT_POLL = 0.005

#: grpcio's connectivity states by the numbers its core channel reports.
_CORE_SETTLED = frozenset(state.value[0] for state in _SETTLED)


class _SyncConnecting(_ConnectWindow):
    """Connects a blocking channel at once; ``wait`` polls it until it settles (bounded).

    grpcio's blocking channel has no public ``get_state``; its
    ``subscribe`` runs a polling thread for as long as anyone is
    subscribed, and closing the channel then waits up to 200 ms for it.
    So this asks the core channel directly, as that polling thread does
    (``check_connectivity_state``): once with ``try_to_connect`` when the
    client is built, then, only while a decision waits, every 5 ms. On a
    grpcio without it (the tests pin the version that has it) the first
    call connects, as before.
    """

    def __init__(self, channel: grpc.Channel, connect_timeout: float) -> None:
        super().__init__(connect_timeout)
        self._core = getattr(channel, "_channel", None)
        self._settled = self._core is None or not hasattr(self._core, "check_connectivity_state")
        if not self._settled:
            self._state(try_to_connect=True)

    def _state(self, *, try_to_connect: bool) -> bool:
        """Whether the channel is settled (ready, failed or shut down)."""
        assert self._core is not None
        settled = self._core.check_connectivity_state(try_to_connect) in _CORE_SETTLED
        if settled:
            self._settled = True
        return bool(settled)

    def wait(self, deadline_remaining: Optional[float]) -> Optional[float]:
        """Waits (bounded) for the first connection; returns what is left of the caller's deadline."""
        if self._settled:
            return deadline_remaining
        since = time.monotonic()
        give_up = since + self.wait_limit(deadline_remaining)
        while not self._state(try_to_connect=False) and time.monotonic() < give_up:
            time.sleep(_CONNECT_POLL)
        if time.monotonic() >= self.connect_by:
            self._settled = True  # the window is over: never wait again
        return self.left(deadline_remaining, since)

    def close(self) -> None:
        self._settled = True


class _AsyncConnecting(_ConnectWindow):
    """Connects a grpc.aio channel at once (a task of the running loop); ``wait`` awaits it (bounded)."""

    def __init__(self, channel: grpc.aio.Channel, connect_timeout: float) -> None:
        super().__init__(connect_timeout)
        self._channel = channel
        try:
            self._task: Optional[asyncio.Task[None]] = asyncio.get_running_loop().create_task(self._connect())
        except RuntimeError:  # built outside a loop: the first call connects
            self._task = None

    async def _connect(self) -> None:
        state = self._channel.get_state(try_to_connect=True)
        while state not in _SETTLED:
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)

    async def wait(self, deadline_remaining: Optional[float]) -> Optional[float]:
        """Waits (bounded) for the first connection; returns what is left of the caller's deadline."""
        task = self._task
        if task is None or task.done():
            return deadline_remaining
        since = time.monotonic()
        limit = self.wait_limit(deadline_remaining)
        if limit > 0:
            try:
                await asyncio.wait_for(asyncio.shield(task), limit)
            except asyncio.TimeoutError:
                pass
        return self.left(deadline_remaining, since)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Base:
    """What both clients share: argument mapping, metadata, fallback."""

    def __init__(
        self,
        *,
        timeout: float,
        fallback: Optional[LocalPolicy],
        metadata: Sequence[tuple[str, str]],
        shadow_log_interval: float,
        layer: Optional[str],
        report_interval: float = 1.0,
        local_hedging: Optional[LocalHedging] = None,
    ) -> None:
        self.timeout = timeout
        #: The hedging retryd served with the reporter's answers (retryd.hedging),
        #: kept three report intervals after an upstream's last entry.
        self.hedging = HedgingTable(keep_for=3 * report_interval, local=local_hedging)
        #: This service's name in a call chain's lineage (docs/lineage.md): the
        #: adapters send ``<inbound lineage>/<layer>:<attempt>`` on each attempt.
        self.layer = check_layer(layer)
        self.fallback = fallback
        self._metadata = list(metadata)
        #: The fallback's outage: one warning when retryd stops answering, one when it is back.
        self.outage = Outage("decisions", "made by the local rule")
        self._shadow = ShadowDivergences(interval=float(shadow_log_interval), logger=log)

    @property
    def shadow_divergences(self) -> Mapping[str, int]:
        """How many shadow answers disagreed with the local rule, per upstream (a snapshot).

        A shadow answer "disagrees" when retryd's verdict or deny reason is
        not the local rule's. Upstreams with no difference are absent.
        """
        return self._shadow.counts()

    def _answered(self, response: pb.DecideResponse, args: dict[str, Any]) -> Decision:
        """The decision to act on for retryd's answer: retryd's own, or the local rule's for a shadow answer."""
        self._reachable()
        decision = _decision(response)
        if not decision.shadow:
            return decision
        # Not enforced: decide as the client would without retryd (the
        # fallback rule; its default limits when the fallback is switched
        # off, since retryd did answer), and keep retryd's answer beside it.
        local = self._local(args, self.fallback or DEFAULT_LOCAL_POLICY,
                            "retryd shadow answer, not enforced (upstream in shadow mode)")
        if differs(decision, local):
            self._shadow.record(args["upstream"], decision, local)
        return dataclasses.replace(local, fallback=False, shadow=True, retryd_decision=decision,
                                   decision_id=decision.decision_id)

    @staticmethod
    def _local(args: dict[str, Any], policy: LocalPolicy, reason: str) -> Decision:
        return local_decide(
            policy=policy,
            idempotency=args["idempotency"],
            attempt=args["attempt"],
            evidence=args["evidence"],
            failure=args["failure"],
            http_status=args["http_status"],
            retry_after=args["retry_after"],
            deadline_remaining=_seconds(args["deadline_remaining"]),
            body=args["body"],
            first_byte_delivered=args["first_byte_delivered"],
            runtime_draining=args["runtime_draining"],
            auth_refresh_attempted=args["auth_refresh_attempted"],
            max_attempts=args["max_attempts"],
            grpc_status_code=int(args["grpc_status_code"]),
            grpc_retry_pushback_ms=args["grpc_retry_pushback_ms"],
            lineage=args["lineage"],
            retried_below=args["retried_below"],
            reason=reason,
        )

    def decide_past_deadline(self, **kwargs: Any) -> Decision:
        """Decides, without asking retryd, an attempt that ended because the caller's deadline passed.

        Takes the keyword arguments of :meth:`Client.decide`. No retry fits
        in a deadline that is over, and asking retryd would only keep the
        caller waiting past it; the local rule answers at once, with the
        mark retryd would give (so a non-idempotent call that was sent
        surfaces as ambiguous, never as a plain failure). The adapters call
        this; ``fallback`` is False on the answer, since retryd was not
        unreachable.
        """
        args = {**_DECIDE_DEFAULTS, **kwargs, "deadline_remaining": 0.0}
        local = self._local(args, self.fallback or DEFAULT_LOCAL_POLICY,
                            "decided locally: the caller's deadline passed during the attempt")
        return dataclasses.replace(local, fallback=False)

    def _reachable(self) -> None:
        self.outage.succeeded(getattr(self, "target", "?"))

    def _call_metadata(self) -> list[tuple[str, str]]:
        return self._metadata + trace_metadata()

    def _call_timeout(self, deadline_remaining: Optional[float], timeout: Optional[float]) -> float:
        if timeout is not None:
            return timeout  # chosen for this call by the caller: used as given
        limit = self.timeout
        if deadline_remaining is not None:
            # Waiting for retryd longer than the caller has left is pointless,
            # but leave it a few milliseconds to say DENY DEADLINE itself.
            limit = min(limit, max(deadline_remaining, _MIN_CALL_TIMEOUT))
        return limit

    @staticmethod
    def _request(args: dict[str, Any]) -> pb.DecideRequest:
        request = pb.DecideRequest(
            upstream=args["upstream"],
            operation=args["operation"],
            idempotency=int(args["idempotency"]),  # type: ignore[arg-type]
            attempt=args["attempt"],
            evidence=int(args["evidence"]),  # type: ignore[arg-type]
            failure=int(args["failure"]),  # type: ignore[arg-type]
            http_status=args["http_status"],
            retry_after=args["retry_after"] or "",
            first_byte_delivered=args["first_byte_delivered"],
            runtime_draining=args["runtime_draining"],
            auth_refresh_attempted=args["auth_refresh_attempted"],
            max_attempts=args["max_attempts"],
            grpc_status_code=int(args["grpc_status_code"]),
            lineage=args["lineage"],
            retried_below=args["retried_below"],
        )
        if args["grpc_retry_pushback_ms"] is not None:
            # Presence matters: an empty value is garbage (DENY SERVER_PUSHBACK),
            # an absent one is no pushback at all.
            request.grpc_retry_pushback_ms = args["grpc_retry_pushback_ms"]
        if args["body"] is not None:
            request.body.CopyFrom(_body_message(args["body"]))
        deadline = _duration(args["deadline_remaining"])
        if deadline is not None:
            request.deadline_remaining.CopyFrom(deadline)
        previous = _duration(args["previous_backoff"])
        if previous is not None:
            request.previous_backoff.CopyFrom(previous)
        return request

    def _on_error(self, error: grpc.RpcError, args: dict[str, Any]) -> Decision:
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequestError(details) from None
        if self.fallback is None:
            raise RetrydUnavailableError(f"retryd: {code.name}: {details}", code) from error
        if not args["upstream"]:
            raise InvalidRequestError("upstream: required")
        if int(args["idempotency"]) == 0:
            raise InvalidRequestError("idempotency: required")
        if args["attempt"] < 1:
            raise InvalidRequestError("attempt: must be at least 1")
        # One warning per outage (a busy caller decides thousands of times a
        # second), and one with the count when retryd answers again.
        self.outage.failed(f"{code.name}: {details}", getattr(self, "target", "?"))
        return self._local(args, self.fallback, f"retryd unreachable ({code.name})")

    def _on_hedge_error(self, error: grpc.RpcError, args: dict[str, Any]) -> Decision:
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequestError(details) from None
        if self.hedging.local is None:
            raise RetrydUnavailableError(f"retryd: {code.name}: {details}", code) from error
        check_hedge_args(args)
        self.hedging.unreachable = True
        self.outage.failed(f"{code.name}: {details}", getattr(self, "target", "?"))
        decision: Decision = local_hedge_decision(self.hedging, args, f"retryd unreachable ({code.name})")
        return decision

    def _hedge_answered(self, response: pb.DecideResponse, args: dict[str, Any]) -> Decision:
        """The hedge decision to act on: retryd's, or for a shadow answer the local hedging's."""
        self._reachable()
        decision = _decision(response)
        if not decision.shadow:
            return decision
        # Not enforced (the upstream is in shadow mode): hedge as the client
        # would without retryd (its local hedging, else not at all).
        local: Decision = local_hedge_decision(self.hedging, args,
                                               "retryd shadow answer, not enforced (upstream in shadow mode)")
        return dataclasses.replace(local, fallback=False, shadow=True, retryd_decision=decision,
                                   decision_id=decision.decision_id)

    @staticmethod
    def _hedge_args(upstream: str, idempotency: IdempotencyLike, hedge: int, attempt: int, operation: str,
                    deadline_remaining: Optional[Seconds], body: Optional[Body], lineage: str) -> dict[str, Any]:
        return dict(upstream=upstream, idempotency=idempotency, hedge=hedge, attempt=attempt,
                    operation=operation, deadline_remaining=deadline_remaining, body=body, lineage=lineage)

    @staticmethod
    def _unavailable(error: grpc.RpcError) -> RetrydError:
        code = error.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequestError(error.details() or "")
        return RetrydUnavailableError(f"retryd: {code.name}: {error.details()}", code)


def _args(
    upstream: str,
    idempotency: IdempotencyLike,
    attempt: int,
    operation: str,
    evidence: EvidenceLike,
    failure: FailureKindLike,
    http_status: int,
    retry_after: Optional[str],
    deadline_remaining: Optional[Seconds],
    body: Optional[Body],
    first_byte_delivered: bool,
    runtime_draining: bool,
    auth_refresh_attempted: bool,
    previous_backoff: Optional[Seconds],
    max_attempts: int,
    grpc_status_code: GrpcCodeLike,
    grpc_retry_pushback_ms: Optional[str],
    lineage: str = "",
    retried_below: str = "",
) -> dict[str, Any]:
    return dict(
        upstream=upstream,
        idempotency=idempotency,
        attempt=attempt,
        operation=operation,
        evidence=evidence,
        failure=failure,
        http_status=http_status,
        retry_after=retry_after,
        deadline_remaining=deadline_remaining,
        body=body,
        first_byte_delivered=first_byte_delivered,
        runtime_draining=runtime_draining,
        auth_refresh_attempted=auth_refresh_attempted,
        previous_backoff=previous_backoff,
        max_attempts=max_attempts,
        grpc_status_code=grpc_status_code,
        grpc_retry_pushback_ms=grpc_retry_pushback_ms,
        lineage=lineage,
        retried_below=retried_below,
    )


#: The defaults of every optional argument of ``decide``.
_DECIDE_DEFAULTS: dict[str, Any] = dict(
    operation="", evidence=Evidence.UNSPECIFIED, failure=FailureKind.UNSPECIFIED, http_status=0,
    retry_after=None, deadline_remaining=None, body=None, first_byte_delivered=False,
    runtime_draining=False, auth_refresh_attempted=False, previous_backoff=None, max_attempts=0,
    grpc_status_code=0, grpc_retry_pushback_ms=None, lineage="", retried_below="",
)


class Client(_Base):
    """A blocking retryd client. Thread-safe; share one per process.

    ``target`` is a gRPC target such as ``"127.0.0.1:50051"``. ``timeout``
    (seconds) bounds every decision call. ``fallback`` is the local rule
    used when retryd cannot answer (``None`` raises
    :class:`RetrydUnavailableError` instead). ``credentials`` switches to
    TLS; ``metadata`` is sent with every call (for example an authorization
    header). The client starts connecting at once; a decision made before
    that first connection is set up waits for it up to ``connect_timeout``
    seconds after the client was built (and never past the caller's
    deadline), so that connecting is not charged to the decision's own
    ``timeout``.

    The client owns one :class:`~retryd.reporter.TrafficReporter`
    (:attr:`reporter`, started on first use, sending every
    ``report_interval`` seconds) that the adapters count first attempts on;
    :meth:`close` stops it and sends what is left.

    For an upstream in shadow mode (retryd answers ``shadow``), the client
    acts on its own local rule, not on retryd's decision
    (:attr:`Decision.shadow`, :attr:`Decision.retryd_decision`); differences
    are counted in :attr:`shadow_divergences` and logged on the ``retryd``
    logger at most once per upstream every ``shadow_log_interval`` seconds.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 0.2,
        fallback: Optional[LocalPolicy] = DEFAULT_LOCAL_POLICY,
        credentials: Optional[grpc.ChannelCredentials] = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, Any]] = (),
        report_interval: float = 1.0,
        shadow_log_interval: float = DEFAULT_SHADOW_LOG_INTERVAL,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        layer: Optional[str] = None,
        local_hedging: Optional[LocalHedging] = None,
    ) -> None:
        super().__init__(timeout=timeout, fallback=fallback, metadata=metadata,
                         shadow_log_interval=shadow_log_interval, layer=layer,
                         report_interval=report_interval, local_hedging=local_hedging)
        self.target = target
        self.report_interval = report_interval
        self._reporter: Optional[TrafficReporter] = None
        self._reporter_lock = threading.Lock()
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=_channel_options(options))
        else:
            self._channel = grpc.secure_channel(target, credentials, options=_channel_options(options))
        self._connecting = _SyncConnecting(self._channel, connect_timeout)
        self._decider = pb_grpc.RetryDeciderStub(self._channel)  # type: ignore[no-untyped-call]
        self._admin = pb_grpc.RetryAdminStub(self._channel)  # type: ignore[no-untyped-call]

    def decide(
        self,
        *,
        upstream: str,
        idempotency: IdempotencyLike,
        attempt: int,
        operation: str = "",
        evidence: EvidenceLike = Evidence.UNSPECIFIED,
        failure: FailureKindLike = FailureKind.UNSPECIFIED,
        http_status: int = 0,
        retry_after: Optional[str] = None,
        deadline_remaining: Optional[Seconds] = None,
        body: Optional[Body] = None,
        first_byte_delivered: bool = False,
        runtime_draining: bool = False,
        auth_refresh_attempted: bool = False,
        previous_backoff: Optional[Seconds] = None,
        max_attempts: int = 0,
        grpc_status_code: GrpcCodeLike = 0,
        grpc_retry_pushback_ms: Optional[str] = None,
        lineage: str = "",
        retried_below: str = "",
        timeout: Optional[float] = None,
    ) -> Decision:
        """Asks retryd whether the failed ``attempt`` (1 = the first) may be retried.

        Every argument is the DecideRequest field of the same name; see
        proto/retryd/v1/retryd.proto. Durations are seconds or timedeltas.
        For a gRPC call, ``grpc_status_code`` is the code's number (or a
        :class:`~retryd.GrpcCode`) and ``grpc_retry_pushback_ms`` the raw
        trailer value, None when the server sent none. ``lineage`` is the
        inbound request's lineage (docs/lineage.md, without this layer's
        entry) and ``retried_below`` the failed response's ``retryd-retried``
        value; the adapters fill both in from :mod:`retryd.lineage`.

        The call to retryd waits at most the client's ``timeout``, less when
        ``deadline_remaining`` is shorter (never below 50 ms); a ``timeout``
        given here is used as given.
        """
        args = _args(upstream, idempotency, attempt, operation, evidence, failure, http_status,
                     retry_after, deadline_remaining, body, first_byte_delivered, runtime_draining,
                     auth_refresh_attempted, previous_backoff, max_attempts, grpc_status_code,
                     grpc_retry_pushback_ms, lineage, retried_below)
        deadline_remaining = self._connecting.wait(_seconds(deadline_remaining))
        args["deadline_remaining"] = deadline_remaining
        request = self._request(args)
        try:
            response = self._decider.Decide(
                request,
                timeout=self._call_timeout(_seconds(deadline_remaining), timeout),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            return self._on_error(error, args)
        return self._answered(response, args)

    def decide_hedge(
        self,
        *,
        upstream: str,
        idempotency: IdempotencyLike,
        hedge: int,
        attempt: int,
        operation: str = "",
        deadline_remaining: Optional[Seconds] = None,
        body: Optional[Body] = None,
        lineage: str = "",
        timeout: Optional[float] = None,
    ) -> Decision:
        """Asks retryd whether to send the ``hedge``-th hedge (1 = the first) of a call still running.

        ``attempt`` is the number of attempts already sent. A RETRY says
        send it now (it spent a token of the upstream's retry budget); a DENY
        names why (HEDGING_OFF, HEDGE_CAP, UNIFORMLY_SLOW, BUDGET_EXHAUSTED,
        ...). With retryd unreachable, the client's ``local_hedging`` decides
        (:func:`retryd.hedging.local_hedge_decision`), or, without it, this
        raises :class:`RetrydUnavailableError`. The adapters call this when a
        hedge timer fires (retryd.hedging).
        """
        args = self._hedge_args(upstream, idempotency, hedge, attempt, operation, deadline_remaining, body,
                                lineage)
        args["deadline_remaining"] = self._connecting.wait(_seconds(deadline_remaining))
        request = hedge_request(pb, args, _duration, _body_message)
        try:
            response = self._decider.Decide(
                request, timeout=self._call_timeout(_seconds(args["deadline_remaining"]), timeout),
                metadata=self._call_metadata())
        except grpc.RpcError as error:
            return self._on_hedge_error(error, args)
        return self._hedge_answered(response, args)

    @property
    def reporter(self) -> TrafficReporter:
        """This client's traffic reporter, started on first use and closed with the client."""
        with self._reporter_lock:
            if self._reporter is None:
                self._reporter = TrafficReporter(self, interval=self.report_interval).start()
            return self._reporter

    def report_batch(
        self, traffic: Sequence[Union[Traffic, tuple[str, int]]], *, report_id: str = ""
    ) -> ReportResult:
        """Sends one report of at most 1024 entries: :class:`Traffic`, or ``(upstream, requests)`` pairs.

        With a ``report_id``, re-sending the same entries with the same id is
        safe: retryd applies each entry at most once (see ReportTrafficRequest
        in the proto). Raises :class:`RetrydUnavailableError` (with ``.code``)
        or :class:`InvalidRequestError` when the report fails.
        """
        request = _report_request(traffic, report_id)
        try:
            response = self._decider.ReportTraffic(
                request, timeout=max(self.timeout, 1.0), metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            self.hedging.unreachable = error.code() in _UNREACHABLE
            raise self._unavailable(error) from error
        return _report_result(response, self.hedging)

    def report_traffic(self, counts: Union[Mapping[str, int], Iterable[tuple[str, int]]]) -> int:
        """Reports real (first-attempt) requests per upstream now; returns the entries accepted.

        Without a report id: a failed call may or may not have been applied.
        :attr:`reporter` batches, retries and deduplicates for you.
        """
        accepted = 0
        for request in _traffic_requests(counts):
            try:
                response = self._decider.ReportTraffic(
                    request, timeout=max(self.timeout, 1.0), metadata=self._call_metadata()
                )
            except grpc.RpcError as error:
                raise self._unavailable(error) from error
            accepted += response.accepted
        return accepted

    def get_budget(self, upstream: str) -> Budget:
        """The current state of one upstream's budget (admin)."""
        try:
            response = self._admin.GetBudget(
                pb.GetBudgetRequest(upstream=upstream), timeout=max(self.timeout, 1.0),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            raise self._unavailable(error) from error
        return _budget(response.budget)

    def list_budgets(self) -> list[Budget]:
        """Every tracked budget, ordered by upstream (admin)."""
        try:
            response = self._admin.ListBudgets(
                pb.ListBudgetsRequest(), timeout=max(self.timeout, 1.0), metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            raise self._unavailable(error) from error
        return [_budget(budget) for budget in response.budgets]

    def set_retries_enabled(self, upstream: str, enabled: bool, reason: str = "") -> bool:
        """Switches retries on or off for an upstream, fleet-wide; returns the previous state (admin)."""
        try:
            response = self._admin.SetRetriesEnabled(
                pb.SetRetriesEnabledRequest(upstream=upstream, enabled=enabled, reason=reason),
                timeout=max(self.timeout, 1.0),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            raise self._unavailable(error) from error
        return bool(response.previous)

    def close(self) -> None:
        """Stops the reporter, sending what it holds (one try), and closes the channel."""
        with self._reporter_lock:
            reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.close()
        self._connecting.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio twin of :class:`Client` (grpc.aio). Create it inside a running loop.

    Its :attr:`reporter` is an :class:`~retryd.reporter.AsyncTrafficReporter`,
    stopped and flushed by :meth:`close`.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 0.2,
        fallback: Optional[LocalPolicy] = DEFAULT_LOCAL_POLICY,
        credentials: Optional[grpc.ChannelCredentials] = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, Any]] = (),
        report_interval: float = 1.0,
        shadow_log_interval: float = DEFAULT_SHADOW_LOG_INTERVAL,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        layer: Optional[str] = None,
        local_hedging: Optional[LocalHedging] = None,
    ) -> None:
        super().__init__(timeout=timeout, fallback=fallback, metadata=metadata,
                         shadow_log_interval=shadow_log_interval, layer=layer,
                         report_interval=report_interval, local_hedging=local_hedging)
        self.target = target
        self.report_interval = report_interval
        self._reporter: Optional[AsyncTrafficReporter] = None
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_channel_options(options))
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=_channel_options(options))
        self._connecting = _AsyncConnecting(self._channel, connect_timeout)
        self._decider = pb_grpc.RetryDeciderStub(self._channel)  # type: ignore[no-untyped-call]
        self._admin = pb_grpc.RetryAdminStub(self._channel)  # type: ignore[no-untyped-call]

    async def decide(
        self,
        *,
        upstream: str,
        idempotency: IdempotencyLike,
        attempt: int,
        operation: str = "",
        evidence: EvidenceLike = Evidence.UNSPECIFIED,
        failure: FailureKindLike = FailureKind.UNSPECIFIED,
        http_status: int = 0,
        retry_after: Optional[str] = None,
        deadline_remaining: Optional[Seconds] = None,
        body: Optional[Body] = None,
        first_byte_delivered: bool = False,
        runtime_draining: bool = False,
        auth_refresh_attempted: bool = False,
        previous_backoff: Optional[Seconds] = None,
        max_attempts: int = 0,
        grpc_status_code: GrpcCodeLike = 0,
        grpc_retry_pushback_ms: Optional[str] = None,
        lineage: str = "",
        retried_below: str = "",
        timeout: Optional[float] = None,
    ) -> Decision:
        """See :meth:`Client.decide`."""
        args = _args(upstream, idempotency, attempt, operation, evidence, failure, http_status,
                     retry_after, deadline_remaining, body, first_byte_delivered, runtime_draining,
                     auth_refresh_attempted, previous_backoff, max_attempts, grpc_status_code,
                     grpc_retry_pushback_ms, lineage, retried_below)
        deadline_remaining = await self._connecting.wait(_seconds(deadline_remaining))
        args["deadline_remaining"] = deadline_remaining
        request = self._request(args)
        try:
            response = await self._decider.Decide(
                request,
                timeout=self._call_timeout(_seconds(deadline_remaining), timeout),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            return self._on_error(error, args)
        return self._answered(response, args)

    async def decide_hedge(
        self,
        *,
        upstream: str,
        idempotency: IdempotencyLike,
        hedge: int,
        attempt: int,
        operation: str = "",
        deadline_remaining: Optional[Seconds] = None,
        body: Optional[Body] = None,
        lineage: str = "",
        timeout: Optional[float] = None,
    ) -> Decision:
        """See :meth:`Client.decide_hedge`."""
        args = self._hedge_args(upstream, idempotency, hedge, attempt, operation, deadline_remaining, body,
                                lineage)
        args["deadline_remaining"] = await self._connecting.wait(_seconds(deadline_remaining))
        request = hedge_request(pb, args, _duration, _body_message)
        try:
            response = await self._decider.Decide(
                request, timeout=self._call_timeout(_seconds(args["deadline_remaining"]), timeout),
                metadata=self._call_metadata())
        except grpc.RpcError as error:
            return self._on_hedge_error(error, args)
        return self._hedge_answered(response, args)

    @property
    def reporter(self) -> AsyncTrafficReporter:
        """This client's traffic reporter (a task of the running loop), closed with the client."""
        if self._reporter is None:
            self._reporter = AsyncTrafficReporter(self, interval=self.report_interval)
        return self._reporter

    async def report_batch(
        self, traffic: Sequence[Union[Traffic, tuple[str, int]]], *, report_id: str = ""
    ) -> ReportResult:
        """See :meth:`Client.report_batch`."""
        request = _report_request(traffic, report_id)
        try:
            response = await self._decider.ReportTraffic(
                request, timeout=max(self.timeout, 1.0), metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            self.hedging.unreachable = error.code() in _UNREACHABLE
            raise self._unavailable(error) from error
        return _report_result(response, self.hedging)

    async def report_traffic(self, counts: Union[Mapping[str, int], Iterable[tuple[str, int]]]) -> int:
        """See :meth:`Client.report_traffic`."""
        accepted = 0
        for request in _traffic_requests(counts):
            try:
                response = await self._decider.ReportTraffic(
                    request, timeout=max(self.timeout, 1.0), metadata=self._call_metadata()
                )
            except grpc.RpcError as error:
                raise self._unavailable(error) from error
            accepted += response.accepted
        return int(accepted)

    async def get_budget(self, upstream: str) -> Budget:
        """See :meth:`Client.get_budget`."""
        try:
            response = await self._admin.GetBudget(
                pb.GetBudgetRequest(upstream=upstream), timeout=max(self.timeout, 1.0),
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            raise self._unavailable(error) from error
        return _budget(response.budget)

    async def close(self) -> None:
        """Stops the reporter, sending what it holds (one try), and closes the channel."""
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            await reporter.aclose()
        self._connecting.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

