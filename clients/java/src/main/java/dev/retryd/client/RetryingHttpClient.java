package dev.retryd.client;

import java.io.IOException;
import java.net.http.HttpClient;
import java.net.http.HttpHeaders;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.net.http.HttpTimeoutException;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.List;
import java.util.Objects;
import java.util.Optional;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.Flow;
import java.util.concurrent.TimeUnit;
import java.util.stream.BaseStream;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.BodyKind;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.Idempotency;

/**
 * Sends requests with {@link HttpClient} and retries them as retryd decides.
 * Thread-safe; share one per {@code HttpClient}.
 *
 * <pre>{@code
 * RetryingHttpClient http = RetryingHttpClient.builder(HttpClient.newHttpClient(), retryd).build();
 * HttpResponse<String> response = http.send(
 *     HttpRequest.newBuilder(URI.create("https://catalog.internal/items/7")).build(),
 *     HttpResponse.BodyHandlers.ofString(),
 *     RetryOptions.builder("catalog").idempotency(Idempotency.IDEMPOTENCY_SAFE)
 *         .deadline(Duration.ofSeconds(2)).build());
 * }</pre>
 *
 * <p>About 630 lines: the attempt loop, the body handling between attempts and
 * the hand-off to {@link HedgedHttp} for a hedged first attempt are read
 * together; classification is {@link HttpOutcome}'s.
 *
 * <p>A successful attempt costs counter increments on the {@link TrafficReporter}
 * (the first attempt as a request, and every attempt's outcome: a failure when
 * retryd is asked about it, a success otherwise, a 404 included; an interrupted
 * attempt is neither) and nothing else: retryd is asked only after a failure,
 * that is an {@code IOException} (classified by {@link HttpOutcome}) or a status
 * in {@link RetryOptions.Builder#retryStatuses}. The failed response's body is
 * read by your handler and then closed (if it is a stream) before the backoff is
 * slept, so no connection is held while waiting; the backoff never outlasts the
 * deadline.
 *
 * <p>The result: the response when it succeeds, when its status is not one to
 * ask about, or when retryd denies retrying it ({@link RetriedResponse#decision()});
 * the last attempt's exception, unchanged, when retryd denies retrying it (the
 * decision is attached: {@link #decisionOf(Throwable)}); {@link
 * AmbiguousExecutionException} when the call may have taken effect upstream and
 * is not retried (AMBIGUOUS, or a DENY carrying {@link Decision#unknownOutcome()}).
 * When the caller's deadline ran out during an attempt, retryd is not asked: the
 * local rule decides (DENY DEADLINE, with the same mark).
 *
 * <p>No hidden re-sends. The JDK's {@code MultiExchange} re-sends a request once
 * by itself when the exchange failed with an {@code IOException} before any
 * response byte (a GET or HEAD; every method under {@code
 * -Djdk.httpclient.enableAllMethodRetry}; any request on an HTTP/2 GOAWAY), on
 * fresh connections as well as pooled ones, and no setting turns that off. So
 * every attempt's request carries a body publisher that allows one exchange:
 * the JDK asks a publisher its length while it builds each exchange's headers,
 * before any byte is written, and the second ask fails the exchange with
 * {@link ResendRefusedException} (SENT_NO_RESPONSE, CONNECTION_RESET). The
 * request the JDK would have re-sent is never written; retryd decides the next
 * attempt instead, spending budget and counting toward {@code max_attempts},
 * and a NON_IDEMPOTENT call is never repeated. (A connect the JDK tries again
 * after {@code ConnectException} writes no request; redirects and {@code
 * Authenticator} replays the HttpClient would make by itself are refused the
 * same way, so leave redirects at {@code Redirect.NEVER}, the default, and use
 * {@link RetryOptions.Builder#onRefreshCredentials} for 401s.) Verified on JDK
 * 17 (HttpAdapterTest counts the requests a server reads, fresh and pooled).
 *
 * <p>In a call chain (docs/lineage.md) each attempt carries the lineage of
 * the request being served ({@link Lineage#current()}) plus this layer's entry
 * in the {@code retryd.lineage} baggage member; each decision carries that
 * lineage and the failed response's {@code retryd-retried}, and a call that
 * ends in failure after the decision is recorded on the request being served.
 *
 * <p>About 560 lines, one responsibility: an {@code HttpClient} call under
 * retryd's decisions (the attempt loop, evidence from the JDK's exceptions,
 * and the one-exchange body that refuses the JDK's own re-send).
 */
