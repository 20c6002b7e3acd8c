package dev.retryd.client;

import java.time.Duration;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.ZonedDateTime;
import java.time.format.DateTimeFormatter;
import java.time.format.DateTimeFormatterBuilder;
import java.time.temporal.ChronoField;
import java.time.format.DateTimeParseException;
import java.util.EnumSet;
import java.util.Locale;
import java.util.Optional;
import java.util.Set;
import java.util.concurrent.ThreadLocalRandom;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.BodyKind;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.Replayability;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/**
 * The conservative rule that decides when retryd cannot be reached: the same
 * rule as the Python and TypeScript clients' fallback, plus the gRPC outcomes.
 *
 * <p>Without retryd there is no fleet-wide budget and no per-upstream policy, so
 * the local rule only ever allows less than retryd would:
 *
 * <ul>
 *   <li>it honours the local attempt limit ({@link LocalPolicy#maxAttempts()}, 2
 *       by default: at most one retry per call) and the request's own lower limit;
 *   <li>it never retries a one-shot body, a response already delivered, a
 *       draining runtime, a deadline below the minimum attempt budget, or a
 *       permanent failure (profile rejection, invalid certificate, request encoding);
 *   <li>it never retries what may have been sent unless the operation is safely
 *       idempotent: only proven NOT_SENT is retried for a NON_IDEMPOTENT call; a
 *       request that may have been sent is AMBIGUOUS when no response (or only
 *       part of one) came back, or a 502/503/504 (gRPC: UNAVAILABLE or
 *       DEADLINE_EXCEEDED) came back; anything else is DENY;
 *   <li>a safely idempotent call is retried on SENT_NO_RESPONSE, on a partial
 *       2xx/3xx response, and on 408, 425 (first attempt), 429, 502, 503 and 504
 *       (gRPC: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED only with a valid
 *       pushback); 401 (gRPC: UNAUTHENTICATED) is retried once with
 *       {@code refreshCredentials} for SAFE calls; 500 never (the policy that could
 *       register it as transient lives in retryd);
 *   <li>in a call chain (docs/lineage.md), a failure the layer below already
 *       retried ({@code retried_below}) is DENY RETRIED_BELOW, and a call made
 *       inside an enclosing retry (an attempt above 1 in {@code lineage}) DENY
 *       INSIDE_ENCLOSING_RETRY, retryd's default policy (rule 5, after draining);
 *   <li>a negative or unparseable {@code grpc-retry-pushback-ms} is DENY SERVER_PUSHBACK;
 *   <li>the backoff is full jitter from {@code base} capped at {@code maxBackoff},
 *       floored by Retry-After or the pushback (above {@code maxRetryAfter}, or not
 *       fitting the deadline, is DENY DEADLINE), shortened to fit the deadline.
 * </ul>
 *
 * <p>Evidence is weakened as retryd does (see {@link #effectiveEvidence}).
 */
public final class LocalRule {
  private LocalRule() {}

  private static final Set<FailureKind> NOT_SENT_PROOF =
      EnumSet.of(
          FailureKind.FAILURE_KIND_DNS,
          FailureKind.FAILURE_KIND_CONNECT,
          FailureKind.FAILURE_KIND_POOL_TIMEOUT,
          FailureKind.FAILURE_KIND_PRE_REQUEST_TLS,
          FailureKind.FAILURE_KIND_PROFILE_REJECTION,
          FailureKind.FAILURE_KIND_HTTP2_REFUSED_STREAM,
          FailureKind.FAILURE_KIND_GOAWAY_UNPROCESSED,
          FailureKind.FAILURE_KIND_TLS_CERTIFICATE_INVALID);
  private static final Set<FailureKind> PARTIAL =
      EnumSet.of(FailureKind.FAILURE_KIND_DECODE_RESET, FailureKind.FAILURE_KIND_INTERRUPTED_STREAM);
  private static final Set<FailureKind> PERMANENT =
      EnumSet.of(
          FailureKind.FAILURE_KIND_PROFILE_REJECTION,
          FailureKind.FAILURE_KIND_TLS_CERTIFICATE_INVALID,
          FailureKind.FAILURE_KIND_REQUEST_ENCODING);

