package dev.retryd.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.ClientStreamTracer;
import io.grpc.Context;
import io.grpc.Deadline;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import java.util.Optional;
import java.util.concurrent.Executor;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.BodyKind;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.Idempotency;
import retryd.v1.Retryd.Verdict;

/**
 * Retries grpc-java unary calls as retryd decides, with the evidence of
 * {@link GrpcOutcome}. Add it to a channel ({@code ClientInterceptors.intercept(channel,
 * credentials, retrydInterceptor)}: the last one listed runs first, so that the
 * interceptors listed before it run again for every attempt).
 *
 * <pre>{@code
 * RetrydClientInterceptor retrying = RetrydClientInterceptor.builder(retryd, "inventory").build();
 * InventoryGrpc.InventoryBlockingStub stub = InventoryGrpc.newBlockingStub(ClientInterceptors.intercept(channel, retrying))
 *     .withOption(RetrydClientInterceptor.IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)
 *     .withDeadlineAfter(2, TimeUnit.SECONDS);
 * }</pre>
 *
 * <p>About 790 lines, one responsibility (a unary call under retryd's
 * decisions), but too long: its per-call state (attempts, the held response,
 * the hedged first round) should move to a class of its own. Not done yet.
 *
 * <p>Only unary methods are retried; streaming calls pass through, their one
 * attempt carrying the lineage (below) as attempt 1, never decided. The
 * request message is kept until the call ends, the response is held until its
 * status, and each attempt is a new call on the next channel with the same
 * {@link CallOptions}, so the caller's deadline bounds every attempt and every
 * backoff (what is left of it is told to retryd). A successful attempt costs
 * counter increments on the {@link TrafficReporter} (the first attempt, and every
 * attempt's outcome: {@link #FAILURE_CODES} fail, any other ending succeeds, a
 * cancel is neither) and nothing else. The backoff
 * runs on a timer thread, never blocking a transport or the caller's executor.
 *
 * <p>Idempotency is the caller's to declare: the {@link #IDEMPOTENCY} call
 * option, else the builder's function (by default the method descriptor's own
 * {@code idempotency_level}: SAFE for NO_SIDE_EFFECTS, IDEMPOTENT for
 * IDEMPOTENT), else NON_IDEMPOTENT, which retryd retries only when the attempt
 * provably never left.
 *
 * <p>The call ends with the last attempt's status and trailers; the status's
 * cause carries retryd's decision ({@link #decisionOf(Throwable)} on the
 * {@code StatusRuntimeException}). When the call may have run upstream (retryd
 * answered AMBIGUOUS, or denied a retry of an attempt with an unknown outcome,
 * the caller's deadline included) the status's cause is an {@link
 * AmbiguousExecutionException}: {@link AmbiguousExecutionException#of(Throwable)}. Do not also configure a grpc-java
 * retryPolicy for these methods: the two would multiply.
 *
 * <p>In a call chain (docs/lineage.md) each attempt carries the lineage of
 * the request being served (the caller's {@link Context}, see {@link Lineage})
 * plus this layer's entry in the {@code retryd.lineage} baggage member; each
 * decision carries that lineage and the failed response's {@code retryd-retried}
 * trailer, and a call that ends in failure after the decision is recorded on
 * the request being served.
 *
 * <p>Hedging (issue 33): a unary call to an upstream whose hedging retryd
 * serves ({@link RetrydClient#hedging}) and whose idempotency the policy lists
 * sends its first attempt with a timer of the served delay; if it fires with the
 * attempt still running, retryd is asked for a hedge, and on RETRY a copy goes
 * out. The first copy that ends with a code outside {@link #FAILURE_CODES} wins;
 * the others are cancelled and recorded nowhere (the first attempt's time, as a
 * success latency, excepted). When every copy fails, the last one's status goes
 * to the normal retry path, every copy counted as an attempt.
 *
 * <p>About 770 lines, one responsibility: a gRPC call under retryd's
 * decisions (the attempt loop, its hedged first attempt, its classification
 * of grpc-java's statuses into evidence, the deadline-after-send rule, each
 * attempt's outcome for the reporter, and a streaming call's single attempt
 * with its lineage), read top to bottom. The hedged copies share the call's
 * recorded events and lock, hence inside it; splitting the call into a state
 * class of its own is the next step if it grows.
 */
