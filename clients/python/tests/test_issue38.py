"""Issue 38: every request that reaches the upstream is an attempt that was decided.

Real servers on loopback count what they read and the connections they
accept; a real retryd decides (frozen with SIGSTOP, or killed, for the
fallback). In every scenario the requests the server read equal the
attempts the adapter says it sent, and each attempt after the first
followed a RETRY: httpx and httpcore re-send nothing by themselves, on a
fresh connection or a pooled one reset after the request was read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import grpc
import httpx
import pytest

from grpc_servers import METHOD, ResettingProxy, SilentServer, scripted
from grpc_servers import ok as grpc_ok
from grpc_servers import hang as grpc_hang
from scripted_http import KeepAliveAction, KeepAliveServer, hold, ok_keep_alive, reset_after_read
from support import CLIENT_TEST_CONFIG, Server, handled, start_server, stop_server, stopped, wait_for
from retryd import AmbiguousExecutionError, AsyncClient, Client, DenyReason, Idempotency, UnknownOutcome, Verdict
from retryd.grpc import AmbiguousAioRpcError, AmbiguousRpcError, AsyncRetryInterceptor, RetryInterceptor
from retryd.httpx import arequest_with_retries, attempts_of, decision_of, request_with_retries

SAFE, CHARGE = Idempotency.SAFE, Idempotency.NON_IDEMPOTENT


@dataclass
class Call:
    method: str
    idempotency: Idempotency
    deadline: Optional[float] = 5.0


Result = Union[httpx.Response, BaseException]


def run_calls(mode: str, retryd_target: str, origin: KeepAliveServer, calls: list[Call]) -> list[Result]:
    """Runs ``calls`` in order through one httpx client (one pool) and the adapter of ``mode``.

    The clients are at their defaults (httpx's own 5 s timeouts, retryd's
    200 ms decision timeout and default fallback).
    """
    results: list[Result] = []
    if mode == "sync":
        with Client(retryd_target) as retryd, httpx.Client() as http:
            for call in calls:
                try:
                    results.append(request_with_retries(
                        http, retryd, call.method, origin.url + "/v1/charges", content=b"charge",
                        upstream="py-resend", idempotency=call.idempotency, deadline=call.deadline))
                except (httpx.HTTPError, AmbiguousExecutionError) as error:
                    results.append(error)
        return results

    async def main() -> None:
        async with AsyncClient(retryd_target) as aretryd, httpx.AsyncClient() as ahttp:
            for call in calls:
                try:
                    results.append(await arequest_with_retries(
                        ahttp, aretryd, call.method, origin.url + "/v1/charges", content=b"charge",
                        upstream="py-resend", idempotency=call.idempotency, deadline=call.deadline))
                except (httpx.HTTPError, AmbiguousExecutionError) as error:
                    results.append(error)

    asyncio.run(main())
    return results


def attempts(results: list[Result]) -> int:
    counted = [attempts_of(result) for result in results]
    assert all(n is not None for n in counted), results
    return sum(n for n in counted if n is not None)


def scenario(mode: str, retryd_target: str, actions: list[KeepAliveAction],
             calls: list[Call]) -> tuple[list[Result], KeepAliveServer]:
    with KeepAliveServer(*actions) as origin:
        results = run_calls(mode, retryd_target, origin, calls)
    assert len(origin.requests) == attempts(results), (origin.requests, results)
    return results, origin


MODES = pytest.mark.parametrize("mode", ["sync", "async"])


@MODES
def test_a_pooled_connection_reset_after_the_read_is_not_resent(server: Server, mode: str) -> None:
    results, origin = scenario(mode, server.grpc, [ok_keep_alive(), reset_after_read(), ok_keep_alive()],
                               [Call("GET", SAFE), Call("POST", CHARGE)])
    first, charge = results
    assert isinstance(first, httpx.Response) and first.status_code == 200
    assert isinstance(charge, AmbiguousExecutionError) and attempts_of(charge) == 1
    # The charge went out on the pooled connection, was read, and was not
    # re-sent on a new one by httpcore.
    assert (len(origin.requests), origin.connections) == (2, 1)


@MODES
def test_a_safe_get_reset_on_a_pooled_connection_is_resent_only_as_a_decided_retry(
        server: Server, mode: str) -> None:
    results, origin = scenario(mode, server.grpc, [ok_keep_alive(), reset_after_read(), ok_keep_alive()],
                               [Call("GET", SAFE), Call("GET", SAFE)])
    second = results[1]
    assert isinstance(second, httpx.Response) and attempts_of(second) == 2
    retry = decision_of_first(second)
    assert retry.verdict is Verdict.RETRY and not retry.fallback
    assert (len(origin.requests), origin.connections) == (3, 2)


def decision_of_first(response: httpx.Response) -> Any:
    decisions = response.extensions["retryd.decisions"]
    assert len(decisions) == 1
    return decisions[0]


@MODES
def test_a_get_declared_non_idempotent_is_not_resent(server: Server, mode: str) -> None:
    """The method never decides: a GET that charges is treated as a charge."""
    results, origin = scenario(mode, server.grpc, [ok_keep_alive(), reset_after_read()],
                               [Call("GET", SAFE), Call("GET", CHARGE)])
    assert isinstance(results[1], AmbiguousExecutionError)
    assert results[1].decision.unknown_outcome is UnknownOutcome.RECONCILE
    assert (len(origin.requests), origin.connections) == (2, 1)


@MODES
def test_a_fresh_connection_reset_after_the_read_is_not_resent(server: Server, mode: str) -> None:
    results, origin = scenario(mode, server.grpc, [reset_after_read()], [Call("POST", CHARGE)])
    assert isinstance(results[0], AmbiguousExecutionError) and results[0].decision.rule == 8
    assert (len(origin.requests), origin.connections) == (1, 1)


@MODES
def test_a_safe_get_reset_every_time_is_read_once_per_decided_attempt(server: Server, mode: str) -> None:
    results, origin = scenario(mode, server.grpc, [reset_after_read()], [Call("GET", SAFE)])
    error = results[0]
    assert isinstance(error, httpx.TransportError) and attempts_of(error) == 3  # retryd's max_attempts
    assert decision_of(error).deny_reason is DenyReason.MAX_ATTEMPTS  # type: ignore[union-attr]
    assert len(origin.requests) == 3


# ------------------------------------------------------------------ the caller's deadline after sending

@MODES
def test_a_hung_charge_that_runs_into_the_callers_deadline_is_ambiguous_without_asking_retryd(
        server: Server, mode: str) -> None:
    before = handled(server)
    with KeepAliveServer() as origin:
        origin.actions = [hold(origin.released)]
        results = run_calls(mode, server.grpc, origin, [Call("POST", CHARGE, deadline=0.5)])
        assert len(origin.requests) == 1
    error = results[0]
    assert isinstance(error, AmbiguousExecutionError) and attempts_of(error) == 1
    assert isinstance(error.__cause__, httpx.ReadTimeout)
    decision = error.decision
    assert decision.deny_reason is DenyReason.DEADLINE and decision.unknown_outcome is UnknownOutcome.RECONCILE
    # Decided locally: retryd was reachable, yet gave no decision id, and did not count a request.
    assert decision.decision_id == "" and not decision.fallback
    assert "deadline passed" in decision.explanation
    assert handled(server) == before


@MODES
def test_a_hung_grpc_charge_that_runs_into_the_callers_deadline_is_ambiguous_without_asking_retryd(
        server: Server, mode: str) -> None:
    release = threading.Event()
    before = handled(server)
    with scripted(grpc_hang(release)) as origin:
        try:
            if mode == "sync":
                with Client(server.grpc) as retryd:
                    interceptor = RetryInterceptor(retryd, upstream="py-resend", idempotency=CHARGE)
                    with grpc.intercept_channel(grpc.insecure_channel(origin.target), interceptor) as channel:
                        with pytest.raises(AmbiguousRpcError) as raised:
                            channel.unary_unary(METHOD)(b"charge", timeout=0.5)
                error: AmbiguousExecutionError = raised.value
            else:
                async def main() -> AmbiguousExecutionError:
                    async with AsyncClient(server.grpc) as aretryd:
                        interceptor = AsyncRetryInterceptor(aretryd, upstream="py-resend", idempotency=CHARGE)
                        async with grpc.aio.insecure_channel(origin.target, interceptors=[interceptor]) as channel:
                            with pytest.raises(AmbiguousAioRpcError) as araised:
                                await channel.unary_unary(METHOD)(b"charge", timeout=0.5)
                    return araised.value

                error = asyncio.run(main())
        finally:
            release.set()
        assert len(origin.calls) == 1
    assert error.deny_reason is DenyReason.DEADLINE and error.decision.decision_id == ""
    assert not error.decision.fallback and error.decision.unknown_outcome is UnknownOutcome.RECONCILE
    assert handled(server) == before


# ------------------------------------------------------------------ retryd frozen, then killed

@pytest.fixture
def own_retryd(tmp_path: Path) -> Iterator[Server]:
    started = start_server(CLIENT_TEST_CONFIG, tmp_path)
    yield started
    if started.process.poll() is None:
        started.process.send_signal(signal.SIGCONT)
        stop_server(started)


def test_with_retryd_frozen_then_killed_reads_equal_decided_attempts_and_each_outage_warns_twice(
        own_retryd: Server, caplog: pytest.LogCaptureFixture) -> None:
    calls = [Call("GET", SAFE), Call("POST", CHARGE), Call("GET", CHARGE)]
    with caplog.at_level(logging.WARNING, logger="retryd"), KeepAliveServer(reset_after_read()) as origin, \
            Client(own_retryd.grpc) as retryd, httpx.Client() as http:
        def run() -> list[Result]:
            results: list[Result] = []
            for call in calls:
                try:
                    results.append(request_with_retries(http, retryd, call.method, origin.url, upstream="py-resend",
                                                         idempotency=call.idempotency, deadline=call.deadline))
                except (httpx.HTTPError, AmbiguousExecutionError) as error:
                    results.append(error)
            return results

        assert not retryd.decide(upstream="py-resend", idempotency=SAFE, attempt=1, http_status=503).fallback
        own_retryd.process.send_signal(signal.SIGSTOP)
        wait_for(lambda: stopped(own_retryd.process.pid), what="every retryd thread to stop")
        frozen = run()
        own_retryd.process.send_signal(signal.SIGCONT)
        thawing = 0  # decisions the local rule still made while retryd woke up

        def answered() -> bool:
            nonlocal thawing
            fallback = retryd.decide(upstream="py-resend", idempotency=SAFE, attempt=1, http_status=503).fallback
            thawing += fallback
            return not fallback

        wait_for(answered, what="retryd to answer again")
        own_retryd.process.kill()
        own_retryd.process.wait()
        killed = run()
        for results in (frozen, killed):
            # The local rule: a SAFE GET once more (2 attempts), the charges never.
            assert [attempts_of(result) for result in results] == [2, 1, 1]
            assert all(decision_of(result).fallback for result in results)  # type: ignore[union-attr]
            assert isinstance(results[1], AmbiguousExecutionError)
            assert isinstance(results[2], AmbiguousExecutionError)
        assert len(origin.requests) == attempts(frozen) + attempts(killed) == 8
    lines = [record.getMessage() for record in caplog.records if "decisions:" in record.getMessage()]
    assert len(lines) == 3, lines  # frozen, back (with its count), killed
    assert "unreachable" in lines[0] and "unreachable" in lines[2]
    assert "reachable again" in lines[1], lines[1]
    assert f"decisions: {4 + thawing} made by the local rule" in lines[1], lines[1]


# ------------------------------------------------------------------ the first decision is retryd's

FIRST_DECISION = {
    "sync": """
