/**
 * The retryd client on @grpc/grpc-js.
 *
 * Every decision call has a short timeout (`timeoutMs`, 200 ms by default,
 * further bounded by the caller's own remaining deadline), carries the active
 * OpenTelemetry trace context, and falls back to the conservative local rule
 * of ./fallback when retryd cannot answer in time. An invalid request is never
 * hidden by the fallback: it throws InvalidRequestError. A shadow answer (an
 * upstream with `enforce = false`) is not acted on: the same local rule
 * decides, and the differences are counted and logged (./shadow).
 */
import * as grpc from '@grpc/grpc-js';
import type { Duration, Duration__Output } from './generated/google/protobuf/Duration';
import type { Body as PbBody } from './generated/retryd/v1/Body';
import type { Budget__Output } from './generated/retryd/v1/Budget';
import type { DecideRequest } from './generated/retryd/v1/DecideRequest';
import type { DecideResponse__Output } from './generated/retryd/v1/DecideResponse';
import type { RetryAdminClient } from './generated/retryd/v1/RetryAdmin';
import type { RetryDeciderClient } from './generated/retryd/v1/RetryDecider';
import type { UpstreamTraffic } from './generated/retryd/v1/UpstreamTraffic';
import { InvalidRequestError, RetrydUnavailableError } from './errors';
import { DEFAULT_LOCAL_POLICY, localDecide, type LocalPolicy } from './fallback';
import type { Hedging__Output } from './generated/retryd/v1/Hedging';
import { hedgingFromPb, HedgingTable, localHedgeDecision, type LocalHedging } from './hedging';
import { isLayerName, lineageError, resolveLayer } from './lineage';
import { OutageLog } from './outage';
import { proto } from './proto';
import { MAX_TRAFFIC_ENTRIES, TrafficReporter, type Logger, type ReportResult, type TrafficEntry, type TrafficReporterOptions } from './reporter';
import { decisionsDiffer, DEFAULT_SHADOW_LOG_INTERVAL_MS, ShadowDivergences } from './shadow';
import { traceMetadata } from './tracing';
import type { Body, Budget, DecideInput, Decision, DenyReason, Evidence, Idempotency, UnknownOutcome, Verdict } from './types';

export { MAX_TRAFFIC_ENTRIES };

/**
 * Channel options the client starts from: reconnect quickly after retryd
 * restarts (gRPC's own default backs off up to two minutes, all of which the
 * fallback would have to cover). Options passed by the caller win.
 */
export const DEFAULT_CHANNEL_OPTIONS: grpc.ChannelOptions = Object.freeze({
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 2000,
});

/** The least time a decision call gets when the caller's deadline is nearly over. */
const MIN_CALL_TIMEOUT_MS = 50;

export interface ClientOptions {
  /** Bound on every decision call, in ms (default 200). */
  timeoutMs?: number;
  /**
   * Bound on the connection the client opens when it is made, in ms
   * (default 2000). A decision made while it is being opened waits for it
   * (at most this long, and never past the caller's deadline) before its own
   * `timeoutMs` starts, so connecting is not charged to the first decision.
   */
  connectTimeoutMs?: number;
  /** The local rule used when retryd cannot answer; null throws RetrydUnavailableError instead. */
  fallback?: LocalPolicy | null;
  /** Channel credentials (default: insecure, for a loopback or sidecar retryd). */
  credentials?: grpc.ChannelCredentials;
  /** Metadata sent with every call, e.g. { authorization: 'Bearer …' }. */
  metadata?: Record<string, string>;
  /** Extra gRPC channel options. */
  channelOptions?: grpc.ChannelOptions;
  /**
   * The client's traffic reporter (`client.reporter`), which the adapters
   * count first attempts into: its options, or false for none (then budgets
   * fill only from what you report yourself, and the per-second floor).
   */
  reporting?: TrafficReporterOptions | false;
  /** Where warnings go (default: console): one per retryd outage, the shadow divergences, and the reporter's. */
  logger?: Logger;
  /**
   * The least time between two warnings about shadow decisions that differ
   * from the local rule, per upstream, in ms (default 60 000).
   */
  shadowLogIntervalMs?: number;
  /**
   * This service's layer name in call chains (docs/lineage.md): 1 to 64
   * bytes of [A-Za-z0-9._-]. The adapters append `<layer>:<attempt>` to the
   * `retryd.lineage` baggage member of each attempt. Default:
   * OTEL_SERVICE_NAME if it is valid, else the program's name, else "service".
   */
  layer?: string;
  /**
   * Hedging while retryd is unreachable (./hedging): a fixed delay paid from
   * a local bucket. Default null: no hedging without retryd.
   */
  localHedging?: LocalHedging | null;
}

