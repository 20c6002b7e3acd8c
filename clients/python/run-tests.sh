#!/usr/bin/env bash
# Installs the Python client into clients/python/.venv (from PyPI, with its
# stubs generated from ../../proto during the build) and runs its test suite
# against a real retryd: $RETRYD_BIN, default <repo>/target/debug/retryd.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RETRYD_BIN="${RETRYD_BIN:-$repo/target/debug/retryd}"
if [[ ! -x "$RETRYD_BIN" ]]; then
  echo "run-tests.sh: no retryd binary at $RETRYD_BIN (cargo build --bin retryd, or set RETRYD_BIN)" >&2
  exit 1
fi
python="${PYTHON:-python3}"
cd "$here"
if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# A regular (not editable) install: the tests exercise the built package.
# A clean build tree, so that no stale module from an earlier build is packed.
rm -rf build src/*.egg-info
.venv/bin/python -m pip install --quiet -c constraints.txt ".[test]"
echo "== mypy --strict (retryd package)"
(cd "$here/tests" && ../.venv/bin/python -m mypy -p retryd)
echo "== pytest"
.venv/bin/python -m pytest -q "$@"