  // google.rpc.Code numbers the rule looks at.
  private static final int GRPC_DEADLINE_EXCEEDED = 4;
  private static final int GRPC_RESOURCE_EXHAUSTED = 8;
  private static final int GRPC_UNAVAILABLE = 14;
  private static final int GRPC_UNAUTHENTICATED = 16;

  /**
   * The evidence retryd would use: the strongest (latest) of the claim
   * (unspecified counts as NOT_SENT), the failure's floor, and the outcome's floor
   * (an HTTP status or a pushback means RESPONSE_RECEIVED; a gRPC code alone does
   * not, since gRPC libraries make codes up).
   */
  public static Evidence effectiveEvidence(DecideRequest request) {
    int claim = request.getEvidenceValue();
    int effective = claim == 0 || claim > 4 ? (claim == 0 ? 1 : 2) : claim;
    FailureKind failure = request.getFailure();
    int failureFloor = NOT_SENT_PROOF.contains(failure) ? 1 : PARTIAL.contains(failure) ? 4 : 2;
    int outcomeFloor = request.getHttpStatus() != 0 || request.hasGrpcRetryPushbackMs() ? 3 : 1;
    return Evidence.forNumber(Math.max(effective, Math.max(failureFloor, outcomeFloor)));
  }

  /** Whether the idempotency allows a repeat: SAFE, IDEMPOTENT or IDEMPOTENT_WITH_KEY. */
  public static boolean isSafelyIdempotent(Idempotency idempotency) {
    return idempotency == Idempotency.IDEMPOTENCY_SAFE
        || idempotency == Idempotency.IDEMPOTENCY_IDEMPOTENT
        || idempotency == Idempotency.IDEMPOTENCY_IDEMPOTENT_WITH_KEY;
  }

  /** The replayability table; multipart takes its weakest part; anything undeclared is one-shot. */
  public static Replayability replayability(Body body) {
    BodyKind kind = body.getKind();
    switch (kind) {
      case BODY_KIND_NONE:
      case BODY_KIND_BYTES:
      case BODY_KIND_ENCODED_VALUE:
        return Replayability.REPLAYABILITY_REPLAYABLE;
      case BODY_KIND_REOPENABLE_SUPPLIER:
        return Replayability.REPLAYABILITY_REOPENABLE;
      case BODY_KIND_PUBLISHER_FACTORY:
        Replayability declared = body.getDeclared();
        return declared == Replayability.REPLAYABILITY_REPLAYABLE || declared == Replayability.REPLAYABILITY_REOPENABLE
            ? declared
            : Replayability.REPLAYABILITY_ONE_SHOT;
      case BODY_KIND_MULTIPART:
        if (body.getPartsCount() == 0) {
          return Replayability.REPLAYABILITY_ONE_SHOT;
        }
        int weakest = 1;
        for (Body part : body.getPartsList()) {
          weakest = Math.max(weakest, replayability(part).getNumber());
        }
        return Replayability.forNumber(weakest);
      default:
        return Replayability.REPLAYABILITY_ONE_SHOT;
    }
  }

  /**
   * A Retry-After value (delay-seconds or an HTTP-date in any of the three forms)
   * as a delay from {@code now}; empty if unparseable. A date in the past is zero.
   */
  public static Optional<Duration> parseRetryAfter(String value, Instant now) {
    if (value == null) {
      return Optional.empty();
    }
    String text = value.trim();
    if (text.isEmpty()) {
      return Optional.empty();
    }
    if (text.chars().allMatch(c -> c >= '0' && c <= '9')) {
      try {
        return Optional.of(Duration.ofSeconds(Long.parseLong(text)));
      } catch (NumberFormatException | ArithmeticException tooLarge) {
        return Optional.of(Duration.ofSeconds(Long.MAX_VALUE / 2));
      }
    }
    for (DateTimeFormatter format : httpDates(now)) {
      try {
        Duration delay = Duration.between(now, ZonedDateTime.parse(text, format).toInstant());
        return Optional.of(delay.isNegative() ? Duration.ZERO : delay);
      } catch (DateTimeParseException next) {
        // try the next form
      }
    }
    return Optional.empty();
  }

