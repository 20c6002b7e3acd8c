#!/usr/bin/env bash
# Checks the README's "Depend on it" as a new user would follow it, offline:
# a copy of clients/java outside the repository (so -Dproto.root is needed),
# installed with install-local.sh into a fresh local repository, then a tiny
# outside project that depends on dev.retryd:retryd-client built against it.
# Run by run-tests.sh after the suite.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="$(mktemp -d /tmp/retryd-java-offline.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/client"
tar -C "$here" --exclude=./target --exclude=./.m2 -cf - . | tar -C "$work/client" -xf -
# The copy's local repository starts as a copy of the suite's cache, so that
# only the install itself is new (Maven copies Debian's jars into it).
cp -r "$here/.m2" "$work/m2"
bash "$work/client/install-local.sh" "$work/m2" -Dproto.root="$repo/proto"
mkdir -p "$work/app/src/main/java/app"
cat > "$work/app/pom.xml" <<'POM'
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>example</groupId>
  <artifactId>app</artifactId>
  <version>1</version>
  <properties>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
    <maven.compiler.release>11</maven.compiler.release>
  </properties>
  <dependencies>
    <dependency>
      <groupId>dev.retryd</groupId>
      <artifactId>retryd-client</artifactId>
      <version>0.1.0-SNAPSHOT</version>
    </dependency>
  </dependencies>
  <build>
    <plugins>
      <!-- Versions Debian's /usr/share/maven-repo has (Maven's defaults are older). -->
      <plugin><groupId>org.apache.maven.plugins</groupId><artifactId>maven-resources-plugin</artifactId><version>3.3.0</version></plugin>
      <plugin><groupId>org.apache.maven.plugins</groupId><artifactId>maven-compiler-plugin</artifactId><version>3.10.1</version></plugin>
    </plugins>
  </build>
</project>
POM
cat > "$work/app/src/main/java/app/Main.java" <<'JAVA'
package app;

import dev.retryd.client.Decision;
import dev.retryd.client.LocalPolicy;
import dev.retryd.client.LocalRule;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;

public final class Main {
  public static void main(String[] args) {
    Decision decision = LocalRule.decide(LocalPolicy.DEFAULT, DecideRequest.newBuilder().setUpstream("catalog")
        .setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1).setFailure(FailureKind.FAILURE_KIND_CONNECT).build(), "offline check");
    System.out.println(decision);
  }
}
JAVA
cd "$work/app"
mvn -B -q -o -Daether.offline.protocols=file -s "$here/settings-debian.xml" -Dmaven.repo.local="$work/m2" compile
test -f "$work/app/target/classes/app/Main.class"
echo "check-offline-use: an outside project built offline against the installed retryd-client"
