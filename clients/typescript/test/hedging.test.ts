/** Issue 33 on the client: latency buckets, histograms in reports, the
 * hedging table, and hedged fetch calls against a real upstream on loopback
 * whose first request is held (a controllable latency tail) and a real retryd. */
import { strict as assert } from 'node:assert';
import * as fs from 'node:fs';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import * as path from 'node:path';
import { after, before, describe, test } from 'node:test';
import {
  bucketStart,
  fetchWithRetries,
  hedgesOf,
  HedgingTable,
  latencyBucket,
  MAX_BUCKET,
  RetrydClient,
  RetrydError,
  TrafficReporter,
  type TrafficEntry,
} from '../src';
import { feed, hedgesWon } from './hedging-support';
import { CLIENT_TEST_CONFIG, closedPort, REPO, startRetryd, type Retryd } from './support';

// The brief's vectors, with 1000 us in bucket 63: e = 9, m = 1000 >> 6 = 15,
// 8 * (9 - 2) + 7 = 63, as the proto's formula and its "bucket b starts at
// (8 + b % 8) << (b / 8 - 1)" agree (bucket 63 is 960..1023 us).
const VECTORS: [number, number][] = [
  [0, 0], [15, 15], [16, 16], [17, 16], [18, 17], [31, 23], [32, 24], [1000, 63], [3_600_000_000, 237], [7_200_000_000, 237],
];

describe('latency buckets', () => {
  test('the vectors', () => {
    for (const [micros, expected] of VECTORS) assert.equal(latencyBucket(micros), expected, `${micros}`);
  });

  test('conformance/latency_buckets.json, which retryd checks its own bucket function against', () => {
    const shared = JSON.parse(fs.readFileSync(path.join(REPO, 'conformance', 'latency_buckets.json'), 'utf8')) as {
      max_bucket: number;
      pairs: [number, number][];
      starts: [number, number][];
    };
    assert.equal(shared.max_bucket, MAX_BUCKET);
    // Values beyond 2^53 are read as the nearest double: still above one hour.
    for (const [micros, expected] of shared.pairs) assert.equal(latencyBucket(micros), expected, `${micros}`);
    for (const [index, start] of shared.starts) {
      assert.equal(bucketStart(index), start, `${index}`);
      assert.equal(latencyBucket(start), index, `${start}`);
    }
  });

  test('every bucket starts where the formula says, up to one hour', () => {
    for (let index = 0; index <= MAX_BUCKET; index++) {
      const start = bucketStart(index);
      assert.equal(latencyBucket(start), index);
      if (start > 0) assert.equal(latencyBucket(start - 1), index - 1);
    }
  });
});

class Sink {
  batches: { id: string; entries: TrafficEntry[] }[] = [];
  failFirst = false;
  async sendTrafficReport(entries: TrafficEntry[], id: string) {
    this.batches.push({ id, entries: structuredClone(entries) });
    if (this.failFirst && this.batches.length === 1) throw new RetrydError('down');
    return { accepted: entries.length, alreadyApplied: 0 };
  }
}

describe('latency histograms in the reporter', () => {
  test('sent beside the counts', async () => {
    const sink = new Sink();
    const reporter = new TrafficReporter(sink, { intervalMs: 60_000 });
    reporter.record('a');
    reporter.recordOutcome('a', true);
    reporter.recordLatency('a', true, 1); // 1000 us: bucket 63
    reporter.recordLatency('a', true, 1);
    reporter.recordLatency('a', false, 0.017); // 17 us: bucket 16
    await reporter.flush();
    assert.deepEqual(sink.batches[0]!.entries, [
      { upstream: 'a', requests: 1, successes: 1, failures: 0, retrySuccesses: 0, retryFailures: 0, latencySuccesses: { 63: 2 }, latencyFailures: { 16: 1 } },
    ]);
  });

  test('a re-sent batch carries the same histograms', async () => {
    const sink = new Sink();
    sink.failFirst = true;
    const reporter = new TrafficReporter(sink, { intervalMs: 60_000, logger: { warn: () => undefined } });
    reporter.recordLatency('a', true, 2);
    assert.equal(await reporter.flush(), false);
    reporter.recordLatency('a', true, 2); // waits beside the held batch
    assert.equal(await reporter.flush(), true);
    const [first, second, third] = sink.batches;
    assert.deepEqual(first, second);
    assert.deepEqual(first!.entries[0]!.latencySuccesses, { [latencyBucket(2000)]: 1 });
    assert.deepEqual(third!.entries[0]!.latencySuccesses, { [latencyBucket(2000)]: 1 });
  });

  test('bounded by the bucket count', () => {
    const reporter = new TrafficReporter(new Sink(), { intervalMs: 60_000 });
    for (let ms = 0; ms < 4_000_000_000 / 1000; ms += 1000.003) reporter.recordLatency('a', true, ms);
    assert.ok(Object.keys(reporter.pendingTraffic().a!.latencySuccesses!).length <= MAX_BUCKET + 1);
  });
});