/** Asks whether to send the `hedge`-th hedge of a call whose attempts are still running. */
export interface HedgeInput {
  upstream: string;
  idempotency: Idempotency | number;
  /** 1 for the first hedge. */
  hedge: number;
  /** Attempts already sent. */
  attempt: number;
  operation?: string;
  deadlineRemainingMs?: number;
  body?: Body;
  lineage?: string;
}

/** A decision call's own options. */
export interface CallOptions {
  /** Overrides the client's timeoutMs for this call. */
  timeoutMs?: number;
  /**
   * Whether `deadlineRemainingMs` also bounds the wait for retryd (default
   * true: no answer is worth more than what is left). False for a deadline
   * that is only data, as in the conformance vectors.
   */
  boundByDeadline?: boolean;
}

// ------------------------------------------------------------------ mapping

function pbEnum(prefix: string, value: string | number | undefined): never {
  if (value === undefined) return 0 as never;
  return (typeof value === 'number' ? value : `${prefix}${value}`) as never;
}

function fromPbEnum<T extends string>(prefix: string, value: string | number): T | 'UNSPECIFIED' {
  // A number means a value newer than this client's copy of the contract.
  return typeof value === 'string' && value.startsWith(prefix) ? (value.slice(prefix.length) as T) : 'UNSPECIFIED';
}

/** Milliseconds to a protobuf Duration; negative values are sent as they are (retryd rejects them). */
export function toDuration(ms: number | undefined): Duration | null {
  if (ms === undefined) return null;
  const totalNanos = Math.round(ms * 1e6);
  const seconds = Math.trunc(totalNanos / 1e9);
  return { seconds, nanos: totalNanos - seconds * 1e9 };
}

export function fromDuration(duration: Duration__Output | null): number {
  return duration === null ? 0 : Number(duration.seconds) * 1000 + duration.nanos / 1e6;
}

function toPbBody(body: Body): PbBody {
  return {
    kind: pbEnum('BODY_KIND_', body.kind),
    declared: pbEnum('REPLAYABILITY_', body.declared),
    parts: (body.parts ?? []).map(toPbBody),
  };
}

/** One report entry on the wire; the histograms absent (not empty) when none was recorded. */
function toUpstreamTraffic(entry: TrafficEntry | [string, number]): UpstreamTraffic {
  if (Array.isArray(entry)) return { upstream: entry[0], requests: entry[1] };
  const { latencySuccesses, latencyFailures, ...counts } = entry;
  return {
    ...counts,
    ...(latencySuccesses === undefined ? {} : { latencySuccesses: { counts: latencySuccesses } }),
    ...(latencyFailures === undefined ? {} : { latencyFailures: { counts: latencyFailures } }),
  };
}

