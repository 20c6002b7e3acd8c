//! Hedging a call's first attempt: whether and how a call is hedged (the
//! delay retryd served, or the local rule's fixed delay while retryd is
//! unreachable), and the runner both adapters send their first attempt
//! through.
//!
//! The runner keeps every copy of the call in the caller's own task: the
//! first attempt, the hedge timer, the hedge Decide in flight and the
//! hedges sent. Nothing is spawned, so a fast call costs one timer more
//! than an unhedged one and never asks retryd; a loser is cancelled by
//! dropping its future (reqwest and tonic then reset its stream or close
//! its connection: the upstream sees it go).
//!
//! It asks through the callbacks it is given; it decides nothing.
// Each adapter is a feature; with both off, the runner goes unused.
#![cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use retryd_engine::{Idempotencies, Idempotency};
use tokio::time::Instant;

use crate::client::{Client, Error};
use crate::decision::Decision;

/// The local rule's hedging of an upstream while retryd is unreachable
/// (`UpstreamFallback::hedging`; [`crate::FallbackPolicy::local_hedge_delay`]
/// sets it for every upstream). Off by default: with retryd away, a call is
/// hedged only when the caller configured a delay here.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalHedging {
    /// The fixed hedge delay: a call still running after it is hedged.
    pub delay: Duration,
    /// Hedges of one call, at most (default 1).
    pub max_hedges: u32,
    /// The share of first attempts the local rule may add as hedges
    /// (default 0.05, as retryd's `max_extra_load`): each first attempt
    /// earns this much of a hedge, up to [`LOCAL_HEDGE_BURST`] saved up.
    pub max_extra_load: f64,
    /// The idempotency levels hedged (default SAFE and IDEMPOTENT; never
    /// NON_IDEMPOTENT, whatever is set here).
    pub idempotency: Idempotencies,
}

/// The most hedges an upstream saves up locally: a burst of slow calls
/// after a quiet spell hedges at most this many (as the Go client).
pub const LOCAL_HEDGE_BURST: f64 = 10.0;

impl LocalHedging {
    /// Hedging after `delay`, with the defaults otherwise.
    pub fn after(delay: Duration) -> LocalHedging {
        LocalHedging {
            delay,
            max_hedges: 1,
            max_extra_load: 0.05,
            idempotency: Idempotencies::SAFE_AND_IDEMPOTENT,
        }
    }

    pub(crate) fn allows(&self, idempotency: Idempotency) -> bool {
        !self.delay.is_zero()
            && self.max_hedges > 0
            && idempotency != Idempotency::NonIdempotent
            && self.idempotency.contains(idempotency)
    }
}

/// How one call is hedged: after `delay`, up to `max` hedges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) delay: Duration,
    pub(crate) max: u32,
}

/// Whether and how a call to `upstream` of `idempotency` is hedged: as
/// retryd last served it (fresh: [`crate::TrafficReporter::hedging`]), or,
/// with nothing fresh served while retryd is unreachable, at the local
/// rule's fixed delay (none by default). A call of no declared idempotency
/// is NON_IDEMPOTENT and never hedged.
pub(crate) fn plan(client: &Client, upstream: &str, idempotency: Idempotency) -> Option<Plan> {
    if idempotency == Idempotency::NonIdempotent {
        return None;
    }
    if let Some(served) = client.reporter().served_plan(upstream, idempotency) {
        return served;
    }
    let local = client.inner.fallback.policy().of(upstream).hedging?;
    if !local.allows(idempotency) || !client.inner.outage.counts().unreachable {
        return None;
    }
    Some(Plan {
        delay: local.delay,
        max: local.max_hedges,
    })
}

