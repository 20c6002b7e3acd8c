/**
 * @grpc/grpc-js client interceptors: honest evidence from a failed gRPC call,
 * and retryd-governed retries.
 *
 * An interceptor sits above grpc-js's own call stack and sees only what the
 * library hands up: the response headers (if any), the messages, and a final
 * status `{ code, details, metadata }`. A code alone proves nothing (grpc-js
 * makes up UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED itself), so the
 * evidence comes from whether the status was the server's and from the
 * library's own wording, checked against grpc-js 1.14.7 (package-lock.json)
 * and tested against the real failure on 127.0.0.1 for every NOT_SENT row:
 *
 * | what the interceptor saw (no headers, no messages, empty trailers)     | evidence         | failure                 |
 * |------------------------------------------------------------------------|------------------|-------------------------|
 * | UNAVAILABLE "No connection established…" (the pick failed: no          | NOT_SENT         | CONNECT                 |
 * |   connection, e.g. a refused port; no stream was ever created)         |                  |                         |
 * | DEADLINE_EXCEEDED "…Waiting for LB pick" (the channel never became     | NOT_SENT         | CONNECT                 |
 * |   ready, e.g. a server that accepts TCP and never speaks HTTP/2)       |                  |                         |
 * | DEADLINE_EXCEEDED "…waiting for name resolution"                       | NOT_SENT         | DNS                     |
 * | UNAVAILABLE "Stream refused by server" (HTTP/2 REFUSED_STREAM, after   | NOT_SENT         | HTTP2_REFUSED_STREAM    |
 * |   grpc-js's one transparent retry)                                     |                  |                         |
 * | any other DEADLINE_EXCEEDED "Deadline exceeded…" (the stream existed)  | SENT_NO_RESPONSE | RESPONSE_HEADER_TIMEOUT |
 * | "Connection dropped", "read ECONNRESET", "Received RST_STREAM…", …     | SENT_NO_RESPONSE | CONNECTION_RESET        |
 * | "Write error…", "Write failed…"                                        | SENT_NO_RESPONSE | PARTIAL_WRITE           |
 * | the same after response headers arrived                                | PARTIAL_RESPONSE | INTERRUPTED_STREAM (a   |
 * |                                                                        |                  | deadline), DECODE_RESET |
 * | anything else: a status the server sent (its trailers arrived), with   | RESPONSE_RECEIVED| (code, raw pushback)    |
 * |   `grpc-retry-pushback-ms` passed raw                                  |                  |                         |
 *
 * A status counts as the library's only when its trailers are empty and its
 * details are one of grpc-js's own strings: a server's status always
 * carries trailers (grpc-js and tonic servers send at least content-type),
 * so a server that words its details like grpc-js gets RESPONSE_RECEIVED,
 * never NOT_SENT. NOT_SENT needs, in addition, that no header and no message
 * arrived, and no "previous attempts" of grpc-js's own retryPolicy (which
 * retryd-governed callers must switch off: see the README). GOAWAY with a
 * lower last-stream-id is not exposed by grpc-js 1.14.7 (the call just waits
 * for its deadline, SENT_NO_RESPONSE). Every attempt's code goes to retryd
 * as `grpc_status_code`; a response stream that already delivered messages
 * is `first_byte_delivered`.
 */
import * as grpc from '@grpc/grpc-js';
import type { RetrydClient } from './client';
import { AmbiguousExecutionError, attachDecision, leavesOutcomeUnknown } from './errors';
import { currentChain, isLayerName, LINEAGE_BAGGAGE_KEY, outboundLineage, recordRetriedFailure, RETRIED_HEADER, withLineageBaggage, type ChainContext } from './lineage';
import type { TrafficReporter } from './reporter';
import { withBaggageEntry } from './tracing';
import type { Decision, Evidence, FailureKind, Idempotency } from './types';

/** What a failed gRPC attempt proves, in retryd's terms. */
export interface GrpcOutcome {
  evidence: Evidence;
  failure?: FailureKind;
  /** The code the attempt ended with. */
  grpcStatusCode: number;
  /** The raw `grpc-retry-pushback-ms` trailer; absent when the server sent none. */
  grpcRetryPushbackMs?: string;
  /** Whether response messages were already handed to the application. */
  firstByteDelivered: boolean;
  /** The `retryd-retried` trailer, when it names a layer: a layer below already retried this failure. */
  retriedBelow?: string;
}