/** The DecideRequest for an input. */
export function toDecideRequest(input: DecideInput): DecideRequest {
  return {
    upstream: input.upstream,
    operation: input.operation ?? '',
    idempotency: pbEnum('IDEMPOTENCY_', input.idempotency),
    body: input.body === undefined ? null : toPbBody(input.body),
    attempt: input.attempt,
    evidence: pbEnum('EVIDENCE_', input.evidence),
    failure: pbEnum('FAILURE_KIND_', input.failure),
    httpStatus: input.httpStatus ?? 0,
    retryAfter: input.retryAfter ?? '',
    deadlineRemaining: toDuration(input.deadlineRemainingMs),
    firstByteDelivered: input.firstByteDelivered ?? false,
    runtimeDraining: input.runtimeDraining ?? false,
    authRefreshAttempted: input.authRefreshAttempted ?? false,
    previousBackoff: toDuration(input.previousBackoffMs),
    maxAttempts: input.maxAttempts ?? 0,
    grpcStatusCode: input.grpcStatusCode ?? 0,
    // An optional field: present only when the server sent the trailer.
    ...(input.grpcRetryPushbackMs === undefined || input.grpcRetryPushbackMs === null
      ? {}
      : { grpcRetryPushbackMs: input.grpcRetryPushbackMs }),
    lineage: input.lineage ?? '',
    retriedBelow: input.retriedBelow ?? '',
  };
}

export function toDecision(response: DecideResponse__Output): Decision {
  const denyReason = fromPbEnum<DenyReason>('DENY_REASON_', response.denyReason);
  const unknownOutcome = fromPbEnum<UnknownOutcome>('UNKNOWN_OUTCOME_', response.unknownOutcome);
  return {
    verdict: fromPbEnum<Verdict>('VERDICT_', response.verdict),
    backoffMs: fromDuration(response.backoff),
    denyReason: denyReason === 'UNSPECIFIED' ? null : denyReason,
    // A mark newer than this client's contract still says "may have happened".
    unknownOutcome: unknownOutcome === 'UNSPECIFIED' ? 'RECONCILE' : unknownOutcome,
    refreshCredentials: response.refreshCredentials,
    rule: response.rule,
    effectiveEvidence: fromPbEnum<Evidence>('EVIDENCE_', response.effectiveEvidence),
    evidenceAdjusted: response.evidenceAdjusted,
    decisionId: response.decisionId,
    tokensRemaining: response.tokensRemaining,
    explanation: response.explanation,
    fallback: false,
    shadow: response.shadow,
    retrydDecision: null,
  };
}

function toBudget(budget: Budget__Output | null): Budget {
  if (budget === null) throw new Error('retryd returned no budget');
  return {
    upstream: budget.upstream,
    tokens: budget.tokens,
    capacity: budget.capacity,
    ratio: budget.ratio,
    minPerSecond: budget.minPerSecond,
    retriesEnabled: budget.retriesEnabled,
    tracked: budget.tracked,
    ...(budget.hedging === null || budget.hedging === undefined ? {} : { hedging: hedgingFromPb(budget.hedging) }),
  };
}

/**
 * Starts connecting `channel` and settles when it is READY (true), when the
 * first attempt failed or the channel was closed (false: waiting longer only
 * delays the fallback), or after `boundMs` (false).
 */
function connectEagerly(channel: ReturnType<grpc.Client["getChannel"]>, boundMs: number): Promise<boolean> {
  const deadline = Date.now() + boundMs;
  return new Promise<boolean>((resolve) => {
    const check = (): void => {
      const state = channel.getConnectivityState(true);
      if (state === grpc.connectivityState.READY) return resolve(true);
      if (state === grpc.connectivityState.TRANSIENT_FAILURE || state === grpc.connectivityState.SHUTDOWN) return resolve(false);
      channel.watchConnectivityState(state, deadline, (error) => (error ? resolve(false) : check()));
    };
    check();
  });
}

/** What retryd would reject for sure, checked where the local rule answers instead (it is never hidden). */
function checkRequired(input: DecideInput): void {
  if (!input.upstream) throw new InvalidRequestError('upstream: required');
  if (!input.idempotency) throw new InvalidRequestError('idempotency: required');
  if (!(input.attempt >= 1)) throw new InvalidRequestError('attempt: must be at least 1');
  const lineage = input.lineage ? lineageError(input.lineage) : null;
  if (lineage !== null) throw new InvalidRequestError(`lineage: ${lineage}`);
  if (input.retriedBelow) {
    if (!isLayerName(input.retriedBelow)) throw new InvalidRequestError('retried_below: not a layer name: 1 to 64 bytes of [A-Za-z0-9._-]');
    // As retryd reads it: the mark travels on a response, so it needs one.
    const claim = input.evidence;
    const answered =
      claim === undefined || claim === 0
        ? Boolean(input.httpStatus || input.grpcStatusCode)
        : claim === 'RESPONSE_RECEIVED' || claim === 'PARTIAL_RESPONSE' || claim === 3 || claim === 4;
    if (!answered) throw new InvalidRequestError('retried_below: needs a response (evidence RESPONSE_RECEIVED or PARTIAL_RESPONSE, or a status)');
  }
}

