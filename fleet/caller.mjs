// One TypeScript (Node.js) caller of the fleet: the twin of fleet/caller.py
// (same protocol, mix, strategies and counters; read its docstring). It uses
// the TypeScript client built as its README says (clients/typescript:
// npm ci && npm run build): RetrydClient and fetchWithRetries, whose
// reporter counts first attempts by default. The tail scenario's options
// (`tail`, `local_hedging`) are those of fleet/caller.py.
//
//   node fleet/caller.mjs CONFIG.json   prints "ready", waits for "go EPOCH_MS"
//                                       on stdin, prints "done" at the end
import { createRequire } from 'node:module';
import { randomUUID } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const client = require(path.join(here, '..', 'clients', 'typescript', 'dist', 'src', 'index.js'));
const { RetrydClient, fetchWithRetries, AmbiguousExecutionError } = client;

const config = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const strategy = config.strategy;
const rate = Number(config.rate);
const durationMs = Number(config.duration_s) * 1000;
const deadlineMs = Number(config.deadline_s) * 1000;
const attemptTimeoutMs = Number(config.attempt_timeout_s) * 1000;
const RETRYABLE = new Set([502, 503, 504]);
const tailMode = Boolean(config.tail);
const tailCalls = [];
const explanations = [];

// A small seeded generator, so a caller's schedule is the same for every
// strategy of a run.
function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const random = mulberry32(config.seed);

/** tower/Finagle TpsBudget: see TpsBudget in fleet/caller.py. */
class TpsBudget {
  constructor(ttlS = 10, minPerSec = 10, percent = 0.2) {
    this.ttlMs = ttlS * 1000;
    this.percent = percent;
    this.reserve = minPerSec * ttlS;
    this.slots = []; // [second, deposits, withdrawals]
  }
  slot() {
    const now = performance.now();
    const second = Math.floor(now / 1000) * 1000;
    while (this.slots.length && this.slots[0][0] <= now - this.ttlMs) this.slots.shift();
    if (!this.slots.length || this.slots[this.slots.length - 1][0] !== second) this.slots.push([second, 0, 0]);
    return this.slots[this.slots.length - 1];
  }
  deposit() {
    this.slot()[1] += 1;
  }
  withdraw() {
    const slot = this.slot();
    let deposits = 0;
    let withdrawals = 0;
    for (const s of this.slots) {
      deposits += s[1];
      withdrawals += s[2];
    }
    if (this.reserve + this.percent * deposits - withdrawals >= 1) {
      slot[2] += 1;
      return true;
    }
    return false;
  }
}

let epochMs = 0;
const series = {};
const decisions = {};
const decideMs = [];
const callMs = [];
const failedKeys = [];
function bucketOf(atMs) {
  return Math.floor((atMs - epochMs) / config.bucket_ms);
}
function add(name, atMs = Date.now()) {
  const b = bucketOf(atMs);
  series[name] ??= {};
  series[name][b] = (series[name][b] ?? 0) + 1;
}
function tally(label) {
  decisions[label] = (decisions[label] ?? 0) + 1;
}

/** The real RetrydClient, timing each decision as the caller waits for it and counting verdicts. */
class TimedClient extends RetrydClient {
  async decide(input, options) {
    const started = performance.now();
    const decision = await super.decide(input, options);
    decideMs.push(performance.now() - started);
    let label = decision.verdict;
    if (decision.verdict === 'DENY') label += ':' + decision.denyReason;
    if (decision.fallback) label = 'fallback ' + label;
    tally(label);
    add('decisions');
    if (decision.verdict === 'RETRY' && !decision.fallback) add('granted');
    return decision;
  }
  async decideHedge(input, options) {
    const decision = await super.decideHedge(input, options);
    let label = `hedge ${decision.verdict}`;
    if (decision.verdict === 'DENY') label += ':' + decision.denyReason;
    if (decision.fallback) label = 'fallback ' + label;
    tally(label);
    add('hedge_asked');
    explanations.push(`${((Date.now() - epochMs) / 1000).toFixed(1)}s ${decision.explanation}`);
    explanations.splice(3, Math.max(0, explanations.length - 6));
    if (decision.verdict === 'RETRY') add('hedge_granted');
    return decision;
  }
}

const localHedging = config.local_hedging
  ? { delayMs: config.local_hedging.delay_s * 1000, maxHedges: config.local_hedging.max_hedges, maxExtraLoad: config.local_hedging.max_extra_load }
  : undefined;
const retryd = strategy === 'retryd' ? new TimedClient(config.retryd_target, { timeoutMs: 200, ...(localHedging ? { localHedging } : {}) }) : null;
const budget = strategy === 'local' ? new TpsBudget() : null;

// Every attempt that leaves, whichever strategy sends it.
const countingFetch = (input, init) => {
  add('attempts');
  return fetch(input, init);
};

async function ownLoop(url, init) {
  const attempts = strategy === 'none' ? 1 : 3;
  const end = performance.now() + deadlineMs;
  for (let attempt = 1; ; attempt++) {
    const left = end - performance.now();
    let retryable = false;
    try {
      const response = await countingFetch(url, { ...init, signal: AbortSignal.timeout(Math.max(1, Math.min(attemptTimeoutMs, left))) });
      await response.arrayBuffer();
      if (response.status >= 200 && response.status < 300) return 'ok';
      retryable = RETRYABLE.has(response.status);
    } catch {
      retryable = true; // a timeout, a refused or reset connection
    }
    if (!retryable || attempt >= attempts) return 'failed';
    if (budget && !budget.withdraw()) {
      tally('local DENY:BUDGET');
      return 'failed';
    }
    const backoff = random() * Math.min(1000, 50 * 2 ** (attempt - 1));
    if (backoff + 50 > end - performance.now()) return 'failed';
    tally('local RETRY');
    await new Promise((resolve) => setTimeout(resolve, backoff));
  }
}