  private static final DateTimeFormatter IMF_FIXDATE = DateTimeFormatter.RFC_1123_DATE_TIME;
  // asctime: Sun Nov  6 08:49:37 1994, always GMT.
  private static final DateTimeFormatter ASCTIME =
      DateTimeFormatter.ofPattern("EEE MMM ppd HH:mm:ss yyyy", Locale.US).withZone(ZoneOffset.UTC);

  private static DateTimeFormatter[] httpDates(Instant now) {
    // RFC 850: Sunday, 06-Nov-94 08:49:37 GMT. Its two-digit year is the one
    // not more than 50 years ahead (RFC 9110), so the base moves with now.
    int base = now.atZone(ZoneOffset.UTC).getYear() - 49;
    DateTimeFormatter rfc850 =
        new DateTimeFormatterBuilder()
            .appendPattern("EEEE, dd-MMM-")
            .appendValueReduced(ChronoField.YEAR, 2, 2, base)
            .appendPattern(" HH:mm:ss zzz")
            .toFormatter(Locale.US);
    return new DateTimeFormatter[] {IMF_FIXDATE, rfc850, ASCTIME};
  }


  /**
   * A raw {@code grpc-retry-pushback-ms} value (gRFC A6): the least wait, or empty
   * when the server asks not to retry (negative or unparseable). Spaces and tabs
   * around the digits are forgiven, as retryd does.
   */
  public static Optional<Duration> parsePushback(String raw) {
    String digits = raw.replaceAll("^[ \t]+|[ \t]+$", "");
    if (digits.isEmpty() || !digits.chars().allMatch(c -> c >= '0' && c <= '9')) {
      return Optional.empty();
    }
    try {
      return Optional.of(Duration.ofMillis(Long.parseLong(digits)));
    } catch (NumberFormatException tooLarge) {
      return Optional.of(Duration.ofMillis(Long.MAX_VALUE));
    }
  }

  /**
   * Checks what retryd would reject before deciding anything, so that the
   * fallback never hides a caller's bug.
   *
   * @throws InvalidRequestException naming the field
   */
  static void validate(DecideRequest request) {
    if (request.getUpstream().isEmpty()) {
      throw new InvalidRequestException("upstream: required");
    }
    if (request.getIdempotencyValue() == 0) {
      throw new InvalidRequestException("idempotency: required");
    }
    if (request.getAttempt() < 1) {
      throw new InvalidRequestException("attempt: must be at least 1");
    }
    if (request.getGrpcStatusCode() != 0 && request.getHttpStatus() != 0) {
      throw new InvalidRequestException("grpc_status_code: not together with http_status");
    }
    if (request.getGrpcStatusCode() > 16) {
      throw new InvalidRequestException("grpc_status_code: at most 16");
    }
    if (request.hasGrpcRetryPushbackMs() && request.getGrpcStatusCode() == 0) {
      throw new InvalidRequestException("grpc_retry_pushback_ms: only with grpc_status_code");
    }
    if (!Lineage.isValid(request.getLineage())) {
      throw new InvalidRequestException("lineage: entries layer:attempt ([A-Za-z0-9._-]{1,64}, 1..1000), at most 32 and 1024 bytes");
    }
    if (!request.getRetriedBelow().isEmpty()) {
      if (!Lineage.isValidLayer(request.getRetriedBelow())) {
        throw new InvalidRequestException("retried_below: a layer name, 1 to 64 bytes of [A-Za-z0-9._-]");
      }
      // As retryd: the claimed evidence says whether a response came, else a status does.
      boolean answered =
          request.getEvidenceValue() == 0
              ? request.getHttpStatus() != 0 || request.getGrpcStatusCode() != 0
              : request.getEvidence() == Evidence.EVIDENCE_RESPONSE_RECEIVED
                  || request.getEvidence() == Evidence.EVIDENCE_PARTIAL_RESPONSE;
      if (!answered) {
        throw new InvalidRequestException("retried_below: only with a response");
      }
    }
  }

