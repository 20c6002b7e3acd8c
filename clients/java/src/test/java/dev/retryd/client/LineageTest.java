package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Optional;
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/** The lineage value, the baggage member, the default layer name and the local rule's chain checks. */
class LineageTest {
  @Test
  void validValuesAreKeptAsTheyAre() {
    assertEquals(Optional.of(""), Lineage.shorten(""));
    assertEquals(Optional.of("edge:2/middle:1"), Lineage.shorten("edge:2/middle:1"));
    assertEquals(Optional.of("a.b_c-D9:1000"), Lineage.shorten(" a.b_c-D9:1000 "));
    assertTrue(Lineage.isValid("edge:2/middle:1"));
    assertTrue(Lineage.isValid(""));
  }

  @Test
  void anInvalidEntryMakesTheWholeValueIgnored() {
    for (String bad :
        List.of("edge", "edge:", "edge:0", "edge:1001", "edge:01x", ":1", "ed ge:1", "edge:1//b:1", "edge:1/", "é:1",
            "x".repeat(65) + ":1", "edge:-1", "edge:99999")) {
      assertEquals(Optional.empty(), Lineage.shorten(bad), bad);
      assertFalse(Lineage.isValid(bad), bad);
      assertEquals("", Lineage.inbound(bad).lineage(), bad);
    }
    assertTrue(Lineage.isValidLayer("x".repeat(64)));
    assertTrue(Lineage.isValidLayer("..."));
  }

  @Test
  void aLongLineageDropsTheOutermostEntriesAndKeepsAnEnclosingRetry() {
    List<String> entries = new ArrayList<>();
    for (int i = 1; i <= 40; i++) {
      entries.add("l" + i + ":" + (i == 3 ? 7 : i == 5 ? 2 : 1));
    }
    String shortened = Lineage.shorten(String.join("/", entries)).orElseThrow();
    // 32 entries: "...:7" first (the highest dropped attempt), then the innermost 31.
    List<String> kept = new ArrayList<>(List.of("...:7"));
    kept.addAll(entries.subList(9, 40));
    assertEquals(String.join("/", kept), shortened);
    assertTrue(Lineage.isValid(shortened));
    assertTrue(Lineage.isInsideEnclosingRetry(shortened));

    // Only first attempts dropped: no "..." entry, just the innermost 32.
    List<String> plain = Collections.nCopies(40, "p:1");
    assertEquals(String.join("/", Collections.nCopies(32, "p:1")), Lineage.shorten(String.join("/", plain)).orElseThrow());

    // The byte limit: 20 entries of 64-byte names are 1379 bytes.
    List<String> wide = new ArrayList<>();
    for (int i = 0; i < 20; i++) {
      wide.add(String.format("%064d", i) + ":" + (i == 0 ? 3 : 1));
    }
    String fitted = Lineage.shorten(String.join("/", wide)).orElseThrow();
    assertTrue(fitted.length() <= Lineage.MAX_BYTES, fitted);
    assertTrue(fitted.startsWith("...:3/"), fitted);
    assertTrue(fitted.endsWith("/" + wide.get(19)), fitted);
    assertTrue(Lineage.isValid(fitted));
  }

  @Test
  void theOutboundValueAppendsThisLayerAndNeverDropsIt() {
    assertEquals("edge:1", Lineage.outbound("", "edge", 1));
    assertEquals("edge:2/middle:3", Lineage.outbound("edge:2", "middle", 3));
    String full = String.join("/", Collections.nCopies(32, "p:2"));
    String outbound = Lineage.outbound(full, "me", 1);
    assertTrue(outbound.endsWith("/me:1"), outbound);
    assertTrue(outbound.startsWith("...:2/"), outbound);
    assertTrue(Lineage.isValid(outbound), outbound);
    String thirtyOne = String.join("/", Collections.nCopies(31, "p:2"));
    assertEquals(thirtyOne + "/me:1", Lineage.outbound(thirtyOne, "me", 1));
    assertEquals("me:1", Lineage.outbound("not valid", "me", 1));
    assertEquals("edge:1/me:1000", Lineage.outbound("edge:1", "me", 5000));
    assertThrows(IllegalArgumentException.class, () -> Lineage.outbound("", "bad layer", 1));
  }

  @Test
  void theBaggageMemberIsReadAndReplacedLeavingTheOthers() {
    assertEquals(Optional.of("edge:2"), Lineage.fromBaggage(List.of("userId=42, retryd.lineage = edge:2 ;prop=1", "x=y")));
    assertEquals(Optional.of("edge:1"), Lineage.fromBaggage(List.of("a=b", "retryd.lineage=edge:1")));
    assertEquals(Optional.empty(), Lineage.fromBaggage(List.of("retryd.lineagex=edge:1")));
    assertEquals(Optional.empty(), Lineage.fromBaggage(null));
    assertEquals("retryd.lineage=edge:1", Lineage.withMember(List.of(), "edge:1"));
    assertEquals(
        "userId=42,k=v;p,retryd.lineage=edge:1/middle:2",
        Lineage.withMember(List.of("userId=42, retryd.lineage=old:9", "k=v;p"), "edge:1/middle:2"));
  }

