package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.logging.Handler;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.FailureKind;
import retryd.v1.Retryd.Idempotency;

/**
 * Issue 38: one warning per outage of retryd (frozen with SIGSTOP, or killed),
 * whatever the number of fallback decisions and failed traffic batches, and one
 * when it answers again, with the counts. Before: one warning per fallback
 * decision plus one per failed batch.
 */
class OutageWarningTest {
  private final List<LogRecord> warnings = new CopyOnWriteArrayList<>();
  private final Logger logger = Logger.getLogger("dev.retryd.client");
  private final Handler capture =
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

  @BeforeEach
  void listen() {
    logger.addHandler(capture);
  }

  @AfterEach
  void stopListening() {
    logger.removeHandler(capture);
  }

  private static DecideRequest connectFailure() {
    return DecideRequest.newBuilder().setUpstream("java-outage").setOperation("GET /items")
        .setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1).setFailure(FailureKind.FAILURE_KIND_CONNECT).build();
  }

  private List<String> messages() {
    List<String> texts = new java.util.ArrayList<>();
    for (LogRecord record : warnings) {
      texts.add(new java.util.logging.SimpleFormatter().formatMessage(record));
    }
    return texts;
  }

  @Test
  void aFrozenRetrydIsWarnedAboutOnceAndItsReturnOnceWithTheCounts() throws Exception {
    try (RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
        RetrydClient client = RetrydClient.builder(server.target()).build();
        TrafficReporter reporter = TrafficReporter.builder(client).build()) {
      assertFalse(client.decide(connectFailure()).fallback());
      server.freeze();
      int fallbacks = 0;
      try {
        for (int i = 0; i < 6; i++) {
          assertTrue(client.decide(connectFailure()).fallback());
          fallbacks++;
        }
        reporter.record("java-outage");
        assertFalse(reporter.flush(), "the batch cannot be sent to a frozen retryd");
        assertEquals(1, warnings.size(), "warnings: " + messages());
        assertTrue(messages().get(0).startsWith("retryd unreachable"), messages().get(0));
      } finally {
        server.thaw();
      }
      // Poll for retryd's first answer after the thaw (each decision is bounded by its timeout).
      boolean answered = false;
      for (int i = 0; i < 100 && !answered; i++) {
        answered = !client.decide(connectFailure()).fallback();
        if (!answered) {
          fallbacks++;
        }
      }
      assertTrue(answered, "retryd never answered after the thaw");
      assertTrue(reporter.flush());
      assertEquals(2, warnings.size(), "warnings: " + messages());
      String back = messages().get(1);
      assertTrue(back.startsWith("retryd reachable again"), back);
      assertTrue(back.contains(" " + fallbacks + " decisions were made by the local rule and 1 traffic batches failed"), back);
      assertEquals(1, client.outages());
    }
  }

  @Test
  void aKilledRetrydIsWarnedAboutOnce() throws Exception {
    RetrydServer server = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    try (RetrydClient client = RetrydClient.builder(server.target()).build();
        TrafficReporter reporter = TrafficReporter.builder(client).build()) {
      assertFalse(client.decide(connectFailure()).fallback());
      server.close(); // SIGTERM, waited for
      for (int i = 0; i < 6; i++) {
        assertTrue(client.decide(connectFailure()).fallback());
      }
      reporter.record("java-outage");
      assertFalse(reporter.flush());
      reporter.record("java-outage");
      assertFalse(reporter.flush());
      assertEquals(1, warnings.size(), "warnings: " + messages());
      assertTrue(messages().get(0).startsWith("retryd unreachable"), messages().get(0));
      assertEquals(1, client.outages());
    } finally {
      server.close();
    }
  }
}
