/**
 * Node.js client for retryd, the fleet-wide retry decision service.
 *
 * ```ts
 * import { RetrydClient } from 'retryd-client';
 * const retryd = new RetrydClient('127.0.0.1:50051', { timeoutMs: 200 });
 * const decision = await retryd.decide({ upstream: 'payments-api', idempotency: 'SAFE', attempt: 1, failure: 'CONNECT' });
 * if (decision.verdict === 'RETRY') await sleep(decision.backoffMs);
 * ```
 *
 * With fetch, `fetchWithRetries` does the whole loop; with @grpc/grpc-js,
 * `retryingInterceptor`.
 */
export { RetrydClient, DEFAULT_CHANNEL_OPTIONS, MAX_TRAFFIC_ENTRIES, toDecideRequest, type ClientOptions, type CallOptions, type HedgeInput } from './client';
export {
  AmbiguousExecutionError,
  ambiguousExecutionOf,
  decisionOf,
  InvalidRequestError,
  leavesOutcomeUnknown,
  RetrydError,
  RetrydUnavailableError,
} from './errors';
export { DEFAULT_LOCAL_POLICY, effectiveEvidence, localDecide, parsePushback, parseRetryAfter, unknownOutcomeOf, type LocalPolicy } from './fallback';
export {
  bodyOf,
  classifyFetchError,
  classifyResponse,
  DEFAULT_RETRY_STATUSES,
  fetchWithRetries,
  hedgesOf,
  type FetchRetryOptions,
  type Outcome,
} from './fetch';
export {
  attemptSucceeded,
  classifyGrpcStatus,
  classifyingInterceptor,
  FAILURE_CODES,
  grpcOutcomeOf,
  retryingInterceptor,
  type AttemptSeen,
  type GrpcOutcome,
  type GrpcRetryOptions,
} from './grpc';
export {
  chainFromLineage,
  currentChain,
  defaultLayer,
  enclosingRetry,
  formatLineage,
  isLayerName,
  LINEAGE_BAGGAGE_KEY,
  lineageError,
  lineageFromBaggage,
  lineageHandler,
  lineageMiddleware,
  lineageServerInterceptor,
  MAX_LINEAGE_ATTEMPT,
  MAX_LINEAGE_BYTES,
  MAX_LINEAGE_ENTRIES,
  parseLineage,
  RETRIED_HEADER,
  runInChain,
  shortenLineage,
  withLineageBaggage,
  type ChainContext,
  type LineageEntry,
  type LineageOptions,
} from './lineage';
export {
  hedgingFromPb,
  HedgingTable,
  localHedgeDecision,
  runHedged,
  type HedgePlan,
  type HedgeRace,
  type HedgeRound,
  type Hedging,
  type LocalHedging,
} from './hedging';
export { bucketStart, latencyBucket, latencyBucketOfMs, MAX_BUCKET, MAX_LATENCY_US } from './latency';
export { DEFAULT_SHADOW_LOG_INTERVAL_MS } from './shadow';
export { TrafficReporter, type LatencyCounts, type Logger, type ReportResult, type TrafficEntry, type TrafficReporterOptions, type TrafficSink } from './reporter';
export { traceMetadata, withBaggageEntry } from './tracing';
export {
  ENUM_VALUES,
  isSafelyIdempotent,
  replayabilityOf,
  type Body,
  type BodyKind,
  type Budget,
  type DecideInput,
  type Decision,
  type DenyReason,
  type Evidence,
  type FailureKind,
  type Idempotency,
  type Replayability,
  type UnknownOutcome,
  type Verdict,
} from './types';
