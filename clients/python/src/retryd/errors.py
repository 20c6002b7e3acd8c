"""Exceptions raised by the retryd client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ._types import Decision


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


class AmbiguousExecutionError(RetrydError):
    """The request may or may not have taken effect upstream.

    Retrying could duplicate a side effect, and reporting a plain failure
    would claim it did not happen. Reconcile: query the upstream, or replay
    with an idempotency key. ``response`` is the last response if one
    arrived; the transport error, if any, is ``__cause__``.
    """

    def __init__(self, decision: Decision, response: Optional[Any] = None) -> None:
        super().__init__(f"ambiguous execution: {decision.explanation or 'request may have taken effect'}")
        self.decision = decision
        self.response = response
