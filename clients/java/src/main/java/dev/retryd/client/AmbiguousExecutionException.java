package dev.retryd.client;

import java.io.IOException;
import java.net.http.HttpResponse;
import java.util.HashSet;
import java.util.Optional;
import java.util.Set;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.UnknownOutcome;

/**
 * The request may have taken effect upstream, and it was not retried: retryd (or
 * the local rule) answered AMBIGUOUS, or it denied a retry (an empty budget, the
 * last attempt, the caller's deadline) of an attempt whose outcome is unknown
 * ({@link Decision#unknownOutcome()}). Reporting a plain failure would claim it
 * did not happen, so the adapters raise this instead.
 *
 * <p>What to do: {@link #resendWithSameKey()} true (IDEMPOTENT_WITH_KEY):
 * re-sending with the same idempotency key is safe, a new key is not. Otherwise
 * (NON_IDEMPOTENT) reconcile: ask the upstream whether it happened before you
 * report a failure or send it again. {@link #denyReason()} says why there was no
 * retry (DENY_REASON_UNSPECIFIED for an AMBIGUOUS answer).
 *
 * <p>An {@link IOException}, so that {@link RetryingHttpClient#send} keeps the
 * checked exceptions of {@link java.net.http.HttpClient#send}; a {@link
 * RetrydClientInterceptor} call closes with the last attempt's status whose cause
 * is this ({@link #of(Throwable)} finds it). The cause is the last attempt's
 * failure, if it was an exception.
 */
public final class AmbiguousExecutionException extends IOException {
  private static final long serialVersionUID = 1L;
  private final transient Decision decision;
  private final transient HttpResponse<?> response;

  /** A decision with {@link Decision#isOutcomeUnknown()}, the last attempt's response (or null) and its failure (or null). */
  public AmbiguousExecutionException(Decision decision, HttpResponse<?> response, Throwable cause) {
    super(messageOf(decision), cause);
    this.decision = decision;
    this.response = response;
  }

  private static String messageOf(Decision decision) {
    String what =
        decision.isAmbiguous()
            ? "AMBIGUOUS"
            : decision.verdict().name().replaceFirst("^VERDICT_", "") + " " + decision.denyReason().name();
    String todo =
        decision.resendWithSameKey()
            ? "outcome unknown: re-send with the same idempotency key"
            : "outcome unknown: reconcile before failing or re-sending";
    return "retryd: " + what + " (rule " + decision.rule() + "), " + todo + ": " + decision.explanation();
  }

  /** The decision: AMBIGUOUS, or a DENY with an unknown-outcome mark. */
  public Decision decision() {
    return decision;
  }

  /** Why no retry was allowed (BUDGET_EXHAUSTED, MAX_ATTEMPTS, DEADLINE...); DENY_REASON_UNSPECIFIED for AMBIGUOUS. */
  public DenyReason denyReason() {
    return decision.denyReason();
  }

  /** The mark: RECONCILE, RESEND_WITH_KEY, or NONE for an AMBIGUOUS answer of a retryd without the mark. */
  public UnknownOutcome unknownOutcome() {
    return decision.unknownOutcome();
  }

  /**
   * True for an IDEMPOTENT_WITH_KEY call: it may have happened, and re-sending it
   * with the same idempotency key is safe. False: reconcile.
   */
  public boolean resendWithSameKey() {
    return decision.resendWithSameKey();
  }

  /** The response of the last attempt, if one arrived (a 503, say). */
  public Optional<HttpResponse<?>> response() {
    return Optional.ofNullable(response);
  }

  /**
   * The ambiguous-execution error in {@code error}'s causes: itself from {@link
   * RetryingHttpClient#send}, or the cause of a {@code StatusRuntimeException} a
   * {@link RetrydClientInterceptor} call ended with. Empty for a plain failure.
   */
  public static Optional<AmbiguousExecutionException> of(Throwable error) {
    Set<Throwable> seen = new HashSet<>();
    for (Throwable cause = error; cause != null && seen.add(cause); cause = cause.getCause()) {
      if (cause instanceof AmbiguousExecutionException) {
        return Optional.of((AmbiguousExecutionException) cause);
      }
    }
    return Optional.empty();
  }
}
