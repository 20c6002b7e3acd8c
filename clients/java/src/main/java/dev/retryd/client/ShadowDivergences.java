package dev.retryd.client;

import com.google.protobuf.Descriptors.FieldDescriptor;
import com.google.protobuf.UnknownFieldSet;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.logging.Level;
import java.util.logging.Logger;
import retryd.v1.Retryd.DecideResponse;
import retryd.v1.Retryd.DenyReason;

/**
 * Shadow answers ({@code DecideResponse.shadow}): an upstream with {@code
 * enforce = false} in retryd's policy is in shadow mode, where retryd decides as
 * it would and spends the budget, but does not enforce the decision. The client
 * then acts on its own local rule and keeps retryd's answer beside it; where
 * retryd's verdict or deny reason differs from the local one, the difference is
 * counted per upstream and logged, at most one warning per upstream per
 * interval (a minute by default), saying how many were not logged since. The
 * same behaviour as the Python and Go clients'.
 */
final class ShadowDivergences {
  private static final Logger LOG = Logger.getLogger("dev.retryd.client");
  /** DecideResponse.shadow's field number in the contract. */
  static final int SHADOW_FIELD = 12;

  private final long intervalNanos;
  private final Map<String, long[]> upstreams = new HashMap<>(); // count, unlogged, loggedAt (0: never)

  ShadowDivergences(Duration interval) {
    this.intervalNanos = interval.toNanos();
  }

  /**
   * Whether retryd marked its answer as a shadow one. Read by field number, so
   * that it works whether or not the contract this client was built from has the
   * field yet (then it arrives as an unknown field).
   */
  static boolean isShadow(DecideResponse response) {
    FieldDescriptor field = DecideResponse.getDescriptor().findFieldByNumber(SHADOW_FIELD);
    if (field != null && field.getJavaType() == FieldDescriptor.JavaType.BOOLEAN) {
      return (Boolean) response.getField(field);
    }
    UnknownFieldSet.Field unknown = response.getUnknownFields().getField(SHADOW_FIELD);
    List<Long> values = unknown.getVarintList();
    return !values.isEmpty() && values.get(values.size() - 1) != 0;
  }

  static boolean differs(Decision retryd, Decision local) {
    return retryd.verdict() != local.verdict() || retryd.denyReason() != local.denyReason();
  }

  static String describe(Decision decision) {
    return decision.denyReason() != DenyReason.DENY_REASON_UNSPECIFIED
        ? decision.verdict().name() + " " + decision.denyReason().name()
        : decision.verdict().name();
  }

  /** Counts one difference; logs it unless this upstream logged one less than the interval ago. */
  void record(String upstream, Decision retryd, Decision local) {
    long now = System.nanoTime();
    long unlogged;
    synchronized (upstreams) {
      long[] state = upstreams.computeIfAbsent(upstream, name -> new long[3]);
      state[0]++;
      if (state[2] != 0 && now - state[2] < intervalNanos) {
        state[1]++;
        return;
      }
      unlogged = state[1];
      state[1] = 0;
      state[2] = now == 0 ? 1 : now;
    }
    LOG.log(
        Level.WARNING,
        "retryd shadow decision for upstream {0} differs from the local rule: retryd {1}, local rule {2} (acted on); "
            + "{3} more difference(s) for this upstream not logged since the last line",
        new Object[] {upstream, describe(retryd), describe(local), unlogged});
  }

  /** Differences counted so far, per upstream (a snapshot). */
  Map<String, Long> counts() {
    Map<String, Long> counts = new HashMap<>();
    synchronized (upstreams) {
      upstreams.forEach((name, state) -> counts.put(name, state[0]));
    }
    return counts;
  }
}
