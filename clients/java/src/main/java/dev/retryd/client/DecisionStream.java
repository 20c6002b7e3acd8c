package dev.retryd.client;

import io.grpc.Status;
import io.grpc.stub.StreamObserver;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import retryd.v1.RetryDeciderGrpc;
import retryd.v1.Retryd.DecideRequest;
import retryd.v1.Retryd.DecideResponse;

/**
 * Decisions over one long-lived {@code DecideStream}: cheaper than a unary call
 * each when a caller decides often. Thread-safe. Responses come back in request
 * order, one per request, so each {@link #decide} future is completed by the
 * response in its position.
 *
 * <p>An item retryd rejects completes its future with {@link InvalidRequestException}
 * and does not end the stream. An item retryd does not answer within the client's
 * timeout (bounded by its deadline) is decided by the local rule; its late
 * response, when it comes, is discarded. If the stream breaks, every pending item
 * is decided by the local rule (or fails with {@link RetrydUnavailableException}
 * without a fallback), and the next {@link #decide} opens a new stream.
 */
public final class DecisionStream implements AutoCloseable {
  private final RetrydClient client;
  private final Object lock = new Object();
  private Session session;
  private boolean closed;

  DecisionStream(RetrydClient client) {
    this.client = client;
  }

  /**
   * Sends one failed attempt; the future completes with its decision, or with
   * the local rule's after the client's timeout (bounded by the request's deadline).
   */
  public CompletableFuture<Decision> decide(DecideRequest request) {
    return decide(request, client.callTimeout(request, client.timeout()));
  }

  /** {@link #decide(DecideRequest)} waiting exactly {@code timeout}, whatever the request's deadline. */
  public CompletableFuture<Decision> decide(DecideRequest request, java.time.Duration timeout) {
    CompletableFuture<Decision> future = new CompletableFuture<>();
    Pending pending = new Pending(request, future);
    synchronized (lock) {
      if (closed) {
        throw new IllegalStateException("DecisionStream is closed");
      }
      if (session == null || session.broken) {
        session = new Session();
      }
      // Enqueue and send under one lock, so the queue's order is the wire's.
      session.queue.add(pending);
      session.requests.onNext(request);
    }
    long timeoutNanos = timeout.toNanos();
    client
        .scheduler()
        .schedule(
            () -> {
              if (!future.isDone()) {
                pending.fail(Status.DEADLINE_EXCEEDED.withDescription("no answer on DecideStream in time"));
              }
            },
            timeoutNanos,
            TimeUnit.NANOSECONDS);
    return future;
  }

  /** Half-closes the stream; pending items still get their responses. */
  @Override
  public void close() {
    synchronized (lock) {
      closed = true;
      if (session != null && !session.broken) {
        session.requests.onCompleted();
      }
    }
  }

  private final class Pending {
    final DecideRequest request;
    final CompletableFuture<Decision> future;

    Pending(DecideRequest request, CompletableFuture<Decision> future) {
      this.request = request;
      this.future = future;
    }

    void fail(Status status) {
      try {
        future.complete(client.fallbackOrThrow(request, status, status.asRuntimeException()));
      } catch (RuntimeException error) {
        future.completeExceptionally(error);
      }
    }
  }

  /** One open stream and the items sent on it that await their response. */
  private final class Session implements StreamObserver<DecideResponse> {
    final ArrayDeque<Pending> queue = new ArrayDeque<>();
    final StreamObserver<DecideRequest> requests;
    boolean broken;

    Session() {
      requests = RetryDeciderGrpc.newStub(client.channel()).decideStream(this);
    }

    @Override
    public void onNext(DecideResponse response) {
      Pending pending;
      synchronized (lock) {
        pending = queue.poll();
      }
      if (pending == null) {
        return; // more responses than requests: not the contract; nothing to complete
      }
      if (response.hasError()) {
        if (response.getError().getCode() == Status.Code.INVALID_ARGUMENT.value()) {
          pending.future.completeExceptionally(new InvalidRequestException(response.getError().getMessage()));
        } else {
          pending.fail(Status.fromCodeValue(response.getError().getCode()).withDescription(response.getError().getMessage()));
        }
        return;
      }
      try {
        pending.future.complete(client.answered(response, pending.request));
      } catch (RuntimeException failure) {
        pending.future.completeExceptionally(failure);
      }
    }

    @Override
    public void onError(Throwable error) {
      List<Pending> orphans;
      synchronized (lock) {
        broken = true;
        orphans = new ArrayList<>(queue);
        queue.clear();
      }
      Status status = Status.fromThrowable(error);
      for (Pending pending : orphans) {
        pending.fail(status);
      }
    }

    @Override
    public void onCompleted() {
      onError(Status.UNAVAILABLE.withDescription("DecideStream ended").asRuntimeException());
    }
  }
}
