package dev.retryd.client;

import java.time.Duration;
import java.util.Objects;
import java.util.Set;
import java.util.function.UnaryOperator;
import java.net.http.HttpRequest;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.Idempotency;

/**
 * What {@link RetryingHttpClient#send} needs to know about one call that the
 * request itself does not say. Immutable; build with {@link #builder(String)}.
 */
public final class RetryOptions {
  /** Statuses worth asking retryd about; any other response is returned as it is. */
  public static final Set<Integer> DEFAULT_RETRY_STATUSES = Set.of(401, 408, 425, 429, 500, 502, 503, 504);

  final String upstream;
  final Idempotency idempotency;
  final String operation;
  final Duration deadline;
  final int maxAttempts;
  final Body body;
  final boolean reopenableBody;
  final Set<Integer> retryStatuses;
  final UnaryOperator<HttpRequest> onRefreshCredentials;
  final boolean reportFirstAttempt;
  final boolean bodyDeliveredIncrementally;

  private RetryOptions(Builder builder) {
    this.upstream = builder.upstream;
    this.idempotency = builder.idempotency;
    this.operation = builder.operation;
    this.deadline = builder.deadline;
    this.maxAttempts = builder.maxAttempts;
    this.body = builder.body;
    this.reopenableBody = builder.reopenableBody;
    this.retryStatuses = builder.retryStatuses;
    this.onRefreshCredentials = builder.onRefreshCredentials;
    this.reportFirstAttempt = builder.reportFirstAttempt;
    this.bodyDeliveredIncrementally = builder.bodyDeliveredIncrementally;
  }

  /** Options for a call to {@code upstream}, the name of its budget and policy in retryd. */
  public static Builder builder(String upstream) {
    return new Builder(upstream);
  }

  /** How options are built. */
  public static final class Builder {
    private final String upstream;
    private Idempotency idempotency;
    private String operation;
    private Duration deadline;
    private int maxAttempts;
    private Body body;
    private boolean reopenableBody;
    private Set<Integer> retryStatuses = DEFAULT_RETRY_STATUSES;
    private UnaryOperator<HttpRequest> onRefreshCredentials;
    private boolean reportFirstAttempt = true;
    private boolean bodyDeliveredIncrementally;

    private Builder(String upstream) {
      if (Objects.requireNonNull(upstream, "upstream").isEmpty()) {
        throw new IllegalArgumentException("upstream: required");
      }
      this.upstream = upstream;
    }

    /**
     * How safe the operation is to repeat, as you know it. Required unless the
     * request carries an {@code Idempotency-Key} header (then IDEMPOTENT_WITH_KEY
     * unless you say otherwise). Never guessed from the method.
     */
    public Builder idempotency(Idempotency value) {
      if (value == null || value == Idempotency.IDEMPOTENCY_UNSPECIFIED || value == Idempotency.UNRECOGNIZED) {
        throw new IllegalArgumentException("idempotency: must be SAFE, IDEMPOTENT, IDEMPOTENT_WITH_KEY or NON_IDEMPOTENT");
      }
      this.idempotency = value;
      return this;
    }

    /** The operation for retryd's audit ("POST /v1/charges"); by default the method and path. */
    public Builder operation(String value) {
      this.operation = Objects.requireNonNull(value);
      return this;
    }

    /**
     * The time the whole call may take, every attempt and backoff included. Each
     * attempt's request timeout is cut to what is left, and what is left is what
     * retryd is told.
     */
    public Builder deadline(Duration value) {
      if (value.isNegative()) {
        throw new IllegalArgumentException("deadline: must not be negative");
      }
      this.deadline = value;
      return this;
    }

    /** Your own attempt limit (the lower of it and the policy's applies); 0, the default, means the policy's. */
    public Builder maxAttempts(int value) {
      if (value < 0) {
        throw new IllegalArgumentException("maxAttempts: must not be negative");
      }
      this.maxAttempts = value;
      return this;
    }

    /** The body's replayability, overriding what is derived from the request's {@code BodyPublisher}. */
    public Builder body(Body value) {
      this.body = Objects.requireNonNull(value);
      return this;
    }

    /**
     * Declares that the supplier behind {@code BodyPublishers.ofInputStream}
     * opens a fresh stream of the same bytes each time (the JDK calls it once
     * per attempt), so the body is REOPENABLE rather than one-shot.
     */
    public Builder reopenableBody(boolean value) {
      this.reopenableBody = value;
      return this;
    }

    /** The statuses for which retryd is asked ({@link #DEFAULT_RETRY_STATUSES} by default). */
    public Builder retryStatuses(Set<Integer> value) {
      this.retryStatuses = Set.copyOf(value);
      return this;
    }

    /**
     * Called when retryd allows a refresh-and-replay after a 401: returns the
     * request to replay, with fresh credentials. Without it a 401 is returned.
     */
    public Builder onRefreshCredentials(UnaryOperator<HttpRequest> value) {
      this.onRefreshCredentials = Objects.requireNonNull(value);
      return this;
    }

    /**
     * Whether the first attempt is counted on the traffic reporter, with every
     * attempt's outcome (true by default; retries are never counted as requests).
     */
    public Builder reportFirstAttempt(boolean value) {
      this.reportFirstAttempt = value;
      return this;
    }

    /**
     * Declares that your {@code BodyHandler} hands bytes to your code as they
     * arrive (a consumer or subscriber of your own) rather than buffering them
     * ({@code ofString}, {@code ofByteArray}, ...): a body failure after the first
     * byte is then reported with {@code first_byte_delivered}, which denies a
     * retry that would deliver twice.
     */
    public Builder bodyDeliveredIncrementally(boolean value) {
      this.bodyDeliveredIncrementally = value;
      return this;
    }

    /** The options. */
    public RetryOptions build() {
      return new RetryOptions(this);
    }
  }
}
