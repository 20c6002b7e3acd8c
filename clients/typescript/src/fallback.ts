/**
 * The conservative local rule used when retryd cannot be reached.
 *
 * Without retryd there is no fleet-wide budget and no per-upstream policy,
 * so the local rule only ever allows less than retryd would:
 * - it honours the local attempt limit (`maxAttempts`, 2 by default: at most
 *   one retry per call) and the request's own lower limit;
 * - it never retries a one-shot body, a response already delivered, a
 *   draining runtime, a failure a layer below already retried
 *   (`retriedBelow`), a call inside an enclosing retry (`lineage`; unless
 *   `insideEnclosingRetry: 'allow'`), a deadline below `minAttemptBudgetMs`, or a permanent
 *   failure (profile rejection, invalid certificate, request encoding);
 * - it never retries what may have been sent unless the operation is safely
 *   idempotent: only proven NOT_SENT is retried for a NON_IDEMPOTENT call; a
 *   request that may have been sent is AMBIGUOUS when no response (or part of
 *   one) came back, or a 502/503/504 did; anything else is DENY;
 * - a safely idempotent call is retried on SENT_NO_RESPONSE, a partial
 *   2xx/3xx response, and 408, 425 (first attempt), 429, 502, 503, 504; a 401
 *   once with `refreshCredentials` for SAFE calls; 500 never;
 * - for a gRPC code on anything but proven NOT_SENT (a code speaks even
 *   when no response came, as in retryd): a negative or unparseable pushback is DENY
 *   SERVER_PUSHBACK; UNAVAILABLE and DEADLINE_EXCEEDED are retried for a
 *   safely idempotent call (AMBIGUOUS otherwise), RESOURCE_EXHAUSTED only
 *   with a valid pushback, UNAUTHENTICATED once with `refreshCredentials`
 *   for SAFE calls; every other code (INTERNAL and UNKNOWN included) is DENY;
 * - the backoff is full jitter from `baseMs` capped at `maxBackoffMs`,
 *   floored by Retry-After or the gRPC pushback (one above
 *   `maxRetryAfterMs`, or that does not fit the deadline, is DENY DEADLINE)
 *   and shortened to fit the deadline.
 *
 * Evidence is weakened exactly as retryd does (`effectiveEvidence`), and
 * every decision carries the same `unknownOutcome` mark retryd computes
 * (`unknownOutcomeOf`), whichever rule decided.
 */
import type { DecideInput, Decision, DenyReason, Evidence, FailureKind, UnknownOutcome, Verdict } from './types';
import { enclosingRetry } from './lineage';
import { isSafelyIdempotent, replayabilityOf } from './types';

export interface LocalPolicy {
  maxAttempts: number;
  baseMs: number;
  maxBackoffMs: number;
  minAttemptBudgetMs: number;
  maxRetryAfterMs: number;
  /**
   * Whether a call made inside a retry of an enclosing call (a lineage entry
   * with an attempt above 1) may be retried as well: 'deny' (the default,
   * as retryd's default policy) or 'allow'.
   */
  insideEnclosingRetry?: 'deny' | 'allow';
}

export const DEFAULT_LOCAL_POLICY: LocalPolicy = Object.freeze({
  maxAttempts: 2,
  baseMs: 100,
  maxBackoffMs: 2000,
  minAttemptBudgetMs: 50,
  maxRetryAfterMs: 30_000,
});

const NOT_SENT_PROOF = new Set<FailureKind | number>([
  'DNS',
  'CONNECT',
  'POOL_TIMEOUT',
  'PRE_REQUEST_TLS',
  'PROFILE_REJECTION',
  'HTTP2_REFUSED_STREAM',
  'GOAWAY_UNPROCESSED',
  'TLS_CERTIFICATE_INVALID',
]);
const PARTIAL = new Set<FailureKind | number>(['DECODE_RESET', 'INTERRUPTED_STREAM']);
export const PERMANENT_FAILURES = new Set<FailureKind | number>([
  'PROFILE_REJECTION',
  'TLS_CERTIFICATE_INVALID',
  'REQUEST_ENCODING',
]);
const ORDER: Evidence[] = ['NOT_SENT', 'SENT_NO_RESPONSE', 'RESPONSE_RECEIVED', 'PARTIAL_RESPONSE'];

