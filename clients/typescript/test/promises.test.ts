/** What the README promises and issue 16 found broken, each against real
 * sockets on 127.0.0.1 and a real retryd: reporting on by default, the
 * deadline on every attempt, the decision behind every outcome, requests that
 * never left, bodies that stay readable, a frozen retryd, and traffic reports
 * that are never counted twice nor retried forever. */
import { strict as assert } from 'node:assert';
import { createHash } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import {
  AmbiguousExecutionError,
  classifyFetchError,
  decisionOf,
  fetchWithRetries,
  RetrydClient,
  TrafficReporter,
  type Decision,
} from '../src';
import {
  CapturingLogger,
  CLIENT_TEST_CONFIG,
  closedPort,
  closeWithoutResponse,
  hang,
  ioTurns,
  LossyProxy,
  respond,
  ScriptedServer,
  startRetryd,
  waitFor,
  type Action,
  type Retryd,
} from './support';

async function withServer<T>(actions: Action[], body: (server: ScriptedServer) => Promise<T>): Promise<T> {
  const server = await ScriptedServer.start(actions);
  try {
    return await body(server);
  } finally {
    await server.close();
  }
}

const retrydDecision = (error: unknown): Decision | undefined => (error as { retrydDecision?: Decision }).retrydDecision;

/** Headers, five bytes of a 100-byte body, then silence. */
const stallBody = (): Action => (socket) => {
  socket.write('HTTP/1.1 200 X\r\nContent-Length: 100\r\n\r\n01234');
};

