/** Errors raised by the retryd client. */
import type { Decision, DenyReason, UnknownOutcome } from './types';

/** Base class of every error this package raises. */
export class RetrydError extends Error {
  override name = 'RetrydError';
}

/**
 * retryd rejected the request as invalid (gRPC INVALID_ARGUMENT): a bug in
 * the caller, never hidden by the local fallback. `field` is the offending
 * field, from the start of the message ("upstream: required").
 */
export class InvalidRequestError extends RetrydError {
  override name = 'InvalidRequestError';
  readonly field: string;
  constructor(message: string) {
    super(message);
    const colon = message.indexOf(':');
    this.field = colon >= 0 ? message.slice(0, colon).trim() : '';
  }
}

/** retryd could not answer in time and the local fallback is disabled. */
export class RetrydUnavailableError extends RetrydError {
  override name = 'RetrydUnavailableError';
  constructor(
    message: string,
    /** The gRPC status code. */
    readonly code: number,
  ) {
    super(message);
  }
}

/**
 * The request may or may not have taken effect upstream: retrying could
 * duplicate a side effect, and a plain failure would claim it did not happen.
 * Raised for an AMBIGUOUS answer and for a DENY whose decision carries an
 * `unknownOutcome` mark (an empty budget, the last attempt, the caller's
 * deadline), so no rule hides that the call may have happened.
 *
 * Reconcile (query the upstream) before reporting a failure or sending it
 * again; when `resendWithSameKey` is true (an IDEMPOTENT_WITH_KEY call),
 * re-sending with the same idempotency key is safe, and a new key is not.
 */
export class AmbiguousExecutionError extends RetrydError {
  override name = 'AmbiguousExecutionError';
  constructor(
    readonly decision: Decision,
    /** The last response, if one arrived. */
    readonly response?: Response,
    options?: { cause?: unknown },
  ) {
    const why = decision.denyReason === null ? '' : ` (retry denied: ${decision.denyReason})`;
    super(`ambiguous execution${why}: ${decision.explanation || 'the request may have taken effect'}`, options);
  }

  /** Why retrying was denied (BUDGET_EXHAUSTED, MAX_ATTEMPTS, DEADLINE, …); null for an AMBIGUOUS answer. */
  get denyReason(): DenyReason | null {
    return this.decision.denyReason;
  }

  /** The decision's mark: 'RECONCILE' or 'RESEND_WITH_KEY' ('NONE' only for an AMBIGUOUS answer without one). */
  get unknownOutcome(): UnknownOutcome {
    return this.decision.unknownOutcome;
  }

  /** True when it may have happened and re-sending with the same idempotency key is safe (IDEMPOTENT_WITH_KEY). */
  get resendWithSameKey(): boolean {
    return this.decision.unknownOutcome === 'RESEND_WITH_KEY';
  }
}

/**
 * Whether a decision that ends the call means "it may have happened": an
 * AMBIGUOUS answer, or a DENY carrying an unknown-outcome mark. The one test
 * both adapters (and the conformance runner) use.
 */
export function leavesOutcomeUnknown(decision: Decision): boolean {
  return decision.verdict === 'AMBIGUOUS' || (decision.verdict !== 'RETRY' && decision.unknownOutcome !== 'NONE');
}

/**
 * Where the adapters leave their last decision: keyed by the returned
 * Response, the thrown error, or a gRPC error's metadata object (grpc-js
 * builds the ServiceError with the very Metadata instance the interceptor
 * saw, so that object identifies the call's outcome).
 */
const DECISIONS = new WeakMap<object, Decision>();

/** Records `decision` as the outcome's last decision (see decisionOf). */
export function attachDecision(outcome: unknown, decision: Decision): void {
  if (outcome === null || typeof outcome !== 'object') return;
  DECISIONS.set(outcome, decision);
  if (!(outcome instanceof Response)) {
    try {
      Object.defineProperty(outcome, 'retrydDecision', { value: decision, configurable: true, enumerable: false });
    } catch {
      // A frozen error still has its decision in the map.
    }
  }
}

/**
 * The last retryd decision behind an outcome of fetchWithRetries or of the
 * gRPC interceptor: pass the Response it resolved to, or the error it
 * rejected with (an AmbiguousExecutionError, a fetch error, a gRPC
 * ServiceError). Undefined when no attempt failed, so nothing was decided.
 *
 * ```ts
 * const response = await fetchWithRetries(retryd, url, {}, { upstream: 'catalog', idempotency: 'SAFE' });
 * const decision = decisionOf(response);
 * if (decision?.verdict === 'DENY') log.warn({ reason: decision.denyReason, id: decision.decisionId }, decision.explanation);
 * ```
 */
export function decisionOf(outcome: unknown): Decision | undefined {
  if (outcome === null || typeof outcome !== 'object') return undefined;
  const direct = DECISIONS.get(outcome);
  if (direct !== undefined) return direct;
  if (outcome instanceof AmbiguousExecutionError) return outcome.decision;
  const metadata = (outcome as { metadata?: unknown }).metadata;
  if (metadata !== null && typeof metadata === 'object') return DECISIONS.get(metadata);
  return undefined;
}

/**
 * The AmbiguousExecutionError behind an outcome of fetchWithRetries or the
 * gRPC interceptor, or undefined when the outcome is known. fetchWithRetries
 * rejects with the error itself; a gRPC call's ServiceError (which grpc-js
 * builds, so its class cannot change) carries it as
 * `error.ambiguousExecution`, which this returns.
 */
export function ambiguousExecutionOf(outcome: unknown): AmbiguousExecutionError | undefined {
  if (outcome instanceof AmbiguousExecutionError) return outcome;
  const carried = (outcome as { ambiguousExecution?: unknown } | null | undefined)?.ambiguousExecution;
  return carried instanceof AmbiguousExecutionError ? carried : undefined;
}
