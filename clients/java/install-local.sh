#!/usr/bin/env bash
# Installs dev.retryd:retryd-client into a local Maven repository (default
# ~/.m2/repository; or the first argument), offline, with only what Debian's
# /usr/share/maven-repo has. Debian packages no maven-install-plugin there, so
# `mvn install` fails offline; this runs `mvn package` (the plugins Debian does
# have) and lays out the jar and its pom as install would:
#   <repo>/dev/retryd/retryd-client/<version>/retryd-client-<version>.{jar,pom}
# Further arguments go to Maven, for example -Dproto.root=/path/to/retryd/proto
# for a copy of clients/java outside the retryd repository (proto.root defaults
# to ../../proto).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_local="${1:-$HOME/.m2/repository}"
shift || true
cd "$here"
mvn -B -q -o -Daether.offline.protocols=file \
  -s "$here/settings-debian.xml" -Dmaven.repo.local="$here/.m2" \
  -Dmaven.test.skip=true package "$@"
# The project's own version: the first <version> after <artifactId>retryd-client.
version="$(sed -n '/<artifactId>retryd-client<\/artifactId>/,/<version>/s:.*<version>\(.*\)</version>.*:\1:p' pom.xml | head -n1)"
dest="$repo_local/dev/retryd/retryd-client/$version"
mkdir -p "$dest"
cp "target/retryd-client-$version.jar" "$dest/retryd-client-$version.jar"
cp pom.xml "$dest/retryd-client-$version.pom"
echo "installed dev.retryd:retryd-client:$version into $repo_local"
