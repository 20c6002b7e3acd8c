package dev.retryd.client;

import java.util.concurrent.atomic.AtomicLong;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * One warning per outage of retryd, shared by a {@link RetrydClient}'s
 * decisions and the {@link TrafficReporter}s on it: a WARNING when retryd
 * becomes unreachable, FINE for every fallback decision and failed traffic batch
 * meanwhile, and one WARNING when a call succeeds again, with the counts. A
 * warning per decision would flood the log exactly when it matters most.
 *
 * <p>A healthy call costs one volatile read.
 */
final class Outage {
  private static final Logger LOG = Logger.getLogger("dev.retryd.client");

  private final Object lock = new Object();
  private volatile boolean down;
  private long startedNanos;
  private final AtomicLong fallbackDecisions = new AtomicLong();
  private final AtomicLong failedBatches = new AtomicLong();
  private final AtomicLong outages = new AtomicLong();

  /** A decision retryd could not make ({@code what}: the status), made by the local rule. */
  void fallbackDecision(String what) {
    fallbackDecisions.incrementAndGet();
    failed(what, "deciding with the local rule until it is back");
  }

  /** A traffic batch that could not be sent; it is re-sent later with the same id. */
  void failedBatch(String what) {
    failedBatches.incrementAndGet();
    failed(what, "traffic reports wait until it is back");
  }

  private void failed(String what, String meanwhile) {
    boolean first = false;
    if (!down) {
      synchronized (lock) {
        if (!down) {
          down = true;
          startedNanos = System.nanoTime();
          outages.incrementAndGet();
          first = true;
        }
      }
    }
    if (first) {
      LOG.log(Level.WARNING, "retryd unreachable ({0}); {1} (one warning per outage)", new Object[] {what, meanwhile});
    } else {
      LOG.log(Level.FINE, "retryd still unreachable ({0})", what);
    }
  }

  /** A call retryd answered. Ends the outage, if there was one, with one warning. */
  void answered() {
    if (!down) {
      return;
    }
    long decisions;
    long batches;
    long seconds;
    synchronized (lock) {
      if (!down) {
        return;
      }
      down = false;
      decisions = fallbackDecisions.getAndSet(0);
      batches = failedBatches.getAndSet(0);
      seconds = (System.nanoTime() - startedNanos) / 1_000_000_000L;
    }
    LOG.log(
        Level.WARNING,
        "retryd reachable again after {0}s; meanwhile {1} decisions were made by the local rule and {2} traffic batches failed",
        new Object[] {seconds, decisions, batches});
  }

  /** Whether retryd is taken to be unreachable now. */
  boolean isDown() {
    return down;
  }

  /** How many outages began since the client was built. */
  long count() {
    return outages.get();
  }
}
