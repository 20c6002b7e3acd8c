#!/usr/bin/env bash
# Generates the Go code of the contract, proto/retryd/v1/retryd.proto, into
# clients/go/retrydv1 (or into $1/retrydv1). The proto file is not edited:
# its Go package is given with protoc's M option.
#
# protoc-gen-go is built from the google.golang.org/protobuf the module builds
# with (the offline vendor tree, see debian-vendor.sh); protoc-gen-go-grpc and
# protoc come from PATH (Debian: protoc-gen-go-grpc, protobuf-compiler).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$here}"
module=github.com/retryd/retryd/clients/go
mapping="Mretryd/v1/retryd.proto=$module/retrydv1"
bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
(cd "$here" && go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go)
mkdir -p "$out/retrydv1"
PATH="$bin:$PATH" protoc -I "$here/../../proto" \
  --go_out="$out" --go_opt=module="$module" --go_opt="$mapping" \
  --go-grpc_out="$out" --go-grpc_opt=module="$module" --go-grpc_opt="$mapping" \
  retryd/v1/retryd.proto