function isServiceError(error: unknown): error is grpc.ServiceError {
  return error instanceof Error && typeof (error as grpc.ServiceError).code === 'number';
}

// ------------------------------------------------------------------ the client

type Unary<Req, Res> = (
  request: Req,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: (error: grpc.ServiceError | null, response?: Res) => void,
) => grpc.ClientUnaryCall;

/**
 * A retryd client. Share one per process; call close() when done.
 *
 * For an upstream in shadow mode (retryd answers `shadow`), the client acts
 * on its own local rule, not on retryd's decision (`decision.shadow`,
 * `decision.retrydDecision`); differences are counted in
 * `shadowDivergences()` and warned about at most once per upstream every
 * `shadowLogIntervalMs`.
 */
export class RetrydClient {
  readonly timeoutMs: number;
  /** This service's layer name in call chains (the `layer` option, or its default). */
  readonly layer: string;
  readonly fallback: LocalPolicy | null;
  /**
   * Counts real traffic and sends it to this retryd; null when created with
   * `reporting: false`. fetchWithRetries and the gRPC interceptor record
   * their first attempts here unless told otherwise; close() flushes it.
   */
  readonly reporter: TrafficReporter | null;
  /**
   * The hedging retryd served with the reporter's answers, per upstream,
   * kept three report intervals after an upstream's last entry (./hedging).
   */
  readonly hedging: HedgingTable;
  private readonly logger: Logger;
  /** The fallback's outage: one warning when it begins, one line when retryd answers again. */
  private readonly outage: OutageLog;
  private readonly decider: RetryDeciderClient;
  private readonly admin: RetryAdminClient;
  private readonly metadata: Record<string, string>;
  private readonly shadowLog: ShadowDivergences;

  /**
   * Settles once the connection opened at construction is ready (true), or
   * has failed or run out of `connectTimeoutMs` (false; the client keeps
   * reconnecting, and decisions fall back meanwhile). Never rejects.
   */
  readonly connected: Promise<boolean>;
  private connecting = true;

  /** `target` is a gRPC target such as "127.0.0.1:50051". */
  constructor(readonly target: string, options: ClientOptions = {}) {
    this.timeoutMs = options.timeoutMs ?? 200;
    this.layer = resolveLayer(options.layer);
    this.fallback = options.fallback === undefined ? DEFAULT_LOCAL_POLICY : options.fallback;
    this.metadata = options.metadata ?? {};
    this.logger = options.logger ?? console;
    this.outage = new OutageLog(
      this.logger,
      (detail) => `retryd at ${target} did not answer (${detail}); deciding by the local rule until it answers again`,
      (failures, lastedMs) =>
        `retryd at ${target} answers again after ${Math.round(lastedMs)} ms; ${failures} decision(s) were made by the local rule meanwhile`,
    );
    // Checked before anything is opened, so a bad value leaks no channel.
    this.shadowLog = new ShadowDivergences(options.shadowLogIntervalMs ?? DEFAULT_SHADOW_LOG_INTERVAL_MS, this.logger);
    const credentials = options.credentials ?? grpc.credentials.createInsecure();
    const v1 = proto().retryd.v1;
    const channelOptions = { ...DEFAULT_CHANNEL_OPTIONS, ...options.channelOptions };
    this.decider = new v1.RetryDecider(target, credentials, channelOptions);
    // The admin client shares the decider's channel.
    this.admin = new v1.RetryAdmin(target, credentials, { ...channelOptions, channelOverride: this.decider.getChannel() });
    // Connect now rather than on the first call: the TCP and HTTP/2
    // handshakes would otherwise count against the first decision's 200 ms,
    // which on a busy machine made the first call fall back.
    this.connected = connectEagerly(this.decider.getChannel(), options.connectTimeoutMs ?? 2000);
    void this.connected.then(() => {
      this.connecting = false;
    });
    const intervalMs = (options.reporting === false ? undefined : options.reporting?.intervalMs) ?? 1000;
    this.hedging = new HedgingTable(3 * intervalMs, options.localHedging ?? null);
    this.reporter =
      options.reporting === false ? null : new TrafficReporter(this, { logger: this.logger, ...options.reporting }).start();
  }

