package dev.retryd.client;

import java.time.Duration;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/**
 * What the client knows of one upstream's hedging, as retryd last served it in
 * a {@code ReportTraffic} response ({@code Hedging} in retryd.proto). Immutable.
 */
public final class Hedging {
  /**
   * How many report intervals an entry outlives the last response that carried it.
   * A response lists only the upstreams of its own report, so an upstream idle for
   * an interval is absent without its policy having changed: dropping it at once
   * would leave the next calls unhedged. Three intervals (3s by default) ride out
   * an idle interval or two and a re-sent batch, while the entries of a retryd
   * that stopped answering are gone within seconds, so that in an outage the local
   * rule's hedging ({@link LocalPolicy#hedgeDelay()}), not a stale delay, applies.
   */
  static final int STALE_AFTER_INTERVALS = 3;

  private final boolean enabled;
  private final Duration delay;
  private final int maxHedges;
  private final Set<Idempotency> idempotency;
  private final long seenNanos;
  private final long staleNanos;

  Hedging(retryd.v1.Retryd.Hedging served, long seenNanos, long staleNanos) {
    this.enabled = served.getEnabled();
    this.delay = Durations.fromProto(served.getDelay());
    this.maxHedges = served.getMaxHedges();
    Set<Idempotency> levels = EnumSet.noneOf(Idempotency.class);
    for (Idempotency level : served.getIdempotencyList()) {
      if (level != Idempotency.UNRECOGNIZED) {
        levels.add(level);
      }
    }
    this.idempotency = levels;
    this.seenNanos = seenNanos;
    this.staleNanos = staleNanos;
  }

  /** True when retryd says calls to the upstream may be hedged now. */
  public boolean enabled() {
    return enabled;
  }

  /** The hedge delay retryd serves: the fleet's chosen quantile of first-attempt latency. */
  public Duration delay() {
    return delay;
  }

  /** The most hedges of one call. */
  public int maxHedges() {
    return maxHedges;
  }

  /** Whether a call of {@code level} may be hedged: never NON_IDEMPOTENT, whatever retryd sent. */
  public boolean allows(Idempotency level) {
    return enabled
        && !delay.isZero()
        && !delay.isNegative()
        && maxHedges > 0
        && level != Idempotency.IDEMPOTENCY_NON_IDEMPOTENT
        && idempotency.contains(level);
  }

  boolean staleAt(long nanos) {
    return nanos - seenNanos > staleNanos;
  }

  /** How one call is hedged: after {@code delay}, up to {@code max} hedges. */
  static final class Plan {
    final Duration delay;
    final int max;

    Plan(Duration delay, int max) {
      this.delay = delay;
      this.max = max;
    }
  }

  /** The per-upstream table, bounded like the reporter's upstreams. */
  static final class Table {
    private final Map<String, Hedging> entries = new HashMap<>();
    private final int max;

    Table(int max) {
      this.max = max;
    }

    synchronized void update(List<retryd.v1.Retryd.Hedging> served, long nowNanos, Duration stale) {
      for (Iterator<Hedging> it = entries.values().iterator(); it.hasNext(); ) {
        if (it.next().staleAt(nowNanos)) {
          it.remove();
        }
      }
      for (retryd.v1.Retryd.Hedging h : served) {
        if (entries.containsKey(h.getUpstream()) || entries.size() < max) {
          entries.put(h.getUpstream(), new Hedging(h, nowNanos, stale.toNanos()));
        }
      }
    }

    synchronized Optional<Hedging> lookup(String upstream, long nowNanos) {
      Hedging h = entries.get(upstream);
      return h == null || h.staleAt(nowNanos) ? Optional.empty() : Optional.of(h);
    }

    synchronized int size() {
      return entries.size();
    }
  }

  /**
   * The local rule's allowance of hedges while retryd is unreachable: each first
   * attempt earns {@link #LOAD} of a token for its upstream (up to {@link #BURST}),
   * each hedge spends one, so local hedging adds at most that share of load.
   */
  static final class LocalAllowance {
    static final double LOAD = 0.05;
    static final double BURST = 10;
    private final Map<String, Double> tokens = new HashMap<>();
    private final int max;

    LocalAllowance(int max) {
      this.max = max;
    }

    synchronized void earn(String upstream) {
      Double held = tokens.get(upstream);
      if (held == null && tokens.size() >= max) {
        return;
      }
      tokens.put(upstream, Math.min(BURST, (held == null ? 0 : held) + LOAD));
    }

    synchronized boolean spend(String upstream) {
      Double held = tokens.get(upstream);
      if (held == null || held < 1) {
        return false;
      }
      tokens.put(upstream, held - 1);
      return true;
    }
  }

  /** The local rule for a hedge ({@code hedge >= 1}): RETRY (no backoff) or DENY. */
  static Decision localDecide(LocalPolicy policy, LocalAllowance allowance, DecideRequest request, String reason) {
    Idempotency level = request.getIdempotency();
    boolean safe = level == Idempotency.IDEMPOTENCY_SAFE || level == Idempotency.IDEMPOTENCY_IDEMPOTENT;
    if (policy.hedgeDelay().isZero()) {
      return local(Verdict.VERDICT_DENY, DenyReason.DENY_REASON_HEDGING_OFF, reason, "no local hedging (LocalPolicy.hedgeDelay is zero)");
    }
    if (!safe || request.getHedge() > 1) {
      return local(Verdict.VERDICT_DENY, DenyReason.DENY_REASON_HEDGING_OFF, reason, "the local rule hedges safely idempotent calls once");
    }
    if (request.hasDeadlineRemaining()
        && Durations.fromProto(request.getDeadlineRemaining()).compareTo(policy.minAttemptBudget()) < 0) {
      return local(Verdict.VERDICT_DENY, DenyReason.DENY_REASON_DEADLINE, reason, "the deadline leaves no room for another attempt");
    }
    if (!allowance.spend(request.getUpstream())) {
      return local(Verdict.VERDICT_DENY, DenyReason.DENY_REASON_HEDGE_CAP, reason, "the local hedge allowance is spent");
    }
    return local(Verdict.VERDICT_RETRY, DenyReason.DENY_REASON_UNSPECIFIED, reason, "hedge at the local delay");
  }

  private static Decision local(Verdict verdict, DenyReason deny, String reason, String why) {
    return new Decision(verdict, Duration.ZERO, deny, false, 1, Evidence.EVIDENCE_SENT_NO_RESPONSE, false, "", Double.NaN,
        reason + "; local rule: " + why, true, UnknownOutcome.UNKNOWN_OUTCOME_NONE);
  }
}
