/** conformance/hedging.json through RetrydClient.decideHedge against a real
 * retryd: the reports the vectors name go through sendTrafficReport (latency
 * histograms included), then every hedge case is asked as the adapters ask it.
 *
 * The four cases that put a failure on a hedge (evidence, failure, status,
 * Retry-After) cannot be expressed through decideHedge, which sends none by
 * design; they are retryd's own validation, run by the server's suite. */
import { strict as assert } from 'node:assert';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { InvalidRequestError, RetrydClient, type Idempotency, type TrafficEntry } from '../src';
import { REPO, startRetryd, type Retryd } from './support';

interface Case {
  name: string;
  request: Record<string, unknown>;
  expect?: Record<string, unknown>;
  expect_error?: { code: string; field: string };
}
type Histogram = { counts?: Record<string, number> };
const vectors = JSON.parse(fs.readFileSync(path.join(REPO, 'conformance', 'hedging.json'), 'utf8')) as {
  config: string;
  disable_upstreams: string[];
  reports: { traffic: (Record<string, unknown> & { upstream: string; latencySuccesses?: Histogram; latencyFailures?: Histogram })[] }[];
  cases: Case[];
};
const FAILURE_FIELDS = ['evidence', 'failure', 'httpStatus', 'retryAfter'];
const cases = vectors.cases.filter((c) => !FAILURE_FIELDS.some((field) => field in c.request));

function entryOf(traffic: (typeof vectors.reports)[number]['traffic'][number]): TrafficEntry {
  const histogram = (h: Histogram | undefined) =>
    h?.counts === undefined ? undefined : Object.fromEntries(Object.entries(h.counts).map(([index, n]) => [Number(index), Number(n)]));
  const entry: TrafficEntry = {
    upstream: traffic.upstream,
    requests: Number(traffic.requests ?? 0),
    successes: Number(traffic.successes ?? 0),
    failures: Number(traffic.failures ?? 0),
    retrySuccesses: 0,
    retryFailures: 0,
  };
  const successes = histogram(traffic.latencySuccesses);
  const failures = histogram(traffic.latencyFailures);
  if (successes !== undefined) entry.latencySuccesses = successes;
  if (failures !== undefined) entry.latencyFailures = failures;
  return entry;
}

describe('hedging conformance vectors', () => {
  let retryd: Retryd;
  let client: RetrydClient;
  before(async () => {
    retryd = await startRetryd(vectors.config);
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null, reporting: false });
    for (const upstream of vectors.disable_upstreams) await client.setRetriesEnabled(upstream, false, 'hedging conformance vectors');
    for (const report of vectors.reports) {
      const result = await client.sendTrafficReport(report.traffic.map(entryOf), '');
      assert.equal(result.accepted, report.traffic.length);
    }
  });
  after(async () => {
    await client?.close();
    await retryd?.stop();
  });

  test('only the failure cases are left out, and the report filled the hedging table', () => {
    const leftOut = vectors.cases.filter((c) => !cases.includes(c)).map((c) => c.name);
    assert.deepEqual(leftOut, ['hedge-with-evidence', 'hedge-with-status', 'hedge-with-failure', 'hedge-with-retry-after']);
    assert.ok(cases.length >= 15);
    assert.ok(client.hedging.plan('hedge-tail', 'IDEMPOTENT'));
    assert.ok(client.hedging.current('hedge-slow'));
    assert.equal(client.hedging.plan('hedge-slow', 'SAFE'), undefined); // uniformly slow: off
  });

  for (const c of cases) {
    test(c.name, async () => {
      const request = c.request;
      const input = {
        upstream: request.upstream as string,
        operation: request.operation as string,
        idempotency: (request.idempotency as string).replace(/^IDEMPOTENCY_/, '') as Idempotency,
        attempt: request.attempt as number,
        hedge: request.hedge as number,
        ...(request.deadlineRemaining === undefined ? {} : { deadlineRemainingMs: Number((request.deadlineRemaining as string).replace(/s$/, '')) * 1000 }),
      };
      // The vectors' deadlines are data here: the call itself gets 5 s.
      const options = { timeoutMs: 5000, boundByDeadline: false };
      if (c.expect_error !== undefined) {
        await assert.rejects(client.decideHedge(input, options), (error: unknown) => {
          assert.ok(error instanceof InvalidRequestError);
          assert.ok(error.message.startsWith(c.expect_error!.field), error.message);
          return true;
        });
        return;
      }
      const expect = c.expect!;
      const decision = await client.decideHedge(input, options);
      assert.deepEqual(
        {
          verdict: `VERDICT_${decision.verdict}`,
          deny_reason: decision.denyReason === null ? undefined : `DENY_REASON_${decision.denyReason}`,
          rule: decision.rule,
          effective_evidence: `EVIDENCE_${decision.effectiveEvidence}`,
          unknown_outcome: `UNKNOWN_OUTCOME_${decision.unknownOutcome}`,
        },
        {
          verdict: expect.verdict,
          deny_reason: expect.deny_reason,
          rule: expect.rule,
          effective_evidence: expect.effective_evidence,
          unknown_outcome: expect.unknown_outcome,
        },
        decision.explanation,
      );
      assert.equal(decision.fallback, false);
      assert.ok(decision.decisionId);
      if (decision.verdict === 'RETRY') {
        assert.ok(decision.backoffMs >= Number(expect.backoff_min_ms ?? 0) && decision.backoffMs <= Number(expect.backoff_max_ms ?? 0));
      }
    });
  }
});
