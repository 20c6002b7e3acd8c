package dev.retryd.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ConnectivityState;
import io.grpc.ForwardingClientCall;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;
import java.util.logging.Level;
import java.util.logging.Logger;
import retryd.v1.RetryAdminGrpc;
import retryd.v1.RetryDeciderGrpc;
import retryd.v1.Retryd.Budget;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DecideResponse;
import retryd.v1.Retryd.GetBudgetRequest;
import retryd.v1.Retryd.ReportTrafficRequest;
import retryd.v1.Retryd.ReportTrafficResponse;
import retryd.v1.Retryd.SetRetriesEnabledRequest;
import retryd.v1.Retryd.UpstreamTraffic;

/**
 * A client of retryd's {@code RetryDecider} (and {@code RetryAdmin}) over
 * grpc-java's netty transport. Thread-safe; share one per process and close it
 * on shutdown.
 *
 * <p>About 750 lines: the calls (a hedge's Decide among them), the fallback,
 * the eager connect and the reconnect watcher of one client are read together; the local rule, the
 * reporter and the outage warnings are classes of their own.
 *
 * <p>Every decision gets a short timeout ({@link Builder#timeout}, 200ms by
 * default), further bounded by the request's own {@code deadline_remaining}
 * (but never below 50ms, so that retryd can still say DENY DEADLINE itself).
 * When retryd cannot answer in time, the request is decided by the conservative
 * {@link LocalRule} ({@link Decision#fallback()} is true; one warning when
 * retryd becomes unreachable and one when it answers again, with counts),
 * unless {@link Builder#noFallback()} asked for a {@link RetrydUnavailableException}
 * instead. An invalid request is never hidden by the fallback: it throws
 * {@link InvalidRequestException}.
 *
 * <p>gRPC's own reconnect backoff grows to two minutes, all of which the fallback
 * would have to cover; this client instead short-circuits it once a second while
 * the channel is in TRANSIENT_FAILURE, so it uses retryd again within about 2s of
 * retryd coming back.
 */
public final class RetrydClient implements AutoCloseable {
  private static final Logger LOG = Logger.getLogger("dev.retryd.client");
  /** The least time a decision call gets when the caller's deadline is nearly over. */
  static final Duration MIN_CALL_TIMEOUT = Duration.ofMillis(50);
  /** The most the first decision after a successful eager connect waits for retryd. */
  static final Duration FIRST_CALL_TIMEOUT = Duration.ofSeconds(1);
  /** How often a channel in TRANSIENT_FAILURE is told to reconnect now. */
  static final Duration RECONNECT_INTERVAL = Duration.ofSeconds(1);
  /** The most entries one ReportTraffic call may carry. */
  public static final int MAX_TRAFFIC_ENTRIES = 1024;

  static final Metadata.Key<String> TRACEPARENT = Metadata.Key.of("traceparent", Metadata.ASCII_STRING_MARSHALLER);
  static final Metadata.Key<String> TRACESTATE = Metadata.Key.of("tracestate", Metadata.ASCII_STRING_MARSHALLER);

  private final ManagedChannel channel;
  private final boolean ownsChannel;
  private final Channel decorated;
  private final Duration timeout;
  private final LocalPolicy fallback;
  private final String layer;
  private final ScheduledExecutorService scheduler;
  private final ShadowDivergences shadowDivergences;
  private final Outage outage = new Outage();
  // Learned from the traffic reports' responses, off the request path.
  private final Hedging.Table hedging = new Hedging.Table(10_000);
  private final Hedging.LocalAllowance localHedges = new Hedging.LocalAllowance(10_000);
  // True from a successful eager connect until the first decision call: that
  // call may wait up to FIRST_CALL_TIMEOUT (still bounded by the request's
  // deadline), since what it pays for beyond retryd's answer is this JVM's
  // first-call warm-up (over 200ms in a cold JVM at a load average of 13 here),
  // not retryd's health.
  private final java.util.concurrent.atomic.AtomicBoolean firstCall = new java.util.concurrent.atomic.AtomicBoolean();
  private volatile boolean closed;