describe('the hedging table', () => {
  test('keeps an entry three intervals, then drops it', () => {
    let now = 100_000;
    const table = new HedgingTable(3000, null, () => now);
    table.update([{ upstream: 'a', enabled: true, delayMs: 50, maxHedges: 1, idempotency: new Set(['SAFE' as const]) }]);
    now += 3000;
    assert.equal(table.current('a')?.delayMs, 50);
    assert.deepEqual(table.plan('a', 'SAFE'), { delayMs: 50, maxHedges: 1, local: false });
    assert.equal(table.plan('a', 'NON_IDEMPOTENT'), undefined);
    assert.equal(table.plan('a', 'IDEMPOTENT'), undefined); // not in the policy's list
    now += 1;
    assert.equal(table.current('a'), undefined);
  });

  test('never hedges NON_IDEMPOTENT, even if a policy lists it', () => {
    const table = new HedgingTable(3000);
    table.update([{ upstream: 'a', enabled: true, delayMs: 50, maxHedges: 1, idempotency: new Set(['SAFE', 'NON_IDEMPOTENT'] as const) }]);
    assert.equal(table.plan('a', 'NON_IDEMPOTENT'), undefined);
    table.update([{ upstream: 'a', enabled: false, delayMs: 0, maxHedges: 1, idempotency: new Set(['SAFE'] as const) }]);
    assert.equal(table.plan('a', 'SAFE'), undefined);
  });
});

/**
 * An upstream whose first request is held until the client goes away (at
 * most `holdMs`), and whose later requests are answered at once; it notes
 * whether the held request was aborted by the client (cancelled).
 */
class HeldFirst {
  count = 0;
  cancelled = false;
  /** When each request arrived (performance.now()). */
  readonly arrivals: number[] = [];
  private readonly server: http.Server;
  private cancelledWaiters: (() => void)[] = [];
  constructor(private readonly holdMs = 5000) {
    this.server = http.createServer((req, res) => {
      this.count++;
      this.arrivals.push(performance.now());
      if (this.count > 1) {
        res.end('hedge');
        return;
      }
      const timer = setTimeout(() => res.end('first'), this.holdMs);
      res.on('close', () => {
        clearTimeout(timer);
        if (!res.writableEnded) {
          this.cancelled = true;
          for (const wake of this.cancelledWaiters) wake();
        }
      });
    });
  }
  async listen(): Promise<string> {
    await new Promise<void>((resolve) => this.server.listen(0, '127.0.0.1', resolve));
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}/x`;
  }
  untilCancelled(ms: number): Promise<boolean> {
    if (this.cancelled) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), ms);
      this.cancelledWaiters.push(() => {
        clearTimeout(timer);
        resolve(true);
      });
    });
  }
  close(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise((resolve) => this.server.close(() => resolve()));
  }
}

/** A report that fails: the client now knows retryd is unreachable. */
async function unreachable(client: RetrydClient): Promise<void> {
  await assert.rejects(client.sendTrafficReport([['ts-hedge', 1]], 'x'), RetrydError);
}

/**
 * A hedge reaches the upstream at least this share of the served delay after
 * the first attempt did: the two arrivals differ by the delay, retryd's answer
 * and each request's own connect, which a busy machine can delay for the first
 * one; sent at once, the gap would be near 0.
 */
const HALF = 0.5;

async function decisionsMade(retryd: Retryd): Promise<number> {
  const text = await (await fetch(`http://${retryd.metrics}/metrics`)).text();
  let total = 0;
  for (const line of text.split('\n')) {
    if (/^retryd_(decisions|expired_requests)_total[{ ]/.test(line)) total += Number(line.slice(line.lastIndexOf(' ') + 1));
  }
  return total;
}

describe('hedged fetch calls', () => {
  let retryd: Retryd;
  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
  });
  after(async () => {
    await retryd.stop();
  });