async function call(k, kind, startedAtMs) {
  const started = performance.now();
  let url;
  let init;
  let idempotency;
  let copy = 0;
  if (kind === 'GET') {
    url = `${config.upstream_url}/items/${tailMode ? `ts-${config.id}-${k}` : k}`;
    init = { method: 'GET' };
    idempotency = 'SAFE';
  } else {
    // One key per logical payment, the same on every attempt of it.
    // POST /charges does not deduplicate (NON_IDEMPOTENT); /keyed-charges
    // honours the key, so there the declaration IDEMPOTENT_WITH_KEY is true.
    url = `${config.upstream_url}/${config.keyed ? 'keyed-charges' : 'charges'}`;
    init = {
      method: 'POST',
      headers: { 'Idempotency-Key': `ts-${config.id}-${randomUUID()}`, 'content-type': 'application/json' },
      body: JSON.stringify({ amount: 100 + k }),
    };
    idempotency = config.keyed ? 'IDEMPOTENT_WITH_KEY' : 'NON_IDEMPOTENT';
  }
  budget?.deposit();
  let outcome;
  try {
    if (retryd) {
      const response = await fetchWithRetries(retryd, url, init, {
        upstream: config.retryd_upstream,
        idempotency,
        deadlineMs,
        attemptTimeoutMs,
        fetch: countingFetch,
      });
      await response.arrayBuffer();
      outcome = response.status >= 200 && response.status < 300 ? 'ok' : 'failed';
      copy = Number(response.headers.get('x-fleet-copy') ?? 0);
    } else {
      outcome = await ownLoop(url, init);
      copy = 1;
    }
  } catch (error) {
    outcome = error instanceof AmbiguousExecutionError ? 'ambiguous' : 'failed';
    if (tailMode) tally(`error ${error?.name ?? 'unknown'}`);
  }
  add(outcome, startedAtMs);
  // The idempotent calls apart (issue 32 compares their success).
  if (kind === 'GET') add(`get_${outcome}`, startedAtMs);
  // See failed_keys in fleet/caller.py: compared with the upstream's charges.
  if (kind === 'POST' && outcome === 'failed') failedKeys.push(init.headers['Idempotency-Key']);
  if (outcome === 'ok') {
    callMs.push(performance.now() - started);
    if (tailMode) tailCalls.push([Math.round(startedAtMs - epochMs) / 1000, Math.round((performance.now() - started) * 100) / 100, copy]);
  }
}

async function main() {
  if (tailMode) {
    // See the warm-up in fleet/caller.py: warm connections, nothing recorded.
    for (let round = 0; round < 3; round++) {
      await Promise.all(Array.from({ length: 20 }, (_, i) => fetch(`${config.upstream_url}/items/warm-ts-${config.id}-${i}`).then((r) => r.arrayBuffer())));
    }
  }
  process.stdout.write('ready\n');
  const lines = readline.createInterface({ input: process.stdin });
  const line = await new Promise((resolve) => lines.once('line', resolve));
  lines.close();
  epochMs = Number(line.split(/\s+/)[1]);
  const mono0 = performance.now() - (Date.now() - epochMs); // performance.now() at the epoch
  const offset = random() * (1000 / rate);
  const inFlight = new Set();
  let k = 0;
  for (; ; k++) {
    const at = offset + (k * 1000) / rate;
    if (at >= durationMs) break;
    const delay = mono0 + at - performance.now();
    if (delay > 0) await new Promise((resolve) => setTimeout(resolve, delay));
    add('first', epochMs + at);
    if (inFlight.size >= config.max_in_flight) {
      add('shed', epochMs + at);
      continue;
    }
    const kind = random() < 0.5 || tailMode ? 'GET' : 'POST';
    if (kind === 'GET') add('get_first', epochMs + at);
    const promise = call(k, kind, epochMs + at).finally(() => inFlight.delete(promise));
    inFlight.add(promise);
  }
  // Every call is bounded by its deadline, so this ends.
  await Promise.all([...inFlight]);
  let reporterDropped = null;
  if (retryd) {
    const reporter = retryd.reporter;
    await retryd.close(); // sends the traffic counted so far
    reporterDropped = reporter ? reporter.dropped : null;
  }
  const usage = process.cpuUsage();
  fs.writeFileSync(
    config.out,
    JSON.stringify({
      lang: 'typescript',
      id: config.id,
      strategy,
      arrivals: k,
      series,
      decisions,
      decide_ms: decideMs,
      call_ms: callMs,
      cpu_s: (usage.user + usage.system) / 1e6,
      reporter_dropped: reporterDropped,
      unfinished: 0,
      failed_charge_keys: failedKeys,
      tail_calls: tailCalls,
      hedge_explanations: explanations,
    }),
  );
  process.stdout.write('done\n');
}

main().catch((error) => {
  process.stderr.write(`caller failed: ${error?.stack ?? error}\n`);
  process.exit(1);
});
