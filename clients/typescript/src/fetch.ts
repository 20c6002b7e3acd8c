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
 * | unknown scheme, invalid URL, UND_ERR_INVALID_ARG,          | NOT_SENT          | PROFILE_REJECTION       |
 * |   UND_ERR_NOT_SUPPORTED                                    |                   |                         |
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
 * fetchWithRetries() sends a request, asks retryd after each failure, cancels
 * the failed response's body (releasing its connection) and only then waits
 * the backoff, so no connection is held while waiting.
 */
import type { RetrydClient } from './client';
import { AmbiguousExecutionError } from './errors';
import type { TrafficReporter } from './reporter';
import type { Body, Decision, Evidence, FailureKind, Idempotency } from './types';

/** What happened to one attempt, in retryd's terms. */
export interface Outcome {
  evidence: Evidence;
  failure?: FailureKind;
  httpStatus?: number;
  retryAfter?: string | null;
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
    };
  }
  if (some(codes, (code) => DNS.has(code))) return { evidence: 'NOT_SENT', failure: 'DNS' };
  if (some(codes, (code) => CONNECT.has(code)) || syscalls.has('connect')) return { evidence: 'NOT_SENT', failure: 'CONNECT' };
  if (some(codes, (code) => CERTIFICATE.has(code))) return { evidence: 'NOT_SENT', failure: 'TLS_CERTIFICATE_INVALID' };
  if (some(codes, (code) => code.startsWith('ERR_SSL_') || code.startsWith('ERR_TLS_') || code === 'EPROTO')) {
    return { evidence: 'NOT_SENT', failure: 'PRE_REQUEST_TLS' };
  }
  if (some(codes, (code) => PROFILE.has(code)) || /unknown scheme|invalid url|failed to parse url/i.test(text)) {
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

/** A response that arrived: its status and Retry-After. */
export function classifyResponse(response: Response): Outcome {
  return { evidence: 'RESPONSE_RECEIVED', httpStatus: response.status, retryAfter: response.headers.get('retry-after') };
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
  /** The whole call's deadline in ms, retries and backoffs included. */
  deadlineMs?: number;
  /** The caller's own attempt limit (the lower of this and the policy's applies). */
  maxAttempts?: number;
  /** Statuses to ask retryd about (default DEFAULT_RETRY_STATUSES). */
  retryStatuses?: ReadonlySet<number>;
  /** Abort an attempt (headers and body) that takes longer than this, in ms. */
  attemptTimeoutMs?: number;
  /** Counts the first attempt (only) as real traffic. */
  reporter?: TrafficReporter;
  /** Called before replaying after a 401 when retryd says refresh; may return a new init (e.g. new headers). */
  onRefreshCredentials?: (init: RequestInit) => RequestInit | void | Promise<RequestInit | void>;
  /** The fetch to use (default globalThis.fetch). */
  fetch?: typeof fetch;
  /** How to wait the backoff (default a timer). */
  sleep?: (ms: number) => Promise<void>;
}

const MAX_LOOP = 100;
const defaultSleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms));

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
 * it (the decision is on `error.retrydDecision`), and with
 * AmbiguousExecutionError when retryd answers AMBIGUOUS. An abort through
 * `init.signal` is rethrown at once.
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
  const body = options.body ?? (input instanceof Request && input.body !== null ? { kind: 'BYTES' } : bodyOf(init.body));
  const operation = options.operation ?? operationOf(input, init);
  const deadlineAt = options.deadlineMs === undefined ? undefined : performance.now() + options.deadlineMs;
  let currentInit = init;
  let previousBackoffMs: number | undefined;
  let authRefreshAttempted = false;

  for (let attempt = 1; ; attempt++) {
    if (attempt === 1) options.reporter?.record(options.upstream);
    const userSignal = currentInit.signal ?? undefined;
    const signals = [userSignal, options.attemptTimeoutMs === undefined ? undefined : AbortSignal.timeout(options.attemptTimeoutMs)].filter(
      (signal): signal is AbortSignal => signal !== undefined,
    );
    const signal = signals.length === 0 ? undefined : signals.length === 1 ? signals[0] : AbortSignal.any(signals);

    let response: Response | undefined;
    let failure: unknown;
    let outcome: Outcome;
    try {
      response = await fetchImpl(input instanceof Request ? input.clone() : input, { ...currentInit, signal });
    } catch (error) {
      if (userSignal?.aborted) throw error;
      failure = error;
    }
    if (response === undefined) {
      outcome = classifyFetchError(failure);
    } else {
      try {
        // Read the whole body (through a clone, so the response stays readable).
        await response.clone().arrayBuffer();
        if (!retryStatuses.has(response.status)) return response;
        outcome = classifyResponse(response);
      } catch (error) {
        if (userSignal?.aborted) throw error;
        failure = error;
        outcome = classifyFetchError(error, response);
      }
    }

    const remaining = deadlineAt === undefined ? undefined : Math.max(0, deadlineAt - performance.now());
    const decision = await retryd.decide({
      upstream: options.upstream,
      idempotency: options.idempotency,
      attempt,
      operation,
      body,
      deadlineRemainingMs: remaining,
      authRefreshAttempted,
      previousBackoffMs,
      maxAttempts: options.maxAttempts,
      ...outcome,
    });
    if (decision.verdict === 'AMBIGUOUS') {
      throw new AmbiguousExecutionError(decision, response, { cause: failure });
    }
    let retry = decision.verdict === 'RETRY' && attempt < MAX_LOOP;
    if (retry && decision.refreshCredentials) {
      if (options.onRefreshCredentials === undefined) retry = false;
      else currentInit = (await options.onRefreshCredentials(currentInit)) ?? currentInit;
    }
    if (!retry) {
      if (response !== undefined && failure === undefined) return response;
      throw withDecision(failure, decision);
    }
    if (decision.refreshCredentials) authRefreshAttempted = true;
    // Release the connection before waiting.
    await response?.body?.cancel().catch(() => undefined);
    previousBackoffMs = decision.backoffMs || undefined;
    if (decision.backoffMs > 0) await sleep(decision.backoffMs);
  }
}

function withDecision(error: unknown, decision: Decision): unknown {
  if (error !== null && typeof error === 'object') {
    try {
      Object.defineProperty(error, 'retrydDecision', { value: decision, configurable: true, enumerable: false });
    } catch {
      // A frozen error is rethrown as it is.
    }
  }
  return error;
}