  private RetrydClient(Builder builder) {
    this.ownsChannel = builder.channel == null;
    this.channel =
        builder.channel != null
            ? builder.channel
            : NettyChannelBuilder.forTarget(builder.target).usePlaintext().build();
    this.decorated = ClientInterceptors.intercept(channel, new MetadataInterceptor(builder.headers, builder.traceContext));
    this.timeout = builder.timeout;
    this.fallback = builder.fallback;
    this.layer = builder.layer != null ? builder.layer : Lineage.defaultLayer();
    this.shadowDivergences = new ShadowDivergences(builder.shadowLogInterval);
    this.scheduler =
        Executors.newSingleThreadScheduledExecutor(
            runnable -> {
              Thread thread = new Thread(runnable, "retryd-client");
              thread.setDaemon(true);
              return thread;
            });
    watchConnectivity(channel.getState(false));
    firstCall.set(connectEagerly(builder.connectTimeout));
  }

  /**
   * Connects now, so that the first decision is not charged for the TCP and
   * HTTP/2 handshakes and grpc-java's first-call class loading, which in a fresh
   * JVM took longer than the 200ms decision timeout (the first decision fell
   * back, 4 runs of 4). One gRPC health check ({@code grpc.health.v1.Health/Check},
   * which retryd serves; raw bytes, so no generated health stubs are needed),
   * bounded by {@code connectTimeout}. Its outcome only warms the channel: a
   * retryd that is down is found out, and warned about, by the first decision.
   */
  private boolean connectEagerly(Duration connectTimeout) {
    // A decision's marshalling, run once here rather than on its clock.
    MethodDescriptor<DecideRequest, DecideResponse> decide = RetryDeciderGrpc.getDecideMethod();
    try (java.io.InputStream bytes = decide.getRequestMarshaller().stream(DecideRequest.newBuilder().setUpstream("warm-up").build())) {
      bytes.readAllBytes();
      decide.getResponseMarshaller().parse(decide.getResponseMarshaller().stream(DecideResponse.getDefaultInstance()));
    } catch (java.io.IOException | RuntimeException notWarmed) {
      LOG.log(Level.FINE, "retryd: warm-up of the decision path failed", notWarmed);
    }
    if (connectTimeout.isZero()) {
      channel.getState(true); // start connecting, do not wait
      return false;
    }
    MethodDescriptor<byte[], byte[]> check =
        MethodDescriptor.<byte[], byte[]>newBuilder()
            .setType(MethodDescriptor.MethodType.UNARY)
            .setFullMethodName("grpc.health.v1.Health/Check")
            .setRequestMarshaller(RawBytes.INSTANCE)
            .setResponseMarshaller(RawBytes.INSTANCE)
            .build();
    try {
      io.grpc.stub.ClientCalls.blockingUnaryCall(
          decorated, check, io.grpc.CallOptions.DEFAULT.withDeadlineAfter(connectTimeout.toNanos(), TimeUnit.NANOSECONDS),
          new byte[0]);
      return true;
    } catch (StatusRuntimeException notYet) {
      // UNIMPLEMENTED still means retryd answered; anything else, it did not.
      LOG.log(Level.FINE, "retryd: eager connect did not complete ({0})", notYet.getStatus());
      return notYet.getStatus().getCode() == Status.Code.UNIMPLEMENTED;
    }
  }

  /** The bound of a decision call: the first one after a successful connect may take up to FIRST_CALL_TIMEOUT. */
  private Duration limitFor(Duration limit) {
    if (firstCall.get() && firstCall.compareAndSet(true, false) && FIRST_CALL_TIMEOUT.compareTo(limit) > 0) {
      return FIRST_CALL_TIMEOUT;
    }
    return limit;
  }

  /** A marshaller of raw message bytes (an empty HealthCheckRequest is zero bytes). */
  private enum RawBytes implements MethodDescriptor.Marshaller<byte[]> {
    INSTANCE;

    @Override
    public java.io.InputStream stream(byte[] value) {
      return new java.io.ByteArrayInputStream(value);
    }

    @Override
    public byte[] parse(java.io.InputStream stream) {
      try {
        return stream.readAllBytes();
      } catch (java.io.IOException broken) {
        throw Status.INTERNAL.withCause(broken).asRuntimeException();
      }
    }
  }

