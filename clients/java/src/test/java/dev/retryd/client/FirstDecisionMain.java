package dev.retryd.client;

import java.lang.management.ManagementFactory;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;

/**
 * What a new user's process does first (the README's quick start, at the
 * client's defaults): build one client, decide once. Run in a fresh JVM by
 * {@link FirstDecisionTest}; prints whether the decision fell back and the
 * milliseconds from JVM start to it.
 */
public final class FirstDecisionMain {
  private FirstDecisionMain() {}

  public static void main(String[] args) {
    long beforeBuild = System.nanoTime();
    try (RetrydClient retryd = RetrydClient.builder(args[0]).build()) {
      long buildMillis = (System.nanoTime() - beforeBuild) / 1_000_000;
      Decision decision =
          retryd.decide(DecideRequest.newBuilder().setUpstream("java-first").setOperation("GET /items")
              .setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1).setFailure(FailureKind.FAILURE_KIND_CONNECT).build());
      long sinceStart = System.currentTimeMillis() - ManagementFactory.getRuntimeMXBean().getStartTime();
      System.out.println("FIRST fallback=" + decision.fallback() + " ms_from_jvm_start=" + sinceStart + " ms_build=" + buildMillis);
    }
  }
}