/** Sets this attempt's `retryd.lineage` in the call's `baggage` metadata, keeping its other members. */
function setLineage(metadata: grpc.Metadata, lineage: string): grpc.Metadata {
  metadata.set('baggage', withLineageBaggage(metadata.get('baggage').map(String), lineage));
  return metadata;
}

/** What the interceptor saw of an attempt before its status. */
export interface AttemptSeen {
  /** Response headers arrived (onReceiveMetadata). */
  headers: boolean;
  /** Response messages handed to the application. */
  messagesDelivered: number;
}

/** grpc-js's own status details (1.14.7) for failures it made up; see the module table. */
const NOT_CONNECTED = /^(?:(?:weighted_)?round_robin: )?No connection established/;
const REFUSED_STREAM = /^Stream refused by server$/;
const DEADLINE = /^Deadline exceeded/;
const NEVER_PICKED = /(?:^|,)Waiting for LB pick(?:,|$)/;
const NEVER_RESOLVED = /(?:^|,)waiting for name resolution(?:,|$)/;
const PARTIAL_WRITE = /^Write (?:error: |failed with error )/;
const RESET = [
  /^Connection dropped$/,
  /^(?:read|write) E[A-Z]+$/,
  /^Received RST_STREAM with code \d+/,
  /^Call cancelled$/,
  /^Bandwidth exhausted or memory limit exceeded$/,
  /^Protocol not secure enough$/,
  /^No status information received$/,
  /^Failed to start HTTP\/2 stream/,
];

function isEmpty(metadata: grpc.Metadata | undefined): boolean {
  return metadata === undefined || Object.keys(metadata.getMap()).length === 0;
}

/**
 * What a failed gRPC attempt proves; see the module table. `seen` is what
 * arrived before the status (the interceptors track it for you).
 */
export function classifyGrpcStatus(status: grpc.StatusObject, seen: AttemptSeen): GrpcOutcome {
  const details = status.details ?? '';
  const firstByteDelivered = seen.messagesDelivered > 0;
  const code = status.code;
  const madeUp =
    isEmpty(status.metadata) &&
    (NOT_CONNECTED.test(details) || REFUSED_STREAM.test(details) || DEADLINE.test(details) || PARTIAL_WRITE.test(details) || RESET.some((re) => re.test(details)));
  if (!madeUp) {
    const pushback = status.metadata?.get('grpc-retry-pushback-ms') ?? [];
    const outcome: GrpcOutcome = { evidence: 'RESPONSE_RECEIVED', grpcStatusCode: code, firstByteDelivered };
    if (pushback.length > 0) outcome.grpcRetryPushbackMs = String(pushback[0]);
    // A value that is not a layer name came from an upstream we do not control.
    const retried = String(status.metadata?.get(RETRIED_HEADER)[0] ?? '').trim();
    if (isLayerName(retried)) outcome.retriedBelow = retried;
    return outcome;
  }
  const nothingArrived = !seen.headers && seen.messagesDelivered === 0;
  if (nothingArrived && code === grpc.status.UNAVAILABLE && NOT_CONNECTED.test(details)) {
    return { evidence: 'NOT_SENT', failure: 'CONNECT', grpcStatusCode: code, firstByteDelivered };
  }
  if (nothingArrived && code === grpc.status.UNAVAILABLE && REFUSED_STREAM.test(details)) {
    return { evidence: 'NOT_SENT', failure: 'HTTP2_REFUSED_STREAM', grpcStatusCode: code, firstByteDelivered };
  }
  const isDeadline = code === grpc.status.DEADLINE_EXCEEDED && DEADLINE.test(details);
  // "previous attempts: N" means grpc-js's own retryPolicy ran attempts that
  // may have been sent: the latest one waiting for a pick proves nothing then.
  if (nothingArrived && isDeadline && !/previous attempts/.test(details)) {
    if (NEVER_RESOLVED.test(details)) return { evidence: 'NOT_SENT', failure: 'DNS', grpcStatusCode: code, firstByteDelivered };
    if (NEVER_PICKED.test(details)) return { evidence: 'NOT_SENT', failure: 'CONNECT', grpcStatusCode: code, firstByteDelivered };
  }
  if (seen.headers || firstByteDelivered) {
    return { evidence: 'PARTIAL_RESPONSE', failure: isDeadline ? 'INTERRUPTED_STREAM' : 'DECODE_RESET', grpcStatusCode: code, firstByteDelivered };
  }
  let failure: FailureKind = 'CONNECTION_RESET';
  if (isDeadline) failure = 'RESPONSE_HEADER_TIMEOUT';
  else if (PARTIAL_WRITE.test(details)) failure = 'PARTIAL_WRITE';
  return { evidence: 'SENT_NO_RESPONSE', failure, grpcStatusCode: code, firstByteDelivered };
}

