package dev.retryd.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.Context;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import java.util.Objects;
import java.util.Optional;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.function.Function;
import retryd.v1.Retryd.Idempotency;

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
 * <p>This class is the wiring: the builder, what is shared by every call (the
 * upstream, the reporter, the timer thread), the outcome classification
 * ({@link #FAILURE_CODES}) and the choice made per call. A unary call is a
 * {@code RetryingCall}, the per-call attempt state machine (attempts, the held
 * response, the decisions, the end); its hedged first attempt is a {@code
 * HedgedRound}; each attempt's stream is seen through an {@code AttemptTrace}
 * (all three package-private).
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
 * success latency, excepted). A call a hedge won is counted in the reporter's
 * {@code hedges_won} ({@link TrafficReporter#recordHedgeWon}). When every copy
 * fails, the last one's status goes to the normal retry path, every copy
 * counted as an attempt.
 */
public final class RetrydClientInterceptor implements ClientInterceptor, AutoCloseable {
  /** Declares a call's idempotency: {@code stub.withOption(IDEMPOTENCY, Idempotency.IDEMPOTENCY_SAFE)}. */
  public static final CallOptions.Key<Idempotency> IDEMPOTENCY = CallOptions.Key.create("retryd-idempotency");

  static final Metadata.Key<String> BAGGAGE = Metadata.Key.of("baggage", Metadata.ASCII_STRING_MARSHALLER);
  static final Metadata.Key<String> RETRIED = Metadata.Key.of(Lineage.RETRIED_HEADER, Metadata.ASCII_STRING_MARSHALLER);

  /** A hard stop, whatever retryd or the fallback says. */
  static final int MAX_LOOP = 100;

  // What every call of this interceptor shares (RetryingCall and HedgedRound read them).
  final RetrydClient retryd;
  final String upstream;
  private final Function<MethodDescriptor<?, ?>, Idempotency> idempotency;
  final Runnable onRefreshCredentials;
  final int maxAttempts;
  /** Null with {@link Builder#noTrafficReport()}. */
  final TrafficReporter reporter;
  private final boolean ownsReporter;
  /** Backoffs and hedge delays run here, never on a transport or the caller's executor. */
  final ScheduledExecutorService timer;

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
    return new RetryingCall<>(this, method, options, next, declared);
  }
}
