package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.sun.net.httpserver.HttpContext;
import com.sun.net.httpserver.HttpServer;
import dev.retryd.client.testproto.EchoGrpc;
import dev.retryd.client.testproto.EchoReply;
import dev.retryd.client.testproto.EchoRequest;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.Contexts;
import io.grpc.ForwardingClientCall;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Server;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.ServerInterceptors;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.netty.NettyServerBuilder;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.Idempotency;

/**
 * A real call chain on loopback (docs/lineage.md): an edge calls a middle
 * server, whose handler calls a back end that always fails, through the
 * adapters, with the middleware on the middle. Over HTTP (com.sun.net.httpserver,
 * java.net.http) and gRPC (netty). The back end counts what reaches it.
 *
 * <p>retryd must apply the chain rule (RETRIED_BELOW, INSIDE_ENCLOSING_RETRY):
 * the suite fails, not skips, on one that does not.
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class ChainTest {
  private static final Metadata.Key<String> BAGGAGE = Metadata.Key.of("baggage", Metadata.ASCII_STRING_MARSHALLER);
  private static final Metadata.Key<String> RETRIED = Metadata.Key.of("retryd-retried", Metadata.ASCII_STRING_MARSHALLER);
  private static final Metadata.Key<String> PUSHBACK = Metadata.Key.of("grpc-retry-pushback-ms", Metadata.ASCII_STRING_MARSHALLER);

  private RetrydServer retrydServer;
  private RetrydClient edgeRetryd;
  private RetrydClient middleRetryd;

  // HTTP: the back end and the middle.
  private HttpServer backEnd;
  private HttpServer middle;
  private ExecutorService middleThreads;
  private RetryingHttpClient middleHttp;
  private RetryingHttpClient edgeHttp;
  private final List<String> backEndBaggage = new CopyOnWriteArrayList<>();
  private final List<String> middleBaggage = new CopyOnWriteArrayList<>();
  private final List<String> middleLineage = new CopyOnWriteArrayList<>();
  private final AtomicReference<Decision> middleDecision = new AtomicReference<>();

  // gRPC: the back end and the middle.
  private Server grpcBackEnd;
  private Server grpcMiddle;
  private ManagedChannel toGrpcBackEnd;
  private ManagedChannel toGrpcMiddle;
  private RetrydClientInterceptor middleInterceptor;
  private RetrydClientInterceptor edgeInterceptor;
  private final List<String> grpcBackEndBaggage = new CopyOnWriteArrayList<>();
  private final List<String> grpcMiddleBaggage = new CopyOnWriteArrayList<>();
  private final AtomicReference<Decision> grpcMiddleDecision = new AtomicReference<>();

  @BeforeAll
  void start() throws Exception {
    retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    edgeRetryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).layer("edge").build();
    middleRetryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).layer("middle").build();
    Decision probe =
        edgeRetryd.decide(
            DecideRequest.newBuilder().setUpstream("java-chain-probe").setIdempotency(Idempotency.IDEMPOTENCY_SAFE).setAttempt(1)
                .setEvidence(Evidence.EVIDENCE_RESPONSE_RECEIVED).setHttpStatus(503).setRetriedBelow("probe").build());
    assertFalse(probe.fallback(), "retryd must answer the probe");
    // A retryd without the chain rule fails the suite rather than skipping it: a skip could only hide a stale binary.
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, probe.denyReason(), "this retryd does not apply the chain rule: " + RetrydServer.binary());

    backEnd = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    backEnd.createContext(
        "/",
        exchange -> {
          backEndBaggage.add(String.join("|", exchange.getRequestHeaders().getOrDefault("baggage", List.of())));
          exchange.getRequestBody().readAllBytes();
          exchange.sendResponseHeaders(503, -1);
          exchange.close();
        });
    backEnd.start();

    middleHttp = RetryingHttpClient.builder(HttpClient.newHttpClient(), middleRetryd).noTrafficReport().build();
    edgeHttp = RetryingHttpClient.builder(HttpClient.newHttpClient(), edgeRetryd).noTrafficReport().build();
    middle = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    middleThreads = Executors.newFixedThreadPool(2);
    middle.setExecutor(middleThreads);
    HttpContext context =
        middle.createContext(
            "/",
            exchange -> {
              middleBaggage.add(String.join("|", exchange.getRequestHeaders().getOrDefault("baggage", List.of())));
              middleLineage.add(Lineage.current().map(Lineage.Inbound::lineage).orElse("<none>"));
              exchange.getRequestBody().readAllBytes();
              int status;
              try {
                RetriedResponse<Void> response =
                    middleHttp.send(
                        HttpRequest.newBuilder(URI.create("http://127.0.0.1:" + backEnd.getAddress().getPort() + "/items")).build(),
                        HttpResponse.BodyHandlers.discarding(),
                        RetryOptions.builder("java-chain-back").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(5)).build());
                middleDecision.set(response.decision().orElse(null));
                status = response.statusCode() >= 500 ? 503 : 200;
              } catch (IOException | InterruptedException failed) {
                status = 503;
              }
              exchange.sendResponseHeaders(status, -1);
              exchange.close();
            });
    context.getFilters().add(LineageFilter.of(middleRetryd));
    middle.start();

    startGrpc();
  }

  private void startGrpc() throws IOException {
    EchoGrpc.EchoImplBase failing =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            reply.onError(Status.UNAVAILABLE.withDescription("back end down").asRuntimeException());
          }
        };
    grpcBackEnd =
        NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0))
            .addService(ServerInterceptors.intercept(failing, recordBaggage(grpcBackEndBaggage)))
            .build()
            .start();
    toGrpcBackEnd = NettyChannelBuilder.forAddress("127.0.0.1", grpcBackEnd.getPort()).usePlaintext().build();
    middleInterceptor = RetrydClientInterceptor.builder(middleRetryd, "java-chain-grpc-back").noTrafficReport().build();
    EchoGrpc.EchoBlockingStub backEndStub =
        EchoGrpc.newBlockingStub(ClientInterceptors.intercept(toGrpcBackEnd, middleInterceptor))
            .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE);
    EchoGrpc.EchoImplBase calling =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            try {
              reply.onNext(backEndStub.withDeadlineAfter(5, TimeUnit.SECONDS).say(request));
              reply.onCompleted();
            } catch (StatusRuntimeException failed) {
              grpcMiddleDecision.set(RetrydClientInterceptor.decisionOf(failed).orElse(null));
              reply.onError(Status.UNAVAILABLE.withDescription("dependency failed").asRuntimeException());
            }
          }
        };
    // The lineage interceptor is listed last so that it runs first: the recorder sees the same headers.
    grpcMiddle =
        NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0))
            .addService(ServerInterceptors.intercept(calling, recordBaggage(grpcMiddleBaggage), LineageServerInterceptor.of(middleRetryd)))
            .build()
            .start();
    toGrpcMiddle = NettyChannelBuilder.forAddress("127.0.0.1", grpcMiddle.getPort()).usePlaintext().build();
    edgeInterceptor = RetrydClientInterceptor.builder(edgeRetryd, "java-chain-grpc-middle").noTrafficReport().build();
  }

  private static ServerInterceptor recordBaggage(List<String> into) {
    return new ServerInterceptor() {
      @Override
      public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata headers, ServerCallHandler<Q, R> next) {
        Iterable<String> values = headers.getAll(BAGGAGE);
        into.add(values == null ? "" : String.join("|", values));
        return Contexts.interceptCall(io.grpc.Context.current(), call, headers, next);
      }
    };
  }

  /** Puts baggage of the caller's own on every call (listed before the retrying interceptor: it runs per attempt). */
  private static ClientInterceptor baggage(String value) {
    return new ClientInterceptor() {
      @Override
      public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
        return new ForwardingClientCall.SimpleForwardingClientCall<Q, R>(next.newCall(method, options)) {
          @Override
          public void start(Listener<R> listener, Metadata headers) {
            headers.put(BAGGAGE, value);
            super.start(listener, headers);
          }
        };
      }
    };
  }

  @BeforeEach
  void reset() {
    backEndBaggage.clear();
    middleBaggage.clear();
    middleLineage.clear();
    middleDecision.set(null);
    grpcBackEndBaggage.clear();
    grpcMiddleBaggage.clear();
    grpcMiddleDecision.set(null);
  }

  @AfterAll
  void stop() throws Exception {
    toGrpcMiddle.shutdownNow();
    toGrpcBackEnd.shutdownNow();
    grpcMiddle.shutdownNow();
    grpcBackEnd.shutdownNow();
    middleInterceptor.close();
    edgeInterceptor.close();
    middle.stop(0);
    middleThreads.shutdownNow();
    backEnd.stop(0);
    middleHttp.close();
    edgeHttp.close();
    edgeRetryd.close();
    middleRetryd.close();
    retrydServer.close();
  }

  private URI middleUri() {
    return URI.create("http://127.0.0.1:" + middle.getAddress().getPort() + "/orders");
  }

  @Test
  void theMiddleRetriesTheBackEndAndMarksItsFailure() throws Exception {
    // A plain client as the edge, so that what the middle does is seen whatever retryd's rule.
    HttpResponse<Void> response =
        HttpClient.newHttpClient()
            .send(
                HttpRequest.newBuilder(middleUri()).header("baggage", "userId=42,retryd.lineage=edge:1").build(),
                HttpResponse.BodyHandlers.discarding());
    assertEquals(503, response.statusCode());
    assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
    assertEquals(List.of("edge:1"), middleLineage);
    // max_attempts = 3: three requests, each with its own attempt number after the inbound lineage.
    assertEquals(
        List.of("retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:2", "retryd.lineage=edge:1/middle:3"),
        backEndBaggage);
    assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, middleDecision.get().denyReason());
    assertFalse(middleDecision.get().fallback());
  }

  @Test
  void aSuccessIsNotMarkedAndNoInboundLineageMeansTheOwnEntryOnly() throws Exception {
    // Without an inbound lineage the middle's request is its own first entry; a 200 carries no mark.
    HttpServer ok = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    List<String> seen = new CopyOnWriteArrayList<>();
    ok.createContext(
        "/",
        exchange -> {
          seen.add(String.join("|", exchange.getRequestHeaders().getOrDefault("baggage", List.of())));
          exchange.sendResponseHeaders(200, -1);
          exchange.close();
        });
    ok.start();
    try {
      RetriedResponse<Void> response =
          edgeHttp.send(
              HttpRequest.newBuilder(URI.create("http://127.0.0.1:" + ok.getAddress().getPort() + "/"))
                  .header("baggage", "a=1, retryd.lineage=stale:9")
                  .header("baggage", "b=2;p")
                  .build(),
              HttpResponse.BodyHandlers.discarding(),
              RetryOptions.builder("java-chain-ok").idempotency(Idempotency.IDEMPOTENCY_SAFE).build());
      assertEquals(200, response.statusCode());
      assertEquals(List.of("a=1,b=2;p,retryd.lineage=edge:1"), seen);
    } finally {
      ok.stop(0);
    }
    // The middle's filter on a request without baggage: an empty lineage, still a served request.
    HttpResponse<Void> plain = HttpClient.newHttpClient().send(HttpRequest.newBuilder(middleUri()).build(), HttpResponse.BodyHandlers.discarding());
    assertEquals(503, plain.statusCode());
    assertEquals(List.of(""), middleLineage);
    assertEquals(List.of("retryd.lineage=middle:1", "retryd.lineage=middle:2", "retryd.lineage=middle:3"), backEndBaggage);
  }

  @Test
  void theFilterMarksOnlyA5xxAfterAFailedDecision() throws Exception {
    // The handler says by its query what happened below it; the filter's wrapped exchange does the rest.
    HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    server
        .createContext(
            "/",
            exchange -> {
              String query = exchange.getRequestURI().getQuery();
              int status = Integer.parseInt(query.substring(query.indexOf('=') + 1));
              if (query.startsWith("failedBelow")) {
                Lineage.current().orElseThrow().markFailedAfterDecision();
              }
              exchange.sendResponseHeaders(status, -1);
              exchange.close();
            })
        .getFilters()
        .add(LineageFilter.of("middle"));
    server.start();
    try {
      HttpClient client = HttpClient.newHttpClient();
      String base = "http://127.0.0.1:" + server.getAddress().getPort() + "/?";
      for (String[] row : new String[][] {{"failedBelow=503", "middle"}, {"failedBelow=500", "middle"}, {"failedBelow=404", ""},
          {"failedBelow=200", ""}, {"ownFailure=503", ""}}) {
        HttpResponse<Void> response = client.send(HttpRequest.newBuilder(URI.create(base + row[0])).build(), HttpResponse.BodyHandlers.discarding());
        assertEquals(row[1], response.headers().firstValue("retryd-retried").orElse(""), row[0]);
      }
    } finally {
      server.stop(0);
    }
  }

  @Test
  void onAnHttpsServerTheHandlerStillGetsTheTlsSession() throws Exception {
    java.nio.file.Path keystore = java.nio.file.Files.createTempDirectory("retryd-chain-tls-").resolve("server.p12");
    Process keytool =
        new ProcessBuilder(
                java.nio.file.Paths.get(System.getProperty("java.home"), "bin", "keytool").toString(),
                "-genkeypair", "-alias", "server", "-keyalg", "RSA", "-keysize", "2048", "-validity", "2",
                "-dname", "CN=127.0.0.1", "-ext", "san=ip:127.0.0.1", "-storetype", "PKCS12",
                "-keystore", keystore.toString(), "-storepass", "changeit", "-keypass", "changeit")
            .redirectErrorStream(true)
            .start();
    String output = new String(keytool.getInputStream().readAllBytes(), java.nio.charset.StandardCharsets.UTF_8);
    assertEquals(0, keytool.waitFor(), "keytool failed: " + output);
    java.security.KeyStore store = java.security.KeyStore.getInstance("PKCS12");
    try (java.io.InputStream in = java.nio.file.Files.newInputStream(keystore)) {
      store.load(in, "changeit".toCharArray());
    }
    javax.net.ssl.KeyManagerFactory keys = javax.net.ssl.KeyManagerFactory.getInstance(javax.net.ssl.KeyManagerFactory.getDefaultAlgorithm());
    keys.init(store, "changeit".toCharArray());
    javax.net.ssl.TrustManagerFactory trust = javax.net.ssl.TrustManagerFactory.getInstance(javax.net.ssl.TrustManagerFactory.getDefaultAlgorithm());
    trust.init(store);
    javax.net.ssl.SSLContext serverTls = javax.net.ssl.SSLContext.getInstance("TLS");
    serverTls.init(keys.getKeyManagers(), null, null);
    javax.net.ssl.SSLContext clientTls = javax.net.ssl.SSLContext.getInstance("TLS");
    clientTls.init(null, trust.getTrustManagers(), null);
    com.sun.net.httpserver.HttpsServer https = com.sun.net.httpserver.HttpsServer.create(new InetSocketAddress("127.0.0.1", 0), 0);
    https.setHttpsConfigurator(new com.sun.net.httpserver.HttpsConfigurator(serverTls));
    AtomicReference<String> protocol = new AtomicReference<>();
    https
        .createContext(
            "/",
            exchange -> {
              protocol.set(((com.sun.net.httpserver.HttpsExchange) exchange).getSSLSession().getProtocol());
              Lineage.current().orElseThrow().markFailedAfterDecision();
              exchange.sendResponseHeaders(503, -1);
              exchange.close();
            })
        .getFilters()
        .add(LineageFilter.of("middle"));
    https.start();
    try {
      HttpResponse<Void> response =
          HttpClient.newBuilder().sslContext(clientTls).build()
              .send(HttpRequest.newBuilder(URI.create("https://127.0.0.1:" + https.getAddress().getPort() + "/")).build(),
                  HttpResponse.BodyHandlers.discarding());
      assertEquals(503, response.statusCode());
      assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
      assertTrue(protocol.get().startsWith("TLS"), protocol.get());
    } finally {
      https.stop(0);
    }
  }

  @Test
  void theEdgeReportsRetriedBelowAndDoesNotRetry() throws Exception {
    RetriedResponse<Void> response =
        edgeHttp.send(
            HttpRequest.newBuilder(middleUri()).header("baggage", "userId=42,retryd.lineage=bogus:9").build(),
            HttpResponse.BodyHandlers.discarding(),
            RetryOptions.builder("java-chain-middle").idempotency(Idempotency.IDEMPOTENCY_SAFE).deadline(Duration.ofSeconds(10)).build());
    assertEquals(503, response.statusCode());
    assertEquals(1, response.attempts());
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, response.decision().orElseThrow().denyReason());
    assertFalse(response.decision().orElseThrow().fallback());
    assertTrue(response.decision().orElseThrow().explanation().contains("middle"), response.decision().orElseThrow().explanation());
    // The edge's baggage: its own members kept, a stale lineage member replaced by the edge's entry.
    assertEquals(List.of("userId=42,retryd.lineage=edge:1"), middleBaggage);
    assertEquals(3, backEndBaggage.size(), backEndBaggage.toString());
  }

  @Test
  void aCallInsideAnEnclosingRetryIsNotRetried() throws Exception {
    // The edge's second attempt reaches the middle: its back-end call is tried once.
    HttpResponse<Void> response =
        HttpClient.newHttpClient()
            .send(HttpRequest.newBuilder(middleUri()).header("baggage", "retryd.lineage=edge:2").build(), HttpResponse.BodyHandlers.discarding());
    assertEquals(List.of("retryd.lineage=edge:2/middle:1"), backEndBaggage);
    assertEquals(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, middleDecision.get().denyReason());
    assertFalse(middleDecision.get().fallback());
    // Denied is "ended in failure after retryd's decision": the 503 is marked too.
    assertEquals(503, response.statusCode());
    assertEquals(List.of("middle"), response.headers().allValues("retryd-retried"));
  }

  private EchoGrpc.EchoBlockingStub edgeStub() {
    return EchoGrpc.newBlockingStub(ClientInterceptors.intercept(toGrpcMiddle, baggage("userId=42,retryd.lineage=bogus:9"), edgeInterceptor))
        .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
        .withDeadlineAfter(10, TimeUnit.SECONDS);
  }

  @Test
  void grpcTheMiddleRetriesAndMarksItsTrailers() {
    StatusRuntimeException failed =
        assertThrows(StatusRuntimeException.class, () -> edgeStub().say(EchoRequest.newBuilder().setText("x").build()));
    assertEquals(Status.Code.UNAVAILABLE, failed.getStatus().getCode());
    Metadata trailers = failed.getTrailers();
    assertNotNull(trailers);
    assertEquals("middle", trailers.get(RETRIED));
    assertEquals(List.of("-1"), iterable(trailers.getAll(PUSHBACK)));
    assertEquals(
        List.of("retryd.lineage=edge:1/middle:1", "retryd.lineage=edge:1/middle:2", "retryd.lineage=edge:1/middle:3"),
        grpcBackEndBaggage);
    assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, grpcMiddleDecision.get().denyReason());
    // The edge does not retry: RETRIED_BELOW (rule 5) comes before the pushback of -1 (rule 9).
    assertEquals(List.of("userId=42,retryd.lineage=edge:1"), grpcMiddleBaggage);
    Decision edge = RetrydClientInterceptor.decisionOf(failed).orElseThrow();
    assertFalse(edge.fallback());
    assertEquals(DenyReason.DENY_REASON_RETRIED_BELOW, edge.denyReason());
  }

  @Test
  void grpcACallInsideAnEnclosingRetryIsNotRetried() {
    EchoGrpc.EchoBlockingStub secondAttempt =
        EchoGrpc.newBlockingStub(ClientInterceptors.intercept(toGrpcMiddle, baggage("retryd.lineage=edge:2"))).withDeadlineAfter(10, TimeUnit.SECONDS);
    StatusRuntimeException failed =
        assertThrows(StatusRuntimeException.class, () -> secondAttempt.say(EchoRequest.newBuilder().setText("x").build()));
    assertEquals(List.of("retryd.lineage=edge:2/middle:1"), grpcBackEndBaggage);
    assertEquals(DenyReason.DENY_REASON_INSIDE_ENCLOSING_RETRY, grpcMiddleDecision.get().denyReason());
    assertEquals("middle", failed.getTrailers().get(RETRIED));
  }

  @Test
  void grpcAStreamingCallIsNotRetriedButCarriesTheLineage() throws Exception {
    EchoGrpc.EchoBlockingStub stub =
        EchoGrpc.newBlockingStub(ClientInterceptors.intercept(toGrpcBackEnd, baggage("userId=42"), middleInterceptor))
            .withDeadlineAfter(10, TimeUnit.SECONDS);
    io.grpc.Context served = Lineage.withInbound(io.grpc.Context.current(), Lineage.inbound("edge:2"));
    StatusRuntimeException failed =
        served.call(() -> assertThrows(StatusRuntimeException.class, () -> stub.watch(EchoRequest.newBuilder().setText("x").build()).forEachRemaining(reply -> {})));
    assertEquals(Status.Code.UNIMPLEMENTED, failed.getStatus().getCode());
    // One attempt, this layer's entry after the inbound lineage, the caller's members kept.
    assertEquals(List.of("userId=42,retryd.lineage=edge:2/middle:1"), grpcBackEndBaggage);
  }

  private static List<String> iterable(Iterable<String> values) {
    List<String> list = new java.util.ArrayList<>();
    if (values != null) {
      values.forEach(list::add);
    }
    return list;
  }
}
