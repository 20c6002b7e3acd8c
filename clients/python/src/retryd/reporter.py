"""Background reporters that batch real-traffic counts into ReportTraffic.

About 510 lines, one responsibility (counts in, batches out, re-sent with
their ids until applied): the blocking and asyncio reporters share the
counters and batching here, and differ only in how they wait and send.

Budgets fill from reported first attempts only ("retries never fund
retries"), so call ``record`` once per real request, never for a retry. The
adapters (:mod:`retryd.httpx`, :mod:`retryd.grpc`) do it for you through the
client's own reporter (``Client.reporter``), which the client flushes and
stops when it is closed.

Reports also carry *outcomes*, so that a budget can follow the upstream's
health: ``record_outcome(upstream, success, retry=...)`` once per finished
attempt, first attempts (``successes``/``failures``) apart from retries
(``retry_successes``/``retry_failures``). An attempt is a failure when the
caller asked (or would ask) retryd or its local rule whether to retry it
(not sent, no response, a retryable status); every other ending is a
success, a 404 included. An attempt the caller cancelled or abandoned is
neither. The adapters record every attempt's outcome by default.

``record`` and ``record_outcome`` only add to in-memory counters under a lock. Every
``interval`` seconds the counts become *batches* of at most 1024 entries,
each with a fresh ``report_id`` (a random UUID), and are sent:

- a batch that fails for a reason that may pass (retryd unreachable, a
  timeout, ABORTED) is kept and re-sent, with the same id and the same
  entries in the same order, so retryd applies each entry at most once even
  if the failed call had in fact been applied (``already_applied`` in the
  answer). New counts wait meanwhile, still merged per upstream, so memory
  stays bounded by ``max_upstreams``;
- a batch that fails for a reason re-sending cannot fix (PERMISSION_DENIED,
  RESOURCE_EXHAUSTED, INVALID_ARGUMENT) is dropped with one warning, and
  its requests are counted in ``dropped_requests``;
- a batch not delivered within ``resend_window`` seconds (5 minutes, less
  than retryd's 10-minute ``limits.report_id_window``) is dropped and
  counted too: re-sent after retryd forgot its id, it could be counted twice,
  and losing it only means fewer retries.

``dropped_requests`` also counts requests to upstreams beyond
``max_upstreams`` distinct ones (their outcomes are dropped with them).
``dropped_batches`` counts dropped batches. A batch carries, per upstream,
the requests and the four outcome counts together, and a re-sent batch the
same counts.

Latencies: ``record_latency(upstream, success, seconds)`` counts how long a
completed *first* attempt took, from sending to the end of the response, in
the upstream's success or failure histogram (:mod:`retryd.latency`: at most
238 buckets each, so memory stays bounded by ``max_upstreams`` too). retryd
adds them up fleet-wide to serve hedge delays. Hedges and retries are never
recorded; a first attempt cancelled because its hedge answered first is
recorded as a success with the time it had run. The adapters do this by
default. A batch carries the histograms beside the counts, and a re-sent
batch the same histograms.

Hedges won: ``record_hedge_won(upstream)`` counts a hedged call whose answer
came from a hedge, not from its first attempt (``hedges_won``; retryd
counts it in ``retryd_hedges_won_total``). Only the caller knows which copy
won, so the hedging adapters count it by default, once per call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Protocol

from .errors import InvalidRequestError, RetrydError
from .hedging import Hedging
from .latency import bucket_of_seconds
from .outage import Outage

log = logging.getLogger("retryd")

#: The most entries one ReportTraffic call may carry.
MAX_TRAFFIC_ENTRIES = 1024

#: gRPC codes for which re-sending the same report cannot succeed.
PERMANENT_REPORT_CODES = frozenset({"PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"})


@dataclass(frozen=True)
class ReportResult:
    """What retryd did with one report: entries applied now, and entries an
    earlier call with the same ``report_id`` had already applied."""

    accepted: int
    already_applied: int = 0
    #: The hedging retryd serves for the reported upstreams that have a policy.
    hedging: tuple[Hedging, ...] = ()


class Traffic(NamedTuple):
    """One entry of a report: first attempts sent, and how attempts ended.

    ``Traffic("a", 3)`` is three requests with no outcomes (a caller that
    does not report them); a plain ``(upstream, requests)`` pair is accepted
    wherever a ``Traffic`` is.
    """

    upstream: str
    requests: int = 0
    successes: int = 0
    failures: int = 0
    retry_successes: int = 0
    retry_failures: int = 0
    #: First-attempt latencies of successes: ``(bucket, count)`` pairs, by bucket.
    latency_successes: tuple[tuple[int, int], ...] = ()
    #: First-attempt latencies of failures, likewise.
    latency_failures: tuple[tuple[int, int], ...] = ()
    #: Hedged calls whose answer came from a hedge.
    hedges_won: int = 0


#: Where each count sits in a pending row (the fields of Traffic after ``upstream``).
_REQUESTS, _SUCCESSES, _FAILURES, _RETRY_SUCCESSES, _RETRY_FAILURES, _HEDGES_WON = range(6)
_COUNTS = 6


class _Row:
    """One upstream's pending counts and its two latency histograms (bucket -> count)."""

    __slots__ = ("counts", "latency_successes", "latency_failures")

    def __init__(self) -> None:
        self.counts = [0] * _COUNTS
        self.latency_successes: dict[int, int] = {}
        self.latency_failures: dict[int, int] = {}

    def add(self, entry: Traffic) -> None:
        for index, n in enumerate((entry.requests, entry.successes, entry.failures, entry.retry_successes,
                                   entry.retry_failures, entry.hedges_won)):
            self.counts[index] += n
        for histogram, pairs in ((self.latency_successes, entry.latency_successes),
                                 (self.latency_failures, entry.latency_failures)):
            for index, n in pairs:
                histogram[index] = histogram.get(index, 0) + n

    def traffic(self, upstream: str) -> Traffic:
        requests, successes, failures, retry_successes, retry_failures, hedges_won = self.counts
        return Traffic(upstream, requests, successes, failures, retry_successes, retry_failures,
                       tuple(sorted(self.latency_successes.items())),
                       tuple(sorted(self.latency_failures.items())), hedges_won)


