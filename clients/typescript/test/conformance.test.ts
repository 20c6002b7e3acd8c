/** The language-neutral conformance vectors, through RetrydClient.decide against a real retryd. */
import { strict as assert } from 'node:assert';
import * as fs from 'node:fs';
import { after, before, describe, test } from 'node:test';
import { InvalidRequestError, leavesOutcomeUnknown, localDecide, RetrydClient, type Body, type DecideInput } from '../src';
import { startRetryd, VECTORS, type Retryd } from './support';

interface Case {
  name: string;
  request: Record<string, unknown>;
  expect?: Record<string, unknown>;
  expect_error?: { code: string; field: string };
}
const vectors = JSON.parse(fs.readFileSync(VECTORS, 'utf8')) as {
  config: string;
  disable_upstreams?: string[];
  cases: Case[];
};

/** "IDEMPOTENCY_SAFE" -> "SAFE"; numbers pass through unchanged. */
function enumArg<T extends string>(prefix: string, value: unknown): T | number | undefined {
  if (value === undefined) return undefined;
  if (typeof value === 'number') return value;
  assert.ok(typeof value === 'string' && value.startsWith(prefix), `${String(value)} lacks ${prefix}`);
  return value.slice(prefix.length) as T;
}

/** "1.5s" -> 1500 */
function ms(value: unknown): number | undefined {
  if (value === undefined) return undefined;
  assert.ok(typeof value === 'string' && value.endsWith('s'));
  return Number(value.slice(0, -1)) * 1000;
}

function bodyArg(value: unknown): Body | undefined {
  if (value === undefined) return undefined;
  const body = value as { kind?: unknown; declared?: unknown; parts?: unknown[] };
  return {
    kind: enumArg<Body['kind'] & string>('BODY_KIND_', body.kind) ?? 'NONE',
    declared: enumArg('REPLAYABILITY_', body.declared) as Body['declared'],
    parts: (body.parts ?? []).map((part) => bodyArg(part)!),
  };
}

/** The proto3 JSON of a DecideRequest as a DecideInput. */
function decideInput(request: Record<string, unknown>): DecideInput {
  return {
    upstream: (request.upstream as string | undefined) ?? '',
    operation: request.operation as string | undefined,
    idempotency: enumArg<DecideInput['idempotency'] & string>('IDEMPOTENCY_', request.idempotency) ?? 0,
    attempt: (request.attempt as number | undefined) ?? 0,
    evidence: enumArg('EVIDENCE_', request.evidence) as DecideInput['evidence'],
    failure: enumArg('FAILURE_KIND_', request.failure) as DecideInput['failure'],
    httpStatus: request.httpStatus as number | undefined,
    retryAfter: request.retryAfter as string | undefined,
    deadlineRemainingMs: ms(request.deadlineRemaining),
    body: bodyArg(request.body),
    firstByteDelivered: request.firstByteDelivered as boolean | undefined,
    runtimeDraining: request.runtimeDraining as boolean | undefined,
    authRefreshAttempted: request.authRefreshAttempted as boolean | undefined,
    previousBackoffMs: ms(request.previousBackoff),
    maxAttempts: request.maxAttempts as number | undefined,
    grpcStatusCode: request.grpcStatusCode as number | undefined,
    lineage: request.lineage as string | undefined,
    retriedBelow: request.retriedBelow as string | undefined,
    // Presence matters: an absent trailer and an empty one are different cases.
    grpcRetryPushbackMs: 'grpcRetryPushbackMs' in request ? (request.grpcRetryPushbackMs as string) : undefined,
  };
}

describe('conformance vectors', () => {
  let retryd: Retryd;
  let client: RetrydClient;

  before(async () => {
    retryd = await startRetryd(vectors.config);
    // No fallback: a broken or missing server must fail these tests.
    client = new RetrydClient(retryd.grpc, { timeoutMs: 5000, fallback: null });
    for (const upstream of vectors.disable_upstreams ?? []) {
      await client.setRetriesEnabled(upstream, false, 'conformance vectors');
    }
  });

  after(async () => {
    client?.close();
    await retryd?.stop();
  });

  test('the file has enough distinct vectors', () => {
    assert.ok(vectors.cases.length >= 60);
    assert.ok(vectors.cases.filter((c) => c.expect_error).length >= 10);
    assert.equal(new Set(vectors.cases.map((c) => c.name)).size, vectors.cases.length);
  });

  for (const vector of vectors.cases) {
    test(vector.name, async () => {
      const input = decideInput(vector.request);
      if (vector.expect_error) {
        assert.equal(vector.expect_error.code, 'INVALID_ARGUMENT');
        await assert.rejects(client.decide(input, { boundByDeadline: false }), (error: unknown) => {
          assert.ok(error instanceof InvalidRequestError, String(error));
          assert.ok(error.message.startsWith(vector.expect_error!.field), error.message);
          return true;
        });
        return;
      }
      const expect = vector.expect!;
      // A vector's deadline is data, not this runner's: on a busy machine a
      // 10 ms deadline must not bound the wait for the answer.
      const decision = await client.decide(input, { boundByDeadline: false });
      const got: Record<string, unknown> = {
        verdict: `VERDICT_${decision.verdict}`,
        deny_reason: decision.denyReason === null ? undefined : `DENY_REASON_${decision.denyReason}`,
        rule: decision.rule,
        effective_evidence: `EVIDENCE_${decision.effectiveEvidence}`,
      };
      const want: Record<string, unknown> = {
        verdict: expect.verdict,
        deny_reason: expect.deny_reason,
        rule: expect.rule,
        effective_evidence: expect.effective_evidence,
      };
      if ('evidence_adjusted' in expect) {
        got.evidence_adjusted = decision.evidenceAdjusted;
        want.evidence_adjusted = expect.evidence_adjusted;
      }
      if ('refresh_credentials' in expect) {
        got.refresh_credentials = decision.refreshCredentials;
        want.refresh_credentials = expect.refresh_credentials;
      }
      // Every vector carries the mark; a missing one would fail here.
      assert.ok(typeof expect.unknown_outcome === 'string', 'the vector has no unknown_outcome');
      got.unknown_outcome = `UNKNOWN_OUTCOME_${decision.unknownOutcome}`;
      want.unknown_outcome = expect.unknown_outcome;
      assert.deepEqual(got, want, decision.explanation);
      // What the adapters do with it: an ambiguous execution for AMBIGUOUS
      // and for any DENY with a mark, never the plain failure.
      assert.equal(
        leavesOutcomeUnknown(decision),
        expect.verdict === 'VERDICT_AMBIGUOUS' || (expect.verdict === 'VERDICT_DENY' && expect.unknown_outcome !== 'UNKNOWN_OUTCOME_NONE'),
      );
      // The local rule decides differently (no budget, no policy) but marks
      // the same facts the same way.
      assert.equal(`UNKNOWN_OUTCOME_${localDecide(input).unknownOutcome}`, expect.unknown_outcome, 'the local rule\'s mark');
      assert.equal(decision.fallback, false);
      assert.ok(decision.decisionId);
      if (decision.verdict === 'RETRY') {
        if (typeof expect.backoff_min_ms === 'number') assert.ok(decision.backoffMs >= expect.backoff_min_ms - 1e-6, `backoff ${decision.backoffMs}`);
        if (typeof expect.backoff_max_ms === 'number') assert.ok(decision.backoffMs <= expect.backoff_max_ms + 1e-6, `backoff ${decision.backoffMs}`);
      } else {
        assert.equal(decision.backoffMs, 0);
      }
    });
  }
});
