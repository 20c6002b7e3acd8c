package dev.retryd.client;

import java.time.Duration;
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
   * boundary differently. {@code micros} is read as unsigned, as the contract's
   * 64-bit values are (a negative long is above one hour).
   */
  public static int bucket(long micros) {
    if (Long.compareUnsigned(micros, HOUR_MICROS) > 0) {
      micros = HOUR_MICROS;
    }
    if (micros < 16) {
      return (int) micros;
    }
    int e = 63 - Long.numberOfLeadingZeros(micros);
    long m = micros >>> (e - 3);
    return 8 * (e - 2) + (int) (m - 8);
  }

  /** The bucket of {@code elapsed} (a negative one, from a clock step, counts as 0). */
  public static int bucketOf(Duration elapsed) {
    return bucket(Math.max(0, elapsed.toNanos() / 1000));
  }

  /**
   * One upstream's pending first-attempt latencies: a count per bucket, 238 each
   * at most (1.9 KB a histogram, allocated on its first latency; a flat array, so
   * that recording allocates nothing: a map boxed every bucket above 127).
   */
  static final class Histograms {
    long[] successes;
    long[] failures;

    void record(boolean success, long nanos) {
      int b = bucket(Math.max(0, nanos / 1000));
      if (success) {
        if (successes == null) {
          successes = new long[MAX_BUCKET + 1];
        }
        successes[b]++;
      } else {
        if (failures == null) {
          failures = new long[MAX_BUCKET + 1];
        }
        failures[b]++;
      }
    }

    /** The contract's histogram of {@code counts} (empty buckets left out), or null if it is empty. */
    static LatencyHistogram proto(long[] counts) {
      if (counts == null) {
        return null;
      }
      LatencyHistogram.Builder histogram = LatencyHistogram.newBuilder();
      for (int b = 0; b < counts.length; b++) {
        if (counts[b] > 0) {
          histogram.putCounts(b, counts[b]);
        }
      }
      return histogram.getCountsCount() == 0 ? null : histogram.build();
    }
  }
}
