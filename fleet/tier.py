"""One Python tier of the ``layers`` scenario: the twin of fleet/tier.mjs
(same config, protocol, counters and strategies; read its header).

Run by fleet/run.py as ``python fleet/tier.py CONFIG.json`` in the venv
where the retryd client is installed as its README says (``pip install
"./clients/python[httpx]"``), with uvicorn as the ASGI server. Inbound, with
``config["lineage"]``, the app is wrapped in the client's
``retryd.asgi.LineageMiddleware``; outbound, every call goes through
``retryd.httpx.arequest_with_retries`` (strategy retryd), which reads the
request's lineage from the context the middleware set. Without lineage no
middleware is installed and the ``baggage`` header is taken off every
attempt, so that retryd decides each hop on its own, as before issue 31.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import resource
import socket
import sys
import time
from typing import Any

import httpx

from retryd import AsyncClient, Idempotency
from retryd.errors import AmbiguousExecutionError
from retryd.httpx import arequest_with_retries

RETRYABLE = (502, 503, 504)
TAG = "x-fleet-tag"
ITEM = re.compile(r"^/items/(\d+)$")


class TpsBudget:
    """tower/Finagle TpsBudget, as in fleet/caller.py."""

    def __init__(self, ttl: float = 10.0, min_per_sec: float = 10.0, percent: float = 0.2) -> None:
        self.ttl, self.percent = ttl, percent
        self.reserve = min_per_sec * ttl
        self.slots: collections.deque[list[float]] = collections.deque()

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
        if self.reserve + self.percent * sum(s[1] for s in self.slots) - sum(s[2] for s in self.slots) >= 1:
            slot[2] += 1
            return True
        return False


class Tier:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.strategy = config["strategy"]
        self.lineage = bool(config["lineage"])
        self.deadline = float(config["deadline_s"])
        self.attempt_timeout = float(config["attempt_timeout_s"])
        self.rng = random.Random(config["seed"])
        # counts[name][tag]: tag "f" inside the fault window, "-" outside it.
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.decisions: collections.Counter[str] = collections.Counter()
        self.decide_ms: list[float] = []
        self.in_flight = 0  # inbound requests being served (the runner waits for 0)
        self.budget = TpsBudget() if self.strategy == "local" else None
        self.retryd: AsyncClient | None = None
        self.http: httpx.AsyncClient | None = None

    async def open(self) -> None:
        if self.strategy == "retryd":
            tier = self

            class TimedClient(AsyncClient):
                async def decide(self, **kwargs: Any) -> Any:  # type: ignore[override]
                    started = time.perf_counter()
                    decision = await super().decide(**kwargs)
                    tier.decide_ms.append((time.perf_counter() - started) * 1000)
                    label = decision.verdict.name
                    if label == "DENY":
                        label += ":" + decision.deny_reason.name
                    if decision.fallback:
                        label = "fallback " + label
                    tier.decisions[label] += 1
                    return decision

            self.retryd = TimedClient(self.config["retryd_target"], timeout=0.2, layer=self.config["layer"],
                                      options=[("grpc.default_authority", "retryd")])

        async def on_request(request: httpx.Request) -> None:
            self.counts["attempts"][request.headers.get(TAG, "-")] += 1
            if not self.lineage:
                request.headers.pop("baggage", None)

        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.attempt_timeout),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
            event_hooks={"request": [on_request]},
        )

    async def close(self) -> None:
        if self.retryd is not None:
            await self.retryd.close()
        if self.http is not None:
            await self.http.aclose()

    async def call_downstream(self, k: int, tag: str) -> str:
        """'ok', 'failed' (a failed response) or 'no-response'."""
        assert self.http is not None
        url = f"{self.config['downstream_url']}/items/{k}"
        headers = {TAG: tag}
        if self.budget is not None:
            self.budget.deposit()
        if self.retryd is not None:
            try:
                response = await arequest_with_retries(
                    self.http, self.retryd, "GET", url, upstream=self.config["retryd_upstream"],
                    idempotency=Idempotency.SAFE, deadline=self.deadline, headers=headers)
            except (httpx.HTTPError, AmbiguousExecutionError):
                return "no-response"
            return "ok" if response.is_success else "failed"
        end = time.monotonic() + self.deadline
        attempt = 1
        while True:
            left = end - time.monotonic()
            try:
                response = await self.http.get(url, headers=headers, timeout=min(self.attempt_timeout, max(left, 0.001)))
                if response.is_success:
                    return "ok"
                if response.status_code not in RETRYABLE:
                    return "failed"
                result = "failed"
            except httpx.TransportError:
                result = "no-response"
            if attempt >= 3:
                return result
            if self.budget is not None and not self.budget.withdraw():
                self.decisions["local DENY:BUDGET"] += 1
                return result
            backoff = self.rng.uniform(0, min(1.0, 0.05 * 2 ** (attempt - 1)))
            if backoff + 0.05 > end - time.monotonic():
                return result
            self.decisions["local RETRY"] += 1
            await asyncio.sleep(backoff)
            attempt += 1

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"lang": "python", "layer": self.config["layer"],
                "counts": {name: dict(counter) for name, counter in self.counts.items()},
                "decisions": dict(self.decisions), "decide_ms": self.decide_ms,
                "cpu_s": usage.ru_utime + usage.ru_stime, "in_flight": self.in_flight}

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The service as a plain ASGI app."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/_stats":
            await self.reply(send, 200, self.stats())
            return
        match = ITEM.match(path)
        if not match or scope["method"] != "GET":
            await self.reply(send, 404, {"error": "no such route"})
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        tag = "f" if headers.get(TAG) == "f" else "-"
        self.counts["inbound"][tag] += 1
        self.in_flight += 1
        try:
            outcome = await self.call_downstream(int(match.group(1)), tag)
        finally:
            self.in_flight -= 1
        self.counts[outcome][tag] += 1
        await self.reply(send, 200 if outcome == "ok" else 503 if outcome == "failed" else 504,
                         {"outcome": outcome, "layer": self.config["layer"]})

    @staticmethod
    async def reply(send: Any, status: int, body: dict[str, Any]) -> None:
        text = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(text)).encode())]})
        await send({"type": "http.response.body", "body": text})


async def serve(tier: Tier) -> None:
    import uvicorn

    await tier.open()
    app: Any = tier.app
    if tier.lineage:
        # The client's inbound side: the request's lineage in the context for
        # the handler's outbound calls, and `retryd-retried` on its 5xx when
        # a call failed after retryd's decision.
        from retryd.asgi import LineageMiddleware

        app = LineageMiddleware(app, layer=tier.config["layer"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, interface="asgi3", log_level="warning", access_log=False, timeout_keep_alive=30,
                            lifespan="on")
    # uvicorn handles the runner's SIGTERM itself (a graceful stop; the
    # runner kills a tier that is not gone within 10 s).
    server = uvicorn.Server(config)
    started = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if started.done():
            started.result()
            return
        await asyncio.sleep(0.01)
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    await started
    await tier.close()


async def edge(tier: Tier) -> None:
    config = tier.config
    rate, duration = float(config["rate"]), float(config["duration_s"])
    tag_from, tag_until = config["tag_window_s"]
    await tier.open()
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    epoch = int(line.split()[1]) / 1000.0
    mono0 = time.monotonic() - (time.time() - epoch)
    offset = tier.rng.uniform(0, 1.0 / rate)
    tasks: set[asyncio.Task[None]] = set()

    async def one(k: int, tag: str) -> None:
        outcome = await tier.call_downstream(config["id"] * 1_000_000 + k, tag)
        tier.counts[outcome][tag] += 1

    k = 0
    while True:
        at = offset + k / rate
        if at >= duration:
            break
        delay = mono0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tag = "f" if tag_from <= at < tag_until else "-"
        tier.counts["first"][tag] += 1
        task = asyncio.create_task(one(k, tag))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        k += 1
    if tasks:
        await asyncio.wait(set(tasks), timeout=tier.deadline + 5)
    await tier.close()
    with open(config["out"], "w") as out:
        json.dump(tier.stats(), out)
    print("done", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        tier_config = json.load(file)
    tier_ = Tier(tier_config)
    asyncio.run(edge(tier_) if tier_config["role"] == "edge" else serve(tier_))
