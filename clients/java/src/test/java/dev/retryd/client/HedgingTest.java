package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.io.OutputStream;
import java.net.ServerSocket;
import java.net.Socket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
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
import java.net.InetSocketAddress;
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UpstreamTraffic;

/** Latency buckets, the hedging table, and hedged HTTP calls against a real upstream. */
class HedgingTest {
  /** A guard against a hang, never a latency claim. */
  private static final long HANG_GUARD_SECONDS = 30;

  @Test
  void bucketsMatchTheContractVectors() {
    // 1000us is in bucket 63: bucket 63 starts at (8+7)<<6 = 960us, bucket 64 at 1024us.
    long[][] vectors = {
      {0, 0}, {15, 15}, {16, 16}, {17, 16}, {18, 17}, {31, 23}, {32, 24}, {1000, 63}, {1023, 63}, {1024, 64},
      {3_600_000_000L, 237}, {7_200_000_000L, 237}, {Long.MAX_VALUE, 237}, {-1, 237}, // -1: 2^64-1 unsigned
    };
    for (long[] v : vectors) {
      assertEquals(v[1], Latency.bucket(v[0]), "bucket(" + v[0] + ")");
    }
    for (int b = 16; b <= Latency.MAX_BUCKET; b++) {
      long start = (long) (8 + b % 8) << (b / 8 - 1);
      assertEquals(b, Latency.bucket(start), "start of bucket " + b);
      assertEquals(b - 1, Latency.bucket(start - 1), "end of bucket " + (b - 1));
    }
  }

