"""A background reporter that batches real-traffic counts into ReportTraffic.

Budgets fill from reported first attempts only ("retries never fund
retries"), so call :meth:`TrafficReporter.record` once per real request, never
for a retry. ``record`` only adds to an in-memory counter under a lock; a
daemon thread sends the counts every ``interval`` seconds, in batches of at
most 1024 entries. Counts that could not be sent are kept and sent with the
next batch, up to ``max_upstreams`` distinct upstreams (beyond that new
upstreams are dropped and counted in ``dropped``).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Protocol

from .errors import RetrydError

log = logging.getLogger("retryd")


class _Reports(Protocol):
    def report_traffic(self, counts: dict[str, int]) -> int: ...


class TrafficReporter:
    """Batches ``ReportTraffic`` calls on a background thread.

    Use it as a context manager, or call :meth:`start` and :meth:`close`
    (which sends what is left). ``client`` is a :class:`retryd.Client`.
    """

    def __init__(self, client: _Reports, *, interval: float = 1.0, max_upstreams: int = 10_000) -> None:
        self._client = client
        self.interval = interval
        self.max_upstreams = max_upstreams
        self.dropped = 0
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def record(self, upstream: str, requests: int = 1) -> None:
        """Counts ``requests`` real (first-attempt) requests to ``upstream``."""
        if requests <= 0:
            return
        with self._lock:
            if upstream in self._pending or len(self._pending) < self.max_upstreams:
                self._pending[upstream] = self._pending.get(upstream, 0) + requests
            else:
                self.dropped += requests

    def pending(self) -> dict[str, int]:
        """A copy of the counts not yet sent."""
        with self._lock:
            return dict(self._pending)

    def flush(self) -> bool:
        """Sends the pending counts now; returns False (keeping them) if retryd failed."""
        with self._send_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            try:
                self._client.report_traffic(batch)
            except RetrydError as error:
                log.warning("retryd: traffic report failed, will retry: %s", error)
                with self._lock:
                    for upstream, n in batch.items():
                        if upstream in self._pending or len(self._pending) < self.max_upstreams:
                            self._pending[upstream] = self._pending.get(upstream, 0) + n
                        else:
                            self.dropped += n
                return False
            return True

    def start(self) -> TrafficReporter:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="retryd-traffic-reporter", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stops the thread and sends what is left."""
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