  /**
   * Asks retryd whether to send the `hedge`-th hedge (1 = the first) of a
   * call still running. A RETRY says send it now (it spent a token of the
   * upstream's retry budget); a DENY names why (HEDGING_OFF, HEDGE_CAP,
   * UNIFORMLY_SLOW, BUDGET_EXHAUSTED, ...). With retryd unreachable the
   * `localHedging` option decides, or, without it, this rejects with
   * RetrydUnavailableError. The adapters call it when a hedge timer fires.
   */
  async decideHedge(input: HedgeInput, options: CallOptions = {}): Promise<Decision> {
    const bound = options.boundByDeadline !== false;
    if (this.connecting) await this.untilConnected(bound ? input.deadlineRemainingMs : undefined);
    let timeoutMs = options.timeoutMs ?? this.timeoutMs;
    if (input.deadlineRemainingMs !== undefined && bound) timeoutMs = Math.min(timeoutMs, Math.max(input.deadlineRemainingMs, MIN_CALL_TIMEOUT_MS));
    const request: DecideRequest = {
      upstream: input.upstream,
      operation: input.operation ?? '',
      idempotency: pbEnum('IDEMPOTENCY_', input.idempotency),
      attempt: input.attempt,
      hedge: input.hedge,
      lineage: input.lineage ?? '',
      deadlineRemaining: toDuration(input.deadlineRemainingMs),
      ...(input.body === undefined ? {} : { body: toPbBody(input.body) }),
    };
    try {
      const response = await this.call<DecideRequest, DecideResponse__Output>(
        this.decider.Decide.bind(this.decider) as Unary<DecideRequest, DecideResponse__Output>,
        request,
        timeoutMs,
      );
      this.answered();
      const decision = toDecision(response);
      if (!decision.shadow) return decision;
      // Not enforced (the upstream is in shadow mode): hedge as the client
      // would without retryd (its local hedging, else not at all).
      const local = localHedgeDecision(
        this.hedging,
        input.hedge,
        input.idempotency,
        input.deadlineRemainingMs,
        'retryd shadow answer, not enforced (upstream in shadow mode)',
      );
      return { ...local, fallback: false, shadow: true, retrydDecision: decision, decisionId: decision.decisionId };
    } catch (error) {
      if (!isServiceError(error)) throw error;
      if (error.code === grpc.status.INVALID_ARGUMENT) throw new InvalidRequestError(error.details);
      const codeName = grpc.status[error.code] ?? String(error.code);
      if (this.hedging.local === null) throw new RetrydUnavailableError(`retryd: ${codeName}: ${error.details}`, error.code);
      this.hedging.unreachable = true;
      this.outage.failed(`${codeName}: ${error.details}`);
      return localHedgeDecision(this.hedging, input.hedge, input.idempotency, input.deadlineRemainingMs, `retryd unreachable (${codeName})`);
    }
  }

