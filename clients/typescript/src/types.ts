/**
 * The vocabulary of retryd.v1 for TypeScript callers: the proto enum names
 * without their prefixes ('SAFE' for IDEMPOTENCY_SAFE). Every union below is
 * computed from the types that proto-loader-gen-types generated from
 * proto/retryd/v1/retryd.proto, so a value added to the contract appears here
 * at the next build, and a value removed from it breaks the build.
 *
 * Wherever an enum is accepted, a number is accepted too and sent unchanged:
 * a newer server may know values this client does not.
 */
import { BodyKind as PbBodyKind } from './generated/retryd/v1/BodyKind';
import { DenyReason as PbDenyReason } from './generated/retryd/v1/DenyReason';
import type { Hedging } from './hedging';
import { Evidence as PbEvidence } from './generated/retryd/v1/Evidence';
import { FailureKind as PbFailureKind } from './generated/retryd/v1/FailureKind';
import { Idempotency as PbIdempotency } from './generated/retryd/v1/Idempotency';
import { Replayability as PbReplayability } from './generated/retryd/v1/Replayability';
import { UnknownOutcome as PbUnknownOutcome } from './generated/retryd/v1/UnknownOutcome';
import { Verdict as PbVerdict } from './generated/retryd/v1/Verdict';

type Strip<Name, Prefix extends string> = Name extends `${Prefix}${infer Rest}` ? Rest : never;
type Values<Pb, Prefix extends string> = Exclude<Strip<keyof Pb, Prefix>, 'UNSPECIFIED'>;

/** How safe it is to run the operation more than once, as the caller declares it. */
export type Idempotency = Values<typeof PbIdempotency, 'IDEMPOTENCY_'>;
/** How far the failed attempt got. */
export type Evidence = Values<typeof PbEvidence, 'EVIDENCE_'>;
/** The stage failure that produced the evidence. */
export type FailureKind = Values<typeof PbFailureKind, 'FAILURE_KIND_'>;
/** Whether a body can be sent again. */
export type Replayability = Values<typeof PbReplayability, 'REPLAYABILITY_'>;
/** What the body is, in the terms of the replayability table. */
export type BodyKind = Strip<keyof typeof PbBodyKind, 'BODY_KIND_'>;
/** What to do. UNSPECIFIED only for a value this client does not know. */
export type Verdict = Strip<keyof typeof PbVerdict, 'VERDICT_'>;
/** Why a retry was denied. */
export type DenyReason = Values<typeof PbDenyReason, 'DENY_REASON_'>;
/**
 * Whether the failed attempt may have taken effect upstream, whichever rule
 * decided: 'NONE' (not in doubt, or harmless to repeat), 'RECONCILE'
 * (NON_IDEMPOTENT: ask the upstream before failing or re-sending) or
 * 'RESEND_WITH_KEY' (IDEMPOTENT_WITH_KEY: re-sending with the same key is
 * safe, a new key is not).
 */
export type UnknownOutcome = Strip<keyof typeof PbUnknownOutcome, 'UNKNOWN_OUTCOME_'>;

function names<Pb extends object, Prefix extends string>(pb: Pb, prefix: Prefix): Strip<keyof Pb, Prefix>[] {
  return Object.keys(pb).map((key) => key.slice(prefix.length)) as Strip<keyof Pb, Prefix>[];
}

/** Every value of each enum, in proto order (UNSPECIFIED included where the proto has it). */
export const ENUM_VALUES = {
  idempotency: names(PbIdempotency, 'IDEMPOTENCY_'),
  evidence: names(PbEvidence, 'EVIDENCE_'),
  failureKind: names(PbFailureKind, 'FAILURE_KIND_'),
  replayability: names(PbReplayability, 'REPLAYABILITY_'),
  bodyKind: names(PbBodyKind, 'BODY_KIND_'),
  verdict: names(PbVerdict, 'VERDICT_'),
  denyReason: names(PbDenyReason, 'DENY_REASON_'),
  unknownOutcome: names(PbUnknownOutcome, 'UNKNOWN_OUTCOME_'),
} as const;

/** A request body as far as replayability goes. No body at all is `undefined`. */
export interface Body {
  kind: BodyKind | number;
  /** For PUBLISHER_FACTORY only: the replayability the factory declares. */
  declared?: Replayability | number;
  /** For MULTIPART only: the parts (1 to 64, nested at most 4 deep). */
  parts?: Body[];
}

