package dev.retryd.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

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
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestInstance;
import retryd.v1.Retryd.DenyReason;
import retryd.v1.Retryd.Evidence;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.UnknownOutcome;
import retryd.v1.Retryd.Verdict;

/**
 * The grpc-java interceptor against real grpc-java servers of the test's own on
 * 127.0.0.1 and a real retryd (with its gRPC rules; fast backoffs).
 */
@TestInstance(TestInstance.Lifecycle.PER_CLASS)
class GrpcInterceptorTest {
  /** What the test server does with the n-th call (0-based). */
  interface Behaviour {
    void handle(int call, EchoRequest request, StreamObserver<EchoReply> reply, String authorization);
  }

  private static final Metadata.Key<String> AUTHORIZATION = Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);
  private static final io.grpc.Context.Key<String> AUTH_SEEN = io.grpc.Context.key("authorization");

  private RetrydServer retrydServer;
  private RetrydClient retryd;
  private RetrydClientInterceptor interceptor;
  private final AtomicReference<Behaviour> behaviour = new AtomicReference<>();
  private final AtomicInteger calls = new AtomicInteger();
  private final List<Long> arrivals = new CopyOnWriteArrayList<>();
  private final AtomicReference<String> token = new AtomicReference<>("stale");
  private final AtomicInteger refreshes = new AtomicInteger();
  private Server server;
  private ManagedChannel channel;
  private Channel intercepted;

  @BeforeAll
  void start() throws Exception {
    retrydServer = RetrydServer.start(RetrydServer.CLIENT_TEST_CONFIG);
    // With the fallback on, for the deadline test: with the deadline spent, the
    // decision call gets only its 50ms floor, which a loaded machine can miss,
    // and the local rule then says the same DENY DEADLINE. The other tests
    // check that retryd, not the fallback, decided.
    retryd = RetrydClient.builder(retrydServer.target()).timeout(Duration.ofSeconds(5)).build();
    interceptor =
        RetrydClientInterceptor.builder(retryd, "java-grpc")
            .noTrafficReport()
            .onRefreshCredentials(
                () -> {
                  refreshes.incrementAndGet();
                  token.set("fresh");
                })
            .build();
    EchoGrpc.EchoImplBase service =
        new EchoGrpc.EchoImplBase() {
          @Override
          public void say(EchoRequest request, StreamObserver<EchoReply> reply) {
            arrivals.add(System.nanoTime());
            behaviour.get().handle(calls.getAndIncrement(), request, reply, AUTH_SEEN.get());
          }
        };
    ServerInterceptor readAuth =
        new ServerInterceptor() {
          @Override
          public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata headers, ServerCallHandler<Q, R> next) {
            String auth = headers.get(AUTHORIZATION);
            return Contexts.interceptCall(io.grpc.Context.current().withValue(AUTH_SEEN, auth == null ? "" : auth), call, headers, next);
          }
        };
    server = NettyServerBuilder.forAddress(new InetSocketAddress("127.0.0.1", 0)).addService(ServerInterceptors.intercept(service, readAuth)).build().start();
    channel = NettyChannelBuilder.forAddress("127.0.0.1", server.getPort()).usePlaintext().build();
    // The header interceptor is listed first so that it runs again for every attempt.
    intercepted = ClientInterceptors.intercept(channel, bearer(), interceptor);
  }

  private ClientInterceptor bearer() {
    return new ClientInterceptor() {
      @Override
      public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
        return new ForwardingClientCall.SimpleForwardingClientCall<Q, R>(next.newCall(method, options)) {
          @Override
          public void start(Listener<R> listener, Metadata headers) {
            headers.put(AUTHORIZATION, "Bearer " + token.get());
            super.start(listener, headers);
          }
        };
      }
    };
  }

  @AfterEach
  void reset() {
    calls.set(0);
    arrivals.clear();
  }

  @AfterAll
  void stop() throws Exception {
    channel.shutdownNow();
    server.shutdownNow();
    interceptor.close();
    retryd.close();
    retrydServer.close();
  }

  private EchoGrpc.EchoBlockingStub stub(Channel through, Idempotency idempotency, Duration deadline) {
    return EchoGrpc.newBlockingStub(through)
        .withOption(RetrydClientInterceptor.IDEMPOTENCY, idempotency)
        .withDeadlineAfter(deadline.toMillis(), TimeUnit.MILLISECONDS);
  }

  private static EchoRequest hello() {
    return EchoRequest.newBuilder().setText("hello").build();
  }

  private static Decision decisionOf(StatusRuntimeException error) {
    return RetrydClientInterceptor.decisionOf(error).orElseThrow(() -> new AssertionError("no decision on " + error));
  }

  private static Decision retrydsDecisionOf(StatusRuntimeException error) {
    Decision decision = decisionOf(error);
    assertFalse(decision.fallback(), "decided by the fallback: " + decision);
    return decision;
  }

  private static void ok(StreamObserver<EchoReply> reply, String text) {
    reply.onNext(EchoReply.newBuilder().setText(text).build());
    reply.onCompleted();
  }

  @Test
  void aRefusedPortNeverLeftSoEvenANonIdempotentCallIsRetried() throws Exception {
    int port;
    try (ServerSocket probe = new ServerSocket(0)) {
      port = probe.getLocalPort();
    }
    ManagedChannel refused = NettyChannelBuilder.forAddress("127.0.0.1", port).usePlaintext().build();
    try {
      StatusRuntimeException error =
          assertThrows(
              StatusRuntimeException.class,
              () -> stub(ClientInterceptors.intercept(refused, interceptor), Idempotency.IDEMPOTENCY_NON_IDEMPOTENT, Duration.ofSeconds(10)).say(hello()));
      assertEquals(Status.Code.UNAVAILABLE, error.getStatus().getCode());
      Decision decision = retrydsDecisionOf(error);
      assertEquals(Evidence.EVIDENCE_NOT_SENT, decision.effectiveEvidence(), decision.toString());
      assertEquals(DenyReason.DENY_REASON_MAX_ATTEMPTS, decision.denyReason(), decision.toString());
    } finally {
      refused.shutdownNow();
    }
  }

  @Test
  void aServerThatNeverAnswersEndsAtTheDeadlineAsSentNoResponse() {
    behaviour.set((call, request, reply, auth) -> {}); // never answers
    long start = System.nanoTime();
    StatusRuntimeException error =
        assertThrows(StatusRuntimeException.class, () -> stub(intercepted, Idempotency.IDEMPOTENCY_SAFE, Duration.ofMillis(600)).say(hello()));
    double elapsed = (System.nanoTime() - start) / 1e9;
    assertEquals(Status.Code.DEADLINE_EXCEEDED, error.getStatus().getCode());
    assertTrue(elapsed >= 0.6 && elapsed <= 2.6, "took " + elapsed + "s for a 0.6s deadline");
    Decision decision = decisionOf(error);
    assertEquals(Evidence.EVIDENCE_SENT_NO_RESPONSE, decision.effectiveEvidence(), decision.toString());
    assertEquals(DenyReason.DENY_REASON_DEADLINE, decision.denyReason(), decision.toString());
    assertEquals(1, calls.get());
  }

  @Test
  void unavailableFromTheServerIsRetriedWhenSafe() {
    behaviour.set((call, request, reply, auth) -> {
      if (call == 0) {
        reply.onError(Status.UNAVAILABLE.withDescription("warming up").asRuntimeException());
      } else {
        ok(reply, "hi");
      }
    });
    EchoReply reply = stub(intercepted, Idempotency.IDEMPOTENCY_SAFE, Duration.ofSeconds(10)).say(hello());
    assertEquals("hi", reply.getText());
    assertEquals(2, calls.get());
  }

  @Test
  void resourceExhaustedWithAPushbackOf300msWaitsAtLeastThat() {
    behaviour.set((call, request, reply, auth) -> {
      if (call == 0) {
        Metadata trailers = new Metadata();
        trailers.put(GrpcOutcome.PUSHBACK, "300");
        reply.onError(Status.RESOURCE_EXHAUSTED.asRuntimeException(trailers));
      } else {
        ok(reply, "after pushback");
      }
    });
    EchoReply reply = stub(intercepted, Idempotency.IDEMPOTENCY_SAFE, Duration.ofSeconds(10)).say(hello());
    assertEquals("after pushback", reply.getText());
    assertEquals(2, calls.get());
    double gap = (arrivals.get(1) - arrivals.get(0)) / 1e9;
    assertTrue(gap >= 0.3 && gap <= 2.3, "waited " + gap + "s for a 300ms pushback");
  }

  @Test
  void aNegativePushbackIsNotRetried() {
    behaviour.set((call, request, reply, auth) -> {
      Metadata trailers = new Metadata();
      trailers.put(GrpcOutcome.PUSHBACK, "-1");
      reply.onError(Status.RESOURCE_EXHAUSTED.asRuntimeException(trailers));
    });
    StatusRuntimeException error =
        assertThrows(StatusRuntimeException.class, () -> stub(intercepted, Idempotency.IDEMPOTENCY_SAFE, Duration.ofSeconds(10)).say(hello()));
    assertEquals(Status.Code.RESOURCE_EXHAUSTED, error.getStatus().getCode());
    assertEquals("-1", error.getTrailers().get(GrpcOutcome.PUSHBACK), "the server's trailers reach the caller");
    Decision decision = retrydsDecisionOf(error);
    assertEquals(DenyReason.DENY_REASON_SERVER_PUSHBACK, decision.denyReason(), decision.toString());
    assertEquals(Evidence.EVIDENCE_RESPONSE_RECEIVED, decision.effectiveEvidence());
    assertEquals(1, calls.get());
  }

  @Test
  void unauthenticatedIsReplayedOnceAfterARefresh() {
    token.set("stale");
    int before = refreshes.get();
    behaviour.set((call, request, reply, auth) -> {
      if (auth.equals("Bearer fresh")) {
        ok(reply, "welcome");
      } else {
        reply.onError(Status.UNAUTHENTICATED.withDescription("token expired").asRuntimeException());
      }
    });
    EchoReply reply = stub(intercepted, Idempotency.IDEMPOTENCY_SAFE, Duration.ofSeconds(10)).say(hello());
    assertEquals("welcome", reply.getText());
    assertEquals(2, calls.get());
    assertEquals(before + 1, refreshes.get());
  }

  @Test
  void aNonIdempotentCallTheServerReadThenUnavailableIsAmbiguousAndSentOnce() {
    behaviour.set((call, request, reply, auth) -> reply.onError(Status.UNAVAILABLE.withDescription("backend dropped it").asRuntimeException()));
    StatusRuntimeException error =
        assertThrows(StatusRuntimeException.class, () -> stub(intercepted, Idempotency.IDEMPOTENCY_NON_IDEMPOTENT, Duration.ofSeconds(10)).say(hello()));
    assertEquals(Status.Code.UNAVAILABLE, error.getStatus().getCode());
    Decision decision = retrydsDecisionOf(error);
    assertEquals(Verdict.VERDICT_AMBIGUOUS, decision.verdict(), decision.toString());
    assertTrue(decision.isAmbiguous());
    assertEquals(1, calls.get(), "sent once");
  }

  @Test
  void aSuccessfulCallIsNotDecidedAtAll() {
    behaviour.set((call, request, reply, auth) -> ok(reply, request.getText()));
    assertEquals("hello", stub(intercepted, Idempotency.IDEMPOTENCY_NON_IDEMPOTENT, Duration.ofSeconds(10)).say(hello()).getText());
    assertEquals(1, calls.get());
    assertFalse(RetrydClientInterceptor.decisionOf(new RuntimeException()).isPresent());
  }

  @Test
  void aNonIdempotentCallDeniedForAnEmptyBudgetAfterTheServerReadItIsTheAmbiguousError() {
    // Issue 36: the budget rule comes before the ambiguity rules, so retryd
    // answers DENY BUDGET_EXHAUSTED; its mark says the call may have run.
    behaviour.set((call, request, reply, auth) -> reply.onError(Status.UNAVAILABLE.withDescription("backend dropped it").asRuntimeException()));
    try (RetrydClientInterceptor budgetless = RetrydClientInterceptor.builder(retryd, "java-budgetless").noTrafficReport().build()) {
      Channel through = ClientInterceptors.intercept(channel, budgetless);
      StatusRuntimeException error =
          assertThrows(StatusRuntimeException.class, () -> stub(through, Idempotency.IDEMPOTENCY_NON_IDEMPOTENT, Duration.ofSeconds(10)).say(hello()));
      assertEquals(Status.Code.UNAVAILABLE, error.getStatus().getCode(), "the call ends with the server's status");
      AmbiguousExecutionException ambiguous = AmbiguousExecutionException.of(error).orElseThrow(() -> new AssertionError("plain failure: " + error));
      assertEquals(Verdict.VERDICT_DENY, ambiguous.decision().verdict(), ambiguous.decision().toString());
      assertEquals(DenyReason.DENY_REASON_BUDGET_EXHAUSTED, ambiguous.denyReason());
      assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE, ambiguous.unknownOutcome());
      assertFalse(ambiguous.resendWithSameKey());
      assertFalse(ambiguous.decision().fallback(), "retryd decided");
      assertEquals(1, calls.get(), "sent once");

      // The same with an idempotency key: "unknown; re-send with the same key".
      calls.set(0);
      StatusRuntimeException keyed =
          assertThrows(StatusRuntimeException.class, () -> stub(through, Idempotency.IDEMPOTENCY_IDEMPOTENT_WITH_KEY, Duration.ofSeconds(10)).say(hello()));
      AmbiguousExecutionException resend = AmbiguousExecutionException.of(keyed).orElseThrow(() -> new AssertionError("plain failure: " + keyed));
      assertEquals(DenyReason.DENY_REASON_BUDGET_EXHAUSTED, resend.denyReason());
      assertTrue(resend.resendWithSameKey());
      assertEquals(1, calls.get(), "sent once");
    }
  }

  @Test
  void aHungNonIdempotentCallRunningIntoTheCallersDeadlineIsTheAmbiguousErrorDecidedLocally() {
    // Issue 38: the server read the call and holds it; the caller's deadline
    // ends it. It may have run: ambiguous, without asking retryd (no time left).
    behaviour.set((call, request, reply, auth) -> { /* never answers */ });
    StatusRuntimeException error =
        assertThrows(StatusRuntimeException.class, () -> stub(intercepted, Idempotency.IDEMPOTENCY_NON_IDEMPOTENT, Duration.ofMillis(500)).say(hello()));
    assertEquals(Status.Code.DEADLINE_EXCEEDED, error.getStatus().getCode());
    AmbiguousExecutionException ambiguous = AmbiguousExecutionException.of(error).orElseThrow(() -> new AssertionError("plain failure: " + error));
    assertEquals(DenyReason.DENY_REASON_DEADLINE, ambiguous.denyReason(), ambiguous.decision().toString());
    assertEquals(UnknownOutcome.UNKNOWN_OUTCOME_RECONCILE, ambiguous.unknownOutcome());
    assertTrue(ambiguous.decision().fallback(), "decided locally: " + ambiguous.decision());
    assertEquals(1, calls.get(), "sent once");
  }
}
