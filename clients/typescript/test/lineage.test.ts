/**
 * Issue 31, "one layer retries" (docs/lineage.md): the lineage helpers, the
 * local rule's rule-5 checks, and a real three-layer chain over node:http and
 * over gRPC: an edge calls a middle server (wrapped by lineageHandler /
 * lineageServerInterceptor) whose handler calls a failing back end through
 * the adapters, against a real retryd.
 *
 * The suite asks retryd once whether it applies the chain rule, and fails
 * on a server that does not (a stale $RETRYD_BIN) rather than skip.
 */
import { strict as assert } from 'node:assert';
import { AsyncLocalStorage } from 'node:async_hooks';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import { context, propagation, ROOT_CONTEXT, type Context, type ContextManager } from '@opentelemetry/api';
import express from 'express';
import {
  currentChain,
  decisionOf,
  defaultLayer,
  DEFAULT_LOCAL_POLICY,
  enclosingRetry,
  fetchWithRetries,
  InvalidRequestError,
  lineageError,
  lineageFromBaggage,
  lineageHandler,
  lineageMiddleware,
  lineageServerInterceptor,
  localDecide,
  parseLineage,
  RetrydClient,
  retryingInterceptor,
  shortenLineage,
  formatLineage,
  withLineageBaggage,
  type Decision,
  type GrpcOutcome,
} from '../src';
import { closedPort, retrydBin, startRetryd, type Retryd } from './support';

// ------------------------------------------------------------------ parsing and shortening

describe('lineage values', () => {
  test('parses layer:attempt entries and refuses anything else', () => {
    assert.deepEqual(parseLineage('edge:2/middle:1'), [
      { layer: 'edge', attempt: 2 },
      { layer: 'middle', attempt: 1 },
    ]);
    assert.deepEqual(parseLineage(''), []);
    assert.deepEqual(parseLineage('...:7/a.b_c-D9:1000'), [
      { layer: '...', attempt: 7 },
      { layer: 'a.b_c-D9', attempt: 1000 },
    ]);
    for (const bad of ['edge', 'edge:', ':1', 'edge:0', 'edge:01', 'edge:1001', 'edge:+1', 'ed ge:1', 'edge:1/', 'edge:1//m:1', `${'x'.repeat(65)}:1`, 'é:1']) {
      assert.equal(parseLineage(bad), null, bad);
    }
    assert.equal(lineageError('edge:1'), null);
    assert.match(lineageError(Array.from({ length: 33 }, () => 'a:1').join('/')) ?? '', /more than 32 entries/);
    assert.match(lineageError(`${'x'.repeat(60)}:1/`.repeat(17).slice(0, -1)) ?? '', /longer than 1024 bytes/);
  });

  test('the innermost retrying entry is the enclosing retry', () => {
    assert.deepEqual(enclosingRetry('edge:2/middle:3/inner:1'), { layer: 'middle', attempt: 3 });
    assert.equal(enclosingRetry('edge:1/middle:1'), undefined);
    assert.equal(enclosingRetry('garbage:x'), undefined);
  });

  test('a long lineage loses its outermost entries, keeping a dropped retry as ...:<max>', () => {
    const ones = Array.from({ length: 40 }, (_, i) => ({ layer: `l${i}`, attempt: 1 }));
    const kept = shortenLineage(ones);
    assert.equal(kept.length, 32);
    assert.deepEqual(kept, ones.slice(8));

    const retried = ones.map((entry, i) => (i === 2 ? { ...entry, attempt: 5 } : i === 5 ? { ...entry, attempt: 3 } : entry));
    const marked = shortenLineage(retried);
    assert.equal(marked.length, 32);
    // The marker takes a slot: 31 of the innermost entries stay.
    assert.deepEqual(marked[0], { layer: '...', attempt: 5 });
    assert.deepEqual(marked.slice(1), retried.slice(9));
    assert.equal(lineageError(formatLineage(marked)), null);

    // The byte limit: 64-byte layers, 67 bytes an entry with its separator.
    const wide = Array.from({ length: 20 }, (_, i) => ({ layer: `${String(i).padStart(2, '0')}${'w'.repeat(62)}`, attempt: i === 0 ? 2 : 1 }));
    const cut = shortenLineage(wide);
    const text = formatLineage(cut);
    assert.ok(text.length <= 1024, `${text.length} bytes`);
    assert.deepEqual(cut[0], { layer: '...', attempt: 2 });
    assert.deepEqual(cut.at(-1), wide.at(-1));
    assert.equal(lineageError(text), null);
    // One more entry would not have fitted.
    assert.ok(text.length + 67 > 1024);

    // Short enough: unchanged.
    assert.deepEqual(shortenLineage(parseLineage('edge:2/middle:1')!), parseLineage('edge:2/middle:1'));
  });

  test('baggage: the member is read and replaced, every other member kept', () => {
    assert.equal(lineageFromBaggage('tenant=acme, retryd.lineage = edge:2/middle:1 ;prop=1,x=y'), 'edge:2/middle:1');
    assert.equal(lineageFromBaggage(['tenant=acme', 'retryd.lineage=edge%3A3']), 'edge:3');
    assert.equal(lineageFromBaggage('tenant=acme'), undefined);
    assert.equal(lineageFromBaggage(undefined), undefined);
    assert.equal(withLineageBaggage('tenant=acme, retryd.lineage=old:9;p, k=v', 'edge:1'), 'tenant=acme,k=v,retryd.lineage=edge:1');
    assert.equal(withLineageBaggage(null, 'edge:1'), 'retryd.lineage=edge:1');
  });

  test('the default layer: OTEL_SERVICE_NAME, else the program name sanitised, else "service"', () => {
    assert.equal(defaultLayer({ OTEL_SERVICE_NAME: 'checkout' }, ['node', '/srv/app.js']), 'checkout');
    assert.equal(defaultLayer({ OTEL_SERVICE_NAME: 'bad name' }, ['node', '/srv/my app+v2.mjs']), 'my_app_v2');
    assert.equal(defaultLayer({}, ['node', `/srv/${'a'.repeat(80)}.js`]), 'a'.repeat(64));
    assert.equal(defaultLayer({}, ['node', '']), 'node');
    assert.equal(defaultLayer({}, ['', '']), 'service');
    assert.throws(() => new RetrydClient('127.0.0.1:1', { layer: 'no spaces', reporting: false }), TypeError);
  });
});

