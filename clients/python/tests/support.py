"""Helpers for the tests: start and stop a real retryd from $RETRYD_BIN."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# RETRYD_CONFORMANCE points at another copy of the vectors (a newer one in
# a sibling checkout, say); by default, this repository's.
VECTORS = Path(os.environ.get("RETRYD_CONFORMANCE") or REPO / "conformance" / "decisions.json")

# Fast backoffs so that end-to-end retry tests sleep milliseconds.
CLIENT_TEST_CONFIG = """
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
max_retry_after = "60s"
transient_500 = false
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "10ms", max = "50ms", jitter = "full" }

# A large minimum attempt budget, so deadline tests need no tight timing.
[upstreams."py-slow"]
min_attempt_budget = "300ms"

[upstreams."py-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

# Budgets that start empty and fill only from reported traffic (issue 16).
[upstreams."py-fill"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams."py-fill-async"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams."py-fill-grpc"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams."py-opt-out"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams."py-dedup"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

# Never filled: every retry is BUDGET_EXHAUSTED.
[upstreams."py-drained"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

# Issue 36: an empty budget that stays empty (0.1 token per reported request),
# so a retry of an attempt that may have run is denied BUDGET_EXHAUSTED.
[upstreams."x"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }

[upstreams."py-dedup-direct"]
budget = { capacity = 100.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

# Issue 33: hedged upstreams at the policy's defaults (p95, one hedge, 5% of
# first attempts, 100 samples over 30 s); the tests report the latencies.
[upstreams."py-hedged".hedging]
quantile = 0.95

[upstreams."py-hedged-grpc".hedging]
quantile = 0.95

[upstreams."py-hedge-cap".hedging]
quantile = 0.95

[upstreams."py-hedged-sync-grpc".hedging]
quantile = 0.95

[upstreams."py-hedged-sync-http".hedging]
quantile = 0.95

# In shadow mode: retryd's hedge answers are not enforced.
[upstreams."py-hedge-shadow"]
enforce = false

[upstreams."py-hedge-shadow".hedging]
quantile = 0.95
"""


def retryd_bin() -> Path:
    path = Path(os.environ.get("RETRYD_BIN") or REPO / "target" / "debug" / "retryd")
    if not path.is_file():
        pytest.fail(f"retryd binary not found at {path}: build it (cargo build --bin retryd) or set RETRYD_BIN")
    return path


@dataclass
class Server:
    grpc: str
    metrics: str
    process: subprocess.Popen[bytes]


def start_server(config: str, directory: Path) -> Server:
    config_path = directory / "retryd.toml"
    config_path.write_text(config)
    stderr = open(directory / "retryd.stderr", "wb")
    process = subprocess.Popen(
        [str(retryd_bin()), "serve", "--config", str(config_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    lines: queue.Queue[bytes] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        lines.put(process.stdout.readline())
        for _ in process.stdout:  # keep draining
            pass

    threading.Thread(target=read, daemon=True).start()
    try:
        line = lines.get(timeout=60)
        addresses = json.loads(line)
    except (queue.Empty, ValueError) as error:
        process.kill()
        process.wait()
        log = (directory / "retryd.stderr").read_text(errors="replace")[-4000:]
        pytest.fail(f"retryd did not start ({error!r}); stderr:\n{log}")
    return Server(grpc=addresses["grpc"], metrics=addresses["metrics"], process=process)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0, what: str = "the condition") -> None:
    """Polls ``condition`` until it holds; fails the test after ``timeout`` seconds."""
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def metrics(server: Server) -> dict[str, float]:
    """retryd's Prometheus samples, by full sample name (labels included)."""
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def handled(server: Server) -> float:
    """Decide calls retryd has dealt with: decisions made, plus those it did not
    make because the caller had given up (its grpc-timeout passed, or it reset
    the call), which retryd counts in retryd_expired_requests_total."""
    total = 0.0
    for name, value in metrics(server).items():
        if name.split("{", 1)[0] in ("retryd_decisions_total", "retryd_expired_requests_total"):
            total += value
    return total


def hedges_won(server: Server, upstream: str) -> float:
    """retryd_hedges_won_total for one upstream, from retryd's /metrics."""
    return sum(value for name, value in metrics(server).items()
               if name.startswith("retryd_hedges_won_total{") and f'upstream="{upstream}"' in name)


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (Linux /proc)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            return False
    return bool(states) and all(state in ("T", "t") for state in states)


class FakeClock:
    """Monotonic seconds that move only when the code under test sleeps on them.

    Pass it as ``clock=`` and its :meth:`sleep` (or :meth:`asleep`) as
    ``sleep=`` to an adapter: its deadline arithmetic then runs on this clock,
    so a latency promise can be asserted exactly, whatever the machine's load.
    Start and steps are binary fractions, so the arithmetic is exact.
    """

    def __init__(self, start: float = 1024.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)
