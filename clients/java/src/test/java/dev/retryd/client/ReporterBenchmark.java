package dev.retryd.client;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * The reporter's cost per recorded first attempt: its outcome and its latency
 * (what the adapters add to every completed first attempt), against the outcome
 * alone. Not part of the suite (surefire excludes *Benchmark); run it with
 * {@code clients/java/run-tests.sh -Dtest=ReporterBenchmark} and read the lines
 * it prints. Latencies spread over ~20 buckets, as a real upstream's would be.
 */
class ReporterBenchmark {
  private static final int WARMUP = 2_000_000;
  private static final int ROUNDS = 15;
  private static final int CALLS_PER_ROUND = 1_000_000;

  @Test
  void costPerRecordedAttempt() throws Exception {
    long[] spread = new long[64];
    for (int i = 0; i < spread.length; i++) {
      spread[i] = (500L + i * i * 37L) * 1000L; // nanoseconds
    }
    try (RetrydClient retryd = RetrydClient.builder("127.0.0.1:9").connectTimeout(java.time.Duration.ZERO).build()) {
      TrafficReporter reporter = TrafficReporter.builder(retryd).build(); // never flushed: only the recording is timed
      for (int i = 0; i < WARMUP; i++) {
        reporter.recordOutcome("bench", true, false);
        reporter.recordLatency("bench", true, spread[i & 63]);
      }
      List<Double> outcomeOnly = new ArrayList<>();
      List<Double> withLatency = new ArrayList<>();
      List<Double> latencyOnly = new ArrayList<>();
      for (int round = 0; round < ROUNDS; round++) {
        long start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          reporter.recordOutcome("bench", true, false);
        }
        outcomeOnly.add((System.nanoTime() - start) / (double) CALLS_PER_ROUND);
        start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          reporter.recordOutcome("bench", true, false);
          reporter.recordLatency("bench", true, spread[i & 63]);
        }
        withLatency.add((System.nanoTime() - start) / (double) CALLS_PER_ROUND);
        start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          reporter.recordLatency("bench", true, spread[i & 63]);
        }
        latencyOnly.add((System.nanoTime() - start) / (double) CALLS_PER_ROUND);
      }
      System.out.printf("ReporterBenchmark: ns per call, median of %d rounds of %d: outcome only %.1f, outcome + latency %.1f, latency only %.1f%n",
          ROUNDS, CALLS_PER_ROUND, median(outcomeOnly), median(withLatency), median(latencyOnly));
    }
  }

  private static double median(List<Double> values) {
    List<Double> sorted = new ArrayList<>(values);
    Collections.sort(sorted);
    return sorted.get(sorted.size() / 2);
  }
}