  @Test
  void theDefaultLayerName() {
    assertEquals("checkout", Lineage.defaultLayer("checkout", "com.example.Main"));
    assertEquals("Main", Lineage.defaultLayer("not valid!", "com.example.Main --port 8080"));
    assertEquals("Main", Lineage.defaultLayer(null, "com.example.Main"));
    assertEquals("my_app", Lineage.defaultLayer("", "/opt/my+app.jar"));
    assertEquals("app-1.2", Lineage.defaultLayer(null, "/opt/app-1.2.jar x"));
    assertEquals("service", Lineage.defaultLayer(null, null));
    assertEquals("service", Lineage.defaultLayer(null, ""));
    assertTrue(Lineage.isValidLayer(Lineage.defaultLayer()));
    assertEquals(Optional.of("middle"), Lineage.retriedBelow(" middle "));
    assertEquals(Optional.empty(), Lineage.retriedBelow("mid dle"));
    assertEquals(Optional.empty(), Lineage.retriedBelow(""));
  }

  @Test
  void theServedRequestReachesAnotherThreadOnlyWhenTheContextIsCarried() throws Exception {
    java.util.concurrent.ExecutorService executor = java.util.concurrent.Executors.newSingleThreadExecutor();
    try {
      Lineage.Inbound inbound = Lineage.inbound("edge:2");
      io.grpc.Context served = Lineage.withInbound(io.grpc.Context.current(), inbound);
      java.util.concurrent.Callable<Optional<Lineage.Inbound>> read = Lineage::current;
      assertEquals(Optional.empty(), Lineage.current());
      assertEquals(Optional.of(inbound), served.call(read));
      // Handed to another thread as it is: not carried. Wrapped, or on a context executor: carried.
      assertEquals(Optional.empty(), served.call(() -> executor.submit(read).get()));
      assertEquals(Optional.of(inbound), served.call(() -> executor.submit(io.grpc.Context.current().wrap(read)).get()));
      assertEquals(Optional.of(inbound),
          served.call(() -> java.util.concurrent.CompletableFuture.supplyAsync(Lineage::current, io.grpc.Context.currentContextExecutor(executor)).get()));
    } finally {
      executor.shutdownNow();
    }
  }

  private static DecideRequest.Builder failed503() {
    return DecideRequest.newBuilder()
        .setUpstream("u")
        .setIdempotency(Idempotency.IDEMPOTENCY_SAFE)
        .setAttempt(1)
        .setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED)
        .setHttpStatus(503);
  }

  @Test
  void theLocalRuleDeniesWhatWasRetriedBelowOrInsideAnEnclosingRetry() {
    assertEquals(Verdict.VERDICT_RETRY, LocalRule.decide(LocalPolicy.DEFAULT, failed503().build(), "t").verdict());
    assertEquals(
        Verdict.VERDICT_RETRY, LocalRule.decide(LocalPolicy.DEFAULT, failed503().setLineage("edge:1/mid:1").build(), "t").verdict());

    Decision below = LocalRule.decide(LocalPolicy.DEFAULT, failed503().setRetriedBelow("middle").build(), "t");
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, below.denyReason());
    assertEquals(5, below.rule());
    assertTrue(below.explanation().contains("middle"), below.explanation());

    Decision inside = LocalRule.decide(LocalPolicy.DEFAULT, failed503().setLineage("edge:2/mid:1").build(), "t");
    assertEquals(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, inside.denyReason());
    assertEquals(5, inside.rule());

    // Rule 5's order: draining first; the attempt limit (rule 1) before it.
    assertEquals(DenyReason.DENY_REASON_RUNTIME_DRAINING,
        LocalRule.decide(LocalPolicy.DEFAULT, failed503().setRetriedBelow("m").setRuntimeDraining(true).build(), "t").denyReason());
    assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS,
        LocalRule.decide(LocalPolicy.DEFAULT, failed503().setRetriedBelow("m").setAttempt(2).build(), "t").denyReason());

    // The unknown-outcome mark is kept: a timed-out POST denied inside a retry is still RECONCILE.
    Decision post =
        LocalRule.decide(LocalPolicy.DEFAULT,
            DecideRequest.newBuilder().setUpstream("u").setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).setAttempt(1)
                .setEvidence(Evidence.EVIDENCE_SENT_NO_RESPONSE).setFailure(FailureKind.FAILURE_KIND_RESPONSE_HEADER_TIMEOUT)
                .setLineage("edge:3").build(),
            "t");
    assertEquals(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, post.denyReason());
    assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE, post.unknownOutcome());
    assertTrue(post.isOutcomeUnknown());
  }

  @Test
  void theLocalRuleRejectsWhatRetrydWould() {
    assertThrows(InvalidRequestException.class,
        () -> LocalRule.decide(LocalPolicy.DEFAULT, failed503().setLineage("edge:0").build(), "t"));
    assertThrows(InvalidRequestException.class,
        () -> LocalRule.decide(LocalPolicy.DEFAULT, failed503().setRetriedBelow("a b").build(), "t"));
    assertThrows(InvalidRequestException.class,
        () -> LocalRule.decide(LocalPolicy.DEFAULT,
            failed503().clearHttpStatus().setEvidence(Evidence.EVIDENCE_SENT_NO_RESPONSE).setRetriedBelow("m").build(), "t"));
  }
}
