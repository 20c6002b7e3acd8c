"""The conservative local rule used when retryd cannot be reached.

Without retryd there is no fleet-wide budget and no per-upstream policy, so
the local rule only ever allows less than retryd would:

- it honours the local attempt limit (``LocalPolicy.max_attempts``, 2 by
  default: at most one retry per call) and the request's own lower limit;
- it never retries a one-shot body, a response already delivered, a
  draining runtime, a deadline below ``min_attempt_budget``, or a permanent
  failure (profile rejection, invalid certificate, request encoding);
- in a call chain (docs/lineage.md) it never retries a failure the layer
  below already retried (``retried_below``: DENY RETRIED_BELOW) nor a call
  made inside an enclosing retry (an attempt above 1 in ``lineage``: DENY
  INSIDE_ENCLOSING_RETRY, retryd's default policy), both at rule 5;
- it never retries what may have been sent unless the operation is safely
  idempotent: only proven NOT_SENT is retried for a NON_IDEMPOTENT call;
  a request that may have been sent is AMBIGUOUS when no response (or only
  part of one) came back, or a 502/503/504 came back; anything else is DENY;
- a safely idempotent call is retried on SENT_NO_RESPONSE, on a partial
  2xx/3xx response, and on 408, 425 (first attempt), 429, 502, 503 and 504;
  401 is retried once with ``refresh_credentials`` for SAFE calls; 500 never
  (the policy that could register it as transient lives in retryd);
- a gRPC code (``grpc_status_code``) is read like its HTTP neighbour:
  UNAVAILABLE and DEADLINE_EXCEEDED like 503 (retried if safely idempotent,
  else AMBIGUOUS), RESOURCE_EXHAUSTED like 429 but only with a valid
  ``grpc-retry-pushback-ms``, UNAUTHENTICATED like 401, every other code
  DENY; a negative or unparseable pushback is DENY SERVER_PUSHBACK (gRFC A6);
- the backoff is full jitter from ``base`` capped at ``max_backoff``,
  floored by Retry-After or the pushback (one above ``max_retry_after`` or
  that does not fit the deadline is DENY DEADLINE), shortened to fit the
  deadline.

Evidence is weakened exactly as retryd does (``effective_evidence``), and
every decision carries the same ``unknown_outcome`` mark retryd computes
(``unknown_outcome``, from crates/retryd-engine/src/outcome.rs), whichever
rule decided.
"""

from __future__ import annotations

import datetime
import email.utils
import enum
import math
import random
import time
from dataclasses import dataclass
from typing import Optional, TypeVar, Union

from ._types import (
    Body,
    Decision,
    DenyReason,
    Evidence,
    FailureKind,
    GrpcCode,
    Idempotency,
    Replayability,
    UnknownOutcome,
    Verdict,
)
from .lineage import enclosing_retry

_NOT_SENT_PROOF = {
    FailureKind.DNS,
    FailureKind.CONNECT,
    FailureKind.POOL_TIMEOUT,
    FailureKind.PRE_REQUEST_TLS,
    FailureKind.PROFILE_REJECTION,
    FailureKind.HTTP2_REFUSED_STREAM,
    FailureKind.GOAWAY_UNPROCESSED,
    FailureKind.TLS_CERTIFICATE_INVALID,
}
_PARTIAL = {FailureKind.DECODE_RESET, FailureKind.INTERRUPTED_STREAM}
PERMANENT_FAILURES = frozenset(
    {FailureKind.PROFILE_REJECTION, FailureKind.TLS_CERTIFICATE_INVALID, FailureKind.REQUEST_ENCODING}
)


@dataclass(frozen=True)
class LocalPolicy:
    """Limits of the local fallback rule. Durations are in seconds."""

    max_attempts: int = 2
    base: float = 0.1
    max_backoff: float = 2.0
    min_attempt_budget: float = 0.05
    max_retry_after: float = 30.0


#: The local rule's default limits.
DEFAULT_LOCAL_POLICY = LocalPolicy()


def effective_evidence(
    evidence: Union[Evidence, int],
    failure: Union[FailureKind, int],
    http_status: int,
    grpc_retry_pushback_ms: Optional[str] = None,
) -> Evidence:
    """The evidence retryd would use: the claim, never stronger than what proves it.

    The effective evidence is the strongest of the claim (unspecified counts
    as NOT_SENT), the failure's floor and the answer's floor: only the server
    can have sent an HTTP status or a pushback trailer, so either means at
    least RESPONSE_RECEIVED. A gRPC code alone does not (a gRPC library makes
    up DEADLINE_EXCEEDED or UNAVAILABLE by itself).
    """
    claim = Evidence.NOT_SENT if int(evidence) == 0 else _as(Evidence, evidence, Evidence.SENT_NO_RESPONSE)
    if int(failure) in _NOT_SENT_PROOF:
        failure_floor = Evidence.NOT_SENT
    elif int(failure) in _PARTIAL:
        failure_floor = Evidence.PARTIAL_RESPONSE
    else:
        failure_floor = Evidence.SENT_NO_RESPONSE
    answered = bool(http_status) or grpc_retry_pushback_ms is not None
    status_floor = Evidence.RESPONSE_RECEIVED if answered else Evidence.NOT_SENT
    return Evidence(max(claim, failure_floor, status_floor))


