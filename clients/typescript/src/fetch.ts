/**
 * fetch (undici) adapter: honest evidence from fetch outcomes, and
 * retryd-governed retries.
 *
 * Node's fetch rejects with `TypeError: fetch failed` whose `cause` carries the
 * undici or system error code. What each code proves:
 *
 * | code (on the error or its causes)                         | evidence          | failure                 |
 * |-----------------------------------------------------------|-------------------|-------------------------|
 * | ENOTFOUND, EAI_AGAIN, EAI_NONAME, EAI_FAIL, EAI_NODATA     | NOT_SENT          | DNS                     |
 * | ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENETDOWN,         | NOT_SENT          | CONNECT                 |
 * |   EADDRNOTAVAIL, UND_ERR_CONNECT_TIMEOUT, any error of the |                   |                         |
 * |   `connect` syscall                                        |                   |                         |
 * | certificate errors (CERT_*, *_SELF_SIGNED_*,               | NOT_SENT          | TLS_CERTIFICATE_INVALID |
 * |   UNABLE_TO_VERIFY_LEAF_SIGNATURE, ERR_TLS_CERT_ALTNAME_…) |                   |                         |
 * | other TLS errors (ERR_SSL_*, ERR_TLS_*, EPROTO)            | NOT_SENT          | PRE_REQUEST_TLS         |
 * | a TypeError other than "fetch failed": thrown while the    | SENT_NO_RESPONSE  | REQUEST_ENCODING        |
 * |   Request was built (invalid URL, header, method, body),   |  (never left; the |  (permanent)            |
 * |   before any connection                                    |  kind can't prove |                         |
 * |                                                            |  it, so no claim) |                         |
 * | unknown scheme, UND_ERR_INVALID_ARG, UND_ERR_NOT_SUPPORTED | NOT_SENT          | PROFILE_REJECTION       |
 * | HTTP/2 REFUSED_STREAM                                      | NOT_SENT          | HTTP2_REFUSED_STREAM    |
 * | EPIPE                                                      | SENT_NO_RESPONSE  | PARTIAL_WRITE           |
 * | UND_ERR_HEADERS_TIMEOUT, our attempt timeout before headers| SENT_NO_RESPONSE  | RESPONSE_HEADER_TIMEOUT |
 * | ECONNRESET, UND_ERR_SOCKET ("other side closed")           | SENT_NO_RESPONSE  | CONNECTION_RESET        |
 * | UND_ERR_REQ_CONTENT_LENGTH_MISMATCH                        | SENT_NO_RESPONSE  | REQUEST_ENCODING        |
 * | anything else                                              | SENT_NO_RESPONSE  | GENERIC_IO              |
 * | while reading the body: UND_ERR_BODY_TIMEOUT, a timeout    | PARTIAL_RESPONSE  | INTERRUPTED_STREAM      |
 * | while reading the body: a reset or close                   | PARTIAL_RESPONSE  | DECODE_RESET            |
 * | a response                                                 | RESPONSE_RECEIVED | (status, Retry-After)   |
 *
 * A headers timeout never proves NOT_SENT: the request was written and the
 * upstream may be executing it.
 *
 * fetchWithRetries() builds the Request itself, so that anything the
 * Request constructor refuses is known never to have left (a request-encoding
 * failure: permanent, nothing retried, no budget spent). It sends the
 * request, asks retryd after each failure, cancels the failed response's
 * body (releasing its connection) and only then waits the backoff, so no
 * connection is held while waiting. The caller's deadline bounds every
 * attempt (headers and body) and every backoff; when it ends an attempt
 * after the request was sent, the decision is the local rule's, at once
 * (for a NON_IDEMPOTENT call: AmbiguousExecutionError).
 *
 * Node's fetch (undici) re-sends nothing by itself, on a fresh or a pooled
 * connection (test/outcome.test.ts counts the reads), so every request that
 * reaches the upstream is an attempt that was decided or the first one.
 */
import type { RetrydClient } from './client';
import { AmbiguousExecutionError, attachDecision, leavesOutcomeUnknown } from './errors';
import { currentChain, isLayerName, LINEAGE_BAGGAGE_KEY, outboundLineage, recordRetriedFailure, RETRIED_HEADER, withLineageBaggage } from './lineage';
import type { TrafficReporter } from './reporter';
import { withBaggageEntry } from './tracing';
import { runHedged } from './hedging';
import { replayabilityOf, type Body, type Decision, type Evidence, type FailureKind, type Idempotency } from './types';

