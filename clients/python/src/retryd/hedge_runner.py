"""The hedged first round of a call, on asyncio: copies raced, the first good answer wins.

The adapters (:func:`retryd.httpx.arequest_with_retries`, the grpc.aio
interceptor) describe one copy of the call (``start_copy``) and what counts
as a final answer; this module owns the timing:

1. the first copy is sent and a timer of the served ``delay`` starts;
2. if the timer fires while no copy has answered, retryd is asked
   (``ask(k)``, a Decide with ``hedge = k``); a fast call never asks;
3. on RETRY a copy is sent and, below ``max_hedges``, the timer starts
   again; a DENY (or retryd failing to answer) ends the hedging of the call;
4. the first copy whose answer is final (not a retryable failure) wins; the
   others are cancelled (their tasks cancelled: the HTTP request aborted,
   the gRPC call cancelled) and awaited, so nothing outlives the call;
5. when every copy failed, the last failure is returned: the caller's
   normal retry path decides about it, as for an unhedged call.

What is recorded stays honest (``on_end``): a copy that answered, win or
failure, is reported with its elapsed time; a cancelled loser is not an
outcome at all, except that a cancelled *first* copy's elapsed time is
reported as a success latency (``on_first_cancelled``): leaving it out
would hide the very tail hedging is for. The caller's deadline bounds the
round: no hedge is asked for once it has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

from ._types import Decision
from .errors import RetrydError

R = TypeVar("R")


@dataclass(frozen=True)
class HedgePlan:
    """How to hedge one call: the delay before each hedge, and how many at most."""

    delay: float
    max_hedges: int
    #: True when the plan is the local fallback's fixed delay (retryd unreachable).
    local: bool = False


@dataclass
class HedgeRound(Generic[R]):
    """What a hedged round ended with."""

    result: R
    #: The copy that produced ``result``: 0 for the first attempt, k for the k-th hedge.
    copy: int
    #: Copies sent, the first included.
    sent: int
    #: retryd's answers to the hedge requests, in order.
    decisions: list[Decision]


async def run_hedged(
    *,
    plan: HedgePlan,
    start_copy: Callable[[int], Awaitable[R]],
    is_final: Callable[[R], bool],
    ask: Callable[[int], Awaitable[Decision]],
    on_end: Callable[[int, R, float], None],
    on_first_cancelled: Callable[[float], None],
    clock: Callable[[], float],
    remaining: Callable[[], Optional[float]],
    cancel_copy: Optional[Callable[[asyncio.Future[Any]], None]] = None,
) -> HedgeRound[R]:
    """Races copies of a call as the module doc describes. ``start_copy(k)`` sends copy k.

    ``cancel_copy`` cancels a loser (by default ``task.cancel()``); the httpx
    adapter's defers the cancel to a point where httpcore's pool survives it.
    """
    running: dict[asyncio.Future[Any], tuple[int, float]] = {}
    cancel: Callable[[asyncio.Future[Any]], None] = cancel_copy or _cancel_task

    def launch(copy: int) -> None:
        running[asyncio.ensure_future(start_copy(copy))] = (copy, clock())

    launch(0)
    sent = 1
    decisions: list[Decision] = []
    asking: Optional[asyncio.Future[Decision]] = None
    hedging = plan.max_hedges >= 1
    timer_at = clock() + plan.delay
    last: Optional[tuple[int, R]] = None
    try:
        while running:
            waiting: set[asyncio.Future[Any]] = set(running)
            timeout: Optional[float] = None
            if asking is not None:
                waiting.add(asking)
            elif hedging:
                timeout = max(0.0, timer_at - clock())
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                # The timer fired with every copy still running.
                left = remaining()
                if left is not None and left <= 0:
                    hedging = False
                else:
                    asking = asyncio.ensure_future(ask(sent))
                continue
            if asking is not None and asking in done:
                decision = _answer(asking)
                asking = None
                if decision is not None:
                    decisions.append(decision)
                if decision is not None and decision.should_retry and running:
                    launch(sent)
                    sent += 1
                    hedging = sent <= plan.max_hedges
                    timer_at = clock() + plan.delay
                else:
                    hedging = False
            finished = [task for task in done if task in running]
            # A final answer first, so that two copies ending together never
            # report the winner as a failure.
            finished.sort(key=lambda task: not is_final(task.result()))
            for task in finished:
                copy, started = running.pop(task)
                result: R = task.result()
                on_end(copy, result, clock() - started)
                if is_final(result):
                    await _cancel_losers(running, on_first_cancelled, clock, cancel)
                    return HedgeRound(result, copy, sent, decisions)
                last = (copy, result)
    finally:
        if asking is not None:
            asking.cancel()
        # Only on an exception (the caller cancelled): no copy outlives the call.
        if running:
            for task in running:
                cancel(task)
            await asyncio.gather(*running, return_exceptions=True)
    assert last is not None
    return HedgeRound(last[1], last[0], sent, decisions)


def _cancel_task(task: asyncio.Future[Any]) -> None:
    task.cancel()


def _answer(asking: asyncio.Future[Decision]) -> Optional[Decision]:
    try:
        return asking.result()
    except RetrydError:
        # retryd refused or could not answer, and no local hedging decided:
        # the call goes on unhedged, as it would have without a hedge timer.
        return None


async def _cancel_losers(running: dict[asyncio.Future[Any], tuple[int, float]],
                         on_first_cancelled: Callable[[float], None], clock: Callable[[], float],
                         cancel_copy: Callable[[asyncio.Future[Any]], None]) -> None:
    now = clock()
    for task, (copy, started) in running.items():
        cancel_copy(task)
        if copy == 0:
            on_first_cancelled(now - started)
    # Awaited so that each copy closes its connection or call before the
    # caller sees the winner.
    await asyncio.gather(*running, return_exceptions=True)
    running.clear()
