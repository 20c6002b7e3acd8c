package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.retryd.client.testproto.EchoGrpc;
import dev.retryd.client.testproto.EchoReply;
import dev.retryd.client.testproto.EchoRequest;
import io.grpc.ClientInterceptors;
import io.grpc.Context;
import io.grpc.ManagedChannel;
import io.grpc.Server;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.ServerCallStreamObserver;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UpstreamTraffic;

/**
 * Hedging against a real retryd that serves hedge delays from reported
 * latencies (hedging policies at their defaults: p95, one hedge, 5% extra load,
 * 100 samples over 30s), with real upstreams on loopback.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class HedgingRetrydTest {
  private static final long HANG_GUARD_SECONDS = 30;
  private static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

  // Budgets that neither refill nor take deposits, so that a token a hedge spends shows.
  private static final String CONFIG =
      RetrydServer.CLIENT_TEST_CONFIG
          + String.join(
              "\n",
              "[upstreams.\"java-hedge\"]",
              "budget = { capacity = 100.0, initial = 50.0, ratio = 0.0, min_per_second = 0.0 }",
              "[upstreams.\"java-hedge\".hedging]",
              "quantile = 0.95",
              "[upstreams.\"java-hedge-grpc\"]",
              "budget = { capacity = 100.0, initial = 50.0, ratio = 0.0, min_per_second = 0.0 }",
              "[upstreams.\"java-hedge-grpc\".hedging]",
              "quantile = 0.95",
              "[upstreams.\"java-hedge-cap\".hedging]",
              "quantile = 0.95",
              "");

  private RetrydServer server;

  @BeforeAll
  void start() throws Exception {
    server = RetrydServer.start(CONFIG);
  }

  @AfterAll
  void stop() throws Exception {
    server.close();
  }

  /** A reporter that sends only when the test flushes it, so pending counts stay put. */
  private static TrafficReporter quietReporter(RetrydClient client) {
    return TrafficReporter.builder(client).interval(Duration.ofHours(1)).build();
  }

  /**
   * Reports {@code n} first attempts through the reporter, 90% at 1ms and 10% at
   * 200ms, so that retryd serves a p95 delay of about 200ms (p50 far below it:
   * not uniformly slow), long enough that a fast call on a loaded machine is not
   * hedged; returns what the client learned from the response.
   */
  private static Hedging seed(RetrydClient client, TrafficReporter reporter, String upstream, int n) {
    reporter.record(upstream, n);
    reporter.recordOutcome(upstream, true, false, n);
    for (int i = 0; i < n; i++) {
      reporter.recordLatency(upstream, true, TimeUnit.MILLISECONDS.toNanos(i < n * 9 / 10 ? 1 : 200));
    }
    assertTrue(reporter.flush());
    Hedging h = client.hedging(upstream).orElseThrow();
    assertTrue(h.enabled() && h.maxHedges() == 1, "served " + h);
    assertTrue(h.delay().compareTo(Duration.ofMillis(150)) >= 0 && h.delay().compareTo(Duration.ofMillis(250)) <= 0, "delay " + h.delay());
    return h;
  }

  private static RetryOptions safe(String upstream) {
    return RetryOptions.builder(upstream).idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
  }

  @Test
  void aServedHedgeWinsAndTheLoserIsCancelled() throws Exception {
    try (RetrydClient client = RetrydClient.builder(server.target()).build();
        TrafficReporter reporter = quietReporter(client);
        HedgingTest.SlowFirst upstream = new HedgingTest.SlowFirst(TimeUnit.SECONDS.toMillis(HANG_GUARD_SECONDS));
        RetryingHttpClient http = RetryingHttpClient.builder(HTTP, client).reporter(reporter).build()) {
      Hedging h = seed(client, reporter, "java-hedge", 200);
      // The first exchange pays for connecting and the JDK's warm-up: not hedged (NON_IDEMPOTENT).
      http.send(HttpRequest.newBuilder(upstream.uri("/warm")).build(), HttpResponse.BodyHandlers.ofString(),
          RetryOptions.builder("java-hedge").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build());
      // A fast call asks nothing: no decision, no token.
      RetriedResponse<String> fast =
          http.send(HttpRequest.newBuilder(upstream.uri("/warm")).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge"));
      assertEquals("fast", fast.body());
      assertTrue(fast.decision().isEmpty());
      assertEquals(50.0, client.getBudget("java-hedge").getTokens());

      long start = System.nanoTime();
      RetriedResponse<String> response =
          http.send(HttpRequest.newBuilder(upstream.uri("/slow")).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge"));
      assertEquals("fast", response.body());
      Decision hedge = response.decision().orElseThrow();
      assertTrue(hedge.shouldRetry() && !hedge.fallback() && hedge.backoff().isZero(), hedge.toString());
      assertTrue(upstream.hedgeArrivalNanos.get() - start >= h.delay().toNanos(), "the hedge went before the served delay");
      assertTrue(upstream.cancelled.await(HANG_GUARD_SECONDS, TimeUnit.SECONDS), "the upstream never saw the first attempt cancelled");
      assertEquals(2, upstream.slow.get());
      assertEquals(49.0, client.getBudget("java-hedge").getTokens()); // the hedge spent one token, as a retry would
      UpstreamTraffic traffic = reporter.pendingTraffic().get("java-hedge");
      assertEquals(3, traffic.getRequests());
      assertEquals(2, traffic.getSuccesses());
      assertEquals(0, traffic.getFailures());
      assertEquals(1, traffic.getRetrySuccesses());
      assertEquals(3, traffic.getLatencySuccesses().getCountsMap().values().stream().mapToLong(Long::longValue).sum());
      assertFalse(traffic.hasLatencyFailures());
      assertEquals(1, traffic.getHedgesWon()); // the slow call, a hedge answered; the fast one was never hedged
      assertTrue(reporter.flush()); // retryd takes the histograms, and counts the hedge won
      assertEquals("1", hedgesWon("java-hedge"));
    }
  }

  @Test
  void aServedGrpcHedgeWinsAndTheLoserIsCancelled() throws Exception {
    AtomicInteger calls = new AtomicInteger();
    AtomicLong hedgeArrival = new AtomicLong();
    CountDownLatch cancelled = new CountDownLatch(1);
    EchoGrpc.EchoImplBase service =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            int n = calls.incrementAndGet();
            if (n == 2) { // the slow call's first attempt: held until cancelled
              ((ServerCallStreamObserver<EchoReply>) reply).setOnCancelHandler(cancelled::countDown);
              Context.current().addListener(context -> cancelled.countDown(), Runnable::run);
              return;
            }
            if (n == 3) {
              hedgeArrival.set(System.nanoTime());
            }
            reply.onNext(EchoReply.newBuilder().setText("fast").build());
            reply.onCompleted();
          }
        };
    Server upstream = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(service).build().start();
    ManagedChannel channel = NettyChannelBuilder.forAddress("127.0.0.1", upstream.getPort()).usePlaintext().build();
    try (RetrydClient client = RetrydClient.builder(server.target()).build();
        TrafficReporter reporter = quietReporter(client);
        RetrydClientInterceptor interceptor = RetrydClientInterceptor.builder(client, "java-hedge-grpc").reporter(reporter).build()) {
      Hedging h = seed(client, reporter, "java-hedge-grpc", 200);
      // The channel's first call pays for connecting: made without the interceptor.
      EchoGrpc.newBlockingStub(channel).say(EchoRequest.newBuilder().setText("warm").build());
      calls.set(0);
      EchoGrpc.EchoBlockingStub stub =
          EchoGrpc.newBlockingStub(ClientInterceptors.intercept(channel, interceptor))
              .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
              .withDeadlineAfter(HANG_GUARD_SECONDS, TimeUnit.SECONDS);
      assertEquals("fast", stub.say(EchoRequest.newBuilder().setText("a").build()).getText());
      assertEquals(50.0, client.getBudget("java-hedge-grpc").getTokens()); // a fast call asks nothing
      long start = System.nanoTime();
      assertEquals("fast", stub.say(EchoRequest.newBuilder().setText("b").build()).getText());
      assertTrue(hedgeArrival.get() - start >= h.delay().toNanos(), "the hedge went before the served delay");
      assertTrue(cancelled.await(HANG_GUARD_SECONDS, TimeUnit.SECONDS), "the upstream never saw the first call cancelled");
      assertEquals(3, calls.get());
      assertEquals(49.0, client.getBudget("java-hedge-grpc").getTokens());
      UpstreamTraffic traffic = reporter.pendingTraffic().get("java-hedge-grpc");
      assertEquals(2, traffic.getRequests());
      assertEquals(1, traffic.getSuccesses());
      assertEquals(0, traffic.getFailures());
      assertEquals(1, traffic.getRetrySuccesses());
      assertEquals(0, traffic.getRetryFailures());
      assertEquals(1, traffic.getHedgesWon());
      assertTrue(reporter.flush());
      assertEquals("1", hedgesWon("java-hedge-grpc"));
    } finally {
      channel.shutdownNow();
      upstream.shutdownNow();
    }
  }

  @Test
  void aHedgeOverTheCapSendsNoCopy() throws Exception {
    // Each call's first attempt (its lineage entry's attempt 1) is held until
    // the client aborts it, or for 1s (past the ~200ms delay) and then answered
    // "held"; a hedge (attempt 2) at once. Told apart by the lineage rather than
    // by arrival order: on a loaded machine the first call's first attempt,
    // paying for the connection, can arrive after its hedge.
    AtomicInteger arrivals = new AtomicInteger();
    java.util.regex.Pattern firstAttempt = java.util.regex.Pattern.compile("(?i)baggage:[^\r\n]*retryd\\.lineage=[^,;\r\n]*:1(?![0-9])");
    try (RawServer upstream =
            new RawServer(
                (socket, raw) -> {
                  for (String head; (head = raw.readRequest(socket)) != null; ) {
                    arrivals.incrementAndGet();
                    if (firstAttempt.matcher(head).find()) {
                      socket.setSoTimeout(1000);
                      try {
                        if (socket.getInputStream().read() < 0) {
                          return;
                        }
                      } catch (java.net.SocketTimeoutException held) {
                        socket.setSoTimeout(0);
                        answer(socket, "held");
                        continue;
                      }
                    }
                    answer(socket, "fast");
                  }
                });
        RetrydClient client = RetrydClient.builder(server.target()).build();
        TrafficReporter reporter = quietReporter(client);
        RetryingHttpClient http = RetryingHttpClient.builder(HTTP, client).reporter(reporter).build()) {
      seed(client, reporter, "java-hedge-cap", 100); // 5% of 100: 5 hedges over the window
      URI uri = URI.create(upstream.url("http", "/x"));
      for (int i = 1; i <= 5; i++) {
        RetriedResponse<String> response = http.send(HttpRequest.newBuilder(uri).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge-cap"));
        assertEquals("fast", response.body(), "call " + i);
        assertTrue(response.decision().orElseThrow().shouldRetry());
      }
      int before = arrivals.get();
      RetriedResponse<String> denied = http.send(HttpRequest.newBuilder(uri).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge-cap"));
      assertEquals("held", denied.body());
      Decision decision = denied.decision().orElseThrow();
      assertEquals(DenyReason.DENY_REASON_HEDGE_CAP, decision.denyReason());
      assertFalse(decision.fallback());
      assertEquals(1, arrivals.get() - before);
      // Five calls a hedge answered; the sixth, answered by its first attempt, is no hedge won.
      assertEquals(5, reporter.pendingTraffic().get("java-hedge-cap").getHedgesWon());
      assertTrue(reporter.flush());
      assertEquals("5", hedgesWon("java-hedge-cap"));
    }
  }

  /**
   * retryd's {@code retryd_hedges_won_total} for {@code upstream}, off its
   * /metrics ("" without a series): the reported {@code hedges_won}, as retryd
   * counts it.
   */
  private String hedgesWon(String upstream) throws Exception {
    HttpResponse<String> metrics =
        HTTP.send(HttpRequest.newBuilder(URI.create("http://" + server.metrics + "/metrics")).build(), HttpResponse.BodyHandlers.ofString());
    assertEquals(200, metrics.statusCode());
    String prefix = "retryd_hedges_won_total{upstream=\"" + upstream + "\"} ";
    return metrics.body().lines().filter(line -> line.startsWith(prefix)).map(line -> line.substring(prefix.length())).findFirst().orElse("");
  }

  private static void answer(Socket socket, String body) throws IOException {
    OutputStream out = socket.getOutputStream();
    out.write(("HTTP/1.1 200 OK\r\nContent-Length: " + body.length() + "\r\n\r\n" + body).getBytes(StandardCharsets.ISO_8859_1));
    out.flush();
  }
}