/** Outcomes by the status's metadata object, which grpc-js puts on the ServiceError. */
const OUTCOMES = new WeakMap<object, GrpcOutcome>();

/** The outcome the interceptor classified for a failed call (pass its ServiceError). */
export function grpcOutcomeOf(error: unknown): GrpcOutcome | undefined {
  const metadata = (error as { metadata?: unknown } | null)?.metadata;
  return metadata !== null && typeof metadata === 'object' ? OUTCOMES.get(metadata) : undefined;
}

export interface GrpcRetryOptions {
  /** The upstream called (names the budget and policy in retryd). */
  upstream: string;
  /** Required: per method, by its path ("/inventory.v1.Stock/Reserve"), when the methods differ. */
  idempotency: Idempotency | number | ((path: string) => Idempotency | number);
  /** For audit; default the method path. */
  operation?: string;
  /** The caller's own attempt limit (the lower of this and the policy's applies). */
  maxAttempts?: number;
  /**
   * Where first attempts are counted, and every attempt's outcome
   * (FAILURE_CODES fail, any other ending succeeds, CANCELLED is neither):
   * default the client's reporter; false counts nothing.
   */
  reporter?: TrafficReporter | false;
  /**
   * Called before replaying after UNAUTHENTICATED when retryd says refresh,
   * with a copy of the call's metadata; may change it or return new metadata.
   * Without it, an UNAUTHENTICATED call is not replayed.
   */
  onRefreshCredentials?: (metadata: grpc.Metadata) => grpc.Metadata | void | Promise<grpc.Metadata | void>;
  /** Called with every failed attempt's outcome and its decision. */
  onAttempt?: (outcome: GrpcOutcome, decision: Decision) => void;
  /**
   * Ends an attempt that takes longer than this, in ms, so that a hung
   * attempt leaves time for the next one under the caller's deadline. Each
   * attempt's deadline is the earlier of this and the caller's; a timed-out
   * attempt is SENT_NO_RESPONSE (its request was sent), so retryd decides it
   * by its idempotency. Default: none (only the caller's deadline).
   */
  attemptTimeoutMs?: number;
  /** Called with retryd's answer to each hedge request of a call (./hedging). */
  onHedge?: (decision: Decision) => void;
}

/**
 * The codes that make an attempt a failure in the reporter's outcome counts:
 * those the retry tables can retry (UNAVAILABLE and DEADLINE_EXCEEDED as
 * 502-504 and "no response", RESOURCE_EXHAUSTED as 429, UNAUTHENTICATED as
 * 401, INTERNAL and UNKNOWN as 500), the twins of DEFAULT_RETRY_STATUSES.
 * Every other code is a success (the upstream answered, as a 404), except
 * CANCELLED: the caller's own, counted as neither.
 */
export const FAILURE_CODES: ReadonlySet<number> = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.DEADLINE_EXCEEDED,
  grpc.status.RESOURCE_EXHAUSTED,
  grpc.status.UNAUTHENTICATED,
  grpc.status.INTERNAL,
  grpc.status.UNKNOWN,
]);

/** How an attempt that ended with `code` counts: true a success, false a failure, undefined neither. */
export function attemptSucceeded(code: number): boolean | undefined {
  if (code === grpc.status.CANCELLED) return undefined;
  return !FAILURE_CODES.has(code);
}

/** Counts how an attempt ended; a first attempt's `elapsedMs` goes in the latency histograms. */
function recordAttempt(reporter: TrafficReporter | null, upstream: string, code: number, attempt: number, elapsedMs?: number): void {
  const success = attemptSucceeded(code);
  if (success === undefined) return;
  reporter?.recordOutcome(upstream, success, attempt > 1);
  if (attempt === 1 && elapsedMs !== undefined) reporter?.recordLatency(upstream, success, elapsedMs);
}