  test('the local fallback sends a copy after its delay and cancels the slow first attempt', async () => {
    const client = new RetrydClient(`127.0.0.1:${await closedPort()}`, {
      connectTimeoutMs: 500,
      localHedging: { delayMs: 100, maxExtraLoad: 1 },
      reporting: { intervalMs: 60_000, logger: { warn: () => undefined } },
      logger: { warn: () => undefined },
    });
    await unreachable(client);
    const upstream = new HeldFirst();
    const url = await upstream.listen();
    try {
      const started = performance.now();
      const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedge', idempotency: 'SAFE', deadlineMs: 5000 });
      const took = performance.now() - started;
      assert.equal(await response.text(), 'hedge');
      const [decision, ...more] = hedgesOf(response);
      assert.equal(more.length, 0);
      assert.equal(decision!.verdict, 'RETRY');
      assert.equal(decision!.fallback, true);
      assert.equal(upstream.count, 2);
      assert.ok(await upstream.untilCancelled(2000), 'the losing first attempt was not cancelled');
      assert.ok(took < 2500, `took ${took} ms; the hold is 5 s`);
      const traffic = client.reporter!.pendingTraffic()['ts-hedge']!;
      // One first attempt, no failure: the cancelled first attempt is a
      // success latency (its elapsed time, about the delay), the hedge a
      // retry-side success, never a first attempt.
      assert.deepEqual([traffic.requests, traffic.successes, traffic.failures, traffic.retrySuccesses, traffic.retryFailures], [1, 0, 0, 1, 0]);
      const buckets = Object.entries(traffic.latencySuccesses!);
      assert.equal(buckets.length, 1);
      assert.equal(buckets[0]![1], 1);
      assert.ok(bucketStart(Number(buckets[0]![0])) >= 87_000, `${buckets[0]![0]}`);
      assert.equal(traffic.latencyFailures, undefined);
    } finally {
      await upstream.close();
      await client.close();
    }
  });

  test('without local hedging an unreachable retryd means no hedge', async () => {
    const client = new RetrydClient(`127.0.0.1:${await closedPort()}`, {
      connectTimeoutMs: 500,
      reporting: { intervalMs: 60_000, logger: { warn: () => undefined } },
      logger: { warn: () => undefined },
    });
    await unreachable(client);
    const upstream = new HeldFirst(300);
    const url = await upstream.listen();
    try {
      const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedge', idempotency: 'SAFE' });
      assert.equal(await response.text(), 'first');
      assert.equal(upstream.count, 1);
    } finally {
      await upstream.close();
      await client.close();
    }
  });

