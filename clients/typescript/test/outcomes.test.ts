/** Issue 32: reports carry outcomes. The adapters, against a real retryd and
 * real downstream servers, count how every attempt ended; the counts that
 * reach the wire are captured by an in-process ReportTraffic server.
 *
 * The rule: an attempt is a failure when the adapter asked (or would ask)
 * retryd whether to retry it; every other ending is a success (a 404
 * included); an attempt the caller cancelled is neither. */
import { strict as assert } from 'node:assert';
import { after, before, describe, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import { AmbiguousExecutionError, fetchWithRetries, retryingInterceptor, RetrydClient, TrafficReporter, type TrafficEntry } from '../src';
import { proto } from '../src/proto';
import { CLIENT_TEST_CONFIG, closedPort, hang, respond, ScriptedServer, startRetryd, type Action, type Retryd } from './support';

interface Report {
  reportId: string;
  traffic: TrafficEntry[];
}

/** The outcome counts alone: the first attempts' latency histograms are test/hedging.test.ts's. */
function counts(traffic: Record<string, TrafficEntry>): Record<string, TrafficEntry> {
  return Object.fromEntries(
    Object.entries(traffic).map(([upstream, { latencySuccesses: _s, latencyFailures: _f, ...rest }]) => [upstream, rest]),
  );
}

/** A ReportTraffic server that records every report as sent and fails the first `failures` (UNAVAILABLE). */
class Capture {
  readonly reports: Report[] = [];
  failures = 0;
  private readonly server = new grpc.Server();
  target = '';

  static async start(): Promise<Capture> {
    const capture = new Capture();
    capture.server.addService(proto().retryd.v1.RetryDecider.service, {
      ReportTraffic: (call: grpc.ServerUnaryCall<Report, unknown>, callback: grpc.sendUnaryData<unknown>) => {
        const { reportId, traffic } = call.request;
        capture.reports.push({
          reportId,
          traffic: traffic.map(({ upstream, requests, successes, failures, retrySuccesses, retryFailures }) => ({
            upstream,
            requests,
            successes,
            failures,
            retrySuccesses,
            retryFailures,
          })),
        });
        if (capture.reports.length <= capture.failures) return callback({ code: grpc.status.UNAVAILABLE, details: 'injected' });
        callback(null, { accepted: traffic.length, alreadyApplied: 0 });
      },
    });
    const port = await new Promise<number>((resolve, reject) =>
      capture.server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) => (error ? reject(error) : resolve(bound))),
    );
    capture.target = `127.0.0.1:${port}`;
    return capture;
  }

  /** The entries of the reports delivered, summed per upstream (a re-sent report counted once). */
  sent(): Record<string, TrafficEntry> {
    const byId = new Map(this.reports.map((report) => [report.reportId, report.traffic]));
    const total: Record<string, TrafficEntry> = {};
    for (const entries of byId.values()) {
      for (const e of entries) {
        const row = (total[e.upstream] ??= entry(e.upstream, 0));
        row.requests += e.requests;
        row.successes += e.successes;
        row.failures += e.failures;
        row.retrySuccesses += e.retrySuccesses;
        row.retryFailures += e.retryFailures;
      }
    }
    return total;
  }

  close(): void {
    this.server.forceShutdown();
  }
}

function entry(upstream: string, requests: number, successes = 0, failures = 0, retrySuccesses = 0, retryFailures = 0): TrafficEntry {
  return { upstream, requests, successes, failures, retrySuccesses, retryFailures };
}

async function withServer<T>(actions: Action[], body: (server: ScriptedServer) => Promise<T>): Promise<T> {
  const server = await ScriptedServer.start(actions);
  try {
    return await body(server);
  } finally {
    await server.close();
  }
}