/** A backstop on attempts, far above any policy's max_attempts. */
const MAX_LOOP = 100;

function deadlineMsOf(deadline: grpc.Deadline | undefined): number {
  if (deadline === undefined) return Infinity;
  return deadline instanceof Date ? deadline.getTime() : Number(deadline);
}

/**
 * A listener that tracks what arrived and forwards it, one argument per
 * method (grpc-js tells an InterceptingListener by its arity).
 */
function observe(seen: AttemptSeen, downstream: grpc.InterceptingListener, onStatus: (status: grpc.StatusObject) => void): grpc.InterceptingListener {
  return {
    onReceiveMetadata(metadata) {
      seen.headers = true;
      downstream.onReceiveMetadata(metadata);
    },
    onReceiveMessage(message) {
      // grpc-js hands a unary call's listener null when no message came.
      if (message !== null && message !== undefined) seen.messagesDelivered++;
      downstream.onReceiveMessage(message);
    },
    onReceiveStatus(status) {
      onStatus(status);
    },
  };
}

/**
 * Classifies every failed call (no retryd, no retries): `onOutcome` gets the
 * outcome, and `grpcOutcomeOf(error)` finds it on the ServiceError. For your
 * own loop, or to log what happened.
 */
export function classifyingInterceptor(onOutcome?: (outcome: GrpcOutcome, status: grpc.StatusObject) => void): grpc.Interceptor {
  return classifying(onOutcome);
}

/** classifyingInterceptor, sending `lineage` (a streaming call's one attempt) when given. */
function classifying(
  onOutcome?: (outcome: GrpcOutcome, status: grpc.StatusObject) => void,
  lineage?: string,
  onEnd?: (status: grpc.StatusObject) => void,
): grpc.Interceptor {
  return (options, nextCall) => {
    const seen: AttemptSeen = { headers: false, messagesDelivered: 0 };
    return new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        next(
          lineage === undefined ? metadata : setLineage(metadata, lineage),
          observe(seen, listener, (status) => {
            onEnd?.(status);
            if (status.code !== grpc.status.OK) {
              const outcome = classifyGrpcStatus(status, seen);
              OUTCOMES.set(status.metadata, outcome);
              onOutcome?.(outcome, status);
            }
            listener.onReceiveStatus(status);
          }),
        );
      },
    });
  };
}

/**
 * Runs unary calls with retries as retryd decides (other methods are only
 * classified: a request stream cannot be replayed, and a response stream is
 * handed to the application as it arrives).
 *
 * Each failed attempt is classified (module table) and sent to retryd with
 * the remaining deadline; on RETRY the backoff is slept outside any call (no
 * stream held), then the same request message is sent again as a new call
 * under the caller's one deadline, which therefore bounds every attempt and
 * every backoff. The first attempt is counted as real traffic, and every
 * attempt's outcome on the same reporter (FAILURE_CODES). The caller
 * sees the last attempt's headers, message and status; `decisionOf(error)`
 * gives the last decision. When the call may have taken effect (AMBIGUOUS,
 * or a DENY with an `unknownOutcome` mark), the ServiceError carries an
 * AmbiguousExecutionError as `error.ambiguousExecution`
 * (`ambiguousExecutionOf(error)`). A caller's deadline that expires after
 * the request was sent is decided locally, without retryd. A cancel by the
 * caller ends the call at once, also during a backoff.
 */
