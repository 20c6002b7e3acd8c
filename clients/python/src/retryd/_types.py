"""The vocabulary of retryd.v1 as plain Python types.

The enums mirror the proto enums number for number, without the proto's
prefixes (``Idempotency.SAFE`` is ``IDEMPOTENCY_SAFE``). The test suite checks
them against the generated descriptors, so a new proto value cannot be
forgotten here. Wherever the API takes one of these enums it also accepts a
plain ``int``, which is sent unchanged: a newer server may know values this
client does not.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:  # hedging imports this module
    from .hedging import Hedging


class Idempotency(enum.IntEnum):
    """How safe it is to execute the operation more than once (declared by the caller)."""

    UNSPECIFIED = 0
    SAFE = 1
    IDEMPOTENT = 2
    IDEMPOTENT_WITH_KEY = 3
    NON_IDEMPOTENT = 4

    @property
    def is_safely_idempotent(self) -> bool:
        return self in (Idempotency.SAFE, Idempotency.IDEMPOTENT, Idempotency.IDEMPOTENT_WITH_KEY)


class Evidence(enum.IntEnum):
    """How far the failed attempt got, ordered from weakest to strongest."""

    UNSPECIFIED = 0
    NOT_SENT = 1
    SENT_NO_RESPONSE = 2
    RESPONSE_RECEIVED = 3
    PARTIAL_RESPONSE = 4


class FailureKind(enum.IntEnum):
    """The stage failure that produced the evidence."""

    UNSPECIFIED = 0
    DNS = 1
    CONNECT = 2
    POOL_TIMEOUT = 3
    PRE_REQUEST_TLS = 4
    PROFILE_REJECTION = 5
    HTTP2_REFUSED_STREAM = 6
    GOAWAY_UNPROCESSED = 7
    PARTIAL_WRITE = 8
    RESPONSE_HEADER_TIMEOUT = 9
    CONNECTION_RESET = 10
    DECODE_RESET = 11
    INTERRUPTED_STREAM = 12
    GENERIC_IO = 13
    TLS_CERTIFICATE_INVALID = 14
    REQUEST_ENCODING = 15


class Replayability(enum.IntEnum):
    """Whether a request body can be sent again."""

    UNSPECIFIED = 0
    REPLAYABLE = 1
    REOPENABLE = 2
    ONE_SHOT = 3


class BodyKind(enum.IntEnum):
    """What the request body is, in the terms of the replayability table."""

    NONE = 0
    BYTES = 1
    ENCODED_VALUE = 2
    REOPENABLE_SUPPLIER = 3
    INPUT_STREAM = 4
    PUBLISHER_FACTORY = 5
    PUBLISHER = 6
    MULTIPART = 7


class Verdict(enum.IntEnum):
    """What the caller should do."""

    UNSPECIFIED = 0
    RETRY = 1
    DENY = 2
    AMBIGUOUS = 3


class DenyReason(enum.IntEnum):
    """Why a retry was denied."""

    UNSPECIFIED = 0
    MAX_ATTEMPTS = 1
    BUDGET_EXHAUSTED = 2
    BODY_NOT_REPLAYABLE = 3
    RESPONSE_ALREADY_DELIVERED = 4
    RUNTIME_DRAINING = 5
    DEADLINE = 6
    PERMANENT_FAILURE = 7
    STATUS_NOT_RETRYABLE = 8
    RETRIES_DISABLED = 9
    BUDGET_UNAVAILABLE = 10
    SERVER_PUSHBACK = 11
    #: The layer below already retried this failure, or was denied (``retried_below``).
    RETRIED_BELOW = 12
    #: The call is made inside a retry of an enclosing call (an attempt above 1 in ``lineage``).
    INSIDE_ENCLOSING_RETRY = 13
    #: A hedge for an upstream without hedging, for this idempotency, or beyond ``max_hedges``.
    HEDGING_OFF = 14
    #: A hedge beyond the policy's cap on extra load.
    HEDGE_CAP = 15
    #: A hedge for an upstream that is uniformly slow (p50 close to the hedging quantile).
    UNIFORMLY_SLOW = 16


class UnknownOutcome(enum.IntEnum):
    """Whether the failed attempt may have taken effect upstream, whatever the verdict.

    Computed from the facts alone, never from the verdict, so a DENY (an
    empty budget, the last attempt) cannot hide that a payment may have
    happened. A decision that is not RETRY and carries a mark is not a plain
    failure: the adapters raise :class:`~retryd.AmbiguousExecutionError`.
    """

    #: Not in doubt (never sent, or a final response settled it), or
    #: repeating the call cannot duplicate an effect (SAFE, IDEMPOTENT).
    NONE = 0
    #: NON_IDEMPOTENT and possibly executed: reconcile (ask the upstream)
    #: before reporting a failure or sending it again.
    RECONCILE = 1
    #: IDEMPOTENT_WITH_KEY and possibly executed: re-sending with the same
    #: idempotency key is safe (the upstream deduplicates); a new key is not.
    RESEND_WITH_KEY = 2


class GrpcCode(enum.IntEnum):
    """The gRPC status codes of ``google.rpc.Code`` other than OK, by wire number.

    ``grpc.StatusCode`` carries the same numbers (``StatusCode.UNAVAILABLE.value[0]``
    is 14); this enum exists so that a decision can name a code without
    importing grpcio.
    """

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


#: An enum value, or a raw number passed through unchanged.
IdempotencyLike = Union[Idempotency, int]
EvidenceLike = Union[Evidence, int]
FailureKindLike = Union[FailureKind, int]
GrpcCodeLike = Union[GrpcCode, int]


@dataclass(frozen=True)
class Body:
    """A request body, as far as replayability is concerned.

    Use the constructors: ``Body.bytes()``, ``Body.encoded_value()``,
    ``Body.reopenable()``, ``Body.input_stream()``, ``Body.publisher()``,
    ``Body.publisher_factory(Replayability.REPLAYABLE)`` and
    ``Body.multipart(part, ...)``. No body at all is ``None``.
    """

    kind: Union[BodyKind, int]
    declared: Union[Replayability, int, None] = None
    parts: tuple[Body, ...] = field(default=())

    @classmethod
    def bytes(cls) -> Body:
        return cls(BodyKind.BYTES)

    @classmethod
    def encoded_value(cls) -> Body:
        return cls(BodyKind.ENCODED_VALUE)

    @classmethod
    def reopenable(cls) -> Body:
        return cls(BodyKind.REOPENABLE_SUPPLIER)

    @classmethod
    def input_stream(cls) -> Body:
        return cls(BodyKind.INPUT_STREAM)

    @classmethod
    def publisher(cls) -> Body:
        return cls(BodyKind.PUBLISHER)

    @classmethod
    def publisher_factory(cls, declared: Union[Replayability, int]) -> Body:
        return cls(BodyKind.PUBLISHER_FACTORY, declared=declared)

    @classmethod
    def multipart(cls, *parts: Body) -> Body:
        return cls(BodyKind.MULTIPART, parts=tuple(parts))

    @property
    def replayability(self) -> Replayability:
        """The seed's replayability table; multipart takes its weakest part."""
        if self.kind == BodyKind.PUBLISHER_FACTORY:
            try:
                return Replayability(self.declared or 0)
            except ValueError:
                return Replayability.ONE_SHOT
        if self.kind == BodyKind.MULTIPART:
            if not self.parts:
                return Replayability.ONE_SHOT
            # ONE_SHOT (3) is the weakest, REPLAYABLE (1) the strongest.
            return max((part.replayability for part in self.parts), key=int)
        if self.kind in (BodyKind.NONE, BodyKind.BYTES, BodyKind.ENCODED_VALUE):
            return Replayability.REPLAYABLE
        if self.kind == BodyKind.REOPENABLE_SUPPLIER:
            return Replayability.REOPENABLE
        return Replayability.ONE_SHOT


