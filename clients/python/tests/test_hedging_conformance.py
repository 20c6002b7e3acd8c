"""conformance/hedging.json through Client.decide_hedge against a real retryd:
the reports the vectors name are sent through Client.report_batch (latency
histograms included), then every hedge case is asked as the adapters ask it.

The four cases that put a failure on a hedge (evidence, failure, status,
Retry-After) cannot be expressed through ``decide_hedge``, which sends none
by design; they are retryd's own validation, run by the server's suite.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from support import REPO, Server, start_server, stop_server
from retryd import Client, DenyReason, Idempotency, InvalidRequestError, Traffic, Verdict

VECTORS = json.loads((REPO / "conformance" / "hedging.json").read_text())
#: Request fields a hedge Decide of decide_hedge never carries.
_FAILURE_FIELDS = {"evidence", "failure", "httpStatus", "retryAfter"}
CASES = [case for case in VECTORS["cases"] if not _FAILURE_FIELDS & set(case["request"])]


def test_only_the_failure_cases_are_left_out() -> None:
    left_out = [case["name"] for case in VECTORS["cases"] if case not in CASES]
    assert left_out == ["hedge-with-evidence", "hedge-with-status", "hedge-with-failure", "hedge-with-retry-after"]
    assert len(CASES) >= 15


def _traffic(entry: dict[str, Any]) -> Traffic:
    def pairs(name: str) -> tuple[tuple[int, int], ...]:
        counts = entry.get(name, {}).get("counts", {})
        return tuple(sorted((int(index), int(n)) for index, n in counts.items()))

    return Traffic(entry["upstream"], int(entry.get("requests", 0)), int(entry.get("successes", 0)),
                   int(entry.get("failures", 0)), 0, 0, pairs("latencySuccesses"), pairs("latencyFailures"))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    server: Server = start_server(VECTORS["config"], tmp_path_factory.mktemp("hedging-conformance"))
    try:
        with Client(server.grpc, timeout=5, fallback=None) as strict:
            for upstream in VECTORS["disable_upstreams"]:
                strict.set_retries_enabled(upstream, False, "hedging conformance vectors")
            for report in VECTORS["reports"]:
                result = strict.report_batch([_traffic(entry) for entry in report["traffic"]])
                assert result.accepted == len(report["traffic"])
            # The report's answer filled the client's hedging table.
            assert strict.hedging.plan("hedge-tail", Idempotency.IDEMPOTENT) is not None
            assert strict.hedging.current("hedge-slow") is not None
            assert strict.hedging.plan("hedge-slow", Idempotency.SAFE) is None  # uniformly slow: off
            yield strict
    finally:
        stop_server(server)


def _seconds(value: str | None) -> float | None:
    return None if value is None else float(value.rstrip("s"))


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_hedge_vector(client: Client, case: dict[str, Any]) -> None:
    request = case["request"]
    kwargs = dict(upstream=request["upstream"], operation=request.get("operation", ""),
                  idempotency=Idempotency[request["idempotency"].removeprefix("IDEMPOTENCY_")],
                  attempt=request["attempt"], hedge=request["hedge"],
                  deadline_remaining=_seconds(request.get("deadlineRemaining")))
    if "expect_error" in case:
        with pytest.raises(InvalidRequestError) as raised:
            client.decide_hedge(**kwargs, timeout=5)
        assert raised.value.message.startswith(case["expect_error"]["field"]), raised.value.message
        return
    expect = case["expect"]
    decision = client.decide_hedge(**kwargs, timeout=5)
    got = {
        "verdict": "VERDICT_" + decision.verdict.name,
        "deny_reason": None if decision.deny_reason == DenyReason.UNSPECIFIED else "DENY_REASON_" + decision.deny_reason.name,
        "rule": decision.rule,
        "effective_evidence": "EVIDENCE_" + decision.effective_evidence.name,
        "unknown_outcome": "UNKNOWN_OUTCOME_" + decision.unknown_outcome.name,
    }
    want = {key: expect.get(key) for key in got}
    assert got == want, decision.explanation
    assert not decision.fallback and decision.decision_id
    if decision.verdict == Verdict.RETRY:
        assert expect.get("backoff_min_ms", 0) <= decision.backoff * 1000 <= expect.get("backoff_max_ms", 0)