  /** A builder for a client of the retryd at {@code target} ("127.0.0.1:50051", "dns:///retryd:50051"), plaintext. */
  public static Builder builder(String target) {
    return new Builder(Objects.requireNonNull(target, "target"), null);
  }

  /**
   * A builder for a client over a channel of your own (TLS, load balancing,
   * credentials). {@link #close()} then leaves the channel open.
   */
  public static Builder builder(ManagedChannel channel) {
    return new Builder(null, Objects.requireNonNull(channel, "channel"));
  }

  /** How this client is built. */
  public static final class Builder {
    private final String target;
    private final ManagedChannel channel;
    private Duration timeout = Duration.ofMillis(200);
    private Duration connectTimeout = Duration.ofSeconds(5);
    private LocalPolicy fallback = LocalPolicy.DEFAULT;
    private Supplier<TraceContext> traceContext = () -> null;
    private final Map<String, String> headers = new LinkedHashMap<>();
    private Duration shadowLogInterval = Duration.ofMinutes(1);
    private String layer;

    private Builder(String target, ManagedChannel channel) {
      this.target = target;
      this.channel = channel;
    }

    /** The longest a decision waits for retryd (200ms by default); the fallback decides after it. */
    public Builder timeout(Duration value) {
      if (value.isNegative() || value.isZero()) {
        throw new IllegalArgumentException("timeout: must be positive, got " + value);
      }
      this.timeout = value;
      return this;
    }

    /**
     * How long {@link #build()} waits for the connection to retryd (5s by
     * default): the client connects when it is built, not on the first
     * decision's 200ms. In a cold JVM on a loaded 2-core machine, netty's first
     * connect alone took more than 2s; a refused connection returns at once, so
     * the bound is only reached when retryd accepts and does not answer. Zero: start connecting and return at once. A retryd that
     * is not up by then costs nothing more: decisions fall back until it is.
     */
    public Builder connectTimeout(Duration value) {
      if (value.isNegative()) {
        throw new IllegalArgumentException("connectTimeout: must not be negative, got " + value);
      }
      this.connectTimeout = value;
      return this;
    }

    /** The local rule's limits when retryd cannot answer ({@link LocalPolicy#DEFAULT} by default). */
    public Builder fallback(LocalPolicy value) {
      this.fallback = Objects.requireNonNull(value, "fallback");
      return this;
    }

    /** No local rule: a decision retryd could not make throws {@link RetrydUnavailableException}. */
    public Builder noFallback() {
      this.fallback = null;
      return this;
    }

    /**
     * Where each call reads the caller's current trace context (see
     * {@link TraceContext}); the supplier may return null for "no trace". Called
     * on the thread that calls retryd.
     */
    public Builder traceContext(Supplier<TraceContext> value) {
      this.traceContext = Objects.requireNonNull(value, "traceContext");
      return this;
    }

    /**
     * The least time between two warnings, per upstream, about shadow decisions
     * that differ from the local rule (a minute by default); every difference is
     * counted in {@link RetrydClient#shadowDivergences()} whatever it is.
     */
    public Builder shadowLogInterval(Duration value) {
      if (value.isNegative()) {
        throw new IllegalArgumentException("shadowLogInterval: must not be negative, got " + value);
      }
      this.shadowLogInterval = value;
      return this;
    }

    /** A header sent with every call, for example {@code authorization}. */
    public Builder header(String name, String value) {
      headers.put(name.toLowerCase(java.util.Locale.ROOT), Objects.requireNonNull(value));
      return this;
    }

    /**
     * This service's layer name in call chains (docs/lineage.md): the adapters
     * send it in the {@code retryd.lineage} baggage member, the middleware in
     * {@code retryd-retried}. 1 to 64 bytes of {@code [A-Za-z0-9._-]}; by default
     * {@link Lineage#defaultLayer()} ({@code OTEL_SERVICE_NAME}, else the program's name).
     */
    public Builder layer(String value) {
      if (!Lineage.isValidLayer(value)) {
        throw new IllegalArgumentException("layer: 1 to 64 bytes of [A-Za-z0-9._-], got " + value);
      }
      this.layer = value;
      return this;
    }

    /** The client. */
    public RetrydClient build() {
      return new RetrydClient(this);
    }
  }