public final class RetryingHttpClient implements AutoCloseable {
  /** A hard stop, whatever retryd or the fallback says. */
  private static final int MAX_LOOP = 100;

  private final HttpClient http;
  private final RetrydClient retryd;
  private final TrafficReporter reporter;
  private final boolean ownsReporter;
  private volatile java.util.concurrent.ScheduledExecutorService timer;

  private RetryingHttpClient(Builder builder) {
    this.http = builder.http;
    this.retryd = builder.retryd;
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
  }

  /** A builder over {@code http}, asking {@code retryd}. */
  public static Builder builder(HttpClient http, RetrydClient retryd) {
    return new Builder(Objects.requireNonNull(http, "http"), Objects.requireNonNull(retryd, "retryd"));
  }

  /** How the adapter is built. */
  public static final class Builder {
    private final HttpClient http;
    private final RetrydClient retryd;
    private TrafficReporter reporter;
    private boolean report = true;

    private Builder(HttpClient http, RetrydClient retryd) {
      this.http = http;
      this.retryd = retryd;
    }

    /** Counts first attempts and outcomes on this reporter (by default the adapter starts one of its own, closed with it). */
    public Builder reporter(TrafficReporter value) {
      this.reporter = Objects.requireNonNull(value);
      return this;
    }

    /** Counts no traffic (if another part of the process reports it). */
    public Builder noTrafficReport() {
      this.report = false;
      this.reporter = null;
      return this;
    }

    /** The adapter. */
    public RetryingHttpClient build() {
      return new RetryingHttpClient(this);
    }
  }

  /** The reporter first attempts are counted on, if any. */
  public Optional<TrafficReporter> reporter() {
    return Optional.ofNullable(reporter);
  }

  /** Closes the adapter's own reporter (sending what is left); the HttpClient and RetrydClient stay open. */
  @Override
  public void close() {
    if (ownsReporter) {
      reporter.close();
    }
    if (timer != null) {
      timer.shutdownNow();
    }
  }

  /** The timer that bounds body reads by the deadline; started on first use. */
  private java.util.concurrent.ScheduledExecutorService timer() {
    java.util.concurrent.ScheduledExecutorService current = timer;
    if (current == null) {
      synchronized (this) {
        if (timer == null) {
          java.util.concurrent.ScheduledThreadPoolExecutor created =
              new java.util.concurrent.ScheduledThreadPoolExecutor(
                  1,
                  runnable -> {
                    Thread thread = new Thread(runnable, "retryd-http-deadline");
                    thread.setDaemon(true);
                    return thread;
                  });
          created.setRemoveOnCancelPolicy(true); // most timers are cancelled: do not keep them queued
          timer = created;
        }
        current = timer;
      }
    }
    return current;
  }