/** What happened to one attempt, in retryd's terms. */
export interface Outcome {
  evidence: Evidence;
  failure?: FailureKind;
  httpStatus?: number;
  retryAfter?: string | null;
  /** The response's `retryd-retried` header, when it names a layer: a layer below already retried this failure. */
  retriedBelow?: string;
}

/** The `retryd-retried` header of a response, if it is a valid layer name (else it came from an upstream we do not control). */
function retriedBelowOf(response: Response): { retriedBelow?: string } {
  const value = response.headers.get(RETRIED_HEADER)?.trim();
  return isLayerName(value) ? { retriedBelow: value } : {};
}

/** Statuses worth asking retryd about; any other response is returned as is. */
export const DEFAULT_RETRY_STATUSES: ReadonlySet<number> = new Set([401, 408, 425, 429, 500, 502, 503, 504]);

const DNS = new Set(['ENOTFOUND', 'EAI_AGAIN', 'EAI_NONAME', 'EAI_FAIL', 'EAI_NODATA']);
const CONNECT = new Set([
  'ECONNREFUSED',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENETDOWN',
  'EHOSTDOWN',
  'EADDRNOTAVAIL',
  'UND_ERR_CONNECT_TIMEOUT',
]);
const CERTIFICATE = new Set([
  'CERT_HAS_EXPIRED',
  'CERT_NOT_YET_VALID',
  'CERT_REVOKED',
  'CERT_UNTRUSTED',
  'CERT_REJECTED',
  'CERT_SIGNATURE_FAILURE',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'ERR_TLS_CERT_ALTNAME_INVALID',
  'HOSTNAME_MISMATCH',
]);
const PROFILE = new Set(['UND_ERR_INVALID_ARG', 'UND_ERR_NOT_SUPPORTED', 'ERR_INVALID_URL', 'ERR_INVALID_URL_SCHEME']);
const RESET = new Set(['ECONNRESET', 'UND_ERR_SOCKET', 'ECONNABORTED']);

interface Facts {
  codes: Set<string>;
  syscalls: Set<string>;
  names: Set<string>;
  text: string;
}

/** Every code, syscall, name and message on an error, its causes and aggregated errors. */
function facts(error: unknown): Facts {
  const found: Facts = { codes: new Set(), syscalls: new Set(), names: new Set(), text: '' };
  const seen = new Set<unknown>();
  const visit = (value: unknown, depth: number): void => {
    if (value === null || typeof value !== 'object' || seen.has(value) || depth > 8) return;
    seen.add(value);
    const record = value as { code?: unknown; syscall?: unknown; name?: unknown; message?: unknown; cause?: unknown; errors?: unknown };
    if (typeof record.code === 'string') found.codes.add(record.code);
    if (typeof record.syscall === 'string') found.syscalls.add(record.syscall);
    if (typeof record.name === 'string') found.names.add(record.name);
    if (typeof record.message === 'string') found.text += ` ${record.message}`;
    visit(record.cause, depth + 1);
    if (Array.isArray(record.errors)) for (const inner of record.errors) visit(inner, depth + 1);
  };
  visit(error, 0);
  return found;
}

const some = (codes: Set<string>, test: (code: string) => boolean): boolean => [...codes].some(test);

/**
 * What a fetch rejection proves; see the module table. Pass `response` when
 * the error came while reading the body of a response whose headers arrived.
 */