  /** The default timeout of a decision. */
  public Duration timeout() {
    return timeout;
  }

  /** This service's layer name in call chains ({@link Builder#layer}). */
  public String layer() {
    return layer;
  }

  /** The local rule's limits, or empty if the fallback is off. */
  public java.util.Optional<LocalPolicy> fallback() {
    return java.util.Optional.ofNullable(fallback);
  }

  /**
   * Asks retryd whether the failed attempt may be retried. Every field of the
   * request is sent as it is (see {@code proto/retryd/v1/retryd.proto}).
   *
   * @throws InvalidRequestException if retryd (or the local rule) rejects the request
   * @throws RetrydUnavailableException if retryd cannot answer and the fallback is off
   */
  public Decision decide(DecideRequest request) {
    return call(request, callTimeout(request, limitFor(timeout)));
  }

  /**
   * {@link #decide(DecideRequest)} waiting exactly {@code callTimeout} for retryd,
   * whatever the request's deadline (for callers who bound the wait themselves).
   */
  public Decision decide(DecideRequest request, Duration callTimeout) {
    return call(request, callTimeout);
  }

  private Decision call(DecideRequest request, Duration limit) {
    try {
      DecideResponse response =
          RetryDeciderGrpc.newBlockingStub(decorated)
              .withDeadlineAfter(limit.toNanos(), TimeUnit.NANOSECONDS)
              .decide(request);
      return answered(response, request);
    } catch (StatusRuntimeException error) {
      return onError(error, request);
    }
  }

  /** The decision to act on for retryd's answer: its own, or the local rule's for a shadow answer. */
  Decision answered(DecideResponse response, DecideRequest request) {
    outage.answered();
    Decision decision = Decision.fromResponse(response);
    if (!ShadowDivergences.isShadow(response)) {
      return decision;
    }
    // Not enforced: decide as this client would without retryd (the fallback's
    // limits; its defaults when the fallback is off, since retryd did answer),
    // and keep retryd's answer beside it.
    Decision retrydAnswer = decision.asShadowAnswer();
    Decision local =
        localDecide(fallback != null ? fallback : LocalPolicy.DEFAULT, request,
            "retryd shadow answer, not enforced (upstream in shadow mode)");
    if (ShadowDivergences.differs(retrydAnswer, local)) {
      shadowDivergences.record(request.getUpstream(), retrydAnswer, local);
    }
    return Decision.shadowed(local, retrydAnswer);
  }

  /**
   * How many shadow answers disagreed with the local rule (verdict or deny
   * reason), per upstream; see {@link Decision#shadow()}.
   */
  public Map<String, Long> shadowDivergences() {
    return shadowDivergences.counts();
  }

  /**
   * {@link #decide(DecideRequest)} without blocking: the future completes with
   * the decision (or the fallback's), or exceptionally with {@link
   * InvalidRequestException} / {@link RetrydUnavailableException}.
   */
  public CompletableFuture<Decision> decideAsync(DecideRequest request) {
    CompletableFuture<Decision> result = new CompletableFuture<>();
    RetryDeciderGrpc.newStub(decorated)
        .withDeadlineAfter(callTimeout(request, limitFor(timeout)).toNanos(), TimeUnit.NANOSECONDS)
        .decide(
            request,
            new StreamObserver<DecideResponse>() {
              @Override
              public void onNext(DecideResponse response) {
                try {
                  result.complete(answered(response, request));
                } catch (RuntimeException failure) {
                  result.completeExceptionally(failure);
                }
              }

              @Override
              public void onError(Throwable error) {
                try {
                  result.complete(RetrydClient.this.onError(asStatusError(error), request));
                } catch (RuntimeException failure) {
                  result.completeExceptionally(failure);
                }
              }

              @Override
              public void onCompleted() {}
            });
    return result;
  }