// ------------------------------------------------------------------ the local rule

describe('the local rule in a call chain', () => {
  const base = { upstream: 'u', idempotency: 'SAFE' as const, attempt: 1, httpStatus: 503 };

  test('a failure retried below is DENY RETRIED_BELOW at rule 5', () => {
    const decision = localDecide({ ...base, retriedBelow: 'middle' });
    assert.equal(decision.verdict, 'DENY');
    assert.equal(decision.denyReason, 'RETRIED_BELOW');
    assert.equal(decision.rule, 5);
    assert.match(decision.explanation, /layer below \(middle\)/);
    // Without the mark the same failure is retried: the mark is what denies.
    assert.equal(localDecide(base).verdict, 'RETRY');
  });

  test('inside an enclosing retry: DENY INSIDE_ENCLOSING_RETRY by default, retried when allowed', () => {
    const decision = localDecide({ ...base, lineage: 'edge:2/middle:1' });
    assert.equal(decision.denyReason, 'INSIDE_ENCLOSING_RETRY');
    assert.equal(decision.rule, 5);
    assert.match(decision.explanation, /edge, attempt 2/);
    assert.equal(localDecide({ ...base, lineage: 'edge:1/middle:1' }).verdict, 'RETRY');
    assert.equal(localDecide({ ...base, lineage: 'edge:2' }, { ...DEFAULT_LOCAL_POLICY, insideEnclosingRetry: 'allow' }).verdict, 'RETRY');
  });

  test('the mark never changes the unknown-outcome mark, and rules 1-4 come first', () => {
    const post = localDecide({ upstream: 'u', idempotency: 'NON_IDEMPOTENT', attempt: 1, httpStatus: 503, retriedBelow: 'middle' });
    assert.equal(post.denyReason, 'RETRIED_BELOW');
    assert.equal(post.unknownOutcome, 'RECONCILE');
    assert.equal(localDecide({ ...base, attempt: 2, retriedBelow: 'middle' }).denyReason, 'MAX_ATTEMPTS');
  });

  test('the client refuses what retryd would refuse, even when it decides locally', async () => {
    const client = new RetrydClient(`127.0.0.1:${await closedPort()}`, { reporting: false, logger: { warn: () => undefined, info: () => undefined } });
    try {
      await assert.rejects(client.decide({ ...base, lineage: 'edge:0' }), InvalidRequestError);
      await assert.rejects(client.decide({ ...base, retriedBelow: 'bad name' }), InvalidRequestError);
      // The mark travels on a response: none without one.
      await assert.rejects(
        client.decide({ upstream: 'u', idempotency: 'SAFE', attempt: 1, evidence: 'SENT_NO_RESPONSE', failure: 'CONNECTION_RESET', retriedBelow: 'middle' }),
        InvalidRequestError,
      );
      const decision = await client.decide({ ...base, retriedBelow: 'middle' });
      assert.equal(decision.fallback, true);
      assert.equal(decision.denyReason, 'RETRIED_BELOW');
    } finally {
      await client.close();
    }
  });
});

