package dev.retryd.client;

import io.grpc.Status;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.UUID;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.logging.Level;
import java.util.logging.Logger;
import retryd.v1.Retryd.ReportTrafficRequest;
import retryd.v1.Retryd.ReportTrafficResponse;
import retryd.v1.Retryd.UpstreamTraffic;

/**
 * Batches real-traffic counts into {@code ReportTraffic} calls on a daemon
 * thread. Budgets fill from reported first attempts only ("retries never fund
 * retries"), so call {@link #record} once per real request, never for a retry.
 * {@code record} only adds to an in-memory counter under a lock.
 *
 * <p>Reports also carry outcomes, so that a budget can follow the upstream's
 * health: call {@link #recordOutcome} once per finished attempt, first attempts
 * ({@code successes}/{@code failures}) apart from retries
 * ({@code retry_successes}/{@code retry_failures}). An attempt is a failure when
 * the caller asked (or would ask) retryd or its local rule whether to retry it
 * (not sent, no response, a retryable status); every other ending is a success,
 * a 404 included. An attempt the caller cancelled or abandoned is neither. The
 * adapters ({@link RetryingHttpClient}, {@link RetrydClientInterceptor}) record
 * every attempt's outcome by default. A batch carries each upstream's requests
 * and outcomes together, and a re-sent batch the same counts. They also count
 * the hedged calls a hedge answered ({@link #recordHedgeWon}, {@code hedges_won}).
 *
 * <p>Every {@link #interval} the pending counts become batches of at most 1024
 * entries, each with a random {@code report_id}. A batch that fails for a reason
 * that may pass (UNAVAILABLE, a timeout, ABORTED, ...) is re-sent later with the
 * same id and the same entries in the same order, so retryd applies each entry
 * at most once even when the first send was applied but its answer lost. While
 * a batch waits to be re-sent, new counts accumulate (up to {@code maxUpstreams}
 * distinct upstreams; beyond that they are dropped, outcomes with them, and their
 * requests counted). A batch retryd
 * refuses for good (INVALID_ARGUMENT, PERMISSION_DENIED, RESOURCE_EXHAUSTED) is
 * dropped with one warning and its requests counted in {@link #droppedRequests()}.
 */
public final class TrafficReporter implements AutoCloseable {
  private static final Logger LOG = Logger.getLogger("dev.retryd.client");

  private final RetrydClient client;
  private final Duration interval;
  private final int maxUpstreams;
  private final Object lock = new Object();
  private Map<String, long[]> pending = new HashMap<>();
  // First-attempt latencies, by upstream; an upstream here is also in pending
  // (same bound), so counts and latencies go in the same entry.
  private Map<String, Latency.Histograms> latencies = new HashMap<>();
  private final Object sendLock = new Object();
  private final ArrayDeque<Batch> outbox = new ArrayDeque<>();
  private final AtomicLong dropped = new AtomicLong();
  private final AtomicLong accepted = new AtomicLong();
  private final AtomicLong alreadyApplied = new AtomicLong();
  private final CountDownLatch stop = new CountDownLatch(1);
  private Thread thread;

  private TrafficReporter(Builder builder) {
    this.client = builder.client;
    this.interval = builder.interval;
    this.maxUpstreams = builder.maxUpstreams;
  }

  /** A builder of a reporter that sends through {@code client}. */
  public static Builder builder(RetrydClient client) {
    return new Builder(Objects.requireNonNull(client, "client"));
  }

  /** How a reporter is built. */
  public static final class Builder {
    private final RetrydClient client;
    private Duration interval = Duration.ofSeconds(1);
    private int maxUpstreams = 10_000;

    private Builder(RetrydClient client) {
      this.client = client;
    }

    /** How often the daemon thread sends (1s by default). */
    public Builder interval(Duration value) {
      if (value.isNegative() || value.isZero()) {
        throw new IllegalArgumentException("interval: must be positive, got " + value);
      }
      this.interval = value;
      return this;
    }

    /** The most distinct upstreams counted between two successful sends (10,000 by default). */
    public Builder maxUpstreams(int value) {
      if (value < 1) {
        throw new IllegalArgumentException("maxUpstreams: must be at least 1, got " + value);
      }
      this.maxUpstreams = value;
      return this;
    }

    /** The reporter, not started: call {@link TrafficReporter#start()} (or just {@link TrafficReporter#flush()}). */
    public TrafficReporter build() {
      return new TrafficReporter(this);
    }
  }

  /** How often the daemon thread sends. */
  public Duration interval() {
    return interval;
  }

  /** Counts one real (first-attempt) request to {@code upstream}. */
  public void record(String upstream) {
    record(upstream, 1);
  }

  /** Counts {@code requests} real (first-attempt) requests to {@code upstream}. */
  public void record(String upstream, long requests) {
    add(upstream, REQUESTS, requests);
  }