import sys, time
from retryd import Client, FailureKind, Idempotency
built = time.monotonic()
client = Client(sys.argv[1])
decision = client.decide(upstream="py-first", idempotency=Idempotency.SAFE, attempt=1, failure=FailureKind.CONNECT)
print(time.monotonic(), built, decision.fallback, decision.decision_id)
client.close()
""",
    "async": """
import asyncio, sys, time
from retryd import AsyncClient, FailureKind, Idempotency
async def main():
    built = time.monotonic()
    client = AsyncClient(sys.argv[1])
    decision = await client.decide(upstream="py-first", idempotency=Idempotency.SAFE, attempt=1,
                                   failure=FailureKind.CONNECT)
    print(time.monotonic(), built, decision.fallback, decision.decision_id)
    await client.close()
asyncio.run(main())
""",
}


@MODES
def test_the_first_decision_of_a_new_process_is_retryds(server: Server, mode: str) -> None:
    """Connecting is not charged to the first decision's 200 ms: the client connects when it is built.

    CLOCK_MONOTONIC is system-wide, so the child's clock reading is
    comparable with the parent's, taken just before the process started.
    """
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", FIRST_DECISION[mode], server.grpc], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert child.returncode == 0, child.stderr
    decided_at, built_at, fallback, decision_id = child.stdout.split()
    assert fallback == "False" and decision_id, child.stdout
    from_start, from_build = float(decided_at) - started, float(decided_at) - float(built_at)
    assert 0 < from_build < from_start
    # Not a latency ceiling: the measured numbers, for the README.
    print(f"{mode}: process start -> first decision {from_start * 1000:.0f} ms, "
          f"client built -> first decision {from_build * 1000:.0f} ms")


@MODES
def test_the_client_connects_when_it_is_built(mode: str) -> None:
    """Before any call: the connection to retryd is opened by the constructor."""
    with SilentServer() as listener:
        if mode == "sync":
            client = Client(listener.target)
            try:
                wait_for(lambda: listener.accepted() >= 1, what="the client's connection")
            finally:
                client.close()
        else:
            async def main() -> None:
                aclient = AsyncClient(listener.target)
                try:
                    give_up = time.monotonic() + 5
                    while listener.accepted() < 1:
                        assert time.monotonic() < give_up, "no connection from the async client"
                        await asyncio.sleep(0.02)
                finally:
                    await aclient.close()

            asyncio.run(main())


def test_a_grpc_call_reset_after_the_server_read_it_is_resent_only_as_decided_retries(server: Server) -> None:
    """grpcio's transparent retries cover only streams that never reached the server:
    a call reset after the handler got it is re-sent only when retryd says RETRY."""
    release = threading.Event()
    retries: list[float] = []
    with scripted(grpc_hang(release), grpc_hang(release), grpc_ok()) as origin, \
            ResettingProxy(origin.port) as proxy, Client(server.grpc) as retryd:
        def reset_the_first_two() -> None:
            for n in (1, 2):
                give_up = time.monotonic() + 10
                while len(origin.calls) < n and time.monotonic() < give_up:
                    time.sleep(0.01)  # a poll for the server to have read call n
                proxy.reset_clients()

        resetter = threading.Thread(target=reset_the_first_two, daemon=True)
        resetter.start()
        interceptor = RetryInterceptor(retryd, upstream="py-resend", idempotency=SAFE,
                                       sleep=lambda seconds: retries.append(seconds) or time.sleep(seconds))
        try:
            with grpc.intercept_channel(grpc.insecure_channel(proxy.target), interceptor) as channel:
                reply = channel.unary_unary(METHOD)(b"stock", timeout=5.0)
        finally:
            release.set()
            resetter.join(10)
        assert reply == b"ok"
        assert len(origin.calls) == len(retries) + 1 == 3