@dataclass(frozen=True)
class Decision:
    """The decision for one failed attempt: what the client acts on.

    ``backoff`` is in seconds. ``fallback`` is True when retryd could not be
    reached and the client's conservative local rule decided instead; then
    ``decision_id`` is empty and ``tokens_remaining`` is NaN.

    ``shadow`` is True when retryd answered for an upstream in shadow mode
    (``enforce = false`` in its policy): retryd's decision is not enforced,
    so this decision is the client's own local rule (the one it falls back
    to), and the adapters act on it. Then ``retryd_decision`` is retryd's
    shadow decision, as it answered (its own ``shadow`` True, its
    ``tokens_remaining`` the shadow budget's), ``decision_id`` is retryd's
    (the id of its audit span), ``tokens_remaining`` is NaN, and
    ``fallback`` is False. ``retryd_decision`` is None otherwise.

    ``unknown_outcome`` says whether the attempt may have taken effect
    upstream, whichever rule decided (see :class:`UnknownOutcome`);
    :attr:`is_outcome_unknown` is True for it and for AMBIGUOUS.
    """

    verdict: Verdict
    backoff: float
    deny_reason: DenyReason
    refresh_credentials: bool
    rule: int
    effective_evidence: Evidence
    evidence_adjusted: bool
    decision_id: str
    tokens_remaining: float
    explanation: str
    fallback: bool = False
    shadow: bool = False
    retryd_decision: Optional[Decision] = None
    unknown_outcome: UnknownOutcome = UnknownOutcome.NONE

    @property
    def should_retry(self) -> bool:
        return self.verdict == Verdict.RETRY

    @property
    def is_ambiguous(self) -> bool:
        """The verdict is AMBIGUOUS. A DENY may leave the outcome open too: see :attr:`is_outcome_unknown`."""
        return self.verdict == Verdict.AMBIGUOUS

    @property
    def is_outcome_unknown(self) -> bool:
        """The attempt may have taken effect upstream: AMBIGUOUS, or any verdict with a mark.

        When the call is not retried, this is the ambiguous-execution error,
        never a plain failure (the deny reason says only why no retry).
        """
        return self.verdict == Verdict.AMBIGUOUS or self.unknown_outcome != UnknownOutcome.NONE

    @property
    def resend_with_same_key(self) -> bool:
        """Unknown, and re-sending with the same idempotency key is safe (IDEMPOTENT_WITH_KEY)."""
        return self.unknown_outcome == UnknownOutcome.RESEND_WITH_KEY


@dataclass(frozen=True)
class Budget:
    """The state of one upstream's retry budget."""

    upstream: str
    tokens: float
    capacity: float
    ratio: float
    min_per_second: float
    retries_enabled: bool
    tracked: bool
    #: The upstream's hedging as served to clients; None without a policy.
    hedging: Optional[Hedging] = None
