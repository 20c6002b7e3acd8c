"""Shadow upstreams (issue 22): retryd's answer for an upstream with
``enforce = false`` is not acted on; the client's local rule decides, and
the differences are counted and logged at most once per interval.

Against a real retryd (its own, configured here) and HTTP servers of the
test's own on 127.0.0.1 that count the requests they get."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator

import httpx
import pytest

from scripted_http import ScriptedServer, respond
from support import Server, start_server, stop_server
from retryd import AsyncClient, Client, DenyReason, FailureKind, Idempotency, Verdict
from retryd.httpx import DECISIONS_EXTENSION, decision_of, request_with_retries

# Each shadow upstream has an enforced twin with the same policy, so that the
# same facts show both sides. transient_500 makes retryd retry a 500 on an
# idempotent call, which the local rule never does; an empty budget makes
# retryd deny what the local rule retries.
CONFIG = """
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "1ms", max = "5ms", jitter = "full" }

[upstreams."shadow-500"]
enforce = false
transient_500 = true

[upstreams."live-500"]
transient_500 = true

[upstreams."shadow-empty"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."live-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log-other"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }
"""


@pytest.fixture(scope="module")
def shadow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(CONFIG, tmp_path_factory.mktemp("shadow"))
    yield started
    stop_server(started)


@pytest.fixture
def retryd(shadow_server: Server) -> Iterator[Client]:
    # reporter=None below: the tests' budgets must not fill from their traffic.
    with Client(shadow_server.grpc, timeout=5) as client:
        yield client


def no_sleep(seconds: float) -> None:
    assert 0 <= seconds <= 2.0, seconds


def test_a_shadow_retry_the_local_rule_denies_is_not_retried(retryd: Client) -> None:
    with ScriptedServer(respond(500), respond(200)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="shadow-500",
                                        idempotency=Idempotency.SAFE, reporter=None, sleep=no_sleep)
        assert response.status_code == 500
        assert len(server.requests) == 1, "the local rule never retries a 500"
    decision = decision_of(response)
    assert decision is not None and decision.shadow and not decision.fallback
    assert (decision.verdict, decision.deny_reason) == (Verdict.DENY, DenyReason.STATUS_NOT_RETRYABLE)
    assert "shadow" in decision.explanation and math.isnan(decision.tokens_remaining)
    shadow = decision.retryd_decision
    assert shadow is not None and shadow.shadow and shadow.retryd_decision is None
    assert shadow.verdict == Verdict.RETRY, shadow
    assert shadow.rule == 9 and shadow.decision_id and decision.decision_id == shadow.decision_id
    assert retryd.shadow_divergences == {"shadow-500": 1}


def test_the_async_client_follows_the_local_rule_too(shadow_server: Server) -> None:
    async def decide() -> tuple[Verdict, Verdict, int]:
        async with AsyncClient(shadow_server.grpc, timeout=5) as client:
            decision = await client.decide(upstream="shadow-500", idempotency=Idempotency.SAFE,
                                           attempt=1, http_status=500)
            assert decision.retryd_decision is not None
            return decision.verdict, decision.retryd_decision.verdict, client.shadow_divergences["shadow-500"]

    assert asyncio.run(decide()) == (Verdict.DENY, Verdict.RETRY, 1)


def test_a_shadow_denial_the_local_rule_retries_is_retried(retryd: Client) -> None:
    with ScriptedServer(respond(503), respond(200, b"ok")) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="shadow-empty",
                                        idempotency=Idempotency.SAFE, reporter=None, sleep=no_sleep)
        assert response.status_code == 200 and response.content == b"ok"
        assert len(server.requests) == 2
    (decision,) = response.extensions[DECISIONS_EXTENSION]
    assert decision.shadow and decision.verdict == Verdict.RETRY
    assert decision.retryd_decision is not None
    assert decision.retryd_decision.deny_reason == DenyReason.BUDGET_EXHAUSTED

    # The same direction for a connect failure of a payment, straight from decide.
    decision = retryd.decide(upstream="shadow-empty", idempotency=Idempotency.NON_IDEMPOTENT,
                             attempt=1, failure=FailureKind.CONNECT)
    assert decision.shadow and decision.verdict == Verdict.RETRY and decision.rule == 9
    assert decision.retryd_decision is not None
    assert decision.retryd_decision.verdict == Verdict.DENY
    assert decision.retryd_decision.deny_reason == DenyReason.BUDGET_EXHAUSTED
    assert retryd.shadow_divergences["shadow-empty"] == 2


def test_an_enforced_upstream_acts_on_retryds_decision(retryd: Client) -> None:
    with ScriptedServer(respond(500)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="live-500",
                                        idempotency=Idempotency.SAFE, reporter=None, sleep=no_sleep)
        assert response.status_code == 500
        assert len(server.requests) == 3, "retryd retries a transient 500 up to max_attempts"
    with ScriptedServer(respond(503), respond(200)) as server, httpx.Client() as http:
        response = request_with_retries(http, retryd, "GET", server.url, upstream="live-empty",
                                        idempotency=Idempotency.SAFE, reporter=None, sleep=no_sleep)
        assert response.status_code == 503 and len(server.requests) == 1
    decision = decision_of(response)
    assert decision is not None and not decision.shadow and decision.retryd_decision is None
    assert decision.deny_reason == DenyReason.BUDGET_EXHAUSTED
    assert "live-500" not in retryd.shadow_divergences and "live-empty" not in retryd.shadow_divergences


def test_differences_are_logged_once_per_interval_with_the_count(
    shadow_server: Server, caplog: pytest.LogCaptureFixture,
) -> None:
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "shadow" in r.getMessage()]

    def differing(client: Client, upstream: str = "shadow-log") -> None:
        # retryd: DENY BUDGET_EXHAUSTED (empty); the local rule: RETRY a 503 GET.
        decision = client.decide(upstream=upstream, idempotency=Idempotency.SAFE, attempt=1, http_status=503)
        assert decision.verdict == Verdict.RETRY and decision.retryd_decision is not None
        assert decision.retryd_decision.deny_reason == DenyReason.BUDGET_EXHAUSTED

    with Client(shadow_server.grpc, timeout=5, shadow_log_interval=60) as client, \
            caplog.at_level(logging.WARNING, logger="retryd"):
        for _ in range(4):
            differing(client)
        # Both sides agree here (attempt 3: retryd's limit is 3, the local
        # rule's 2): neither counted nor logged.
        agreed = client.decide(upstream="shadow-log", idempotency=Idempotency.SAFE, attempt=3, http_status=503)
        assert agreed.shadow and agreed.retryd_decision is not None
        assert agreed.deny_reason == agreed.retryd_decision.deny_reason == DenyReason.MAX_ATTEMPTS
        (line,) = warnings()
        assert "'shadow-log'" in line and "retryd DENY BUDGET_EXHAUSTED" in line
        assert "local rule RETRY (acted on)" in line and "; 0 more" in line
        assert client.shadow_divergences == {"shadow-log": 4}

        # Another upstream has its own interval.
        differing(client, "shadow-log-other")
        assert len(warnings()) == 2 and "'shadow-log-other'" in warnings()[1]

        # Once the interval has passed (the clock moved on, not slept), the
        # next difference is logged with the three that were not.
        client._shadow.clock = lambda: time.monotonic() + 1000.0
        differing(client)
        assert len(warnings()) == 3
        assert "'shadow-log'" in warnings()[2] and "; 3 more difference(s)" in warnings()[2]
        assert client.shadow_divergences == {"shadow-log": 5, "shadow-log-other": 1}


def test_a_bad_log_interval_is_refused(shadow_server: Server) -> None:
    with pytest.raises(ValueError, match="shadow_log_interval"):
        Client(shadow_server.grpc, shadow_log_interval=-1)
