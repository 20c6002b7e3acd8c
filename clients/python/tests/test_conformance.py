"""The language-neutral conformance vectors, through Client.decide against a real retryd."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from support import VECTORS, Server
from retryd import (
    DEFAULT_LOCAL_POLICY,
    AmbiguousExecutionError,
    Body,
    BodyKind,
    Client,
    Decision,
    DenyReason,
    Evidence,
    FailureKind,
    Idempotency,
    InvalidRequestError,
    Replayability,
    UnknownOutcome,
    Verdict,
    local_decide,
)

CASES = json.loads(VECTORS.read_text())["cases"]


def test_enough_vectors() -> None:
    assert len(CASES) >= 60
    assert sum("expect_error" in case for case in CASES) >= 10
    assert len({case["name"] for case in CASES}) == len(CASES)


def enum_arg(enum_type: Any, prefix: str, value: Any) -> Any:
    """"IDEMPOTENCY_SAFE" -> Idempotency.SAFE; numbers pass through unchanged."""
    if value is None:
        return enum_type(0)
    if isinstance(value, int):
        return value
    assert value.startswith(prefix), value
    return enum_type[value[len(prefix):]]


def seconds(value: str | None) -> float | None:
    if value is None:
        return None
    assert value.endswith("s"), value
    return float(value[:-1])


def body_arg(value: dict[str, Any] | None) -> Body | None:
    if value is None:
        return None
    declared = value.get("declared")
    return Body(
        kind=enum_arg(BodyKind, "BODY_KIND_", value.get("kind")),
        declared=None if declared is None else enum_arg(Replayability, "REPLAYABILITY_", declared),
        parts=tuple(body_arg(part) for part in value.get("parts", [])),  # type: ignore[misc]
    )


def decide_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """The proto3 JSON of a DecideRequest as Client.decide keyword arguments."""
    return dict(
        upstream=request.get("upstream", ""),
        operation=request.get("operation", ""),
        idempotency=enum_arg(Idempotency, "IDEMPOTENCY_", request.get("idempotency")),
        attempt=request.get("attempt", 0),
        evidence=enum_arg(Evidence, "EVIDENCE_", request.get("evidence")),
        failure=enum_arg(FailureKind, "FAILURE_KIND_", request.get("failure")),
        http_status=request.get("httpStatus", 0),
        retry_after=request.get("retryAfter"),
        deadline_remaining=seconds(request.get("deadlineRemaining")),
        body=body_arg(request.get("body")),
        first_byte_delivered=request.get("firstByteDelivered", False),
        runtime_draining=request.get("runtimeDraining", False),
        auth_refresh_attempted=request.get("authRefreshAttempted", False),
        previous_backoff=seconds(request.get("previousBackoff")),
        max_attempts=request.get("maxAttempts", 0),
        grpc_status_code=request.get("grpcStatusCode", 0),
        # Presence matters: "" is a garbage pushback, absent is none at all.
        grpc_retry_pushback_ms=request.get("grpcRetryPushbackMs"),
        lineage=request.get("lineage", ""),
        retried_below=request.get("retriedBelow", ""),
    )


def check_surfacing(decision: Decision) -> None:
    """What the adapters do with a decision that ends the call: a DENY with a
    mark is the ambiguous-execution error (with its reason), never the plain failure."""
    marked = decision.unknown_outcome != UnknownOutcome.NONE
    if decision.verdict == Verdict.DENY:
        assert decision.is_outcome_unknown == marked
        if marked:
            error = AmbiguousExecutionError(decision)
            assert error.deny_reason == decision.deny_reason != DenyReason.UNSPECIFIED
            assert error.resend_with_same_key == (decision.unknown_outcome == UnknownOutcome.RESEND_WITH_KEY)
            assert decision.deny_reason.name in str(error)
    if decision.verdict == Verdict.AMBIGUOUS:
        assert decision.is_outcome_unknown


@pytest.fixture(scope="module")
def client(conformance_server: Server) -> Iterator[Client]:
    # No fallback: a broken or missing server must fail these tests.
    with Client(conformance_server.grpc, timeout=5, fallback=None) as strict:
        yield strict


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_vector(client: Client, case: dict[str, Any]) -> None:
    kwargs = decide_kwargs(case["request"])
    if "expect_error" in case:
        expected = case["expect_error"]
        assert expected["code"] == "INVALID_ARGUMENT"
        with pytest.raises(InvalidRequestError) as raised:
            client.decide(**kwargs, timeout=5)
        assert raised.value.message.startswith(expected["field"]), raised.value.message
        return

    expect = case["expect"]
    # An explicit timeout: the vectors check retryd's answer, and a case's
    # short deadline would otherwise bound the call to 50 ms, which a busy
    # machine can exceed.
    decision = client.decide(**kwargs, timeout=5)
    got = {
        "verdict": "VERDICT_" + decision.verdict.name,
        "deny_reason": None if decision.deny_reason == DenyReason.UNSPECIFIED else "DENY_REASON_" + decision.deny_reason.name,
        "rule": decision.rule,
        "effective_evidence": "EVIDENCE_" + decision.effective_evidence.name,
        "unknown_outcome": "UNKNOWN_OUTCOME_" + decision.unknown_outcome.name,
    }
    want = {
        "verdict": expect["verdict"],
        "deny_reason": expect.get("deny_reason"),
        "rule": expect["rule"],
        "effective_evidence": expect["effective_evidence"],
        "unknown_outcome": expect["unknown_outcome"],
    }
    if "evidence_adjusted" in expect:
        got["evidence_adjusted"] = decision.evidence_adjusted
        want["evidence_adjusted"] = expect["evidence_adjusted"]
    if "refresh_credentials" in expect:
        got["refresh_credentials"] = decision.refresh_credentials
        want["refresh_credentials"] = expect["refresh_credentials"]
    assert got == want, decision.explanation
    assert not decision.fallback
    assert decision.decision_id
    check_surfacing(decision)
    # The local fallback rule marks the same facts the same way (the mark
    # depends on no policy, so the local limits cannot change it).
    local = local_decide(policy=DEFAULT_LOCAL_POLICY, **{
        key: value for key, value in kwargs.items() if key not in ("upstream", "operation", "previous_backoff")
    })
    assert local.unknown_outcome == decision.unknown_outcome, local.explanation
    backoff_ms = decision.backoff * 1000
    if decision.verdict == Verdict.RETRY:
        if "backoff_min_ms" in expect:
            assert backoff_ms >= expect["backoff_min_ms"] - 1e-6
        if "backoff_max_ms" in expect:
            assert backoff_ms <= expect["backoff_max_ms"] + 1e-6
    else:
        assert backoff_ms == 0