public final class RetrydClientInterceptor implements ClientInterceptor, AutoCloseable {
  /** Declares a call's idempotency: {@code stub.withOption(IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)}. */
  public static final CallOptions.Key<Idempotency> IDEMPOTENCY = CallOptions.Key.create("retryd-idempotency");

  static final Metadata.Key<String> BAGGAGE = Metadata.Key.of("baggage", Metadata.ASCII_STRING_MARSHALLER);
  static final Metadata.Key<String> RETRIED = Metadata.Key.of(Lineage.RETRIED_HEADER, Metadata.ASCII_STRING_MARSHALLER);

  /** A hard stop, whatever retryd or the fallback says. */
  private static final int MAX_LOOP = 100;

  private final RetrydClient retryd;
  private final String upstream;
  private final Function<MethodDescriptor<?, ?>, Idempotency> idempotency;
  private final Runnable onRefreshCredentials;
  private final int maxAttempts;
  private final TrafficReporter reporter;
  private final boolean ownsReporter;
  private final ScheduledExecutorService timer;

  private RetrydClientInterceptor(Builder builder) {
    this.retryd = builder.retryd;
    this.upstream = builder.upstream;
    this.idempotency = builder.idempotency;
    this.onRefreshCredentials = builder.onRefreshCredentials;
    this.maxAttempts = builder.maxAttempts;
    if (builder.reporter != null) {
      this.reporter = builder.reporter;
      this.ownsReporter = false;
    } else if (builder.report) {
      this.reporter = TrafficReporter.builder(retryd).build().start();
      this.ownsReporter = true;
    } else {
      this.reporter = null;
      this.ownsReporter = false;
    }
    this.timer =
        Executors.newSingleThreadScheduledExecutor(
            runnable -> {
              Thread thread = new Thread(runnable, "retryd-grpc-retries");
              thread.setDaemon(true);
              return thread;
            });
  }

  /** A builder of an interceptor for calls to {@code upstream} (the budget and policy in retryd). */
  public static Builder builder(RetrydClient retryd, String upstream) {
    if (Objects.requireNonNull(upstream, "upstream").isEmpty()) {
      throw new IllegalArgumentException("upstream: required");
    }
    return new Builder(Objects.requireNonNull(retryd, "retryd"), upstream);
  }

  /** How the interceptor is built. */
  public static final class Builder {
    private final RetrydClient retryd;
    private final String upstream;
    private Function<MethodDescriptor<?, ?>, Idempotency> idempotency = RetrydClientInterceptor::declaredByTheMethod;
    private Runnable onRefreshCredentials;
    private int maxAttempts;
    private TrafficReporter reporter;
    private boolean report = true;

    private Builder(RetrydClient retryd, String upstream) {
      this.retryd = retryd;
      this.upstream = upstream;
    }

    /** The idempotency of each method (null: NON_IDEMPOTENT), when a call does not set {@link #IDEMPOTENCY}. */
    public Builder idempotency(Function<MethodDescriptor<?, ?>, Idempotency> value) {
      this.idempotency = Objects.requireNonNull(value);
      return this;
    }

    /**
     * Called before the replay retryd allows after UNAUTHENTICATED (on the timer
     * thread): refresh what your {@code CallCredentials} or header interceptor
     * sends. Without it UNAUTHENTICATED is not replayed.
     */
    public Builder onRefreshCredentials(Runnable value) {
      this.onRefreshCredentials = Objects.requireNonNull(value);
      return this;
    }

    /** Your own attempt limit (0, the default: the policy's). */
    public Builder maxAttempts(int value) {
      if (value < 0) {
        throw new IllegalArgumentException("maxAttempts: must not be negative");
      }
      this.maxAttempts = value;
      return this;
    }

    /** Counts first attempts and outcomes on this reporter (by default the interceptor starts one of its own). */
    public Builder reporter(TrafficReporter value) {
      this.reporter = Objects.requireNonNull(value);
      return this;
    }

