package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.protobuf.util.JsonFormat;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestFactory;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DecideRequest;

/**
 * Every case of conformance/decisions.json through the Java client against a
 * real retryd: unary {@code decide}, then all of them over one {@code decideStream}.
 *
 * <p>Requests are read with protobuf's JSON mapping straight into {@code
 * DecideRequest}, so every field a vector sets (gRPC fields, an optional
 * pushback whose presence matters, numbers for undefined enum values) reaches
 * retryd unchanged, and new vectors need no change here.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class ConformanceTest {
  private static final class Case {
    final String name;
    final DecideRequest request;
    final JsonObject expect;
    final JsonObject expectError;

    Case(String name, DecideRequest request, JsonObject expect, JsonObject expectError) {
      this.name = name;
      this.request = request;
      this.expect = expect;
      this.expectError = expectError;
    }
  }

  // Generous and fixed (not bounded by the vectors' deadlines): on a busy machine a
  // 50ms wait could fail a case that retryd decides correctly.
  private static final Duration CALL_TIMEOUT = Duration.ofSeconds(10);

  private RetrydServer server;
  private RetrydClient client;
  private final List<Case> cases = new ArrayList<>();

  @BeforeAll
  void start() throws Exception {
    Path vectors = RetrydServer.repo().resolve("conformance/decisions.json");
    JsonObject file = JsonParser.parseString(Files.readString(vectors)).getAsJsonObject();
    for (JsonElement element : file.getAsJsonArray("cases")) {
      JsonObject item = element.getAsJsonObject();
      DecideRequest.Builder request = DecideRequest.newBuilder();
      // No ignoringUnknownFields: a vector naming a field this client's
      // contract lacks must fail loudly, not be sent without it.
      JsonFormat.parser().merge(item.get("request").toString(), request);
      cases.add(
          new Case(
              item.get("name").getAsString(),
              request.build(),
              item.has("expect") ? item.getAsJsonObject("expect") : null,
              item.has("expect_error") ? item.getAsJsonObject("expect_error") : null));
    }
    server = RetrydServer.start(file.get("config").getAsString());
    // No fallback: a case retryd did not answer must fail, never be decided locally.
    client = RetrydClient.builder(server.target()).timeout(Duration.ofSeconds(10)).noFallback().build();
    for (JsonElement upstream : file.getAsJsonArray("disable_upstreams")) {
      client.setRetriesEnabled(upstream.getAsString(), false, "conformance: disable_upstreams");
    }
  }

  @AfterAll
  void stop() throws Exception {
    if (client != null) {
      client.close();
    }
    if (server != null) {
      server.close();
    }
  }

  @Test
  void theVectorsAreThere() {
    assertTrue(cases.size() >= 100, "expected the full vector file, got " + cases.size() + " cases");
  }

  @TestFactory
  Stream<DynamicTest> unary() {
    return cases.stream()
        .map(
            c ->
                DynamicTest.dynamicTest(
                    c.name,
                    () -> {
                      if (c.expectError != null) {
                        InvalidRequestException error = assertThrows(InvalidRequestException.class, () -> client.decide(c.request, CALL_TIMEOUT));
                        checkError(c, error);
                      } else {
                        check(c, client.decide(c.request, CALL_TIMEOUT));
                      }
                    }));
  }

  @TestFactory
  Stream<DynamicTest> stream() throws Exception {
    // Send every case on one stream first, then check each response in order.
    List<CompletableFuture<Decision>> futures = new ArrayList<>();
    try (DecisionStream stream = client.decideStream()) {
      for (Case c : cases) {
        futures.add(stream.decide(c.request, CALL_TIMEOUT));
      }
      CompletableFuture.allOf(futures.toArray(new CompletableFuture<?>[0]))
          .handle((ignored, error) -> null)
          .get(60, TimeUnit.SECONDS);
    }
    List<DynamicTest> tests = new ArrayList<>();
    for (int i = 0; i < cases.size(); i++) {
      Case c = cases.get(i);
      CompletableFuture<Decision> future = futures.get(i);
      tests.add(
          DynamicTest.dynamicTest(
              c.name,
              () -> {
                if (c.expectError != null) {
                  ExecutionException error = assertThrows(ExecutionException.class, future::get);
                  checkError(c, assertInstanceOf(InvalidRequestException.class, error.getCause()));
                } else {
                  check(c, future.get());
                }
              }));
    }
    return tests.stream();
  }

  private static void checkError(Case c, InvalidRequestException error) {
    assertEquals("INVALID_ARGUMENT", c.expectError.get("code").getAsString(), "only INVALID_ARGUMENT is expected of a case");
    String field = c.expectError.get("field").getAsString();
    assertTrue(error.getMessage().startsWith(field), "message should start with '" + field + "': " + error.getMessage());
  }

  private static void check(Case c, Decision decision) {
    JsonObject expect = c.expect;
    if (expect == null) {
      fail("case " + c.name + " has neither expect nor expect_error");
    }
    assertFalse(decision.fallback(), "decided by the fallback, not retryd");
    if (expect.has("shadow")) {
      assertEquals(expect.get("shadow").getAsBoolean(), decision.shadow(), "shadow; " + decision);
    }
    // For a shadow answer the client acts on its local rule; the vector states retryd's answer.
    decision = decision.retrydDecision().orElse(decision);
    String verdict = expect.get("verdict").getAsString();
    assertEquals(verdict, decision.verdict().name(), "verdict; " + decision);
    String deny = expect.has("deny_reason") ? expect.get("deny_reason").getAsString() : "DENY_REASON_UNSPECIFIED";
    assertEquals(deny, decision.denyReason().name(), "deny_reason; " + decision);
    assertEquals(expect.get("rule").getAsInt(), decision.rule(), "rule; " + decision);
    // Every case states the mark (issue 36): retryd's, and the local rule's
    // from the same facts, which must agree with it whatever rule decided.
    String mark = expect.get("unknown_outcome").getAsString();
    assertEquals(mark, decision.unknownOutcome().name(), "unknown_outcome; " + decision);
    assertEquals(mark, LocalRule.unknownOutcome(c.request, decision.effectiveEvidence()).name(),
        "the local rule's unknown_outcome; " + decision);
    // What the adapters act on: a DENY with a mark raises the ambiguous error.
    boolean unknown = verdict.equals("VERDICT_AMBIGUOUS") || (verdict.equals("VERDICT_DENY") && !mark.equals("UNKNOWN_OUTCOME_NONE"));
    assertEquals(unknown, decision.isOutcomeUnknown(), "isOutcomeUnknown; " + decision);
    assertEquals(mark.equals("UNKNOWN_OUTCOME_RESEND_WITH_KEY"), decision.resendWithSameKey(), "resendWithSameKey; " + decision);
    assertEquals(expect.get("effective_evidence").getAsString(), decision.effectiveEvidence().name(), "effective_evidence; " + decision);
    assertEquals(expect.get("evidence_adjusted").getAsBoolean(), decision.evidenceAdjusted(), "evidence_adjusted; " + decision);
    if (expect.has("refresh_credentials")) {
      assertEquals(expect.get("refresh_credentials").getAsBoolean(), decision.refreshCredentials(), "refresh_credentials");
    }
    assertBackoffAndId(expect, verdict, decision);
  }

  /**
   * The backoff within the case's bounds for a RETRY, none otherwise, and a decision id:
   * the checks every conformance runner of this client ends with.
   */
  static void assertBackoffAndId(JsonObject expect, String verdict, Decision decision) {
    long backoffNanos = decision.backoff().toNanos();
    if (verdict.equals("VERDICT_RETRY")) {
      if (expect.has("backoff_min_ms")) {
        assertTrue(backoffNanos >= expect.get("backoff_min_ms").getAsLong() * 1_000_000L, "backoff below min: " + decision);
      }
      if (expect.has("backoff_max_ms")) {
        assertTrue(backoffNanos <= expect.get("backoff_max_ms").getAsLong() * 1_000_000L, "backoff above max: " + decision);
      }
    } else {
      assertEquals(0, backoffNanos, "a verdict other than RETRY has no backoff");
    }
    assertFalse(decision.decisionId().isEmpty(), "decision_id");
  }
}