class _SendsReports(Protocol):
    def report_batch(self, traffic: Sequence[Traffic], *, report_id: str = "") -> ReportResult: ...


class _SendsReportsAsync(Protocol):
    def report_batch(
        self, traffic: Sequence[Traffic], *, report_id: str = ""
    ) -> Awaitable[ReportResult]: ...


@dataclass
class Batch:
    """One report as sent, and as re-sent: the id and the entries never change."""

    report_id: str
    entries: tuple[Traffic, ...]
    created: float = field(default_factory=time.monotonic)

    @property
    def requests(self) -> int:
        return sum(entry.requests for entry in self.entries)


def is_permanent(error: BaseException) -> bool:
    """Whether re-sending the same report after ``error`` is pointless."""
    if isinstance(error, InvalidRequestError):
        return True
    code: Any = getattr(error, "code", None)
    return getattr(code, "name", None) in PERMANENT_REPORT_CODES


def _outcome_index(success: bool, retry: bool) -> int:
    if retry:
        return _RETRY_SUCCESSES if success else _RETRY_FAILURES
    return _SUCCESSES if success else _FAILURES


class _Book:
    """The counts and batches, shared by the thread and asyncio reporters.

    Only the sender that holds the send lock touches ``unsent``; ``pending``
    is guarded by ``lock`` because ``record`` runs on any thread.
    """

    def __init__(self, max_upstreams: int, resend_window: float, target: str) -> None:
        self.max_upstreams = max_upstreams
        self.target = target
        #: One warning when sends start failing, one (with counts) when one is delivered again.
        self.outage = Outage("traffic reports", "failed sends (each re-sent with the same id)")
        self.resend_window = resend_window
        self.dropped_requests = 0
        self.dropped_batches = 0
        self.lock = threading.Lock()
        #: Per upstream: requests, the four outcome counts, the two latency histograms.
        self.pending: dict[str, _Row] = {}
        self.unsent: list[Batch] = []

    def _row(self, upstream: str) -> Optional[_Row]:
        """The upstream's pending row, created if the bound allows (call under the lock)."""
        row = self.pending.get(upstream)
        if row is None and len(self.pending) < self.max_upstreams:
            row = self.pending[upstream] = _Row()
        return row

    def add(self, upstream: str, index: int, n: int) -> None:
        if n <= 0:
            return
        with self.lock:
            row = self._row(upstream)
            if row is None:
                if index == _REQUESTS:
                    self.dropped_requests += n
                return
            row.counts[index] += n

    def add_latency(self, upstream: str, success: bool, index: int) -> None:
        with self.lock:
            row = self._row(upstream)
            if row is None:
                return
            histogram = row.latency_successes if success else row.latency_failures
            histogram[index] = histogram.get(index, 0) + 1

    def traffic(self) -> dict[str, Traffic]:
        """Every count not yet delivered, per upstream (unsent batches included)."""
        rows: dict[str, _Row] = {}
        with self.lock:
            for upstream, pending in self.pending.items():
                rows[upstream] = _Row()
                rows[upstream].add(pending.traffic(upstream))
        for batch in self.unsent:
            for entry in batch.entries:
                rows.setdefault(entry.upstream, _Row()).add(entry)
        return {upstream: row.traffic(upstream) for upstream, row in rows.items()}

    def snapshot(self) -> dict[str, int]:
        return {upstream: entry.requests for upstream, entry in self.traffic().items() if entry.requests}

    def next_batch(self) -> Optional[Batch]:
        """The batch to send next: the oldest unsent one, else fresh counts."""
        now = time.monotonic()
        while self.unsent and now - self.unsent[0].created > self.resend_window:
            stale = self.unsent.pop(0)
            self._drop(stale, f"not delivered within {self.resend_window:.0f}s")
        if not self.unsent:
            with self.lock:
                if not self.pending:
                    return None
                entries = [row.traffic(upstream) for upstream, row in self.pending.items()]
                self.pending = {}
            for start in range(0, len(entries), MAX_TRAFFIC_ENTRIES):
                chunk = tuple(entries[start : start + MAX_TRAFFIC_ENTRIES])
                self.unsent.append(Batch(report_id=uuid.uuid4().hex, entries=chunk, created=now))
        return self.unsent[0]

    def sent(self, batch: Batch) -> None:
        self.unsent.remove(batch)
        self.outage.succeeded(self.target, f"; delivered the held batch of {batch.requests} requests")

    def failed(self, batch: Batch, error: BaseException) -> bool:
        """Handles a failed send; True if the batch is kept for a re-send."""
        if is_permanent(error):
            self.unsent.remove(batch)
            self._drop(batch, str(error))
            return False
        # One warning per outage, not one per re-send (every interval).
        self.outage.failed(f"report of {batch.requests} requests kept for a re-send: {error}", self.target)
        return True

    def _drop(self, batch: Batch, why: str) -> None:
        self.dropped_batches += 1
        self.dropped_requests += batch.requests
        log.warning("retryd: dropped a traffic report of %d requests (id %s): %s",
                    batch.requests, batch.report_id, why)


