#!/usr/bin/env bash
# Usage: debian-vendor.sh [MODULE_DIR]
#
# Assembles clients/go/vendor from Debian's Go packages (/usr/share/gocode/src),
# so that the module builds and tests with GOFLAGS=-mod=vendor and no module
# proxy. The vendor tree is a test-time arrangement: it is git-ignored, never
# committed.
#
# With MODULE_DIR, a module of your own (a directory with a go.mod), it
# vendors the same packages and this client itself into MODULE_DIR/vendor and
# adds their requirements to MODULE_DIR/go.mod (the client as
# github.com/retryd/retryd/clients/go v0.0.0), so that module builds offline
# with GOFLAGS=-mod=vendor. Run it again after updating this copy of the
# client. (A `replace` to a local copy is not enough offline: the client's own
# requirements still have to come from a module proxy or cache.)
#
# The packages copied are the non-standard dependencies of ROOTS below (found
# with `go list -deps` in GOPATH mode over Debian's tree). A new import that
# is not covered fails the build with "cannot find package ... in vendor":
# add it to ROOTS.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="$here"
if [[ $# -gt 0 ]]; then
  target="$(cd "$1" && pwd)"
  [[ -f "$target/go.mod" ]] || { echo "debian-vendor.sh: no go.mod in $target" >&2; exit 1; }
fi
client_module=github.com/retryd/retryd/clients/go
gocode="${DEBIAN_GOCODE:-/usr/share/gocode/src}"
ROOTS=(
  google.golang.org/grpc
  google.golang.org/grpc/backoff
  google.golang.org/grpc/codes
  google.golang.org/grpc/connectivity
  google.golang.org/grpc/credentials
  google.golang.org/grpc/encoding
  google.golang.org/grpc/health
  google.golang.org/grpc/health/grpc_health_v1
  google.golang.org/grpc/metadata
  google.golang.org/grpc/peer
  google.golang.org/grpc/status
  google.golang.org/protobuf/cmd/protoc-gen-go
  google.golang.org/protobuf/encoding/protojson
  google.golang.org/protobuf/proto
  google.golang.org/protobuf/reflect/protoreflect
  google.golang.org/protobuf/runtime/protoimpl
  google.golang.org/protobuf/types/known/durationpb
)
# The modules the packages belong to, with the versions Debian 12 ships. Each
# must be required by go.mod at exactly this version (go 1.17+ checks the
# vendor tree against go.mod); the indirect ones are grpc's dependencies.
MODULES=(
  "google.golang.org/grpc v1.33.3"
  "google.golang.org/protobuf v1.28.1"
  "github.com/golang/protobuf v1.3.5"
  "google.golang.org/genproto v0.0.0-20200413115906-b5235f65be36"
  "golang.org/x/net v0.7.0"
  "golang.org/x/sys v0.3.0"
  "golang.org/x/text v0.7.0"
)
for dir in google.golang.org/grpc google.golang.org/protobuf; do
  [[ -d "$gocode/$dir" ]] || { echo "debian-vendor.sh: $gocode/$dir missing: apt-get install golang-google-grpc-dev golang-google-protobuf-dev" >&2; exit 1; }
done
grep -q 'Version = "1.33' "$gocode/google.golang.org/grpc/version.go" ||
  { echo "debian-vendor.sh: expected grpc 1.33.x in $gocode" >&2; exit 1; }

packages="$(GO111MODULE=off GOPATH="${gocode%/src}" GOFLAGS= go list -deps \
  -f '{{if not .Standard}}{{.ImportPath}}{{end}}' "${ROOTS[@]}")"

vendor="$target/vendor"
rm -rf "$vendor"
mkdir -p "$vendor"
modules_txt="$vendor/modules.txt"
: >"$modules_txt"
if [[ "$target" != "$here" ]]; then
  # This client, as one more module of the target's.
  echo "# $client_module v0.0.0" >>"$modules_txt"
  echo "## explicit; go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$here/go.mod")" >>"$modules_txt"
  for package in "" /retrydv1; do
    echo "$client_module$package" >>"$modules_txt"
    mkdir -p "$vendor/$client_module$package"
    find "$here$package" -maxdepth 1 -type f -name '*.go' ! -name '*_test.go' -exec cp {} "$vendor/$client_module$package/" \;
  done
  requires=("-require=$client_module@v0.0.0")
  for entry in "${MODULES[@]}"; do
    read -r module version <<<"$entry"
    requires+=("-require=$module@$version")
  done
  (cd "$target" && GOFLAGS= go mod edit "${requires[@]}")
fi
for entry in "${MODULES[@]}"; do
  read -r module version <<<"$entry"
  members="$(grep -E "^${module//./\\.}(/|$)" <<<"$packages" || true)"
  [[ -n "$members" ]] || continue
  echo "# $module $version" >>"$modules_txt"
  # The module's own language version, which the compiler applies to it.
  go_version="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gocode/$module/go.mod" 2>/dev/null | head -1)"
  echo "## explicit${go_version:+; go $go_version}" >>"$modules_txt"
  while read -r package; do
    echo "$package" >>"$modules_txt"
    mkdir -p "$vendor/$package"
    # The package's own files only (subdirectories are packages of their own);
    # tests and testdata are not needed to build it.
    find "$gocode/$package" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' -o -name '*.h' -o -name '*.c' \) \
      ! -name '*_test.go' -exec cp {} "$vendor/$package/" \;
  done <<<"$members"
  packages="$(grep -vE "^${module//./\\.}(/|$)" <<<"$packages" || true)"
done
if [[ -n "$packages" ]]; then
  echo "debian-vendor.sh: packages of no listed module: $packages" >&2
  exit 1
fi