  /**
   * Sends {@code request}, retrying as retryd decides (see the class comment).
   *
   * @throws AmbiguousExecutionException when the call may have taken effect and
   *     is not retried: AMBIGUOUS, or a DENY with an unknown-outcome mark (the
   *     caller's deadline after the request was sent included, decided locally)
   * @throws IOException the last attempt's failure, when retryd denies a retry
   *     (or {@link HttpTimeoutException} when the deadline ran out during an attempt)
   * @throws IllegalArgumentException when the idempotency is neither declared nor given by an Idempotency-Key
   */
  public <T> RetriedResponse<T> send(HttpRequest request, HttpResponse.BodyHandler<T> handler, RetryOptions options)
      throws IOException, InterruptedException {
    Idempotency idempotency = idempotencyOf(request, options);
    Body body = options.body != null ? options.body : bodyOf(request, options.reopenableBody);
    String operation = options.operation != null ? options.operation : request.method() + " " + pathOf(request);
    long deadlineAt = options.deadline == null ? 0 : System.nanoTime() + options.deadline.toNanos();
    HttpRequest current = request;
    // The request being served (docs/lineage.md), read once on the caller's thread.
    Optional<Lineage.Inbound> inbound = Lineage.current();
    String inboundLineage = inbound.map(Lineage.Inbound::lineage).orElse("");
    Duration previousBackoff = Duration.ZERO;
    boolean authRefreshAttempted = false;
    Decision last = null;
    for (int attempt = 1; ; attempt++) {
      if (attempt == 1 && reporter != null && options.reportFirstAttempt) {
        reporter.record(options.upstream);
      }
      Duration remaining = options.deadline == null ? null : Duration.ofNanos(Math.max(0, deadlineAt - System.nanoTime()));
      long bodyDeadline = options.deadline == null ? 0 : deadlineAt;
      Tracking<T> tracking;
      HttpResponse<T> response = null;
      IOException error = null;
      HttpOutcome outcome;
      Optional<Hedging.Plan> plan = Optional.empty();
      if (attempt == 1) {
        retryd.firstAttemptSent(options.upstream);
        // A one-shot body cannot be sent twice: never hedged.
        plan = HedgedHttp.replayable(body) ? retryd.hedgePlan(options.upstream, idempotency) : Optional.empty();
      }
      if (plan.isPresent()) {
        final HttpRequest first = current;
        final Duration firstRemaining = remaining;
        HedgedHttp.Result<T> hedged =
            new HedgedHttp<T>(http, retryd, reporter, options, timer())
                .run(
                    plan.get(),
                    copy -> oneExchange(first, copy == 0 ? firstRemaining : remainingOf(options, deadlineAt),
                        Lineage.outbound(inboundLineage, retryd.layer(), copy + 1)),
                    () -> new Tracking<>(handler, bodyDeadline, bodyDeadline == 0 ? null : timer()),
                    (k, sent) -> hedgeAsk(options, operation, idempotency, body, inboundLineage, deadlineAt, k, sent));
        response = hedged.response;
        error = hedged.error;
        tracking = hedged.tracking;
        if (hedged.lastDecision != null) {
          last = hedged.lastDecision;
        }
        attempt = hedged.sent; // the next retry, if any, counts every copy sent
      } else {
        tracking = new Tracking<>(handler, bodyDeadline, bodyDeadline == 0 ? null : timer());
        long start = System.nanoTime();
        // send(), not sendAsync().get(): the JDK hands sendAsync's result to its
        // executor, a thread hop that cost ~300us a call here. The request timeout
        // (cut to the deadline) bounds the wait for the headers, the tracking
        // subscriber's timer the body.
        try {
          response = http.send(oneExchange(current, remaining, Lineage.outbound(inboundLineage, retryd.layer(), attempt)), tracking);
        } catch (IOException failed) {
          // The JDK wraps the refusal of its own re-send; the refusal says what happened.
          error = ResendRefusedException.in(failed).map(IOException.class::cast).orElse(failed);
        }
        // A failure is an attempt retryd (or, past the deadline, the local rule) is
        // asked about; any other ending is a success. An interrupt is neither.
        boolean succeededNow = response != null && !options.retryStatuses.contains(response.statusCode());
        if (reporter != null && options.reportFirstAttempt) {
          reporter.recordOutcome(options.upstream, succeededNow, attempt > 1);
          if (attempt == 1) {
            reporter.recordLatency(options.upstream, succeededNow, System.nanoTime() - start);
          }
        }
      }
      boolean succeeded = response != null && !options.retryStatuses.contains(response.statusCode());
      if (response != null) {
        if (succeeded) {
          return new RetriedResponse<>(response, attempt, last);
        }
        outcome = HttpOutcome.ofResponse(tracking.info != null ? tracking.info : infoOf(response));
      } else {
        outcome = HttpOutcome.ofException(error, tracking.info);
      }

      DecideRequest.Builder ask =
          DecideRequest.newBuilder()
              .setUpstream(options.upstream)
              .setOperation(operation)
              .setIdempotency(idempotency)
              .setAttempt(attempt)
              .setEvidence(outcome.evidence())
              .setFailure(outcome.failure())
              .setHttpStatus(outcome.httpStatus())
              .setFirstByteDelivered(
                  options.bodyDeliveredIncrementally && response == null && tracking.info != null && tracking.delivered)
              .setAuthRefreshAttempted(authRefreshAttempted)
              .setMaxAttempts(options.maxAttempts)
              .setLineage(inboundLineage);
      // The layer below says it already retried (or was denied): only with a response.
      HttpResponse.ResponseInfo answered = response != null ? infoOf(response) : tracking.info;
      if (answered != null) {
        Lineage.retriedBelow(answered.headers().firstValue(Lineage.RETRIED_HEADER).orElse(null)).ifPresent(ask::setRetriedBelow);
      }
      if (outcome.retryAfter() != null) {
        ask.setRetryAfter(outcome.retryAfter());
      }
      if (body != null) {
        ask.setBody(body);
      }
      if (options.deadline != null) {
        ask.setDeadlineRemaining(Durations.toProto(Duration.ofNanos(Math.max(0, deadlineAt - System.nanoTime()))));
      }
      if (!previousBackoff.isZero()) {
        ask.setPreviousBackoff(Durations.toProto(previousBackoff));
      }
      // The caller's deadline ran out after the request was sent: there is no
      // time to ask retryd, and nothing to retry. The local rule says so (DENY
      // DEADLINE) with the same unknown-outcome mark retryd would compute, so a
      // NON_IDEMPOTENT call that may have happened surfaces as ambiguous.
      boolean deadlineSpent = options.deadline != null && deadlineAt - System.nanoTime() <= 0;
      Decision decision =
          deadlineSpent
              ? LocalRule.decide(retryd.fallback().orElse(LocalPolicy.DEFAULT), ask.build(),
                  "the caller's deadline expired during the attempt, retryd not asked")
              : retryd.decide(ask.build());
      last = decision;
      if (decision.isOutcomeUnknown()) {
        inbound.ifPresent(Lineage.Inbound::markFailedAfterDecision);
        // AMBIGUOUS, or a DENY (budget, attempts, deadline) of an attempt that
        // may have taken effect: never the plain failure.
        throw new AmbiguousExecutionException(decision, response, error);
      }
      boolean retry = decision.shouldRetry() && attempt < MAX_LOOP;
      if (retry && decision.refreshCredentials()) {
        if (options.onRefreshCredentials == null) {
          retry = false;
        } else {
          current = Objects.requireNonNull(options.onRefreshCredentials.apply(current), "onRefreshCredentials returned null");
          authRefreshAttempted = true;
        }
      }
      if (!retry) {
        // The call ends in failure after retryd's decision: the middleware
        // marks the served request's failed response with retryd-retried.
        inbound.ifPresent(Lineage.Inbound::markFailedAfterDecision);
        if (error != null) {
          error.addSuppressed(new DecisionRecord(decision, null));
          throw error;
        }
        return new RetriedResponse<>(response, attempt, decision);
      }
      if (response != null) {
        closeBody(response.body()); // give the connection back before waiting
      }
      Duration wait = decision.backoff();
      if (options.deadline != null) {
        Duration left = Duration.ofNanos(Math.max(0, deadlineAt - System.nanoTime()));
        wait = wait.compareTo(left) < 0 ? wait : left;
      }
      if (!wait.isZero() && !wait.isNegative()) {
        TimeUnit.NANOSECONDS.sleep(wait.toNanos());
      }
      previousBackoff = decision.backoff();
    }
  }

