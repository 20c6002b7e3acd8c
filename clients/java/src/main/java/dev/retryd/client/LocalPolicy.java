package dev.retryd.client;

import java.time.Duration;
import java.util.Objects;

/**
 * The limits of the local fallback rule ({@link LocalRule}), used when retryd
 * cannot answer. Immutable; start from {@link #DEFAULT} and change what you need
 * with the {@code with*} methods.
 */
public final class LocalPolicy {
  /** At most 2 attempts (one retry), full jitter from 100ms capped at 2s, 50ms minimum attempt budget, Retry-After or pushback at most 30s. */
  public static final LocalPolicy DEFAULT =
      new LocalPolicy(2, Duration.ofMillis(100), Duration.ofSeconds(2), Duration.ofMillis(50), Duration.ofSeconds(30), Duration.ZERO);

  private final int maxAttempts;
  private final Duration base;
  private final Duration maxBackoff;
  private final Duration minAttemptBudget;
  private final Duration maxRetryAfter;
  private final Duration hedgeDelay;

  private LocalPolicy(
      int maxAttempts, Duration base, Duration maxBackoff, Duration minAttemptBudget, Duration maxRetryAfter, Duration hedgeDelay) {
    if (maxAttempts < 1) {
      throw new IllegalArgumentException("maxAttempts: must be at least 1, got " + maxAttempts);
    }
    for (Duration value : new Duration[] {base, maxBackoff, minAttemptBudget, maxRetryAfter, hedgeDelay}) {
      if (Objects.requireNonNull(value).isNegative()) {
        throw new IllegalArgumentException("durations must not be negative, got " + value);
      }
    }
    this.maxAttempts = maxAttempts;
    this.base = base;
    this.maxBackoff = maxBackoff;
    this.minAttemptBudget = minAttemptBudget;
    this.maxRetryAfter = maxRetryAfter;
    this.hedgeDelay = hedgeDelay;
  }

  /** The most attempts of one call, the failed one included (a request's own lower limit wins). */
  public int maxAttempts() {
    return maxAttempts;
  }

  /** The backoff before the first retry's jitter: attempt n draws from [0, base * 2^(n-1)]. */
  public Duration base() {
    return base;
  }

  /** The cap of the jittered backoff. */
  public Duration maxBackoff() {
    return maxBackoff;
  }

  /** The least time an attempt needs: less deadline left than this is DENY DEADLINE. */
  public Duration minAttemptBudget() {
    return minAttemptBudget;
  }

  /** The longest Retry-After or gRPC pushback honoured; a longer one is DENY DEADLINE. */
  public Duration maxRetryAfter() {
    return maxRetryAfter;
  }

  /** This policy with another attempt limit. */
  public LocalPolicy withMaxAttempts(int value) {
    return new LocalPolicy(value, base, maxBackoff, minAttemptBudget, maxRetryAfter, hedgeDelay);
  }

  /** This policy with another jitter base. */
  public LocalPolicy withBase(Duration value) {
    return new LocalPolicy(maxAttempts, value, maxBackoff, minAttemptBudget, maxRetryAfter, hedgeDelay);
  }

  /** This policy with another backoff cap. */
  public LocalPolicy withMaxBackoff(Duration value) {
    return new LocalPolicy(maxAttempts, base, value, minAttemptBudget, maxRetryAfter, hedgeDelay);
  }

  /** This policy with another minimum attempt budget. */
  public LocalPolicy withMinAttemptBudget(Duration value) {
    return new LocalPolicy(maxAttempts, base, maxBackoff, value, maxRetryAfter, hedgeDelay);
  }

  /** This policy with another Retry-After/pushback ceiling. */
  public LocalPolicy withMaxRetryAfter(Duration value) {
    return new LocalPolicy(maxAttempts, base, maxBackoff, minAttemptBudget, value, hedgeDelay);
  }

  /**
   * The fixed hedge delay while retryd is unreachable and has served no hedging
   * for the upstream in the last three report intervals: a safely idempotent call
   * still running after it is hedged once, if the upstream's local allowance has a
   * token (each first attempt earns 0.05 of one, retryd's default cap of extra
   * load, up to 10 saved). Zero, the default: no hedging without retryd.
   */
  public Duration hedgeDelay() {
    return hedgeDelay;
  }

  /** This policy with another local hedge delay (zero: no local hedging). */
  public LocalPolicy withHedgeDelay(Duration value) {
    return new LocalPolicy(maxAttempts, base, maxBackoff, minAttemptBudget, maxRetryAfter, value);
  }
}
