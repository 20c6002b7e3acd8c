"""What the client knows about hedging each upstream, learned from traffic reports.

retryd answers every ``ReportTraffic`` with the current hedging of each
reported upstream that has a hedging policy (``ReportTrafficResponse.hedging``):
whether to hedge, the delay (the fleet's chosen quantile of first-attempt
latency), how many hedges a call may send and which idempotency levels may
be hedged. The reporter sends a batch every interval anyway, so the delay
reaches the client off the request path, with no stream to keep open and no
call on a request's way: a call only reads this table.

An upstream absent from the latest responses keeps its entry for
``3 * report_interval`` seconds, then drops it. Three intervals ride out a
report that failed once or an interval without traffic to that upstream (no
traffic, no entry in the batch), while a delay older than that no longer
describes the fleet: a stale delay would hedge too early (more load) or too
late (no help). Without a fresh entry a call is not hedged, unless retryd is
unreachable and the local fallback (``LocalHedging``) is configured.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ._types import Idempotency, IdempotencyLike
from .hedge_runner import HedgePlan


@dataclass(frozen=True)
class Hedging:
    """One upstream's hedging as retryd served it (the proto's ``Hedging``)."""

    upstream: str
    enabled: bool
    #: Seconds to wait after sending before asking for a hedge.
    delay: float
    max_hedges: int
    idempotency: frozenset[int]

    def allows(self, idempotency: IdempotencyLike) -> bool:
        """Whether a call of this idempotency may be hedged now (never NON_IDEMPOTENT)."""
        level = int(idempotency)
        return (self.enabled and self.delay > 0 and self.max_hedges >= 1
                and level != Idempotency.NON_IDEMPOTENT and level in self.idempotency)


def hedging_from_pb(message: Any) -> Hedging:
    """A ``retryd.v1.Hedging`` message as a :class:`Hedging`."""
    delay = message.delay.seconds + message.delay.nanos / 1e9 if message.HasField("delay") else 0.0
    return Hedging(upstream=message.upstream, enabled=message.enabled, delay=delay,
                   max_hedges=message.max_hedges,
                   idempotency=frozenset(int(level) for level in message.idempotency))


@dataclass(frozen=True)
class LocalHedging:
    """Hedging while retryd is unreachable: a fixed delay, paid from a local bucket.

    Off by default (``Client(local_hedging=None)``): without the fleet's
    view, a fixed delay is a guess, and a guess that is too short doubles
    the load on a slow upstream. When given, a call to a SAFE or IDEMPOTENT
    operation still running after ``delay`` seconds may send up to
    ``max_hedges`` copies, each spending one token of a local bucket that
    earns ``max_extra_load`` tokens per first attempt (5% by default, the
    issue's cap) up to ``capacity``: the extra load stays bounded even if
    every call is slow.
    """

    delay: float
    max_hedges: int = 1
    max_extra_load: float = 0.05
    capacity: float = 10.0

    def __post_init__(self) -> None:
        if self.delay <= 0:
            raise ValueError(f"delay: must be positive, got {self.delay!r}")
        if self.max_hedges < 1:
            raise ValueError(f"max_hedges: must be at least 1, got {self.max_hedges!r}")
        if not 0 <= self.max_extra_load <= 1:
            raise ValueError(f"max_extra_load: must be within 0..1, got {self.max_extra_load!r}")


class _LocalBucket:
    """The local fallback's hedge tokens: earned by first attempts, spent by hedges."""

    def __init__(self, policy: LocalHedging) -> None:
        self.policy = policy
        self.tokens = 0.0
        self.lock = threading.Lock()

    def earn(self) -> None:
        with self.lock:
            self.tokens = min(self.policy.capacity, self.tokens + self.policy.max_extra_load)

    def spend(self) -> bool:
        with self.lock:
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


class HedgingTable:
    """Per upstream, the latest :class:`Hedging` retryd served, with its age.

    Thread-safe. ``update`` is called with each report response;
    ``current(upstream)`` is what a call reads (None: do not hedge).
    """

    def __init__(self, *, keep_for: float, clock: Callable[[], float] = time.monotonic,
                 local: Optional[LocalHedging] = None) -> None:
        self.keep_for = keep_for
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Hedging, float]] = {}
        self.local = local
        self._bucket = _LocalBucket(local) if local is not None else None
        #: True from a failed report or hedge decision until the next answered report.
        self.unreachable = False
        self._not_hedged: dict[str, int] = {}

    def update(self, served: Iterable[Hedging]) -> None:
        """Takes the entries of one report response; drops the entries too old to trust."""
        now = self._clock()
        self.unreachable = False
        with self._lock:
            for hedging in served:
                self._entries[hedging.upstream] = (hedging, now)
            # Bounded by the upstreams reported within keep_for, which the
            # reporter's max_upstreams bounds in turn.
            for upstream in [u for u, (_, seen) in self._entries.items() if now - seen > self.keep_for]:
                del self._entries[upstream]

    def current(self, upstream: str) -> Optional[Hedging]:
        """The upstream's hedging, if retryd served it within ``keep_for`` seconds."""
        with self._lock:
            entry = self._entries.get(upstream)
        if entry is None or self._clock() - entry[1] > self.keep_for:
            return None
        return entry[0]

    def snapshot(self) -> dict[str, Hedging]:
        """Every fresh entry, per upstream."""
        now = self._clock()
        with self._lock:
            return {u: h for u, (h, seen) in self._entries.items() if now - seen <= self.keep_for}

    def plan(self, upstream: str, idempotency: IdempotencyLike) -> Optional[HedgePlan]:
        """How to hedge a call now: retryd's served delay, the local fallback's, or None (do not)."""
        served = self.current(upstream)
        if served is not None:
            return HedgePlan(served.delay, served.max_hedges) if served.allows(idempotency) else None
        local = self.local
        if local is not None and self.unreachable and int(idempotency) in (Idempotency.SAFE, Idempotency.IDEMPOTENT):
            return HedgePlan(local.delay, local.max_hedges, local=True)
        return None

    def count_not_hedged(self, reason: str) -> None:
        """Counts a call that would have been hedged but could not be (``reason``: why).

        The blocking httpx adapter hedges only where it can end a loser
        (:mod:`retryd._thread_copy`); the first call of each reason logs one
        warning on the ``retryd`` logger.
        """
        with self._lock:
            first = reason not in self._not_hedged
            self._not_hedged[reason] = self._not_hedged.get(reason, 0) + 1
        if first:
            logging.getLogger("retryd").warning(
                "retryd: a blocking httpx call was not hedged (%s): its copies could not be ended; "
                "counted in client.hedging.not_hedged()", reason)

    def not_hedged(self) -> dict[str, int]:
        """Calls not hedged because their copies could not have been ended, by reason.

        ``"transport"`` (not httpx's own ``HTTPTransport`` over a plain pool: a
        proxy, a mount, a transport of your own), ``"http2"`` (``http2=True``:
        a connection carries other calls), ``"httpcore"`` (httpcore's internals
        are not those the adapter reads), ``"socket"`` (a copy's socket was not
        found in the pool even so: a hedge was withdrawn unsent, or none sent).
        """
        with self._lock:
            return dict(self._not_hedged)

    def first_attempt(self) -> None:
        """Counts a first attempt toward the local fallback's hedge tokens."""
        if self._bucket is not None:
            self._bucket.earn()

    def spend_local(self) -> bool:
        """Spends one local hedge token (retryd unreachable); False when none is left."""
        return self._bucket is not None and self._bucket.spend()


