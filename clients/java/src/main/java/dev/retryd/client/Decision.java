package dev.retryd.client;

import java.time.Duration;
import java.util.Objects;
import retryd.v1.Retryd.DecideResponse;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/**
 * The decision for one failed attempt: from retryd, or from the local rule when
 * retryd could not answer ({@link #fallback()} is then true). Immutable.
 */
public final class Decision {
  private final Verdict verdict;
  private final Duration backoff;
  private final DenyReason denyReason;
  private final boolean refreshCredentials;
  private final int rule;
  private final Evidence effectiveEvidence;
  private final boolean evidenceAdjusted;
  private final String decisionId;
  private final double tokensRemaining;
  private final String explanation;
  private final boolean fallback;
  private final UnknownOutcome unknownOutcome;
  private final boolean shadow;
  private final Decision retrydDecision;

  Decision(
      Verdict verdict,
      Duration backoff,
      DenyReason denyReason,
      boolean refreshCredentials,
      int rule,
      Evidence effectiveEvidence,
      boolean evidenceAdjusted,
      String decisionId,
      double tokensRemaining,
      String explanation,
      boolean fallback,
      UnknownOutcome unknownOutcome) {
    this(verdict, backoff, denyReason, refreshCredentials, rule, effectiveEvidence, evidenceAdjusted, decisionId,
        tokensRemaining, explanation, fallback, unknownOutcome, false, null);
  }

  private Decision(
      Verdict verdict,
      Duration backoff,
      DenyReason denyReason,
      boolean refreshCredentials,
      int rule,
      Evidence effectiveEvidence,
      boolean evidenceAdjusted,
      String decisionId,
      double tokensRemaining,
      String explanation,
      boolean fallback,
      UnknownOutcome unknownOutcome,
      boolean shadow,
      Decision retrydDecision) {
    this.verdict = Objects.requireNonNull(verdict);
    this.backoff = Objects.requireNonNull(backoff);
    this.denyReason = Objects.requireNonNull(denyReason);
    this.refreshCredentials = refreshCredentials;
    this.rule = rule;
    this.effectiveEvidence = Objects.requireNonNull(effectiveEvidence);
    this.evidenceAdjusted = evidenceAdjusted;
    this.decisionId = Objects.requireNonNull(decisionId);
    this.tokensRemaining = tokensRemaining;
    this.explanation = Objects.requireNonNull(explanation);
    this.fallback = fallback;
    // A value newer than this client reads as UNRECOGNIZED: unknown, so
    // treated as "may have happened" (never as the plain failure).
    this.unknownOutcome = Objects.requireNonNull(unknownOutcome);
    this.shadow = shadow;
    this.retrydDecision = retrydDecision;
  }

  /**
   * The decision to act on for a shadow answer: the local rule's {@code local},
   * marked shadow, carrying retryd's own answer and its decision id.
   */
  static Decision shadowed(Decision local, Decision retryd) {
    return new Decision(local.verdict, local.backoff, local.denyReason, local.refreshCredentials, local.rule,
        local.effectiveEvidence, local.evidenceAdjusted, retryd.decisionId, local.tokensRemaining, local.explanation,
        false, local.unknownOutcome, true, retryd);
  }

  /** The same answer from retryd, marked as a shadow one (not enforced). */
  Decision asShadowAnswer() {
    return new Decision(verdict, backoff, denyReason, refreshCredentials, rule, effectiveEvidence, evidenceAdjusted,
        decisionId, tokensRemaining, explanation, false, unknownOutcome, true, null);
  }

  /** The decision retryd sent. Values newer than this client read as UNSPECIFIED/UNRECOGNIZED. */
  static Decision fromResponse(DecideResponse response) {
    return new Decision(
        response.getVerdict(),
        Durations.fromProto(response.getBackoff()),
        response.getDenyReason(),
        response.getRefreshCredentials(),
        response.getRule(),
        response.getEffectiveEvidence(),
        response.getEvidenceAdjusted(),
        response.getDecisionId(),
        response.getTokensRemaining(),
        response.getExplanation(),
        false,
        response.getUnknownOutcome());
  }

  /** RETRY, DENY or AMBIGUOUS. */
  public Verdict verdict() {
    return verdict;
  }

  /** For RETRY: how long to wait before the next attempt (hold no connection meanwhile). Zero otherwise. */
  public Duration backoff() {
    return backoff;
  }