describe('issue 16, against a real retryd', () => {
  let retryd: Retryd;
  let client: RetrydClient;

  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: false });
  });
  after(async () => {
    await client?.close();
    await retryd?.stop();
  });

  // ---------------------------------------------------------------- 1. reporting on by default

  test('an adapter call counts its first attempt by default, sent by close()', async () => {
    const own = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: { intervalMs: 3_600_000 } });
    assert.ok(own.reporter, 'a client has a reporter unless told otherwise');
    await withServer([respond(200, 'ok')], async (server) => {
      for (let i = 0; i < 3; i++) {
        const response = await fetchWithRetries(own, server.url, {}, { upstream: 'ts-report-default', idempotency: 'SAFE' });
        assert.equal(response.status, 200);
      }
      await fetchWithRetries(own, server.url, {}, { upstream: 'ts-report-optout', idempotency: 'SAFE', reporter: false });
    });
    assert.deepEqual(own.reporter.pending(), { 'ts-report-default': 3 });
    await own.close(); // the interval is an hour: only close() can have sent them
    assert.equal((await client.getBudget('ts-report-default')).tokens, 3);
    assert.equal((await client.getBudget('ts-report-optout')).tokens, 0);
  });

  // ---------------------------------------------------------------- 2. the deadline bounds every attempt

  // Which timer ended the attempt is read from the error it raised (its limit
  // as set), so no wall-clock ceiling is needed: a busy machine only makes
  // the call end later, never the assertion wrong. (node:test's mock timers
  // do not fit here: undici needs real timers to send the request at all.)
  test('deadlineMs bounds an attempt against a server that never answers', { timeout: 15_000 }, async () => {
    await withServer([hang()], async (server) => {
      const started = performance.now();
      await assert.rejects(
        fetchWithRetries(client, server.url, {}, { upstream: 'ts-deadline', idempotency: 'SAFE', deadlineMs: 1000 }),
        (error: unknown) => {
          assert.equal((error as Error).name, 'TimeoutError');
          assert.match((error as Error).message, /ran out of time \((1000|999) ms\)/, 'the deadline set the attempt timer');
          // Nothing was left to ask retryd with: decided locally, at once.
          assert.deepEqual([retrydDecision(error)?.denyReason, retrydDecision(error)?.rule, retrydDecision(error)?.decisionId], ['DEADLINE', 6, '']);
          return true;
        },
      );
      assert.ok(performance.now() - started >= 990, 'not before the deadline');
      assert.equal(server.requests.length, 1);
    });
  });

  test('deadlineMs bounds reading the body too', { timeout: 15_000 }, async () => {
    await withServer([stallBody()], async (server) => {
      const started = performance.now();
      await assert.rejects(
        fetchWithRetries(client, server.url, {}, { upstream: 'ts-deadline', idempotency: 'SAFE', deadlineMs: 800 }),
        (error: unknown) => {
          assert.match(String((error as Error).cause ?? error), /ran out of time \((800|799) ms\)/, String(error));
          return retrydDecision(error)?.denyReason === 'DEADLINE' && retrydDecision(error)?.effectiveEvidence === 'PARTIAL_RESPONSE';
        },
      );
      assert.ok(performance.now() - started >= 790, 'not before the deadline');
      assert.equal(server.requests.length, 1);
    });
  });

  test('the remaining deadline shortens the attempt after a retry', { timeout: 15_000 }, async () => {
    // 400 ms attempts, a 500 ms deadline: the first attempt times out and is
    // retried; the second gets only what is left (~100 ms), not 400 ms.
    await withServer([hang()], async (server) => {
      const started = performance.now();
      await assert.rejects(
        fetchWithRetries(client, server.url, {}, { upstream: 'ts-deadline', idempotency: 'SAFE', deadlineMs: 500, attemptTimeoutMs: 400 }),
        (error: unknown) => {
          assert.equal(retrydDecision(error)?.denyReason, 'DEADLINE');
          // The second attempt's own limit, as its timer was set: what was
          // left of the deadline, not another 400 ms. No wall-clock ceiling.
          const limitMs = Number(/ran out of time \((\d+) ms\)/.exec((error as Error).message)?.[1]);
          assert.ok(limitMs < 400, (error as Error).message);
          return true;
        },
      );
      assert.ok(performance.now() - started >= 490, 'not before the deadline');
      assert.equal(server.requests.length, 2);
    });
  });

  // ---------------------------------------------------------------- 3. the decision behind every outcome

  test('decisionOf a returned response: an empty budget and a 503', async () => {
    await withServer([respond(503, 'busy')], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-empty', idempotency: 'SAFE' });
      assert.equal(response.status, 503);
      assert.equal(await response.text(), 'busy');
      const decision = decisionOf(response);
      assert.ok(decision, 'the denial must be reachable from the response');
      assert.deepEqual([decision.verdict, decision.denyReason, decision.rule], ['DENY', 'BUDGET_EXHAUSTED', 2]);
      assert.ok(decision.decisionId);
    });
  });

  test('decisionOf a success after a retry, of a first-try success, and of errors', async () => {
    await withServer([respond(503), respond(200)], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-decision', idempotency: 'SAFE' });
      assert.equal(response.status, 200);
      assert.equal(decisionOf(response)?.verdict, 'RETRY');
    });
    await withServer([respond(200)], async (server) => {
      const response = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-decision', idempotency: 'SAFE' });
      assert.equal(decisionOf(response), undefined, 'nothing failed, nothing was decided');
    });
    const port = await closedPort();
    await assert.rejects(fetchWithRetries(client, `http://127.0.0.1:${port}/`, {}, { upstream: 'ts-decision', idempotency: 'SAFE', maxAttempts: 1 }), (error: unknown) => {
      assert.equal(decisionOf(error)?.denyReason, 'MAX_ATTEMPTS');
      assert.equal(decisionOf(error), retrydDecision(error));
      return true;
    });
    await withServer([closeWithoutResponse()], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, server.url, { method: 'POST', body: '{}' }, { upstream: 'ts-decision', idempotency: 'NON_IDEMPOTENT' }),
        (error: unknown) => error instanceof AmbiguousExecutionError && decisionOf(error) === error.decision,
      );
    });
  });

  // ---------------------------------------------------------------- 4. refused before it was written

  test('an invalid header value is a request-encoding failure: not retried, nothing spent', async () => {
    await withServer([respond(200)], async (server) => {
      const before = (await client.getBudget('ts-encoding')).tokens;
      for (const [method, idempotency] of [['GET', 'SAFE'], ['POST', 'NON_IDEMPOTENT']] as const) {
        await assert.rejects(
          fetchWithRetries(client, server.url, { method, headers: { 'x-token': 'a\nb' } }, { upstream: 'ts-encoding', idempotency }),
          (error: unknown) => {
            assert.ok(error instanceof TypeError && !(error instanceof AmbiguousExecutionError), String(error));
            assert.match(error.message, /Headers\.append/);
            assert.deepEqual([retrydDecision(error)?.denyReason, retrydDecision(error)?.rule], ['PERMANENT_FAILURE', 7]);
            return true;
          },
        );
      }
      assert.equal(server.requests.length, 0);
      assert.equal((await client.getBudget('ts-encoding')).tokens, before);
    });
  });

  test('an invalid URL, header name, method or body is a request-encoding failure', async () => {
    const cases: [string, RequestInit, string][] = [
      ['http://', {}, 'PERMANENT_FAILURE'],
      ['http://127.0.0.1:1/', { headers: { 'bad name': 'x' } }, 'PERMANENT_FAILURE'],
      ['http://127.0.0.1:1/', { headers: { 'x-euro': '€' } }, 'PERMANENT_FAILURE'],
      ['http://127.0.0.1:1/', { method: 'NOT A METHOD' }, 'PERMANENT_FAILURE'],
      ['http://127.0.0.1:1/', { method: 'GET', body: 'x' }, 'PERMANENT_FAILURE'],
      // A stream without `duplex`: a one-shot body, which rule 3 denies before rule 7.
      ['http://127.0.0.1:1/', { method: 'POST', body: new ReadableStream() }, 'BODY_NOT_REPLAYABLE'],
    ];
    for (const [url, init, reason] of cases) {
      await assert.rejects(fetchWithRetries(client, url, init, { upstream: 'ts-encoding', idempotency: 'IDEMPOTENT' }), (error: unknown) => {
        assert.equal(retrydDecision(error)?.denyReason, reason, `${url} ${JSON.stringify(init.headers ?? init.method)}: ${String(error)}`);
        return true;
      });
      // classifyFetchError says the same for the error fetch itself throws.
      await assert.rejects(fetch(url, init), (error: unknown) => {
        assert.deepEqual(classifyFetchError(error), { evidence: 'SENT_NO_RESPONSE', failure: 'REQUEST_ENCODING' }, String(error));
        return true;
      });
    }
    assert.equal((await client.getBudget('ts-encoding')).tokens, 10);
  });

  // ---------------------------------------------------------------- 5. the body outlives the attempt timeout

  test('a returned body stays readable after attemptTimeoutMs and deadlineMs pass', async (t) => {
    await withServer([respond(200, 'hello'), respond(503, 'busy')], async (server) => {
      t.mock.timers.enable({ apis: ['setTimeout'] });
      const ok = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-body', idempotency: 'SAFE', attemptTimeoutMs: 150, deadlineMs: 200 });
      const denied = await fetchWithRetries(client, server.url, {}, { upstream: 'ts-empty', idempotency: 'SAFE', attemptTimeoutMs: 150 });
      assert.equal(denied.status, 503);
      // On the mock clock, past both timers: one left armed would fire now.
      t.mock.timers.tick(450);
      await ioTurns();
      assert.equal(await ok.text(), 'hello');
      assert.equal(await denied.text(), 'busy');
    });
  });

  // ---------------------------------------------------------------- 7. traffic reports

  test('a re-sent report keeps its id, so a lost answer never counts twice', { timeout: 30_000 }, async () => {
    const proxy = await LossyProxy.start(retryd.grpc);
    const logger = new CapturingLogger();
    const viaProxy = new RetrydClient(proxy.target, { timeoutMs: 300, fallback: null, reporting: false, logger });
    try {
      const reporter = new TrafficReporter(viaProxy, { logger });
      reporter.record('ts-dedup', 1);
      assert.equal(await reporter.flush(), true); // connects through the proxy
      assert.equal((await client.getBudget('ts-dedup')).tokens, 1);

      proxy.dropResponses = true;
      reporter.record('ts-dedup', 5);
      assert.equal(await reporter.flush(), false, 'the answer was lost');
      await waitFor('the lost report to be applied', async () => (await client.getBudget('ts-dedup')).tokens === 6);
      assert.deepEqual(reporter.pending(), { 'ts-dedup': 5 }, 'kept for re-sending');

      reporter.record('ts-dedup', 2); // new traffic waits beside the unacknowledged batch
      proxy.dropResponses = false;
      proxy.cut();
      await waitFor('the re-send to be acknowledged', () => reporter.flush(), 10_000);
      // 1 + 5 (once, whatever the re-sends) + 2
      assert.equal((await client.getBudget('ts-dedup')).tokens, 8);
      assert.deepEqual(reporter.pending(), {});
      assert.equal(reporter.dropped, 0);
      // One outage: a warning when the answer was lost, a line when it is over.
      assert.equal(logger.warnings.length, 1, logger.warnings.join('\n'));
      assert.match(logger.warnings[0]!, /traffic reports to retryd fail/);
      assert.match(logger.infos.at(-1) ?? '', /traffic reports reach retryd again/);
    } finally {
      await viaProxy.close();
      await proxy.close();
    }
  });
});

