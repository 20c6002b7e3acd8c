// One TypeScript tier of the `layers` scenario (docs/fleet.md): a call chain
// edge → middle → back → the sick upstream (fleet/upstream.mjs), every tier
// a real process using the TypeScript client as its README says
// (clients/typescript: npm ci && npm run build). Its Python twin is
// fleet/tier.py (same config, protocol and counters).
//
//   node fleet/tier.mjs CONFIG.json
//
// role "service": an HTTP server on 127.0.0.1 (prints {"port": N}) whose
//   GET /items/N calls config.downstream_url + /items/N with the strategy and
//   answers 200 with the body, 503 when the call ended in a failed response,
//   504 when it ended without one (a timeout, a refused connection);
//   GET /_stats answers its counters (never counted as traffic).
// role "edge": an open-loop stream of GET /items/N to its downstream, as
//   fleet/caller.mjs: prints "ready", waits for "go EPOCH_MS", writes its
//   counters to config.out and prints "done".
//
// Calls the edge starts inside the fault window carry `x-fleet-tag: f`, which
// every service forwards, so that each tier and the upstream count the
// requests a logical call caused, however late they come.
//
// Strategies: naive (3 attempts), local (3 attempts, each retry a token of
// this process's own TpsBudget), retryd (fetchWithRetries; with
// config.lineage the inbound side is lineageHandler, else no inbound
// middleware and no baggage sent, so that retryd decides each hop alone, as
// before issue 31).
import { createRequire } from 'node:module';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
const client = require(path.join(here, '..', 'clients', 'typescript', 'dist', 'src', 'index.js'));
const { RetrydClient, fetchWithRetries, lineageHandler } = client;

const config = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const strategy = config.strategy;
const deadlineMs = Number(config.deadline_s) * 1000;
const attemptTimeoutMs = Number(config.attempt_timeout_s) * 1000;
const RETRYABLE = new Set([502, 503, 504]);
const TAG = 'x-fleet-tag';

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

