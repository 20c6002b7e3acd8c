"""Exceptions raised by the retryd client."""

from __future__ import annotations

from typing import Any, Optional

from ._types import Decision, DenyReason, UnknownOutcome


class RetrydError(Exception):
    """Base class of every error this package raises."""


class InvalidRequestError(RetrydError, ValueError):
    """retryd rejected the request as invalid (gRPC INVALID_ARGUMENT).

    ``field`` is the offending field, taken from the start of the message
    (``"upstream: required"`` names ``upstream``). This is a bug in the
    caller, so the client never falls back to its local rule for it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = message.split(":", 1)[0].strip() if ":" in message else ""


class RetrydUnavailableError(RetrydError):
    """retryd could not be reached in time and local fallback is disabled."""

    def __init__(self, message: str, code: Optional[Any] = None) -> None:
        super().__init__(message)
        self.code = code


def describe_ambiguity(decision: Decision) -> str:
    """The message of an ambiguous-execution error: what is unknown, and why no retry."""
    what = ("outcome unknown, re-send with the same idempotency key"
            if decision.unknown_outcome == UnknownOutcome.RESEND_WITH_KEY else "ambiguous execution")
    why = f" (no retry: {decision.deny_reason.name})" if decision.deny_reason != DenyReason.UNSPECIFIED else ""
    return f"{what}{why}: {decision.explanation or 'request may have taken effect'}"


class AmbiguousExecutionError(RetrydError):
    """The request may or may not have taken effect upstream.

    Raised for an AMBIGUOUS answer and for any decision that ends the call
    while leaving its outcome unknown (``decision.unknown_outcome`` set: a
    DENY such as BUDGET_EXHAUSTED or MAX_ATTEMPTS of a call that may have
    run, or a non-idempotent call whose deadline passed after it was sent).
    Retrying could duplicate a side effect, and reporting a plain failure
    would claim it did not happen. Reconcile: query the upstream, or, when
    :attr:`resend_with_same_key` is True, re-send with the same idempotency
    key. ``deny_reason`` says why retryd did not retry (UNSPECIFIED for
    AMBIGUOUS). ``response`` is the last response if one arrived; the
    transport error, if any, is ``__cause__``.
    """

    def __init__(self, decision: Decision, response: Optional[Any] = None) -> None:
        super().__init__(describe_ambiguity(decision))
        self.decision = decision
        self.response = response

    @property
    def deny_reason(self) -> Any:
        """Why no retry (a :class:`~retryd.DenyReason`; UNSPECIFIED for an AMBIGUOUS verdict)."""
        return self.decision.deny_reason

    @property
    def resend_with_same_key(self) -> bool:
        """True for IDEMPOTENT_WITH_KEY: unknown, and re-sending with the same key is safe."""
        return self.decision.resend_with_same_key