export function classifyFetchError(error: unknown, response?: Response): Outcome {
  if (response === undefined && isBuildError(error)) return REQUEST_ENCODING;
  const { codes, syscalls, names, text } = facts(error);
  const timedOut = codes.has('UND_ERR_BODY_TIMEOUT') || codes.has('UND_ERR_HEADERS_TIMEOUT') || names.has('TimeoutError');
  if (response !== undefined) {
    let failure: FailureKind = 'GENERIC_IO';
    if (timedOut) failure = 'INTERRUPTED_STREAM';
    else if (some(codes, (code) => RESET.has(code)) || /terminated|other side closed/i.test(text)) failure = 'DECODE_RESET';
    return {
      evidence: 'PARTIAL_RESPONSE',
      failure,
      httpStatus: response.status,
      retryAfter: response.headers.get('retry-after'),
      ...retriedBelowOf(response),
    };
  }
  if (some(codes, (code) => DNS.has(code))) return { evidence: 'NOT_SENT', failure: 'DNS' };
  if (some(codes, (code) => CONNECT.has(code)) || syscalls.has('connect')) return { evidence: 'NOT_SENT', failure: 'CONNECT' };
  if (some(codes, (code) => CERTIFICATE.has(code))) return { evidence: 'NOT_SENT', failure: 'TLS_CERTIFICATE_INVALID' };
  if (some(codes, (code) => code.startsWith('ERR_SSL_') || code.startsWith('ERR_TLS_') || code === 'EPROTO')) {
    return { evidence: 'NOT_SENT', failure: 'PRE_REQUEST_TLS' };
  }
  if (some(codes, (code) => PROFILE.has(code)) || /unknown scheme/i.test(text)) {
    return { evidence: 'NOT_SENT', failure: 'PROFILE_REJECTION' };
  }
  if (/REFUSED_STREAM/.test(text)) return { evidence: 'NOT_SENT', failure: 'HTTP2_REFUSED_STREAM' };
  if (codes.has('EPIPE')) return { evidence: 'SENT_NO_RESPONSE', failure: 'PARTIAL_WRITE' };
  if (timedOut) return { evidence: 'SENT_NO_RESPONSE', failure: 'RESPONSE_HEADER_TIMEOUT' };
  if (some(codes, (code) => RESET.has(code)) || /other side closed/i.test(text)) {
    return { evidence: 'SENT_NO_RESPONSE', failure: 'CONNECTION_RESET' };
  }
  if (codes.has('UND_ERR_REQ_CONTENT_LENGTH_MISMATCH')) return { evidence: 'SENT_NO_RESPONSE', failure: 'REQUEST_ENCODING' };
  return { evidence: 'SENT_NO_RESPONSE', failure: 'GENERIC_IO' };
}

/**
 * What a Request that could not even be built proves. It never left, but
 * FAILURE_KIND_REQUEST_ENCODING cannot support a NOT_SENT claim (a streamed
 * body can fail after its headers were sent), so none is made; the kind is
 * permanent, so retryd denies at rule 7 and spends nothing.
 */
const REQUEST_ENCODING: Outcome = Object.freeze({ evidence: 'SENT_NO_RESPONSE', failure: 'REQUEST_ENCODING' });

/**
 * Whether fetch rejected before any network activity: undici wraps every
 * network error as TypeError("fetch failed"), while the Request constructor
 * (invalid URL, header name or value, method, a GET with a body, a stream
 * without `duplex`) throws its own TypeError first. The messages browsers
 * use for network errors are excluded, for fetch implementations like theirs.
 */
function isBuildError(error: unknown): boolean {
  return error instanceof TypeError && !/fetch failed|failed to fetch|networkerror|load failed/i.test(error.message);
}

/** A response that arrived: its status and Retry-After. */
export function classifyResponse(response: Response): Outcome {
  return {
    evidence: 'RESPONSE_RECEIVED',
    httpStatus: response.status,
    retryAfter: response.headers.get('retry-after'),
    ...retriedBelowOf(response),
  };
}

/**
 * The replayability of a fetch body: strings, buffers and Blobs are BYTES;
 * URLSearchParams an ENCODED_VALUE; FormData a MULTIPART of BYTES parts; a
 * ReadableStream or an async iterable an INPUT_STREAM (fetch cannot resend it).
 */
export function bodyOf(body: unknown): Body | undefined {
  if (body === undefined || body === null) return undefined;
  if (typeof body === 'string' || body instanceof ArrayBuffer || ArrayBuffer.isView(body) || body instanceof Blob) {
    return { kind: 'BYTES' };
  }
  if (body instanceof URLSearchParams) return { kind: 'ENCODED_VALUE' };
  if (body instanceof FormData) {
    const parts: Body[] = [];
    body.forEach(() => parts.push({ kind: 'BYTES' }));
    return parts.length === 0 ? { kind: 'BYTES' } : { kind: 'MULTIPART', parts };
  }
  return { kind: 'INPUT_STREAM' };
}

