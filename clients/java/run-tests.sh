#!/usr/bin/env bash
# Builds the Java client offline against Debian's Maven repository
# (/usr/share/maven-repo, filled by the Debian packages listed below) and runs
# its whole test suite against a real retryd: $RETRYD_BIN, default
# <repo>/target/debug/retryd. Extra arguments go to Maven (for example
# -Dtest=ConformanceTest).
#
# Debian packages it needs (scripts/test installs them): openjdk-17-jdk-headless
# maven protobuf-compiler protobuf-compiler-grpc-java-plugin libgrpc-java
# libprotobuf-java libnetty-java libperfmark-java libgoogle-gson-java
# libanimal-sniffer-java libgoogle-common-protos-java junit5
# libmaven-compiler-plugin-java libsurefire-java libmaven-jar-plugin-java
# libmaven-resources-plugin-java libmaven-antrun-plugin-java
# libbuild-helper-maven-plugin-java
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RETRYD_BIN="${RETRYD_BIN:-$repo/target/debug/retryd}"
if [[ ! -x "$RETRYD_BIN" ]]; then
  echo "run-tests.sh: no retryd binary at $RETRYD_BIN (cargo build --bin retryd, or set RETRYD_BIN)" >&2
  exit 1
fi
for tool in mvn java protoc /usr/bin/grpc_java_plugin; do
  if ! command -v "$tool" >/dev/null; then
    echo "run-tests.sh: $tool not found; install the Debian packages listed at the top of this script" >&2
    exit 1
  fi
done
cd "$here"
# -o with file: allowed: Maven resolves only from the file:// mirror of
# settings-debian.xml and never tries the network. The local repository is a
# cache under this directory, so /usr/share/maven-repo is never written to.
mvn -B -o -Daether.offline.protocols=file \
  -s "$here/settings-debian.xml" -Dmaven.repo.local="$here/.m2" \
  test "$@"
# The whole suite (no arguments) also checks offline use as the README tells
# it: install-local.sh from a copy outside the repository, then an outside
# project built against the installed client. (The README's code blocks are
# compiled by ReadmeExamplesTest, part of the suite.)
if [[ $# -eq 0 ]]; then
  bash "$here/check-offline-use.sh"
fi
