/** Shadow upstreams (issue 22): retryd's answer for an upstream with
 * `enforce = false` is not acted on; the client's local rule decides, and the
 * differences are counted and logged at most once per interval. Against a
 * real retryd (its own, configured here) and HTTP servers of the test's own
 * on 127.0.0.1 that count the requests they get. */
import { strict as assert } from 'node:assert';
import { after, before, describe, test } from 'node:test';
import { decisionOf, fetchWithRetries, RetrydClient, type DecideInput, type Decision } from '../src';
import { CapturingLogger, respond, ScriptedServer, startRetryd, type Action, type Retryd } from './support';

// Each shadow upstream has an enforced twin with the same policy, so that the
// same facts show both sides. transient_500 makes retryd retry a 500 on an
// idempotent call, which the local rule never does; an empty budget makes
// retryd deny what the local rule retries.
const CONFIG = `
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "1ms", max = "5ms", jitter = "full" }

[upstreams."shadow-500"]
enforce = false
transient_500 = true

[upstreams."live-500"]
transient_500 = true

[upstreams."shadow-empty"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."live-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }

[upstreams."shadow-log-other"]
enforce = false
budget = { capacity = 10.0, initial = 0.0, ratio = 0.0, min_per_second = 0.0 }
`;

async function withServer<T>(actions: Action[], body: (server: ScriptedServer) => Promise<T>): Promise<T> {
  const server = await ScriptedServer.start(actions);
  try {
    return await body(server);
  } finally {
    await server.close();
  }
}

const sleep = async (ms: number): Promise<void> => {
  assert.ok(ms >= 0 && ms <= 2000, `backoff ${ms} ms`);
};

