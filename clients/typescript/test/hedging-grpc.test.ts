/** Hedged unary gRPC calls through retryingInterceptor, against a gRPC server
 * of the test's own whose first call is held (a controllable latency tail)
 * and answers the later ones at once. */
import { strict as assert } from 'node:assert';
import { after, before, describe, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import { bucketStart, retryingInterceptor, RetrydClient, RetrydError, type Decision } from '../src';
import { feed, hedgesWon } from './hedging-support';
import { CLIENT_TEST_CONFIG, closedPort, startRetryd, type Retryd } from './support';

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

/** The first Reserve is held until the client cancels it (at most `holdMs`); later ones answer at once. */
class HeldFirstGrpc {
  count = 0;
  cancelled = false;
  /** When each call arrived (performance.now()). */
  readonly arrivals: number[] = [];
  private readonly server = new grpc.Server();
  private wake: (() => void) | undefined;
  port = 0;
  constructor(private readonly holdMs = 5000) {
    this.server.addService(STOCK, {
      Reserve: (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
        this.count++;
        this.arrivals.push(performance.now());
        if (this.count > 1) return callback(null, Buffer.from('hedge'));
        const timer = setTimeout(() => callback(null, Buffer.from('first')), this.holdMs);
        call.on('cancelled', () => {
          clearTimeout(timer);
          this.cancelled = true;
          this.wake?.();
        });
      },
    });
  }
  async start(): Promise<string> {
    this.port = await new Promise<number>((resolve, reject) =>
      this.server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, port) => (error ? reject(error) : resolve(port))),
    );
    return `127.0.0.1:${this.port}`;
  }
  untilCancelled(ms: number): Promise<boolean> {
    if (this.cancelled) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), ms);
      this.wake = () => {
        clearTimeout(timer);
        resolve(true);
      };
    });
  }
  close(): void {
    this.server.forceShutdown();
  }
}

function reserve(client: RetrydClient, target: string, upstream: string, onHedge?: (decision: Decision) => void): Promise<string> {
  const stock = new StockClient(target, grpc.credentials.createInsecure(), {
    interceptors: [retryingInterceptor(client, { upstream, idempotency: 'SAFE', ...(onHedge ? { onHedge } : {}) })],
  }) as unknown as Stock;
  return new Promise<string>((resolve, reject) => {
    stock.Reserve(Buffer.from('x'), { deadline: Date.now() + 5000 }, (error, response) => {
      stock.close();
      if (error) reject(error);
      else resolve(response!.toString());
    });
  });
}

const quiet = { warn: () => undefined };

/**
 * A hedge reaches the upstream at least this share of the served delay after
 * the first attempt did: the two arrivals differ by the delay, retryd's answer
 * and each request's own connect, which a busy machine can delay for the first
 * one; sent at once, the gap would be near 0.
 */
const HALF = 0.5;

