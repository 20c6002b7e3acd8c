package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.concurrent.TimeUnit;
import java.util.logging.Handler;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import java.util.concurrent.CopyOnWriteArrayList;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import io.grpc.Server;
import io.grpc.Status;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.StreamObserver;
import java.net.InetSocketAddress;
import retryd.v1.RetryDeciderGrpc;
import retryd.v1.Retryd.ReportTrafficRequest;
import retryd.v1.Retryd.ReportTrafficResponse;

/**
 * TrafficReporter against a real retryd: the budgets of java-report* start at 0
 * and gain exactly one token per reported request (no refill), so a budget
 * shows exactly what was deposited, and a request counted twice shows as twice.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class TrafficReporterTest {
  private RetrydServer server;
  private RetrydClient client;

  @BeforeAll
  void start() throws Exception {
    server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    client = RetrydClient.builder(server.target()).timeout(Duration.ofMillis(300)).build();
  }

  @AfterAll
  void stop() throws Exception {
    client.close();
    server.close();
  }

  private double tokens(String upstream) {
    return client.getBudget(upstream).getTokens();
  }

  @Test
  void recordedCountsFillTheBudget() {
    TrafficReporter reporter = TrafficReporter.builder(client).build();
    for (int i = 0; i < 7; i++) {
      reporter.record("java-report");
    }
    reporter.record("java-report", 3);
    assertEquals(10L, reporter.pending().get("java-report"));
    assertTrue(reporter.flush());
    assertTrue(reporter.pending().isEmpty());
    assertEquals(1, reporter.acceptedEntries());
    assertEquals(10.0, tokens("java-report"), 1e-9);
  }

  @Test
  void theDaemonSendsOnItsOwn() throws Exception {
    try (TrafficReporter reporter = TrafficReporter.builder(client).interval(Duration.ofMillis(100)).build().start()) {
      reporter.record("java-report-daemon", 4);
      long until = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
      while (reporter.acceptedEntries() == 0 && System.nanoTime() < until) {
        Thread.sleep(20);
      }
      assertEquals(1, reporter.acceptedEntries(), "sent by the daemon within 10s");
      assertEquals(4.0, tokens("java-report-daemon"), 1e-9);
    }
  }

  @Test
  void aBatchRetrydDidNotAnswerIsResentWithTheSameIdAndCountedOnce() throws Exception {
    TrafficReporter reporter = TrafficReporter.builder(client).build();
    reporter.record("java-report-resend", 7);
    // Connected first: a connect still in progress when retryd froze can fail,
    // and the channel then fails calls fast until its next reconnect.
    tokens("java-report-resend");
    server.freeze();
    try {
      assertFalse(reporter.flush(), "retryd is frozen: the report times out");
      assertEquals(1, reporter.unsentBatches());
      reporter.record("java-report-resend", 5); // new counts wait for the next batch
    } finally {
      server.thaw();
    }
    // The frozen retryd may still read and apply the first send once thawed;
    // the re-send carries the same report id, so it is applied at most once.
    // Poll: the first flushes after the thaw may still meet the channel's
    // reconnect (each is bounded by the call timeout).
    boolean resent = false;
    for (int i = 0; i < 20 && !resent; i++) {
      resent = reporter.flush();
    }
    assertTrue(resent, "re-sent");
    assertEquals(0, reporter.unsentBatches());
    assertEquals(1, reporter.acceptedEntries() + reporter.alreadyAppliedEntries());
    assertEquals(5L, reporter.pending().get("java-report-resend"));
    assertTrue(reporter.flush());
    // Give a late-applied first send time to land before reading the budget.
    Thread.sleep(300);
    assertEquals(12.0, tokens("java-report-resend"), 1e-9, "7 + 5 requests, each counted once");
  }

  @Test
  void aReportAppliedButUnansweredIsResentAndCountedOnce() throws Exception {
    // retryd applies the report, but its answer is held back by the proxy, so
    // the client times out and re-sends the same batch (same report_id).
    try (PausingProxy proxy = new PausingProxy(server.port());
        RetrydClient viaProxy = RetrydClient.builder("127.0.0.1:" + proxy.port()).timeout(Duration.ofMillis(300)).build()) {
      TrafficReporter reporter = TrafficReporter.builder(viaProxy).build();
      reporter.record("java-report-unanswered", 7);
      // Connect first: grpc-java waits for the server's HTTP/2 settings, which
      // a held proxy would keep from it.
      viaProxy.getBudget("java-report-unanswered");
      proxy.hold(true);
      try {
        assertFalse(reporter.flush(), "no answer: the report times out");
      } finally {
        proxy.hold(false);
      }
      assertEquals(7.0, tokens("java-report-unanswered"), 1e-9, "the first send was applied");
      assertTrue(reporter.flush());
      assertEquals(1, reporter.alreadyAppliedEntries(), "retryd recognised the re-send");
      assertEquals(0, reporter.acceptedEntries());
      assertEquals(7.0, tokens("java-report-unanswered"), 1e-9, "7 requests, counted once");
    }
  }

  @Test
  void aResentBatchKeepsItsIdAndEntries() throws Exception {
    // A scripted RetryDecider that fails the first report as UNAVAILABLE and
    // records what each call carried: the client side of the report-id promise.
    CopyOnWriteArrayList<ReportTrafficRequest> received = new CopyOnWriteArrayList<>();
    RetryDeciderGrpc.RetryDeciderImplBase service =
        new RetryDeciderGrpc.RetryDeciderImplBase() {
          @Override
          public void reportTraffic(ReportTrafficRequest request, StreamObserver<ReportTrafficResponse> reply) {
            received.add(request);
            if (received.size() == 1) {
              reply.onError(Status.UNAVAILABLE.withDescription("scripted outage").asRuntimeException());
              return;
            }
            reply.onNext(ReportTrafficResponse.newBuilder().setAccepted(request.getTrafficCount()).build());
            reply.onCompleted();
          }
        };
    Server scripted = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(service).build().start();
    try (RetrydClient scriptedClient = RetrydClient.builder("127.0.0.1:" + scripted.getPort()).build()) {
      TrafficReporter reporter = TrafficReporter.builder(scriptedClient).build();
      reporter.record("java-a", 2);
      reporter.record("java-b", 3);
      assertFalse(reporter.flush());
      reporter.record("java-a", 10); // not part of the batch being re-sent
      assertTrue(reporter.flush());
      assertTrue(reporter.flush());
      assertEquals(3, received.size());
      ReportTrafficRequest first = received.get(0);
      assertFalse(first.getReportId().isEmpty());
      assertTrue(first.getReportId().length() <= 128 && first.getReportId().chars().allMatch(c -> c > 32 && c < 127));
      assertEquals(first, received.get(1), "the re-send is the same report: id, entries, order");
      assertFalse(received.get(2).getReportId().equals(first.getReportId()), "a new batch has a new id");
      assertEquals(1, received.get(2).getTrafficCount());
      assertEquals(10, received.get(2).getTraffic(0).getRequests());
    } finally {
      scripted.shutdownNow();
    }
  }

  @Test
  void aBatchRefusedForGoodIsDroppedWithOneWarningAndCounted() {
    CopyOnWriteArrayList<LogRecord> warnings = new CopyOnWriteArrayList<>();
    Handler capture =
        new Handler() {
          @Override
          public void publish(LogRecord record) {
            if (record.getLevel().intValue() >= Level.WARNING.intValue()) {
              warnings.add(record);
            }
          }

          @Override
          public void flush() {}

          @Override
          public void close() {}
        };
    Logger logger = Logger.getLogger("dev.retryd.client");
    logger.addHandler(capture);
    try {
      TrafficReporter reporter = TrafficReporter.builder(client).build();
      reporter.record("", 3); // an empty upstream: INVALID_ARGUMENT for the whole report
      reporter.record("java-report-refused", 2);
      assertTrue(reporter.flush(), "nothing left to re-send");
      assertEquals(5, reporter.droppedRequests());
      assertEquals(0, reporter.unsentBatches());
      assertEquals(1, warnings.size(), "one warning per dropped batch");
      assertTrue(warnings.get(0).getParameters()[1].toString().equals("INVALID_ARGUMENT"), String.valueOf(warnings.get(0).getParameters()[1]));
      // The reporter goes on working.
      reporter.record("java-report-refused", 1);
      assertTrue(reporter.flush());
      assertEquals(1, reporter.acceptedEntries());
    } finally {
      logger.removeHandler(capture);
    }
  }

  @Test
  void upstreamsBeyondTheLimitAreDroppedAndCounted() {
    TrafficReporter reporter = TrafficReporter.builder(client).maxUpstreams(2).build();
    reporter.record("java-a");
    reporter.record("java-b");
    reporter.record("java-c", 4);
    reporter.record("java-a");
    assertEquals(4, reporter.droppedRequests());
    assertEquals(2L, reporter.pending().get("java-a"));
  }
}
