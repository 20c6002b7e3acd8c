/** Errors raised by the retryd client. */
import type { Decision } from './types';

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
 * Reconcile (query the upstream, or replay with an idempotency key).
 */
export class AmbiguousExecutionError extends RetrydError {
  override name = 'AmbiguousExecutionError';
  constructor(
    readonly decision: Decision,
    /** The last response, if one arrived. */
    readonly response?: Response,
    options?: { cause?: unknown },
  ) {
    super(`ambiguous execution: ${decision.explanation || 'the request may have taken effect'}`, options);
  }
}
