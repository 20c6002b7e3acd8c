package dev.retryd.client;

import java.io.IOException;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.BiFunction;
import java.util.function.IntFunction;
import java.util.function.Supplier;

/**
 * The first attempt of a hedged call ({@link RetryingHttpClient}). The first
 * attempt is sent with the synchronous {@code send} on the caller's thread, as an
 * unhedged call is (a fast call costs a timer more, no thread hop: {@code
 * sendAsync} for it cost ~0.6 ms a call here, HedgedCallBenchmark). A timer of
 * the plan's delay, if it fires with the attempt still running, asks retryd for a
 * hedge ({@code decideHedgeAsync}, off the caller's thread) and on RETRY sends a copy
 * with {@code sendAsync}. The first copy whose answer is not a retryable failure
 * wins; the others are cancelled: a hedge by {@code cancel(true)} on its future,
 * the first attempt by interrupting the caller's thread inside {@code send},
 * which aborts its exchange (JDK 16+); either way the upstream sees the stream or
 * connection go. A cancelled loser is recorded nowhere, except the first
 * attempt's latency (the time it ran, as a success). A call a hedge answered is
 * counted in the reporter's {@code hedges_won}. When every copy sent failed, the
 * last failure goes to the normal retry path.
 *
 * <p>The interrupt is ours only while the caller is inside {@code send}: it is
 * sent under a lock that the caller takes as soon as {@code send} returns, and
 * cleared then if it came too late to abort anything. An interrupt of the
 * caller's own ends the call as before (every copy cancelled); one that arrives
 * in the same instant as a winning hedge is taken for ours.
 */
final class HedgedHttp<T> {
  /** A hedge in flight. */
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
  private final ScheduledExecutorService timer;

  // Guarded by lock.
  private final Object lock = new Object();
  private Thread caller;
  private boolean firstDone;
  private boolean abortFirst;
  private Copy<T> winner;
  private HttpResponse<T> winnerResponse;
  private final List<Copy<T>> hedges = new ArrayList<>();
  private int sent = 1;
  private Decision lastDecision;
  private ScheduledFuture<?> pendingTimer;
  /** Hedges that ended, for the caller to wait on once its own attempt failed. */
  private final LinkedBlockingQueue<Copy<T>> ended = new LinkedBlockingQueue<>();

  HedgedHttp(HttpClient http, RetrydClient retryd, TrafficReporter reporter, RetryOptions options, ScheduledExecutorService timer) {
    this.http = http;
    this.retryd = retryd;
    this.reporter = options.reportFirstAttempt ? reporter : null;
    this.options = options;
    this.timer = timer;
  }

  /**
   * Runs the copies. {@code request} builds copy k's request (its lineage entry
   * k+1), {@code tracking} its body handler, {@code ask} the Decide of hedge k
   * with k copies sent.
   */
  Result<T> run(
      Hedging.Plan plan,
      IntFunction<HttpRequest> request,
      Supplier<RetryingHttpClient.Tracking<T>> tracking,
      BiFunction<Integer, Integer, HedgeRequest> ask)
      throws InterruptedException {
    RetryingHttpClient.Tracking<T> firstTracking = tracking.get();
    synchronized (lock) {
      caller = Thread.currentThread();
    }
    // Before the timer: scheduling may start the timer's thread, which on a
    // loaded machine took longer than some calls (the delay counts from here).
    long start = System.nanoTime();
    schedule(plan, request, tracking, ask);
    HttpResponse<T> response = null;
    IOException error = null;
    boolean interrupted = false;
    try {
      response = http.send(request.apply(0), firstTracking);
    } catch (IOException failed) {
      error = unwrap(failed);
    } catch (InterruptedException stopped) {
      interrupted = true;
    }
    long elapsed = System.nanoTime() - start;
    boolean ours;
    List<Copy<T>> running;
    synchronized (lock) {
      firstDone = true; // no interrupt, and no new hedge, from here on
      ours = abortFirst;
      if (pendingTimer != null) {
        pendingTimer.cancel(false);
      }
      running = new ArrayList<>(hedges);
    }
    if (ours) {
      Thread.interrupted(); // ours, if it came after send returned
      if (response != null) {
        RetryingHttpClient.closeBody(response.body()); // answered in the same instant as the winner
      }
      if (reporter != null) {
        // The first attempt ran this long and was still running: a lower bound
        // of its latency, counted so that the tail hedging is for stays seen.
        reporter.recordLatency(options.upstream, true, elapsed);
        // And the call's answer came from a hedge (UpstreamTraffic.hedges_won).
        reporter.recordHedgeWon(options.upstream);
      }
      cancelAllBut(running, winner);
      return result(winnerResponse, null, winner.tracking);
    }
    if (interrupted) {
      cancelAllBut(running, null);
      throw new InterruptedException();
    }
    boolean succeeded = response != null && !options.retryStatuses.contains(response.statusCode());
    if (reporter != null) {
      reporter.recordOutcome(options.upstream, succeeded, false);
      reporter.recordLatency(options.upstream, succeeded, elapsed);
    }
    if (succeeded || running.isEmpty()) {
      cancelAllBut(running, null);
      return result(response, error, firstTracking);
    }
    // The first attempt failed with hedges in flight: the first of them to
    // succeed wins, else the last failure goes to the retry path.
    Result<T> last = result(response, error, firstTracking);
    try {
      for (int left = running.size(); left > 0; left--) {
        Copy<T> copy = ended.take();
        HttpResponse<T> hedgeResponse = null;
        IOException hedgeError = null;
        try {
          hedgeResponse = copy.future.get();
        } catch (ExecutionException failed) {
          hedgeError = failed.getCause() instanceof IOException ? unwrap((IOException) failed.getCause()) : new IOException(failed.getCause());
        } catch (java.util.concurrent.CancellationException cancelled) {
          continue;
        }
        if (last.response != null) {
          RetryingHttpClient.closeBody(last.response.body());
        }
        last = result(hedgeResponse, hedgeError, copy.tracking);
        if (hedgeResponse != null && !options.retryStatuses.contains(hedgeResponse.statusCode())) {
          if (reporter != null) {
            reporter.recordHedgeWon(options.upstream); // a hedge answered, after the first attempt failed
          }
          cancelAllBut(running, copy);
          return last;
        }
      }
    } catch (InterruptedException stopped) {
      cancelAllBut(running, null);
      throw stopped;
    }
    return last;
  }