  /**
   * Counts how one attempt to {@code upstream} ended: {@code retry} false for a
   * first attempt ({@code successes}/{@code failures}), true for an attempt after
   * it ({@code retry_successes}/{@code retry_failures}). See the class doc for the rule.
   */
  public void recordOutcome(String upstream, boolean success, boolean retry) {
    recordOutcome(upstream, success, retry, 1);
  }

  /** Counts how {@code attempts} attempts to {@code upstream} ended (see {@link #recordOutcome(String, boolean, boolean)}). */
  public void recordOutcome(String upstream, boolean success, boolean retry, long attempts) {
    add(upstream, retry ? (success ? RETRY_SUCCESSES : RETRY_FAILURES) : (success ? SUCCESSES : FAILURES), attempts);
  }

  /**
   * Counts one hedged call to {@code upstream} whose answer came from a hedge
   * rather than from its first attempt ({@code UpstreamTraffic.hedges_won} in
   * retryd.proto): only the caller knows which copy answered; retryd counts them
   * in {@code retryd_hedges_won_total}, and granted minus won is the hedges that
   * lost. A call its first attempt answered, or whose every copy failed, is not
   * counted. The adapters do this by default.
   */
  public void recordHedgeWon(String upstream) {
    recordHedgeWon(upstream, 1);
  }

  /** Counts {@code calls} hedged calls a hedge answered (see {@link #recordHedgeWon(String)}). */
  public void recordHedgeWon(String upstream, long calls) {
    add(upstream, HEDGES_WON, calls);
  }

  /**
   * Counts how long one first attempt to {@code upstream} took, from sending it
   * to the end of its response, in the success or failure histogram (the same
   * classification as {@link #recordOutcome}). Retries and hedges must not be
   * recorded; a first attempt cancelled because its hedge answered first is
   * recorded as a success with the time it had run (see {@code
   * UpstreamTraffic.latency_successes} in retryd.proto). The adapters do this by
   * default. Costs an array increment under the reporter's lock (BENCHMARKS.md).
   */
  public void recordLatency(String upstream, boolean success, long nanos) {
    synchronized (lock) {
      if (!pending.containsKey(upstream)) {
        if (pending.size() >= maxUpstreams) {
          return;
        }
        pending.put(upstream, new long[COUNTS]);
      }
      latencies.computeIfAbsent(upstream, u -> new Latency.Histograms()).record(success, nanos);
    }
  }

  private static final int REQUESTS = 0;
  private static final int SUCCESSES = 1;
  private static final int FAILURES = 2;
  private static final int RETRY_SUCCESSES = 3;
  private static final int RETRY_FAILURES = 4;
  private static final int HEDGES_WON = 5;
  private static final int COUNTS = 6;

  private void add(String upstream, int index, long n) {
    if (n <= 0) {
      return;
    }
    synchronized (lock) {
      long[] count = pending.get(upstream);
      if (count == null) {
        if (pending.size() >= maxUpstreams) {
          if (index == REQUESTS) {
            dropped.addAndGet(n);
          }
          return;
        }
        count = new long[COUNTS];
        pending.put(upstream, count);
      }
      count[index] += n;
    }
  }

  /** A copy of the requests not yet in a batch (upstreams with outcomes only are left out). */
  public Map<String, Long> pending() {
    Map<String, Long> copy = new LinkedHashMap<>();
    synchronized (lock) {
      pending.forEach(
          (upstream, count) -> {
            if (count[REQUESTS] > 0) {
              copy.put(upstream, count[REQUESTS]);
            }
          });
    }
    return copy;
  }

  /** A copy of every count not yet in a batch, outcomes included, as the entries it will be sent as. */
  public Map<String, UpstreamTraffic> pendingTraffic() {
    Map<String, UpstreamTraffic> copy = new LinkedHashMap<>();
    synchronized (lock) {
      pending.forEach((upstream, count) -> copy.put(upstream, entry(upstream, count, latencies.get(upstream))));
    }
    return copy;
  }

  private static UpstreamTraffic entry(String upstream, long[] count, Latency.Histograms latency) {
    UpstreamTraffic.Builder entry =
        UpstreamTraffic.newBuilder()
            .setUpstream(upstream)
            .setRequests(count[REQUESTS])
            .setSuccesses(count[SUCCESSES])
            .setFailures(count[FAILURES])
            .setRetrySuccesses(count[RETRY_SUCCESSES])
            .setRetryFailures(count[RETRY_FAILURES])
            .setHedgesWon(count[HEDGES_WON]);
    if (latency != null) {
      retryd.v1.Retryd.LatencyHistogram successes = Latency.Histograms.proto(latency.successes);
      retryd.v1.Retryd.LatencyHistogram failures = Latency.Histograms.proto(latency.failures);
      if (successes != null) {
        entry.setLatencySuccesses(successes);
      }
      if (failures != null) {
        entry.setLatencyFailures(failures);
      }
    }
    return entry.build();
  }