/**
 * The evidence retryd would use: the strongest of the claim (none counts as
 * NOT_SENT), the failure's floor and the status's floor. An HTTP status or a
 * gRPC pushback trailer proves a response (RESPONSE_RECEIVED); a gRPC code
 * alone does not, since gRPC libraries make codes up themselves.
 */
export function effectiveEvidence(
  evidence: Evidence | number | undefined,
  failure: FailureKind | number | undefined,
  httpStatus: number | undefined,
  grpcRetryPushbackMs?: string | null,
): Evidence {
  let claimRank = 0;
  if (typeof evidence === 'string') claimRank = Math.max(0, ORDER.indexOf(evidence));
  else if (typeof evidence === 'number' && evidence !== 0) claimRank = evidence >= 1 && evidence <= 4 ? evidence - 1 : 1;
  let failureFloor = 1;
  if (failure !== undefined && NOT_SENT_PROOF.has(failure)) failureFloor = 0;
  else if (failure !== undefined && PARTIAL.has(failure)) failureFloor = 3;
  const statusFloor = httpStatus || (grpcRetryPushbackMs !== undefined && grpcRetryPushbackMs !== null) ? 2 : 0;
  return ORDER[Math.max(claimRank, failureFloor, statusFloor)] as Evidence;
}

/**
 * Whether the attempt may have taken effect upstream, as retryd computes it
 * (crates/retryd-engine/src/outcome.rs): from the facts alone, never from the
 * verdict, so no rule can hide it. Set for NON_IDEMPOTENT (RECONCILE) and
 * IDEMPOTENT_WITH_KEY (RESEND_WITH_KEY) when the effective evidence
 * (SENT_NO_RESPONSE; PARTIAL_RESPONSE with no status or a 2xx/3xx) or the
 * status (502, 503, 504, gRPC UNAVAILABLE or DEADLINE_EXCEEDED) leaves the
 * outcome open; never on a proven NOT_SENT or a final response (4xx, 500).
 */
export function unknownOutcomeOf(input: DecideInput, effective: Evidence): UnknownOutcome {
  let mark: UnknownOutcome;
  if (input.idempotency === 'NON_IDEMPOTENT') mark = 'RECONCILE';
  else if (input.idempotency === 'IDEMPOTENT_WITH_KEY') mark = 'RESEND_WITH_KEY';
  else if (isSafelyIdempotent(input.idempotency)) return 'NONE';
  // A number this client does not know: treated as not repeatable, as the
  // local rule treats it.
  else mark = 'RECONCILE';
  const http = input.httpStatus ?? 0;
  const code = input.grpcStatusCode ?? 0;
  const statusLeavesItOpen = (): boolean => {
    if (http !== 0) return http >= 502 && http <= 504;
    return code === GRPC.UNAVAILABLE || code === GRPC.DEADLINE_EXCEEDED;
  };
  let open: boolean;
  switch (effective) {
    case 'NOT_SENT':
      open = false;
      break;
    case 'SENT_NO_RESPONSE':
      open = true;
      break;
    case 'PARTIAL_RESPONSE':
      // The effect happened and its result was lost on the way, unless an
      // error status says what happened.
      open = (http === 0 && code === 0) || (http >= 200 && http < 400) || statusLeavesItOpen();
      break;
    default:
      open = statusLeavesItOpen();
  }
  return open ? mark : 'NONE';
}

const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];

/** An HTTP-date (IMF-fixdate, or the obsolete RFC 850 and asctime forms) as epoch ms; null if none. */
function parseHttpDate(text: string): number | null {
  let match = /^[A-Za-z]{3}, (\d{2}) ([A-Za-z]{3}) (\d{4}) (\d{2}):(\d{2}):(\d{2}) GMT$/.exec(text);
  let parts: [string, string, number, string, string, string] | undefined;
  if (match) parts = [match[1]!, match[2]!, Number(match[3]), match[4]!, match[5]!, match[6]!];
  match ??= /^[A-Za-z]+, (\d{2})-([A-Za-z]{3})-(\d{2}) (\d{2}):(\d{2}):(\d{2}) GMT$/.exec(text);
  if (match && !parts) {
    const year = Number(match[3]);
    parts = [match[1]!, match[2]!, year < 70 ? 2000 + year : 1900 + year, match[4]!, match[5]!, match[6]!];
  }
  match ??= /^[A-Za-z]{3} ([A-Za-z]{3}) ([ \d]\d) (\d{2}):(\d{2}):(\d{2}) (\d{4})$/.exec(text);
  if (match && !parts) parts = [match[2]!.trim(), match[1]!, Number(match[6]), match[3]!, match[4]!, match[5]!];
  if (!parts) return null;
  const month = MONTHS.indexOf(parts[1]);
  if (month < 0) return null;
  return Date.UTC(parts[2], month, Number(parts[0]), Number(parts[3]), Number(parts[4]), Number(parts[5]));
}