  /**
   * Decides one failed attempt without retryd (see the class comment).
   *
   * @param reason why retryd did not decide, for the explanation
   * @throws InvalidRequestException if retryd would have rejected the request
   */
  public static Decision decide(LocalPolicy policy, DecideRequest request, String reason) {
    validate(request);
    Evidence effective = effectiveEvidence(request);
    boolean claimed = request.getEvidenceValue() != 0;
    boolean adjusted = claimed && effective.getNumber() != request.getEvidenceValue();
    Idempotency idempotency = request.getIdempotency();
    boolean safe = isSafelyIdempotent(idempotency);
    int attempt = request.getAttempt();
    int http = request.getHttpStatus();
    int grpc = request.getGrpcStatusCode();
    Duration deadline = request.hasDeadlineRemaining() ? Durations.fromProto(request.getDeadlineRemaining()) : null;
    Answer answer = new Answer(effective, adjusted, reason, unknownOutcome(request, effective));

    int limit = request.getMaxAttempts() == 0 ? policy.maxAttempts() : Math.min(policy.maxAttempts(), request.getMaxAttempts());
    if (attempt >= limit) {
      return answer.deny(DenyReason.DENY_REASON_MAX_ATTEMPTS, 1, "attempt " + attempt + " reached the local limit " + limit);
    }
    if (request.hasBody() && replayability(request.getBody()) == Replayability.REPLAYABILITY_ONE_SHOT) {
      return answer.deny(DenyReason.DENY_REASON_BODY_NOT_REPLAYABLE, 3, "the body is one-shot");
    }
    if (request.getFirstByteDelivered()) {
      return answer.deny(DenyReason.DENY_REASON_RESPONSE_ALREADY_DELIVERED, 4, "the response was already delivered");
    }
    if (request.getRuntimeDraining()) {
      return answer.deny(DenyReason.DENY_REASON_RUNTIME_DRAINING, 5, "the runtime is draining");
    }
    // Rule 5 in a call chain (docs/lineage.md): the layer nearest the failure
    // retries it. One that already did said so; retrying here would multiply
    // its attempts by ours. Likewise while a layer above retries the request
    // being served (the default policy: deny inside an enclosing retry).
    if (!request.getRetriedBelow().isEmpty()) {
      return answer.deny(DenyReason.DENY_REASON_RETRIED_BELOW, 5,
          "the layer below (" + request.getRetriedBelow() + ") already retried this failure");
    }
    if (Lineage.isInsideEnclosingRetry(request.getLineage())) {
      return answer.deny(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, 5,
          "the call is made inside a retry of an enclosing call (" + request.getLineage() + ")");
    }
    if (deadline != null && deadline.compareTo(policy.minAttemptBudget()) < 0) {
      return answer.deny(DenyReason.DENY_REASON_DEADLINE, 6, "the deadline leaves no room for another attempt");
    }
    if (PERMANENT.contains(request.getFailure())) {
      return answer.deny(DenyReason.DENY_REASON_PERMANENT_FAILURE, 7, "the failure is permanent");
    }
    if (effective == Evidence.EVIDENCE_SENT_NO_RESPONSE && !safe) {
      return answer.ambiguous(8, "the request may have been sent and is not idempotent");
    }

    // Rule 9. The floor is Retry-After or the pushback, whichever applies.
    Optional<Duration> floor = http != 0 ? parseRetryAfter(request.getRetryAfter(), Instant.now()) : Optional.empty();
    boolean refresh = false;
    Verdict verdict;
    if (effective == Evidence.EVIDENCE_NOT_SENT || effective == Evidence.EVIDENCE_SENT_NO_RESPONSE) {
      verdict = Verdict.VERDICT_RETRY;
    } else if (effective == Evidence.EVIDENCE_PARTIAL_RESPONSE && grpc == 0 && (http == 0 || (http >= 200 && http < 400))) {
      verdict = safe ? Verdict.VERDICT_RETRY : Verdict.VERDICT_AMBIGUOUS;
    } else if (grpc != 0) {
      if (request.hasGrpcRetryPushbackMs()) {
        floor = parsePushback(request.getGrpcRetryPushbackMs());
        if (floor.isEmpty()) {
          return answer.deny(DenyReason.DENY_REASON_SERVER_PUSHBACK, 9, "the server asked not to retry (pushback)");
        }
      }
      if (grpc == GRPC_UNAVAILABLE || grpc == GRPC_DEADLINE_EXCEEDED) {
        verdict = safe ? Verdict.VERDICT_RETRY : Verdict.VERDICT_AMBIGUOUS;
      } else if (grpc == GRPC_RESOURCE_EXHAUSTED && safe && floor.isPresent()) {
        verdict = Verdict.VERDICT_RETRY;
      } else if (grpc == GRPC_UNAUTHENTICATED && idempotency == Idempotency.IDEMPOTENCY_SAFE && !request.getAuthRefreshAttempted()) {
        verdict = Verdict.VERDICT_RETRY;
        refresh = true;
      } else {
        verdict = Verdict.VERDICT_DENY;
      }
    } else if (http == 502 || http == 503 || http == 504) {
      verdict = safe ? Verdict.VERDICT_RETRY : Verdict.VERDICT_AMBIGUOUS;
    } else if (!safe) {
      verdict = Verdict.VERDICT_DENY;
    } else if (http == 408 || http == 429 || (http == 425 && attempt == 1)) {
      verdict = Verdict.VERDICT_RETRY;
    } else if (http == 401 && idempotency == Idempotency.IDEMPOTENCY_SAFE && !request.getAuthRefreshAttempted()) {
      verdict = Verdict.VERDICT_RETRY;
      refresh = true;
    } else {
      verdict = Verdict.VERDICT_DENY;
    }
    if (verdict == Verdict.VERDICT_AMBIGUOUS) {
      return answer.ambiguous(9, "the request may have taken effect");
    }
    if (verdict == Verdict.VERDICT_DENY) {
      String outcome = grpc != 0 ? "gRPC code " + grpc : "status " + http;
      return answer.deny(DenyReason.DENY_REASON_STATUS_NOT_RETRYABLE, 9, outcome + " is not retried locally");
    }

    Duration backoff = Duration.ZERO;
    if (!refresh) {
      long capNanos = Math.min(policy.maxBackoff().toNanos(), scaled(policy.base().toNanos(), attempt - 1));
      backoff = Duration.ofNanos(capNanos <= 0 ? 0 : ThreadLocalRandom.current().nextLong(capNanos + 1));
    }
    if (floor.isPresent()) {
      if (floor.get().compareTo(policy.maxRetryAfter()) > 0) {
        return answer.deny(DenyReason.DENY_REASON_DEADLINE, 6, "the requested wait exceeds the local maximum");
      }
      backoff = max(backoff, floor.get());
    }
    if (deadline != null) {
      Duration room = deadline.minus(policy.minAttemptBudget());
      if (floor.isPresent() && floor.get().compareTo(room) > 0) {
        return answer.deny(DenyReason.DENY_REASON_DEADLINE, 6, "the requested wait does not fit the deadline");
      }
      backoff = room.isNegative() ? Duration.ZERO : min(backoff, room);
    }
    return answer.retry(backoff, refresh, "retry " + effective.name());
  }