def unknown_outcome(
    idempotency: Union[Idempotency, int],
    effective: Evidence,
    http_status: int = 0,
    grpc_status_code: int = 0,
) -> UnknownOutcome:
    """Whether the attempt may have taken effect upstream: retryd's mark, from the facts alone.

    Set where rule 8 or the status rules would answer AMBIGUOUS had no
    earlier rule denied (for a keyed call: would, were it not keyed): the
    evidence (SENT_NO_RESPONSE; a partial 2xx/3xx response, or one with no
    status) or the status (502, 503, 504, gRPC UNAVAILABLE or
    DEADLINE_EXCEEDED) leaves the outcome open. Never on a proven NOT_SENT,
    nor when a final response settled it (a 4xx, a 500).
    """
    idem = int(idempotency)
    if idem == Idempotency.NON_IDEMPOTENT:
        mark = UnknownOutcome.RECONCILE
    elif idem == Idempotency.IDEMPOTENT_WITH_KEY:
        mark = UnknownOutcome.RESEND_WITH_KEY
    elif idem in (Idempotency.SAFE, Idempotency.IDEMPOTENT):
        return UnknownOutcome.NONE
    else:  # unspecified or newer than this client: as the local rule reads it, NON_IDEMPOTENT
        mark = UnknownOutcome.RECONCILE

    def status_leaves_it_open() -> bool:
        if http_status:
            return 502 <= http_status <= 504
        return grpc_status_code in (GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED)

    if effective == Evidence.NOT_SENT:
        open_ = False
    elif effective == Evidence.SENT_NO_RESPONSE:
        open_ = True
    elif effective == Evidence.PARTIAL_RESPONSE:
        # The effect happened and its result was lost on the way, unless an
        # error status says what happened.
        if (not http_status and not grpc_status_code) or 200 <= http_status <= 399:
            open_ = True
        else:
            open_ = status_leaves_it_open()
    else:
        open_ = status_leaves_it_open()
    return mark if open_ else UnknownOutcome.NONE


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds from a Retry-After value (delay-seconds or HTTP-date); None if unparseable."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(int(text))
    try:
        parsed = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed is None:
        return None
    if parsed.tzinfo is None:  # the asctime form carries no zone: it is GMT
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, parsed.timestamp() - (time.time() if now is None else now))


def parse_pushback(value: str) -> Optional[float]:
    """Seconds from a raw ``grpc-retry-pushback-ms`` value; None means "do not retry".

    gRFC A6 defines only a non-negative decimal integer of milliseconds;
    anything else (negative, empty, garbage) asks the client not to retry.
    Spaces and tabs around the digits are forgiven, as retryd forgives them.
    """
    digits = value.strip(" \t")
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits) / 1000.0


_E = TypeVar("_E", bound=enum.IntEnum)


def _as(enum_type: type[_E], value: int, default: _E) -> _E:
    try:
        return enum_type(value)
    except ValueError:
        return default