  /** How many batches wait to be (re-)sent. */
  public int unsentBatches() {
    synchronized (sendLock) {
      return outbox.size();
    }
  }

  /** Requests dropped: refused for good by retryd, or beyond {@code maxUpstreams}. */
  public long droppedRequests() {
    return dropped.get();
  }

  /** Entries retryd applied, over every send. */
  public long acceptedEntries() {
    return accepted.get();
  }

  /** Entries a re-send found already applied by an earlier send of the same batch. */
  public long alreadyAppliedEntries() {
    return alreadyApplied.get();
  }

  /**
   * Sends now: first any batch waiting to be re-sent, then (once none waits) the
   * pending counts. Returns true when nothing is left to re-send.
   */
  public boolean flush() {
    synchronized (sendLock) {
      if (outbox.isEmpty()) {
        // New counts become batches only once the earlier ones are through, so
        // that an outage grows one map of counts, not a queue of batches.
        Map<String, long[]> taken;
        Map<String, Latency.Histograms> takenLatencies;
        synchronized (lock) {
          taken = pending;
          takenLatencies = latencies;
          pending = new HashMap<>();
          latencies = new HashMap<>();
        }
        // A batch is built once: a re-send carries the same histograms.
        List<UpstreamTraffic> entries = new ArrayList<>(taken.size());
        taken.forEach((upstream, count) -> entries.add(entry(upstream, count, takenLatencies.get(upstream))));
        for (int start = 0; start < entries.size(); start += RetrydClient.MAX_TRAFFIC_ENTRIES) {
          outbox.add(new Batch(entries.subList(start, Math.min(entries.size(), start + RetrydClient.MAX_TRAFFIC_ENTRIES))));
        }
      }
      while (!outbox.isEmpty()) {
        Batch batch = outbox.peek();
        try {
          ReportTrafficResponse response = client.reportTraffic(batch.request, interval);
          accepted.addAndGet(response.getAccepted());
          alreadyApplied.addAndGet(response.getAlreadyApplied());
          outbox.poll();
        } catch (InvalidRequestException invalid) {
          drop(batch, Status.Code.INVALID_ARGUMENT, invalid);
        } catch (RetrydUnavailableException error) {
          if (error.code() == Status.Code.PERMISSION_DENIED || error.code() == Status.Code.RESOURCE_EXHAUSTED) {
            drop(batch, error.code(), error);
          } else {
            batch.failures++;
            // One warning per outage, shared with the client's fallback decisions.
            client.outage().failedBatch(error.getMessage());
            LOG.log(Level.FINE, "retryd: traffic report {0} failed ({1}), will re-send it with the same id",
                new Object[] {batch.request.getReportId(), error.getMessage()});
            return false;
          }
        }
      }
      return true;
    }
  }

  private void drop(Batch batch, Status.Code code, RuntimeException error) {
    outbox.poll();
    dropped.addAndGet(batch.requests);
    LOG.log(
        Level.WARNING,
        "retryd: traffic report {0} refused ({1}: {2}); dropped {3} requests in {4} entries",
        new Object[] {batch.request.getReportId(), code, error.getMessage(), batch.requests, batch.request.getTrafficCount()});
  }

  /** Starts the daemon thread; returns this reporter. */
  public synchronized TrafficReporter start() {
    if (thread == null) {
      thread = new Thread(this::run, "retryd-traffic-reporter");
      thread.setDaemon(true);
      thread.start();
    }
    return this;
  }

  private void run() {
    try {
      while (!stop.await(interval.toNanos(), TimeUnit.NANOSECONDS)) {
        try {
          flush();
        } catch (RuntimeException unexpected) {
          LOG.log(Level.WARNING, "retryd: traffic reporter failed; will try again", unexpected);
        }
      }
    } catch (InterruptedException interrupted) {
      Thread.currentThread().interrupt();
    }
  }

  /** Stops the daemon thread and sends what is left (once). */
  @Override
  public void close() {
    stop.countDown();
    Thread running;
    synchronized (this) {
      running = thread;
      thread = null;
    }
    if (running != null) {
      try {
        running.join(TimeUnit.SECONDS.toMillis(10));
      } catch (InterruptedException interrupted) {
        Thread.currentThread().interrupt();
      }
    }
    flush();
  }

  /** One report: its id and entries never change, so a re-send is safe. */
  private static final class Batch {
    final ReportTrafficRequest request;
    final long requests;
    int failures;

    Batch(List<UpstreamTraffic> entries) {
      this.request =
          ReportTrafficRequest.newBuilder().addAllTraffic(entries).setReportId(UUID.randomUUID().toString()).build();
      long sum = 0;
      for (UpstreamTraffic entry : entries) {
        sum += entry.getRequests();
      }
      this.requests = sum;
    }
  }
}