/** What happened to one failed attempt (the DecideRequest, in milliseconds). */
export interface DecideInput {
  /** The upstream called; names the budget and the policy. */
  upstream: string;
  /** Declared idempotency (required: the method alone never decides). */
  idempotency: Idempotency | number;
  /** Attempts made so far, the failed one included: 1 = the first attempt failed. */
  attempt: number;
  /** For audit, e.g. "POST /v1/charges". */
  operation?: string;
  /** The caller's claim; retryd may weaken it, never strengthen it. */
  evidence?: Evidence | number;
  failure?: FailureKind | number;
  /** 0 or absent for none. */
  httpStatus?: number;
  /** The raw Retry-After header. */
  retryAfter?: string | null;
  /** Time left before the caller's own deadline; absent = no deadline. */
  deadlineRemainingMs?: number;
  body?: Body;
  firstByteDelivered?: boolean;
  runtimeDraining?: boolean;
  authRefreshAttempted?: boolean;
  /** The backoff slept before the failed attempt (decorrelated jitter). */
  previousBackoffMs?: number;
  /** The caller's own attempt limit; 0 or absent = the policy's. */
  maxAttempts?: number;
  /**
   * For a gRPC call: the status code the attempt ended with (1 CANCELLED to
   * 16 UNAUTHENTICATED); 0 or absent for none. Never together with
   * httpStatus. A code alone does not prove a response arrived: say so in
   * `evidence` (RESPONSE_RECEIVED for a status the server sent).
   */
  grpcStatusCode?: number;
  /**
   * The raw `grpc-retry-pushback-ms` trailer, exactly as received.
   * Presence matters: undefined or null means the server sent none, while
   * any string (even "" or "-1") is sent as it is.
   */
  grpcRetryPushbackMs?: string | null;
  /**
   * Where this call sits in a call chain (docs/lineage.md): the
   * `retryd.lineage` baggage member of the inbound request it is made while
   * serving, without this layer's own entry (`edge:2/middle:1`); empty or
   * absent at the edge. The adapters fill it from the inbound wrappers'
   * context (./lineage). An entry with an attempt above 1 means a layer
   * above is retrying: DENY INSIDE_ENCLOSING_RETRY unless the upstream's
   * policy allows it.
   */
  lineage?: string;
  /**
   * The layer that already retried this failure below, from the failed
   * response's `retryd-retried` header or trailer (a layer name; only with a
   * response). DENY RETRIED_BELOW: only the layer nearest a failure retries it.
   */
  retriedBelow?: string;
}

/**
 * The decision for one failed attempt: what the client acts on. It is
 * retryd's answer, except in two cases: `fallback` is true when the local
 * rule decided because retryd could not answer, and `shadow` is true when
 * retryd answered for an upstream in shadow mode (see `shadow`).
 */
export interface Decision {
  verdict: Verdict;
  /** For RETRY: wait this long before the next attempt. */
  backoffMs: number;
  /** For DENY: why; null otherwise. */
  denyReason: DenyReason | null;
  /**
   * Whether the attempt may have taken effect upstream, set whichever rule
   * decided (a DENY BUDGET_EXHAUSTED of a timed-out charge is 'RECONCILE').
   * The adapters raise AmbiguousExecutionError for a DENY that carries one,
   * as for AMBIGUOUS. A value newer than this client reads as 'RECONCILE',
   * so that it is never hidden.
   */
  unknownOutcome: UnknownOutcome;
  /** For RETRY after a 401: refresh credentials before replaying. */
  refreshCredentials: boolean;
  /** The step of the decision order that decided, 1 to 9. */
  rule: number;
  effectiveEvidence: Evidence | 'UNSPECIFIED';
  evidenceAdjusted: boolean;
  /** Empty for a fallback decision. */
  decisionId: string;
  /** NaN for a fallback decision. */
  tokensRemaining: number;
  explanation: string;
  /**
   * True when the local rule decided: retryd could not answer, or the
   * caller's deadline was already over (`deadlineRemainingMs` 0: asking
   * would only wait past it; `decisionId` is empty then too).
   */
  fallback: boolean;
  /**
   * True when retryd answered for an upstream in shadow mode (`enforce =
   * false` in its policy): retryd's decision is not enforced, so this
   * decision is the client's own local rule (the one it falls back to), and
   * fetchWithRetries and the interceptor act on it. Then `retrydDecision` is
   * retryd's shadow decision, `decisionId` is retryd's (its audit span),
   * `tokensRemaining` is NaN and `fallback` is false.
   */
  shadow: boolean;
  /**
   * For a shadow answer, retryd's own decision as it answered (its `shadow`
   * true, its `tokensRemaining` the shadow budget's): what retryd would have
   * enforced. Null otherwise.
   */
  retrydDecision: Decision | null;
}

/** The state of one upstream's budget. */
export interface Budget {
  upstream: string;
  tokens: number;
  capacity: number;
  ratio: number;
  minPerSecond: number;
  retriesEnabled: boolean;
  tracked: boolean;
  /** The upstream's hedging as served to clients; absent without a policy. */
  hedging?: Hedging;
}

const REPLAYABILITY_RANK: Record<Replayability, number> = { REPLAYABLE: 0, REOPENABLE: 1, ONE_SHOT: 2 };

/** The seed's replayability table; multipart takes its weakest part; no body is REPLAYABLE. */
export function replayabilityOf(body: Body | undefined): Replayability {
  if (body === undefined) return 'REPLAYABLE';
  switch (body.kind) {
    case 'NONE':
    case 'BYTES':
    case 'ENCODED_VALUE':
      return 'REPLAYABLE';
    case 'REOPENABLE_SUPPLIER':
      return 'REOPENABLE';
    case 'PUBLISHER_FACTORY':
      return typeof body.declared === 'string' ? body.declared : 'ONE_SHOT';
    case 'MULTIPART': {
      const parts = body.parts ?? [];
      if (parts.length === 0) return 'ONE_SHOT';
      return parts
        .map(replayabilityOf)
        .reduce((weakest, part) => (REPLAYABILITY_RANK[part] > REPLAYABILITY_RANK[weakest] ? part : weakest));
    }
    default:
      return 'ONE_SHOT';
  }
}

/** True for SAFE, IDEMPOTENT and IDEMPOTENT_WITH_KEY. */
export function isSafelyIdempotent(idempotency: Idempotency | number): boolean {
  return idempotency === 'SAFE' || idempotency === 'IDEMPOTENT' || idempotency === 'IDEMPOTENT_WITH_KEY';
}