  /**
   * Asks retryd whether to send the hedge {@code hedge} describes: RETRY (no
   * backoff) sends it now; a DENY (HEDGE_CAP, HEDGING_OFF, UNIFORMLY_SLOW,
   * BUDGET_EXHAUSTED, DEADLINE, ...) sends no copy. A granted hedge spends a token
   * of the upstream's retry budget. The HTTP adapter and the gRPC interceptor ask
   * every hedge through {@link #decideHedgeAsync}.
   *
   * <p>When retryd does not answer, the local hedge rule decides ({@link
   * Decision#fallback()}: RETRY only with {@link LocalPolicy#hedgeDelay()} set, for
   * a SAFE or IDEMPOTENT call's first hedge, within the deadline and the local
   * allowance; DENY otherwise), unless the fallback is off. For an upstream in
   * shadow mode the local hedge rule decides and retryd's answer is beside it.
   *
   * @throws InvalidRequestException if retryd (or, for a hedge below 1, this
   *     client) rejects the request; the message starts with the field
   * @throws RetrydUnavailableException if retryd cannot answer and the fallback is off
   */
  public Decision decideHedge(HedgeRequest hedge) {
    return decide(checkedHedge(hedge));
  }

  /**
   * {@link #decideHedge} without blocking: the future completes with the decision
   * (or the local hedge rule's), or exceptionally with {@link
   * InvalidRequestException} / {@link RetrydUnavailableException}.
   */
  public CompletableFuture<Decision> decideHedgeAsync(HedgeRequest hedge) {
    DecideRequest request;
    try {
      request = checkedHedge(hedge);
    } catch (InvalidRequestException invalid) {
      return CompletableFuture.failedFuture(invalid);
    }
    return decideAsync(request);
  }

  /** A hedge's Decide; a hedge below 1 is a failed attempt's question, asked with {@link #decide}. */
  private static DecideRequest checkedHedge(HedgeRequest hedge) {
    if (hedge.hedge() < 1) {
      throw new InvalidRequestException("hedge: must be at least 1 (a failed attempt is asked with decide)");
    }
    return hedge.toDecideRequest();
  }

  /**
   * Opens a {@code DecideStream}: decisions over one long-lived stream, in request
   * order. Close it when done.
   */
  public DecisionStream decideStream() {
    return new DecisionStream(this);
  }

  /**
   * Sends one traffic report as it is (its {@code report_id} included).
   *
   * @throws InvalidRequestException on INVALID_ARGUMENT
   * @throws RetrydUnavailableException on any other failure, with its code
   */
  public ReportTrafficResponse reportTraffic(ReportTrafficRequest request) {
    return reportTraffic(request, Duration.ofSeconds(1));
  }

  /** {@link #reportTraffic(ReportTrafficRequest)} from a reporter sending every {@code interval}. */
  ReportTrafficResponse reportTraffic(ReportTrafficRequest request, Duration interval) {
    try {
      ReportTrafficResponse response =
          RetryDeciderGrpc.newBlockingStub(decorated)
              .withDeadlineAfter(slowCallTimeout().toNanos(), TimeUnit.NANOSECONDS)
              .reportTraffic(request);
      outage.answered();
      hedging.update(response.getHedgingList(), System.nanoTime(), interval.multipliedBy(Hedging.STALE_AFTER_INTERVALS));
      return response;
    } catch (StatusRuntimeException error) {
      throw unavailable(error);
    }
  }

  /**
   * Reports real (first-attempt) requests per upstream, in calls of at most
   * {@link #MAX_TRAFFIC_ENTRIES} entries without report ids; returns the entries
   * accepted. For re-sendable batches use a {@link TrafficReporter}.
   */
  public long reportTraffic(Map<String, Long> counts) {
    List<UpstreamTraffic> entries = new ArrayList<>();
    counts.forEach(
        (upstream, n) -> {
          if (n != null && n > 0) {
            entries.add(UpstreamTraffic.newBuilder().setUpstream(upstream).setRequests(n).build());
          }
        });
    long accepted = 0;
    for (int start = 0; start < entries.size(); start += MAX_TRAFFIC_ENTRIES) {
      List<UpstreamTraffic> chunk = entries.subList(start, Math.min(entries.size(), start + MAX_TRAFFIC_ENTRIES));
      accepted += reportTraffic(ReportTrafficRequest.newBuilder().addAllTraffic(chunk).build()).getAccepted();
    }
    return accepted;
  }

