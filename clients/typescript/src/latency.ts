/**
 * First-attempt latencies in retryd's log-linear buckets (LatencyHistogram in
 * the proto), computed the same in every client so that retryd can add up
 * the fleet's histograms: a latency of v microseconds falls in bucket v below
 * 16, else, with e the index of its top bit and m its top four bits (8 to
 * 15), in bucket 8 * (e - 2) + (m - 8). A bucket is at most 12.5% wide and
 * anything above one hour counts as one hour (bucket 237), so a histogram
 * holds at most 238 buckets: the reporter's memory per upstream is bounded
 * whatever the traffic.
 */

/** One hour in microseconds: longer latencies count as one hour. */
export const MAX_LATENCY_US = 3_600_000_000;
/** The highest bucket (one hour). */
export const MAX_BUCKET = 237;

/** The bucket of a latency of `micros` microseconds (an integer; negative counts as 0). */
export function latencyBucket(micros: number): number {
  if (!(micros >= 16)) return micros > 0 ? Math.floor(micros) : 0;
  // One hour (3.6e9) is below 2^32, so the unsigned 32-bit operators are
  // exact on every value that reaches them.
  const v = (micros > MAX_LATENCY_US ? MAX_LATENCY_US : Math.floor(micros)) >>> 0;
  const e = 31 - Math.clz32(v);
  const m = v >>> (e - 3);
  return 8 * (e - 2) + (m - 8);
}

/** The bucket of a latency given in milliseconds (performance.now() differences). */
export function latencyBucketOfMs(ms: number): number {
  // Truncated to whole microseconds, as an integer clock would count them.
  return latencyBucket(Math.trunc(ms * 1000));
}

/** The smallest latency (microseconds) in bucket `index`. */
export function bucketStart(index: number): number {
  if (index < 16) return index;
  return (8 + (index % 8)) * 2 ** (Math.floor(index / 8) - 1);
}