describe('hedged gRPC calls', () => {
  let retryd: Retryd;
  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
  });
  after(async () => {
    await retryd.stop();
  });

  test('the local fallback sends a copy after its delay and cancels the slow first call', async () => {
    const client = new RetrydClient(`127.0.0.1:${await closedPort()}`, {
      connectTimeoutMs: 500,
      localHedging: { delayMs: 100, maxExtraLoad: 1 },
      reporting: { intervalMs: 60_000, logger: quiet },
      logger: quiet,
    });
    await assert.rejects(client.sendTrafficReport([['ts-hedge-grpc', 1]], 'x'), RetrydError);
    const upstream = new HeldFirstGrpc();
    const target = await upstream.start();
    try {
      const hedges: Decision[] = [];
      const started = performance.now();
      assert.equal(await reserve(client, target, 'ts-hedge-grpc', (decision) => hedges.push(decision)), 'hedge');
      const took = performance.now() - started;
      assert.equal(upstream.count, 2);
      assert.equal(hedges.length, 1);
      assert.equal(hedges[0]!.verdict, 'RETRY');
      assert.ok(await upstream.untilCancelled(2000), 'the losing first call was not cancelled');
      assert.ok(took < 2500, `took ${took} ms; the hold is 5 s`);
      const traffic = client.reporter!.pendingTraffic()['ts-hedge-grpc']!;
      assert.deepEqual([traffic.requests, traffic.successes, traffic.failures, traffic.retrySuccesses, traffic.retryFailures], [1, 0, 0, 1, 0]);
      const buckets = Object.entries(traffic.latencySuccesses!);
      assert.equal(buckets.length, 1);
      assert.ok(bucketStart(Number(buckets[0]![0])) >= 87_000, `${buckets[0]![0]}`);
      assert.equal(traffic.latencyFailures, undefined);
    } finally {
      upstream.close();
      await client.close();
    }
  });

  test('a hedge retryd denies HEDGING_OFF sends no copy', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    client.hedging.update([{ upstream: 'ts-hedge-grpc-off', enabled: true, delayMs: 50, maxHedges: 1, idempotency: new Set(['SAFE'] as const) }]);
    const upstream = new HeldFirstGrpc(400);
    const target = await upstream.start();
    try {
      const hedges: Decision[] = [];
      assert.equal(await reserve(client, target, 'ts-hedge-grpc-off', (d) => hedges.push(d)), 'first');
      assert.equal(upstream.count, 1);
      assert.deepEqual(hedges.map((d) => d.denyReason), ['HEDGING_OFF']);
      const traffic = client.reporter!.pendingTraffic()['ts-hedge-grpc-off']!;
      assert.deepEqual([traffic.requests, traffic.successes, traffic.failures], [1, 1, 0]);
      assert.equal(Object.values(traffic.latencySuccesses!).reduce((a, b) => a + b, 0), 1);
    } finally {
      upstream.close();
      await client.close();
    }
  });

  test('retryd serves a delay from reported latencies; a hedge after it wins and the first call is cancelled', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    await feed(client, 'ts-hedged-grpc');
    const served = client.hedging.current('ts-hedged-grpc');
    assert.ok(served?.enabled, JSON.stringify(served));
    const upstream = new HeldFirstGrpc();
    const target = await upstream.start();
    try {
      const hedges: Decision[] = [];
      const started = performance.now();
      assert.equal(await reserve(client, target, 'ts-hedged-grpc', (d) => hedges.push(d)), 'hedge');
      const took = performance.now() - started;
      assert.equal(upstream.count, 2);
      assert.deepEqual(hedges.map((d) => [d.verdict, d.fallback]), [['RETRY', false]]);
      assert.ok(await upstream.untilCancelled(2000), 'the losing first call was not cancelled');
      assert.ok(took < 2500, `took ${took} ms`);
      const [first, hedge] = upstream.arrivals;
      assert.ok(hedge! - first! >= served.delayMs * HALF, `the hedge came ${hedge! - first!} ms after the first call`);
      const traffic = client.reporter!.pendingTraffic()['ts-hedged-grpc']!;
      assert.deepEqual([traffic.requests, traffic.successes, traffic.failures, traffic.retrySuccesses, traffic.retryFailures], [1, 0, 0, 1, 0]);
      assert.equal(traffic.hedgesWon, 1); // the hedge answered: counted once, by default
      assert.equal(await client.reporter!.flush(), true);
      assert.equal(await hedgesWon(retryd, 'ts-hedged-grpc'), 1);
    } finally {
      upstream.close();
      await client.close();
    }
  });

  test('a fast call sends no hedge and records its latency', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    client.hedging.update([{ upstream: 'ts-hedge-grpc-fast', enabled: true, delayMs: 500, maxHedges: 1, idempotency: new Set(['SAFE'] as const) }]);
    const upstream = new HeldFirstGrpc();
    upstream.count = 1; // every call answered at once
    const target = await upstream.start();
    try {
      const hedges: Decision[] = [];
      for (let i = 0; i < 3; i++) assert.equal(await reserve(client, target, 'ts-hedge-grpc-fast', (d) => hedges.push(d)), 'hedge');
      assert.equal(hedges.length, 0);
      assert.equal(upstream.count, 4);
      const traffic = client.reporter!.pendingTraffic()['ts-hedge-grpc-fast']!;
      assert.equal(Object.values(traffic.latencySuccesses!).reduce((a, b) => a + b, 0), 3);
    } finally {
      upstream.close();
      await client.close();
    }
  });
});