  /** The current state of one upstream's budget (admin). */
  public Budget getBudget(String upstream) {
    try {
      return RetryAdminGrpc.newBlockingStub(decorated)
          .withDeadlineAfter(slowCallTimeout().toNanos(), TimeUnit.NANOSECONDS)
          .getBudget(GetBudgetRequest.newBuilder().setUpstream(upstream).build())
          .getBudget();
    } catch (StatusRuntimeException error) {
      throw unavailable(error);
    }
  }

  /** Switches retries on or off for an upstream, fleet-wide; returns the previous state (admin). */
  public boolean setRetriesEnabled(String upstream, boolean enabled, String reason) {
    try {
      return RetryAdminGrpc.newBlockingStub(decorated)
          .withDeadlineAfter(slowCallTimeout().toNanos(), TimeUnit.NANOSECONDS)
          .setRetriesEnabled(
              SetRetriesEnabledRequest.newBuilder().setUpstream(upstream).setEnabled(enabled).setReason(reason).build())
          .getPrevious();
    } catch (StatusRuntimeException error) {
      throw unavailable(error);
    }
  }

  /** Stops the reconnect watcher and, unless it was the caller's, shuts the channel down. */
  @Override
  public void close() {
    closed = true;
    scheduler.shutdownNow();
    if (ownsChannel) {
      channel.shutdownNow();
      try {
        channel.awaitTermination(5, TimeUnit.SECONDS);
      } catch (InterruptedException interrupted) {
        Thread.currentThread().interrupt();
      }
    }
  }

  // ---- shared with DecisionStream ----

  Channel channel() {
    return decorated;
  }

  /** The outage log shared by decisions and traffic reporters. */
  Outage outage() {
    return outage;
  }

  /** How many outages of retryd this client saw begin (each warned about once). */
  public long outages() {
    return outage.count();
  }

  ScheduledExecutorService scheduler() {
    return scheduler;
  }

  Duration callTimeout(DecideRequest request, Duration limit) {
    if (request.hasDeadlineRemaining()) {
      // Waiting for retryd longer than the caller has left is pointless, but
      // leave it a few milliseconds to say DENY DEADLINE itself.
      Duration remaining = Durations.fromProto(request.getDeadlineRemaining());
      Duration floor = remaining.compareTo(MIN_CALL_TIMEOUT) > 0 ? remaining : MIN_CALL_TIMEOUT;
      return floor.compareTo(limit) < 0 ? floor : limit;
    }
    return limit;
  }

  /** What a failed decision call means: an invalid request, or the fallback (or an exception without one). */
  Decision onError(StatusRuntimeException error, DecideRequest request) {
    Status status = error.getStatus();
    if (status.getCode() == Status.Code.INVALID_ARGUMENT) {
      throw new InvalidRequestException(String.valueOf(status.getDescription()));
    }
    return fallbackOrThrow(request, status, error);
  }

  Decision fallbackOrThrow(DecideRequest request, Status status, Throwable cause) {
    String what = status.getCode() + (status.getDescription() == null ? "" : ": " + status.getDescription());
    if (fallback == null) {
      throw new RetrydUnavailableException("retryd: " + what, status.getCode(), cause);
    }
    outage.fallbackDecision(what);
    return localDecide(fallback, request, "retryd unreachable (" + status.getCode() + ")");
  }

  /** The local rule: its hedge rule for a hedge, {@link LocalRule} for a failed attempt. */
  private Decision localDecide(LocalPolicy policy, DecideRequest request, String reason) {
    if (request.getHedge() > 0) {
      return Hedging.localDecide(policy, localHedges, request, reason);
    }
    return LocalRule.decide(policy, request, reason);
  }

  /**
   * What this client knows now of {@code upstream}'s hedging, from the latest
   * traffic report responses; empty when none carried it in the last three
   * report intervals.
   */
  public Optional<Hedging> hedging(String upstream) {
    return hedging.lookup(upstream, System.nanoTime());
  }

  /** A first attempt to {@code upstream} was sent: it earns the local hedge allowance (used only with a local hedge delay). */
  void firstAttemptSent(String upstream) {
    if (fallback != null && !fallback.hedgeDelay().isZero()) {
      localHedges.earn(upstream);
    }
  }