/// A boxed future of the caller's task.
pub(crate) type Task<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a hedged first attempt ended: the copy whose result the call goes
/// on with (the winner, or the last failure when every copy failed: the
/// normal retry path decides it), the copies sent, the hedge decisions.
pub(crate) struct Hedged<R> {
    pub(crate) result: R,
    /// 0 for the first attempt, k for the k-th hedge.
    pub(crate) copy: u32,
    /// Copies sent, the first attempt included.
    pub(crate) sent: u32,
    pub(crate) decisions: Vec<Decision>,
}

/// What the runner is given by an adapter.
pub(crate) struct Copies<'a, R, S, D, E, C> {
    /// Sends the k-th hedge (k >= 1); `None` if it cannot be built.
    pub(crate) send: S,
    /// Asks for the k-th hedge with `sent` copies out: `decide(k, sent)`.
    pub(crate) decide: D,
    /// Whether a result ends the call (an answer, not a retryable failure).
    pub(crate) done: fn(&R) -> bool,
    /// Told of every copy that ended on its own (the winner included,
    /// a cancelled loser never): `ended(copy, result, elapsed)`.
    pub(crate) ended: E,
    /// Told the time the first attempt had run when a hedge won and it was
    /// cancelled (a lower bound of its latency: `latency_successes`).
    pub(crate) cancelled_first: C,
    pub(crate) marker: std::marker::PhantomData<&'a ()>,
}

