/**
 * Issues 36 and 38 over HTTP, against a real retryd and a real keep-alive
 * server that counts the requests it reads and the connections it accepts:
 * a DENY never hides that a call may have happened, the caller's deadline
 * after sending is an ambiguous execution decided locally, and no request
 * reaches the upstream that was not decided (Node's fetch re-sends nothing by
 * itself, on a fresh or a pooled connection), also while retryd is frozen or
 * gone. Every client here has the default settings.
 */
import { strict as assert } from 'node:assert';
import { after, before, describe, test } from 'node:test';
import { AmbiguousExecutionError, decisionOf, fetchWithRetries, RetrydClient, type FetchRetryOptions } from '../src';
import { CapturingLogger, CLIENT_TEST_CONFIG, CountingServer, startRetryd, type Reply, type Retryd } from './support';

/** A fetch that counts the attempts the adapter made (each one was decided or was the first). */
function countingFetch(): { fetch: typeof fetch; attempts: () => number } {
  let attempts = 0;
  return {
    fetch: (input, init) => {
      attempts++;
      return fetch(input, init);
    },
    attempts: () => attempts,
  };
}

async function withServer<T>(script: Reply[], body: (server: CountingServer) => Promise<T>): Promise<T> {
  const server = await CountingServer.start(script);
  try {
    return await body(server);
  } finally {
    await server.close();
  }
}

async function ambiguous(call: Promise<unknown>): Promise<AmbiguousExecutionError> {
  try {
    await call;
  } catch (error) {
    assert.ok(error instanceof AmbiguousExecutionError, `expected an ambiguous execution, got ${String(error)}`);
    return error;
  }
  throw new Error('expected the call to fail');
}

describe('unknown outcomes and re-sends over HTTP', { timeout: 60_000 }, () => {
  let retryd: Retryd;
  let client: RetrydClient;
  const logger = new CapturingLogger();

  before(async () => {
    retryd = await startRetryd(CLIENT_TEST_CONFIG);
    client = new RetrydClient(retryd.grpc, { logger });
    assert.equal(await client.connected, true);
  });
  after(async () => {
    await client?.close();
    await retryd?.stop();
  });

  const post = { method: 'POST', body: '{"amount":100}' };

  test('a POST held past the attempt timeout on an empty budget is ambiguous, carrying BUDGET_EXHAUSTED', async () => {
    await withServer(['hold'], async (server) => {
      const error = await ambiguous(
        fetchWithRetries(client, `${server.url}/v1/charges`, post, { upstream: 'ts-hold', idempotency: 'NON_IDEMPOTENT', attemptTimeoutMs: 300 }),
      );
      assert.equal(error.denyReason, 'BUDGET_EXHAUSTED', error.message);
      assert.equal(error.unknownOutcome, 'RECONCILE');
      assert.equal(error.resendWithSameKey, false);
      assert.equal(error.decision.fallback, false, 'retryd decided');
      assert.match(error.message, /BUDGET_EXHAUSTED/);
      assert.deepEqual(server.reads.map((read) => read.method), ['POST'], 'applied once, never re-sent');
    });
  });

  test('a keyed POST held past the attempt timeout on an empty budget says: re-send with the same key', async () => {
    await withServer(['hold'], async (server) => {
      const error = await ambiguous(
        fetchWithRetries(client, `${server.url}/v1/charges`, post, { upstream: 'ts-hold', idempotency: 'IDEMPOTENT_WITH_KEY', attemptTimeoutMs: 300 }),
      );
      assert.equal(error.denyReason, 'BUDGET_EXHAUSTED');
      assert.equal(error.unknownOutcome, 'RESEND_WITH_KEY');
      assert.equal(error.resendWithSameKey, true);
      assert.equal(server.reads.length, 1);
    });
  });

  test("a hung POST running into the caller's deadline is ambiguous, decided locally", async () => {
    await withServer(['hold'], async (server) => {
      const error = await ambiguous(
        fetchWithRetries(client, `${server.url}/v1/charges`, post, { upstream: 'ts-pay', idempotency: 'NON_IDEMPOTENT', deadlineMs: 300 }),
      );
      assert.deepEqual([error.denyReason, error.unknownOutcome], ['DEADLINE', 'RECONCILE']);
      assert.equal(error.decision.decisionId, '', 'no question went to retryd');
      assert.match(error.decision.explanation, /deadline expired/);
      assert.equal(server.reads.length, 1);
    });
  });

  test("a hung safe GET running into the caller's deadline is a plain failure", async () => {
    await withServer(['hold'], async (server) => {
      await assert.rejects(
        fetchWithRetries(client, `${server.url}/items/7`, {}, { upstream: 'ts-pay', idempotency: 'SAFE', deadlineMs: 300 }),
        (error: unknown) => {
          assert.ok(!(error instanceof AmbiguousExecutionError), String(error));
          assert.deepEqual([decisionOf(error)?.denyReason, decisionOf(error)?.unknownOutcome], ['DEADLINE', 'NONE']);
          return true;
        },
      );
      assert.equal(server.reads.length, 1);
    });
  });

  test('a fresh connection reset after the POST was read: ambiguous, read once', async () => {
    await withServer(['reset', 'ok'], async (server) => {
      const counted = countingFetch();
      const error = await ambiguous(
        fetchWithRetries(client, `${server.url}/v1/charges`, post, { upstream: 'ts-pay', idempotency: 'NON_IDEMPOTENT', fetch: counted.fetch }),
      );
      assert.equal(error.decision.verdict, 'AMBIGUOUS');
      assert.deepEqual([server.reads.length, server.connections, counted.attempts()], [1, 1, 1]);
    });
  });

  // undici re-sends nothing by itself: were it to retry the GET on a new
  // connection, that read would answer 200 and the call would succeed. Which
  // connection undici picks is its own business (it releases a socket a tick
  // after the body ends), so the server resets the first request that comes
  // on a pooled connection, and the test calls until one did.
  for (const idempotency of ['NON_IDEMPOTENT', 'SAFE'] as const) {
    test(`a pooled connection reset after a GET declared ${idempotency} was read: every read was decided`, async () => {
      await withServer(['reset-if-reused'], async (server) => {
        const counted = countingFetch();
        const options: FetchRetryOptions = { upstream: 'ts-pay', idempotency, fetch: counted.fetch };
        let outcome: unknown;
        for (let call = 0; call < 20 && !server.reads.some((read) => read.reused); call++) {
          outcome = await fetchWithRetries(client, `${server.url}/balance`, {}, options).then(
            async (response) => (await response.text(), response),
            (error: unknown) => error,
          );
        }
        const resetAt = server.reads.findIndex((read) => read.reused);
        assert.ok(resetAt > 0, 'a request went out on a pooled connection');
        if (idempotency === 'NON_IDEMPOTENT') {
          assert.ok(outcome instanceof AmbiguousExecutionError, String(outcome));
          assert.equal(outcome.unknownOutcome, 'RECONCILE');
          assert.equal(server.reads.length, resetAt + 1, 'never re-sent, by undici or the adapter');
        } else {
          // Re-sent only as retryd allowed: a RETRY per reset, up to its
          // max_attempts (3); the re-send may land on a pooled connection too.
          assert.ok(server.reads.length - resetAt >= 2, 'retried after the reset');
          assert.ok(server.reads.length - resetAt <= 3, 'within max_attempts');
          const decision = decisionOf(outcome);
          assert.ok(
            (outcome instanceof Response && outcome.status === 200 && decision?.verdict === 'RETRY') || decision?.denyReason === 'MAX_ATTEMPTS',
            String(outcome),
          );
        }
        assert.equal(counted.attempts(), server.reads.length, 'every read was an attempt the adapter made');
      });
    });
  }
});

