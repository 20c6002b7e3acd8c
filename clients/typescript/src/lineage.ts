/**
 * Where a call sits in a call chain (docs/lineage.md, issue 31): "one layer
 * retries".
 *
 * Downward, every outbound attempt carries the W3C baggage member
 * `retryd.lineage=<inbound lineage>/<layer>:<attempt>`; upward, a handler
 * whose outbound call ended in failure after retryd's decision marks its own
 * failed response with `retryd-retried: <layer>` (gRPC: that trailer plus
 * `grpc-retry-pushback-ms: -1`), so that the layer above does not retry the
 * same failure again.
 *
 * The inbound wrappers here (`lineageHandler`, `lineageMiddleware`,
 * `lineageServerInterceptor`) keep the inbound lineage in an
 * AsyncLocalStorage for the handler's duration; the outbound adapters
 * (fetchWithRetries, retryingInterceptor) read it from there, so no code of
 * the caller's passes it along.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import type * as http from 'node:http';
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';

/** The baggage member's key. */
export const LINEAGE_BAGGAGE_KEY = 'retryd.lineage';
/** The response header (HTTP) and trailer (gRPC) that says a layer below already retried. */
export const RETRIED_HEADER = 'retryd-retried';
/** Most entries in a lineage. */
export const MAX_LINEAGE_ENTRIES = 32;
/** Longest lineage, in bytes (all its characters are ASCII). */
export const MAX_LINEAGE_BYTES = 1024;
/** Highest attempt number an entry may carry. */
export const MAX_LINEAGE_ATTEMPT = 1000;

/** One `layer:attempt` entry. */
export interface LineageEntry {
  layer: string;
  attempt: number;
}

const LAYER = /^[A-Za-z0-9._-]{1,64}$/;
// One spelling per number (no sign, no leading zero), as retryd reads it.
const ATTEMPT = /^[1-9][0-9]{0,3}$/;

/** Whether `value` is a layer name: 1 to 64 bytes of `[A-Za-z0-9._-]`. */
export function isLayerName(value: unknown): value is string {
  return typeof value === 'string' && LAYER.test(value);
}

/**
 * The entries of a lineage of any length (`edge:2/middle:1`), or null if
 * any entry is not `layer:attempt` (a layer name, an attempt 1 to 1000).
 * The empty string is the edge: no entries.
 */
export function parseLineage(value: string): LineageEntry[] | null {
  if (value === '') return [];
  const entries: LineageEntry[] = [];
  for (const text of value.split('/')) {
    const colon = text.lastIndexOf(':');
    const layer = text.slice(0, colon);
    const attempt = text.slice(colon + 1);
    if (colon < 0 || !LAYER.test(layer) || !ATTEMPT.test(attempt) || Number(attempt) > MAX_LINEAGE_ATTEMPT) return null;
    entries.push({ layer, attempt: Number(attempt) });
  }
  return entries;
}

export function formatLineage(entries: readonly LineageEntry[]): string {
  return entries.map((entry) => `${entry.layer}:${entry.attempt}`).join('/');
}

/**
 * The entries cut to MAX_LINEAGE_ENTRIES and MAX_LINEAGE_BYTES by dropping
 * the outermost ones. If a dropped entry was a retry (attempt above 1), the
 * result starts with `...:<highest dropped attempt>`, so that the rule
 * "inside an enclosing retry" still sees it; that entry counts against the
 * limits too. The innermost entry is always kept.
 */
export function shortenLineage(entries: readonly LineageEntry[]): LineageEntry[] {
  const n = entries.length;
  // suffixBytes[k]: bytes of entries[k..n) joined with '/'.
  const suffixBytes = new Array<number>(n + 1).fill(0);
  for (let k = n - 1; k >= 0; k--) {
    const entry = entries[k]!;
    suffixBytes[k] = entry.layer.length + 1 + String(entry.attempt).length + (k === n - 1 ? 0 : 1 + suffixBytes[k + 1]!);
  }
  let droppedMax = 0;
  for (let k = 0; k < n; k++) {
    const marker = droppedMax > 1 ? { layer: '...', attempt: droppedMax } : undefined;
    const count = n - k + (marker ? 1 : 0);
    const bytes = suffixBytes[k]! + (marker ? 4 + String(marker.attempt).length + 1 : 0);
    if (count <= MAX_LINEAGE_ENTRIES && bytes <= MAX_LINEAGE_BYTES) {
      const kept = entries.slice(k);
      return marker ? [marker, ...kept] : kept;
    }
    droppedMax = Math.max(droppedMax, entries[k]!.attempt);
  }
  return [];
}

/**
 * Why a lineage is not one retryd accepts (at most 32 valid entries, 1024
 * bytes), or null when it is. What `RetrydClient.decide` checks.
 */
export function lineageError(value: string): string | null {
  if (value.length > MAX_LINEAGE_BYTES) return `longer than ${MAX_LINEAGE_BYTES} bytes`;
  const entries = parseLineage(value);
  if (entries === null) return 'not layer:attempt entries (a layer name of 1 to 64 bytes of [A-Za-z0-9._-], an attempt from 1 to 1000) separated by /';
  if (entries.length > MAX_LINEAGE_ENTRIES) return `more than ${MAX_LINEAGE_ENTRIES} entries`;
  return null;
}