test('batches retryd refuses for good are dropped, counted, and warned about once', { timeout: 30_000 }, async () => {
  const key = 'ts-reporter-key-0123456789';
  const config = `${CLIENT_TEST_CONFIG}
[limits]
max_upstreams = 16

[[auth.principals]]
name = "reporter"
api_keys_sha256 = ["${createHash('sha256').update(key).digest('hex')}"]
upstreams = ["ts-*"]
admin = true
`;
  const server = await startRetryd(config);
  const logger = new CapturingLogger();
  const client = new RetrydClient(server.grpc, { timeoutMs: 5000, fallback: null, reporting: false, metadata: { authorization: `Bearer ${key}` } });
  try {
    const reporter = new TrafficReporter(client, { logger });
    const refusals: [string, number, RegExp][] = [
      ['x'.repeat(300), 2, /INVALID_ARGUMENT/], // a name over 256 bytes
      ['other-team', 3, /PERMISSION_DENIED/], // not ts-*
    ];
    for (const [upstream, requests, code] of refusals) {
      const before = reporter.dropped;
      reporter.record(upstream, requests);
      assert.equal(await reporter.flush(), true, 'a refused batch is not kept');
      assert.deepEqual(reporter.pending(), {});
      assert.equal(reporter.dropped, before + requests);
      assert.match(logger.warnings.at(-1) ?? '', code);
    }
    assert.equal(logger.warnings.length, 2);
    // The same refusal again: counted, not warned about again.
    reporter.record('other-team', 1);
    await reporter.flush();
    assert.equal(logger.warnings.length, 2);
    // Over limits.max_upstreams (16 unconfigured upstreams at most).
    for (let i = 0; i < 20; i++) reporter.record(`ts-new-${i}`);
    await reporter.flush();
    assert.match(logger.warnings.at(-1) ?? '', /RESOURCE_EXHAUSTED/);
    assert.equal(reporter.droppedBatches, 4);
    assert.equal(reporter.dropped, 2 + 3 + 1 + 20);
    // A good report goes through, and nothing is stuck behind the dropped ones.
    reporter.record('ts-report-default', 4);
    assert.equal(await reporter.flush(), true);
    assert.equal((await client.getBudget('ts-report-default')).tokens, 4);
  } finally {
    await client.close();
    await server.stop();
  }
});

