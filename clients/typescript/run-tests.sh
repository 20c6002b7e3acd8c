#!/usr/bin/env bash
# Installs the TypeScript client's dependencies (npm ci, from package-lock.json),
# generates its types from ../../proto, compiles it, type-checks the README's
# examples, runs its node:test suite against a real retryd ($RETRYD_BIN,
# default <repo>/target/debug/retryd), and installs the packed tarball into a
# temporary project outside the repository to run the quick start there, as
# CommonJS and as an ES module.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RETRYD_BIN="${RETRYD_BIN:-$repo/target/debug/retryd}"
if [[ ! -x "$RETRYD_BIN" ]]; then
  echo "run-tests.sh: no retryd binary at $RETRYD_BIN (cargo build --bin retryd, or set RETRYD_BIN)" >&2
  exit 1
fi
cd "$here"
npm ci --no-audit --no-fund --loglevel=error
npm run build
node tools/check-readme.js
node --test --test-concurrency=1 dist/test/*.test.js
node tools/check-install.js
