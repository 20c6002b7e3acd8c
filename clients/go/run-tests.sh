#!/usr/bin/env bash
# Builds the Go client offline against Debian's Go packages and runs its
# whole suite (gofmt, go vet, go test -race) against a real retryd:
# $RETRYD_BIN, default <repo>/target/debug/retryd.
#
# Needs (Debian 12): golang-go, golang-google-grpc-dev,
# golang-google-protobuf-dev, protobuf-compiler, protoc-gen-go-grpc, and gcc
# for the race detector. No module proxy is used: tools/debian-vendor.sh
# assembles a git-ignored vendor tree from /usr/share/gocode/src.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RETRYD_BIN="${RETRYD_BIN:-$repo/target/debug/retryd}"
if [[ ! -x "$RETRYD_BIN" ]]; then
  echo "run-tests.sh: no retryd binary at $RETRYD_BIN (cargo build --bin retryd, or set RETRYD_BIN)" >&2
  exit 1
fi
export GOFLAGS=-mod=vendor GOPROXY=off GOTOOLCHAIN=local GO111MODULE=on
cd "$here"
echo "== vendor tree from Debian's packages"
bash tools/debian-vendor.sh
echo "== gofmt"
unformatted="$(find . -name '*.go' -not -path './vendor/*' -print0 | xargs -0 gofmt -l)"
if [[ -n "$unformatted" ]]; then
  echo "run-tests.sh: not gofmt-ed: $unformatted" >&2
  exit 1
fi
echo "== go vet"
go vet ./...
echo "== go test -race"
go test -race -count=1 -timeout 10m ./... "$@"