  test('a fast call never asks retryd', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    client.hedging.update([{ upstream: 'ts-hedge-fast', enabled: true, delayMs: 500, maxHedges: 1, idempotency: new Set(['SAFE'] as const) }]);
    const server = http.createServer((_, res) => res.end('ok'));
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/`;
    try {
      const before = await decisionsMade(retryd);
      for (let i = 0; i < 5; i++) {
        const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedge-fast', idempotency: 'SAFE' });
        assert.equal(await response.text(), 'ok');
        assert.deepEqual(hedgesOf(response), []);
      }
      assert.equal(await decisionsMade(retryd), before);
      const traffic = client.reporter!.pendingTraffic()['ts-hedge-fast']!;
      assert.equal(Object.values(traffic.latencySuccesses!).reduce((a, b) => a + b, 0), 5);
    } finally {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
      await client.close();
    }
  });

  test('a hedge retryd denies HEDGING_OFF sends no copy', async () => {
    // The table says hedge (an entry retryd no longer serves); retryd has no
    // hedging policy for the upstream: denied, and nothing is sent.
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    client.hedging.update([{ upstream: 'ts-hedge-off', enabled: true, delayMs: 50, maxHedges: 1, idempotency: new Set(['SAFE'] as const) }]);
    const upstream = new HeldFirst(400);
    const url = await upstream.listen();
    try {
      const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedge-off', idempotency: 'SAFE' });
      assert.equal(await response.text(), 'first');
      assert.equal(upstream.count, 1);
      assert.deepEqual(hedgesOf(response).map((d) => [d.verdict, d.denyReason]), [['DENY', 'HEDGING_OFF']]);
    } finally {
      await upstream.close();
      await client.close();
    }
  });

  test('retryd serves a delay from reported latencies; a hedge after it wins and the first attempt is cancelled', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    await feed(client, 'ts-hedged');
    const served = client.hedging.current('ts-hedged');
    assert.ok(served?.enabled, JSON.stringify(served));
    assert.ok(served.delayMs >= 87.5 && served.delayMs <= 112.5, `${served.delayMs}`);
    assert.deepEqual((await client.getBudget('ts-hedged')).hedging, served); // GetBudget shows the same
    const upstream = new HeldFirst();
    const url = await upstream.listen();
    try {
      const started = performance.now();
      const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedged', idempotency: 'SAFE', deadlineMs: 5000 });
      const took = performance.now() - started;
      assert.equal(await response.text(), 'hedge');
      assert.equal(upstream.count, 2);
      assert.deepEqual(hedgesOf(response).map((d) => [d.verdict, d.fallback]), [['RETRY', false]]);
      assert.ok(await upstream.untilCancelled(2000), 'the losing first attempt was not cancelled');
      // The hedge reached the upstream after the served delay, not before it.
      const [first, hedge] = upstream.arrivals;
      assert.ok(hedge! - first! >= served.delayMs * HALF, `the hedge came ${hedge! - first!} ms after the first attempt`);
      assert.ok(took < 2500, `took ${took} ms; the hold is 5 s`);
      const traffic = client.reporter!.pendingTraffic()['ts-hedged']!;
      assert.deepEqual([traffic.requests, traffic.successes, traffic.failures, traffic.retrySuccesses, traffic.retryFailures], [1, 0, 0, 1, 0]);
      assert.equal(traffic.latencyFailures, undefined);
      assert.equal(traffic.hedgesWon, 1); // the hedge answered: counted once, by default
      assert.equal(await client.reporter!.flush(), true); // and retryd accepts the report of it
      assert.equal(await hedgesWon(retryd, 'ts-hedged'), 1);
    } finally {
      await upstream.close();
      await client.close();
    }
  });

  test('a hedge beyond the cap (5% of first attempts) sends no copy', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    await feed(client, 'ts-hedge-cap', 100); // five hedges
    for (let i = 0; i < 5; i++) {
      const granted = await client.decideHedge({ upstream: 'ts-hedge-cap', idempotency: 'SAFE', hedge: 1, attempt: 1 });
      assert.equal(granted.verdict, 'RETRY', granted.explanation);
    }
    const upstream = new HeldFirst(400);
    const url = await upstream.listen();
    try {
      const response = await fetchWithRetries(client, url, {}, { upstream: 'ts-hedge-cap', idempotency: 'SAFE' });
      assert.equal(await response.text(), 'first');
      assert.equal(upstream.count, 1);
      assert.deepEqual(hedgesOf(response).map((d) => d.denyReason), ['HEDGE_CAP']);
    } finally {
      await upstream.close();
      await client.close();
    }
  });

  test("a shadow answer to a hedge is not acted on", async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    try {
      await feed(client, 'ts-hedge-shadow');
      const decision = await client.decideHedge({ upstream: 'ts-hedge-shadow', idempotency: 'SAFE', hedge: 1, attempt: 1 });
      // retryd would have hedged; without local hedging the client does not.
      assert.deepEqual([decision.shadow, decision.fallback, decision.retrydDecision?.verdict], [true, false, 'RETRY']);
      assert.deepEqual([decision.verdict, decision.denyReason], ['DENY', 'HEDGING_OFF']);
    } finally {
      await client.close();
    }
  });

  test('a NON_IDEMPOTENT call is never hedged', async () => {
    const client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: { intervalMs: 60_000 } });
    client.hedging.update([
      { upstream: 'ts-hedge-post', enabled: true, delayMs: 50, maxHedges: 2, idempotency: new Set(['SAFE', 'IDEMPOTENT', 'IDEMPOTENT_WITH_KEY', 'NON_IDEMPOTENT'] as const) },
    ]);
    const upstream = new HeldFirst(400);
    const url = await upstream.listen();
    try {
      const response = await fetchWithRetries(client, url, { method: 'POST', body: 'x' }, { upstream: 'ts-hedge-post', idempotency: 'NON_IDEMPOTENT' });
      assert.equal(await response.text(), 'first');
      assert.equal(upstream.count, 1);
    } finally {
      await upstream.close();
      await client.close();
    }
  });
});
