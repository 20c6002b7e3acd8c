package dev.retryd.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.Context;
import io.grpc.Deadline;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import io.grpc.Status;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.Executor;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.Idempotency;

/**
 * One unary call of a {@link RetrydClientInterceptor} across its attempts: the
 * per-call attempt state machine. The caller's events (start, request,
 * sendMessage, halfClose) are recorded; the first attempt starts at halfClose,
 * when the request is complete, and each attempt replays them on a new call.
 * An attempt that fails is classified ({@link GrpcOutcome}) and decided by
 * retryd (or the local rule when the deadline left no time to ask); a retry
 * waits its backoff on the interceptor's timer thread; the call ends once, with
 * the last attempt's headers, message, status and trailers, and the decision on
 * the status's cause.
 *
 * <p>A hedged first attempt is a {@link HedgedRound}: it sends the copies (each
 * an attempt of this call, with its own number and lineage entry) and hands the
 * winner, or the last copy to fail, back to this call's attempt loop. Both
 * share {@link #lock}; the fields the round reads or changes are package-private.
 */
final class RetryingCall<Q, R> extends ClientCall<Q, R> {
  // The interceptor's, shared by its calls.
  final RetrydClient retryd;
  final String upstream;
  final int maxAttempts;
  /** Null when the interceptor counts no traffic. */
  final TrafficReporter reporter;
  final ScheduledExecutorService timer;
  private final Runnable onRefreshCredentials;

  final MethodDescriptor<Q, R> method;
  final CallOptions options;
  final Channel next;
  final Idempotency declared;
  /** Guards the call's state, and the hedged round's. */
  final Object lock = new Object();
  private Listener<R> listener;
  private Metadata headers;
  private Q message;
  private boolean compression;
  // Guarded by lock: the attempt running (the last copy started while hedged),
  // the retry waiting its backoff, whether the call ended, the attempts made.
  ClientCall<Q, R> current;
  private ScheduledFuture<?> pendingRetry;
  boolean done;
  int attempt;
  private Duration previousBackoff = Duration.ZERO;
  private boolean authRefreshAttempted;
  volatile boolean cancelledByCaller;
  // The caller's context, captured on the caller's thread: later attempts
  // start on the timer thread, and must still carry its deadline and
  // cancellation.
  final Context context = Context.current();
  private final Deadline contextDeadline = context.getDeadline();
  // The request being served, if any (docs/lineage.md), from the same context.
  private final Lineage.Inbound inbound = Lineage.KEY.get(context);
  final String inboundLineage = inbound == null ? "" : inbound.lineage();
  /** The hedged first attempt, while it runs (null unhedged, and once it is over). Guarded by lock. */
  private HedgedRound<Q, R> hedged;

  RetryingCall(RetrydClientInterceptor interceptor, MethodDescriptor<Q, R> method, CallOptions options, Channel next, Idempotency declared) {
    this.retryd = interceptor.retryd;
    this.upstream = interceptor.upstream;
    this.maxAttempts = interceptor.maxAttempts;
    this.reporter = interceptor.reporter;
    this.timer = interceptor.timer;
    this.onRefreshCredentials = interceptor.onRefreshCredentials;
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
    Optional<Hedging.Plan> plan = retryd.hedgePlan(upstream, declared);
    if (plan.isPresent()) {
      HedgedRound<Q, R> round = new HedgedRound<>(this, plan.get());
      synchronized (lock) {
        hedged = round;
      }
      round.start();
      return;
    }
    startAttempt();
  }

  /** The hedged round is over (a copy won, or the last one ended): the call goes on unhedged. Lock held. */
  void hedgedRoundOver() {
    hedged = null;
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
      hedgedCopies = hedged != null ? hedged.copies() : List.of();
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
    send(call, new AttemptListener(trace, number, null));
  }

  /** Starts {@code call} as an attempt: the caller's headers, message and half-close replayed. */
  void send(ClientCall<Q, R> call, AttemptListener attemptListener) {
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
  Duration remaining() {
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

  /** One attempt's responses, held until its status; then its outcome recorded and the next step taken. */
  final class AttemptListener extends ClientCall.Listener<R> {
    private final AttemptTrace trace;
    private Metadata responseHeaders;
    private final List<R> messages = new ArrayList<>();
    /** This attempt's number (1 for the first), and the hedged round it is a copy in (null: none). */
    final int number;
    private final HedgedRound<Q, R> round;
    final long startNanos = System.nanoTime();
    /** Cancelled because another copy won: recorded nowhere. Guarded by lock. */
    boolean lost;
    volatile boolean closed;

    AttemptListener(AttemptTrace trace, int number, HedgedRound<Q, R> round) {
      this.trace = trace;
      this.number = number;
      this.round = round;
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
      Boolean succeeded = RetrydClientInterceptor.attemptSucceeded(status.getCode());
      if (round != null) {
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
      if (round != null && !round.copyEnded(this, cancelledByCaller, Boolean.TRUE.equals(succeeded))) {
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
        Lineage.retriedBelow(trailers.get(RetrydClientInterceptor.RETRIED)).ifPresent(ask::setRetriedBelow);
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
      boolean retry = decision.shouldRetry() && attempt < RetrydClientInterceptor.MAX_LOOP;
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