  private static Duration remainingOf(RetryOptions options, long deadlineAt) {
    return options.deadline == null ? null : Duration.ofNanos(Math.max(0, deadlineAt - System.nanoTime()));
  }

  /** The hedge request of hedge {@code k} with {@code sent} attempts sent: nothing failed, so no evidence. */
  private static HedgeRequest hedgeAsk(
      RetryOptions options, String operation, Idempotency idempotency, Body body, String lineage, long deadlineAt, int k, int sent) {
    return HedgeRequest.builder(options.upstream, idempotency, k)
        .operation(operation)
        .body(body)
        .attempt(sent)
        .maxAttempts(options.maxAttempts)
        .lineage(lineage)
        .deadlineRemaining(options.deadline != null ? remainingOf(options, deadlineAt) : null)
        .build();
  }

  /**
   * The decision attached to an exception {@link #send} rethrew because retryd
   * denied retrying it (or the one an {@link AmbiguousExecutionException} carries).
   */
  public static Optional<Decision> decisionOf(Throwable error) {
    return DecisionRecord.find(error);
  }

  /**
   * The replayability of a request's body, from its {@code BodyPublisher}:
   * {@code ofByteArray}/{@code ofString} are BYTES (replayable), {@code ofFile}
   * a REOPENABLE_SUPPLIER (the JDK reopens the file each attempt),
   * {@code ofInputStream} an INPUT_STREAM (one-shot) unless {@code
   * reopenableSupplier} declares that its supplier opens a fresh stream each time,
   * {@code noBody()} or none at all no body (null); anything else ({@code
   * ofByteArrays}, {@code fromPublisher}, {@code concat}, a publisher of your
   * own) a PUBLISHER (one-shot), since nothing says it can be read again.
   */
  public static Body bodyOf(HttpRequest request, boolean reopenableSupplier) {
    Optional<HttpRequest.BodyPublisher> publisher = request.bodyPublisher();
    if (publisher.isEmpty()) {
      return null;
    }
    // The JDK's publishers are internal classes; their names are all there is.
    String name = publisher.get().getClass().getName();
    String kind = name.substring(name.lastIndexOf('$') + 1);
    if (name.startsWith("jdk.internal.net.http.")) {
      switch (kind) {
        case "EmptyPublisher":
          return null;
        case "ByteArrayPublisher":
        case "StringPublisher":
          return body(BodyKind.BODY_KIND_BYTES);
        case "FilePublisher":
          return body(BodyKind.BODY_KIND_REOPENABLE_SUPPLIER);
        case "InputStreamPublisher": // JDK 17
        case "StreamPublisher": // JDK 11
          return body(reopenableSupplier ? BodyKind.BODY_KIND_REOPENABLE_SUPPLIER : BodyKind.BODY_KIND_INPUT_STREAM);
        default:
          break;
      }
    }
    if (publisher.get().contentLength() == 0) {
      return null;
    }
    return body(BodyKind.BODY_KIND_PUBLISHER);
  }

