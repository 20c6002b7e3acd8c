package dev.retryd.client;

import io.grpc.ClientCall;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import retryd.v1.Retryd.Body;
import retryd.v1.Retryd.BodyKind;

/**
 * The hedged first attempt of a {@link RetryingCall} (issue 33). The first
 * attempt goes out with a timer of the plan's delay; if it fires with the copies
 * still running, retryd is asked for a hedge ({@link RetrydClient#decideHedgeAsync}, off the
 * caller's thread), and on RETRY one more copy goes out, up to the plan's
 * maximum; a denial (or no answer) stops the hedging, the copies running go on.
 * Each copy is an attempt of the call (its number, its lineage entry, its
 * outcome recorded as the call's attempts are).
 *
 * <p>The first copy that ends with a code outside {@link
 * RetrydClientInterceptor#FAILURE_CODES} wins: the others are marked lost
 * (recorded nowhere) and cancelled, the first attempt's time counted as a
 * success latency if it was among them, and the call counted as a hedge won if
 * the winner is a hedge. A copy that fails while others run is dropped; the last
 * one to end, failed, goes on to the call's normal retry path. Either way the
 * round is over and the call goes on unhedged.
 *
 * <p>State is guarded by the call's lock, as the call's own: a copy's start,
 * the call's cancel and a copy's end race on the same fields.
 */
final class HedgedRound<Q, R> {
  private final RetryingCall<Q, R> call;
  // Guarded by call.lock. The plan is null once the round is over.
  private Hedging.Plan plan;
  private final List<ClientCall<Q, R>> copies = new ArrayList<>();
  private final List<RetryingCall<Q, R>.AttemptListener> copyListeners = new ArrayList<>();
  private int copiesRunning;
  private ScheduledFuture<?> hedgeTimer;

  HedgedRound(RetryingCall<Q, R> call, Hedging.Plan plan) {
    this.call = call;
    this.plan = plan;
  }

  /** Sends the first attempt and starts the hedge timer. */
  void start() {
    startCopy();
    scheduleHedge();
  }

  /** The copies, while the round runs (the call's cancel cancels them all); call.lock held. */
  List<ClientCall<Q, R>> copies() {
    return plan != null ? new ArrayList<>(copies) : List.of();
  }

  /** Sends one more copy of the hedged first attempt (the first attempt itself first). */
  private void startCopy() {
    int number;
    synchronized (call.lock) {
      if (call.done || plan == null) {
        return;
      }
      number = ++call.attempt;
    }
    AttemptTrace trace = new AttemptTrace(Lineage.outbound(call.inboundLineage, call.retryd.layer(), number));
    ClientCall<Q, R> copy = call.next.newCall(call.method, call.options.withStreamTracerFactory(trace));
    RetryingCall<Q, R>.AttemptListener copyListener = call.new AttemptListener(trace, number, this);
    synchronized (call.lock) {
      copies.add(copy);
      copyListeners.add(copyListener);
      copiesRunning++;
      call.current = copy;
    }
    call.send(copy, copyListener);
  }

  private void scheduleHedge() {
    synchronized (call.lock) {
      if (call.done || plan == null || call.attempt - 1 >= plan.max) {
        return;
      }
      try {
        hedgeTimer = call.timer.schedule(() -> call.context.run(this::askHedge), plan.delay.toNanos(), TimeUnit.NANOSECONDS);
      } catch (java.util.concurrent.RejectedExecutionException closed) {
        hedgeTimer = null;
      }
    }
  }

  /** The hedge delay passed with the copies still running: ask retryd for the next hedge. */
  private void askHedge() {
    int sent;
    synchronized (call.lock) {
      if (call.done || plan == null) {
        return;
      }
      sent = call.attempt;
    }
    HedgeRequest ask =
        HedgeRequest.builder(call.upstream, call.declared, sent)
            .operation(call.method.getFullMethodName())
            .body(Body.newBuilder().setKind(BodyKind.BODY_KIND_ENCODED_VALUE).build())
            .attempt(sent)
            .maxAttempts(call.maxAttempts)
            .lineage(call.inboundLineage)
            .deadlineRemaining(call.remaining())
            .build();
    call.retryd
        .decideHedgeAsync(ask)
        .whenComplete(
            (decision, error) -> {
              // Denied (or no answer): no copy, and no more hedges.
              if (error == null && decision.shouldRetry()) {
                call.context.run(this::startCopy);
                scheduleHedge();
              }
            });
  }

  /**
   * A copy ended: {@code succeeded} when its code is outside FAILURE_CODES,
   * {@code byCaller} when the caller cancelled the call (which ends it too).
   * Returns true when the call goes on as unhedged from here (this copy won, or
   * it was the last one running), false when this result is dropped (a loser, or
   * a failure while other copies run).
   */
  boolean copyEnded(RetryingCall<Q, R>.AttemptListener ended, boolean byCaller, boolean succeeded) {
    boolean wins = byCaller || succeeded;
    List<ClientCall<Q, R>> losers = new ArrayList<>();
    RetryingCall<Q, R>.AttemptListener first = null;
    synchronized (call.lock) {
      if (plan == null || ended.lost) {
        return false;
      }
      copiesRunning--;
      if (!wins && copiesRunning > 0) {
        return false;
      }
      plan = null; // the hedged phase is over
      call.hedgedRoundOver();
      if (hedgeTimer != null) {
        hedgeTimer.cancel(false);
        hedgeTimer = null;
      }
      for (int i = 0; i < copies.size(); i++) {
        RetryingCall<Q, R>.AttemptListener other = copyListeners.get(i);
        if (other != ended && !other.closed) {
          other.lost = true;
          losers.add(copies.get(i));
          if (other.number == 1) {
            first = other;
          }
        }
      }
      call.current = copies.get(copyListeners.indexOf(ended));
    }
    TrafficReporter reporter = call.reporter;
    if (first != null && reporter != null && !call.cancelledByCaller) {
      // The first attempt ran this long and was still running: a lower bound
      // of its latency, counted so that the tail hedging is for stays seen.
      reporter.recordLatency(call.upstream, true, System.nanoTime() - first.startNanos);
    }
    if (succeeded && !byCaller && ended.number > 1 && reporter != null) {
      // The call's answer came from a hedge: only this client knows it
      // (UpstreamTraffic.hedges_won); a call its first attempt answered is not counted.
      reporter.recordHedgeWon(call.upstream);
    }
    for (ClientCall<Q, R> loser : losers) {
      loser.cancel("a hedge of this call answered first", null);
    }
    return true;
  }
}
