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
  private static final int ROUNDS = 15;
  private static final int CALLS_PER_ROUND = 2_000;

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
      // What the adapter sends under a deadline: the JDK's own timer per request is part of the cost.
      HttpRequest timed = HttpRequest.newBuilder(URI.create(server.url("http", "/items/7"))).timeout(Duration.ofSeconds(2)).build();
      RetryOptions options = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(2)).build();
      RetryOptions noDeadline = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
      for (int i = 0; i < WARMUP; i++) {
        http.send(request, HttpResponse.BodyHandlers.ofString());
        http.send(timed, HttpResponse.BodyHandlers.ofString());
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), options);
        adapter.send(request, HttpResponse.BodyHandlers.ofString(), noDeadline);
      }
      List<Double> bare = new ArrayList<>();
      List<Double> bareTimed = new ArrayList<>();
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
          http.send(timed, HttpResponse.BodyHandlers.ofString());
        }
        bareTimed.add((System.nanoTime() - start) / 1e3 / CALLS_PER_ROUND);
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
      // Each round measures all four back to back, so the per-round difference
      // cancels most of the machine's drift; the median of those differences
      // is the figure, their spread how far to trust it.
      List<Double> overhead = new ArrayList<>();
      List<Double> overheadTimed = new ArrayList<>();
      for (int round = 0; round < ROUNDS; round++) {
        overhead.add(wrappedNoDeadline.get(round) - bare.get(round));
        overheadTimed.add(wrapped.get(round) - bareTimed.get(round));
      }
      System.out.printf("BENCH bare HttpClient.send:                  %.1f us/call (median of %d rounds of %d calls)%n", median(bare), ROUNDS, CALLS_PER_ROUND);
      System.out.printf("BENCH RetryingHttpClient.send, no deadline:  %.1f us/call, overhead %+.1f us/call (rounds %+.1f..%+.1f)%n",
          median(wrappedNoDeadline), median(overhead), Collections.min(overhead), Collections.max(overhead));
      System.out.printf("BENCH bare HttpClient.send, 2s timeout:      %.1f us/call%n", median(bareTimed));
      System.out.printf("BENCH RetryingHttpClient.send, 2s deadline:  %.1f us/call, overhead %+.1f us/call over the timed bare call (rounds %+.1f..%+.1f)%n",
          median(wrapped), median(overheadTimed), Collections.min(overheadTimed), Collections.max(overheadTimed));
      TrafficReporter reporter = adapter.reporter().orElseThrow();
      reporter.flush();
      System.out.printf("BENCH first attempts reported: %d entries accepted, %d dropped%n", reporter.acceptedEntries(), reporter.droppedRequests());
    } finally {
      server.close();
    }
  }

  /**
   * The adapter's own CPU cost per successful call, without I/O: over an
   * HttpClient that answers at once from memory (handler applied, one buffer,
   * complete, as the JDK does), so the machine's network noise is out of it.
   */
  @Test
  void ownCostPerSuccessfulCallWithoutIo() throws Exception {
    HttpClient canned = new CannedHttpClient();
    try (RetrydClient retryd = RetrydClient.builder("127.0.0.1:9").build();
        RetryingHttpClient adapter = RetryingHttpClient.builder(canned, retryd).reporter(TrafficReporter.builder(retryd).build()).build()) {
      HttpRequest request = HttpRequest.newBuilder(URI.create("http://127.0.0.1:9/items/7")).build();
      RetryOptions noDeadline = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).build();
      RetryOptions deadline = RetryOptions.builder("bench").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(2)).build();
      int calls = 200_000;
      List<Double> bare = new ArrayList<>();
      List<Double> plain = new ArrayList<>();
      List<Double> timed = new ArrayList<>();
      for (int round = 0; round < 8; round++) {
        long start = System.nanoTime();
        for (int i = 0; i < calls; i++) {
          canned.send(request, HttpResponse.BodyHandlers.ofString());
        }
        bare.add((System.nanoTime() - start) / (double) calls);
        start = System.nanoTime();
        for (int i = 0; i < calls; i++) {
          adapter.send(request, HttpResponse.BodyHandlers.ofString(), noDeadline);
        }
        plain.add((System.nanoTime() - start) / (double) calls);
        start = System.nanoTime();
        for (int i = 0; i < calls; i++) {
          adapter.send(request, HttpResponse.BodyHandlers.ofString(), deadline);
        }
        timed.add((System.nanoTime() - start) / (double) calls);
      }
      // The first rounds warm the JIT up; the median of all 8 ignores them.
      System.out.printf("BENCH no I/O: bare %.0f ns/call; adapter %.0f ns/call without a deadline (+%.0f ns), %.0f ns/call with one (+%.0f ns)%n",
          median(bare), median(plain), median(plain) - median(bare), median(timed), median(timed) - median(bare));
    }
  }

  /** An HttpClient that answers every request at once from memory, for {@link #ownCostPerSuccessfulCallWithoutIo}. */
  private static final class CannedHttpClient extends HttpClient {
    private static final java.net.http.HttpHeaders HEADERS = java.net.http.HttpHeaders.of(java.util.Map.of(), (a, b) -> true);

    @Override
    public <T> HttpResponse<T> send(HttpRequest request, HttpResponse.BodyHandler<T> handler) {
      HttpResponse.ResponseInfo info = new HttpResponse.ResponseInfo() {
        @Override public int statusCode() { return 200; }
        @Override public java.net.http.HttpHeaders headers() { return HEADERS; }
        @Override public Version version() { return Version.HTTP_1_1; }
      };
      HttpResponse.BodySubscriber<T> subscriber = handler.apply(info);
      subscriber.onSubscribe(new java.util.concurrent.Flow.Subscription() {
        @Override public void request(long n) {}
        @Override public void cancel() {}
      });
      subscriber.onNext(List.of(java.nio.ByteBuffer.wrap(new byte[] {'o', 'k'})));
      subscriber.onComplete();
      T body = subscriber.getBody().toCompletableFuture().join();
      return new HttpResponse<T>() {
        @Override public int statusCode() { return 200; }
        @Override public HttpRequest request() { return request; }
        @Override public java.util.Optional<HttpResponse<T>> previousResponse() { return java.util.Optional.empty(); }
        @Override public java.net.http.HttpHeaders headers() { return HEADERS; }
        @Override public T body() { return body; }
        @Override public java.util.Optional<javax.net.ssl.SSLSession> sslSession() { return java.util.Optional.empty(); }
        @Override public URI uri() { return request.uri(); }
        @Override public Version version() { return Version.HTTP_1_1; }
      };
    }

    @Override
    public <T> java.util.concurrent.CompletableFuture<HttpResponse<T>> sendAsync(HttpRequest request, HttpResponse.BodyHandler<T> handler) {
      return java.util.concurrent.CompletableFuture.completedFuture(send(request, handler));
    }

    @Override
    public <T> java.util.concurrent.CompletableFuture<HttpResponse<T>> sendAsync(
        HttpRequest request, HttpResponse.BodyHandler<T> handler, HttpResponse.PushPromiseHandler<T> push) {
      return sendAsync(request, handler);
    }

    @Override public java.util.Optional<java.net.CookieHandler> cookieHandler() { return java.util.Optional.empty(); }
    @Override public java.util.Optional<Duration> connectTimeout() { return java.util.Optional.empty(); }
    @Override public Redirect followRedirects() { return Redirect.NEVER; }
    @Override public java.util.Optional<java.net.ProxySelector> proxy() { return java.util.Optional.empty(); }
    @Override public javax.net.ssl.SSLContext sslContext() { return null; }
    @Override public javax.net.ssl.SSLParameters sslParameters() { return null; }
    @Override public java.util.Optional<java.net.Authenticator> authenticator() { return java.util.Optional.empty(); }
    @Override public Version version() { return Version.HTTP_1_1; }
    @Override public java.util.Optional<java.util.concurrent.Executor> executor() { return java.util.Optional.empty(); }
  }

  private static double median(List<Double> values) {
    List<Double> sorted = new ArrayList<>(values);
    Collections.sort(sorted);
    return sorted.get(sorted.size() / 2);
  }
}