describe('shadow upstreams', () => {
  let retryd: Retryd;
  let logger: CapturingLogger;
  let client: RetrydClient;

  before(async () => {
    retryd = await startRetryd(CONFIG);
  });
  after(async () => {
    await retryd?.stop();
  });

  /** A fresh client per test, so each test sees its own counts and warnings. */
  async function withClient<T>(body: (client: RetrydClient) => Promise<T>, intervalMs?: number): Promise<T> {
    logger = new CapturingLogger();
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, reporting: false, logger, shadowLogIntervalMs: intervalMs });
    try {
      return await body(client);
    } finally {
      await client.close();
    }
  }

  test('a shadow RETRY the local rule denies is not retried', () =>
    withClient(async (client) => {
      await withServer([respond(500), respond(200)], async (server) => {
        const response = await fetchWithRetries(client, server.url, {}, { upstream: 'shadow-500', idempotency: 'SAFE', sleep });
        assert.equal(response.status, 500);
        assert.equal(server.requests.length, 1, 'the local rule never retries a 500');
        const decision = decisionOf(response);
        assert.ok(decision);
        assert.equal(decision.shadow, true);
        assert.equal(decision.fallback, false);
        assert.deepEqual([decision.verdict, decision.denyReason], ['DENY', 'STATUS_NOT_RETRYABLE']);
        assert.match(decision.explanation, /shadow/);
        assert.ok(Number.isNaN(decision.tokensRemaining));
        const shadow = decision.retrydDecision;
        assert.ok(shadow);
        assert.equal(shadow.shadow, true);
        assert.equal(shadow.retrydDecision, null);
        assert.deepEqual([shadow.verdict, shadow.rule], ['RETRY', 9]);
        assert.ok(shadow.decisionId);
        assert.equal(decision.decisionId, shadow.decisionId);
      });
      assert.deepEqual([...client.shadowDivergences()], [['shadow-500', 1]]);
    }));

  test('a shadow BUDGET_EXHAUSTED the local rule retries is retried', () =>
    withClient(async (client) => {
      await withServer([respond(503), respond(200, 'ok')], async (server) => {
        const response = await fetchWithRetries(client, server.url, {}, { upstream: 'shadow-empty', idempotency: 'SAFE', sleep });
        assert.equal(response.status, 200);
        assert.equal(await response.text(), 'ok');
        assert.equal(server.requests.length, 2);
        const decision = decisionOf(response);
        assert.ok(decision);
        assert.deepEqual([decision.shadow, decision.verdict], [true, 'RETRY']);
        assert.deepEqual([decision.retrydDecision?.verdict, decision.retrydDecision?.denyReason], ['DENY', 'BUDGET_EXHAUSTED']);
      });
      // The same direction for a connect failure of a payment, straight from decide.
      const decision = await client.decide({ upstream: 'shadow-empty', idempotency: 'NON_IDEMPOTENT', attempt: 1, failure: 'CONNECT' });
      assert.deepEqual([decision.shadow, decision.verdict, decision.rule], [true, 'RETRY', 9]);
      assert.deepEqual([decision.retrydDecision?.verdict, decision.retrydDecision?.denyReason], ['DENY', 'BUDGET_EXHAUSTED']);
      assert.equal(client.shadowDivergences().get('shadow-empty'), 2);
    }));

  test("an enforced upstream acts on retryd's decision", () =>
    withClient(async (client) => {
      await withServer([respond(500)], async (server) => {
        const response = await fetchWithRetries(client, server.url, {}, { upstream: 'live-500', idempotency: 'SAFE', sleep });
        assert.equal(response.status, 500);
        assert.equal(server.requests.length, 3, 'retryd retries a transient 500 up to max_attempts');
      });
      await withServer([respond(503), respond(200)], async (server) => {
        const response = await fetchWithRetries(client, server.url, {}, { upstream: 'live-empty', idempotency: 'SAFE', sleep });
        assert.equal(response.status, 503);
        assert.equal(server.requests.length, 1);
        const decision = decisionOf(response);
        assert.ok(decision);
        assert.deepEqual([decision.shadow, decision.retrydDecision, decision.denyReason], [false, null, 'BUDGET_EXHAUSTED']);
      });
      assert.equal(client.shadowDivergences().size, 0);
    }));

  test('differences are logged once per interval per upstream, with the count', () =>
    withClient(async (client) => {
      const differing = async (upstream = 'shadow-log'): Promise<Decision> => {
        // retryd: DENY BUDGET_EXHAUSTED (empty); the local rule: RETRY a 503 GET.
        const input: DecideInput = { upstream, idempotency: 'SAFE', attempt: 1, httpStatus: 503 };
        const decision = await client.decide(input);
        assert.deepEqual([decision.verdict, decision.retrydDecision?.denyReason], ['RETRY', 'BUDGET_EXHAUSTED']);
        return decision;
      };
      for (let i = 0; i < 4; i++) await differing();
      // Both sides agree here (attempt 3: retryd's limit is 3, the local
      // rule's 2): neither counted nor logged.
      const agreed = await client.decide({ upstream: 'shadow-log', idempotency: 'SAFE', attempt: 3, httpStatus: 503 });
      assert.deepEqual([agreed.shadow, agreed.denyReason, agreed.retrydDecision?.denyReason], [true, 'MAX_ATTEMPTS', 'MAX_ATTEMPTS']);
      assert.equal(logger.warnings.length, 1, logger.warnings.join('\n'));
      const line = logger.warnings[0]!;
      assert.match(line, /"shadow-log"/);
      assert.match(line, /retryd DENY BUDGET_EXHAUSTED, local rule RETRY \(acted on\); 0 more/);
      assert.deepEqual([...client.shadowDivergences()], [['shadow-log', 4]]);

      // Another upstream has its own interval.
      await differing('shadow-log-other');
      assert.equal(logger.warnings.length, 2);
      assert.match(logger.warnings[1]!, /"shadow-log-other"/);

      // Once the interval has passed (the clock moved on, not slept), the next
      // difference is logged with the three that were not.
      (client as unknown as { shadowLog: { now: () => number } }).shadowLog.now = () => performance.now() + 1_000_000;
      await differing();
      assert.equal(logger.warnings.length, 3);
      assert.match(logger.warnings[2]!, /"shadow-log".*; 3 more difference\(s\)/);
      assert.deepEqual(
        [...client.shadowDivergences()],
        [
          ['shadow-log', 5],
          ['shadow-log-other', 1],
        ],
      );
    }, 60_000));

  test('a bad log interval is refused', () => {
    assert.throws(() => new RetrydClient(retryd.grpc, { reporting: false, shadowLogIntervalMs: -1 }), /shadowLogIntervalMs/);
  });
});