    /** Counts no traffic. */
    public Builder noTrafficReport() {
      this.report = false;
      this.reporter = null;
      return this;
    }

    /** The interceptor. */
    public RetrydClientInterceptor build() {
      return new RetrydClientInterceptor(this);
    }
  }

  /** The reporter first attempts are counted on, if any. */
  public Optional<TrafficReporter> reporter() {
    return Optional.ofNullable(reporter);
  }

  /** The decision retryd made on a failed call: from its {@code StatusRuntimeException} (or {@code Status.getCause()}). */
  public static Optional<Decision> decisionOf(Throwable error) {
    return DecisionRecord.find(error);
  }

  /** Stops the timer thread and closes the interceptor's own reporter. */
  @Override
  public void close() {
    timer.shutdownNow();
    if (ownsReporter) {
      reporter.close();
    }
  }

  /**
   * The codes that make an attempt a failure in the reporter's outcome counts:
   * those the retry tables can retry (UNAVAILABLE and DEADLINE_EXCEEDED as
   * 502-504 and "no response", RESOURCE_EXHAUSTED as 429, UNAUTHENTICATED as 401,
   * INTERNAL and UNKNOWN as 500), the twins of the HTTP statuses the HTTP
   * adapter asks about. Every other code is a success (the upstream answered, as
   * a 404), except CANCELLED: the caller's own, counted as neither.
   */
  public static final java.util.Set<Status.Code> FAILURE_CODES =
      java.util.Collections.unmodifiableSet(
          java.util.EnumSet.of(
              Status.Code.UNAVAILABLE,
              Status.Code.DEADLINE_EXCEEDED,
              Status.Code.RESOURCE_EXHAUSTED,
              Status.Code.UNAUTHENTICATED,
              Status.Code.INTERNAL,
              Status.Code.UNKNOWN));

  /** How an attempt that ended with {@code code} counts: true a success, false a failure, null neither. */
  public static Boolean attemptSucceeded(Status.Code code) {
    if (code == Status.Code.CANCELLED) {
      return null;
    }
    return !FAILURE_CODES.contains(code);
  }

  private static Idempotency declaredByTheMethod(MethodDescriptor<?, ?> method) {
    if (method.isSafe()) {
      return Idempotency.IDEMPOTENCY_SAFE;
    }
    return method.isIdempotent() ? Idempotency.IDEMPOTENCY_IDEMPOTENT : Idempotency.IDEMPOTENCY_NON_IDEMPOTENT;
  }