describe('re-sends while retryd is frozen or killed', { timeout: 60_000 }, () => {
  for (const how of ['frozen', 'killed'] as const) {
    test(`${how}: the local rule allows every attempt the server reads`, async () => {
      const server = await startRetryd(CLIENT_TEST_CONFIG);
      const logger = new CapturingLogger();
      const client = new RetrydClient(server.grpc, { logger });
      try {
        assert.equal(await client.connected, true);
        if (how === 'frozen') await server.freeze();
        else await server.kill();
        await withServer(['reset', 'ok'], async (upstream) => {
          const error = await ambiguous(
            fetchWithRetries(client, `${upstream.url}/v1/charges`, { method: 'POST', body: 'x' }, { upstream: 'ts-pay', idempotency: 'NON_IDEMPOTENT' }),
          );
          assert.equal(error.decision.fallback, true);
          assert.equal(upstream.reads.length, 1, 'a non-idempotent call is never re-sent');
        });
        await withServer(['503'], async (upstream) => {
          const counted = countingFetch();
          const response = await fetchWithRetries(client, `${upstream.url}/items/7`, {}, { upstream: 'ts-pay', idempotency: 'SAFE', fetch: counted.fetch });
          assert.equal(response.status, 503);
          assert.deepEqual([decisionOf(response)?.denyReason, decisionOf(response)?.fallback], ['MAX_ATTEMPTS', true]);
          assert.equal(upstream.reads.length, 2, "the local rule's limit: two attempts");
          assert.equal(counted.attempts(), upstream.reads.length);
        });
        assert.equal(logger.warnings.filter((line) => /did not answer/.test(line)).length, 1, logger.warnings.join('\n'));
      } finally {
        await client.close();
        await server.stop();
      }
    });
  }
});
