"""What recording one first attempt costs the caller (issue 33): a micro-benchmark.

Measures, per recorded attempt, on the reporter a client owns (no network:
the reporter only adds to in-memory counters under a lock):

- ``record_latency``: the bucket computation and the histogram increment;
- a whole first attempt's bookkeeping as the adapters do it: ``record``,
  ``record_outcome`` and ``record_latency``;
- ``HedgingTable.plan``: the lookup every call makes before it is sent.

Run: ``.venv/bin/python tools/bench_reporting.py`` (from clients/python,
after ``run-tests.sh`` or ``pip install .``). Prints ns per operation, the
best of 5 rounds of 200 000.
"""

from __future__ import annotations

import random
import time

from retryd.hedging import Hedging, HedgingTable
from retryd.reporter import ReportResult, TrafficReporter

ROUNDS = 5
N = 200_000


class _Sink:
    def report_batch(self, traffic: object, *, report_id: str = "") -> ReportResult:
        return ReportResult(accepted=0)


def best(label: str, body: object) -> None:
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        body()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    print(f"{label:<58} {min(times) / N * 1e9:8.0f} ns")


def main() -> None:
    reporter = TrafficReporter(_Sink(), interval=3600)
    rng = random.Random(7)
    # A lognormal spread of latencies around 2 ms: many buckets in use.
    latencies = [rng.lognormvariate(-6.2, 0.8) for _ in range(N)]
    upstreams = [f"upstream-{i % 16}" for i in range(N)]

    def latency_only() -> None:
        record = reporter.record_latency
        for upstream, seconds in zip(upstreams, latencies):
            record(upstream, True, seconds)

    def whole_attempt() -> None:
        record, outcome, latency = reporter.record, reporter.record_outcome, reporter.record_latency
        for upstream, seconds in zip(upstreams, latencies):
            record(upstream)
            outcome(upstream, True)
            latency(upstream, True, seconds)

    def outcome_only() -> None:
        record, outcome = reporter.record, reporter.record_outcome
        for upstream in upstreams:
            record(upstream)
            outcome(upstream, True)

    table = HedgingTable(keep_for=3.0)
    table.update([Hedging(f"upstream-{i}", True, 0.01, 1, frozenset({1, 2})) for i in range(16)])

    def plan() -> None:
        lookup = table.plan
        for upstream in upstreams:
            lookup(upstream, 1)

    best("record_latency (bucket + histogram)", latency_only)
    best("record + record_outcome (before issue 33)", outcome_only)
    best("record + record_outcome + record_latency (a first attempt)", whole_attempt)
    best("HedgingTable.plan (per call)", plan)
    traffic = reporter.pending_traffic()["upstream-0"]
    print(f"buckets held for one upstream after {ROUNDS * 3 * N // 16} latencies: {len(traffic.latency_successes)}")


if __name__ == "__main__":
    main()