/** The innermost entry of a lineage whose attempt is above 1: a layer above is retrying. Undefined if none, or invalid. */
export function enclosingRetry(lineage: string | undefined): LineageEntry | undefined {
  const entries = lineage ? parseLineage(lineage) : null;
  return entries?.reverse().find((entry) => entry.attempt > 1);
}

// ------------------------------------------------------------------ baggage

/**
 * The `retryd.lineage` member's value from a W3C `baggage` header (several
 * header lines are one list), percent-decoded, with any properties cut off;
 * undefined when there is none.
 */
export function lineageFromBaggage(baggage: string | readonly string[] | undefined | null): string | undefined {
  const text = typeof baggage === 'string' ? baggage : baggage?.join(',');
  if (!text) return undefined;
  for (const member of text.split(',')) {
    const equals = member.indexOf('=');
    if (equals < 0 || member.slice(0, equals).trim() !== LINEAGE_BAGGAGE_KEY) continue;
    const raw = member.slice(equals + 1).split(';')[0]!.trim();
    try {
      return decodeURIComponent(raw);
    } catch {
      return undefined;
    }
  }
  return undefined;
}

/**
 * A `baggage` header value with the `retryd.lineage` member set to
 * `lineage`: every other member is kept as it was, in order; an earlier
 * `retryd.lineage` member is replaced.
 */
export function withLineageBaggage(baggage: string | readonly string[] | undefined | null, lineage: string): string {
  const text = typeof baggage === 'string' ? baggage : (baggage?.join(',') ?? '');
  const others = text
    .split(',')
    .map((member) => member.trim())
    .filter((member) => member !== '' && member.split('=')[0]!.trim() !== LINEAGE_BAGGAGE_KEY);
  // The lineage's characters are all baggage-octets: no percent-encoding.
  return [...others, `${LINEAGE_BAGGAGE_KEY}=${lineage}`].join(',');
}

// ------------------------------------------------------------------ layer name

/**
 * The default layer name: OTEL_SERVICE_NAME when it is a valid layer name,
 * else the program's name (the main script without its extension) with
 * every other character replaced by '_', cut to 64 bytes; else "service".
 */
export function defaultLayer(env: NodeJS.ProcessEnv = process.env, argv: readonly string[] = process.argv): string {
  const service = env.OTEL_SERVICE_NAME;
  if (isLayerName(service)) return service;
  const script = argv[1] || argv[0] || '';
  const program = path
    .basename(script)
    .replace(/\.(?:[cm]?js|[cm]?ts)$/, '')
    .replace(/[^A-Za-z0-9._-]/g, '_')
    .slice(0, 64);
  return isLayerName(program) ? program : 'service';
}

/** A layer name given as an option, checked; the default when none was given. */
export function resolveLayer(layer: string | undefined): string {
  if (layer === undefined) return defaultLayer();
  if (!isLayerName(layer)) throw new TypeError(`layer: ${JSON.stringify(layer)} is not 1 to 64 bytes of [A-Za-z0-9._-]`);
  return layer;
}

// ------------------------------------------------------------------ the request's context

/** What the inbound wrappers keep for one request being served. */
export interface ChainContext {
  /** The inbound request's lineage, shortened to the limits; empty when it carried none (or an invalid one). */
  readonly lineage: readonly LineageEntry[];
  /**
   * The layer of the outbound call that ended in failure after retryd's
   * decision (a DENY, an AMBIGUOUS, or a RETRY whose next attempt could not
   * be made) while this request was served; undefined while none did.
   */
  retriedBy: string | undefined;
}

const storage = new AsyncLocalStorage<ChainContext>();

/** The context of the inbound request being served here, if an inbound wrapper set one. */
export function currentChain(): ChainContext | undefined {
  return storage.getStore();
}

/**
 * The context for an inbound request whose `retryd.lineage` baggage member
 * is `lineage`: an invalid one is ignored (it came from a caller we do not
 * control), a long one shortened.
 */
export function chainFromLineage(lineage: string | undefined): ChainContext {
  const entries = lineage === undefined ? [] : (parseLineage(lineage) ?? []);
  return { lineage: shortenLineage(entries), retriedBy: undefined };
}

/**
 * Runs `fn` as serving a request with that inbound lineage (a baggage
 * header value, or the context itself), for frameworks the wrappers below do
 * not fit. The adapters called inside read it.
 */
export function runInChain<T>(chain: ChainContext | { baggage: string | readonly string[] | undefined }, fn: () => T): T {
  const context = 'lineage' in chain ? chain : chainFromLineage(lineageFromBaggage(chain.baggage));
  return storage.run(context, fn);
}

/**
 * What an outbound adapter uses for an attempt: the `lineage` to send with
 * the Decide (the inbound one), and the baggage value for attempt `attempt`.
 */