  /** Asks retryd whether the failed attempt may be retried. */
  async decide(input: DecideInput, options: CallOptions = {}): Promise<Decision> {
    let timeoutMs = options.timeoutMs ?? this.timeoutMs;
    if (input.deadlineRemainingMs !== undefined && input.deadlineRemainingMs <= 0 && options.boundByDeadline !== false) {
      // The caller's deadline is over (for the adapters: it expired after the
      // request was sent). Asking retryd would only make the caller wait past
      // it for a DENY DEADLINE; the local rule gives the same answer, with
      // the same unknown-outcome mark, at once.
      checkRequired(input);
      // No attempt limit of its own here: the deadline is why it stops
      // (retryd's limit is not known locally, and may be higher).
      const policy = { ...(this.fallback ?? DEFAULT_LOCAL_POLICY), maxAttempts: Infinity };
      return localDecide(input, policy, "the caller's deadline expired; decided locally, without retryd");
    }
    if (this.connecting) await this.untilConnected(options.boundByDeadline === false ? undefined : input.deadlineRemainingMs);
    if (input.deadlineRemainingMs !== undefined && options.boundByDeadline !== false) {
      // Waiting longer than the caller has left is pointless, but leave
      // retryd a few milliseconds to say DENY DEADLINE itself.
      timeoutMs = Math.min(timeoutMs, Math.max(input.deadlineRemainingMs, MIN_CALL_TIMEOUT_MS));
    }
    try {
      const response = await this.call<DecideRequest, DecideResponse__Output>(
        this.decider.Decide.bind(this.decider) as Unary<DecideRequest, DecideResponse__Output>,
        toDecideRequest(input),
        timeoutMs,
      );
      this.answered();
      return this.toActedOn(input, toDecision(response));
    } catch (error) {
      if (!isServiceError(error)) throw error;
      if (error.code === grpc.status.INVALID_ARGUMENT) {
        this.answered();
        throw new InvalidRequestError(error.details);
      }
      const codeName = grpc.status[error.code] ?? String(error.code);
      if (this.fallback === null) {
        throw new RetrydUnavailableError(`retryd: ${codeName}: ${error.details}`, error.code);
      }
      checkRequired(input);
      this.outage.failed(`${codeName}: ${error.details}`);
      return localDecide(input, this.fallback, `retryd unreachable (${codeName})`);
    }
  }

  /**
   * How many shadow answers disagreed with the local rule (verdict or deny
   * reason), per upstream; upstreams with no difference are absent. A copy.
   */
  shadowDivergences(): Map<string, number> {
    return this.shadowLog.counts();
  }

  /** The decision to act on: retryd's, or for a shadow answer the local rule's, with retryd's beside it. */
  private toActedOn(input: DecideInput, decision: Decision): Decision {
    if (!decision.shadow) return decision;
    // Not enforced: decide as the client would without retryd (the fallback
    // rule; its default limits when the fallback is switched off, since
    // retryd did answer).
    const local = localDecide(
      input,
      this.fallback ?? DEFAULT_LOCAL_POLICY,
      'retryd shadow answer, not enforced (upstream in shadow mode)',
    );
    if (decisionsDiffer(decision, local)) this.shadowLog.record(input.upstream, decision, local);
    return { ...local, fallback: false, shadow: true, retrydDecision: decision, decisionId: decision.decisionId };
  }

  /**
   * One ReportTraffic call: at most MAX_TRAFFIC_ENTRIES entries, with a
   * report id (1 to 128 printable ASCII characters; '' for none) that makes
   * re-sending the same entries safe. What TrafficReporter uses. An entry is
   * a TrafficEntry (requests and outcomes) or an `[upstream, requests]` pair
   * (no outcomes).
   */
  async sendTrafficReport(traffic: (TrafficEntry | [string, number])[], reportId: string): Promise<ReportResult> {
    if (traffic.length > MAX_TRAFFIC_ENTRIES) {
      throw new InvalidRequestError(`traffic: at most ${MAX_TRAFFIC_ENTRIES} entries per report, got ${traffic.length}`);
    }
    let response: { accepted: number; alreadyApplied: number; hedging: Hedging__Output[] };
    try {
      response = await this.adminCall(
        this.decider.ReportTraffic.bind(this.decider) as Unary<unknown, { accepted: number; alreadyApplied: number; hedging: Hedging__Output[] }>,
        { traffic: traffic.map(toUpstreamTraffic), reportId },
      );
    } catch (error) {
      // Unreachable or too slow, not a refusal: the local hedging may start.
      if (error instanceof RetrydUnavailableError && (error.code === grpc.status.UNAVAILABLE || error.code === grpc.status.DEADLINE_EXCEEDED)) {
        this.hedging.unreachable = true;
      }
      throw error;
    }
    const hedging = (response.hedging ?? []).map(hedgingFromPb);
    this.hedging.update(hedging);
    return { accepted: response.accepted, alreadyApplied: response.alreadyApplied, hedging };
  }

