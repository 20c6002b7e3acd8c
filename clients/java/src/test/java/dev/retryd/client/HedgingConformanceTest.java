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
import java.net.ServerSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
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
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.ReportTrafficRequest;
import retryd.v1.Retryd.ReportTrafficResponse;
import retryd.v1.Retryd.Verdict;

/**
 * conformance/hedging.json through {@link RetrydClient#decideHedge} against a
 * real retryd (issue 33): the vectors' reports go through {@link
 * RetrydClient#reportTraffic(ReportTrafficRequest)}, whose answers fill the
 * client's hedging table, then every case is asked as the adapters ask a hedge.
 *
 * <p>The four cases that put a failure on a hedge (evidence, failure, status,
 * Retry-After) cannot be expressed as a {@link HedgeRequest}, which has none by
 * design; they are retryd's own validation, run by the server's suite.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class HedgingConformanceTest {
  private static final List<String> FAILURE_FIELDS = List.of("evidence", "failure", "httpStatus", "retryAfter");

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

  private RetrydServer server;
  private RetrydClient client;
  private final List<Case> cases = new ArrayList<>();
  private final List<String> leftOut = new ArrayList<>();

  @BeforeAll
  void start() throws Exception {
    Path vectors = RetrydServer.repo().resolve("conformance/hedging.json");
    JsonObject file = JsonParser.parseString(Files.readString(vectors)).getAsJsonObject();
    for (JsonElement element : file.getAsJsonArray("cases")) {
      JsonObject item = element.getAsJsonObject();
      JsonObject request = item.getAsJsonObject("request");
      String name = item.get("name").getAsString();
      if (FAILURE_FIELDS.stream().anyMatch(request::has)) {
        leftOut.add(name);
        continue;
      }
      DecideRequest.Builder parsed = DecideRequest.newBuilder();
      // No ignoringUnknownFields: a field this client's contract lacks fails loudly.
      JsonFormat.parser().merge(request.toString(), parsed);
      cases.add(
          new Case(
              name,
              parsed.build(),
              item.has("expect") ? item.getAsJsonObject("expect") : null,
              item.has("expect_error") ? item.getAsJsonObject("expect_error") : null));
    }
    server = RetrydServer.start(file.get("config").getAsString());
    // No fallback: a case retryd did not answer must fail, never be decided locally.
    client = RetrydClient.builder(server.target()).timeout(Duration.ofSeconds(10)).noFallback().build();
    for (JsonElement upstream : file.getAsJsonArray("disable_upstreams")) {
      client.setRetriesEnabled(upstream.getAsString(), false, "hedging conformance: disable_upstreams");
    }
    for (JsonElement report : file.getAsJsonArray("reports")) {
      ReportTrafficRequest.Builder parsed = ReportTrafficRequest.newBuilder();
      JsonFormat.parser().merge(report.toString(), parsed);
      ReportTrafficResponse response = client.reportTraffic(parsed.build());
      assertEquals(parsed.getTrafficCount(), response.getAccepted(), "entries accepted of a report");
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
  void onlyTheFailureCasesAreLeftOut() {
    assertEquals(List.of("hedge-with-evidence", "hedge-with-status", "hedge-with-failure", "hedge-with-retry-after"), leftOut);
    assertTrue(cases.size() >= 15, "expected the full vector file, got " + cases.size() + " hedge cases");
  }

  @Test
  void theReportsFilledTheHedgingTable() {
    Optional<Hedging> tail = client.hedging("hedge-tail");
    assertTrue(tail.isPresent() && tail.get().allows(Idempotency.IDEMPOTENCY_IDEMPOTENT), "hedge-tail: " + tail);
    Optional<Hedging> slow = client.hedging("hedge-slow");
    assertTrue(slow.isPresent(), "hedge-slow was served");
    assertFalse(slow.get().allows(Idempotency.IDEMPOTENCY_SAFE), "hedge-slow: uniformly slow, so off");
  }

  @TestFactory
  Stream<DynamicTest> decideHedge() {
    return cases.stream().map(c -> DynamicTest.dynamicTest(c.name, () -> run(c, false)));
  }

  @TestFactory
  Stream<DynamicTest> decideHedgeAsync() {
    return cases.stream().map(c -> DynamicTest.dynamicTest(c.name, () -> run(c, true)));
  }

  private void run(Case c, boolean async) throws Exception {
    HedgeRequest hedge = hedgeOf(c);
    if (c.expectError != null) {
      InvalidRequestException error;
      if (async) {
        ExecutionException failed = assertThrows(ExecutionException.class, () -> client.decideHedgeAsync(hedge).get(20, TimeUnit.SECONDS));
        error = assertInstanceOf(InvalidRequestException.class, failed.getCause());
      } else {
        error = assertThrows(InvalidRequestException.class, () -> client.decideHedge(hedge));
      }
      assertEquals("INVALID_ARGUMENT", c.expectError.get("code").getAsString(), "only INVALID_ARGUMENT is expected of a case");
      String field = c.expectError.get("field").getAsString();
      assertTrue(error.getMessage().startsWith(field), "message should start with '" + field + "': " + error.getMessage());
      return;
    }
    check(c, async ? client.decideHedgeAsync(hedge).get(20, TimeUnit.SECONDS) : client.decideHedge(hedge));
  }

  /** The case as a HedgeRequest; every field of the case must reach retryd through it. */
  private static HedgeRequest hedgeOf(Case c) {
    DecideRequest r = c.request;
    HedgeRequest.Builder builder =
        HedgeRequest.builder(r.getUpstream(), r.getIdempotency(), r.getHedge())
            .operation(r.getOperation())
            .attempt(r.getAttempt())
            .maxAttempts(r.getMaxAttempts())
            .lineage(r.getLineage());
    if (r.hasBody()) {
      builder.body(r.getBody());
    }
    if (r.hasDeadlineRemaining()) {
      builder.deadlineRemaining(Durations.fromProto(r.getDeadlineRemaining()));
    }
    HedgeRequest hedge = builder.build();
    assertEquals(r, hedge.toDecideRequest(), "the DecideRequest decideHedge sends");
    return hedge;
  }

  private static void check(Case c, Decision decision) {
    JsonObject expect = c.expect;
    if (expect == null) {
      fail("case " + c.name + " has neither expect nor expect_error");
    }
    assertFalse(decision.fallback(), "decided by the fallback, not retryd");
    String verdict = expect.get("verdict").getAsString();
    assertEquals(verdict, decision.verdict().name(), "verdict; " + decision);
    String deny = expect.has("deny_reason") ? expect.get("deny_reason").getAsString() : "DENY_REASON_UNSPECIFIED";
    assertEquals(deny, decision.denyReason().name(), "deny_reason; " + decision);
    assertEquals(expect.get("rule").getAsInt(), decision.rule(), "rule; " + decision);
    String mark = expect.get("unknown_outcome").getAsString();
    assertEquals(mark, decision.unknownOutcome().name(), "unknown_outcome; " + decision);
    boolean unknown = verdict.equals("VERDICT_AMBIGUOUS") || (verdict.equals("VERDICT_DENY") && !mark.equals("UNKNOWN_OUTCOME_NONE"));
    assertEquals(unknown, decision.isOutcomeUnknown(), "isOutcomeUnknown; " + decision);
    assertEquals(expect.get("effective_evidence").getAsString(), decision.effectiveEvidence().name(), "effective_evidence; " + decision);
    if (expect.has("evidence_adjusted")) {
      assertEquals(expect.get("evidence_adjusted").getAsBoolean(), decision.evidenceAdjusted(), "evidence_adjusted; " + decision);
    }
    if (expect.has("refresh_credentials")) {
      assertEquals(expect.get("refresh_credentials").getAsBoolean(), decision.refreshCredentials(), "refresh_credentials");
    }
    ConformanceTest.assertBackoffAndId(expect, verdict, decision);
  }

  @Test
  void aHedgeBelowOneIsRefusedBeforeRetrydIsAsked() throws Exception {
    try (RetrydClient down = RetrydClient.builder("127.0.0.1:" + freePort()).connectTimeout(Duration.ZERO).noFallback().build()) {
      HedgeRequest notAHedge = HedgeRequest.builder("hedge-tail", Idempotency.IDEMPOTENCY_SAFE, 0).attempt(1).build();
      assertEquals("hedge", assertThrows(InvalidRequestException.class, () -> down.decideHedge(notAHedge)).field());
      ExecutionException failed = assertThrows(ExecutionException.class, () -> down.decideHedgeAsync(notAHedge).get(5, TimeUnit.SECONDS));
      assertEquals("hedge", assertInstanceOf(InvalidRequestException.class, failed.getCause()).field());
    }
  }

  /**
   * With retryd unreachable the local hedge rule answers (DENY HEDGING_OFF without
   * a local hedge delay; HEDGE_CAP, then RETRY once first attempts earned a token,
   * then DEADLINE); with the fallback off it is a RetrydUnavailableException.
   */
  @Test
  void withRetrydDownTheLocalHedgeRuleDecides() throws Exception {
    String target = "127.0.0.1:" + freePort();
    HedgeRequest hedge = HedgeRequest.builder("hedge-down", Idempotency.IDEMPOTENCY_IDEMPOTENT, 1).build();
    try (RetrydClient strict = RetrydClient.builder(target).connectTimeout(Duration.ZERO).noFallback().build()) {
      assertThrows(RetrydUnavailableException.class, () -> strict.decideHedge(hedge));
    }
    try (RetrydClient byDefault = RetrydClient.builder(target).connectTimeout(Duration.ZERO).build()) {
      Decision d = byDefault.decideHedge(hedge);
      assertTrue(d.fallback(), d.toString());
      assertEquals(Verdict.VERDICT_DENY, d.verdict(), d.toString());
      assertEquals(DenyReason.DENY_REASON_HEDGING_OFF, d.denyReason(), d.toString());
    }
    LocalPolicy policy = LocalPolicy.DEFAULT.withHedgeDelay(Duration.ofMillis(50));
    try (RetrydClient local = RetrydClient.builder(target).connectTimeout(Duration.ZERO).fallback(policy).build()) {
      Decision none = local.decideHedge(hedge);
      assertTrue(none.fallback(), none.toString());
      assertEquals(DenyReason.DENY_REASON_HEDGE_CAP, none.denyReason(), none.toString());
      for (int i = 0; i < 25; i++) {
        local.firstAttemptSent("hedge-down"); // 25 first attempts at 0.05 each: a token
      }
      Decision granted = local.decideHedgeAsync(hedge).get(5, TimeUnit.SECONDS);
      assertTrue(granted.fallback() && granted.shouldRetry(), granted.toString());
      assertEquals(Duration.ZERO, granted.backoff());
      for (int i = 0; i < 25; i++) {
        local.firstAttemptSent("hedge-down");
      }
      HedgeRequest late = HedgeRequest.builder("hedge-down", Idempotency.IDEMPOTENCY_IDEMPOTENT, 1).deadlineRemaining(Duration.ofMillis(10)).build();
      Decision deadline = local.decideHedge(late);
      assertEquals(DenyReason.DENY_REASON_DEADLINE, deadline.denyReason(), deadline.toString());
    }
  }

  private static int freePort() throws java.io.IOException {
    try (ServerSocket socket = new ServerSocket(0)) {
      return socket.getLocalPort();
    }
  }
}
