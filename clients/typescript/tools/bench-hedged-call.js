#!/usr/bin/env node
// What a hedge timer costs a fast call (issue 33): fetchWithRetries to a
// loopback HTTP server answering at once, with the upstream's hedging on (a
// delay of 1 s that never fires) and off. No retryd is asked either way (a
// fast call never asks); the client's target is a closed port.
//
// Run: node tools/bench-hedged-call.js   (after npm run build; µs per call,
// the best of 10 interleaved rounds of 500 sequential calls)
'use strict';
const http = require('node:http');
const path = require('node:path');
const { RetrydClient, fetchWithRetries } = require(path.resolve(__dirname, '..', 'dist', 'src'));

const ROUNDS = 10;
const N = 500;

async function main() {
  const server = http.createServer((_, res) => res.end('ok'));
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${server.address().port}/`;
  const quiet = { warn: () => undefined };
  const client = new RetrydClient('127.0.0.1:1', { connectTimeoutMs: 100, logger: quiet, reporting: { intervalMs: 3_600_000, logger: quiet } });
  client.hedging.update([{ upstream: 'hedged', enabled: true, delayMs: 1000, maxHedges: 1, idempotency: new Set(['SAFE']) }]);
  const fastest = { plain: Infinity, hedged: Infinity };
  // Rounds interleaved, so that a busy machine's bad moments hit both.
  for (let round = 0; round < ROUNDS; round++) {
    for (const upstream of Object.keys(fastest)) {
      const started = process.hrtime.bigint();
      for (let i = 0; i < N; i++) await (await fetchWithRetries(client, url, {}, { upstream, idempotency: 'SAFE' })).text();
      fastest[upstream] = Math.min(fastest[upstream], Number(process.hrtime.bigint() - started));
    }
  }
  for (const [upstream, ns] of Object.entries(fastest)) console.log(`${upstream.padEnd(8)} ${(ns / N / 1000).toFixed(1).padStart(8)} µs per call`);
  server.closeAllConnections();
  server.close();
  await client.close();
}
main();