  private static Body body(BodyKind kind) {
    return Body.newBuilder().setKind(kind).build();
  }

  private static Idempotency idempotencyOf(HttpRequest request, RetryOptions options) {
    if (options.idempotency != null) {
      return options.idempotency;
    }
    if (request.headers().firstValue("idempotency-key").isPresent()) {
      return Idempotency.IDEMPOTENCY_IDEMPOTENT_WITH_KEY;
    }
    throw new IllegalArgumentException(
        "idempotency: required (RetryOptions.Builder.idempotency, or an Idempotency-Key header); the method alone never decides");
  }

  private static String pathOf(HttpRequest request) {
    String path = request.uri().getRawPath();
    return path == null || path.isEmpty() ? "/" : path;
  }

  /**
   * The attempt's request: its body behind a {@link OneExchangeBody} (see the
   * class comment), its timeout cut to the time left (Java 11 has no
   * HttpRequest.newBuilder(request, filter)).
   */
  private static HttpRequest oneExchange(HttpRequest request, Duration remaining, String lineage) {
    Optional<Duration> own = request.timeout();
    HttpRequest.Builder copy =
        HttpRequest.newBuilder(request.uri())
            .method(request.method(), new OneExchangeBody(request.bodyPublisher().orElse(HttpRequest.BodyPublishers.noBody())))
            .expectContinue(request.expectContinue());
    if (remaining != null && (own.isEmpty() || own.get().compareTo(remaining) > 0)) {
      copy.timeout(remaining.isZero() ? Duration.ofNanos(1) : remaining);
    } else {
      own.ifPresent(copy::timeout);
    }
    request.version().ifPresent(copy::version);
    request.headers().map().forEach((name, values) -> {
      if (!name.equalsIgnoreCase("baggage")) {
        values.forEach(value -> copy.header(name, value));
      }
    });
    // The other members pass through untouched; ours is this attempt's.
    copy.header("baggage", Lineage.withMember(request.headers().allValues("baggage"), lineage));
    return copy.build();
  }

  private static HttpResponse.ResponseInfo infoOf(HttpResponse<?> response) {
    return new HttpResponse.ResponseInfo() {
      @Override
      public int statusCode() {
        return response.statusCode();
      }

      @Override
      public HttpHeaders headers() {
        return response.headers();
      }

      @Override
      public HttpClient.Version version() {
        return response.version();
      }
    };
  }