/** tower/Finagle TpsBudget, as in fleet/caller.mjs. */
class TpsBudget {
  constructor(ttlS = 10, minPerSec = 10, percent = 0.2) {
    this.ttlMs = ttlS * 1000;
    this.percent = percent;
    this.reserve = minPerSec * ttlS;
    this.slots = [];
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

// Counters: by tag ("f" inside the fault window, "-" outside it).
const counts = {}; // name -> tag -> n
const decisions = {};
const decideMs = [];
let inFlight = 0; // inbound requests being served (the runner waits for 0)
function add(name, tag) {
  counts[name] ??= {};
  counts[name][tag] = (counts[name][tag] ?? 0) + 1;
}
function tally(label) {
  decisions[label] = (decisions[label] ?? 0) + 1;
}

class TimedClient extends RetrydClient {
  async decide(input, options) {
    const started = performance.now();
    const decision = await super.decide(input, options);
    decideMs.push(performance.now() - started);
    let label = decision.verdict;
    if (decision.verdict === 'DENY') label += ':' + decision.denyReason;
    if (decision.fallback) label = 'fallback ' + label;
    tally(label);
    return decision;
  }
}

const retryd = strategy === 'retryd' ? new TimedClient(config.retryd_target, { timeoutMs: 200, layer: config.layer }) : null;
const budget = strategy === 'local' ? new TpsBudget() : null;

/** Every attempt that leaves; without lineage, the attempt goes without the baggage member, as before issue 31. */
function attemptFetch(tag) {
  return (input, init) => {
    add('attempts', tag);
    if (!config.lineage && input instanceof Request) input.headers.delete('baggage');
    return fetch(input, init);
  };
}

/** One call downstream: 'ok', 'failed' (a failed response) or 'no-response'. */
async function callDownstream(k, tag) {
  const url = `${config.downstream_url}/items/${k}`;
  const headers = { [TAG]: tag };
  budget?.deposit();
  if (retryd) {
    try {
      const response = await fetchWithRetries(retryd, url, { method: 'GET', headers }, {
        upstream: config.retryd_upstream,
        idempotency: 'SAFE',
        deadlineMs,
        attemptTimeoutMs,
        fetch: attemptFetch(tag),
      });
      await response.arrayBuffer();
      return response.ok ? 'ok' : 'failed';
    } catch {
      return 'no-response';
    }
  }
  const send = attemptFetch(tag);
  const end = performance.now() + deadlineMs;
  for (let attempt = 1; ; attempt++) {
    const left = end - performance.now();
    let result;
    try {
      const response = await send(url, { method: 'GET', headers, signal: AbortSignal.timeout(Math.max(1, Math.min(attemptTimeoutMs, left))) });
      await response.arrayBuffer();
      if (response.ok) return 'ok';
      result = RETRYABLE.has(response.status) ? 'failed' : 'final';
    } catch {
      result = 'no-response';
    }
    if (result === 'final') return 'failed';
    if (attempt >= 3) return result;
    if (budget && !budget.withdraw()) {
      tally('local DENY:BUDGET');
      return result;
    }
    const backoff = random() * Math.min(1000, 50 * 2 ** (attempt - 1));
    if (backoff + 50 > end - performance.now()) return result;
    tally('local RETRY');
    await new Promise((resolve) => setTimeout(resolve, backoff));
  }
}

function reply(response, status, body) {
  const text = JSON.stringify(body);
  try {
    response.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
    response.end(text);
  } catch {
    /* the caller gave up */
  }
}

function serve() {
  const handle = (request, response) => {
    const route = request.url.split('?')[0];
    if (route === '/_stats') {
      reply(response, 200, { lang: 'typescript', layer: config.layer, counts, decisions, decide_ms: decideMs, cpu_s: cpuSeconds(), in_flight: inFlight });
      return;
    }
    const match = /^\/items\/(\d+)$/.exec(route);
    if (!match || request.method !== 'GET') {
      reply(response, 404, { error: 'no such route' });
      return;
    }
    const tag = request.headers[TAG] === 'f' ? 'f' : '-';
    add('inbound', tag);
    inFlight += 1;
    callDownstream(Number(match[1]), tag).finally(() => { inFlight -= 1; }).then(
      (outcome) => {
        add(outcome, tag);
        reply(response, outcome === 'ok' ? 200 : outcome === 'failed' ? 503 : 504, { outcome, layer: config.layer });
      },
      (error) => reply(response, 500, { error: String(error) }),
    );
  };
  // With lineage, the client's inbound wrapper: the handler's outbound calls
  // carry the request's lineage, and its 5xx says `retryd-retried` when its
  // call failed after retryd's decision.
  const server = http.createServer(config.lineage ? lineageHandler(handle) : handle);
  server.keepAliveTimeout = 30_000;
  server.listen(0, '127.0.0.1', () => process.stdout.write(JSON.stringify({ port: server.address().port }) + '\n'));
  process.on('SIGTERM', async () => {
    server.close();
    await retryd?.close();
    process.exit(0);
  });
}

function cpuSeconds() {
  const usage = process.cpuUsage();
  return (usage.user + usage.system) / 1e6;
}

async function edge() {
  const rate = Number(config.rate);
  const durationMs = Number(config.duration_s) * 1000;
  const [tagFrom, tagUntil] = config.tag_window_s.map((s) => s * 1000);
  process.stdout.write('ready\n');
  const lines = readline.createInterface({ input: process.stdin });
  const line = await new Promise((resolve) => lines.once('line', resolve));
  lines.close();
  const epochMs = Number(line.split(/\s+/)[1]);
  const mono0 = performance.now() - (Date.now() - epochMs);
  const offset = random() * (1000 / rate);
  const inFlight = new Set();
  let k = 0;
  for (; ; k++) {
    const at = offset + (k * 1000) / rate;
    if (at >= durationMs) break;
    const delay = mono0 + at - performance.now();
    if (delay > 0) await new Promise((resolve) => setTimeout(resolve, delay));
    const tag = at >= tagFrom && at < tagUntil ? 'f' : '-';
    add('first', tag);
    const promise = callDownstream(config.id * 1_000_000 + k, tag)
      .then((outcome) => add(outcome, tag))
      .finally(() => inFlight.delete(promise));
    inFlight.add(promise);
  }
  await Promise.all([...inFlight]);
  await retryd?.close();
  fs.writeFileSync(config.out, JSON.stringify({ lang: 'typescript', layer: config.layer, counts, decisions, decide_ms: decideMs, cpu_s: cpuSeconds() }));
  process.stdout.write('done\n');
}

(config.role === 'edge' ? edge() : Promise.resolve(serve())).catch((error) => {
  process.stderr.write(`tier failed: ${error?.stack ?? error}\n`);
  process.exit(1);
});
