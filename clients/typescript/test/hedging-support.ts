/** What the hedging tests share: latencies fed to a real retryd through the client's reporter. */
import { strict as assert } from 'node:assert';
import type { RetrydClient } from '../src';
import type { Retryd } from './support';

/**
 * Reports, through the client's own reporter, first attempts with a tail (90%
 * at 10 ms, 10% at 100 ms, so retryd's p95, its hedge delay, is about 100 ms);
 * the report's answer fills the client's hedging table.
 */
export async function feed(client: RetrydClient, upstream: string, requests = 200): Promise<void> {
  const reporter = client.reporter!;
  reporter.record(upstream, requests);
  reporter.recordOutcome(upstream, true, false, requests);
  for (let n = 0; n < requests; n++) reporter.recordLatency(upstream, true, n % 10 === 0 ? 100 : 10);
  assert.equal(await reporter.flush(), true);
}

/** retryd_hedges_won_total for one upstream, scraped from retryd's /metrics. */
export async function hedgesWon(retryd: Retryd, upstream: string): Promise<number> {
  const text = await (await fetch(`http://${retryd.metrics}/metrics`)).text();
  let total = 0;
  for (const line of text.split('\n')) {
    if (line.startsWith('retryd_hedges_won_total{') && line.includes(`upstream="${upstream}"`)) total += Number(line.slice(line.lastIndexOf(' ') + 1));
  }
  return total;
}