/** Milliseconds from a Retry-After value (delay-seconds or HTTP-date); null if unparseable. */
export function parseRetryAfter(value: string | null | undefined, now: number = Date.now()): number | null {
  if (!value) return null;
  const text = value.trim();
  if (/^\d+$/.test(text)) return Number(text) * 1000;
  const at = parseHttpDate(text);
  return at === null ? null : Math.max(0, at - now);
}

/**
 * A `grpc-retry-pushback-ms` value as gRFC A6 reads it (and retryd, which
 * also allows surrounding spaces and tabs): a non-negative decimal integer
 * is milliseconds; anything else (negative, empty, garbage) means "do not
 * retry" (`'stop'`); absent is null.
 */
export function parsePushback(value: string | null | undefined): number | 'stop' | null {
  if (value === undefined || value === null) return null;
  const digits = value.replace(/^[ \t]+|[ \t]+$/g, '');
  return /^\d+$/.test(digits) ? Number(digits) : 'stop';
}

/** google.rpc.Code numbers the local rule treats specially. */
const GRPC = { DEADLINE_EXCEEDED: 4, RESOURCE_EXHAUSTED: 8, UNAVAILABLE: 14, UNAUTHENTICATED: 16 } as const;

/** Decides one failed attempt without retryd; see the module comment. */
export function localDecide(
  input: DecideInput,
  policy: LocalPolicy = DEFAULT_LOCAL_POLICY,
  reason = 'retryd unreachable',
  random: () => number = Math.random,
): Decision {
  const effective = effectiveEvidence(input.evidence, input.failure, input.httpStatus, input.grpcRetryPushbackMs);
  const claimed = input.evidence !== undefined && input.evidence !== 0;
  const safe = isSafelyIdempotent(input.idempotency);
  const status = input.httpStatus ?? 0;
  const answer = (verdict: Verdict, denyReason: DenyReason | null, rule: number, why: string, backoffMs = 0, refresh = false): Decision => ({
    verdict,
    backoffMs,
    denyReason,
    unknownOutcome: unknownOutcomeOf(input, effective),
    refreshCredentials: refresh,
    rule,
    effectiveEvidence: effective,
    evidenceAdjusted: claimed && effective !== input.evidence,
    decisionId: '',
    tokensRemaining: Number.NaN,
    explanation: `${reason}; local rule: ${why}`,
    fallback: true,
    shadow: false,
    retrydDecision: null,
  });

  const limit = input.maxAttempts ? Math.min(policy.maxAttempts, input.maxAttempts) : policy.maxAttempts;
  if (input.attempt >= limit) return answer('DENY', 'MAX_ATTEMPTS', 1, `attempt ${input.attempt} reached the local limit ${limit}`);
  if (input.body !== undefined && replayabilityOf(input.body) === 'ONE_SHOT') {
    return answer('DENY', 'BODY_NOT_REPLAYABLE', 3, 'the body is one-shot');
  }
  if (input.firstByteDelivered) return answer('DENY', 'RESPONSE_ALREADY_DELIVERED', 4, 'the response was already delivered');
  if (input.runtimeDraining) return answer('DENY', 'RUNTIME_DRAINING', 5, 'the runtime is draining');
  // Rule 5 in a call chain (docs/lineage.md), as retryd: the layer nearest
  // the failure retries it, and no layer retries inside an enclosing retry.
  if (input.retriedBelow) {
    return answer('DENY', 'RETRIED_BELOW', 5, `the layer below (${input.retriedBelow}) already retried this failure`);
  }
  const enclosing = enclosingRetry(input.lineage);
  if (enclosing !== undefined && policy.insideEnclosingRetry !== 'allow') {
    return answer(
      'DENY',
      'INSIDE_ENCLOSING_RETRY',
      5,
      `a layer above (${enclosing.layer}, attempt ${enclosing.attempt}) is already retrying the request this call serves`,
    );
  }
  const deadline = input.deadlineRemainingMs;
  if (deadline !== undefined && deadline < policy.minAttemptBudgetMs) {
    return answer('DENY', 'DEADLINE', 6, 'the deadline leaves no room for another attempt');
  }
  if (input.failure !== undefined && PERMANENT_FAILURES.has(input.failure)) {
    return answer('DENY', 'PERMANENT_FAILURE', 7, 'the failure is permanent');
  }
  if (effective === 'SENT_NO_RESPONSE' && !safe) {
    return answer('AMBIGUOUS', null, 8, 'the request may have been sent and is not idempotent');
  }

  const code = input.grpcStatusCode ?? 0;
  const pushback = parsePushback(input.grpcRetryPushbackMs);
  let verdict: Verdict;
  let refresh = false;
  if (effective === 'NOT_SENT') verdict = 'RETRY';
  // A gRPC code speaks even without a response (as in retryd): the library's
  // own CANCELLED or oversized-message RESOURCE_EXHAUSTED is no reason to retry.
  else if (effective === 'SENT_NO_RESPONSE' && code === 0) verdict = 'RETRY';
  else if (code !== 0) {
    if (pushback === 'stop') return answer('DENY', 'SERVER_PUSHBACK', 9, 'the server asked not to retry (grpc-retry-pushback-ms)');
    if (code === GRPC.UNAVAILABLE || code === GRPC.DEADLINE_EXCEEDED) verdict = safe ? 'RETRY' : 'AMBIGUOUS';
    else if (!safe) verdict = 'DENY';
    else if (code === GRPC.RESOURCE_EXHAUSTED && pushback !== null) verdict = 'RETRY';
    else if (code === GRPC.UNAUTHENTICATED && input.idempotency === 'SAFE' && !input.authRefreshAttempted) {
      verdict = 'RETRY';
      refresh = true;
    } else verdict = 'DENY';
  }
  else if (effective === 'PARTIAL_RESPONSE' && (status === 0 || (status >= 200 && status < 400))) verdict = safe ? 'RETRY' : 'AMBIGUOUS';
  else if (status === 502 || status === 503 || status === 504) verdict = safe ? 'RETRY' : 'AMBIGUOUS';
  else if (!safe) verdict = 'DENY';
  else if (status === 408 || status === 429 || (status === 425 && input.attempt === 1)) verdict = 'RETRY';
  else if (status === 401 && input.idempotency === 'SAFE' && !input.authRefreshAttempted) {
    verdict = 'RETRY';
    refresh = true;
  } else verdict = 'DENY';
  if (verdict === 'AMBIGUOUS') return answer('AMBIGUOUS', null, 9, 'the request may have taken effect');
  if (verdict === 'DENY') {
    return answer('DENY', 'STATUS_NOT_RETRYABLE', 9, code !== 0 ? `gRPC code ${code} is not retried locally` : `status ${status} is not retried locally`);
  }

  let backoffMs = refresh ? 0 : random() * Math.min(policy.maxBackoffMs, policy.baseMs * 2 ** (input.attempt - 1));
  const floor = typeof pushback === 'number' ? pushback : parseRetryAfter(input.retryAfter);
  if (floor !== null) {
    if (floor > policy.maxRetryAfterMs) return answer('DENY', 'DEADLINE', 6, 'Retry-After exceeds the local maximum');
    backoffMs = Math.max(backoffMs, floor);
  }
  if (deadline !== undefined) {
    const room = deadline - policy.minAttemptBudgetMs;
    if (floor !== null && floor > room) return answer('DENY', 'DEADLINE', 6, 'Retry-After does not fit the deadline');
    backoffMs = Math.max(0, Math.min(backoffMs, room));
  }
  return answer('RETRY', null, 9, `retry ${effective}`, backoffMs, refresh);
}