// ------------------------------------------------------------------ 6. a frozen retryd, and the fallback's warnings

test('the fallback warns once per outage, not once per decision', async () => {
  const port = await closedPort();
  const logger = new CapturingLogger();
  const down = new RetrydClient(`127.0.0.1:${port}`, { timeoutMs: 200, logger, reporting: false });
  try {
    for (let i = 0; i < 5; i++) {
      const decision = await down.decide({ upstream: 'u', idempotency: 'SAFE', attempt: 1, failure: 'CONNECT' });
      assert.equal(decision.fallback, true);
    }
    assert.equal(logger.warnings.length, 1, logger.warnings.join('\n'));
    assert.match(logger.warnings[0]!, /local rule/);
  } finally {
    await down.close();
  }
});

test('the fallback and the reporter each warn once per outage, and once when it is over, with counts', { timeout: 60_000 }, async () => {
  const server = await startRetryd(CLIENT_TEST_CONFIG);
  const logger = new CapturingLogger();
  // A long interval: this test sends the reports itself.
  const client = new RetrydClient(server.grpc, { logger, reporting: { intervalMs: 600_000 } });
  try {
    assert.equal(await client.connected, true);
    client.reporter!.record('ts-outage');
    await server.freeze();
    try {
      for (let i = 0; i < 3; i++) {
        assert.equal((await client.decide({ upstream: 'ts-outage', idempotency: 'SAFE', attempt: 1, failure: 'CONNECT' })).fallback, true);
      }
      assert.equal(await client.reporter!.flush(), false);
      assert.equal(await client.reporter!.flush(), false);
    } finally {
      server.signal('SIGCONT');
    }
    await waitFor('retryd to answer again', async () => !(await client.decide({ upstream: 'ts-outage', idempotency: 'SAFE', attempt: 1, failure: 'CONNECT' })).fallback);
    assert.equal(await client.reporter!.flush(), true);
    assert.equal(logger.warnings.length, 2, logger.warnings.join('\n'));
    assert.match(logger.warnings[0]!, /did not answer .*local rule/);
    assert.match(logger.warnings[1]!, /traffic reports to retryd fail/);
    assert.equal(logger.infos.length, 2, logger.infos.join('\n'));
    assert.match(logger.infos[0]!, /answers again after \d+ ms; 3 decision\(s\) were made by the local rule/);
    assert.match(logger.infos[1]!, /reach retryd again after \d+ ms; 2 report attempt\(s\) failed/);
    assert.deepEqual(client.reporter!.pending(), {}, 'the kept counts went out');
  } finally {
    await client.close();
    await server.stop();
  }
});