  /**
   * Whether the attempt may have taken effect upstream (retryd's
   * {@code unknown_outcome}), from the facts alone, never from the verdict, so
   * that no rule can hide it: the engine's definition
   * (crates/retryd-engine/src/outcome.rs). Set where rule 8 or the status rules
   * would answer AMBIGUOUS had no earlier rule denied (for a keyed call: would,
   * were it not keyed). A gRPC UNAVAILABLE is open whatever a pushback says: a
   * policy says whether to retry, not whether the server ran the call.
   */
  public static UnknownOutcome unknownOutcome(DecideRequest request, Evidence effective) {
    UnknownOutcome mark;
    switch (request.getIdempotency()) {
      case IDEMPOTENCY_NON_IDEMPOTENT:
        mark = UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE;
        break;
      case IDEMPOTENCY_IDEMPOTENT_WITH_KEY:
        mark = UnknownOutcome.UNKNOWN_OUTCOME_RESEND_WITH_KEY;
        break;
      default:
        return UnknownOutcome.UNKNOWN_OUTCOME_NONE;
    }
    int http = request.getHttpStatus();
    int grpc = request.getGrpcStatusCode();
    boolean statusLeavesItOpen =
        http != 0 ? http >= 502 && http <= 504 : grpc == GRPC_UNAVAILABLE || grpc == GRPC_DEADLINE_EXCEEDED;
    boolean open;
    switch (effective) {
      case EVIDENCE_SENT_NO_RESPONSE:
        open = true;
        break;
      case EVIDENCE_PARTIAL_RESPONSE:
        // The effect happened and its result was lost on the way, unless an
        // error status says what happened.
        open = (http == 0 && grpc == 0) || (http >= 200 && http <= 399) || statusLeavesItOpen;
        break;
      case EVIDENCE_RESPONSE_RECEIVED:
        open = statusLeavesItOpen;
        break;
      default:
        open = false;
    }
    return open ? mark : UnknownOutcome.UNKNOWN_OUTCOME_NONE;
  }