// ------------------------------------------------------------------ a real chain

const CHAIN_CONFIG = `
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
transient_500 = false
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "5ms", max = "20ms", jitter = "full" }
`;

const quiet = { warn: () => undefined, info: () => undefined };

/** A node:http server of the test's own; records every request's headers. */
class HttpServer {
  readonly requests: http.IncomingHttpHeaders[] = [];
  private readonly server: http.Server;
  constructor(handler: http.RequestListener) {
    this.server = http.createServer((request, response) => {
      this.requests.push(request.headers);
      handler(request, response);
    });
  }
  static async start(handler: http.RequestListener): Promise<HttpServer> {
    const server = new HttpServer(handler);
    await new Promise<void>((resolve) => server.server.listen(0, '127.0.0.1', resolve));
    return server;
  }
  get url(): string {
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}/`;
  }
  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

describe('a call chain over node:http and gRPC', () => {
  let retryd: Retryd;
  let edge: RetrydClient;
  let middle: RetrydClient;

  before(async () => {
    const bin = retrydBin();
    retryd = await startRetryd(CHAIN_CONFIG, bin);
    edge = new RetrydClient(retryd.grpc, { layer: 'edge', reporting: false, logger: quiet });
    middle = new RetrydClient(retryd.grpc, { layer: 'middle', reporting: false, logger: quiet });
    assert.ok(await edge.connected);
    assert.ok(await middle.connected);
    const probe = await edge.decide({ upstream: 'ts-chain-probe', idempotency: 'SAFE', attempt: 1, httpStatus: 503, retriedBelow: 'probe' });
    assert.equal(probe.fallback, false, probe.explanation);
    // Every retryd built from this repository applies the chain rule: a
    // server that does not is a stale binary, and the suite fails on it
    // rather than skipping what it is for.
    assert.equal(
      probe.denyReason,
      'RETRIED_BELOW',
      `retryd at ${bin} does not apply the chain rule (answered ${probe.verdict} ${probe.denyReason ?? ''}): a stale binary?`,
    );
  });

  after(async () => {
    await edge?.close();
    await middle?.close();
    await retryd?.stop();
  });

  /**
   * A back end that always answers 503, and a middle whose handler calls it
   * through fetchWithRetries and answers 503 when that failed; `decisions`
   * gets the middle's last decision per request.
   */
  async function httpChain(): Promise<{ back: HttpServer; mid: HttpServer; decisions: (Decision | undefined)[]; close(): Promise<void> }> {
    const back = await HttpServer.start((_request, response) => {
      response.writeHead(503, { 'content-type': 'text/plain' });
      response.end('back end down');
    });
    const decisions: (Decision | undefined)[] = [];
    const mid = await HttpServer.start(
      lineageHandler((_request, response) => {
        void (async () => {
          const result = await fetchWithRetries(middle, back.url, {}, { upstream: 'ts-chain-back', idempotency: 'SAFE', deadlineMs: 10_000 });
          decisions.push(decisionOf(result));
          await result.arrayBuffer();
          response.writeHead(result.ok ? 200 : 503, { 'content-type': 'text/plain' });
          response.end(result.ok ? 'ok' : 'the back end failed');
        })().catch((error: unknown) => {
          response.writeHead(500);
          response.end(String(error));
        });
      }),
    );
    return { back, mid, decisions, close: async () => (await mid.close(), await back.close()) };
  }

  test('HTTP: the middle retries the back end, lineage per attempt, and marks its 503', async () => {
    const chain = await httpChain();
    try {
      // As an edge that sent its first attempt, with a member of its own and a stale lineage.
      const response = await fetch(chain.mid.url, { headers: { baggage: 'tenant=acme,retryd.lineage=edge:1' } });
      assert.equal(response.status, 503);
      assert.equal(response.headers.get('retryd-retried'), 'middle');
      assert.equal(chain.back.requests.length, 3, 'max_attempts 3 at the layer nearest the failure');
      assert.deepEqual(
        chain.back.requests.map((headers) => headers.baggage),
        ['retryd.lineage=edge:1/middle:1', 'retryd.lineage=edge:1/middle:2', 'retryd.lineage=edge:1/middle:3'],
      );
      assert.equal(chain.decisions[0]?.denyReason, 'MAX_ATTEMPTS');
    } finally {
      await chain.close();
    }
  });

  test('HTTP: a success, or a failure that retryd never decided, is not marked', async () => {
    let status = 404;
    const back = await HttpServer.start((_request, response) => {
      response.writeHead(status);
      response.end();
    });
    const mid = await HttpServer.start(
      lineageHandler((_request, response) => {
        void fetchWithRetries(middle, back.url, {}, { upstream: 'ts-chain-back', idempotency: 'SAFE' }).then((result) => {
          // A 404 is not asked about; answering 502 for it is the handler's own failure.
          response.writeHead(result.status === 404 ? 502 : 200);
          response.end();
        });
      }),
    );
    try {
      const failed = await fetch(mid.url);
      assert.equal(failed.status, 502);
      assert.equal(failed.headers.get('retryd-retried'), null);
      status = 200;
      const ok = await fetch(mid.url);
      assert.equal(ok.status, 200);
      assert.equal(ok.headers.get('retryd-retried'), null);
      assert.equal(back.requests.length, 2);
    } finally {
      await mid.close();
      await back.close();
    }
  });

  test('HTTP: the edge adapter sends its own lineage, keeps other baggage, and reports retried_below', async () => {
    const chain = await httpChain();
    try {
      const response = await fetchWithRetries(
        edge,
        chain.mid.url,
        { headers: { baggage: 'tenant=acme, retryd.lineage=stale:9' } },
        { upstream: 'ts-chain-middle', idempotency: 'SAFE', deadlineMs: 10_000 },
      );
      assert.equal(response.status, 503);
      // The edge has no inbound request: its own entry only.
      assert.equal(chain.mid.requests[0]?.baggage, 'tenant=acme,retryd.lineage=edge:1');
      assert.equal(chain.back.requests[0]?.baggage, 'retryd.lineage=edge:1/middle:1');
      const decision = decisionOf(response);
      assert.equal(decision?.fallback, false);
      assert.equal(decision?.denyReason, 'RETRIED_BELOW', decision?.explanation);
      assert.equal(chain.mid.requests.length, 1, 'the edge does not retry what the middle retried');
      assert.equal(chain.back.requests.length, 3, 'one layer of attempts reaches the back end');
    } finally {
      await chain.close();
    }
  });

  test('HTTP: without retryd, the edge local rule denies RETRIED_BELOW too', async () => {
    const chain = await httpChain();
    const offline = new RetrydClient(`127.0.0.1:${await closedPort()}`, { layer: 'edge', reporting: false, logger: quiet });
    try {
      const response = await fetchWithRetries(offline, chain.mid.url, {}, { upstream: 'ts-chain-middle', idempotency: 'SAFE', deadlineMs: 10_000 });
      assert.equal(response.status, 503);
      const decision = decisionOf(response);
      assert.equal(decision?.fallback, true);
      assert.equal(decision?.denyReason, 'RETRIED_BELOW');
      assert.equal(chain.mid.requests.length, 1);
    } finally {
      await offline.close();
      await chain.close();
    }
  });

  test('HTTP: inside an enclosing retry the middle does not retry', async () => {
    const chain = await httpChain();
    try {
      const response = await fetch(chain.mid.url, { headers: { baggage: 'retryd.lineage=edge:2' } });
      assert.equal(response.status, 503);
      assert.equal(response.headers.get('retryd-retried'), 'middle', 'denied is marked as retried');
      assert.equal(chain.back.requests.length, 1);
      assert.equal(chain.back.requests[0]?.baggage, 'retryd.lineage=edge:2/middle:1');
      assert.equal(chain.decisions[0]?.denyReason, 'INSIDE_ENCLOSING_RETRY', chain.decisions[0]?.explanation);
    } finally {
      await chain.close();
    }
  });

  test('Express: lineageMiddleware as the first middleware, the route calling the back end', async () => {
    const back = await HttpServer.start((_request, response) => {
      response.writeHead(503);
      response.end();
    });
    const app = express();
    app.use(lineageMiddleware());
    app.get('/', async (_request, response) => {
      const result = await fetchWithRetries(middle, back.url, {}, { upstream: 'ts-chain-back', idempotency: 'SAFE', deadlineMs: 10_000 });
      response.status(result.ok ? 200 : 503).send(result.ok ? 'ok' : 'the back end failed');
    });
    const mid = await HttpServer.start(app);
    try {
      const response = await fetch(mid.url, { headers: { baggage: 'retryd.lineage=edge:1' } });
      assert.equal(response.status, 503);
      assert.equal(response.headers.get('retryd-retried'), 'middle');
      assert.deepEqual(
        back.requests.map((headers) => headers.baggage),
        ['retryd.lineage=edge:1/middle:1', 'retryd.lineage=edge:1/middle:2', 'retryd.lineage=edge:1/middle:3'],
      );
    } finally {
      await mid.close();
      await back.close();
    }
  });

  test('OpenTelemetry: the member is in the active baggage while the attempt is sent, beside the others', async () => {
    /** A context manager on AsyncLocalStorage, as the SDK's: the context survives awaits. */
    class AsyncContextManager implements ContextManager {
      private readonly storage = new AsyncLocalStorage<Context>();
      active(): Context {
        return this.storage.getStore() ?? ROOT_CONTEXT;
      }
      with<A extends unknown[], F extends (...args: A) => ReturnType<F>>(ctx: Context, fn: F, thisArg?: ThisParameterType<F>, ...args: A): ReturnType<F> {
        return this.storage.run(ctx, () => fn.call(thisArg, ...args));
      }
      bind<T>(_ctx: Context, target: T): T {
        return target;
      }
      enable(): this {
        return this;
      }
      disable(): this {
        this.storage.disable();
        return this;
      }
    }
    const back = await HttpServer.start((_request, response) => {
      response.writeHead(503);
      response.end();
    });
    context.setGlobalContextManager(new AsyncContextManager());
    try {
      const seen: [string | undefined, string | undefined][] = [];
      // What an instrumentation's propagator would read when the request goes out.
      const observing: typeof fetch = (input, init) => {
        const baggage = propagation.getBaggage(context.active());
        seen.push([baggage?.getEntry('retryd.lineage')?.value, baggage?.getEntry('tenant')?.value]);
        return fetch(input, init);
      };
      const withTenant = propagation.setBaggage(ROOT_CONTEXT, propagation.createBaggage({ tenant: { value: 'acme' } }));
      await context.with(withTenant, () =>
        fetchWithRetries(edge, back.url, {}, { upstream: 'ts-chain-back', idempotency: 'SAFE', deadlineMs: 10_000, fetch: observing, maxAttempts: 2 }),
      );
      assert.deepEqual(seen, [
        ['edge:1', 'acme'],
        ['edge:2', 'acme'],
      ]);
      assert.deepEqual(back.requests.map((headers) => headers.baggage), ['retryd.lineage=edge:1', 'retryd.lineage=edge:2']);
    } finally {
      context.disable();
      await back.close();
    }
  });

  test('the middleware form puts the lineage in the context of what follows it', async () => {
    const middleware = lineageMiddleware({ layer: 'mw' });
    const seen: string[] = [];
    const server = await HttpServer.start((request, response) =>
      middleware(request, response, () => {
        void Promise.resolve().then(() => {
          seen.push(formatLineage(currentChain()?.lineage ?? []));
          currentChain()!.retriedBy = 'whoever';
          response.statusCode = 503;
          response.end(); // an implicit head passes through writeHead too
        });
      }),
    );
    try {
      const response = await fetch(server.url, { headers: { baggage: 'retryd.lineage=a:1/b:2' } });
      assert.deepEqual(seen, ['a:1/b:2']);
      assert.equal(response.status, 503);
      assert.equal(response.headers.get('retryd-retried'), 'mw', 'the layer option names the layer');
    } finally {
      await server.close();
    }
  });

  // ---------------------------------------------------------------- gRPC

  const bytes = { serialize: (value: Buffer) => value, deserialize: (value: Buffer) => value };
  const SERVICE = {
    Call: {
      path: '/chain.v1.Layer/Call',
      requestStream: false,
      responseStream: false,
      requestSerialize: bytes.serialize,
      requestDeserialize: bytes.deserialize,
      responseSerialize: bytes.serialize,
      responseDeserialize: bytes.deserialize,
    },
  } as const;
  const LayerClient = grpc.makeGenericClientConstructor(SERVICE, 'Layer');
  type Layer = grpc.Client & {
    Call(request: Buffer, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
    Call(request: Buffer, metadata: grpc.Metadata, options: grpc.CallOptions, callback: grpc.requestCallback<Buffer>): grpc.ClientUnaryCall;
  };
  type Handler = (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => void;

  async function grpcServer(handler: Handler, options: grpc.ServerOptions = {}): Promise<{ target: string; calls: grpc.Metadata[]; server: grpc.Server }> {
    const server = new grpc.Server(options);
    const calls: grpc.Metadata[] = [];
    server.addService(SERVICE, {
      Call: (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
        calls.push(call.metadata);
        handler(call, callback);
      },
    });
    const port = await new Promise<number>((resolve, reject) =>
      server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) => (error ? reject(error) : resolve(bound))),
    );
    return { target: `127.0.0.1:${port}`, calls, server };
  }

  const unary = (client: Layer): Promise<{ error: grpc.ServiceError | null }> =>
    new Promise((resolve) => client.Call(Buffer.from('x'), { deadline: Date.now() + 10_000 }, (error) => resolve({ error })));

  test('gRPC: the middle retries the back end, lineage per attempt, marks its status; the edge reports retried_below', async () => {
    const back = await grpcServer((_call, callback) => callback({ code: grpc.status.UNAVAILABLE, details: 'back end down' }));
    const toBack = new LayerClient(back.target, grpc.credentials.createInsecure(), {
      interceptors: [retryingInterceptor(middle, { upstream: 'ts-chain-grpc-back', idempotency: 'SAFE' })],
      'grpc.service_config_disable_resolution': 1,
    }) as unknown as Layer;
    const mid = await grpcServer(
      (_call, callback) => {
        void unary(toBack).then(({ error }) =>
          error ? callback({ code: grpc.status.UNAVAILABLE, details: `the back end failed: ${error.details}` }) : callback(null, Buffer.from('ok')),
        );
      },
      { interceptors: [lineageServerInterceptor()] },
    );
    const outcomes: [GrpcOutcome, Decision][] = [];
    const toMid = new LayerClient(mid.target, grpc.credentials.createInsecure(), {
      interceptors: [
        retryingInterceptor(edge, { upstream: 'ts-chain-grpc-middle', idempotency: 'SAFE', onAttempt: (outcome, decision) => outcomes.push([outcome, decision]) }),
      ],
      'grpc.service_config_disable_resolution': 1,
    }) as unknown as Layer;
    try {
      const { error } = await unary(toMid);
      assert.equal(error?.code, grpc.status.UNAVAILABLE);
      assert.deepEqual(error?.metadata.get('retryd-retried'), ['middle']);
      assert.deepEqual(error?.metadata.get('grpc-retry-pushback-ms'), ['-1']);
      assert.deepEqual(mid.calls.map((metadata) => metadata.get('baggage')), [['retryd.lineage=edge:1']]);
      assert.deepEqual(
        back.calls.map((metadata) => metadata.get('baggage')),
        [['retryd.lineage=edge:1/middle:1'], ['retryd.lineage=edge:1/middle:2'], ['retryd.lineage=edge:1/middle:3']],
      );
      assert.equal(outcomes.length, 1, 'the edge decided once and did not retry');
      assert.equal(outcomes[0]![0].retriedBelow, 'middle');
      const decision = outcomes[0]![1];
      assert.equal(decision.verdict, 'DENY');
      // A retryd without the chain rule still denies: the pushback of -1.
      assert.equal(decision.denyReason, 'RETRIED_BELOW', decision.explanation);
    } finally {
      toMid.close();
      toBack.close();
      mid.server.forceShutdown();
      back.server.forceShutdown();
    }
  });

  test('gRPC: inside an enclosing retry the middle does not retry', async () => {
    const back = await grpcServer((_call, callback) => callback({ code: grpc.status.UNAVAILABLE, details: 'back end down' }));
    const decisions: Decision[] = [];
    const toBack = new LayerClient(back.target, grpc.credentials.createInsecure(), {
      interceptors: [retryingInterceptor(middle, { upstream: 'ts-chain-grpc-back', idempotency: 'SAFE', onAttempt: (_o, d) => decisions.push(d) })],
    }) as unknown as Layer;
    const mid = await grpcServer(
      (_call, callback) => void unary(toBack).then(({ error }) => callback({ code: grpc.status.INTERNAL, details: String(error?.details) })),
      { interceptors: [lineageServerInterceptor({ layer: 'middle-svc' })] },
    );
    const plain = new LayerClient(mid.target, grpc.credentials.createInsecure()) as unknown as Layer;
    try {
      const metadata = new grpc.Metadata();
      metadata.set('baggage', 'retryd.lineage=edge:2');
      const error = await new Promise<grpc.ServiceError | null>((resolve) => plain.Call(Buffer.from('x'), metadata, { deadline: Date.now() + 10_000 }, (e) => resolve(e)));
      assert.equal(error?.code, grpc.status.INTERNAL);
      assert.deepEqual(error?.metadata.get('retryd-retried'), ['middle-svc']);
      assert.deepEqual(back.calls.map((m) => m.get('baggage')), [['retryd.lineage=edge:2/middle:1']]);
      assert.equal(decisions[0]?.denyReason, 'INSIDE_ENCLOSING_RETRY', decisions[0]?.explanation);
    } finally {
      plain.close();
      toBack.close();
      mid.server.forceShutdown();
      back.server.forceShutdown();
    }
  });
});
