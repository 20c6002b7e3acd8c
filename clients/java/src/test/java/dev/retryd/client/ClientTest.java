package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.protobuf.Duration;
import io.grpc.Contexts;
import io.grpc.Metadata;
import io.grpc.Server;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.ServerInterceptors;
import io.grpc.Status;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.StreamObserver;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.Test;
import retryd.v1.RetryDeciderGrpc;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DecideResponse;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.Verdict;

/** RetrydClient against a real retryd (stopped, frozen, restarted) and a scripted one for metadata and timeouts. */
class ClientTest {
  private static DecideRequest.Builder connectFailure(String upstream) {
    return DecideRequest.newBuilder()
        .setUpstream(upstream)
        .setOperation("GET /items")
        .setIdempotency(Idempotency.IDEMPOTENCY_SAFE)
        .setAttempt(1)
        .setFailure(FailureKind.FAILURE_KIND_CONNECT);
  }

  private static int freePort() throws Exception {
    try (ServerSocket probe = new ServerSocket(0)) {
      return probe.getLocalPort();
    }
  }

  /** A scripted RetryDecider of the test's own: records metadata, answers after a delay (or never). */
  private static final class ScriptedRetryd implements AutoCloseable {
    static final io.grpc.Context.Key<Metadata> HEADERS = io.grpc.Context.key("headers");
    final CopyOnWriteArrayList<Metadata> headers = new CopyOnWriteArrayList<>();
    final Server server;
    volatile long delayMillis;

    ScriptedRetryd() throws Exception {
      RetryDeciderGrpc.RetryDeciderImplBase service =
          new RetryDeciderGrpc.RetryDeciderImplBase() {
            @Override
            public void decide(DecideRequest request, StreamObserver<DecideResponse> reply) {
              headers.add(HEADERS.get());
              if (delayMillis < 0) {
                return; // never answers
              }
              try {
                Thread.sleep(delayMillis);
              } catch (InterruptedException interrupted) {
                return;
              }
              reply.onNext(
                  DecideResponse.newBuilder()
                      .setVerdict(Verdict.VERDICT_DENY)
                      .setDenyReason(DenyReason.DENY_REASON_STATUS_NOT_RETRYABLE)
                      .setRule(9)
                      .setDecisionId("scripted")
                      .build());
              reply.onCompleted();
            }
          };
      ServerInterceptor capture =
          new ServerInterceptor() {
            @Override
            public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata metadata, ServerCallHandler<Q, R> next) {
              return Contexts.interceptCall(io.grpc.Context.current().withValue(HEADERS, metadata), call, metadata, next);
            }
          };
      server = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(ServerInterceptors.intercept(service, capture)).build().start();
    }

    String target() {
      return "127.0.0.1:" + server.getPort();
    }