  /** Reports real (first-attempt) requests per upstream; resolves to the entries accepted. */
  async reportTraffic(counts: Record<string, number> | Iterable<[string, number]>): Promise<number> {
    const pairs = Symbol.iterator in counts ? [...(counts as Iterable<[string, number]>)] : Object.entries(counts);
    const entries: UpstreamTraffic[] = pairs.filter(([, n]) => n > 0).map(([upstream, requests]) => ({ upstream, requests }));
    let accepted = 0;
    for (let start = 0; start < entries.length; start += MAX_TRAFFIC_ENTRIES) {
      const response = await this.adminCall(
        this.decider.ReportTraffic.bind(this.decider) as Unary<unknown, { accepted: number }>,
        { traffic: entries.slice(start, start + MAX_TRAFFIC_ENTRIES) },
      );
      accepted += response.accepted;
    }
    return accepted;
  }

  /** The current state of one upstream's budget (admin). */
  async getBudget(upstream: string): Promise<Budget> {
    const response = await this.adminCall(
      this.admin.GetBudget.bind(this.admin) as Unary<unknown, { budget: Budget__Output | null }>,
      { upstream },
    );
    return toBudget(response.budget);
  }

  /** Every tracked budget, ordered by upstream (admin). */
  async listBudgets(): Promise<Budget[]> {
    const response = await this.adminCall(
      this.admin.ListBudgets.bind(this.admin) as Unary<unknown, { budgets: Budget__Output[] }>,
      {},
    );
    return response.budgets.map(toBudget);
  }

  /** Switches retries on or off for an upstream, fleet-wide; resolves to the previous state (admin). */
  async setRetriesEnabled(upstream: string, enabled: boolean, reason = ''): Promise<boolean> {
    const response = await this.adminCall(
      this.admin.SetRetriesEnabled.bind(this.admin) as Unary<unknown, { previous: boolean }>,
      { upstream, enabled, reason },
    );
    return response.previous;
  }

  /** Flushes the reporter (bounded by one report call's timeout each batch), then closes the channel. */
  async close(): Promise<void> {
    try {
      await this.reporter?.close();
    } finally {
      this.decider.close();
    }
  }

  /** Waits for the eager connect to settle, at most `limitMs`. */
  private async untilConnected(limitMs: number | undefined): Promise<void> {
    if (limitMs === undefined) {
      await this.connected;
      return;
    }
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.connected, new Promise<void>((resolve) => (timer = setTimeout(resolve, limitMs)))]);
    clearTimeout(timer);
  }

  private answered(): void {
    this.outage.recovered();
  }

  private async adminCall<Res>(method: Unary<unknown, Res>, request: unknown): Promise<Res> {
    try {
      return await this.call(method, request, Math.max(this.timeoutMs, 1000));
    } catch (error) {
      if (!isServiceError(error)) throw error;
      if (error.code === grpc.status.INVALID_ARGUMENT) throw new InvalidRequestError(error.details);
      throw new RetrydUnavailableError(`retryd: ${grpc.status[error.code]}: ${error.details}`, error.code);
    }
  }

  private call<Req, Res>(method: Unary<Req, Res>, request: Req, timeoutMs: number): Promise<Res> {
    const metadata = new grpc.Metadata();
    for (const [key, value] of Object.entries(this.metadata)) metadata.set(key, value);
    for (const [key, value] of traceMetadata()) metadata.set(key, value);
    return new Promise<Res>((resolve, reject) => {
      method(request, metadata, { deadline: Date.now() + timeoutMs }, (error, response) => {
        if (error) reject(error);
        else if (response === undefined) reject(new Error('retryd returned no response'));
        else resolve(response);
      });
    });
  }
}
