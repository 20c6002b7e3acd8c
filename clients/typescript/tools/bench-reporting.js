#!/usr/bin/env node
// What recording one first attempt costs the caller (issue 33): a
// micro-benchmark on the built package (npm run build first).
//
// Per operation, on a reporter with no network (it only adds to in-memory
// counters): recordLatency (the bucket and the histogram increment); a whole
// first attempt's bookkeeping as the adapters do it (record, recordOutcome,
// recordLatency) beside the same without recordLatency; and the hedging
// table's plan(), the lookup every call makes before it is sent.
//
// Run: node tools/bench-reporting.js   (best of 5 rounds of 200 000, ns/op)
'use strict';
const path = require('node:path');
const { TrafficReporter, HedgingTable } = require(path.resolve(__dirname, '..', 'dist', 'src'));

const ROUNDS = 5;
const N = 200_000;
const sink = { sendTrafficReport: async () => ({ accepted: 0, alreadyApplied: 0 }) };
const reporter = new TrafficReporter(sink, { intervalMs: 3_600_000 });
// A lognormal spread of latencies around 2 ms, so that many buckets are in use.
let seed = 7;
const random = () => ((seed = (seed * 16807) % 2147483647) / 2147483647);
const latencies = Array.from({ length: N }, () => Math.exp(Math.log(2) + 0.8 * Math.sqrt(-2 * Math.log(random())) * Math.cos(2 * Math.PI * random())));
const upstreams = Array.from({ length: N }, (_, i) => `upstream-${i % 16}`);

function best(label, body) {
  let fastest = Infinity;
  for (let round = 0; round < ROUNDS; round++) {
    const started = process.hrtime.bigint();
    body();
    fastest = Math.min(fastest, Number(process.hrtime.bigint() - started));
  }
  console.log(`${label.padEnd(58)} ${(fastest / N).toFixed(0).padStart(8)} ns`);
}

best('recordLatency (bucket + histogram)', () => {
  for (let i = 0; i < N; i++) reporter.recordLatency(upstreams[i], true, latencies[i]);
});
best('record + recordOutcome (before issue 33)', () => {
  for (let i = 0; i < N; i++) {
    reporter.record(upstreams[i]);
    reporter.recordOutcome(upstreams[i], true, false);
  }
});
best('record + recordOutcome + recordLatency (a first attempt)', () => {
  for (let i = 0; i < N; i++) {
    reporter.record(upstreams[i]);
    reporter.recordOutcome(upstreams[i], true, false);
    reporter.recordLatency(upstreams[i], true, latencies[i]);
  }
});
const table = new HedgingTable(3000);
table.update(Array.from({ length: 16 }, (_, i) => ({ upstream: `upstream-${i}`, enabled: true, delayMs: 10, maxHedges: 1, idempotency: new Set(['SAFE']) })));
best('HedgingTable.plan (per call)', () => {
  for (let i = 0; i < N; i++) table.plan(upstreams[i], 'SAFE');
});
const held = Object.keys(reporter.pendingTraffic()['upstream-0'].latencySuccesses).length;
console.log(`buckets held for one upstream after ${(ROUNDS * 2 * N) / 16} latencies: ${held}`);