    @Override
    public void close() {
      server.shutdownNow();
    }
  }

  @Test
  void traceContextAndHeadersAreSentWithEveryCall() throws Exception {
    AtomicReference<TraceContext> trace = new AtomicReference<>();
    try (ScriptedRetryd scripted = new ScriptedRetryd();
        RetrydClient client = RetrydClient.builder(scripted.target()).header("Authorization", "Bearer t0ken").traceContext(trace::get).build()) {
      Metadata.Key<String> traceparent = Metadata.Key.of("traceparent", Metadata.ASCII_STRING_MARSHALLER);
      Metadata.Key<String> tracestate = Metadata.Key.of("tracestate", Metadata.ASCII_STRING_MARSHALLER);
      Metadata.Key<String> authorization = Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

      trace.set(TraceContext.of("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", true));
      assertFalse(client.decide(connectFailure("java-trace").build()).fallback());
      // The Level 2 "random" flag (0x02) is dropped; tracestate passes.
      trace.set(TraceContext.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03", "vendor=1").orElseThrow());
      client.decide(connectFailure("java-trace").build());
      trace.set(null);
      client.decide(connectFailure("java-trace").build());

      assertEquals("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", scripted.headers.get(0).get(traceparent));
      assertNull(scripted.headers.get(0).get(tracestate));
      assertEquals("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", scripted.headers.get(1).get(traceparent));
      assertEquals("vendor=1", scripted.headers.get(1).get(tracestate));
      assertNull(scripted.headers.get(2).get(traceparent));
      for (Metadata sent : scripted.headers) {
        assertEquals("Bearer t0ken", sent.get(authorization));
      }
    }
    assertTrue(TraceContext.parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01", null).isEmpty(), "all-zero trace id");
    assertTrue(TraceContext.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", null).isEmpty(), "unknown version");
    assertThrows(IllegalArgumentException.class, () -> TraceContext.of("XYZ", "00f067aa0ba902b7", true));
  }

  @Test
  void theTimeoutIsBoundedByTheCallersDeadline() throws Exception {
    try (ScriptedRetryd scripted = new ScriptedRetryd();
        RetrydClient client = RetrydClient.builder(scripted.target()).timeout(java.time.Duration.ofSeconds(5)).build()) {
      scripted.delayMillis = -1; // never answers
      long start = System.nanoTime();
      Decision decision = client.decide(connectFailure("java-timeout").setDeadlineRemaining(Duration.newBuilder().setNanos(150_000_000)).build());
      double elapsed = (System.nanoTime() - start) / 1e9;
      assertTrue(decision.fallback());
      assertTrue(elapsed >= 0.15 && elapsed <= 2.15, "waited " + elapsed + "s with 150ms left of the deadline");

      // A deadline nearly over still leaves retryd 50ms, not zero.
      start = System.nanoTime();
      client.decide(connectFailure("java-timeout").setDeadlineRemaining(Duration.newBuilder().setNanos(1_000_000)).build());
      elapsed = (System.nanoTime() - start) / 1e9;
      assertTrue(elapsed >= 0.05 && elapsed <= 2.05, "waited " + elapsed + "s with 1ms left");
    }
    try (ScriptedRetryd scripted = new ScriptedRetryd();
        RetrydClient client = RetrydClient.builder(scripted.target()).timeout(java.time.Duration.ofMillis(300)).build()) {
      scripted.delayMillis = -1;
      long start = System.nanoTime();
      assertTrue(client.decide(connectFailure("java-timeout").build()).fallback());
      double elapsed = (System.nanoTime() - start) / 1e9;
      assertTrue(elapsed >= 0.3 && elapsed <= 2.3, "waited " + elapsed + "s for a 300ms timeout");
    }
  }

  @Test
  void whenRetrydIsStoppedTheLocalRuleDecides() throws Exception {
    try (RetrydClient client = RetrydClient.builder("127.0.0.1:" + freePort()).build()) {
      Decision retry = client.decide(connectFailure("java-down").build());
      assertTrue(retry.fallback());
      assertEquals(Verdict.VERDICT_RETRY, retry.verdict(), retry.toString());
      assertTrue(retry.explanation().startsWith("retryd unreachable (UNAVAILABLE)"), retry.explanation());
      assertTrue(Double.isNaN(retry.tokensRemaining()));

      Decision ambiguous =
          client.decide(
              connectFailure("java-down")
                  .setIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT)
                  .setFailure(FailureKind.FAILURE_KIND_RESPONSE_HEADER_TIMEOUT)
                  .build());
      assertEquals(Verdict.VERDICT_AMBIGUOUS, ambiguous.verdict(), ambiguous.toString());

      Decision limit = client.decide(connectFailure("java-down").setAttempt(2).build());
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, limit.denyReason(), "the local limit is 2 attempts");

      // The fallback never hides an invalid request.
      InvalidRequestException invalid = assertThrows(InvalidRequestException.class, () -> client.decide(connectFailure("").build()));
      assertEquals("upstream", invalid.field());
    }
    try (RetrydClient strict = RetrydClient.builder("127.0.0.1:" + freePort()).noFallback().build()) {
      RetrydUnavailableException error = assertThrows(RetrydUnavailableException.class, () -> strict.decide(connectFailure("java-down").build()));
      assertEquals(Status.Code.UNAVAILABLE, error.code());
    }
  }

  @Test
  void anInvalidRequestIsReportedWithItsField() throws Exception {
    try (RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
        RetrydClient client = RetrydClient.builder(server.target()).timeout(java.time.Duration.ofSeconds(5)).build()) {
      InvalidRequestException error =
          assertThrows(InvalidRequestException.class, () -> client.decide(connectFailure("java-x").setAttempt(0).build()));
      assertEquals("attempt", error.field(), error.getMessage());
      Decision decision = client.decide(connectFailure("java-x").build());
      assertFalse(decision.fallback());
      assertEquals(Evidence.EVIDENCE_NOT_SENT, decision.effectiveEvidence());
      assertFalse(decision.decisionId().isEmpty());
    }
  }

  @Test
  void aFrozenRetrydFallsBackWithinTheTimeoutAndIsUsedAgainWhenThawed() throws Exception {
    try (RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
        RetrydClient client = RetrydClient.builder(server.target()).timeout(java.time.Duration.ofMillis(200)).build()) {
      assertFalse(client.decide(connectFailure("java-frozen").build(), java.time.Duration.ofSeconds(5)).fallback());
      double before = client.getBudget("java-frozen-budget").getTokens();
      server.freeze();
      try {
        long start = System.nanoTime();
        Decision decision = client.decide(connectFailure("java-frozen-budget").build());
        double elapsed = (System.nanoTime() - start) / 1e9;
        assertTrue(decision.fallback());
        assertTrue(elapsed >= 0.2 && elapsed <= 2.2, "fell back after " + elapsed + "s for a 200ms timeout");
      } finally {
        server.thaw();
      }
      assertFalse(client.decide(connectFailure("java-frozen").build(), java.time.Duration.ofSeconds(5)).fallback());
      // The decision retryd read only after its deadline had passed spent no
      // token: the client's gRPC deadline reached retryd with the request.
      assertEquals(before, client.getBudget("java-frozen-budget").getTokens(), 1e-9);
    }
  }

  @Test
  void aRestartedRetrydIsUsedAgainWithinTwoSeconds() throws Exception {
    int port = freePort();
    Path directory = Files.createTempDirectory("retryd-restart-");
    Path config = directory.resolve("retryd.toml");
    Files.writeString(config, RetrydServer.clientTestConfigOn(port));
    // retryd first: the client connects when it is built, and a channel whose
    // connect failed fails calls fast until its next reconnect (tested below).
    RetrydServer first = RetrydServer.start(config, directory);
    try (RetrydClient client = RetrydClient.builder("127.0.0.1:" + port).timeout(java.time.Duration.ofMillis(500)).build()) {
      try {
        assertFalse(client.decide(connectFailure("java-restart").build(), java.time.Duration.ofSeconds(5)).fallback());
      } finally {
        first.close();
      }
      // Down for 3s, with calls meanwhile (each falls back at once).
      long downUntil = System.nanoTime() + TimeUnit.SECONDS.toNanos(3);
      while (System.nanoTime() < downUntil) {
        assertTrue(client.decide(connectFailure("java-restart").build()).fallback());
        Thread.sleep(200);
      }
      try (RetrydServer second = RetrydServer.start(config, directory)) {
        long back = System.nanoTime();
        double elapsed;
        while (true) {
          Decision decision = client.decide(connectFailure("java-restart").build());
          elapsed = (System.nanoTime() - back) / 1e9;
          if (!decision.fallback()) {
            break;
          }
          assertTrue(elapsed < 4.0, "still falling back " + elapsed + "s after retryd came back");
          Thread.sleep(50);
        }
        assertTrue(elapsed <= 3.0, "used retryd again after " + elapsed + "s (promised: within about 2s)");
      }
    }
  }

  @Test
  void whileRetrydIsDownTheClientTriesToReconnectAboutEverySecond() throws Exception {
    // A listener that resets every connection: gRPC sees each as a failed
    // connect, so its own backoff would space the attempts 1s, 1.6s, 2.56s,
    // 4.1s apart (±20%); this client's watcher short-circuits it each second.
    CopyOnWriteArrayList<Long> attempts = new CopyOnWriteArrayList<>();
    try (RawServer refusing = new RawServer((socket, self) -> {
          attempts.add(System.nanoTime());
          RawServer.reset(socket);
        });
        RetrydClient client = RetrydClient.builder("127.0.0.1:" + refusing.port()).build()) {
      assertTrue(client.decide(connectFailure("java-reconnect").build()).fallback());
      long until = System.nanoTime() + TimeUnit.SECONDS.toNanos(8);
      while (System.nanoTime() < until) {
        Thread.sleep(100);
      }
      assertTrue(attempts.size() >= 5, "connection attempts in 8s: " + attempts.size());
      for (int i = 1; i < attempts.size(); i++) {
        double gap = (attempts.get(i) - attempts.get(i - 1)) / 1e9;
        assertTrue(gap <= 2.0, "attempt " + i + " came " + gap + "s after the one before");
      }
    }
  }

  @Test
  void aShadowAnswerIsNotEnforcedAndItsDivergenceIsCountedAndLoggedOnce() throws Exception {
    String config = RetrydServer.CLIENT_TEST_CONFIG + "\n[upstreams.\"java-shadow\"]\nenforce = false\n";
    java.util.concurrent.CopyOnWriteArrayList<java.util.logging.LogRecord> warnings = new java.util.concurrent.CopyOnWriteArrayList<>();
    java.util.logging.Handler capture =
        new java.util.logging.Handler() {
          @Override
          public void publish(java.util.logging.LogRecord record) {
            if (record.getMessage().startsWith("retryd shadow decision")) {
              warnings.add(record);
            }
          }

          @Override
          public void flush() {}

          @Override
          public void close() {}
        };
    java.util.logging.Logger logger = java.util.logging.Logger.getLogger("dev.retryd.client");
    logger.addHandler(capture);
    try (RetrydServer server = RetrydServer.start(config);
        RetrydClient client = RetrydClient.builder(server.target()).timeout(java.time.Duration.ofSeconds(5)).build();
        DecisionStream stream = client.decideStream()) {
      // Attempt 2 of a connect failure: retryd (3 attempts) would retry, the
      // local rule (2 attempts) denies, and the local rule is what is acted on.
      DecideRequest second = connectFailure("java-shadow").setAttempt(2).build();
      Decision decision = client.decide(second);
      assertTrue(decision.shadow(), decision.toString());
      assertFalse(decision.fallback());
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason());
      Decision retrydsOwn = decision.retrydDecision().orElseThrow();
      assertEquals(Verdict.VERDICT_RETRY, retrydsOwn.verdict());
      assertTrue(retrydsOwn.shadow());
      assertEquals(retrydsOwn.decisionId(), decision.decisionId());
      assertFalse(decision.decisionId().isEmpty());

      Decision overStream = stream.decide(second).get(10, TimeUnit.SECONDS);
      assertTrue(overStream.shadow());
      assertEquals(Verdict.VERDICT_DENY, overStream.verdict());
      assertEquals(2L, client.shadowDivergences().get("java-shadow"));
      assertEquals(1, warnings.size(), "one warning a minute per upstream");

      // Where both agree, nothing is counted; an enforced upstream is not shadowed.
      assertTrue(client.decide(connectFailure("java-shadow").build()).shadow());
      assertEquals(2L, client.shadowDivergences().get("java-shadow"));
      assertFalse(client.decide(connectFailure("java-enforced").setAttempt(2).build()).shadow());
    } finally {
      logger.removeHandler(capture);
    }
  }

  @Test
  void aDecideStreamFallsBackWhenRetrydGoesAway() throws Exception {
    RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    try (RetrydClient client = RetrydClient.builder(server.target()).timeout(java.time.Duration.ofSeconds(2)).build();
        DecisionStream stream = client.decideStream()) {
      Decision first = stream.decide(connectFailure("java-stream").build()).get(10, TimeUnit.SECONDS);
      assertFalse(first.fallback());
      Decision second = stream.decide(connectFailure("java-stream").build()).get(10, TimeUnit.SECONDS);
      assertFalse(second.fallback());
      server.close();
      Decision after = stream.decide(connectFailure("java-stream").build()).get(10, TimeUnit.SECONDS);
      assertTrue(after.fallback(), after.toString());
      assertEquals(Verdict.VERDICT_RETRY, after.verdict());
    } finally {
      server.close();
    }
  }
}