def local_decide(
    *,
    policy: LocalPolicy,
    idempotency: Union[Idempotency, int],
    attempt: int,
    evidence: Union[Evidence, int] = Evidence.UNSPECIFIED,
    failure: Union[FailureKind, int] = FailureKind.UNSPECIFIED,
    http_status: int = 0,
    retry_after: Optional[str] = None,
    deadline_remaining: Optional[float] = None,
    body: Optional[Body] = None,
    first_byte_delivered: bool = False,
    runtime_draining: bool = False,
    auth_refresh_attempted: bool = False,
    max_attempts: int = 0,
    grpc_status_code: int = 0,
    grpc_retry_pushback_ms: Optional[str] = None,
    lineage: str = "",
    retried_below: str = "",
    reason: str = "retryd unreachable",
    rng: Optional[random.Random] = None,
) -> Decision:
    """Decides one failed attempt without retryd; see the module docstring."""
    effective = effective_evidence(evidence, failure, http_status, grpc_retry_pushback_ms)
    claimed = int(evidence) != 0
    idem = _as(Idempotency, idempotency, Idempotency.NON_IDEMPOTENT)
    safe = isinstance(idem, Idempotency) and idem.is_safely_idempotent
    mark = unknown_outcome(idempotency, effective, http_status, int(grpc_status_code))

    def answer(verdict: Verdict, deny: DenyReason, rule: int, why: str, backoff: float = 0.0,
               refresh: bool = False) -> Decision:
        return Decision(
            verdict=verdict,
            backoff=backoff,
            deny_reason=deny,
            refresh_credentials=refresh,
            rule=rule,
            effective_evidence=effective,
            evidence_adjusted=claimed and int(effective) != int(evidence),
            decision_id="",
            tokens_remaining=math.nan,
            explanation=f"{reason}; local rule: {why}",
            fallback=True,
            unknown_outcome=mark,
        )

    def deny(reason_: DenyReason, rule: int, why: str) -> Decision:
        return answer(Verdict.DENY, reason_, rule, why)

    limit = policy.max_attempts if max_attempts <= 0 else min(policy.max_attempts, max_attempts)
    if attempt >= limit:
        return deny(DenyReason.MAX_ATTEMPTS, 1, f"attempt {attempt} reached the local limit {limit}")
    if body is not None and body.replayability == Replayability.ONE_SHOT:
        return deny(DenyReason.BODY_NOT_REPLAYABLE, 3, "the body is one-shot")
    if first_byte_delivered:
        return deny(DenyReason.RESPONSE_ALREADY_DELIVERED, 4, "the response was already delivered")
    if runtime_draining:
        return deny(DenyReason.RUNTIME_DRAINING, 5, "the runtime is draining")
    if retried_below:
        return deny(DenyReason.RETRIED_BELOW, 5, f"the layer below ({retried_below}) already retried this failure")
    if enclosing_retry(lineage):
        return deny(DenyReason.INSIDE_ENCLOSING_RETRY, 5,
                    f"the call is made inside a retry of an enclosing call (lineage {lineage})")
    if deadline_remaining is not None and deadline_remaining < policy.min_attempt_budget:
        return deny(DenyReason.DEADLINE, 6, "the deadline leaves no room for another attempt")
    if int(failure) in PERMANENT_FAILURES:
        return deny(DenyReason.PERMANENT_FAILURE, 7, "the failure is permanent")
    if effective == Evidence.SENT_NO_RESPONSE and not safe:
        return answer(Verdict.AMBIGUOUS, DenyReason.UNSPECIFIED, 8,
                      "the request may have been sent and is not idempotent")

    refresh = False
    code = int(grpc_status_code)
    pushback = None if grpc_retry_pushback_ms is None else parse_pushback(grpc_retry_pushback_ms)
    if grpc_retry_pushback_ms is not None and pushback is None:
        return deny(DenyReason.SERVER_PUSHBACK, 9, "the server asked not to retry (grpc-retry-pushback-ms)")
    if effective in (Evidence.NOT_SENT, Evidence.SENT_NO_RESPONSE):
        verdict = Verdict.RETRY
    elif code:
        if code in (GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED):
            verdict = Verdict.RETRY if safe else Verdict.AMBIGUOUS
        elif not safe:
            verdict = Verdict.DENY
        elif code == GrpcCode.RESOURCE_EXHAUSTED and pushback is not None:
            verdict = Verdict.RETRY
        elif code == GrpcCode.UNAUTHENTICATED and idem == Idempotency.SAFE and not auth_refresh_attempted:
            verdict, refresh = Verdict.RETRY, True
        else:
            verdict = Verdict.DENY
    elif effective == Evidence.PARTIAL_RESPONSE and (http_status == 0 or 200 <= http_status < 400):
        verdict = Verdict.RETRY if safe else Verdict.AMBIGUOUS
    elif http_status in (502, 503, 504):
        verdict = Verdict.RETRY if safe else Verdict.AMBIGUOUS
    elif not safe:
        verdict = Verdict.DENY
    elif http_status in (408, 429) or (http_status == 425 and attempt == 1):
        verdict = Verdict.RETRY
    elif http_status == 401 and idem == Idempotency.SAFE and not auth_refresh_attempted:
        verdict, refresh = Verdict.RETRY, True
    else:
        verdict = Verdict.DENY
    if verdict == Verdict.AMBIGUOUS:
        return answer(verdict, DenyReason.UNSPECIFIED, 9, "the request may have taken effect")
    if verdict == Verdict.DENY:
        what = f"gRPC code {code}" if code else f"status {http_status}"
        return deny(DenyReason.STATUS_NOT_RETRYABLE, 9, f"{what} is not retried locally")

    rng = rng or random.Random()
    backoff = 0.0 if refresh else rng.uniform(0, min(policy.max_backoff, policy.base * 2 ** (attempt - 1)))
    floor = pushback if pushback is not None else parse_retry_after(retry_after)
    if floor is not None:
        if floor > policy.max_retry_after:
            return deny(DenyReason.DEADLINE, 6, "Retry-After or pushback exceeds the local maximum")
        backoff = max(backoff, floor)
    if deadline_remaining is not None:
        room = deadline_remaining - policy.min_attempt_budget
        if floor is not None and floor > room:
            return deny(DenyReason.DEADLINE, 6, "Retry-After or pushback does not fit the deadline")
        backoff = max(0.0, min(backoff, room))
    return answer(Verdict.RETRY, DenyReason.UNSPECIFIED, 9, f"retry {effective.name}", backoff, refresh)
