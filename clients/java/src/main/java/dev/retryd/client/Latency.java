package dev.retryd.client;

import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import retryd.v1.Retryd.LatencyHistogram;

/**
 * The contract's log-linear latency buckets ({@code LatencyHistogram} in
 * retryd.proto), the same in every client, and one upstream's pending histograms.
 */
public final class Latency {
  /** The bucket of one hour, the longest latency told apart (longer counts as one hour). */
  public static final int MAX_BUCKET = 237;

  private static final long HOUR_MICROS = 3_600_000_000L;

  private Latency() {}

  /**
   * The bucket of a latency of {@code micros} microseconds: {@code micros} below
   * 16, otherwise {@code 8*(e-2) + (m-8)} with {@code e = floor(log2 micros)} and
   * {@code m} its top four bits. Integer arithmetic only, so no client rounds a
   * boundary differently. Negative counts as 0.
   */
  public static int bucket(long micros) {
    if (micros < 0) {
      micros = 0;
    }
    if (micros > HOUR_MICROS) {
      micros = HOUR_MICROS;
    }
    if (micros < 16) {
      return (int) micros;
    }
    int e = 63 - Long.numberOfLeadingZeros(micros);
    long m = micros >>> (e - 3);
    return 8 * (e - 2) + (int) (m - 8);
  }

  /** The bucket of {@code elapsed}. */
  public static int bucketOf(Duration elapsed) {
    return bucket(elapsed.toNanos() / 1000);
  }

  /** One upstream's pending first-attempt latencies: at most 238 buckets each. */
  static final class Histograms {
    final Map<Integer, Long> successes = new HashMap<>();
    final Map<Integer, Long> failures = new HashMap<>();

    void record(boolean success, long nanos) {
      (success ? successes : failures).merge(bucket(nanos / 1000), 1L, Long::sum);
    }

    boolean isEmpty() {
      return successes.isEmpty() && failures.isEmpty();
    }

    static LatencyHistogram proto(Map<Integer, Long> counts) {
      return LatencyHistogram.newBuilder().putAllCounts(counts).build();
    }
  }
}
