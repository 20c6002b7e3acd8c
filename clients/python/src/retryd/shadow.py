"""What a client does with a shadow answer (``DecideResponse.shadow``).

An upstream with ``enforce = false`` in retryd's policy is in shadow mode:
retryd decides as it would and spends a shadow budget, but does not enforce
the decision. The client then decides with its own configured behaviour, the
local rule of :mod:`retryd.fallback` (``Client(fallback=...)``, or its default
limits when the client was made with ``fallback=None``), and acts on that.
Where retryd's verdict or deny reason differs from the local one, the
difference is counted per upstream and logged, at most one warning per
upstream per ``interval`` seconds; the line says how many differences were
not logged since the previous one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Optional

from ._types import Decision, DenyReason

#: Seconds between two divergence warnings for one upstream, by default.
DEFAULT_SHADOW_LOG_INTERVAL = 60.0


def describe(decision: Decision) -> str:
    """The verdict and, for a DENY, its reason: ``"DENY BUDGET_EXHAUSTED"``."""
    if decision.deny_reason != DenyReason.UNSPECIFIED:
        return f"{decision.verdict.name} {decision.deny_reason.name}"
    return decision.verdict.name


def differs(retryd: Decision, local: Decision) -> bool:
    """Whether two decisions disagree on what to do (the backoff aside: it is jittered)."""
    return retryd.verdict != local.verdict or retryd.deny_reason != local.deny_reason


@dataclass
class _Upstream:
    count: int = 0
    unlogged: int = 0
    logged_at: Optional[float] = None


@dataclass
class ShadowDivergences:
    """Counts and rate-limits the differences between retryd's shadow decisions and the local rule.

    Thread-safe. ``clock`` is monotonic seconds (replaceable in tests).
    """

    interval: float = DEFAULT_SHADOW_LOG_INTERVAL
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("retryd"))
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _upstreams: dict[str, _Upstream] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.interval >= 0:  # also refuses NaN
            raise ValueError(f"shadow_log_interval: must be at least 0 seconds, got {self.interval!r}")

    def record(self, upstream: str, retryd: Decision, local: Decision) -> None:
        """Counts one difference; logs it unless this upstream logged one less than ``interval`` ago."""
        now = self.clock()
        with self._lock:
            state = self._upstreams.setdefault(upstream, _Upstream())
            state.count += 1
            if state.logged_at is not None and now - state.logged_at < self.interval:
                state.unlogged += 1
                return
            unlogged, state.unlogged, state.logged_at = state.unlogged, 0, now
        self.logger.warning(
            "retryd shadow decision for upstream %r differs from the local rule: retryd %s, local rule %s "
            "(acted on); %d more difference(s) for this upstream not logged since the last line",
            upstream, describe(retryd), describe(local), unlogged,
        )

    def counts(self) -> Mapping[str, int]:
        """Differences counted so far, per upstream (a snapshot)."""
        with self._lock:
            return MappingProxyType({name: state.count for name, state in self._upstreams.items()})