  /** For DENY: why. DENY_REASON_UNSPECIFIED otherwise. */
  public DenyReason denyReason() {
    return denyReason;
  }

  /** For RETRY after a 401 or UNAUTHENTICATED: refresh credentials before replaying. */
  public boolean refreshCredentials() {
    return refreshCredentials;
  }

  /** The step of the decision order that decided, 1 to 9. */
  public int rule() {
    return rule;
  }

  /** The evidence actually used, after validation against the failure and status. */
  public Evidence effectiveEvidence() {
    return effectiveEvidence;
  }

  /** Whether {@link #effectiveEvidence()} is weaker than the caller's claim. */
  public boolean evidenceAdjusted() {
    return evidenceAdjusted;
  }

  /** retryd's id for this decision (on its audit span); empty for a fallback decision. */
  public String decisionId() {
    return decisionId;
  }

  /** Tokens left in the upstream's budget after this decision; NaN for a fallback decision. */
  public double tokensRemaining() {
    return tokensRemaining;
  }

  /** One line for humans saying why. */
  public String explanation() {
    return explanation;
  }

  /**
   * True when the local rule decided: retryd could not answer, or was not asked
   * because the caller's deadline had run out during the attempt.
   */
  public boolean fallback() {
    return fallback;
  }

  /**
   * True when retryd answered for an upstream in shadow mode ({@code enforce =
   * false}): retryd's decision is not enforced, so this decision is the local
   * rule's, and retryd's own answer is {@link #retrydDecision()}.
   */
  public boolean shadow() {
    return shadow;
  }

  /** For a {@link #shadow()} decision: what retryd decided (and would enforce). Empty otherwise. */
  public java.util.Optional<Decision> retrydDecision() {
    return java.util.Optional.ofNullable(retrydDecision);
  }

  /** Whether the verdict is RETRY. */
  public boolean shouldRetry() {
    return verdict == Verdict.VERDICT_RETRY;
  }

  /** Whether the verdict is AMBIGUOUS: reconcile, do not retry. */
  public boolean isAmbiguous() {
    return verdict == Verdict.VERDICT_AMBIGUOUS;
  }

  /**
   * Whether the attempt may have taken effect upstream, whatever the verdict
   * says: UNKNOWN_OUTCOME_RECONCILE (NON_IDEMPOTENT: reconcile before failing or
   * re-sending), UNKNOWN_OUTCOME_RESEND_WITH_KEY (IDEMPOTENT_WITH_KEY: re-sending
   * with the same key is safe, a new key is not), or UNKNOWN_OUTCOME_NONE (a DENY
   * is then a plain failure). Computed by retryd, or by the local rule with the
   * same definition.
   */
  public UnknownOutcome unknownOutcome() {
    return unknownOutcome;
  }

  /**
   * Whether a call ended by this decision must not be reported as failed:
   * AMBIGUOUS, or a DENY carrying an {@link #unknownOutcome()} mark. The adapters
   * raise {@link AmbiguousExecutionException} exactly then.
   */
  public boolean isOutcomeUnknown() {
    return isAmbiguous() || (!shouldRetry() && unknownOutcome != UnknownOutcome.UNKNOWN_OUTCOME_NONE);
  }

  /** Whether the mark is RESEND_WITH_KEY: it may have happened; re-send with the same idempotency key. */
  public boolean resendWithSameKey() {
    return unknownOutcome == UnknownOutcome.UNKNOWN_OUTCOME_RESEND_WITH_KEY;
  }

  @Override
  public String toString() {
    StringBuilder text = new StringBuilder("Decision{").append(verdict.name());
    if (shouldRetry()) {
      text.append(" after ").append(backoff.toMillis()).append("ms");
    }
    if (denyReason != DenyReason.DENY_REASON_UNSPECIFIED) {
      text.append(' ').append(denyReason.name());
    }
    if (unknownOutcome != UnknownOutcome.UNKNOWN_OUTCOME_NONE) {
      text.append(", ").append(unknownOutcome.name());
    }
    text.append(", rule ").append(rule).append(", ").append(effectiveEvidence.name());
    if (fallback) {
      text.append(", fallback");
    }
    if (shadow) {
      text.append(", shadow");
    }
    return text.append(", \"").append(explanation).append("\"}").toString();
  }
}
