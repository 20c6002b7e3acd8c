package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.net.ConnectException;
import java.net.ServerSocket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.net.http.HttpTimeoutException;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.time.temporal.ChronoUnit;
import java.util.concurrent.atomic.AtomicInteger;
import javax.net.ssl.SSLException;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/**
 * The java.net.http adapter against real failing servers of the test's own on
 * 127.0.0.1 and a real retryd (fast backoffs: base 10ms, max 50ms, 3 attempts).
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class HttpAdapterTest {
  private RetrydServer retrydServer;
  private RetrydClient retryd;
  private HttpClient http;
  private RetryingHttpClient adapter;
  // For the deadline tests: a deadline spent during an attempt is decided by
  // the local rule (retryd is not asked); one that is nearly spent gives the
  // decision call only its 50ms floor, which a loaded machine can miss, and the
  // local rule then says the same DENY DEADLINE, so these tests allow the fallback.
  private RetrydClient retrydOrLocal;
  private RetryingHttpClient deadlineAdapter;

  @BeforeAll
  void start() throws Exception {
    retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    // No fallback here: these tests are about retryd's decisions; a silent
    // fallback would hide a broken call. The fallback has its own tests below.
    retryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).noFallback().build();
    http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
    adapter = RetryingHttpClient.builder(http, retryd).noTrafficReport().build();
    retrydOrLocal = RetrydClient.builder(retrydServer.target()).build();
    deadlineAdapter = RetryingHttpClient.builder(http, retrydOrLocal).noTrafficReport().build();
    // Load the client's classes once: a first decision that spends its 50ms
    // floor loading them would otherwise miss a nearly spent deadline.
    retryd.decide(DecideRequest.newBuilder().setUpstream("java-warmup").setIdempotency(Idempotency.IDEMPOTENCY_SAFE)
        .setAttempt(1).setFailure(FailureKind.FAILURE_KIND_CONNECT).build());
  }

  @AfterAll
  void stop() throws Exception {
    adapter.close();
    deadlineAdapter.close();
    retrydOrLocal.close();
    retryd.close();
    retrydServer.close();
  }

  private static RetryOptions.Builder safe(String upstream) {
    return RetryOptions.builder(upstream).idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(10));
  }

  private static HttpRequest get(String url) {
    return HttpRequest.newBuilder(URI.create(url)).GET().build();
  }

  private static Decision decisionOf(Throwable error) {
    return RetryingHttpClient.decisionOf(error).orElseThrow(() -> new AssertionError("no decision attached to " + error));
  }

  @Test
  void refusedIsNotSentAndRetriedUntilTheAttemptLimit() throws Exception {
    int port;
    try (ServerSocket probe = new ServerSocket(0)) {
      port = probe.getLocalPort(); // closed again: nothing listens there now
    }
    ConnectException error =
        assertThrows(
            ConnectException.class,
            () -> adapter.send(get("http://127.0.0.1:" + port + "/"), HttpResponse.BodyHandlers.ofString(), safe("java-refused").build()));
    Decision decision = decisionOf(error);
    assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason(), decision.toString());
    assertEquals(Evidence.EVIDENCE_NOT_SENT, decision.effectiveEvidence());
  }

  @Test
  void resetAfterReadingTheRequestIsSentNoResponseAndRetriedWhenSafe() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          RawServer.reset(socket);
        })) {
      IOException error =
          assertThrows(IOException.class, () -> adapter.send(get(server.url("http", "/r")), HttpResponse.BodyHandlers.ofString(), safe("java-reset").build()));
      Decision decision = decisionOf(error);
      assertEquals(Evidence.EVIDENCE_SENT_NO_RESPONSE, decision.effectiveEvidence(), decision + " for " + error);
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason(), decision.toString());
      // Three decided attempts (max_attempts = 3), three requests read: the JDK's
      // own re-send of a GET that got no byte back was refused every time.
      assertEquals(3, server.requests.get(), "requests read");
      assertInstanceOf(ResendRefusedException.class, error);
    }
  }

  /** Holds a connection after reading its request, until the test ends. */
  private static RawServer.Behaviour readThenHold(java.util.concurrent.CountDownLatch released) {
    return (socket, self) -> {
      self.readRequest(socket);
      released.await();
    };
  }

  @Test
  void aPooledConnectionClosedAfterTheRequestWasReadIsADecidedAttemptNotAHiddenResend() throws Exception {
    // The first connection answers one request and keeps alive, then reads the
    // next one and resets: what a server closing an idle connection does. The
    // JDK would re-send on a new connection and return its 200 as attempt 1.
    AtomicInteger connection = new AtomicInteger();
    try (RawServer server = new RawServer((socket, self) -> {
          boolean first = connection.getAndIncrement() == 0;
          while (self.readRequest(socket) != null) {
            if (first && self.requests.get() == 2) {
              RawServer.reset(socket);
              return;
            }
            socket.getOutputStream().write("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".getBytes(StandardCharsets.US_ASCII));
            socket.getOutputStream().flush();
          }
        })) {
      assertEquals(200, http.send(get(server.url("http", "/warm")), HttpResponse.BodyHandlers.ofString()).statusCode());
      RetriedResponse<String> response = adapter.send(get(server.url("http", "/pooled")), HttpResponse.BodyHandlers.ofString(), safe("java-pooled").build());
      assertEquals(200, response.statusCode());
      assertEquals(2, response.attempts(), "the reset attempt counts");
      Decision decision = response.decision().orElseThrow(() -> new AssertionError("no decision: a hidden re-send"));
      assertEquals(Verdict.VERDICT_RETRY, decision.verdict(), decision.toString());
      assertFalse(decision.fallback());
      assertEquals(Evidence.EVIDENCE_SENT_NO_RESPONSE, decision.effectiveEvidence());
      assertEquals(1 + 2, server.requests.get(), "the warm-up, then one request per decided attempt");
    }
  }

  @Test
  void aGetDeclaredNonIdempotentResetAfterTheServerReadItIsAmbiguousAndSentOnce() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          RawServer.reset(socket);
        })) {
      AmbiguousExecutionException error =
          assertThrows(AmbiguousExecutionException.class, () -> adapter.send(get(server.url("http", "/v1/transfer")),
              HttpResponse.BodyHandlers.ofString(), RetryOptions.builder("java-get-payment").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
      assertEquals(Verdict.VERDICT_AMBIGUOUS, error.decision().verdict(), error.decision().toString());
      assertFalse(error.decision().fallback());
      assertInstanceOf(ResendRefusedException.class, error.getCause());
      assertEquals(1, server.requests.get(), "sent once");
    }
  }

  @Test
  void aHungPostRunningIntoTheCallersDeadlineIsTheAmbiguousErrorDecidedLocally() throws Exception {
    java.util.concurrent.CountDownLatch released = new java.util.concurrent.CountDownLatch(1);
    try (RawServer server = new RawServer(readThenHold(released))) {
      HttpRequest post = HttpRequest.newBuilder(URI.create(server.url("http", "/v1/charges"))).POST(HttpRequest.BodyPublishers.ofString("{}")).build();
      AmbiguousExecutionException error =
          assertThrows(AmbiguousExecutionException.class, () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(),
              RetryOptions.builder("java-payments").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).deadline(Duration.ofMillis(500)).build()));
      assertEquals(DenyReason.DENY_REASON_DEADLINE, error.denyReason(), error.decision().toString());
      assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE, error.unknownOutcome());
      assertTrue(error.decision().fallback(), "decided locally, retryd not asked: " + error.decision());
      assertInstanceOf(HttpTimeoutException.class, error.getCause());
      assertEquals(1, server.requests.get(), "sent once");
    } finally {
      released.countDown();
    }
  }

  @Test
  void aPostAppliedThenHeldPastItsTimeoutOnAnEmptyBudgetIsTheAmbiguousErrorWithBudgetExhausted() throws Exception {
    // Issue 36: the budget rule denies before the ambiguity rule would answer;
    // the DENY keeps its reason, and the caller still learns it may have happened.
    java.util.concurrent.CountDownLatch released = new java.util.concurrent.CountDownLatch(1);
    try (RawServer server = new RawServer(readThenHold(released))) {
      HttpRequest post = HttpRequest.newBuilder(URI.create(server.url("http", "/v1/charges")))
          .timeout(Duration.ofMillis(300)).POST(HttpRequest.BodyPublishers.ofString("{\"amount\":100}")).build();
      AmbiguousExecutionException error =
          assertThrows(AmbiguousExecutionException.class, () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(),
              RetryOptions.builder("java-budgetless").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
      assertEquals(Verdict.VERDICT_DENY, error.decision().verdict(), error.decision().toString());
      assertEquals(DenyReason.DENY_REASON_BUDGET_EXHAUSTED, error.denyReason());
      assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE, error.unknownOutcome());
      assertFalse(error.resendWithSameKey());
      assertFalse(error.decision().fallback(), "retryd decided");
      assertInstanceOf(HttpTimeoutException.class, error.getCause());
      assertEquals(1, server.requests.get(), "applied once");

      HttpRequest keyed = HttpRequest.newBuilder(URI.create(server.url("http", "/v1/charges")))
          .timeout(Duration.ofMillis(300)).header("Idempotency-Key", "charge-7").POST(HttpRequest.BodyPublishers.ofString("{}")).build();
      AmbiguousExecutionException resend =
          assertThrows(AmbiguousExecutionException.class, () -> adapter.send(keyed, HttpResponse.BodyHandlers.ofString(),
              RetryOptions.builder("java-budgetless").build()));
      assertEquals(DenyReason.DENY_REASON_BUDGET_EXHAUSTED, resend.denyReason(), resend.decision().toString());
      assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RESEND_WITH_KEY, resend.unknownOutcome());
      assertTrue(resend.resendWithSameKey());
      assertEquals(2, server.requests.get(), "applied once more");
    } finally {
      released.countDown();
    }
  }

  @Test
  void nonIdempotentPostClosedAfterTheServerReadItIsAmbiguousAndSentOnce() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          socket.close(); // FIN without a response: "header parser received no bytes"
        })) {
      HttpRequest post =
          HttpRequest.newBuilder(URI.create(server.url("http", "/v1/charges")))
              .POST(HttpRequest.BodyPublishers.ofString("{\"amount\":100}"))
              .build();
      AmbiguousExecutionException error =
          assertThrows(
              AmbiguousExecutionException.class,
              () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(),
                  RetryOptions.builder("java-payments").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
      assertEquals(Verdict.VERDICT_AMBIGUOUS, error.decision().verdict());
      assertEquals(8, error.decision().rule());
      assertInstanceOf(IOException.class, error.getCause());
      assertEquals(1, server.requests.get(), "sent once");
      assertEquals(error.decision(), RetryingHttpClient.decisionOf(error).orElseThrow());
    }
  }

  @Test
  void acceptedAndNeverAnsweredTimesOutAsSentNoResponse() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          Thread.sleep(30_000); // hold the connection, say nothing
        })) {
      HttpRequest request = HttpRequest.newBuilder(URI.create(server.url("http", "/hang"))).timeout(Duration.ofMillis(300)).build();
      HttpTimeoutException error =
          assertThrows(HttpTimeoutException.class, () -> adapter.send(request, HttpResponse.BodyHandlers.ofString(), safe("java-hang").build()));
      Decision decision = decisionOf(error);
      assertEquals(Evidence.EVIDENCE_SENT_NO_RESPONSE, decision.effectiveEvidence());
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason(), decision.toString());
      assertEquals(3, server.requests.get());

      // The same hang for a payment: it may be executing, so AMBIGUOUS after one attempt.
      int before = server.requests.get();
      AmbiguousExecutionException ambiguous =
          assertThrows(
              AmbiguousExecutionException.class,
              () -> adapter.send(request, HttpResponse.BodyHandlers.ofString(),
                  RetryOptions.builder("java-hang").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
      assertInstanceOf(HttpTimeoutException.class, ambiguous.getCause());
      assertEquals(before + 1, server.requests.get());
    }
  }

  @Test
  void aDeadlineShorterThanTheHangEndsTheCallAtTheDeadline() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          Thread.sleep(30_000);
        })) {
      long start = System.nanoTime();
      HttpTimeoutException error =
          assertThrows(
              HttpTimeoutException.class,
              () -> deadlineAdapter.send(get(server.url("http", "/hang")), HttpResponse.BodyHandlers.ofString(),
                  safe("java-deadline").deadline(Duration.ofMillis(700)).build()));
      double elapsed = (System.nanoTime() - start) / 1e9;
      assertTrue(elapsed >= 0.7 && elapsed <= 2.7, "the call took " + elapsed + "s for a 0.7s deadline");
      Decision decision = decisionOf(error);
      assertEquals(DenyReason.DENY_REASON_DEADLINE, decision.denyReason(), decision.toString());
      assertEquals(1, server.requests.get());
    }
  }

  @Test
  void aBodyStillDrippingAtTheDeadlineEndsTheCallAtTheDeadline() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          self.readRequest(socket);
          OutputStream out = socket.getOutputStream();
          out.write("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".getBytes(StandardCharsets.US_ASCII));
          for (int i = 0; i < 300; i++) { // one byte every 100ms: 30s for the body
            out.write('x');
            out.flush();
            Thread.sleep(100);
          }
        })) {
      long start = System.nanoTime();
      HttpTimeoutException error =
          assertThrows(
              HttpTimeoutException.class,
              () -> deadlineAdapter.send(get(server.url("http", "/slow")), HttpResponse.BodyHandlers.ofString(),
                  safe("java-drip").deadline(Duration.ofMillis(800)).build()));
      double elapsed = (System.nanoTime() - start) / 1e9;
      assertTrue(elapsed >= 0.8 && elapsed <= 2.8, "the call took " + elapsed + "s for a 0.8s deadline");
      Decision decision = decisionOf(error);
      assertEquals(Evidence.EVIDENCE_PARTIAL_RESPONSE, decision.effectiveEvidence(), decision.toString());
      assertEquals(DenyReason.DENY_REASON_DEADLINE, decision.denyReason(), decision.toString());
    }
  }

  @Test
  void headersThenATruncatedBodyIsPartialAndRetriedWhenSafe() throws Exception {
    AtomicInteger served = new AtomicInteger();
    try (RawServer server = new RawServer((socket, self) -> {
          while (self.readRequest(socket) != null) {
            OutputStream out = socket.getOutputStream();
            if (served.getAndIncrement() == 0) {
              out.write("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a little".getBytes(StandardCharsets.US_ASCII));
              out.flush();
              socket.close();
              return;
            }
            out.write("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nwhole".getBytes(StandardCharsets.US_ASCII));
            out.flush();
          }
        })) {
      RetriedResponse<String> response = adapter.send(get(server.url("http", "/t")), HttpResponse.BodyHandlers.ofString(), safe("java-truncated").build());
      assertEquals("whole", response.body());
      assertEquals(2, response.attempts());
      Decision decision = response.decision().orElseThrow();
      assertEquals(Verdict.VERDICT_RETRY, decision.verdict());
      assertEquals(Evidence.EVIDENCE_PARTIAL_RESPONSE, decision.effectiveEvidence());
      assertEquals(2, server.requests.get());
    }
  }

  @Test
  void garbageInTheTlsHandshakeIsNotSentSoEvenAPaymentIsRetried() throws Exception {
    try (RawServer server = new RawServer((socket, self) -> {
          OutputStream out = socket.getOutputStream();
          out.write("this is not TLS at all\r\n\r\n".getBytes(StandardCharsets.US_ASCII));
          out.flush();
          Thread.sleep(200);
          socket.close();
        })) {
      HttpRequest post = HttpRequest.newBuilder(URI.create(server.url("https", "/v1/charges"))).POST(HttpRequest.BodyPublishers.ofString("x")).build();
      SSLException error =
          assertThrows(
              SSLException.class,
              () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(),
                  RetryOptions.builder("java-tls").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
      Decision decision = decisionOf(error);
      assertEquals(Evidence.EVIDENCE_NOT_SENT, decision.effectiveEvidence(), decision + " for " + error);
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason());
      // The JDK retries a failed connect once by itself, so count at least our three.
      assertTrue(server.connections.get() >= 3, "connections: " + server.connections.get());
      assertEquals(0, server.requests.get());
    }
  }

  @Test
  void tooManyRequestsWithRetryAfterSecondsWaitsThatLong() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(429, "Retry-After", "1"), ScriptedHttpServer.status(200))) {
      RetriedResponse<String> response = adapter.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), safe("java-429s").build());
      assertEquals(200, response.statusCode());
      assertEquals(2, server.requests());
      double gap = server.gapSeconds(0);
      assertTrue(gap >= 1.0 && gap <= 3.0, "waited " + gap + "s for Retry-After: 1");
    }
  }

  @Test
  void tooManyRequestsWithAnHttpDateWaitsUntilThen() throws Exception {
    Instant until = Instant.now().truncatedTo(ChronoUnit.SECONDS).plusSeconds(2);
    // IMF-fixdate (two-digit day); java.time's RFC_1123 formatter writes "1 Dec".
    String date = DateTimeFormatter.ofPattern("EEE, dd MMM yyyy HH:mm:ss 'GMT'", java.util.Locale.US).format(until.atZone(ZoneOffset.UTC));
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(429, "Retry-After", date), ScriptedHttpServer.status(200))) {
      RetriedResponse<String> response = adapter.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), safe("java-429d").build());
      assertEquals(200, response.statusCode());
      long secondAt = server.arrivalsMillis.get(1);
      long early = until.toEpochMilli() - secondAt;
      assertTrue(early <= 50, "the retry came " + early + "ms before " + date);
      assertTrue(secondAt - until.toEpochMilli() <= 2000, "the retry came " + (secondAt - until.toEpochMilli()) + "ms after " + date);
    }
  }

  @Test
  void serviceUnavailableThenOkSucceedsOnTheSecondAttempt() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
      RetriedResponse<String> response = adapter.send(get(server.url("/items/7")), HttpResponse.BodyHandlers.ofString(), safe("java-503").build());
      assertEquals(200, response.statusCode());
      assertEquals("status 200", response.body());
      assertEquals(2, response.attempts());
      assertEquals(Verdict.VERDICT_RETRY, response.decision().orElseThrow().verdict());
      assertFalse(response.decision().orElseThrow().fallback());
    }
  }

  @Test
  void aOneShotBodyAfterA503IsNotSentAgain() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
      byte[] payload = "one-shot payload".getBytes(StandardCharsets.UTF_8);
      ByteArrayInputStream stream = new ByteArrayInputStream(payload);
      HttpRequest put = HttpRequest.newBuilder(URI.create(server.url("/upload"))).PUT(HttpRequest.BodyPublishers.ofInputStream(() -> stream)).build();
      RetriedResponse<String> response =
          adapter.send(put, HttpResponse.BodyHandlers.ofString(),
              RetryOptions.builder("java-oneshot").idempotency(Idempotency.IDEMPOTENCY_IDEMPOTENT).build());
      assertEquals(503, response.statusCode());
      assertEquals(DenyReason.DENY_REASON_BODY_NOT_REPLAYABLE, response.decision().orElseThrow().denyReason());
      assertEquals(1, server.requests(), "sent once");
      assertEquals(payload.length, server.bodyBytes.get(0));
    }
  }

  @Test
  void aReopenableSupplierDeclaredSoIsSentAgain() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
      byte[] payload = "reopened payload".getBytes(StandardCharsets.UTF_8);
      HttpRequest put =
          HttpRequest.newBuilder(URI.create(server.url("/upload"))).PUT(HttpRequest.BodyPublishers.ofInputStream(() -> new ByteArrayInputStream(payload))).build();
      RetriedResponse<String> response =
          adapter.send(put, HttpResponse.BodyHandlers.ofString(),
              RetryOptions.builder("java-reopen").idempotency(Idempotency.IDEMPOTENCY_IDEMPOTENT).reopenableBody(true).build());
      assertEquals(200, response.statusCode());
      assertEquals(2, server.requests());
      assertEquals(payload.length, server.bodyBytes.get(1), "the whole body again");
    }
  }

  @Test
  void anIdempotencyKeyHeaderMakesAPostIdempotentWithKey() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(201))) {
      HttpRequest post =
          HttpRequest.newBuilder(URI.create(server.url("/v1/charges")))
              .header("Idempotency-Key", "charge-42")
              .POST(HttpRequest.BodyPublishers.ofString("{}"))
              .build();
      RetriedResponse<String> response = adapter.send(post, HttpResponse.BodyHandlers.ofString(), RetryOptions.builder("java-key").build());
      assertEquals(201, response.statusCode());
      assertEquals(2, server.requests());
    }
  }

  @Test
  void withoutIdempotencyOrAKeyTheCallIsRefused() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(200))) {
      HttpRequest post = HttpRequest.newBuilder(URI.create(server.url("/x"))).POST(HttpRequest.BodyPublishers.ofString("{}")).build();
      IllegalArgumentException error =
          assertThrows(IllegalArgumentException.class, () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(), RetryOptions.builder("java-x").build()));
      assertTrue(error.getMessage().startsWith("idempotency"), error.getMessage());
      assertEquals(0, server.requests(), "nothing sent");
    }
  }

  @Test
  void unauthorizedIsReplayedOnceWithRefreshedCredentials() throws Exception {
    ScriptedHttpServer.Step checkAuth =
        exchange -> {
          String auth = exchange.getRequestHeaders().getFirst("Authorization");
          ScriptedHttpServer.status("Bearer fresh".equals(auth) ? 200 : 401).answer(exchange);
        };
    try (ScriptedHttpServer server = new ScriptedHttpServer(checkAuth)) {
      AtomicInteger refreshes = new AtomicInteger();
      HttpRequest request = HttpRequest.newBuilder(URI.create(server.url("/me"))).header("Authorization", "Bearer stale").build();
      RetriedResponse<String> response =
          adapter.send(request, HttpResponse.BodyHandlers.ofString(),
              safe("java-401").onRefreshCredentials(old -> {
                    refreshes.incrementAndGet();
                    return HttpRequest.newBuilder(old.uri()).header("Authorization", "Bearer fresh").build();
                  }).build());
      assertEquals(200, response.statusCode());
      assertEquals(1, refreshes.get());
      assertTrue(response.decision().orElseThrow().refreshCredentials());
      assertEquals(java.util.List.of("Bearer stale", "Bearer fresh"), server.authorizations);
    }
  }

  @Test
  void aStatusNotAskedAboutIsReturnedWithoutADecision() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(404))) {
      RetriedResponse<String> response = adapter.send(get(server.url("/none")), HttpResponse.BodyHandlers.ofString(), safe("java-404").build());
      assertEquals(404, response.statusCode());
      assertEquals(1, response.attempts());
      assertTrue(response.decision().isEmpty());
    }
  }

  @Test
  void firstAttemptsAreReportedByDefaultAndRetriesAreNot() throws Exception {
    try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200));
        RetryingHttpClient reporting = RetryingHttpClient.builder(http, retryd).build()) {
      TrafficReporter reporter = reporting.reporter().orElseThrow();
      reporter.flush();
      for (int i = 0; i < 3; i++) {
        reporting.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), safe("java-reported").build());
      }
      assertEquals(4, server.requests(), "one retry among three calls");
      reporter.flush();
      assertEquals(0, reporter.pending().size());
      // java-reported starts at 10 tokens, gains one per reported request and
      // never refills: 10 - 1 (the retry) + 3 (first attempts only) = 12.
      assertEquals(12.0, retryd.getBudget("java-reported").getTokens(), 1e-9);
    }
  }

  @Test
  void anInvalidCertificateIsPermanentAndNotRetried() throws Exception {
    // A self-signed certificate the JDK's default trust store does not know.
    java.nio.file.Path directory = java.nio.file.Files.createTempDirectory("retryd-tls-");
    java.nio.file.Path keystore = directory.resolve("server.p12");
    Process keytool =
        new ProcessBuilder(
                java.nio.file.Paths.get(System.getProperty("java.home"), "bin", "keytool").toString(),
                "-genkeypair", "-alias", "server", "-keyalg", "RSA", "-keysize", "2048", "-validity", "2",
                "-dname", "CN=127.0.0.1", "-ext", "san=ip:127.0.0.1", "-storetype", "PKCS12",
                "-keystore", keystore.toString(), "-storepass", "changeit", "-keypass", "changeit")
            .redirectErrorStream(true)
            .start();
    String keytoolOutput = new String(keytool.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
    assertEquals(0, keytool.waitFor(), "keytool failed: " + keytoolOutput);
    java.security.KeyStore store = java.security.KeyStore.getInstance("PKCS12");
    try (java.io.InputStream in = java.nio.file.Files.newInputStream(keystore)) {
      store.load(in, "changeit".toCharArray());
    }
    javax.net.ssl.KeyManagerFactory keys = javax.net.ssl.KeyManagerFactory.getInstance(javax.net.ssl.KeyManagerFactory.getDefaultAlgorithm());
    keys.init(store, "changeit".toCharArray());
    javax.net.ssl.SSLContext tls = javax.net.ssl.SSLContext.getInstance("TLS");
    tls.init(keys.getKeyManagers(), null, null);
    com.sun.net.httpserver.HttpsServer https =
        com.sun.net.httpserver.HttpsServer.create(new java.net.InetSocketAddress(java.net.InetAddress.getLoopbackAddress(), 0), 0);
    https.setHttpsConfigurator(new com.sun.net.httpserver.HttpsConfigurator(tls));
    AtomicInteger handled = new AtomicInteger();
    https.createContext("/", exchange -> {
      handled.incrementAndGet();
      ScriptedHttpServer.status(200).answer(exchange);
    });
    https.start();
    try {
      String url = "https://127.0.0.1:" + https.getAddress().getPort() + "/";
      SSLException error =
          assertThrows(SSLException.class, () -> adapter.send(get(url), HttpResponse.BodyHandlers.ofString(), safe("java-cert").build()));
      Decision decision = decisionOf(error);
      assertEquals(DenyReason.DENY_REASON_PERMANENT_FAILURE, decision.denyReason(), decision + " for " + error);
      assertEquals(7, decision.rule());
      assertEquals(0, handled.get());
    } finally {
      https.stop(0);
    }
  }

  @Test
  void whenRetrydIsStoppedTheLocalRuleStillRetriesASafe503() throws Exception {
    int port;
    try (ServerSocket probe = new ServerSocket(0)) {
      port = probe.getLocalPort();
    }
    try (RetrydClient down = RetrydClient.builder("127.0.0.1:" + port).build();
        RetryingHttpClient local = RetryingHttpClient.builder(http, down).noTrafficReport().build();
        ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
      RetriedResponse<String> response = local.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), safe("java-down").build());
      assertEquals(200, response.statusCode());
      assertTrue(response.decision().orElseThrow().fallback());
      // The local rule never retries a payment that may have happened.
      try (ScriptedHttpServer payments = new ScriptedHttpServer(ScriptedHttpServer.status(503))) {
        HttpRequest post = HttpRequest.newBuilder(URI.create(payments.url("/v1/charges"))).POST(HttpRequest.BodyPublishers.ofString("{}")).build();
        AmbiguousExecutionException error =
            assertThrows(AmbiguousExecutionException.class, () -> local.send(post, HttpResponse.BodyHandlers.ofString(),
                RetryOptions.builder("java-down").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build()));
        assertTrue(error.decision().fallback());
        assertEquals(503, error.response().orElseThrow().statusCode());
        assertEquals(1, payments.requests());
      }
    }
  }

  @Test
  void whenRetrydIsFrozenTheCallFallsBackWithinTheTimeout() throws Exception {
    try (RetrydServer frozen = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
        RetrydClient client = RetrydClient.builder(frozen.target()).timeout(Duration.ofMillis(200)).build();
        RetryingHttpClient local = RetryingHttpClient.builder(http, client).noTrafficReport().build();
        ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
      frozen.freeze();
      try {
        long start = System.nanoTime();
        RetriedResponse<String> response = local.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), safe("java-frozen").build());
        double elapsed = (System.nanoTime() - start) / 1e9;
        assertEquals(200, response.statusCode());
        assertTrue(response.decision().orElseThrow().fallback());
        // One 200ms decision timeout plus at most the local backoff cap (2s).
        assertTrue(elapsed >= 0.2 && elapsed <= 4.2, "took " + elapsed + "s");
      } finally {
        frozen.thaw();
      }
    }
  }
}