class TrafficReporter:
    """Batches ``ReportTraffic`` calls on a background thread.

    Use it as a context manager, or call :meth:`start` and :meth:`close`
    (which sends what is left). ``client`` is a :class:`retryd.Client`;
    ``Client.reporter`` is one already started and owned by the client.
    """

    def __init__(
        self,
        client: _SendsReports,
        *,
        interval: float = 1.0,
        max_upstreams: int = 10_000,
        resend_window: float = 300.0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval: must be positive, got {interval!r}")
        self._client = client
        self.interval = interval
        self._book = _Book(max_upstreams, resend_window, str(getattr(client, "target", "?")))
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def dropped_requests(self) -> int:
        """Requests never reported: beyond ``max_upstreams``, or in a dropped batch."""
        return self._book.dropped_requests

    @property
    def dropped_batches(self) -> int:
        """Batches dropped after a permanent error or past ``resend_window``."""
        return self._book.dropped_batches

    @property
    def dropped(self) -> int:
        """The former name of :attr:`dropped_requests`."""
        return self._book.dropped_requests

    def record(self, upstream: str, requests: int = 1) -> None:
        """Counts ``requests`` real (first-attempt) requests to ``upstream``."""
        self._book.add(upstream, _REQUESTS, requests)

    def record_outcome(self, upstream: str, success: bool, *, retry: bool = False, count: int = 1) -> None:
        """Counts how ``count`` attempts to ``upstream`` ended (see the module doc for the rule).

        ``retry=False`` for first attempts (``successes``/``failures``),
        ``True`` for the attempts after them (``retry_successes``/``retry_failures``).
        """
        self._book.add(upstream, _outcome_index(success, retry), count)

    def record_latency(self, upstream: str, success: bool, seconds: float) -> None:
        """Counts one completed first attempt's latency (see the module doc for the rule)."""
        self._book.add_latency(upstream, success, bucket_of_seconds(seconds))

    def record_hedge_won(self, upstream: str, count: int = 1) -> None:
        """Counts ``count`` hedged calls to ``upstream`` answered by a hedge (see the module doc)."""
        self._book.add(upstream, _HEDGES_WON, count)

    def pending(self) -> dict[str, int]:
        """The requests not yet delivered (unsent batches included), per upstream."""
        with self._send_lock:
            return self._book.snapshot()

    def pending_traffic(self) -> dict[str, Traffic]:
        """Every count not yet delivered (unsent batches included), outcomes too, per upstream."""
        with self._send_lock:
            return self._book.traffic()

    def flush(self) -> bool:
        """Sends everything pending now; False if something is kept for a re-send."""
        with self._send_lock:
            while (batch := self._book.next_batch()) is not None:
                try:
                    self._client.report_batch(batch.entries, report_id=batch.report_id)
                except RetrydError as error:
                    if self._book.failed(batch, error):
                        return False
                else:
                    self._book.sent(batch)
            return True

    def start(self) -> TrafficReporter:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="retryd-traffic-reporter", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stops the thread and sends what is left (one try)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def __enter__(self) -> TrafficReporter:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncTrafficReporter:
    """The asyncio twin of :class:`TrafficReporter`: a task instead of a thread.

    ``record`` may be called from any thread; the sending task starts on the
    first ``record`` made inside a running event loop (or on :meth:`start`),
    and :meth:`aclose` stops it and sends what is left.
    """

    def __init__(
        self,
        client: _SendsReportsAsync,
        *,
        interval: float = 1.0,
        max_upstreams: int = 10_000,
        resend_window: float = 300.0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval: must be positive, got {interval!r}")
        self._client = client
        self.interval = interval
        self._book = _Book(max_upstreams, resend_window, str(getattr(client, "target", "?")))
        self._send_lock: Optional[asyncio.Lock] = None
        self._task: Optional[asyncio.Task[None]] = None
        self._closed = False

    @property
    def dropped_requests(self) -> int:
        """See :attr:`TrafficReporter.dropped_requests`."""
        return self._book.dropped_requests

    @property
    def dropped_batches(self) -> int:
        """See :attr:`TrafficReporter.dropped_batches`."""
        return self._book.dropped_batches

    def record(self, upstream: str, requests: int = 1) -> None:
        """Counts ``requests`` real (first-attempt) requests to ``upstream``."""
        self._book.add(upstream, _REQUESTS, requests)
        self._start_in_loop()

    def record_outcome(self, upstream: str, success: bool, *, retry: bool = False, count: int = 1) -> None:
        """See :meth:`TrafficReporter.record_outcome`."""
        self._book.add(upstream, _outcome_index(success, retry), count)
        self._start_in_loop()

    def record_latency(self, upstream: str, success: bool, seconds: float) -> None:
        """See :meth:`TrafficReporter.record_latency`."""
        self._book.add_latency(upstream, success, bucket_of_seconds(seconds))
        self._start_in_loop()

    def record_hedge_won(self, upstream: str, count: int = 1) -> None:
        """See :meth:`TrafficReporter.record_hedge_won`."""
        self._book.add(upstream, _HEDGES_WON, count)
        self._start_in_loop()

    def _start_in_loop(self) -> None:
        if self._task is None and not self._closed:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop on this thread: the next record or flush sends it
            self.start()

    def pending(self) -> dict[str, int]:
        """The requests not yet delivered (unsent batches included), per upstream."""
        return self._book.snapshot()

    def pending_traffic(self) -> dict[str, Traffic]:
        """See :meth:`TrafficReporter.pending_traffic`."""
        return self._book.traffic()

    def _lock(self) -> asyncio.Lock:
        if self._send_lock is None:
            self._send_lock = asyncio.Lock()
        return self._send_lock

    async def flush(self) -> bool:
        """Sends everything pending now; False if something is kept for a re-send."""
        async with self._lock():
            while (batch := self._book.next_batch()) is not None:
                try:
                    await self._client.report_batch(batch.entries, report_id=batch.report_id)
                except RetrydError as error:
                    if self._book.failed(batch, error):
                        return False
                else:
                    self._book.sent(batch)
            return True

    def start(self) -> AsyncTrafficReporter:
        """Starts the sending task in the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="retryd-traffic-reporter")
        return self

    async def aclose(self) -> None:
        """Stops the task and sends what is left (one try)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def __aenter__(self) -> AsyncTrafficReporter:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