  static void closeBody(Object body) {
    try {
      if (body instanceof AutoCloseable) {
        ((AutoCloseable) body).close();
      } else if (body instanceof BaseStream) {
        ((BaseStream<?, ?>) body).close();
      }
    } catch (Exception ignored) {
      // The body of a response we are giving up on; its connection is gone either way.
    }
  }


  /**
   * A body publisher that allows one exchange. The JDK asks each exchange's
   * publisher for its length while it builds that exchange's request headers,
   * before writing any byte (HTTP/1.1 and HTTP/2 alike); the second ask comes
   * from the JDK's own re-send, and fails it before anything is written.
   */
  private static final class OneExchangeBody implements HttpRequest.BodyPublisher {
    private final HttpRequest.BodyPublisher body;
    private final java.util.concurrent.atomic.AtomicBoolean exchanged = new java.util.concurrent.atomic.AtomicBoolean();

    OneExchangeBody(HttpRequest.BodyPublisher body) {
      this.body = body;
    }

    @Override
    public long contentLength() {
      if (!exchanged.compareAndSet(false, true)) {
        // contentLength() cannot throw a checked exception; the JDK fails the
        // exchange with whatever it throws, wrapped in an IOException.
        throw new java.io.UncheckedIOException(new ResendRefusedException());
      }
      return body.contentLength();
    }

    @Override
    public void subscribe(Flow.Subscriber<? super ByteBuffer> subscriber) {
      body.subscribe(subscriber);
    }
  }

  /**
   * Records whether (and what) response headers arrived and whether body bytes
   * reached the handler's subscriber, and ends a body read the deadline
   * overtakes with an {@link HttpTimeoutException}.
   */
  static final class Tracking<T> implements HttpResponse.BodyHandler<T> {
    private final HttpResponse.BodyHandler<T> handler;
    private final long deadlineAt;
    private final java.util.concurrent.ScheduledExecutorService timer;
    volatile HttpResponse.ResponseInfo info;
    volatile boolean delivered;

    Tracking(HttpResponse.BodyHandler<T> handler, long deadlineAt, java.util.concurrent.ScheduledExecutorService timer) {
      this.handler = handler;
      this.deadlineAt = deadlineAt;
      this.timer = timer;
    }

    @Override
    public HttpResponse.BodySubscriber<T> apply(HttpResponse.ResponseInfo responseInfo) {
      info = responseInfo;
      HttpResponse.BodySubscriber<T> subscriber = handler.apply(responseInfo);
      return new HttpResponse.BodySubscriber<T>() {
        private final java.util.concurrent.atomic.AtomicBoolean ended = new java.util.concurrent.atomic.AtomicBoolean();
        private volatile java.util.concurrent.ScheduledFuture<?> guard;

        @Override
        public CompletionStage<T> getBody() {
          return subscriber.getBody();
        }

        @Override
        public void onSubscribe(Flow.Subscription subscription) {
          subscriber.onSubscribe(subscription);
          if (timer != null) {
            guard =
                timer.schedule(
                    () -> {
                      if (ended.compareAndSet(false, true)) {
                        // The timeout first: cancelling first let the JDK fail the
                        // body with its own "bytes received" IOException.
                        subscriber.onError(new HttpTimeoutException("deadline exceeded while reading the body"));
                        subscription.cancel();
                      }
                    },
                    Math.max(0, deadlineAt - System.nanoTime()),
                    TimeUnit.NANOSECONDS);
          }
        }

        @Override
        public void onNext(List<ByteBuffer> item) {
          if (ended.get()) {
            return;
          }
          for (ByteBuffer buffer : item) {
            if (buffer.hasRemaining()) {
              delivered = true;
              break;
            }
          }
          subscriber.onNext(item);
        }

        @Override
        public void onError(Throwable throwable) {
          if (ended.compareAndSet(false, true)) {
            stopGuard();
            subscriber.onError(throwable);
          }
        }

        @Override
        public void onComplete() {
          if (ended.compareAndSet(false, true)) {
            stopGuard();
            subscriber.onComplete();
          }
        }

        private void stopGuard() {
          java.util.concurrent.ScheduledFuture<?> running = guard;
          if (running != null) {
            running.cancel(false);
          }
        }
      };
    }
  }
}
