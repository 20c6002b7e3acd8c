"""One warning when retryd becomes unreachable, one when it is back, with counts.

A busy caller decides thousands of times a second and its reporter re-sends
every interval; a line per fallback decision or per failed batch would bury
the one fact that matters (retryd has been unreachable since T, and this is
what the client did meanwhile). :class:`Outage` is that state for one
concern (the fallback's decisions, the reporter's sends): the first failure
logs a warning, later ones are counted (and logged at debug level), and the
first success afterwards logs one warning saying how long it lasted and
what was counted.

Thread-safe. ``clock`` is monotonic seconds, replaceable in tests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("retryd")


class Outage:
    """The outage state of one concern: ``failed`` for each failure, ``succeeded`` for each success.

    ``what`` names the concern in the log lines ("decisions", "traffic
    reports"); ``counted`` names what a failure counts ("decisions made by
    the local rule", "failed sends").
    """

    def __init__(self, what: str, counted: str, *, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.what = what
        self.counted = counted
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self._since: Optional[float] = None
        self._failures = 0
        #: Outages seen so far (ended or not).
        self.outages = 0

    @property
    def in_outage(self) -> bool:
        return self._since is not None

    def failed(self, why: str, target: str) -> None:
        """Counts one failure; the first of an outage logs a warning."""
        with self._lock:
            first = self._since is None
            if first:
                self._since = self._clock()
                self._failures = 0
                self.outages += 1
            self._failures += 1
        if first:
            self._log.warning("retryd at %s unreachable (%s); %s: falling back until it answers again "
                              "(one line now, one when it is back)", target, why, self.what)
        else:
            self._log.debug("retryd at %s still unreachable (%s); %s", target, why, self.what)

    def succeeded(self, target: str, detail: str = "") -> None:
        """Ends an outage, if one is going on, with one warning carrying its counts."""
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._since is None:
                return
            lasted, failures = self._clock() - self._since, self._failures
            self._since, self._failures = None, 0
        self._log.warning("retryd at %s reachable again after %.1fs; %s: %d %s during the outage%s",
                          target, lasted, self.what, failures, self.counted, detail)
