package dev.retryd.client;

import java.io.IOException;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.function.IntFunction;
import retryd.v1.Retryd.DecideRequest;

/**
 * The first attempt of a hedged call ({@link RetryingHttpClient}): sent with
 * {@code sendAsync}, and while it is slower than the plan's delay, a Decide for
 * each hedge and, on RETRY, a copy. The first copy whose answer is not a
 * retryable failure wins; the others are cancelled ({@code cancel(true)} on
 * {@code sendAsync}'s future aborts the exchange on JDK 16+: the upstream sees
 * the stream or connection go). A cancelled loser is recorded nowhere, except the
 * first attempt's latency (the time it ran, as a success). When every copy sent
 * failed, the last failure goes to the normal retry path.
 */
final class HedgedHttp<T> {
  /** One copy of the request in flight. */
  private static final class Copy<T> {
    final int index;
    final long startNanos;
    final RetryingHttpClient.Tracking<T> tracking;
    final CompletableFuture<HttpResponse<T>> future;

    Copy(int index, long startNanos, RetryingHttpClient.Tracking<T> tracking, CompletableFuture<HttpResponse<T>> future) {
      this.index = index;
      this.startNanos = startNanos;
      this.tracking = tracking;
      this.future = future;
    }
  }

  /** How the hedged first attempt ended, for the retry loop. */
  static final class Result<T> {
    HttpResponse<T> response;
    IOException error;
    RetryingHttpClient.Tracking<T> tracking;
    int sent;
    Decision lastDecision;
  }

  private final HttpClient http;
  private final RetrydClient retryd;
  private final TrafficReporter reporter;
  private final RetryOptions options;

  HedgedHttp(HttpClient http, RetrydClient retryd, TrafficReporter reporter, RetryOptions options) {
    this.http = http;
    this.retryd = retryd;
    this.reporter = options.reportFirstAttempt ? reporter : null;
    this.options = options;
  }

  /**
   * Runs the copies. {@code request} builds copy k's request (its lineage entry
   * k+1), {@code tracking} its body handler, {@code ask} the Decide of hedge k
   * with k copies sent.
   */
  Result<T> run(
      Hedging.Plan plan,
      IntFunction<HttpRequest> request,
      java.util.function.Supplier<RetryingHttpClient.Tracking<T>> tracking,
      java.util.function.BiFunction<Integer, Integer, DecideRequest> ask)
      throws InterruptedException {
    LinkedBlockingQueue<Copy<T>> done = new LinkedBlockingQueue<>();
    List<Copy<T>> copies = new ArrayList<>();
    Result<T> result = new Result<>();
    IntFunction<Copy<T>> launch =
        index -> {
          RetryingHttpClient.Tracking<T> handler = tracking.get();
          long start = System.nanoTime();
          CompletableFuture<HttpResponse<T>> future = http.sendAsync(request.apply(index), handler);
          Copy<T> copy = new Copy<>(index, start, handler, future);
          future.whenComplete((response, error) -> done.add(copy));
          return copy;
        };
    copies.add(launch.apply(0));
    result.sent = 1;
    int inFlight = 1;
    long nextHedge = System.nanoTime() + plan.delay.toNanos();
    boolean hedging = plan.max > 0;
    try {
      while (true) {
        Copy<T> ended;
        if (hedging) {
          ended = done.poll(Math.max(0, nextHedge - System.nanoTime()), TimeUnit.NANOSECONDS);
        } else {
          ended = done.take();
        }
        if (ended == null) {
          // The delay passed with every copy still running: ask for the next hedge.
          hedging = false;
          Decision decision = retryd.decide(ask.apply(result.sent, result.sent));
          result.lastDecision = decision;
          // A copy that ended while retryd decided is handled first, rather
          // than a copy sent that the call may no longer need.
          if (decision.shouldRetry() && done.isEmpty()) {
            copies.add(launch.apply(result.sent));
            result.sent++;
            inFlight++;
            if (result.sent - 1 < plan.max) {
              hedging = true;
              nextHedge = System.nanoTime() + plan.delay.toNanos();
            }
          }
          continue;
        }
        inFlight--;
        HttpResponse<T> response = null;
        IOException error = null;
        try {
          response = ended.future.get();
        } catch (ExecutionException failed) {
          Throwable cause = failed.getCause();
          IOException io = cause instanceof IOException ? (IOException) cause : new IOException(cause);
          error = ResendRefusedException.in(io).map(IOException.class::cast).orElse(io);
        }
        boolean succeeded = response != null && !options.retryStatuses.contains(response.statusCode());
        long elapsed = System.nanoTime() - ended.startNanos;
        if (reporter != null) {
          reporter.recordOutcome(options.upstream, succeeded, ended.index > 0);
          if (ended.index == 0) {
            reporter.recordLatency(options.upstream, succeeded, elapsed);
          }
        }
        if (succeeded || inFlight == 0) {
          if (succeeded) {
            for (Copy<T> other : copies) {
              if (other != ended && other.future.cancel(true) && other.index == 0 && reporter != null) {
                // The first attempt ran this long and was still running: a
                // lower bound of its latency, counted so the tail stays seen.
                reporter.recordLatency(options.upstream, true, System.nanoTime() - other.startNanos);
              }
            }
          }
          if (result.response != null) {
            RetryingHttpClient.closeBody(result.response.body());
          }
          result.response = response;
          result.error = error;
          result.tracking = ended.tracking;
          return result;
        }
        // A failed copy while others run: keep it as the last failure so far.
        if (result.response != null) {
          RetryingHttpClient.closeBody(result.response.body());
        }
        result.response = response;
        result.error = error;
        result.tracking = ended.tracking;
      }
    } catch (InterruptedException | RuntimeException stopped) {
      for (Copy<T> copy : copies) {
        copy.future.cancel(true);
      }
      throw stopped;
    }
  }

  /** Whether a body can be sent more than once: none, bytes, or a supplier that reopens. */
  static boolean replayable(retryd.v1.Retryd.Body body) {
    if (body == null) {
      return true;
    }
    switch (body.getKind()) {
      case BODY_KIND_BYTES:
      case BODY_KIND_REOPENABLE_SUPPLIER:
      case BODY_KIND_ENCODED_VALUE:
        return true;
      default:
        return false;
    }
  }

}
