"""The hedged first round of a blocking call: copies as cancellable futures, raced on threads.

The blocking twin of :mod:`retryd.hedge_runner`, with the same rules: the
first copy is sent and a timer of the served ``delay`` starts; only when it
fires with no copy answered is retryd asked (``ask(k)``, on a thread of its
own, so that a copy answering meanwhile is seen at once); on RETRY a copy
is sent and, below ``max_hedges``, the timer starts again; a DENY or no
answer ends the hedging of the call; the first copy whose answer is final
wins and the others are cancelled (``cancel``) before the call returns;
when every copy failed, the last failure is returned for the normal retry
path. A copy is anything with ``add_done_callback(fn)`` and ``cancel()``:
grpcio's ``.future()`` calls, whose ``cancel()`` cancels the RPC (the
server sees CANCELLED), and the blocking httpx adapter's copies on worker
threads, whose ``cancel()`` shuts the copy's socket down
(:mod:`retryd._thread_copy`). ``may_hedge()``, if given, is asked when the
timer fires: False ends the hedging of the call without asking retryd (a
copy that could not be cancelled is never raced).

What is recorded stays honest, as in the asyncio runner: a copy that
answered is reported with its elapsed time (``on_end``); a cancelled loser
is no outcome, except that a cancelled first copy's elapsed time is a
success latency (``on_first_cancelled``). A hedge decision still in flight
when the round ends is left to finish on its thread (bounded by the retryd
client's timeout) and ignored.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Protocol, TypeVar

from ._types import Decision
from .errors import RetrydError
from .hedge_runner import HedgePlan, HedgeRound


class Copy(Protocol):
    def add_done_callback(self, fn: Callable[[Any], None]) -> Any: ...

    def cancel(self) -> bool: ...


F = TypeVar("F", bound=Copy)


def run_hedged_blocking(
    *,
    plan: HedgePlan,
    first: F,
    start_copy: Callable[[int], F],
    is_final: Callable[[F], bool],
    ask: Callable[[int], Decision],
    on_end: Callable[[int, F, float], None],
    on_first_cancelled: Callable[[float], None],
    clock: Callable[[], float],
    remaining: Callable[[], Optional[float]],
    first_sent_at: float,
    may_hedge: Optional[Callable[[], bool]] = None,
) -> HedgeRound[F]:
    """Races copies of a call as the module doc describes; ``first`` is copy 0, already sent."""
    events: queue.Queue[tuple[str, int, Any]] = queue.Queue()
    running: dict[int, tuple[F, float]] = {}

    def watch(copy: int, future: F, started: float) -> None:
        running[copy] = (future, started)
        future.add_done_callback(lambda done: events.put(("copy", copy, done)))

    watch(0, first, first_sent_at)
    sent = 1
    decisions: list[Decision] = []
    asking = False
    hedging = plan.max_hedges >= 1
    timer_at = first_sent_at + plan.delay
    last: Optional[tuple[int, F]] = None
    while running:
        timeout = max(0.0, timer_at - clock()) if hedging and not asking else None
        try:
            kind, copy, value = events.get(timeout=timeout)
        except queue.Empty:
            # The timer fired with every copy still running: only now is retryd asked.
            left = remaining()
            if (left is not None and left <= 0) or (may_hedge is not None and not may_hedge()):
                hedging = False
            else:
                asking = True
                threading.Thread(target=_ask, args=(ask, sent, events), daemon=True,
                                 name="retryd-hedge-decide").start()
            continue
        if kind == "ask":
            asking = False
            decision: Optional[Decision] = value
            if decision is not None:
                decisions.append(decision)
            if decision is not None and decision.should_retry:
                watch(sent, start_copy(sent), clock())
                sent += 1
                hedging = sent <= plan.max_hedges
                timer_at = clock() + plan.delay
            else:
                hedging = False
            continue
        if copy not in running:
            continue  # a loser that ended after the round did
        future, started = running.pop(copy)
        on_end(copy, future, clock() - started)
        if is_final(future):
            now = clock()
            for other, (loser, loser_started) in running.items():
                loser.cancel()
                if other == 0:
                    on_first_cancelled(now - loser_started)
            running.clear()
            return HedgeRound(future, copy, sent, decisions)
        last = (copy, future)
    assert last is not None
    return HedgeRound(last[1], last[0], sent, decisions)


def _ask(ask: Callable[[int], Decision], hedge: int, events: queue.Queue[tuple[str, int, Any]]) -> None:
    try:
        decision: Optional[Decision] = ask(hedge)
    except RetrydError:
        # retryd refused or could not answer, and no local hedging decided:
        # the call goes on unhedged, as it would have without a hedge timer.
        decision = None
    events.put(("ask", hedge, decision))