test('decisions a frozen retryd answers late spend nothing, and a new outage warns again', { timeout: 60_000 }, async () => {
  const server = await startRetryd(CLIENT_TEST_CONFIG);
  const logger = new CapturingLogger();
  const frozen = new RetrydClient(server.grpc, { timeoutMs: 200, logger, reporting: false });
  const admin = new RetrydClient(server.grpc, { timeoutMs: 5000, fallback: null, reporting: false });
  const input = { upstream: 'ts-frozen', idempotency: 'SAFE', attempt: 1, failure: 'CONNECT' } as const;
  try {
    assert.equal((await admin.getBudget('ts-frozen')).tokens, 2);
    assert.equal((await frozen.decide({ ...input, upstream: 'ts-warm' })).fallback, false); // connected
    for (let outage = 1; outage <= 2; outage++) {
      await server.freeze();
      try {
        for (let i = 0; i < 3; i++) {
          const decision = await frozen.decide(input);
          assert.equal(decision.fallback, true);
          // The client's own deadline ended the wait (no wall-clock ceiling).
          assert.match(decision.explanation, /DEADLINE_EXCEEDED/, 'the client timeout bounds the wait');
        }
        // The last call's deadline passed at the client a moment ago; give it
        // a clear margin at the server too. Thawed at once, the server can see
        // up to ~1 ms left (grpc-js rounds grpc-timeout up to whole ms, and its
        // RST_STREAM may reach the socket after the caller fell back): that
        // boundary is not what this test is about.
        await new Promise((resolve) => setTimeout(resolve, 100));
      } finally {
        server.signal('SIGCONT');
      }
      // Thawed, retryd reads the three requests whose deadlines have passed.
      await waitFor('retryd to answer again', async () => !(await frozen.decide({ ...input, upstream: 'ts-warm' })).fallback);
      assert.equal(logger.warnings.length, outage, logger.warnings.join('\n'));
      assert.equal(logger.infos.length, outage, 'and says when it is back');
      assert.equal((await admin.getBudget('ts-frozen')).tokens, 2, 'a decision the caller gave up on must not spend');
    }
  } finally {
    await frozen.close();
    await admin.close();
    await server.stop();
  }
});