export interface FetchRetryOptions {
  /** The upstream called (names the budget and policy in retryd). */
  upstream: string;
  /** Required: the method alone never decides. */
  idempotency: Idempotency | number;
  /** For audit; default "<METHOD> <path>". */
  operation?: string;
  /** Overrides the replayability derived from init.body. */
  body?: Body;
  /**
   * The whole call's deadline in ms: every attempt (headers and body) is
   * aborted when it runs out, every backoff ends by then, and what remains is
   * passed to retryd with each decision.
   */
  deadlineMs?: number;
  /** The caller's own attempt limit (the lower of this and the policy's applies). */
  maxAttempts?: number;
  /** Statuses to ask retryd about (default DEFAULT_RETRY_STATUSES). */
  retryStatuses?: ReadonlySet<number>;
  /**
   * Abort an attempt (headers and body) that takes longer than this, in ms.
   * A response that is returned was read whole within it and stays readable.
   */
  attemptTimeoutMs?: number;
  /**
   * Where the first attempt (only) is counted as real traffic, and every
   * attempt's outcome (a failure when retryd is asked about it, a success
   * otherwise, a 404 included): by default the client's own reporter
   * (`retryd.reporter`); false counts nothing.
   */
  reporter?: TrafficReporter | false;
  /** Called before replaying after a 401 when retryd says refresh; may return a new init (e.g. new headers). */
  onRefreshCredentials?: (init: RequestInit) => RequestInit | void | Promise<RequestInit | void>;
  /** The fetch to use (default globalThis.fetch). */
  fetch?: typeof fetch;
  /** How to wait the backoff (default a timer, ended early by an abort of init.signal). */
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
}

const MAX_LOOP = 100;

/** How one attempt ended: `final` for a response returned as is (not a retryable failure). */
interface Attempted {
  final: boolean;
  response: Response | undefined;
  failure: unknown;
  outcome: Outcome | undefined;
  deadlineExpired: boolean;
  elapsedMs: number;
}

const HEDGES = new WeakMap<object, readonly Decision[]>();

/** retryd's answers to the hedge requests of the call that returned `response` (empty: no hedge timer fired). */
export function hedgesOf(response: Response): readonly Decision[] {
  return HEDGES.get(response) ?? [];
}
/** A timer that an abort of the caller's signal ends early (the next attempt then rethrows the abort). */
const defaultSleep = (ms: number, signal?: AbortSignal): Promise<void> =>
  new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
    function done(): void {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    }
  });

function operationOf(input: string | URL | Request, init: RequestInit): string {
  const method = (init.method ?? (input instanceof Request ? input.method : 'GET')).toUpperCase();
  const url = input instanceof Request ? input.url : String(input);
  try {
    return `${method} ${new URL(url).pathname}`;
  } catch {
    return method;
  }
}

/**
 * fetch with retries as retryd decides.
 *
 * Resolves to the final response when it succeeds, when its status is not in
 * `retryStatuses`, or when retryd denies retrying it (its body is still
 * readable). Rejects with the last fetch error when retryd denies retrying
 * it, and with AmbiguousExecutionError when retryd answers AMBIGUOUS or
 * denies with an `unknownOutcome` mark (the request may have taken effect;
 * the error says `denyReason` and `resendWithSameKey`). An
 * abort through `init.signal` is rethrown at once. `decisionOf(response)` or
 * `decisionOf(error)` gives the last decision (undefined when no attempt
 * failed); errors also carry it as `error.retrydDecision`.
 */
