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
# Trees an older setup.py left in the checkout are removed first; today's
# builds in a temporary directory (setup.py), which is checked below.
rm -rf build src/*.egg-info
.venv/bin/python -m pip install --quiet -c constraints.txt ".[test]"
if [[ -e build ]] || compgen -G "src/*.egg-info" >/dev/null; then
  echo "run-tests.sh: pip install left build/ or *.egg-info in the checkout" >&2
  exit 1
fi
echo "== mypy --strict (retryd package)"
(cd "$here/tests" && ../.venv/bin/python -m mypy -p retryd)
echo "== README.md examples (compiled and type-checked)"
.venv/bin/python tools/check_readme.py README.md --mypy
echo "== pytest"
.venv/bin/python -m pytest -q "$@"