  @Test
  void anAbsentUpstreamIsKeptForThreeIntervalsThenDropped() {
    Hedging.Table table = new Hedging.Table(2);
    retryd.v1.Retryd.Hedging served =
        retryd.v1.Retryd.Hedging.newBuilder()
            .setUpstream("a")
            .setEnabled(true)
            .setDelay(Durations.toProto(Duration.ofMillis(20)))
            .setMaxHedges(1)
            .addIdempotency(Idempotency.IDEMPOTENCY_SAFE)
            .addIdempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT)
            .build();
    long now = 1_000_000_000L;
    Duration stale = Duration.ofSeconds(3);
    table.update(List.of(served), now, stale);
    Hedging h = table.lookup("a", now + stale.toNanos()).orElseThrow();
    assertEquals(Duration.ofMillis(20), h.delay());
    assertTrue(h.allows(Idempotency.IDEMPOTENCY_SAFE));
    // Never NON_IDEMPOTENT, even if a (buggy) retryd listed it; never a level it did not list.
    assertFalse(h.allows(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT));
    assertFalse(h.allows(Idempotency.IDEMPOTENCY_IDEMPOTENT_WITH_KEY));
    assertTrue(table.lookup("a", now + stale.toNanos() + 1).isEmpty());
    table.update(
        List.of(served.toBuilder().setUpstream("b").build(), served.toBuilder().setUpstream("c").build(),
            served.toBuilder().setUpstream("d").build()),
        now + stale.toNanos() + 1, stale);
    assertEquals(2, table.size()); // "a" dropped as stale; bounded
  }

  /**
   * An HTTP/1.1 upstream on loopback: its first request to /slow is held until
   * the client closes the connection (or for {@code holdMillis}, then answered
   * "held"); every other request is answered "fast" at once.
   */
  static final class SlowFirst implements AutoCloseable {
    final AtomicInteger slow = new AtomicInteger();
    final AtomicInteger other = new AtomicInteger();
    final AtomicLong hedgeArrivalNanos = new AtomicLong();
    final CountDownLatch cancelled = new CountDownLatch(1);
    final RawServer server;

    SlowFirst(long holdMillis) throws IOException {
      server =
          new RawServer(
              (socket, raw) -> {
                String head;
                while ((head = raw.readRequest(socket)) != null) {
                  if (!head.startsWith("GET /slow")) {
                    other.incrementAndGet();
                    answer(socket, "fast");
                    continue;
                  }
                  int n = slow.incrementAndGet();
                  if (n == 2) {
                    hedgeArrivalNanos.set(System.nanoTime());
                  }
                  if (n == 1) {
                    socket.setSoTimeout((int) holdMillis);
                    try {
                      if (socket.getInputStream().read() < 0) {
                        cancelled.countDown(); // the client aborted the exchange
                        return;
                      }
                    } catch (java.net.SocketTimeoutException held) {
                      socket.setSoTimeout(0);
                      answer(socket, "held");
                      continue;
                    } catch (IOException reset) {
                      cancelled.countDown();
                      return;
                    }
                  }
                  answer(socket, "fast");
                }
              });
    }

    private static void answer(Socket socket, String body) throws IOException {
      OutputStream out = socket.getOutputStream();
      out.write(("HTTP/1.1 200 OK\r\nContent-Length: " + body.length() + "\r\n\r\n" + body).getBytes(StandardCharsets.ISO_8859_1));
      out.flush();
    }

    URI uri(String path) {
      return URI.create(server.url("http", path));
    }

    @Override
    public void close() throws IOException {
      server.close();
    }
  }

  private static int freePort() throws IOException {
    try (ServerSocket socket = new ServerSocket(0)) {
      return socket.getLocalPort();
    }
  }

  /** A client whose retryd is down, known to be down (a traffic report failed). */
  private static RetrydClient unreachable(LocalPolicy policy, TrafficReporter[] reporter) throws IOException {
    RetrydClient client = RetrydClient.builder("127.0.0.1:" + freePort()).fallback(policy).build();
    reporter[0] = TrafficReporter.builder(client).interval(Duration.ofHours(1)).build();
    reporter[0].record("warm-up");
    assertFalse(reporter[0].flush(), "a report to a closed port was taken");
    return client;
  }

  private static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

  private static RetryOptions safe(String upstream) {
    return RetryOptions.builder(upstream).idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
  }

  private static long successes(UpstreamTraffic entry) {
    return entry.getLatencySuccesses().getCountsMap().values().stream().mapToLong(Long::longValue).sum();
  }

  @Test
  void aLocalHedgeWinsAndTheSlowFirstAttemptIsCancelled() throws Exception {
    Duration delay = Duration.ofMillis(50);
    TrafficReporter[] reporter = new TrafficReporter[1];
    try (SlowFirst upstream = new SlowFirst(TimeUnit.SECONDS.toMillis(HANG_GUARD_SECONDS));
        RetrydClient client = unreachable(LocalPolicy.DEFAULT.withHedgeDelay(delay), reporter);
        RetryingHttpClient http = RetryingHttpClient.builder(HTTP, client).reporter(reporter[0]).build()) {
      // 25 first attempts earn one local token (0.05 each); NON_IDEMPOTENT, so
      // none of them is hedged however slow the machine.
      RetryOptions warm = RetryOptions.builder("java-hedge-local").idempotency(Idempotency.IDEMPOTENCY_NON_IDEMPOTENT).build();
      for (int i = 0; i < 25; i++) {
        RetriedResponse<String> response =
            http.send(HttpRequest.newBuilder(upstream.uri("/warm")).build(), HttpResponse.BodyHandlers.ofString(), warm);
        assertEquals("fast", response.body());
        assertTrue(response.decision().isEmpty());
      }
      long start = System.nanoTime();
      RetriedResponse<String> response =
          http.send(HttpRequest.newBuilder(upstream.uri("/slow")).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge-local"));
      assertEquals("fast", response.body());
      Decision hedge = response.decision().orElseThrow();
      assertTrue(hedge.shouldRetry() && hedge.fallback(), hedge.toString());
      // The timer starts when the first attempt is sent, after start.
      assertTrue(upstream.hedgeArrivalNanos.get() - start >= delay.toNanos(), "the hedge went before the delay");
      assertTrue(upstream.cancelled.await(HANG_GUARD_SECONDS, TimeUnit.SECONDS), "the upstream never saw the first attempt cancelled");
      assertEquals(2, upstream.slow.get());
      // The loser is neither a failure nor an outcome; the winning hedge is an
      // attempt after the first; the first attempt's time counts as a success.
      UpstreamTraffic traffic = reporter[0].pendingTraffic().get("java-hedge-local");
      assertEquals(26, traffic.getRequests());
      assertEquals(25, traffic.getSuccesses());
      assertEquals(0, traffic.getFailures());
      assertEquals(1, traffic.getRetrySuccesses());
      assertEquals(0, traffic.getRetryFailures());
      assertEquals(1, traffic.getHedgesWon()); // the local hedge answered the call
      assertEquals(26, successes(traffic));
      assertFalse(traffic.hasLatencyFailures());
      long slowOnes =
          traffic.getLatencySuccesses().getCountsMap().entrySet().stream()
              .filter(e -> e.getKey() >= Latency.bucketOf(delay))
              .mapToLong(Map.Entry::getValue)
              .sum();
      assertTrue(slowOnes >= 1, traffic.toString());
    }
  }

  @Test
  void aDeniedHedgeSendsNoCopy() throws Exception {
    TrafficReporter[] reporter = new TrafficReporter[1];
    try (SlowFirst upstream = new SlowFirst(300);
        RetrydClient client = unreachable(LocalPolicy.DEFAULT.withHedgeDelay(Duration.ofMillis(20)), reporter);
        RetryingHttpClient http = RetryingHttpClient.builder(HTTP, client).reporter(reporter[0]).build()) {
      // No first attempt yet, so no token: HEDGE_CAP, and no copy.
      RetriedResponse<String> response =
          http.send(HttpRequest.newBuilder(upstream.uri("/slow")).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge-denied"));
      assertEquals("held", response.body());
      assertEquals(DenyReason.DENY_REASON_HEDGE_CAP, response.decision().orElseThrow().denyReason());
      assertEquals(1, upstream.slow.get());
      UpstreamTraffic traffic = reporter[0].pendingTraffic().get("java-hedge-denied");
      assertEquals(1, traffic.getRequests());
      assertEquals(1, traffic.getSuccesses());
      assertEquals(0, traffic.getHedgesWon()); // no copy: the first attempt answered
      assertEquals(1, successes(traffic));
    }
  }

  @Test
  void noLocalHedgingByDefault() throws Exception {
    TrafficReporter[] reporter = new TrafficReporter[1];
    try (SlowFirst upstream = new SlowFirst(100);
        RetrydClient client = unreachable(LocalPolicy.DEFAULT, reporter);
        RetryingHttpClient http = RetryingHttpClient.builder(HTTP, client).reporter(reporter[0]).build()) {
      RetriedResponse<String> response =
          http.send(HttpRequest.newBuilder(upstream.uri("/slow")).build(), HttpResponse.BodyHandlers.ofString(), safe("java-hedge-off"));
      assertEquals("held", response.body());
      assertTrue(response.decision().isEmpty());
      assertEquals(1, upstream.slow.get());
    }
  }

  @Test
  void aGrpcLocalHedgeWinsAndTheSlowFirstCallIsCancelled() throws Exception {
    AtomicInteger calls = new AtomicInteger();
    AtomicLong hedgeArrival = new AtomicLong();
    CountDownLatch cancelled = new CountDownLatch(1);
    EchoGrpc.EchoImplBase service =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            int n = request.getText().equals("warm") ? 0 : calls.incrementAndGet();
            if (n == 1) {
              // Held until the client cancels it (the hedge won).
              ((ServerCallStreamObserver<EchoReply>) reply).setOnCancelHandler(cancelled::countDown);
              Context.current().addListener(context -> cancelled.countDown(), Runnable::run);
              return;
            }
            if (n == 2) {
              hedgeArrival.set(System.nanoTime());
            }
            reply.onNext(EchoReply.newBuilder().setText("fast").build());
            reply.onCompleted();
          }
        };
    Server server = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(service).build().start();
    ManagedChannel channel = NettyChannelBuilder.forAddress("127.0.0.1", server.getPort()).usePlaintext().build();
    Duration delay = Duration.ofMillis(50);
    TrafficReporter[] reporter = new TrafficReporter[1];
    try (RetrydClient client = unreachable(LocalPolicy.DEFAULT.withHedgeDelay(delay), reporter);
        RetrydClientInterceptor interceptor = RetrydClientInterceptor.builder(client, "java-grpc-hedge").reporter(reporter[0]).build()) {
      for (int i = 0; i < 25; i++) {
        client.firstAttemptSent("java-grpc-hedge"); // as 25 calls would
      }
      // The channel's first call pays for connecting (on a loaded machine, past
      // the delay, so that the hedge would reach the server first): made without
      // the interceptor.
      EchoGrpc.newBlockingStub(channel).say(EchoRequest.newBuilder().setText("warm").build());
      long start = System.nanoTime();
      EchoReply reply =
          EchoGrpc.newBlockingStub(ClientInterceptors.intercept(channel, interceptor))
              .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
              .withDeadlineAfter(HANG_GUARD_SECONDS, TimeUnit.SECONDS)
              .say(EchoRequest.newBuilder().setText("hi").build());
      assertEquals("fast", reply.getText());
      assertTrue(hedgeArrival.get() - start >= delay.toNanos(), "the hedge went before the delay");
      assertTrue(cancelled.await(HANG_GUARD_SECONDS, TimeUnit.SECONDS), "the upstream never saw the first call cancelled");
      assertEquals(2, calls.get());
      UpstreamTraffic traffic = reporter[0].pendingTraffic().get("java-grpc-hedge");
      assertEquals(1, traffic.getRequests());
      assertEquals(0, traffic.getSuccesses());
      assertEquals(0, traffic.getFailures());
      assertEquals(1, traffic.getRetrySuccesses());
      assertEquals(0, traffic.getRetryFailures());
      assertEquals(1, traffic.getHedgesWon());
      assertEquals(1, successes(traffic)); // the cancelled first call's time
      assertFalse(traffic.hasLatencyFailures());
    } finally {
      channel.shutdownNow();
      server.shutdownNow();
    }
  }
}