export function outboundLineage(chain: ChainContext | undefined, layer: string, attempt: number): { inbound: string; outbound: string } {
  const inbound = chain?.lineage ?? [];
  return {
    inbound: formatLineage(inbound),
    outbound: formatLineage(shortenLineage([...inbound, { layer, attempt: Math.min(attempt, MAX_LINEAGE_ATTEMPT) }])),
  };
}

/** Records, for the inbound middleware, that an outbound call of `layer` ended in failure after retryd's decision. */
export function recordRetriedFailure(chain: ChainContext | undefined, layer: string): void {
  if (chain !== undefined) chain.retriedBy ??= layer;
}

// ------------------------------------------------------------------ inbound: node:http

export interface LineageOptions {
  /**
   * The layer named in `retryd-retried` (default: the layer of the client
   * whose outbound call failed, i.e. its `layer` option).
   */
  layer?: string;
}

type Handler<Req extends http.IncomingMessage, Res extends http.ServerResponse> = (request: Req, response: Res) => void;

/** Adds `retryd-retried` to a 5xx response of a request whose outbound call failed after a decision, before its head is sent. */
function markFailures(response: http.ServerResponse, chain: ChainContext, layer: string | undefined): void {
  const writeHead = response.writeHead;
  // ServerResponse writes an implicit head through this.writeHead too
  // (res.end() without it), so every head passes here.
  response.writeHead = function (this: http.ServerResponse, statusCode: number, ...rest: unknown[]) {
    const by = layer ?? chain.retriedBy;
    if (statusCode >= 500 && statusCode <= 599 && chain.retriedBy !== undefined && by !== undefined && !this.headersSent) {
      this.setHeader(RETRIED_HEADER, by);
    }
    return (writeHead as (...args: unknown[]) => http.ServerResponse).call(this, statusCode, ...rest);
  } as typeof response.writeHead;
}

function chainOf(request: http.IncomingMessage): ChainContext {
  return chainFromLineage(lineageFromBaggage(request.headers.baggage));
}

/**
 * Wraps a node:http request handler (`http.createServer(lineageHandler(app))`;
 * an Express app is one, and Fastify's `serverFactory` hands one over):
 * the handler runs with the inbound lineage in its context, and a 5xx
 * response of a request whose outbound call ended in failure after retryd's
 * decision carries `retryd-retried: <layer>`.
 */
export function lineageHandler<Req extends http.IncomingMessage = http.IncomingMessage, Res extends http.ServerResponse = http.ServerResponse>(
  handler: Handler<Req, Res>,
  options: LineageOptions = {},
): Handler<Req, Res> {
  const layer = options.layer === undefined ? undefined : resolveLayer(options.layer);
  return (request, response) => {
    const chain = chainOf(request);
    markFailures(response, chain, layer);
    storage.run(chain, () => handler(request, response));
  };
}

/**
 * The same as Connect/Express middleware (`app.use(lineageMiddleware())`):
 * everything after it in the chain runs with the inbound lineage in its
 * context.
 */
export function lineageMiddleware(
  options: LineageOptions = {},
): (request: http.IncomingMessage, response: http.ServerResponse, next: (error?: unknown) => void) => void {
  const layer = options.layer === undefined ? undefined : resolveLayer(options.layer);
  return (request, response, next) => {
    const chain = chainOf(request);
    markFailures(response, chain, layer);
    storage.run(chain, () => next());
  };
}

// ------------------------------------------------------------------ inbound: grpc-js

/**
 * A grpc-js server interceptor (`new grpc.Server({ interceptors:
 * [lineageServerInterceptor()] })`): the handler runs with the inbound
 * metadata's lineage in its context, and a non-OK status of a call whose
 * outbound call ended in failure after retryd's decision carries the
 * trailers `retryd-retried: <layer>` and `grpc-retry-pushback-ms: -1` (so
 * that a plain gRFC A6 client does not retry it either).
 */
export function lineageServerInterceptor(options: LineageOptions = {}): grpc.ServerInterceptor {
  const layer = options.layer === undefined ? undefined : resolveLayer(options.layer);
  return (_method, call) => {
    let chain = chainFromLineage(undefined);
    // Every event is handed on inside the context: grpc-js calls the
    // handler from within them (unary: on half-close; client streams: on
    // the metadata), and the handler's own continuations keep it.
    return new grpc.ServerInterceptingCall(call, {
      start(next) {
        next({
          onReceiveMetadata(metadata, forward) {
            chain = chainFromLineage(lineageFromBaggage(metadata.get('baggage').map(String)));
            storage.run(chain, () => forward(metadata));
          },
          onReceiveMessage(message, forward) {
            storage.run(chain, () => forward(message));
          },
          onReceiveHalfClose(forward) {
            storage.run(chain, forward);
          },
        });
      },
      sendStatus(status, forward) {
        const by = layer ?? chain.retriedBy;
        if (status.code === grpc.status.OK || chain.retriedBy === undefined || by === undefined) return forward(status);
        const metadata = status.metadata?.clone() ?? new grpc.Metadata();
        metadata.set(RETRIED_HEADER, by);
        metadata.set('grpc-retry-pushback-ms', '-1');
        forward({ ...status, metadata });
      },
    });
  };
}