// A unary service of our own, in raw bytes.
const bytes = { serialize: (value: Buffer) => value, deserialize: (value: Buffer) => value };
const STOCK = {
  Reserve: {
    path: '/inventory.v1.Stock/Reserve',
    requestStream: false,
    responseStream: false,
    requestSerialize: bytes.serialize,
    requestDeserialize: bytes.deserialize,
    responseSerialize: bytes.serialize,
    responseDeserialize: bytes.deserialize,
  },
} as const;
const StockClient = grpc.makeGenericClientConstructor(STOCK, 'Stock');
type Stock = grpc.Client & {
  Reserve(request: Buffer, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
};
type Unary = (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => void;
const ok: Unary = (_call, callback) => callback(null, Buffer.from('reserved'));
const fail =
  (code: grpc.status): Unary =>
  (_call, callback) =>
    callback({ code, details: 'failed' });

/** Answers the n-th call with script[n] (the last repeats). */
async function stockServer(script: Unary[]): Promise<{ target: string; calls: () => number; close(): void }> {
  const server = new grpc.Server();
  let calls = 0;
  server.addService(STOCK, {
    Reserve: (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
      script[Math.min(calls++, script.length - 1)]!(call, callback);
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) => (error ? reject(error) : resolve(bound))),
  );
  return { target: `127.0.0.1:${port}`, calls: () => calls, close: () => server.forceShutdown() };
}

describe('outcomes reach the report', () => {
  let retryd: Retryd;
  let client: RetrydClient;
  let capture: Capture;
  let captureClient: RetrydClient;
  let reporter: TrafficReporter;
  const sleep = async (): Promise<void> => undefined;

  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null });
    capture = await Capture.start();
    captureClient = new RetrydClient(capture.target, { timeoutMs: 2000, fallback: null });
  });
  after(async () => {
    await client?.close();
    await captureClient?.close();
    capture?.close();
    await retryd?.stop();
  });

  const fresh = (): TrafficReporter => {
    capture.reports.length = 0;
    capture.failures = 0;
    reporter = new TrafficReporter(captureClient);
    return reporter;
  };

  test('fetch: success, retried 503, 404, a 500 not retried, a refused connection', async () => {
    const reporter = fresh();
    const call = (url: string, upstream: string, idempotency: 'SAFE' | 'NON_IDEMPOTENT' = 'SAFE', init: RequestInit = {}) =>
      fetchWithRetries(client, url, init, { upstream, idempotency, reporter, sleep });
    await withServer([respond(200)], (server) => call(server.url, 'ts-out-ok'));
    await withServer([respond(503), respond(200)], async (server) => {
      assert.equal((await call(server.url, 'ts-out-retried')).status, 200);
      assert.equal(server.requests.length, 2);
    });
    await withServer([respond(404)], (server) => call(server.url, 'ts-out-404'));
    await withServer([respond(500)], async (server) => {
      assert.equal((await call(server.url, 'ts-out-500')).status, 500); // asked about, denied
      assert.equal(server.requests.length, 1);
    });
    await assert.rejects(call(`http://127.0.0.1:${await closedPort()}/`, 'ts-out-refused', 'NON_IDEMPOTENT', { method: 'POST', body: '{}' }));
    await withServer([respond(503)], (server) =>
      assert.rejects(call(server.url, 'ts-out-charge', 'NON_IDEMPOTENT', { method: 'POST', body: '{}' }), AmbiguousExecutionError),
    );
    assert.equal(await reporter.flush(), true);
    assert.deepEqual(capture.sent(), {
      'ts-out-ok': entry('ts-out-ok', 1, 1),
      'ts-out-retried': entry('ts-out-retried', 1, 0, 1, 1),
      'ts-out-404': entry('ts-out-404', 1, 1),
      'ts-out-500': entry('ts-out-500', 1, 0, 1),
      // not sent: retried up to max_attempts = 3
      'ts-out-refused': entry('ts-out-refused', 1, 0, 1, 0, 2),
      'ts-out-charge': entry('ts-out-charge', 1, 0, 1),
    });
  });

  test('a re-sent report carries the same outcomes', async () => {
    const reporter = fresh();
    capture.failures = 1;
    await withServer([respond(503), respond(200)], (server) =>
      fetchWithRetries(client, server.url, {}, { upstream: 'ts-out-resend', idempotency: 'SAFE', reporter, sleep }),
    );
    assert.equal(await reporter.flush(), false); // UNAVAILABLE: kept
    await withServer([respond(200)], (server) => fetchWithRetries(client, server.url, {}, { upstream: 'ts-out-resend', idempotency: 'SAFE', reporter }));
    assert.deepEqual(counts(reporter.pendingTraffic()), { 'ts-out-resend': entry('ts-out-resend', 2, 1, 1, 1) });
    assert.equal(await reporter.flush(), true);
    const [first, second, third] = capture.reports;
    assert.deepEqual(second, first);
    assert.deepEqual(first!.traffic, [entry('ts-out-resend', 1, 0, 1, 1)]);
    assert.notEqual(third!.reportId, first!.reportId);
    assert.deepEqual(third!.traffic, [entry('ts-out-resend', 1, 1)]);
  });

  test('an attempt the caller aborted counts as neither', async () => {
    const reporter = fresh();
    await withServer([hang()], async (server) => {
      const controller = new AbortController();
      const pending = fetchWithRetries(client, server.url, { signal: controller.signal }, { upstream: 'ts-out-abort', idempotency: 'SAFE', reporter, sleep });
      await server.received(1);
      controller.abort();
      await assert.rejects(pending, (error: unknown) => (error as Error).name === 'AbortError');
    });
    assert.deepEqual(counts(reporter.pendingTraffic()), { 'ts-out-abort': entry('ts-out-abort', 1) });
  });

  test('grpc: success, retried UNAVAILABLE, NOT_FOUND, INTERNAL not retried, a refused connection, a cancel', async () => {
    const reporter = fresh();
    const call = async (target: string, upstream: string, idempotency: 'SAFE' | 'NON_IDEMPOTENT' = 'SAFE', cancel = false): Promise<grpc.ServiceError | null> => {
      const stock = new StockClient(target, grpc.credentials.createInsecure(), {
        interceptors: [retryingInterceptor(client, { upstream, idempotency, reporter })],
      }) as unknown as Stock;
      try {
        return await new Promise((resolve) => {
          const pending = stock.Reserve(Buffer.from('sku'), { deadline: Date.now() + 5000 }, (error) => resolve(error ?? null));
          if (cancel) setTimeout(() => pending.cancel(), 100);
        });
      } finally {
        stock.close();
      }
    };
    for (const [script, upstream, code] of [
      [[ok], 'ts-out-grpc-ok', null],
      [[fail(grpc.status.UNAVAILABLE), ok], 'ts-out-grpc-retried', null],
      [[fail(grpc.status.NOT_FOUND)], 'ts-out-grpc-404', grpc.status.NOT_FOUND],
      [[fail(grpc.status.INTERNAL)], 'ts-out-grpc-internal', grpc.status.INTERNAL],
    ] as [Unary[], string, grpc.status | null][]) {
      const server = await stockServer(script);
      try {
        assert.equal((await call(server.target, upstream))?.code ?? null, code, upstream);
      } finally {
        server.close();
      }
    }
    const refused = await call(`127.0.0.1:${await closedPort()}`, 'ts-out-grpc-refused', 'NON_IDEMPOTENT');
    assert.equal(refused?.code, grpc.status.UNAVAILABLE);
    const hung = await stockServer([() => undefined]);
    try {
      assert.equal((await call(hung.target, 'ts-out-grpc-cancel', 'SAFE', true))?.code, grpc.status.CANCELLED);
    } finally {
      hung.close();
    }
    assert.equal(await reporter.flush(), true);
    assert.deepEqual(capture.sent(), {
      'ts-out-grpc-ok': entry('ts-out-grpc-ok', 1, 1),
      'ts-out-grpc-retried': entry('ts-out-grpc-retried', 1, 0, 1, 1),
      'ts-out-grpc-404': entry('ts-out-grpc-404', 1, 1),
      'ts-out-grpc-internal': entry('ts-out-grpc-internal', 1, 0, 1),
      'ts-out-grpc-refused': entry('ts-out-grpc-refused', 1, 0, 1, 0, 2),
      'ts-out-grpc-cancel': entry('ts-out-grpc-cancel', 1),
    });
  });

  test('the client reporter counts outcomes by default, and retryd accepts them', async () => {
    const own = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: { intervalMs: 60_000 } });
    try {
      await withServer([respond(503), respond(200)], (server) => fetchWithRetries(own, server.url, {}, { upstream: 'ts-out-default', idempotency: 'SAFE', sleep }));
      assert.deepEqual(counts(own.reporter!.pendingTraffic()), { 'ts-out-default': entry('ts-out-default', 1, 0, 1, 1) });
      assert.equal(await own.reporter!.flush(), true);
      const result = await own.sendTrafficReport([entry('ts-out-direct', 2, 1, 1), ['ts-out-pair', 1]], '');
      assert.equal(result.accepted, 2);
    } finally {
      await own.close();
    }
  });

  test('recordOutcome without the adapters, bounded by maxUpstreams', async () => {
    const reporter = fresh();
    reporter.record('a', 3);
    reporter.recordOutcome('a', true);
    reporter.recordOutcome('a', false, false, 2);
    reporter.recordOutcome('a', true, true);
    reporter.recordOutcome('a', false, true, 4);
    reporter.recordOutcome('b', true, true); // a retry whose first attempt was reported earlier
    assert.deepEqual(reporter.pending(), { a: 3 });
    assert.equal(await reporter.flush(), true);
    assert.deepEqual(capture.reports[0]!.traffic, [entry('a', 3, 1, 2, 1, 4), entry('b', 0, 0, 0, 1)]);

    const bounded = new TrafficReporter(captureClient, { maxUpstreams: 1 });
    bounded.recordOutcome('a', true);
    bounded.record('b', 2);
    bounded.recordOutcome('b', false);
    assert.deepEqual(counts(bounded.pendingTraffic()), { a: entry('a', 0, 1) });
    assert.equal(bounded.dropped, 2);
  });
});
