package dev.retryd.client;

import java.time.Duration;
import java.util.Objects;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.Idempotency;

/**
 * One hedge decision ({@link RetrydClient#decideHedge}): may the {@code hedge}-th
 * copy of a call whose first attempt (and earlier hedges) are still running be
 * sent now? Nothing has failed, so it carries no evidence, failure, status or
 * Retry-After (retryd rejects a hedge that does). Immutable; built with {@link
 * #builder}.
 */
public final class HedgeRequest {
  /** The Decide this hedge is asked with, built once: the request is its fields. */
  private final DecideRequest request;

  private HedgeRequest(DecideRequest request) {
    this.request = request;
  }

  /**
   * A hedge request for the {@code hedge}-th hedge (1 to 16) of a call to
   * {@code upstream} declared {@code idempotency}.
   */
  public static Builder builder(String upstream, Idempotency idempotency, int hedge) {
    return new Builder(upstream, idempotency, hedge);
  }

  /** The upstream. */
  public String upstream() {
    return request.getUpstream();
  }

  /** k: this is the k-th hedge of the call. */
  public int hedge() {
    return request.getHedge();
  }

  /** The copies sent so far (the first attempt and the hedges granted before this one). */
  public int attempt() {
    return request.getAttempt();
  }

  /** The {@code Decide} this hedge is asked with: every field as given. */
  DecideRequest toDecideRequest() {
    return request;
  }

  @Override
  public String toString() {
    return "HedgeRequest{" + request.toString().replace('\n', ' ').trim() + "}";
  }

  /** Builds a {@link HedgeRequest}. */
  public static final class Builder {
    private final String upstream;
    private final Idempotency idempotency;
    private final int hedge;
    private String operation = "";
    private Body body;
    private int attempt;
    private int maxAttempts;
    private String lineage = "";
    private Duration deadlineRemaining;

    private Builder(String upstream, Idempotency idempotency, int hedge) {
      this.upstream = Objects.requireNonNull(upstream, "upstream");
      this.idempotency = Objects.requireNonNull(idempotency, "idempotency");
      this.hedge = hedge;
    }

    /** The call's operation ("GET /things/{id}", a gRPC method), as its Decide would name it. */
    public Builder operation(String value) {
      this.operation = Objects.requireNonNull(value, "operation");
      return this;
    }

    /** The call's body (none by default: replayable). */
    public Builder body(Body value) {
      this.body = value;
      return this;
    }

    /** The copies sent so far: k for the k-th hedge, the default. */
    public Builder attempt(int value) {
      this.attempt = value;
      return this;
    }

    /** The call's own lower limit on attempts (0, the default: the policy's). */
    public Builder maxAttempts(int value) {
      this.maxAttempts = value;
      return this;
    }

    /** The call's inbound lineage (docs/lineage.md; none by default). */
    public Builder lineage(String value) {
      this.lineage = Objects.requireNonNull(value, "lineage");
      return this;
    }

    /** The time left before the call's deadline (none by default: no deadline). A negative value is sent as it is, and retryd rejects it. */
    public Builder deadlineRemaining(Duration value) {
      this.deadlineRemaining = value;
      return this;
    }

    /** The request. */
    public HedgeRequest build() {
      DecideRequest.Builder ask =
          DecideRequest.newBuilder()
              .setUpstream(upstream)
              .setOperation(operation)
              .setIdempotency(idempotency)
              .setAttempt(attempt != 0 ? attempt : hedge)
              .setHedge(hedge)
              .setMaxAttempts(maxAttempts)
              .setLineage(lineage);
      if (body != null) {
        ask.setBody(body);
      }
      if (deadlineRemaining != null) {
        ask.setDeadlineRemaining(Durations.toProto(deadlineRemaining));
      }
      return new HedgeRequest(ask.build());
    }
  }
}
