package dev.retryd.client;

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.Idempotency;

/**
 * What a fast call costs on an upstream whose hedging retryd enabled (its first
 * attempt goes through {@code sendAsync}, with a hedge timer that never fires)
 * against the same call on an upstream without hedging (the synchronous {@code
 * send}), on loopback. Not part of the suite (surefire excludes *Benchmark); run
 * it with {@code clients/java/run-tests.sh -Dtest=HedgedCallBenchmark}.
 */
class HedgedCallBenchmark {
  private static final int WARMUP = 3_000;
  private static final int ROUNDS = 11;
  private static final int CALLS_PER_ROUND = 1_000;

  @Test
  void fastCallOnAHedgedUpstream() throws Exception {
    byte[] answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".getBytes(StandardCharsets.US_ASCII);
    RawServer server = new RawServer((socket, self) -> {
      socket.setTcpNoDelay(true);
      java.io.OutputStream out = socket.getOutputStream();
      while (self.readRequest(socket) != null) {
        out.write(answer);
        out.flush();
      }
    });
    String config = RetrydServer.CLIENT_TEST_CONFIG + "[upstreams.\"bench-hedged\".hedging]\nquantile = 0.95\n";
    HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
    try (RetrydServer retrydServer = RetrydServer.start(config);
        RetrydClient retryd = RetrydClient.builder(retrydServer.target()).build();
        TrafficReporter reporter = TrafficReporter.builder(retryd).interval(Duration.ofHours(1)).build();
        RetryingHttpClient adapter = RetryingHttpClient.builder(http, retryd).reporter(reporter).build()) {
      // A served delay of ~200ms: no call here is slow enough to ask for a hedge.
      reporter.record("bench-hedged", 200);
      reporter.recordOutcome("bench-hedged", true, false, 200);
      for (int i = 0; i < 200; i++) {
        reporter.recordLatency("bench-hedged", true, TimeUnit.MILLISECONDS.toNanos(i < 180 ? 1 : 200));
      }
      reporter.flush();
      if (!retryd.hedging("bench-hedged").map(h -> h.enabled()).orElse(false)) {
        throw new AssertionError("retryd served no hedging for bench-hedged");
      }
      HttpRequest request = HttpRequest.newBuilder(URI.create(server.url("http", "/items/7"))).build();
      RetryOptions plain = RetryOptions.builder("bench-plain").idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
      RetryOptions hedged = RetryOptions.builder("bench-hedged").idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
      for (int i = 0; i < WARMUP; i++) {
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), plain);
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), hedged);
      }
      List<Double> unhedged = new ArrayList<>();
      List<Double> withHedging = new ArrayList<>();
      List<Double> difference = new ArrayList<>();
      int asked = 0;
      for (int round = 0; round < ROUNDS; round++) {
        long start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          adapter.send(request, HttpResponse.BodyHandlers.ofString(), plain);
        }
        double a = (System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND;
        start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          RetriedResponse<String> response = adapter.send(request, HttpResponse.BodyHandlers.ofString(), hedged);
          if (response.decision().isPresent()) {
            asked++; // slower than the ~200ms delay (a pause of this busy machine): hedged, as it should be
          }
        }
        double b = (System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND;
        unhedged.add(a);
        withHedging.add(b);
        difference.add(b - a);
      }
      System.out.printf("BENCH fast call, upstream without hedging: %.1f us/call (median of %d rounds of %d)%n", median(unhedged), ROUNDS, CALLS_PER_ROUND);
      System.out.printf("BENCH fast call, hedged upstream:          %.1f us/call, %+.1f us/call (rounds %+.1f..%+.1f)%n",
          median(withHedging), median(difference), Collections.min(difference), Collections.max(difference));
      System.out.printf("BENCH calls on the hedged upstream that ran past the delay and asked retryd: %d of %d%n", asked, ROUNDS * CALLS_PER_ROUND);
    } finally {
      server.close();
    }
  }

  private static double median(List<Double> values) {
    List<Double> sorted = new ArrayList<>(values);
    Collections.sort(sorted);
    return sorted.get(sorted.size() / 2);
  }
}