export async function fetchWithRetries(
  retryd: RetrydClient,
  input: string | URL | Request,
  init: RequestInit = {},
  options: FetchRetryOptions,
): Promise<Response> {
  const fetchImpl = options.fetch ?? globalThis.fetch;
  const sleep = options.sleep ?? defaultSleep;
  const retryStatuses = options.retryStatuses ?? DEFAULT_RETRY_STATUSES;
  const reporter = options.reporter === false ? null : (options.reporter ?? retryd.reporter);
  const body = options.body ?? (input instanceof Request && input.body !== null ? { kind: 'BYTES' } : bodyOf(init.body));
  const operation = options.operation ?? operationOf(input, init);
  const deadlineAt = options.deadlineMs === undefined ? undefined : performance.now() + options.deadlineMs;
  const remaining = (): number | undefined => (deadlineAt === undefined ? undefined : Math.max(0, deadlineAt - performance.now()));
  let currentInit = init;
  let previousBackoffMs: number | undefined;
  let authRefreshAttempted = false;
  let decision: Decision | undefined;
  // The request being served, if an inbound wrapper (./lineage) set it.
  const chain = currentChain();
  /** retryd's answers to this call's hedge requests (HEDGES on the response). */
  const hedgeDecisions: Decision[] = [];
  const settle = (response: Response): Response => {
    if (decision !== undefined) attachDecision(response, decision);
    HEDGES.set(response, hedgeDecisions);
    return response;
  };

  /** One attempt, its body read whole; `cancel` aborts it when a hedge of it wins. Rethrows the caller's abort. */
  const sendAttempt = async (attempt: number, cancel?: AbortSignal): Promise<Attempted> => {
    const userSignal = currentInit.signal ?? undefined;
    // One timer per attempt, for the attempt timeout and the deadline alike,
    // cleared once the body has been read: a returned response must not be
    // aborted later (undici errors a body whose signal fires, even a
    // buffered one).
    // Read once: a second read of the clock is later, and never equals the
    // limit taken from the first (which once made a deadline that fired look
    // like an attempt timeout, with a moment left to ask retryd in).
    const left = remaining();
    const limits = [options.attemptTimeoutMs, left].filter((ms): ms is number => ms !== undefined);
    const attemptLimitMs = limits.length === 0 ? undefined : Math.min(...limits);
    const attemptController = new AbortController();
    // Whether the timer that fires is the caller's deadline rather than the
    // attempt timeout: then nothing is left to ask retryd with.
    const limitIsDeadline = left !== undefined && attemptLimitMs === left;
    let deadlineExpired = false;
    const timer =
      attemptLimitMs === undefined
        ? undefined
        : setTimeout(() => {
            deadlineExpired = limitIsDeadline;
            attemptController.abort(new DOMException(`the attempt ran out of time (${Math.round(attemptLimitMs)} ms)`, 'TimeoutError'));
          }, attemptLimitMs);
    const signals = [userSignal, cancel, attemptController.signal].filter((one): one is AbortSignal => one !== undefined);
    const signal = signals.length === 1 ? attemptController.signal : AbortSignal.any(signals);
    const startedAt = performance.now();
    // Rethrown: the caller's abort ends the call, and a hedge's win ends this copy.
    const abandoned = (): boolean => userSignal?.aborted === true || cancel?.aborted === true;

    let response: Response | undefined;
    let failure: unknown;
    let outcome: Outcome | undefined;
    const lineage = outboundLineage(chain, retryd.layer, attempt);
    try {
      let request: Request | undefined;
      try {
        request = new Request(input instanceof Request ? input.clone() : input, { ...currentInit, signal });
      } catch (error) {
        // Refused while building the request: it never left this process.
        failure = error;
        outcome = REQUEST_ENCODING;
      }
      if (request !== undefined) {
        // This attempt's place in the chain; the request's other baggage
        // members are kept. Through OpenTelemetry's baggage as well, so that
        // an instrumentation that injects it (replacing the header) sends it.
        request.headers.set('baggage', withLineageBaggage(request.headers.get('baggage'), lineage.outbound));
        const sending = request;
        try {
          response = await withBaggageEntry(LINEAGE_BAGGAGE_KEY, lineage.outbound, () => fetchImpl(sending));
        } catch (error) {
          if (abandoned()) throw error;
          failure = error;
          outcome = classifyFetchError(error);
        }
      }
      if (response !== undefined) {
        try {
          // Read the whole body (through a clone, so the response stays readable).
          await response.clone().arrayBuffer();
          if (!retryStatuses.has(response.status)) {
            return { final: true, response, failure, outcome: undefined, deadlineExpired, elapsedMs: performance.now() - startedAt };
          }
          outcome = classifyResponse(response);
        } catch (error) {
          if (abandoned()) throw error;
          failure = error;
          outcome = classifyFetchError(error, response);
        }
      }
    } finally {
      clearTimeout(timer);
    }
    return { final: false, response, failure, outcome, deadlineExpired, elapsedMs: performance.now() - startedAt };
  };

  const table = retryd.hedging;
  // A one-shot body (a stream) is never hedged: a copy could not be sent.
  const plan = body !== undefined && replayabilityOf(body) === 'ONE_SHOT' ? undefined : table.plan(options.upstream, options.idempotency);
  let attempt = 0;
  for (;;) {
    let attempted: Attempted;
    if (attempt === 0) {
      reporter?.record(options.upstream);
      table.firstAttempt();
    }
    if (attempt === 0 && plan !== undefined) {
      // The first attempt and its hedges; every copy that answered is counted here.
      const round = await runHedged<Attempted>({
        plan,
        startCopy: (copy, cancel) => sendAttempt(copy + 1, cancel),
        isFinal: (result) => result.final,
        ask: (hedge) =>
          retryd.decideHedge({
            upstream: options.upstream,
            idempotency: options.idempotency,
            hedge,
            attempt: hedge,
            operation,
            deadlineRemainingMs: remaining(),
            ...(body === undefined ? {} : { body }),
            lineage: outboundLineage(chain, retryd.layer, 1).inbound,
          }),
        onEnd: (copy, result, elapsedMs) => {
          reporter?.recordOutcome(options.upstream, result.final, copy > 0);
          if (copy === 0) reporter?.recordLatency(options.upstream, result.final, elapsedMs);
        },
        onFirstCancelled: (elapsedMs) => reporter?.recordLatency(options.upstream, true, elapsedMs),
        remaining,
      });
      hedgeDecisions.push(...round.decisions);
      // Only the caller knows which copy answered: retryd counts hedges won from this.
      if (round.copy > 0 && round.result.final) reporter?.recordHedgeWon(options.upstream);
      attempt = round.sent;
      attempted = round.result;
    } else {
      attempt += 1;
      attempted = await sendAttempt(attempt);
      reporter?.recordOutcome(options.upstream, attempted.final, attempt > 1);
      if (attempt === 1) reporter?.recordLatency(options.upstream, attempted.final, attempted.elapsedMs);
    }
    const { response, failure, outcome, deadlineExpired } = attempted;
    if (attempted.final) return settle(response!);
    const lineage = outboundLineage(chain, retryd.layer, attempt);

    // A failed attempt was counted in the reporter's outcome counts above
    // (an abort by the caller was rethrown, counted as neither).
    decision = await retryd.decide({
      upstream: options.upstream,
      idempotency: options.idempotency,
      attempt,
      operation,
      body,
      // A deadline that expired after the request was sent is decided
      // locally (RetrydClient.decide with nothing left): for a
      // NON_IDEMPOTENT call, an ambiguous execution.
      deadlineRemainingMs: deadlineExpired ? 0 : remaining(),
      authRefreshAttempted,
      previousBackoffMs,
      maxAttempts: options.maxAttempts,
      lineage: lineage.inbound,
      ...outcome!,
    });
    // AMBIGUOUS, or a DENY that says the request may have taken effect: never
    // the plain failure, which would claim it did not happen.
    // A request the Request constructor refused is known never to have left
    // (its failure kind cannot prove NOT_SENT to retryd, so retryd marks it).
    if (leavesOutcomeUnknown(decision) && outcome !== REQUEST_ENCODING) {
      recordRetriedFailure(chain, retryd.layer);
      const ambiguous = new AmbiguousExecutionError(decision, response, { cause: failure });
      attachDecision(ambiguous, decision);
      throw ambiguous;
    }
    let retry = decision.verdict === 'RETRY' && attempt < MAX_LOOP;
    if (retry && decision.refreshCredentials) {
      if (options.onRefreshCredentials === undefined) retry = false;
      else currentInit = (await options.onRefreshCredentials(currentInit)) ?? currentInit;
    }
    if (!retry) {
      // The call ends in failure after retryd's decision: the inbound
      // middleware says so upward, so that the layer above does not retry it.
      recordRetriedFailure(chain, retryd.layer);
      if (response !== undefined && failure === undefined) return settle(response);
      attachDecision(failure, decision);
      throw failure;
    }
    if (decision.refreshCredentials) authRefreshAttempted = true;
    // Release the connection before waiting.
    await response?.body?.cancel().catch(() => undefined);
    previousBackoffMs = decision.backoffMs || undefined;
    // retryd already fits the backoff into the deadline; the local clamp
    // covers a clock that moved on while the decision travelled.
    const backoffMs = Math.min(decision.backoffMs, remaining() ?? Infinity);
    if (backoffMs > 0) await sleep(backoffMs, currentInit.signal ?? undefined);
    if (currentInit.signal?.aborted) throw currentInit.signal.reason;
  }
}