  /**
   * The hedge delay and limit of a call, or empty if it is not hedged: as retryd
   * last served it, or, with no entry while retryd is unreachable, the local
   * rule's fixed delay (none by default).
   */
  Optional<Hedging.Plan> hedgePlan(String upstream, retryd.v1.Retryd.Idempotency level) {
    Optional<Hedging> served = hedging(upstream);
    if (served.isPresent()) {
      return served.get().allows(level) ? Optional.of(new Hedging.Plan(served.get().delay(), served.get().maxHedges())) : Optional.empty();
    }
    boolean safe = level == retryd.v1.Retryd.Idempotency.IDEMPOTENCY_SAFE || level == retryd.v1.Retryd.Idempotency.IDEMPOTENCY_IDEMPOTENT;
    if (fallback != null && !fallback.hedgeDelay().isZero() && safe && outage.isDown()) {
      return Optional.of(new Hedging.Plan(fallback.hedgeDelay(), 1));
    }
    return Optional.empty();
  }

  static StatusRuntimeException asStatusError(Throwable error) {
    if (error instanceof StatusRuntimeException) {
      return (StatusRuntimeException) error;
    }
    return Status.fromThrowable(error).asRuntimeException();
  }

  private Duration slowCallTimeout() {
    return timeout.compareTo(Duration.ofSeconds(1)) > 0 ? timeout : Duration.ofSeconds(1);
  }

  private static RetrydException unavailable(StatusRuntimeException error) {
    Status status = error.getStatus();
    if (status.getCode() == Status.Code.INVALID_ARGUMENT) {
      return new InvalidRequestException(String.valueOf(status.getDescription()));
    }
    return new RetrydUnavailableException(
        "retryd: " + status.getCode() + (status.getDescription() == null ? "" : ": " + status.getDescription()),
        status.getCode(),
        error);
  }

  /**
   * Short-circuits gRPC's reconnect backoff (which grows to two minutes) while
   * the channel is in TRANSIENT_FAILURE: one reconnect a second, so a restarted
   * retryd is used again within about 2s.
   */
  private void watchConnectivity(ConnectivityState seen) {
    if (closed) {
      return;
    }
    channel.notifyWhenStateChanged(
        seen,
        () -> {
          ConnectivityState now = channel.getState(false);
          if (now == ConnectivityState.TRANSIENT_FAILURE) {
            scheduleReconnect();
          }
          if (now != ConnectivityState.SHUTDOWN) {
            watchConnectivity(now);
          }
        });
  }

  private void scheduleReconnect() {
    if (closed) {
      return;
    }
    try {
      scheduler.schedule(
          () -> {
            if (!closed && channel.getState(false) == ConnectivityState.TRANSIENT_FAILURE) {
              channel.resetConnectBackoff();
            }
          },
          RECONNECT_INTERVAL.toMillis(),
          TimeUnit.MILLISECONDS);
    } catch (java.util.concurrent.RejectedExecutionException shuttingDown) {
      // closed meanwhile
    }
  }

  /** Adds the static headers and the caller's trace context to every call. */
  private static final class MetadataInterceptor implements ClientInterceptor {
    private final List<Map.Entry<Metadata.Key<String>, String>> headers = new ArrayList<>();
    private final Supplier<TraceContext> traceContext;

    MetadataInterceptor(Map<String, String> headers, Supplier<TraceContext> traceContext) {
      headers.forEach(
          (name, value) -> this.headers.add(Map.entry(Metadata.Key.of(name, Metadata.ASCII_STRING_MARSHALLER), value)));
      this.traceContext = traceContext;
    }

    @Override
    public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
      return new ForwardingClientCall.SimpleForwardingClientCall<Q, R>(next.newCall(method, options)) {
        @Override
        public void start(Listener<R> listener, Metadata metadata) {
          for (Map.Entry<Metadata.Key<String>, String> header : headers) {
            metadata.put(header.getKey(), header.getValue());
          }
          TraceContext trace = null;
          try {
            trace = traceContext.get();
          } catch (RuntimeException broken) {
            LOG.log(Level.FINE, "trace context supplier failed; no traceparent sent", broken);
          }
          if (trace != null) {
            metadata.put(TRACEPARENT, trace.traceparent());
            trace.tracestate().ifPresent(state -> metadata.put(TRACESTATE, state));
          }
          super.start(listener, metadata);
        }
      };
    }
  }
}