export function retryingInterceptor(retryd: RetrydClient, settings: GrpcRetryOptions): grpc.Interceptor {
  return (options, nextCall) => {
    const method = options.method_definition;
    const reporter = settings.reporter === false ? null : (settings.reporter ?? retryd.reporter);
    // The request being served when the call is made, if an inbound wrapper
    // (./lineage) set it: grpc-js's callbacks later run outside it.
    const chain: ChainContext | undefined = currentChain();
    if (method.requestStream || method.responseStream) {
      // Real traffic all the same; only never retried.
      reporter?.record(settings.upstream);
      // Its one attempt's outcome too: a failure is one the local rule would be asked about.
      return classifying(undefined, outboundLineage(chain, retryd.layer, 1).outbound, (status) =>
        recordAttempt(reporter, settings.upstream, status.code, 1),
      )(options, nextCall);
    }
    const path = method.path;
    const idempotency = typeof settings.idempotency === 'function' ? settings.idempotency(path) : settings.idempotency;
    const deadlineAt = deadlineMsOf(options.deadline);
    const remaining = (): number | undefined => (deadlineAt === Infinity ? undefined : Math.max(0, deadlineAt - Date.now()));
    /** One attempt's call options: the caller's deadline, or the attempt timeout when it ends sooner. */
    const attemptOptions = (): { options: grpc.InterceptorOptions; callerDeadline: boolean } => {
      const attemptEnd = settings.attemptTimeoutMs === undefined ? Infinity : Date.now() + settings.attemptTimeoutMs;
      if (attemptEnd >= deadlineAt) return { options, callerDeadline: deadlineAt !== Infinity };
      return { options: { ...options, deadline: attemptEnd }, callerDeadline: false };
    };

    let downstream: grpc.InterceptingListener;
    let metadata: grpc.Metadata;
    let message: unknown;
    /** The attempt in flight (undefined for the first, which the InterceptingCall's own next() reaches). */
    let current: ReturnType<grpc.NextCall> | undefined;
    /** Whether an attempt is running; otherwise the call is deciding or backing off. */
    let inFlight = false;
    let backoffTimer: NodeJS.Timeout | undefined;
    let cancelled = false;
    let finished = false;
    let authRefreshAttempted = false;
    let previousBackoffMs: number | undefined;
    /** Whether retryd decided on an attempt of this call: a failure that ends it then is marked for the inbound middleware. */
    let decided = false;

    /** Hands one attempt's result to the application, once. */
    const finish = (status: grpc.StatusObject, headers?: grpc.Metadata, response?: unknown): void => {
      if (finished) return;
      finished = true;
      if (headers !== undefined) downstream.onReceiveMetadata(headers);
      if (response !== undefined) downstream.onReceiveMessage(response);
      downstream.onReceiveStatus(status);
    };

    /** A listener that holds the attempt's headers and message until its status says what to do. */
    const attemptListener = (attempt: number, callerDeadline: boolean): grpc.InterceptingListener => {
      const seen: AttemptSeen = { headers: false, messagesDelivered: 0 };
      const startedAt = performance.now();
      let headers: grpc.Metadata | undefined;
      let response: unknown;
      return {
        onReceiveMetadata(received) {
          seen.headers = true;
          headers = received;
        },
        onReceiveMessage(received) {
          if (received !== null && received !== undefined) response = received;
        },
        onReceiveStatus(status) {
          current = undefined;
          inFlight = false;
          // A call the caller cancelled counts as neither.
          if (!cancelled) recordAttempt(reporter, settings.upstream, status.code, attempt, performance.now() - startedAt);
          if (status.code === grpc.status.OK || cancelled) return finish(status, headers, response);
          failed(attempt, status, seen, callerDeadline, headers, response);
        },
      };
    };

    /** A failed (or non-OK) last attempt: retryd decides whether another follows. */
    const failed = (attempt: number, status: grpc.StatusObject, seen: AttemptSeen, callerDeadline: boolean, headers?: grpc.Metadata, response?: unknown): void => {
      const outcome = classifyGrpcStatus(status, seen);
      // grpc-js's own DEADLINE_EXCEEDED on an attempt that ran under the
      // caller's deadline: that deadline is over, whatever the clock says.
      const deadlineExpired = callerDeadline && outcome.evidence !== 'RESPONSE_RECEIVED' && status.code === grpc.status.DEADLINE_EXCEEDED;
      void afterFailure(attempt, status, outcome, deadlineExpired).then(
        (retry) => {
          if (retry) return;
          // Ended in failure after retryd's decision: the inbound
          // middleware says so upward, so the layer above does not retry.
          if (decided && !cancelled) recordRetriedFailure(chain, retryd.layer);
          finish(status, headers, response);
        },
        () => finish(status, headers, response),
      );
    };

    // ---------------------------------------------------------------- the hedged first round
    // (./hedging's design, on grpc-js's callbacks: copy 0 is the
    // InterceptingCall's own call, each hedge a call of its own.)
    const plan = retryd.hedging.plan(settings.upstream, idempotency);
    /** The copies of the first round still running: their calls (copy 0's is `firstCall`) and start times. */
    const running = new Map<number, { call: ReturnType<grpc.NextCall>; startedAt: number }>();
    let sent = 0;
    let hedging = plan !== undefined && plan.maxHedges >= 1;
    let hedgeTimer: NodeJS.Timeout | undefined;
    let roundOver = plan === undefined;

    /** Ends the round: the other copies are cancelled (a cancelled first attempt's time is a success latency). */
    const endRound = (): void => {
      roundOver = true;
      clearTimeout(hedgeTimer);
      const now = performance.now();
      for (const [copy, entry] of running) {
        if (copy === 0 && !cancelled) reporter?.recordLatency(settings.upstream, true, now - entry.startedAt);
        entry.call.cancelWithStatus(grpc.status.CANCELLED, 'a hedge of this call answered first');
      }
      running.clear();
    };

    const copyListener = (copy: number, callerDeadline: boolean): grpc.InterceptingListener => {
      const seen: AttemptSeen = { headers: false, messagesDelivered: 0 };
      let headers: grpc.Metadata | undefined;
      let response: unknown;
      return {
        onReceiveMetadata(received) {
          seen.headers = true;
          headers = received;
        },
        onReceiveMessage(received) {
          if (received !== null && received !== undefined) response = received;
        },
        onReceiveStatus(status) {
          const entry = running.get(copy);
          if (entry === undefined) return; // a loser this round cancelled
          running.delete(copy);
          if (cancelled) {
            endRound();
            return finish(status, headers, response);
          }
          const success = attemptSucceeded(status.code);
          recordAttempt(reporter, settings.upstream, status.code, copy + 1, copy === 0 ? performance.now() - entry.startedAt : undefined);
          // The first answer that is not a retryable failure wins; when every
          // copy failed, the normal path decides about the last one.
          if (success !== false || running.size === 0) {
            // Only the caller knows which copy answered: retryd counts hedges won from this.
            if (copy > 0 && success !== false) reporter?.recordHedgeWon(settings.upstream);
            endRound();
            inFlight = false;
            if (status.code === grpc.status.OK) return finish(status, headers, response);
            failed(sent, status, seen, callerDeadline, headers, response);
          }
        },
      };
    };

    const armHedge = (): void => {
      if (hedging && !roundOver) hedgeTimer = setTimeout(fireHedge, plan!.delayMs);
    };

    /** The hedge timer fired with every copy still running: only now is retryd asked. */
    const fireHedge = (): void => {
      hedgeTimer = undefined;
      const left = remaining();
      if (roundOver || running.size === 0 || message === undefined || (left !== undefined && left <= 0)) return;
      const hedge = sent;
      retryd
        .decideHedge({
          upstream: settings.upstream,
          idempotency,
          hedge,
          attempt: sent,
          operation: settings.operation ?? path,
          deadlineRemainingMs: left,
          body: { kind: 'ENCODED_VALUE' },
          lineage: outboundLineage(chain, retryd.layer, 1).inbound,
        })
        .then(
          (decision) => {
            settings.onHedge?.(decision);
            if (decision.verdict !== 'RETRY' || roundOver || running.size === 0 || cancelled) {
              hedging = false;
              return;
            }
            startCopy();
            hedging = sent <= plan!.maxHedges;
            armHedge();
          },
          // retryd refused or could not answer, and no local hedging decided:
          // the call goes on unhedged.
          () => {
            hedging = false;
          },
        );
    };

    /** Sends the next hedge of the first round. */
    const startCopy = (): void => {
      const copy = sent++;
      const next = attemptOptions();
      const call = nextCall(next.options);
      running.set(copy, { call, startedAt: performance.now() });
      const lineage = outboundLineage(chain, retryd.layer, copy + 1).outbound;
      withBaggageEntry(LINEAGE_BAGGAGE_KEY, lineage, () => call.start(setLineage(metadata.clone(), lineage), copyListener(copy, next.callerDeadline)));
      call.sendMessage(message);
      call.halfClose();
      call.startRead();
    };

    /** Asks retryd; resolves true when a next attempt was scheduled. */
    const afterFailure = async (attempt: number, status: grpc.StatusObject, outcome: GrpcOutcome, deadlineExpired: boolean): Promise<boolean> => {
      OUTCOMES.set(status.metadata, outcome);
      let decision: Decision;
      try {
        decision = await retryd.decide({
          upstream: settings.upstream,
          operation: settings.operation ?? path,
          idempotency,
          attempt,
          // A unary request is one message and a deterministic codec.
          body: { kind: 'ENCODED_VALUE' },
          // Nothing left: RetrydClient.decide answers locally, at once (for a
          // NON_IDEMPOTENT call, an ambiguous execution).
          deadlineRemainingMs: deadlineExpired ? 0 : remaining(),
          authRefreshAttempted,
          previousBackoffMs,
          maxAttempts: settings.maxAttempts,
          lineage: outboundLineage(chain, retryd.layer, attempt).inbound,
          ...outcome,
        });
      } catch {
        // retryd refused the question (fallback off, or a bad request): no
        // decision, so no retry; the caller gets the call's own status.
        return false;
      }
      decided = true;
      attachDecision(status.metadata, decision);
      if (leavesOutcomeUnknown(decision)) {
        // grpc-js builds the caller's ServiceError by copying the status's
        // own properties, so this reaches it as `error.ambiguousExecution`.
        Object.assign(status, { ambiguousExecution: new AmbiguousExecutionError(decision, undefined, { cause: status }) });
      }
      settings.onAttempt?.(outcome, decision);
      if (decision.verdict !== 'RETRY' || attempt >= MAX_LOOP || cancelled) return false;
      if (decision.refreshCredentials) {
        if (settings.onRefreshCredentials === undefined) return false;
        const copy = metadata.clone();
        metadata = (await settings.onRefreshCredentials(copy)) ?? copy;
        authRefreshAttempted = true;
      }
      previousBackoffMs = decision.backoffMs || undefined;
      const waitMs = Math.min(decision.backoffMs, remaining() ?? Infinity);
      await new Promise<void>((resolve) => {
        backoffTimer = setTimeout(resolve, waitMs);
      });
      backoffTimer = undefined;
      if (cancelled) return false;
      // No time left for another attempt: the last failure is the answer.
      if (remaining() === 0) return false;
      startAttempt(attempt + 1);
      return true;
    };

    const startAttempt = (attempt: number): void => {
      const next = attemptOptions();
      const call = nextCall(next.options);
      current = call;
      inFlight = true;
      const lineage = outboundLineage(chain, retryd.layer, attempt).outbound;
      withBaggageEntry(LINEAGE_BAGGAGE_KEY, lineage, () => call.start(setLineage(metadata.clone(), lineage), attemptListener(attempt, next.callerDeadline)));
      call.sendMessage(message);
      call.halfClose();
      call.startRead();
    };

    const first = attemptOptions();
    const firstCall = nextCall(first.options);
    return new grpc.InterceptingCall(firstCall, {
      start(received, listener, next) {
        downstream = listener;
        metadata = received.clone(); // kept for replays; the first attempt sends the original
        reporter?.record(settings.upstream);
        retryd.hedging.firstAttempt();
        current = undefined;
        inFlight = true;
        const lineage = outboundLineage(chain, retryd.layer, 1).outbound;
        if (plan !== undefined) {
          running.set(0, { call: firstCall, startedAt: performance.now() });
          sent = 1;
          withBaggageEntry(LINEAGE_BAGGAGE_KEY, lineage, () => next(setLineage(received, lineage), copyListener(0, first.callerDeadline)));
          armHedge();
          return;
        }
        withBaggageEntry(LINEAGE_BAGGAGE_KEY, lineage, () => next(setLineage(received, lineage), attemptListener(1, first.callerDeadline)));
      },
      sendMessage(received, next) {
        message = received;
        next(received);
      },
      cancel(next) {
        cancelled = true;
        next();
        if (!roundOver) {
          // The first round's hedges go with it; the first status to come back is handed on.
          clearTimeout(hedgeTimer);
          for (const [copy, entry] of running) if (copy > 0) entry.call.cancelWithStatus(grpc.status.CANCELLED, 'Cancelled on client');
          return;
        }
        if (inFlight) {
          // The attempt ends with CANCELLED, which is handed on as it is.
          current?.cancelWithStatus(grpc.status.CANCELLED, 'Cancelled on client');
          return;
        }
        // Waiting for retryd or for the backoff: nothing to cancel but the wait.
        clearTimeout(backoffTimer);
        backoffTimer = undefined;
        finish({ code: grpc.status.CANCELLED, details: 'Cancelled on client', metadata: new grpc.Metadata() });
      },
    });
  };
}