  private static long scaled(long baseNanos, int doublings) {
    if (doublings >= 62 || baseNanos > (Long.MAX_VALUE >> doublings)) {
      return Long.MAX_VALUE;
    }
    return baseNanos << doublings;
  }

  private static Duration max(Duration a, Duration b) {
    return a.compareTo(b) >= 0 ? a : b;
  }

  private static Duration min(Duration a, Duration b) {
    return a.compareTo(b) <= 0 ? a : b;
  }

  /** Builds the fallback decisions of one request. */
  private static final class Answer {
    private final Evidence effective;
    private final boolean adjusted;
    private final String reason;
    private final UnknownOutcome unknownOutcome;

    Answer(Evidence effective, boolean adjusted, String reason, UnknownOutcome unknownOutcome) {
      this.effective = effective;
      this.adjusted = adjusted;
      this.reason = reason;
      this.unknownOutcome = unknownOutcome;
    }

    private Decision make(Verdict verdict, Duration backoff, DenyReason deny, boolean refresh, int rule, String why) {
      return new Decision(verdict, backoff, deny, refresh, rule, effective, adjusted, "", Double.NaN, reason + "; local rule: " + why, true,
          unknownOutcome);
    }

    Decision deny(DenyReason deny, int rule, String why) {
      return make(Verdict.VERDICT_DENY, Duration.ZERO, deny, false, rule, why);
    }

    Decision ambiguous(int rule, String why) {
      return make(Verdict.VERDICT_AMBIGUOUS, Duration.ZERO, DenyReason.DENY_REASON_UNSPECIFIED, false, rule, why);
    }

    Decision retry(Duration backoff, boolean refresh, String why) {
      return make(Verdict.VERDICT_RETRY, backoff, DenyReason.DENY_REASON_UNSPECIFIED, refresh, 9, why);
    }
  }
}