/// Runs `first` and, each time `plan.delay` passes with no answer, asks
/// for a hedge and on RETRY sends it, up to `plan.max`. The first copy
/// whose answer ends the call wins and the others are dropped (cancelled);
/// a denied or failed Decide sends no copy and no further hedge (the first
/// attempt runs on). Once the first attempt has failed, no hedge is asked
/// for; those already out are awaited, and the first of them to answer
/// wins. No timer is armed that would fire at or past `deadline`, and no
/// Decide is asked once it has passed.
pub(crate) async fn run<'a, R, S, D, E, C>(
    plan: Plan,
    deadline: Option<Instant>,
    first: Task<'a, R>,
    mut copies: Copies<'a, R, S, D, E, C>,
) -> Hedged<R>
where
    R: Send + 'a,
    S: FnMut(u32) -> Option<Task<'a, R>>,
    D: FnMut(u32, u32) -> Task<'a, Result<Decision, Error>>,
    E: FnMut(u32, &R, Duration),
    C: FnOnce(Duration),
{
    let started = Instant::now();
    let fits = |at: Instant| deadline.is_none_or(|deadline| at < deadline);
    let arm = |from: Instant| {
        let at = from + plan.delay;
        (plan.max > 0 && fits(at)).then(|| Box::pin(tokio::time::sleep_until(at)))
    };
    let mut first = Some(first);
    let mut timer = arm(started);
    let mut deciding: Option<Task<'a, Result<Decision, Error>>> = None;
    let mut hedges: FuturesUnordered<Task<'a, (u32, Instant, R)>> = FuturesUnordered::new();
    let mut sent = 1u32;
    let mut decisions = Vec::new();
    let mut last: Option<(u32, R)> = None;
    let mut cancelled_first = Some(copies.cancelled_first);
    loop {
        if first.is_none() && hedges.is_empty() {
            // Every copy sent has failed: the last failure goes on.
            let (copy, result) = last.expect("a failed copy when all have ended");
            return Hedged {
                result,
                copy,
                sent,
                decisions,
            };
        }
        tokio::select! {
            result = async { first.as_mut().expect("guarded").await }, if first.is_some() => {
                first = None;
                (copies.ended)(0, &result, started.elapsed());
                if (copies.done)(&result) || hedges.is_empty() {
                    // Dropping the hedges (and a Decide in flight) cancels them.
                    return Hedged { result, copy: 0, sent, decisions };
                }
                // Failed with hedges out: no more hedges, wait for these.
                timer = None;
                deciding = None;
                last = Some((0, result));
            }
            () = async { timer.as_mut().expect("guarded").await }, if timer.is_some() => {
                timer = None;
                if fits(Instant::now()) {
                    deciding = Some((copies.decide)(sent, sent));
                }
            }
            decided = async { deciding.as_mut().expect("guarded").await }, if deciding.is_some() => {
                deciding = None;
                // An error (an invalid request, retryd away with no
                // fallback) sends no copy: the first attempt runs on.
                let Ok(decision) = decided else { continue };
                let granted = decision.should_retry();
                decisions.push(decision);
                if !granted {
                    continue;
                }
                if let Some(copy) = (copies.send)(sent) {
                    let index = sent;
                    let at = Instant::now();
                    hedges.push(Box::pin(async move { (index, at, copy.await) }));
                    sent += 1;
                    if sent - 1 < plan.max {
                        timer = arm(at);
                    }
                }
            }
            Some((copy, at, result)) = hedges.next(), if !hedges.is_empty() => {
                (copies.ended)(copy, &result, at.elapsed());
                if (copies.done)(&result) {
                    if first.is_some() {
                        if let Some(cancelled) = cancelled_first.take() {
                            cancelled(started.elapsed());
                        }
                    }
                    return Hedged { result, copy, sent, decisions };
                }
                if first.is_none() {
                    last = Some((copy, result));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The runner on tokio's paused clock: copies are timers standing for
    //! attempts, decisions are made up, so only the runner's own order is
    //! under test (the adapters' tests run it against real servers).
    use std::sync::{Arc, Mutex};

    use retryd_engine::{DenyReason, Evidence, Verdict};

    use super::*;
    use crate::decision::Source;

    fn decision(verdict: Verdict) -> Decision {
        Decision {
            verdict,
            rule: 10,
            effective_evidence: Evidence::SentNoResponse,
            evidence_adjusted: false,
            unknown_outcome: None,
            decision_id: String::new(),
            tokens_remaining: 1.0,
            explanation: String::new(),
            source: Source::Retryd,
            retryd: None,
        }
    }

    const GRANT: Verdict = Verdict::Retry {
        backoff: Duration::ZERO,
        refresh_credentials: false,
    };

    /// A copy's result: (copy, answered) after `after`.
    fn copy(index: u32, after: Duration, answered: bool) -> Task<'static, (u32, bool)> {
        Box::pin(async move {
            tokio::time::sleep(after).await;
            (index, answered)
        })
    }

    struct Seen {
        asked: Vec<(u32, u32, Instant)>,
        ended: Vec<u32>,
        cancelled_first: Option<Duration>,
    }

    /// Runs a first attempt taking `first`, hedges taking `hedges[k - 1]`,
    /// each Decide answered `verdict`.
    async fn run_with(
        plan: Plan,
        deadline: Option<Instant>,
        first: (Duration, bool),
        hedges: Vec<(Duration, bool)>,
        verdict: Verdict,
    ) -> (Hedged<(u32, bool)>, Seen) {
        let seen = Arc::new(Mutex::new(Seen {
            asked: Vec::new(),
            ended: Vec::new(),
            cancelled_first: None,
        }));
        let (asked, ended, cancelled) = (seen.clone(), seen.clone(), seen.clone());
        let hedged = run(
            plan,
            deadline,
            copy(0, first.0, first.1),
            Copies {
                send: |k: u32| {
                    let (after, answered) = hedges[k as usize - 1];
                    Some(copy(k, after, answered))
                },
                decide: move |k, sent| {
                    asked.lock().unwrap().asked.push((k, sent, Instant::now()));
                    Box::pin(async move { Ok(decision(verdict)) }) as Task<'_, _>
                },
                done: |result: &(u32, bool)| result.1,
                ended: move |copy, _: &(u32, bool), _| ended.lock().unwrap().ended.push(copy),
                cancelled_first: move |ran| cancelled.lock().unwrap().cancelled_first = Some(ran),
                marker: std::marker::PhantomData,
            },
        )
        .await;
        let seen = Arc::try_unwrap(seen)
            .ok()
            .expect("one owner")
            .into_inner()
            .unwrap();
        (hedged, seen)
    }

    const MS: Duration = Duration::from_millis(1);

    fn plan(max: u32) -> Plan {
        Plan {
            delay: 10 * MS,
            max,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_first_attempt_asks_nothing() {
        let (hedged, seen) = run_with(plan(1), None, (5 * MS, true), vec![], GRANT).await;
        assert_eq!((hedged.copy, hedged.sent), (0, 1));
        assert!(seen.asked.is_empty());
        assert_eq!(seen.ended, [0]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_first_attempt_is_hedged_after_the_delay_and_the_hedge_wins() {
        let started = Instant::now();
        let (hedged, seen) = run_with(
            plan(1),
            None,
            (1000 * MS, true),
            vec![(5 * MS, true)],
            GRANT,
        )
        .await;
        assert_eq!((hedged.copy, hedged.sent), (1, 2));
        assert_eq!(seen.asked.len(), 1);
        assert_eq!((seen.asked[0].0, seen.asked[0].1), (1, 1));
        assert_eq!(seen.asked[0].2, started + 10 * MS);
        // The first attempt was cancelled: not ended, its 15 ms reported.
        assert_eq!(seen.ended, [1]);
        assert_eq!(seen.cancelled_first, Some(15 * MS));
        assert_eq!(started.elapsed(), 15 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn hedges_go_out_one_delay_apart_up_to_the_maximum() {
        let slow = (1000 * MS, true);
        let (hedged, seen) = run_with(plan(2), None, slow, vec![slow, (5 * MS, true)], GRANT).await;
        assert_eq!((hedged.copy, hedged.sent), (2, 3));
        let asked: Vec<_> = seen.asked.iter().map(|(k, sent, _)| (*k, *sent)).collect();
        assert_eq!(asked, [(1, 1), (2, 2)]);
        assert_eq!(seen.asked[1].2 - seen.asked[0].2, 10 * MS);
        // No third hedge with max 2, however slow the rest is.
        let (_, seen) = run_with(plan(2), None, (100 * MS, true), vec![slow, slow], GRANT).await;
        assert_eq!(seen.asked.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_denied_hedge_sends_no_copy_and_no_more_are_asked() {
        let started = Instant::now();
        let deny = Verdict::Deny(DenyReason::HedgeCap);
        let (hedged, seen) = run_with(plan(3), None, (100 * MS, true), vec![], deny).await;
        assert_eq!((hedged.copy, hedged.sent), (0, 1));
        assert_eq!(hedged.decisions.len(), 1);
        assert_eq!(seen.asked.len(), 1);
        assert_eq!(started.elapsed(), 100 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_first_attempt_waits_for_the_hedge_out_and_asks_no_more() {
        // The first fails at 12 ms, the hedge (sent at 10) answers at 40.
        let (hedged, seen) = run_with(
            plan(3),
            None,
            (12 * MS, false),
            vec![(30 * MS, true)],
            GRANT,
        )
        .await;
        assert_eq!((hedged.copy, hedged.result.1), (1, true));
        assert_eq!(seen.asked.len(), 1);
        assert_eq!(seen.ended, [0, 1]);
        assert_eq!(seen.cancelled_first, None, "it ended on its own");
        // Both fail: the last failure goes to the retry path.
        let (hedged, _) = run_with(
            plan(1),
            None,
            (12 * MS, false),
            vec![(30 * MS, false)],
            GRANT,
        )
        .await;
        assert_eq!((hedged.copy, hedged.result.1, hedged.sent), (1, false, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn no_timer_fires_past_the_deadline() {
        let deadline = Some(Instant::now() + 10 * MS);
        let (hedged, seen) = run_with(plan(1), deadline, (50 * MS, false), vec![], GRANT).await;
        assert_eq!(hedged.sent, 1);
        assert!(seen.asked.is_empty());
    }
}