  @Override
  public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next) {
    if (method.getType() != MethodDescriptor.MethodType.UNARY) {
      // Not retried, but still a call of this layer in a chain: its one
      // attempt carries the lineage (docs/lineage.md).
      String inbound = Lineage.current().map(Lineage.Inbound::lineage).orElse("");
      return next.newCall(method, options.withStreamTracerFactory(new AttemptTrace(Lineage.outbound(inbound, retryd.layer(), 1))));
    }
    Idempotency declared = options.getOption(IDEMPOTENCY);
    if (declared == null) {
      declared = idempotency.apply(method);
    }
    if (declared == null || declared == Idempotency.IDEMPOTENCY_UNSPECIFIED || declared == Idempotency.UNRECOGNIZED) {
      declared = Idempotency.IDEMPOTENCY_NON_IDEMPOTENT;
    }
    return new RetryingCall<>(method, options, next, declared);
  }

  /** What grpc-java did with one attempt's stream(s), as its stream tracer saw it. */
  private static final class AttemptTrace extends ClientStreamTracer.Factory {
    private final String lineage;
    volatile boolean streamCreated;
    volatile boolean trailersReceived;

    AttemptTrace(String lineage) {
      this.lineage = lineage;
    }

    @Override
    public ClientStreamTracer newClientStreamTracer(ClientStreamTracer.StreamInfo info, Metadata headers) {
      // The attempt's retryd.lineage member goes in here, on the headers the
      // transport sends (grpc-java lets a tracer change them): the interceptors
      // listed before this one run per attempt after it, and one of them may
      // add baggage of its own (OpenTelemetry's re-sends the inbound member).
      // The other members pass through untouched.
      Iterable<String> baggage = headers.removeAll(BAGGAGE);
      List<String> members = new ArrayList<>();
      if (baggage != null) {
        baggage.forEach(members::add);
      }
      headers.put(BAGGAGE, Lineage.withMember(members, lineage));
      return new ClientStreamTracer() {
        @Override
        public void streamCreated(io.grpc.Attributes transportAttrs, Metadata headers) {
          streamCreated = true;
        }

        @Override
        public void inboundTrailers(Metadata trailers) {
          trailersReceived = true;
        }
      };
    }
  }

  /**
   * One unary call across its attempts. The caller's events (start, request,
   * sendMessage, halfClose) are recorded; the first attempt starts at halfClose,
   * when the request is complete, and each attempt replays them on a new call.
   */
  private final class RetryingCall<Q, R> extends ClientCall<Q, R> {
    private final MethodDescriptor<Q, R> method;
    private final CallOptions options;
    private final Channel next;
    private final Idempotency declared;
    private final Object lock = new Object();
    private Listener<R> listener;
    private Metadata headers;
    private Q message;
    private boolean compression;
    private ClientCall<Q, R> current;
    private ScheduledFuture<?> pendingRetry;
    private boolean done;
    private int attempt;
    private Duration previousBackoff = Duration.ZERO;
    private boolean authRefreshAttempted;
    private volatile boolean cancelledByCaller;
    // The caller's context, captured on the caller's thread: later attempts
    // start on the timer thread, and must still carry its deadline and
    // cancellation.
    private final Context context = Context.current();
    private final Deadline contextDeadline = context.getDeadline();
    // The request being served, if any (docs/lineage.md), from the same context.
    private final Lineage.Inbound inbound = Lineage.KEY.get(context);
    private final String inboundLineage = inbound == null ? "" : inbound.lineage();
    // While the first attempt is hedged (see Hedging): the plan, the copies in
    // flight, the pending hedge timer. Guarded by lock.
    private Hedging.Plan plan;
    private final List<ClientCall<Q, R>> copies = new ArrayList<>();
    private final List<AttemptListener> copyListeners = new ArrayList<>();
    private int copiesRunning;
    private ScheduledFuture<?> hedgeTimer;

    RetryingCall(MethodDescriptor<Q, R> method, CallOptions options, Channel next, Idempotency declared) {
      this.method = method;
      this.options = options;
      this.next = next;
      this.declared = declared;
    }

    @Override
    public void start(Listener<R> responseListener, Metadata metadata) {
      this.listener = responseListener;
      this.headers = metadata;
    }

    @Override
    public void request(int numMessages) {
      // Each attempt asks for its own messages (a unary call has one).
    }

    @Override
    public void sendMessage(Q request) {
      if (message != null) {
        throw new IllegalStateException("a unary call sends one message");
      }
      message = request;
    }

    @Override
    public void setMessageCompression(boolean enabled) {
      compression = enabled;
    }

    @Override
    public boolean isReady() {
      return true;
    }

    @Override
    public void halfClose() {
      if (reporter != null) {
        reporter.record(upstream);
      }
      retryd.firstAttemptSent(upstream);
      Optional<Hedging.Plan> hedged = retryd.hedgePlan(upstream, declared);
      if (hedged.isPresent()) {
        synchronized (lock) {
          plan = hedged.get();
        }
        startCopy();
        scheduleHedge();
        return;
      }
      startAttempt();
    }

    /** Sends one more copy of the hedged first attempt (the first attempt itself first). */
    private void startCopy() {
      int number;
      synchronized (lock) {
        if (done || plan == null) {
          return;
        }
        number = ++attempt;
      }
      AttemptTrace trace = new AttemptTrace(Lineage.outbound(inboundLineage, retryd.layer(), number));
      ClientCall<Q, R> call = next.newCall(method, options.withStreamTracerFactory(trace));
      AttemptListener copyListener = new AttemptListener(trace, number, true);
      synchronized (lock) {
        copies.add(call);
        copyListeners.add(copyListener);
        copiesRunning++;
        current = call;
      }
      send(call, copyListener);
    }

    private void scheduleHedge() {
      synchronized (lock) {
        if (done || plan == null || attempt - 1 >= plan.max) {
          return;
        }
        try {
          hedgeTimer = timer.schedule(() -> context.run(this::askHedge), plan.delay.toNanos(), TimeUnit.NANOSECONDS);
        } catch (java.util.concurrent.RejectedExecutionException closed) {
          hedgeTimer = null;
        }
      }
    }

    /** The hedge delay passed with the copies still running: ask retryd for the next hedge. */
    private void askHedge() {
      int sent;
      synchronized (lock) {
        if (done || plan == null) {
          return;
        }
        sent = attempt;
      }
      DecideRequest.Builder ask =
          DecideRequest.newBuilder()
              .setUpstream(upstream)
              .setOperation(method.getFullMethodName())
              .setIdempotency(declared)
              .setBody(Body.newBuilder().setKind(BodyKind.BODY_KIND_ENCODED_VALUE))
              .setAttempt(sent)
              .setHedge(sent)
              .setMaxAttempts(maxAttempts)
              .setLineage(inboundLineage);
      Duration left = remaining();
      if (left != null) {
        ask.setDeadlineRemaining(Durations.toProto(left));
      }
      retryd
          .decideAsync(ask.build())
          .whenComplete(
              (decision, error) -> {
                // Denied (or no answer): no copy, and no more hedges.
                if (error == null && decision.shouldRetry()) {
                  context.run(this::startCopy);
                  scheduleHedge();
                }
              });
    }

    /**
     * A hedged copy ended. Returns true when the call goes on as unhedged from
     * here (this copy won, or it was the last one running), false when this
     * result is dropped (a loser, or a failure while other copies run).
     */
    private boolean copyEnded(AttemptListener ended, boolean wins) {
      List<ClientCall<Q, R>> losers = new ArrayList<>();
      AttemptListener first = null;
      synchronized (lock) {
        if (plan == null || ended.lost) {
          return false;
        }
        copiesRunning--;
        if (!wins && copiesRunning > 0) {
          return false;
        }
        plan = null; // the hedged phase is over
        if (hedgeTimer != null) {
          hedgeTimer.cancel(false);
          hedgeTimer = null;
        }
        for (int i = 0; i < copies.size(); i++) {
          AttemptListener other = copyListeners.get(i);
          if (other != ended && !other.closed) {
            other.lost = true;
            losers.add(copies.get(i));
            if (other.number == 1) {
              first = other;
            }
          }
        }
        current = copies.get(copyListeners.indexOf(ended));
      }
      if (first != null && reporter != null && !cancelledByCaller) {
        // The first attempt ran this long and was still running: a lower bound
        // of its latency, counted so that the tail hedging is for stays seen.
        reporter.recordLatency(upstream, true, System.nanoTime() - first.startNanos);
      }
      for (ClientCall<Q, R> loser : losers) {
        loser.cancel("a hedge of this call answered first", null);
      }
      return true;
    }

    @Override
    public void cancel(String reason, Throwable cause) {
      cancelledByCaller = true;
      ClientCall<Q, R> running;
      boolean waiting;
      synchronized (lock) {
        if (done) {
          return;
        }
        running = current;
        waiting = pendingRetry != null && pendingRetry.cancel(false);
        if (waiting) {
          done = true;
        }
      }
      List<ClientCall<Q, R>> hedgedCopies;
      synchronized (lock) {
        hedgedCopies = plan != null ? new ArrayList<>(copies) : List.of();
      }
      if (waiting) {
        deliver(() -> listener.onClose(Status.CANCELLED.withDescription(reason).withCause(cause), new Metadata()));
      } else if (!hedgedCopies.isEmpty()) {
        for (ClientCall<Q, R> copy : hedgedCopies) {
          copy.cancel(reason, cause); // the last onClose ends the call
        }
      } else if (running != null) {
        running.cancel(reason, cause); // its onClose ends the call
      }
    }

    private void startAttempt() {
      int number;
      synchronized (lock) {
        number = attempt + 1;
      }
      AttemptTrace trace = new AttemptTrace(Lineage.outbound(inboundLineage, retryd.layer(), number));
      ClientCall<Q, R> call = next.newCall(method, options.withStreamTracerFactory(trace));
      synchronized (lock) {
        if (done) {
          return;
        }
        attempt++;
        current = call;
        pendingRetry = null;
      }
      send(call, new AttemptListener(trace, number, false));
    }

    private void send(ClientCall<Q, R> call, AttemptListener attemptListener) {
      Metadata attemptHeaders = new Metadata();
      attemptHeaders.merge(headers);
      call.start(attemptListener, attemptHeaders);
      call.setMessageCompression(compression);
      call.request(2); // the response, and room to see a second one (a protocol error)
      if (message != null) {
        call.sendMessage(message);
      }
      call.halfClose();
    }

    /** Time left before the call's deadline (the options' or the context's, whichever is sooner). */
    private Duration remaining() {
      Deadline deadline = options.getDeadline();
      if (deadline == null || (contextDeadline != null && contextDeadline.isBefore(deadline))) {
        deadline = contextDeadline;
      }
      return deadline == null ? null : Duration.ofNanos(Math.max(0, deadline.timeRemaining(TimeUnit.NANOSECONDS)));
    }

    /** Runs a listener callback on the call's executor when it has one (a blocking stub's), else here. */
    private void deliver(Runnable callback) {
      Executor executor = options.getExecutor();
      if (executor != null) {
        executor.execute(callback);
      } else {
        callback.run();
      }
    }

    private final class AttemptListener extends ClientCall.Listener<R> {
      private final AttemptTrace trace;
      private Metadata responseHeaders;
      private final List<R> messages = new ArrayList<>();
      /** This attempt's number (1 for the first), and whether it is a copy of a hedged first attempt. */
      final int number;
      private final boolean hedged;
      final long startNanos = System.nanoTime();
      /** Cancelled because another copy won: recorded nowhere. Guarded by lock. */
      boolean lost;
      volatile boolean closed;

      AttemptListener(AttemptTrace trace, int number, boolean hedged) {
        this.trace = trace;
        this.number = number;
        this.hedged = hedged;
      }

      @Override
      public void onHeaders(Metadata received) {
        responseHeaders = received;
      }

      @Override
      public void onMessage(R response) {
        messages.add(response);
      }

      @Override
      public void onClose(Status status, Metadata trailers) {
        closed = true;
        Boolean succeeded = attemptSucceeded(status.getCode());
        if (hedged) {
          synchronized (lock) {
            if (lost) {
              return; // a loser: neither a failure nor an outcome
            }
          }
        }
        if (reporter != null && succeeded != null && !cancelledByCaller) {
          reporter.recordOutcome(upstream, succeeded, number > 1);
          if (number == 1) {
            reporter.recordLatency(upstream, succeeded, System.nanoTime() - startNanos);
          }
        }
        if (hedged && !copyEnded(this, cancelledByCaller || Boolean.TRUE.equals(succeeded))) {
          return;
        }
        if (status.isOk() || cancelledByCaller) {
          finish(status, trailers, null);
          return;
        }
        GrpcOutcome outcome = GrpcOutcome.of(status, trailers, trace.streamCreated, trace.trailersReceived, !messages.isEmpty());
        DecideRequest.Builder ask =
            DecideRequest.newBuilder()
                .setUpstream(upstream)
                .setOperation(method.getFullMethodName())
                .setIdempotency(declared)
                .setAttempt(attempt)
                .setEvidence(outcome.evidence())
                .setFailure(outcome.failure())
                .setGrpcStatusCode(outcome.grpcStatusCode())
                .setAuthRefreshAttempted(authRefreshAttempted)
                .setMaxAttempts(maxAttempts)
                .setLineage(inboundLineage);
        if (trace.trailersReceived) {
          // The layer below says it already retried (or was denied): only from the server's trailers.
          Lineage.retriedBelow(trailers.get(RETRIED)).ifPresent(ask::setRetriedBelow);
        }
        if (outcome.pushback() != null) {
          ask.setGrpcRetryPushbackMs(outcome.pushback());
        }
        Duration left = remaining();
        if (left != null) {
          ask.setDeadlineRemaining(Durations.toProto(left));
        }
        if (!previousBackoff.isZero()) {
          ask.setPreviousBackoff(Durations.toProto(previousBackoff));
        }
        if (left != null && left.isZero()) {
          // The caller's deadline ran out after the call started: no time to ask
          // retryd. The local rule says DENY DEADLINE with the mark retryd would
          // compute, so a NON_IDEMPOTENT call that may have run is ambiguous.
          Decision local;
          try {
            local = LocalRule.decide(retryd.fallback().orElse(LocalPolicy.DEFAULT), ask.build(),
                "the caller's deadline expired during the attempt, retryd not asked");
          } catch (RuntimeException invalid) {
            finish(status.augmentDescription("retryd: " + invalid.getMessage()), trailers, null);
            return;
          }
          onDecision(local, status, trailers);
          return;
        }
        retryd
            .decideAsync(ask.build())
            .whenComplete(
                (decision, error) -> {
                  if (error != null) {
                    // An invalid request is a bug of this interceptor or the contract: end the call with it.
                    finish(status.augmentDescription("retryd: " + error.getMessage()), trailers, null);
                  } else {
                    onDecision(decision, status, trailers);
                  }
                });
      }

      private void onDecision(Decision decision, Status status, Metadata trailers) {
        boolean retry = decision.shouldRetry() && attempt < MAX_LOOP;
        if (retry && decision.refreshCredentials()) {
          if (onRefreshCredentials == null) {
            retry = false;
          } else {
            try {
              onRefreshCredentials.run();
              authRefreshAttempted = true;
            } catch (RuntimeException failed) {
              retry = false;
            }
          }
        }
        Duration wait = decision.backoff();
        Duration left = remaining();
        if (retry && left != null) {
          if (left.isZero()) {
            retry = false;
          } else if (wait.compareTo(left) > 0) {
            wait = left;
          }
        }
        if (!retry) {
          finish(status, trailers, decision);
          return;
        }
        previousBackoff = decision.backoff();
        synchronized (lock) {
          if (done) {
            return;
          }
          try {
            pendingRetry = timer.schedule(() -> context.run(RetryingCall.this::startAttempt), wait.toNanos(), TimeUnit.NANOSECONDS);
          } catch (java.util.concurrent.RejectedExecutionException closed) {
            pendingRetry = null;
            retry = false;
          }
        }
        if (!retry) {
          finish(status.augmentDescription("retryd interceptor closed"), trailers, decision);
        }
      }

      /** Ends the caller's call with this attempt's outcome (and retryd's decision on the status). */
      private void finish(Status status, Metadata trailers, Decision decision) {
        synchronized (lock) {
          if (done) {
            return;
          }
          done = true;
        }
        if (decision != null && !status.isOk() && inbound != null) {
          // Ended in failure after retryd's decision: the middleware marks the
          // served request's failed status with retryd-retried.
          inbound.markFailedAfterDecision();
        }
        // A call that may have run upstream ends with the ambiguous-execution
        // error as its status's cause, whether retryd said AMBIGUOUS or denied a
        // retry of it: never as the plain failure.
        Status closing =
            decision == null
                ? status
                : status.withCause(
                    decision.isOutcomeUnknown()
                        ? new AmbiguousExecutionException(decision, null, status.getCause())
                        : new DecisionRecord(decision, status.getCause()));
        Metadata headersSeen = responseHeaders;
        List<R> received = new ArrayList<>(messages);
        deliver(
            () -> {
              if (headersSeen != null) {
                listener.onHeaders(headersSeen);
              }
              if (closing.isOk()) {
                for (R response : received) {
                  listener.onMessage(response);
                }
              }
              listener.onClose(closing, trailers);
            });
      }
    }
  }
}