def hedge_request(pb: Any, args: dict[str, Any], duration: Callable[[Any], Any],
                  body_message: Callable[[Any], Any]) -> Any:
    """The ``DecideRequest`` asking for the ``hedge``-th hedge: no evidence, failure or status."""
    request = pb.DecideRequest(
        upstream=args["upstream"],
        operation=args["operation"],
        idempotency=int(args["idempotency"]),
        attempt=args["attempt"],
        hedge=args["hedge"],
        lineage=args["lineage"],
    )
    if args["body"] is not None:
        request.body.CopyFrom(body_message(args["body"]))
    deadline = duration(args["deadline_remaining"])
    if deadline is not None:
        request.deadline_remaining.CopyFrom(deadline)
    return request


def check_hedge_args(args: dict[str, Any]) -> None:
    """What retryd would refuse, refused before the fallback answers for it."""
    from .errors import InvalidRequestError

    if not args["upstream"]:
        raise InvalidRequestError("upstream: required")
    if int(args["idempotency"]) == 0:
        raise InvalidRequestError("idempotency: required")
    if args["attempt"] < 1:
        raise InvalidRequestError("attempt: must be at least 1")
    if args["hedge"] < 1:
        raise InvalidRequestError("hedge: must be at least 1 for a hedge")


def local_hedge_decision(table: HedgingTable, args: dict[str, Any], reason: str) -> Any:
    """The fallback's answer to a hedge while retryd is unreachable.

    RETRY only with :class:`LocalHedging` configured, for a SAFE or
    IDEMPOTENT call (a key's deduplication is the upstream's, which the
    fallback cannot see), within ``max_hedges``, with a local token to spend.
    """
    import math

    from ._types import Decision, DenyReason, Evidence, Verdict

    def answer(verdict: Verdict, deny: DenyReason, why: str) -> Decision:
        return Decision(verdict=verdict, backoff=0.0, deny_reason=deny, refresh_credentials=False, rule=0,
                        effective_evidence=Evidence.UNSPECIFIED, evidence_adjusted=False, decision_id="",
                        tokens_remaining=math.nan, explanation=f"{reason}; local hedging: {why}",
                        fallback=True)

    local = table.local
    level = int(args["idempotency"])
    if local is None:
        return answer(Verdict.DENY, DenyReason.HEDGING_OFF, "not configured")
    if level not in (Idempotency.SAFE, Idempotency.IDEMPOTENT):
        return answer(Verdict.DENY, DenyReason.HEDGING_OFF, "only SAFE and IDEMPOTENT calls are hedged locally")
    if args["hedge"] > local.max_hedges:
        return answer(Verdict.DENY, DenyReason.HEDGING_OFF, f"hedge {args['hedge']} beyond {local.max_hedges}")
    remaining = args["deadline_remaining"]
    if remaining is not None and float(remaining) <= 0:
        return answer(Verdict.DENY, DenyReason.DEADLINE, "the deadline has passed")
    if not table.spend_local():
        return answer(Verdict.DENY, DenyReason.HEDGE_CAP, "no local hedge token left")
    return answer(Verdict.RETRY, DenyReason.UNSPECIFIED, f"hedge {args['hedge']} after {local.delay}s")