  private Result<T> result(HttpResponse<T> response, IOException error, RetryingHttpClient.Tracking<T> tracking) {
    Result<T> result = new Result<>();
    result.response = response;
    result.error = error;
    result.tracking = tracking;
    synchronized (lock) {
      result.sent = sent;
      result.lastDecision = lastDecision;
    }
    return result;
  }

  private static <T> void cancelAllBut(List<Copy<T>> copies, Copy<T> keep) {
    for (Copy<T> copy : copies) {
      if (copy != keep) {
        copy.future.cancel(true);
      }
    }
  }

  private void schedule(
      Hedging.Plan plan,
      IntFunction<HttpRequest> request,
      Supplier<RetryingHttpClient.Tracking<T>> tracking,
      BiFunction<Integer, Integer, HedgeRequest> ask) {
    synchronized (lock) {
      if (firstDone || winner != null || sent - 1 >= plan.max) {
        return;
      }
      try {
        pendingTimer = timer.schedule(() -> askHedge(plan, request, tracking, ask), plan.delay.toNanos(), TimeUnit.NANOSECONDS);
      } catch (RejectedExecutionException closed) {
        pendingTimer = null; // the adapter is closing: no hedge
      }
    }
  }

  /** The delay passed with the first attempt still running: ask retryd, off the caller's thread. */
  private void askHedge(
      Hedging.Plan plan,
      IntFunction<HttpRequest> request,
      Supplier<RetryingHttpClient.Tracking<T>> tracking,
      BiFunction<Integer, Integer, HedgeRequest> ask) {
    int k;
    synchronized (lock) {
      if (firstDone || winner != null) {
        return;
      }
      k = sent;
    }
    retryd
        .decideHedgeAsync(ask.apply(k, k))
        .whenComplete(
            (decision, failed) -> {
              if (failed != null) {
                return; // an invalid request (a bug): no hedge
              }
              synchronized (lock) {
                lastDecision = decision;
                if (!decision.shouldRetry() || firstDone || winner != null) {
                  return; // denied (no copy, no more hedges), or no longer needed
                }
                launch(sent, request.apply(sent), tracking.get());
                sent++;
              }
              schedule(plan, request, tracking, ask);
            });
  }

  /** Sends hedge {@code index}; lock held. */
  private void launch(int index, HttpRequest copyRequest, RetryingHttpClient.Tracking<T> handler) {
    long start = System.nanoTime();
    CompletableFuture<HttpResponse<T>> future = http.sendAsync(copyRequest, handler);
    Copy<T> copy = new Copy<>(index, start, handler, future);
    hedges.add(copy);
    future.whenComplete((response, failed) -> hedgeEnded(copy, response, failed));
  }

  private void hedgeEnded(Copy<T> copy, HttpResponse<T> response, Throwable failed) {
    boolean succeeded = response != null && !options.retryStatuses.contains(response.statusCode());
    synchronized (lock) {
      if (copy.future.isCancelled() || (winner != null && winner != copy)) {
        if (response != null) {
          RetryingHttpClient.closeBody(response.body()); // a loser that answered anyway
        }
        return; // a loser: neither a failure nor an outcome
      }
      if (reporter != null) {
        reporter.recordOutcome(options.upstream, succeeded, true);
      }
      if (succeeded && !firstDone) {
        winner = copy;
        winnerResponse = response;
        abortFirst = true;
        caller.interrupt(); // aborts the first attempt's send (see the class comment)
        return;
      }
    }
    ended.add(copy); // for a caller whose own attempt failed
  }

  private static IOException unwrap(IOException failed) {
    // The JDK wraps the refusal of its own re-send; the refusal says what happened.
    return ResendRefusedException.in(failed).map(IOException.class::cast).orElse(failed);
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
