"""One Python caller of the fleet: an open-loop stream of calls to the upstream.

Run by fleet/run.py as ``python fleet/caller.py CONFIG.json`` in a venv where
the retryd client is installed as its README says (``pip install
"./clients/python[httpx]"``). It prints ``ready`` once set up, waits for
``go EPOCH_MS`` on stdin (the wall-clock instant every caller counts from),
sends its calls on its own clock, writes its counters to ``config["out"]``
and prints ``done``.

Arrivals are open loop: call k starts at ``offset + k / rate`` whatever the
earlier calls are doing, because a real fleet's traffic does not slow down
when the upstream does. Half are GET /items/N (SAFE), half POST /charges
with an Idempotency-Key per logical payment (kept across that payment's
attempts). POST /charges has no idempotency store, so the charge is declared
NON_IDEMPOTENT to retryd: the key identifies the payment so that the
upstream can count duplicates, it does not make a re-send safe. With
``config["keyed"]`` the charges go to POST /keyed-charges, which honours the
key, declared IDEMPOTENT_WITH_KEY.

Strategies (``config["strategy"]``):
  none     one attempt
  naive    up to 3 attempts on 502/503/504, timeouts and connection errors,
           any method, full-jitter exponential backoff (50 ms base, as
           retryd's default), as HTTP client retry settings and proxies'
           ``retry_on: 5xx,reset`` do
  local    naive, but each retry needs a token from this process's own
           TpsBudget (Finagle/tower: 20% of its own requests plus 10/s,
           over a 10 s window)
  retryd   ``retryd.httpx.arequest_with_retries`` with the client's default
           reporter: retryd decides every retry

The tail scenario (fleet/tail.py) adds two options. ``config["tail"]``: every
call is a GET of a path of its own (``/items/py-ID-K``, so that the upstream's
delay mode draws each call's first attempt the same for every strategy), and
each answered call is recorded as ``[start s, ms, copy]`` (``copy``: the
upstream's x-fleet-copy, 2 when a hedge won), with retryd's answers to hedge
requests counted as ``hedge ...`` decisions. ``config["local_hedging"]``
(``{"delay_s", "max_hedges", "max_extra_load"}``) gives the client its
fixed-delay ``LocalHedging``, which it uses while retryd is unreachable.

Options of the pushback scenario (fleet/pushback.py), off unless set:
  ``honour_retry_after``  naive also retries a 429, and waits at least its
                          Retry-After (each caller on its own answer)
  ``tag_retries``         every attempt after a call's first carries
                          ``x-fleet-prev-ms``: when the previous attempt's
                          answer came (ms since the epoch), for the upstream
                          to count retries and the early ones
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import resource
import sys
import time
import uuid
from typing import Any

import httpx

from retryd import AsyncClient, Idempotency
from retryd.errors import AmbiguousExecutionError
from retryd.httpx import arequest_with_retries

RETRYABLE_STATUSES = (502, 503, 504)


class TpsBudget:
    """tower/Finagle TpsBudget: retries allowed in the last ``ttl`` seconds ≤
    min_per_sec × ttl + percent × requests deposited in that window."""

    def __init__(self, ttl: float = 10.0, min_per_sec: float = 10.0, percent: float = 0.2) -> None:
        self.ttl, self.percent = ttl, percent
        self.reserve = min_per_sec * ttl
        self.slots: collections.deque[list[float]] = collections.deque()  # [second, deposits, withdrawals]

    def _slot(self) -> list[float]:
        now = time.monotonic()
        second = float(int(now))
        while self.slots and self.slots[0][0] <= now - self.ttl:
            self.slots.popleft()
        if not self.slots or self.slots[-1][0] != second:
            self.slots.append([second, 0.0, 0.0])
        return self.slots[-1]

    def deposit(self) -> None:
        self._slot()[1] += 1

    def withdraw(self) -> bool:
        slot = self._slot()
        deposits = sum(s[1] for s in self.slots)
        withdrawals = sum(s[2] for s in self.slots)
        if self.reserve + self.percent * deposits - withdrawals >= 1:
            slot[2] += 1
            return True
        return False


class Counters:
    def __init__(self, epoch: float, bucket_s: float) -> None:
        self.epoch, self.bucket_s = epoch, bucket_s
        self.series: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self.decisions: collections.Counter[str] = collections.Counter()
        self.decide_ms: list[float] = []
        self.call_ms: list[float] = []
        self.explanations: list[str] = []

    def bucket(self, at: float | None = None) -> int:
        return int(((time.time() if at is None else at) - self.epoch) // self.bucket_s)

    def add(self, name: str, at: float | None = None) -> None:
        self.series[name][self.bucket(at)] += 1


class TimedClient(AsyncClient):
    """The real AsyncClient, timing each decision as the caller waits for it
    (that wait is the latency retryd adds to a failed call) and counting its
    verdicts and deny reasons."""

    counters: Counters

    async def decide(self, **kwargs: Any) -> Any:  # type: ignore[override]
        started = time.perf_counter()
        decision = await super().decide(**kwargs)
        self.counters.decide_ms.append((time.perf_counter() - started) * 1000)
        label = decision.verdict.name
        if decision.verdict.name == "DENY":
            label += ":" + decision.deny_reason.name
        if decision.fallback:
            label = "fallback " + label
        self.counters.decisions[label] += 1
        self.counters.add("decisions")
        if decision.verdict.name == "RETRY" and not decision.fallback:
            self.counters.add("granted")
        return decision

    async def decide_hedge(self, **kwargs: Any) -> Any:  # type: ignore[override]
        decision = await super().decide_hedge(**kwargs)
        label = "hedge " + decision.verdict.name
        if decision.verdict.name == "DENY":
            label += ":" + decision.deny_reason.name
        if decision.fallback:
            label = "fallback " + label
        self.counters.decisions[label] += 1
        self.counters.add("hedge_asked")
        # A few of retryd's explanations (delay, p50, p99, window counts) for the report.
        self.counters.explanations.append(f"{time.time() - self.counters.epoch:.1f}s {decision.explanation}")
        del self.counters.explanations[3:-3]
        if decision.verdict.name == "RETRY":
            self.counters.add("hedge_granted")
        return decision


async def main(config: dict[str, Any]) -> None:
    strategy = config["strategy"]
    rate, duration = float(config["rate"]), float(config["duration_s"])
    base = config["upstream_url"]
    rng = random.Random(config["seed"])
    deadline = float(config["deadline_s"])
    attempt_timeout = float(config["attempt_timeout_s"])

    # With several replicas the target is "ipv4:A,B": grpcio would send that
    # whole list as the HTTP/2 :authority, which retryd's server refuses
    # (RST_STREAM PROTOCOL_ERROR), so name the authority explicitly.
    tail_mode = bool(config.get("tail"))
    local = config.get("local_hedging")
    extra: dict[str, Any] = {}
    if local:
        from retryd.hedging import LocalHedging

        extra["local_hedging"] = LocalHedging(delay=float(local["delay_s"]), max_hedges=int(local["max_hedges"]),
                                              max_extra_load=float(local["max_extra_load"]))
    retryd = (TimedClient(config["retryd_target"], timeout=0.2, options=[("grpc.default_authority", "retryd")], **extra)
              if strategy == "retryd" else None)
    budget = TpsBudget() if strategy == "local" else None

    counters_box: dict[str, Counters] = {}

    honour_retry_after = bool(config.get("honour_retry_after"))
    tag_retries = bool(config.get("tag_retries"))
    # x-fleet-call -> ms since the epoch of the call's last answer (or, after
    # a transport error, of its last send).
    last_event: dict[str, float] = {}

    def epoch_ms() -> float:
        return (time.time() - counters_box["c"].epoch) * 1000

    async def count_attempt(request: httpx.Request) -> None:
        if "c" in counters_box:  # not the warm-up's requests
            counters_box["c"].add("attempts")
        call_id = request.headers.get("x-fleet-call")
        if tag_retries and call_id is not None:
            # The hook runs before the request is sent, so the tag rides on it.
            if call_id in last_event:
                request.headers["x-fleet-prev-ms"] = str(int(last_event[call_id]))
            last_event[call_id] = epoch_ms()

    async def note_answer(response: httpx.Response) -> None:
        call_id = response.request.headers.get("x-fleet-call")
        if tag_retries and call_id is not None:
            last_event[call_id] = epoch_ms()

    http = httpx.AsyncClient(
        timeout=httpx.Timeout(attempt_timeout),
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
        event_hooks={"request": [count_attempt], "response": [note_answer]},
    )
    if tail_mode:
        # Connections opened and code paths run before the clock starts, with
        # plain requests (not through the client: no latency recorded), so
        # that the first seconds' latencies, which stay in retryd's window for
        # its whole length, are not those of a cold process.
        for _ in range(3):
            await asyncio.gather(*(http.get(f"{base}/items/warm-py-{config['id']}-{i}") for i in range(20)))
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    epoch = int(line.split()[1]) / 1000.0
    counters = Counters(epoch, config["bucket_ms"] / 1000.0)
    counters_box["c"] = counters
    if retryd is not None:
        retryd.counters = counters

    async def own_loop(method: str, url: str, headers: dict[str, str], content: bytes | None) -> str:
        attempts = 1 if strategy == "none" else 3
        end = time.monotonic() + deadline
        attempt = 1
        while True:
            left = end - time.monotonic()
            failed_retryably = False
            floor = 0.0
            try:
                response = await http.request(method, url, headers=headers, content=content,
                                              timeout=min(attempt_timeout, max(left, 0.001)))
                if 200 <= response.status_code < 300:
                    return "ok"
                failed_retryably = response.status_code in RETRYABLE_STATUSES
                if honour_retry_after and response.status_code == 429:
                    # Per caller: this caller's own answer paces only this call.
                    failed_retryably = True
                    try:
                        floor = float(response.headers.get("retry-after", "0"))
                    except ValueError:
                        floor = 0.0
            except httpx.TransportError:
                failed_retryably = True
            if not failed_retryably or attempt >= attempts:
                return "failed"
            if budget is not None and not budget.withdraw():
                counters.decisions["local DENY:BUDGET"] += 1
                return "failed"
            backoff = floor + rng.uniform(0, min(1.0, 0.05 * 2 ** (attempt - 1)))
            if backoff + 0.05 > end - time.monotonic():
                return "failed"
            counters.decisions["local RETRY"] += 1
            await asyncio.sleep(backoff)
            attempt += 1

    async def call(k: int, kind: str) -> None:
        started = time.monotonic()
        copy = 0
        if kind == "GET":
            path = f"py-{config['id']}-{k}" if tail_mode else str(k)
            method, url, headers, content = "GET", f"{base}/items/{path}", {}, None
            idempotency = Idempotency.SAFE
        else:
            # One key per logical payment, the same on every attempt of it.
            headers = {"Idempotency-Key": f"py-{config['id']}-{uuid.uuid4()}", "content-type": "application/json"}
            content = json.dumps({"amount": 100 + k}).encode()
            if config["keyed"]:
                # This endpoint honours the key, so the declaration is true.
                method, url, idempotency = "POST", f"{base}/keyed-charges", Idempotency.IDEMPOTENT_WITH_KEY
            else:
                method, url, idempotency = "POST", f"{base}/charges", Idempotency.NON_IDEMPOTENT
        if tag_retries:
            headers = dict(headers, **{"x-fleet-call": f"{config['id']}-{k}"})
        if budget is not None:
            budget.deposit()
        try:
            if retryd is not None:
                response = await arequest_with_retries(
                    http, retryd, method, url, upstream=config["retryd_upstream"], idempotency=idempotency,
                    deadline=deadline, headers=headers, content=content)
                outcome = "ok" if 200 <= response.status_code < 300 else "failed"
                copy = int(response.headers.get("x-fleet-copy", "0"))
            else:
                outcome, copy = await own_loop(method, url, headers, content), 1
        except AmbiguousExecutionError:
            outcome = "ambiguous"
        except httpx.HTTPError as error:
            outcome = "failed"
            if tail_mode:
                counters.decisions[f"error {type(error).__name__}"] += 1
        counters.add(outcome, at=epoch + started_at[k])
        if kind == "GET":
            # The idempotent calls apart (issue 32 compares their success).
            counters.add("get_" + outcome, at=epoch + started_at[k])
        if kind == "POST" and outcome == "failed":
            # What the caller believes did not happen: compared with the
            # upstream's applied charges, a key in both is a payment taken
            # while the caller was told it failed.
            failed_keys.append(headers["Idempotency-Key"])
        if outcome == "ok":
            counters.call_ms.append((time.monotonic() - started) * 1000)
            if tail_mode:
                tail_calls.append([round(started_at[k], 3), round((time.monotonic() - started) * 1000, 2), copy])

    started_at: dict[int, float] = {}
    failed_keys: list[str] = []
    tail_calls: list[list[float]] = []
    offset = rng.uniform(0, 1.0 / rate)
    tasks: set[asyncio.Task[None]] = set()
    mono0 = time.monotonic() - (time.time() - epoch)  # monotonic instant of the epoch
    k = 0
    while True:
        at = offset + k / rate
        if at >= duration:
            break
        delay = mono0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        started_at[k] = at
        counters.add("first", at=epoch + at)
        if len(tasks) >= config["max_in_flight"]:
            counters.add("shed", at=epoch + at)
        else:
            kind = "GET" if rng.random() < 0.5 or tail_mode else "POST"
            if kind == "GET":
                counters.add("get_first", at=epoch + at)
            task = asyncio.create_task(call(k, kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        k += 1
    # Every call is bounded by its deadline, so this ends.
    if tasks:
        await asyncio.wait(set(tasks), timeout=deadline + 5)
    reporter_dropped = None
    if retryd is not None:
        reporter = retryd.reporter
        await retryd.close()  # sends the traffic counted so far
        reporter_dropped = getattr(reporter, "dropped_requests", None)
    await http.aclose()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "lang": "python",
        "id": config["id"],
        "strategy": strategy,
        "arrivals": k,
        "series": {name: {str(b): n for b, n in sorted(c.items())} for name, c in counters.series.items()},
        "decisions": dict(counters.decisions),
        "decide_ms": counters.decide_ms,
        "call_ms": counters.call_ms,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "reporter_dropped": reporter_dropped,
        "unfinished": len(tasks),
        "failed_charge_keys": failed_keys,
        "tail_calls": tail_calls,
        "hedge_explanations": counters.explanations,
    }
    with open(config["out"], "w") as out:
        json.dump(result, out)
    print("done", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        asyncio.run(main(json.load(file)))
