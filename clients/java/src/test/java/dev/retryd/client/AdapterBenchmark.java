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
import org.junit.jupiter.api.Test;
import retryd.v1.Retryd.Idempotency;

/**
 * The adapter's own cost per successful call, against the bare HttpClient, on
 * loopback. Not part of the suite (surefire excludes *Benchmark); run it with
 * {@code clients/java/run-tests.sh -Dtest=AdapterBenchmark} and read the lines
 * it prints. A successful call never asks retryd; the adapter's own traffic
 * reporter sends its counts to a real retryd once a second, as in production.
 */
class AdapterBenchmark {
  private static final int WARMUP = 5_000;
  private static final int ROUNDS = 7;
  private static final int CALLS_PER_ROUND = 3_000;

  @Test
  void overheadPerSuccessfulCall() throws Exception {
    // A keep-alive server that answers each request with one write (the JDK's
    // com.sun.net.httpserver writes headers and body apart and, with Nagle and
    // delayed ACKs, takes ~45ms a call here, which would drown the figure).
    byte[] answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".getBytes(StandardCharsets.US_ASCII);
    RawServer server = new RawServer((socket, self) -> {
      socket.setTcpNoDelay(true);
      java.io.OutputStream out = socket.getOutputStream();
      while (self.readRequest(socket) != null) {
        out.write(answer);
        out.flush();
      }
    });
    HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
    try (RetrydServer retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
        RetrydClient retryd = RetrydClient.builder(retrydServer.target()).build();
        RetryingHttpClient adapter = RetryingHttpClient.builder(http, retryd).build()) {
      HttpRequest request = HttpRequest.newBuilder(URI.create(server.url("http", "/items/7"))).build();
      RetryOptions options = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(2)).build();
      RetryOptions noDeadline = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
      for (int i = 0; i < WARMUP; i++) {
        http.send(request, HttpResponse.BodyHandlers.ofString());
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), options);
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), noDeadline);
      }
      List<Double> bare = new ArrayList<>();
      List<Double> wrapped = new ArrayList<>();
      List<Double> wrappedNoDeadline = new ArrayList<>();
      // Interleaved rounds, so that drift of the machine hits all three alike.
      for (int round = 0; round < ROUNDS; round++) {
        long start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          http.send(request, HttpResponse.BodyHandlers.ofString());
        }
        bare.add((System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND);
        start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          adapter.send(request, HttpResponse.BodyHandlers.ofString(), options);
        }
        wrapped.add((System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND);
        start = System.nanoTime();
        for (int i = 0; i < CALLS_PER_ROUND; i++) {
          adapter.send(request, HttpResponse.BodyHandlers.ofString(), noDeadline);
        }
        wrappedNoDeadline.add((System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND);
      }
      double b = median(bare);
      double w = median(wrapped);
      double n = median(wrappedNoDeadline);
      System.out.printf("BENCH bare HttpClient.send:            %.1f us/call (median of %d rounds of %d)%n", b, ROUNDS, CALLS_PER_ROUND);
      System.out.printf("BENCH RetryingHttpClient.send, deadline: %.1f us/call, overhead %+.1f us (%+.1f%%)%n", w, w - b, 100 * (w - b) / b);
      System.out.printf("BENCH RetryingHttpClient.send, none:     %.1f us/call, overhead %+.1f us (%+.1f%%)%n", n, n - b, 100 * (n - b) / b);
      TrafficReporter reporter = adapter.reporter().orElseThrow();
      reporter.flush();
      System.out.printf("BENCH first attempts reported: %d entries accepted, %d dropped%n", reporter.acceptedEntries(), reporter.droppedRequests());
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
