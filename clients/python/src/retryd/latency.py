"""First-attempt latencies in retryd's log-linear buckets (``LatencyHistogram`` in the proto).

Every client computes the same bucket for the same latency, so retryd can
add histograms from the whole fleet: a latency of ``v`` microseconds falls
in bucket ``v`` below 16, else, with ``e`` the index of its top bit and
``m`` its top four bits (8 to 15), in bucket ``8 * (e - 2) + (m - 8)``. A
bucket is at most 12.5% wide, and anything above one hour counts as one
hour (bucket 237), so a histogram never holds more than 238 buckets: that
bounds the reporter's memory per upstream, whatever the traffic.
"""

from __future__ import annotations

#: One hour in microseconds: longer latencies are counted as one hour.
MAX_LATENCY_US = 3_600_000_000
#: The highest bucket index (one hour).
MAX_BUCKET = 237


def bucket(micros: int) -> int:
    """The bucket of a latency of ``micros`` microseconds (negative counts as 0)."""
    if micros < 16:
        return max(micros, 0)
    if micros > MAX_LATENCY_US:
        micros = MAX_LATENCY_US
    e = micros.bit_length() - 1
    m = micros >> (e - 3)
    return 8 * (e - 2) + (m - 8)


def bucket_of_seconds(seconds: float) -> int:
    """The bucket of a latency given in (monotonic) seconds."""
    # int() truncates toward zero: a latency is counted in the bucket of its
    # whole microseconds, as an integer clock would.
    return bucket(int(seconds * 1_000_000))


def bucket_start(index: int) -> int:
    """The smallest latency (microseconds) that falls in bucket ``index``."""
    if index < 16:
        return index
    return (8 + index % 8) << (index // 8 - 1)
