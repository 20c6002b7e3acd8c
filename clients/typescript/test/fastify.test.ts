/**
 * Issue 31 under Fastify (docs/lineage.md): `lineageHandler` wraps the raw
 * node:http handler Fastify hands to its `serverFactory`, as the README says.
 * A real Fastify server on loopback is the middle of a chain; its routes call
 * a back end (node:http, answering by path) through fetchWithRetries with no
 * lineage code of their own, against a real retryd.
 *
 * Fastify runs a route after its hooks and, for a request with a body, after
 * the body has arrived: later events of the request, not the call the wrapper
 * makes. So GET and POST routes are both tested.
 *
 * The suite fails, rather than skips, on a retryd without the chain rule.
 */
import { strict as assert } from 'node:assert';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';
import Fastify, { type FastifyInstance } from 'fastify';
import { currentChain, decisionOf, fetchWithRetries, formatLineage, lineageHandler, RetrydClient, type Decision } from '../src';
import { retrydBin, startRetryd, type Retryd } from './support';

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

describe('lineageHandler under Fastify', () => {
  let retryd: Retryd;
  let edge: RetrydClient;
  let middle: RetrydClient;
  let back: http.Server;
  let backUrl: string;
  const backBaggage: (string | string[] | undefined)[] = [];
  let app: FastifyInstance;
  let appUrl: string;
  const seen: { lineage: string | undefined; decision: Decision | undefined }[] = [];

  before(async () => {
    const bin = retrydBin();
    retryd = await startRetryd(CHAIN_CONFIG, bin);
    edge = new RetrydClient(retryd.grpc, { layer: 'edge', reporting: false, logger: quiet });
    middle = new RetrydClient(retryd.grpc, { layer: 'middle', reporting: false, logger: quiet });
    assert.ok(await edge.connected);
    const probe = await edge.decide({ upstream: 'ts-fastify-probe', idempotency: 'SAFE', attempt: 1, httpStatus: 503, retriedBelow: 'probe' });
    assert.equal(probe.fallback, false, probe.explanation);
    assert.equal(probe.denyReason, 'RETRIED_BELOW', `retryd at ${bin} does not apply the chain rule (answered ${probe.verdict}): a stale binary?`);

    back = http.createServer((request, response) => {
      backBaggage.push(request.headers.baggage);
      response.writeHead(request.url === '/ok' ? 200 : 503);
      response.end();
    });
    await new Promise<void>((resolve) => back.listen(0, '127.0.0.1', resolve));
    backUrl = `http://127.0.0.1:${(back.address() as AddressInfo).port}`;

    // The README's usage, exactly.
    app = Fastify({ serverFactory: (handler) => http.createServer(lineageHandler(handler)) });
    const callBelow = async (below: string): Promise<boolean> => {
      const chain = currentChain();
      const lineage = chain === undefined ? undefined : formatLineage(chain.lineage);
      const result = await fetchWithRetries(middle, `${backUrl}/${below}`, {}, { upstream: 'ts-fastify-back', idempotency: 'SAFE', deadlineMs: 10_000 });
      await result.arrayBuffer();
      seen.push({ lineage, decision: decisionOf(result) });
      return result.ok;
    };
    app.get<{ Querystring: { below: string } }>('/orders', async (request, reply) => {
      const ok = await callBelow(request.query.below);
      return reply.code(ok ? 200 : 503).send({ ok });
    });
    // A body: Fastify runs the route once the body has been read and parsed.
    app.post<{ Body: { below: string } }>('/orders', async (request, reply) => {
      const ok = await callBelow(request.body.below);
      return reply.code(ok ? 200 : 503).send({ ok });
    });
    // A route that throws after the failed call: Fastify's error handler answers 500.
    app.get<{ Querystring: { below: string } }>('/throws', async (request) => {
      if (!(await callBelow(request.query.below))) throw new Error('the back end failed');
      return { ok: true };
    });
    // The route's own failure, no call below.
    app.get('/own', async (_request, reply) => reply.code(503).send({ ok: false }));
    await app.listen({ host: '127.0.0.1', port: 0 });
    appUrl = `http://127.0.0.1:${(app.server.address() as AddressInfo).port}`;
  });

  after(async () => {
    await app?.close();
    await new Promise<void>((resolve) => (back ? back.close(() => resolve()) : resolve()));
    await edge?.close();
    await middle?.close();
    await retryd?.stop();
  });

  function reset(): void {
    backBaggage.length = 0;
    seen.length = 0;
  }

  const threeAttempts = ['retryd.lineage=edge:1/middle:1', 'retryd.lineage=edge:1/middle:2', 'retryd.lineage=edge:1/middle:3'];

  test('GET: the inbound lineage reaches every attempt, and the failed reply is marked', async () => {
    reset();
    const response = await fetch(`${appUrl}/orders?below=fail`, { headers: { baggage: 'tenant=acme,retryd.lineage=edge:1' } });
    assert.equal(response.status, 503);
    assert.equal(response.headers.get('retryd-retried'), 'middle');
    assert.deepEqual(backBaggage, threeAttempts);
    assert.equal(seen[0]?.lineage, 'edge:1');
    assert.equal(seen[0]?.decision?.denyReason, 'MAX_ATTEMPTS');
    assert.equal(seen[0]?.decision?.fallback, false);
  });

  test('POST with a JSON body sent after the head: the route, run once it arrived, is still in the chain', async () => {
    reset();
    // The head first, the body in two later writes: Fastify parses it on
    // events of the request that come after lineageHandler has returned.
    const body = JSON.stringify({ below: 'fail' });
    const response = await new Promise<http.IncomingMessage>((resolve, reject) => {
      const request = http.request(`${appUrl}/orders`, {
        method: 'POST',
        headers: { baggage: 'retryd.lineage=edge:1', 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
      });
      request.on('response', resolve);
      request.on('error', reject);
      request.flushHeaders();
      setImmediate(() => {
        request.write(body.slice(0, 5));
        setImmediate(() => request.end(body.slice(5)));
      });
    });
    response.resume();
    assert.equal(response.statusCode, 503);
    assert.equal(seen[0]?.lineage, 'edge:1');
    assert.deepEqual(backBaggage, threeAttempts);
    assert.equal(response.headers['retryd-retried'], 'middle');
  });

  test('inside an enclosing retry: one attempt, the Decide names the enclosing layer, the reply is marked', async () => {
    reset();
    const response = await fetch(`${appUrl}/orders?below=fail`, { headers: { baggage: 'retryd.lineage=edge:2' } });
    assert.equal(response.status, 503);
    assert.deepEqual(backBaggage, ['retryd.lineage=edge:2/middle:1']);
    const decision = seen[0]?.decision;
    assert.equal(decision?.denyReason, 'INSIDE_ENCLOSING_RETRY', decision?.explanation);
    assert.match(decision?.explanation ?? '', /inside attempt 2 of layer edge/);
    assert.equal(response.headers.get('retryd-retried'), 'middle', 'denied is marked as retried');
  });

  test("a route that throws after a failed call: Fastify's 500 is marked", async () => {
    reset();
    const response = await fetch(`${appUrl}/throws?below=fail`, { headers: { baggage: 'retryd.lineage=edge:1' } });
    assert.equal(response.status, 500);
    assert.equal(response.headers.get('retryd-retried'), 'middle');
    assert.deepEqual(backBaggage, threeAttempts);
  });

  test("a success, or the route's own failure, is not marked; no baggage is the edge's own entry", async () => {
    reset();
    const ok = await fetch(`${appUrl}/orders?below=ok`, { headers: { baggage: 'retryd.lineage=edge:1' } });
    assert.equal(ok.status, 200);
    assert.equal(ok.headers.get('retryd-retried'), null);
    const own = await fetch(`${appUrl}/own`, { headers: { baggage: 'retryd.lineage=edge:1' } });
    assert.equal(own.status, 503);
    assert.equal(own.headers.get('retryd-retried'), null);
    const plain = await fetch(`${appUrl}/orders?below=ok`);
    assert.equal(plain.status, 200);
    assert.deepEqual(backBaggage, ['retryd.lineage=edge:1/middle:1', 'retryd.lineage=middle:1']);
    assert.equal(seen[1]?.lineage, '');
  });

  test('the edge above reports retried_below and does not retry', async () => {
    reset();
    const response = await fetchWithRetries(
      edge,
      `${appUrl}/orders?below=fail`,
      { headers: { baggage: 'tenant=acme' } },
      { upstream: 'ts-fastify-middle', idempotency: 'SAFE', deadlineMs: 10_000 },
    );
    assert.equal(response.status, 503);
    await response.arrayBuffer();
    const decision = decisionOf(response);
    assert.equal(decision?.fallback, false);
    assert.equal(decision?.denyReason, 'RETRIED_BELOW', decision?.explanation);
    assert.match(decision?.explanation ?? '', /retried by layer middle/);
    assert.equal(seen.length, 1, 'the edge does not retry what the middle retried');
    assert.deepEqual(backBaggage, threeAttempts);
  });
});
