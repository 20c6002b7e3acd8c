package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.retryd.client.testproto.EchoGrpc;
import dev.retryd.client.testproto.EchoReply;
import dev.retryd.client.testproto.EchoRequest;
import io.grpc.ClientInterceptors;
import io.grpc.ManagedChannel;
import io.grpc.Server;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.StreamObserver;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.RetryDeciderGrpc;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.ReportTrafficRequest;
import retryd.v1.Retryd.ReportTrafficResponse;
import retryd.v1.Retryd.UpstreamTraffic;

/**
 * Issue 32: reports carry outcomes. The adapters, against a real retryd and real
 * downstream servers, count how every attempt ended; the counts that reach the
 * wire are captured by an in-process ReportTraffic server.
 *
 * <p>The rule: an attempt is a failure when the adapter asked (or would ask)
 * retryd whether to retry it; every other ending is a success (a 404 included);
 * an attempt the caller cancelled is neither.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class OutcomesTest {
  private RetrydServer retrydServer;
  private RetrydClient retryd;
  private Server capture;
  private RetrydClient captureClient;
  private final List<ReportTrafficRequest> received = new CopyOnWriteArrayList<>();
  private final AtomicInteger failFirst = new AtomicInteger();
  private final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();

  @BeforeAll
  void start() throws Exception {
    retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    retryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).noFallback().build();
    RetryDeciderGrpc.RetryDeciderImplBase service =
        new RetryDeciderGrpc.RetryDeciderImplBase() {
          @Override
          public void reportTraffic(ReportTrafficRequest request, StreamObserver<ReportTrafficResponse> reply) {
            received.add(request);
            if (failFirst.getAndDecrement() > 0) {
              reply.onError(Status.UNAVAILABLE.withDescription("injected").asRuntimeException());
              return;
            }
            reply.onNext(ReportTrafficResponse.newBuilder().setAccepted(request.getTrafficCount()).build());
            reply.onCompleted();
          }
        };
    capture = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(service).build().start();
    captureClient = RetrydClient.builder("127.0.0.1:" + capture.getPort()).timeout(Duration.ofSeconds(2)).noFallback().build();
  }

  @AfterAll
  void stop() throws Exception {
    captureClient.close();
    capture.shutdownNow();
    retryd.close();
    retrydServer.close();
  }

  @BeforeEach
  void reset() {
    received.clear();
    failFirst.set(0);
  }

  private static UpstreamTraffic entry(String upstream, long requests, long successes, long failures, long retrySuccesses, long retryFailures) {
    return UpstreamTraffic.newBuilder()
        .setUpstream(upstream)
        .setRequests(requests)
        .setSuccesses(successes)
        .setFailures(failures)
        .setRetrySuccesses(retrySuccesses)
        .setRetryFailures(retryFailures)
        .build();
  }

  /** The entries of the reports delivered, summed per upstream (a re-sent report counted once). */
  private Map<String, UpstreamTraffic> sent() {
    Set<String> seen = new HashSet<>();
    Map<String, long[]> total = new TreeMap<>();
    for (ReportTrafficRequest report : received) {
      if (!seen.add(report.getReportId())) {
        continue;
      }
      for (UpstreamTraffic t : report.getTrafficList()) {
        long[] row = total.computeIfAbsent(t.getUpstream(), u -> new long[5]);
        row[0] += t.getRequests();
        row[1] += t.getSuccesses();
        row[2] += t.getFailures();
        row[3] += t.getRetrySuccesses();
        row[4] += t.getRetryFailures();
      }
    }
    Map<String, UpstreamTraffic> out = new TreeMap<>();
    total.forEach((u, r) -> out.put(u, entry(u, r[0], r[1], r[2], r[3], r[4])));
    return out;
  }

  private static int closedPort() throws Exception {
    try (ServerSocket probe = new ServerSocket(0)) {
      return probe.getLocalPort(); // closed again: nothing listens there now
    }
  }

  private static RetryOptions options(String upstream, Idempotency idempotency) {
    return RetryOptions.builder(upstream).idempotency(idempotency).deadline(Duration.ofSeconds(10)).build();
  }

  private static HttpRequest get(String url) {
    return HttpRequest.newBuilder(URI.create(url)).GET().build();
  }

  @Test
  void httpOutcomesReachTheReport() throws Exception {
    TrafficReporter reporter = TrafficReporter.builder(captureClient).build();
    try (RetryingHttpClient adapter = RetryingHttpClient.builder(http, retryd).reporter(reporter).build()) {
      Object[][] cases = {
        {"java-out-ok", new int[] {200}, 200},
        {"java-out-retried", new int[] {503, 200}, 200},
        {"java-out-404", new int[] {404}, 404},
        {"java-out-500", new int[] {500}, 500}, // asked about, denied (transient_500 = false)
      };
      for (Object[] c : cases) {
        int[] statuses = (int[]) c[1];
        ScriptedHttpServer.Step[] steps = new ScriptedHttpServer.Step[statuses.length];
        for (int i = 0; i < statuses.length; i++) {
          steps[i] = ScriptedHttpServer.status(statuses[i]);
        }
        try (ScriptedHttpServer server = new ScriptedHttpServer(steps)) {
          HttpResponse<String> response =
              adapter.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), options((String) c[0], Idempotency.IDEMPOTENCY_SAFE));
          assertEquals((int) c[2], response.statusCode(), (String) c[0]);
        }
      }
      int port = closedPort();
      assertThrows(
          java.net.ConnectException.class,
          () -> adapter.send(get("http://127.0.0.1:" + port + "/"), HttpResponse.BodyHandlers.ofString(),
              options("java-out-refused", Idempotency.IDEMPOTENCY_NON_IDEMPOTENT)));
      try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503))) {
        HttpRequest post = HttpRequest.newBuilder(URI.create(server.url("/"))).POST(HttpRequest.BodyPublishers.ofString("{}")).build();
        assertThrows(AmbiguousExecutionException.class,
            () -> adapter.send(post, HttpResponse.BodyHandlers.ofString(), options("java-out-charge", Idempotency.IDEMPOTENCY_NON_IDEMPOTENT)));
      }
    }
    assertTrue(reporter.flush());
    Map<String, UpstreamTraffic> want = new TreeMap<>();
    want.put("java-out-ok", entry("java-out-ok", 1, 1, 0, 0, 0));
    want.put("java-out-retried", entry("java-out-retried", 1, 0, 1, 1, 0));
    want.put("java-out-404", entry("java-out-404", 1, 1, 0, 0, 0));
    want.put("java-out-500", entry("java-out-500", 1, 0, 1, 0, 0));
    want.put("java-out-refused", entry("java-out-refused", 1, 0, 1, 0, 2)); // not sent: retried up to 3 attempts
    want.put("java-out-charge", entry("java-out-charge", 1, 0, 1, 0, 0));
    assertEquals(want, sent());
  }

  @Test
  void aResentReportCarriesTheSameOutcomes() throws Exception {
    failFirst.set(1);
    TrafficReporter reporter = TrafficReporter.builder(captureClient).build();
    try (RetryingHttpClient adapter = RetryingHttpClient.builder(http, retryd).reporter(reporter).build()) {
      try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(503), ScriptedHttpServer.status(200))) {
        adapter.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), options("java-out-resend", Idempotency.IDEMPOTENCY_SAFE));
      }
      assertFalse(reporter.flush()); // UNAVAILABLE: kept
      try (ScriptedHttpServer server = new ScriptedHttpServer(ScriptedHttpServer.status(200))) {
        adapter.send(get(server.url("/")), HttpResponse.BodyHandlers.ofString(), options("java-out-resend", Idempotency.IDEMPOTENCY_SAFE));
      }
    }
    assertTrue(reporter.flush()); // the held batch, re-sent
    assertTrue(reporter.flush()); // then what was counted meanwhile
    assertEquals(3, received.size());
    assertEquals(received.get(0), received.get(1), "the re-send is the same report: id, entries, counts");
    UpstreamTraffic first = received.get(0).getTraffic(0);
    UpstreamTraffic third = received.get(2).getTraffic(0);
    assertEquals(List.of(entry("java-out-resend", 1, 0, 1, 1, 0)), List.of(withoutLatency(first)));
    assertNotEquals(received.get(0).getReportId(), received.get(2).getReportId());
    assertEquals(List.of(entry("java-out-resend", 1, 1, 0, 0, 0)), List.of(withoutLatency(third)));
    // The first attempt's latency goes with its outcome (the 503: a failure), the
    // retry's nowhere; the re-send above carried the same histograms.
    assertFalse(first.hasLatencySuccesses());
    assertEquals(1, first.getLatencyFailures().getCountsCount());
    assertEquals(List.of(1L), List.copyOf(first.getLatencyFailures().getCountsMap().values()));
    assertFalse(third.hasLatencyFailures());
    assertEquals(List.of(1L), List.copyOf(third.getLatencySuccesses().getCountsMap().values()));
  }

  private static UpstreamTraffic withoutLatency(UpstreamTraffic entry) {
    return entry.toBuilder().clearLatencySuccesses().clearLatencyFailures().build();
  }

  private static void ok(StreamObserver<EchoReply> reply) {
    reply.onNext(EchoReply.newBuilder().setText("ok").build());
    reply.onCompleted();
  }

  /** An Echo server answering the n-th call with script[n] (the last repeats); null answers never. */
  private static Server echo(Status... script) throws Exception {
    AtomicInteger calls = new AtomicInteger();
    EchoGrpc.EchoImplBase service =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            Status status = script[Math.min(calls.getAndIncrement(), script.length - 1)];
            if (status == null) {
              return; // held until the caller gives up
            }
            if (status.isOk()) {
              ok(reply);
            } else {
              reply.onError(status.asRuntimeException());
            }
          }
        };
    return NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(service).build().start();
  }

  @Test
  void grpcOutcomesReachTheReport() throws Exception {
    TrafficReporter reporter = TrafficReporter.builder(captureClient).build();
    {
      Object[][] cases = {
        {"java-out-grpc-ok", new Status[] {Status.OK}, Status.Code.OK},
        {"java-out-grpc-retried", new Status[] {Status.UNAVAILABLE, Status.OK}, Status.Code.OK},
        {"java-out-grpc-404", new Status[] {Status.NOT_FOUND}, Status.Code.NOT_FOUND},
        {"java-out-grpc-internal", new Status[] {Status.INTERNAL}, Status.Code.INTERNAL}, // asked about, denied
      };
      for (Object[] c : cases) {
        Server server = echo((Status[]) c[1]);
        ManagedChannel channel = NettyChannelBuilder.forAddress("127.0.0.1", server.getPort()).usePlaintext().build();
        try (RetrydClientInterceptor per = RetrydClientInterceptor.builder(retryd, (String) c[0]).reporter(reporter).build()) {
          Status.Code code = Status.Code.OK;
          try {
            EchoGrpc.newBlockingStub(ClientInterceptors.intercept(channel, per))
                .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
                .withDeadlineAfter(10, TimeUnit.SECONDS)
                .say(EchoRequest.newBuilder().setText("x").build());
          } catch (StatusRuntimeException error) {
            code = error.getStatus().getCode();
          }
          assertEquals(c[2], code, (String) c[0]);
        } finally {
          channel.shutdownNow();
          server.shutdownNow();
        }
      }
      ManagedChannel refused = NettyChannelBuilder.forAddress("127.0.0.1", closedPort()).usePlaintext().build();
      try (RetrydClientInterceptor per = RetrydClientInterceptor.builder(retryd, "java-out-grpc-refused").reporter(reporter).build()) {
        StatusRuntimeException error =
            assertThrows(StatusRuntimeException.class,
                () -> EchoGrpc.newBlockingStub(ClientInterceptors.intercept(refused, per))
                    .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_NON_IDEMPOTENT)
                    .withDeadlineAfter(10, TimeUnit.SECONDS)
                    .say(EchoRequest.newBuilder().setText("x").build()));
        assertEquals(Status.Code.UNAVAILABLE, error.getStatus().getCode());
      } finally {
        refused.shutdownNow();
      }
      // Cancelled by the caller while the server holds the call: neither.
      Server held = echo((Status) null);
      ManagedChannel channel = NettyChannelBuilder.forAddress("127.0.0.1", held.getPort()).usePlaintext().build();
      try (RetrydClientInterceptor per = RetrydClientInterceptor.builder(retryd, "java-out-grpc-cancel").reporter(reporter).build()) {
        io.grpc.Context.CancellableContext cancellable = io.grpc.Context.current().withCancellation();
        CountDownLatch ended = new CountDownLatch(1);
        cancellable.run(
            () ->
                EchoGrpc.newStub(ClientInterceptors.intercept(channel, per))
                    .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
                    .say(EchoRequest.newBuilder().setText("x").build(), new StreamObserver<EchoReply>() {
                      @Override
                      public void onNext(EchoReply value) {}

                      @Override
                      public void onError(Throwable t) {
                        ended.countDown();
                      }

                      @Override
                      public void onCompleted() {
                        ended.countDown();
                      }
                    }));
        Thread.sleep(200);
        cancellable.cancel(null);
        assertTrue(ended.await(10, TimeUnit.SECONDS));
      } finally {
        channel.shutdownNow();
        held.shutdownNow();
      }
    }
    assertTrue(reporter.flush());
    Map<String, UpstreamTraffic> want = new TreeMap<>();
    want.put("java-out-grpc-ok", entry("java-out-grpc-ok", 1, 1, 0, 0, 0));
    want.put("java-out-grpc-retried", entry("java-out-grpc-retried", 1, 0, 1, 1, 0));
    want.put("java-out-grpc-404", entry("java-out-grpc-404", 1, 1, 0, 0, 0));
    want.put("java-out-grpc-internal", entry("java-out-grpc-internal", 1, 0, 1, 0, 0));
    want.put("java-out-grpc-refused", entry("java-out-grpc-refused", 1, 0, 1, 0, 2));
    want.put("java-out-grpc-cancel", entry("java-out-grpc-cancel", 1, 0, 0, 0, 0));
    assertEquals(want, sent());
  }

  @Test
  void recordOutcomeWithoutTheAdaptersIsBoundedLikeRequests() {
    TrafficReporter reporter = TrafficReporter.builder(captureClient).build();
    reporter.record("a", 3);
    reporter.recordOutcome("a", true, false);
    reporter.recordOutcome("a", false, false, 2);
    reporter.recordOutcome("a", true, true);
    reporter.recordOutcome("a", false, true, 4);
    reporter.recordOutcome("b", true, true); // a retry whose first attempt was reported earlier
    reporter.recordHedgeWon("a", 2);
    assertEquals(Map.of("a", 3L), reporter.pending());
    assertTrue(reporter.flush());
    assertEquals(
        List.of(entry("a", 3, 1, 2, 1, 4).toBuilder().setHedgesWon(2).build(), entry("b", 0, 0, 0, 1, 0)),
        received.get(0).getTrafficList());

    TrafficReporter bounded = TrafficReporter.builder(captureClient).maxUpstreams(1).build();
    bounded.recordOutcome("a", true, false);
    bounded.record("b", 2);
    bounded.recordOutcome("b", false, false);
    assertEquals(Map.of("a", entry("a", 0, 1, 0, 0, 0)), bounded.pendingTraffic());
    assertEquals(2, bounded.droppedRequests());
  }

  @Test
  void retrydAcceptsReportsWithOutcomes() {
    TrafficReporter reporter = TrafficReporter.builder(retryd).build();
    reporter.record("java-out-real", 2);
    reporter.recordOutcome("java-out-real", true, false);
    reporter.recordOutcome("java-out-real", false, true);
    assertTrue(reporter.flush());
    assertEquals(1, reporter.acceptedEntries());
  }
}
