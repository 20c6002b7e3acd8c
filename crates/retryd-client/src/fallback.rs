//! The local fallback: decisions made in this process when retryd does not
//! answer, and the rule a shadow answer is followed by.
//!
//! It decides with `retryd_engine::decide` itself, the function retryd
//! calls, on a [`Policy`] per upstream and a local token bucket per
//! upstream; nothing here re-states a rule. What the fallback cannot know
//! is what retryd knows: the fleet's shared budget and the operators'
//! policies. So its defaults ([`FallbackPolicy::default`]) are stricter
//! than retryd's (two attempts, a small local bucket), and a caller that
//! mirrors retryd's configuration ([`FallbackPolicy::upstream`]) gets the
//! same answers retryd gives (the conformance test shows it on every
//! vector).
//!
//! It must not import the server, and it does no I/O: the clock is tokio's
//! (so a paused test clock drives the refill) and the jitter draw is
//! `rand`'s.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use retryd_engine::{
    Backoff, BudgetView, DenyReason, Facts, HedgeFacts, HedgePolicy, HedgeState, Jitter, Lineage,
    Policy, Verdict,
};
use retryd_proto as pb;
use tokio::time::Instant;

use crate::decision::{Decision, Source};
use crate::hedge::{LOCAL_HEDGE_BURST, LocalHedging};
use crate::request::{self, InvalidRequest};

/// A local token bucket's configuration, as retryd's `budget` section
/// (`capacity`, `initial`, `ratio`, `min_per_second`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalBudget {
    /// The most tokens the bucket holds.
    pub capacity: f64,
    /// Tokens when the bucket is first used.
    pub initial: f64,
    /// Tokens deposited per first attempt recorded ([`crate::TrafficReporter`]
    /// records them here too).
    pub ratio: f64,
    /// Tokens added per second whatever the traffic.
    pub min_per_second: f64,
}

impl Default for LocalBudget {
    /// Ten tokens, a tenth of a token per first attempt, one a second: a
    /// process retries at most 10% more than it sends, plus one a second.
    fn default() -> Self {
        LocalBudget {
            capacity: 10.0,
            initial: 10.0,
            ratio: 0.1,
            min_per_second: 1.0,
        }
    }
}

/// The policy and the local budget of one upstream.
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamFallback {
    /// The engine's policy.
    pub policy: Policy,
    /// The local bucket.
    pub budget: LocalBudget,
    /// The local rule's hedging while retryd is unreachable; `None` (the
    /// default): no hedge without retryd.
    pub hedging: Option<LocalHedging>,
}

impl Default for UpstreamFallback {
    /// Stricter than retryd's defaults: two attempts in all (one retry),
    /// backoff 100 ms to 2 s with full jitter, Retry-After or pushback at
    /// most 30 s, a 50 ms minimum attempt budget, 500 not transient, the
    /// default gRPC codes.
    fn default() -> Self {
        UpstreamFallback {
            policy: Policy {
                max_attempts: 2,
                min_attempt_budget: Duration::from_millis(50),
                max_retry_after: Duration::from_secs(30),
                backoff: Backoff {
                    base: Duration::from_millis(100),
                    max: Duration::from_secs(2),
                    jitter: Jitter::Full,
                },
                ..Policy::default()
            },
            budget: LocalBudget::default(),
            hedging: None,
        }
    }
}

/// What the fallback applies: a default and per-upstream overrides.
///
/// Mirroring retryd's configuration for an upstream gives retryd's answers
/// while retryd is away:
///
/// ```
/// use retryd_client::{Fallback, FallbackPolicy, LocalBudget, Source, UpstreamFallback, pb};
/// use retryd_client::engine::{DenyReason, Policy};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // retryd's `[upstreams."search"] max_attempts = 5`, its defaults otherwise.
/// let search = UpstreamFallback {
///     policy: Policy { max_attempts: 5, ..Policy::default() },
///     budget: LocalBudget { capacity: 100.0, initial: 100.0, ..LocalBudget::default() },
///     hedging: None,
/// };
/// let fallback = Fallback::new(FallbackPolicy::default().upstream("search", search));
/// let third = pb::DecideRequest {
///     upstream: "search".into(),
///     idempotency: pb::Idempotency::Safe as i32,
///     attempt: 3,
///     http_status: 503,
///     ..Default::default()
/// };
/// assert!(fallback.decide(&third, "example", Source::Fallback).unwrap().should_retry());
/// // Any other upstream gets the stricter default: two attempts in all.
/// let other = pb::DecideRequest { upstream: "ledger".into(), ..third };
/// let decision = fallback.decide(&other, "example", Source::Fallback).unwrap();
/// assert_eq!(decision.deny_reason(), Some(DenyReason::MaxAttempts));
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FallbackPolicy {
    /// For any upstream not named.
    pub default: UpstreamFallback,
    /// By upstream name.
    pub upstreams: HashMap<String, UpstreamFallback>,
    /// Upstreams whose retries are switched off locally (as retryd's
    /// `SetRetriesEnabled(false)`: DENY RETRIES_DISABLED).
    pub disabled: HashSet<String>,
}

impl FallbackPolicy {
    /// The same policy with `upstream` decided by `fallback`.
    pub fn upstream(mut self, upstream: impl Into<String>, fallback: UpstreamFallback) -> Self {
        self.upstreams.insert(upstream.into(), fallback);
        self
    }

    /// The same policy hedging every upstream not named after a fixed
    /// `delay` while retryd is unreachable ([`LocalHedging::after`]: one
    /// hedge, at most 5% more load, SAFE and IDEMPOTENT calls), as the Go
    /// client's `LocalPolicy.HedgeDelay`. Upstreams named with
    /// [`FallbackPolicy::upstream`] set their own `hedging`.
    pub fn local_hedge_delay(mut self, delay: Duration) -> Self {
        self.default.hedging = Some(LocalHedging::after(delay));
        self
    }

    pub(crate) fn of(&self, upstream: &str) -> &UpstreamFallback {
        self.upstreams.get(upstream).unwrap_or(&self.default)
    }
}

/// Most upstreams with a local bucket; a decision for one more is made on
/// an empty bucket (DENY BUDGET_EXHAUSTED), so that a caller naming
/// unbounded upstreams cannot grow this process without bound.
pub const MAX_LOCAL_UPSTREAMS: usize = 10_000;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
    /// The local hedge allowance: earned by first attempts, spent by hedges.
    hedges: f64,
}

impl Bucket {
    fn refill(&mut self, budget: &LocalBudget, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * budget.min_per_second).min(budget.capacity);
        self.refilled = now;
    }
}

/// The local fallback: [`Fallback::decide`] answers as the engine does on
/// the local policy and bucket. Safe for concurrent use.
#[derive(Debug)]
pub struct Fallback {
    policy: FallbackPolicy,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Default for Fallback {
    fn default() -> Self {
        Fallback::new(FallbackPolicy::default())
    }
}

impl Fallback {
    /// A fallback applying `policy`.
    pub fn new(policy: FallbackPolicy) -> Fallback {
        Fallback {
            policy,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// What it applies.
    pub fn policy(&self) -> &FallbackPolicy {
        &self.policy
    }

    /// Decides `request` locally; `reason` starts the explanation ("retryd
    /// unreachable (Unavailable)"). An invalid request is refused as retryd
    /// would refuse it. A RETRY withdraws a token from the local bucket in
    /// the same step as the look, as retryd's store call does.
    pub fn decide(
        &self,
        request: &pb::DecideRequest,
        reason: &str,
        source: Source,
    ) -> Result<Decision, InvalidRequest> {
        let attempt = request::attempt(request)?;
        if attempt.hedge > 0 {
            return Ok(self.decide_hedge(&attempt, &request.upstream, reason, source));
        }
        let fallback = self.policy.of(&request.upstream);
        let retries_enabled = !self.policy.disabled.contains(&request.upstream);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let bucket = bucket(&mut buckets, &request.upstream, &fallback.budget, now);
        let tokens = bucket.as_ref().map_or(0.0, |bucket| bucket.tokens);
        let facts = facts(
            &attempt,
            BudgetView {
                tokens,
                retries_enabled,
                unavailable: false,
            },
            rand::random::<f64>(),
        );
        let decision = retryd_engine::decide(&facts, &fallback.policy);
        let mut remaining = tokens;
        if matches!(decision.verdict, Verdict::Retry { .. }) {
            if let Some(bucket) = bucket {
                bucket.tokens -= 1.0;
                remaining = bucket.tokens;
            }
        }
        drop(buckets);
        let explanation = format!("{reason}; local rule: {}", decision.explanation());
        Ok(Decision {
            verdict: decision.verdict,
            rule: decision.rule.number(),
            effective_evidence: decision.effective_evidence,
            evidence_adjusted: decision.evidence_adjusted,
            unknown_outcome: decision.unknown_outcome,
            decision_id: String::new(),
            tokens_remaining: remaining,
            explanation,
            source,
            retryd: None,
        })
    }

    /// Deposits `requests` first attempts into `upstream`'s local bucket.
    pub fn record_traffic(&self, upstream: &str, requests: u64) {
        let fallback = self.policy.of(upstream);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = bucket(&mut buckets, upstream, &fallback.budget, Instant::now()) {
            bucket.tokens = (bucket.tokens + requests as f64 * fallback.budget.ratio)
                .min(fallback.budget.capacity);
            if let Some(hedging) = &fallback.hedging {
                bucket.hedges = (bucket.hedges + requests as f64 * hedging.max_extra_load.max(0.0))
                    .min(LOCAL_HEDGE_BURST);
            }
        }
    }

    /// The local rule for a hedge: the engine's hedge rule
    /// (`retryd_engine::decide_hedge`, the function retryd calls) on the
    /// local hedging as the policy, the local hedge allowance as the cap and
    /// the local bucket as the budget. A RETRY spends one of each.
    fn decide_hedge(
        &self,
        attempt: &request::Attempt,
        upstream: &str,
        reason: &str,
        source: Source,
    ) -> Decision {
        let fallback = self.policy.of(upstream);
        let retries_enabled = !self.policy.disabled.contains(upstream);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let bucket = bucket(&mut buckets, upstream, &fallback.budget, Instant::now());
        let (tokens, allowance) = bucket
            .as_ref()
            .map_or((0.0, 0.0), |bucket| (bucket.tokens, bucket.hedges));
        // The local hedging stands for the fleet's view: always learned, never
        // uniformly slow (a fixed delay knows no latencies), and the cap is
        // the allowance (a hedge left: under the cap; none: at it).
        let policy = fallback.hedging.map(|local| HedgePolicy {
            max_hedges: local.max_hedges,
            max_extra_load: 1.0,
            idempotency: local.idempotency,
            min_samples: 1,
            uniform_ratio: 1.0,
            ..HedgePolicy::default()
        });
        let delay = fallback.hedging.map_or(Duration::ZERO, |local| local.delay);
        let state = HedgeState {
            samples: 1,
            p50: Duration::ZERO,
            delay,
            tail: delay.max(Duration::from_nanos(1)),
            first_attempts: 1,
            hedges: u64::from(allowance < 1.0),
            // No recent latencies: the local rule has no fleet to watch.
            recent: Default::default(),
        };
        let facts = HedgeFacts {
            hedge: attempt.hedge,
            idempotency: attempt.idempotency,
            deadline_remaining: attempt.deadline_remaining,
            min_attempt_budget: fallback.policy.min_attempt_budget,
            budget: BudgetView {
                tokens,
                retries_enabled,
                unavailable: false,
            },
        };
        let decision = retryd_engine::decide_hedge(&facts, policy.as_ref(), &state);
        let mut remaining = tokens;
        if matches!(decision.verdict, Verdict::Retry { .. }) {
            if let Some(bucket) = bucket {
                bucket.tokens -= 1.0;
                bucket.hedges -= 1.0;
                remaining = bucket.tokens;
            }
        }
        drop(buckets);
        let why = match decision.verdict {
            Verdict::Retry { .. } => format!("hedge {} now, at the local delay", attempt.hedge),
            Verdict::Deny(DenyReason::HedgingOff) if policy.is_none() => {
                "no local hedging (UpstreamFallback::hedging is None)".to_owned()
            }
            Verdict::Deny(DenyReason::HedgeCap) => "the local hedge allowance is spent".to_owned(),
            Verdict::Deny(reason) => format!("hedge denied: {}", reason.as_str()),
            Verdict::Ambiguous => "ambiguous".to_owned(),
        };
        Decision {
            verdict: decision.verdict,
            rule: decision.rule.number(),
            effective_evidence: decision.effective_evidence,
            evidence_adjusted: false,
            unknown_outcome: None,
            decision_id: String::new(),
            tokens_remaining: remaining,
            explanation: format!("{reason}; local rule: {why}"),
            source,
            retryd: None,
        }
    }

    /// Tokens in `upstream`'s local bucket now.
    pub fn tokens(&self, upstream: &str) -> f64 {
        let fallback = self.policy.of(upstream);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        bucket(&mut buckets, upstream, &fallback.budget, Instant::now())
            .map_or(0.0, |bucket| bucket.tokens)
    }
}

/// The refilled bucket of `upstream`, created on first use; `None` once
/// [`MAX_LOCAL_UPSTREAMS`] buckets exist.
fn bucket<'a>(
    buckets: &'a mut HashMap<String, Bucket>,
    upstream: &str,
    budget: &LocalBudget,
    now: Instant,
) -> Option<&'a mut Bucket> {
    if !buckets.contains_key(upstream) {
        if buckets.len() >= MAX_LOCAL_UPSTREAMS {
            return None;
        }
        buckets.insert(
            upstream.to_owned(),
            Bucket {
                tokens: budget.initial.min(budget.capacity),
                refilled: now,
                hedges: 0.0,
            },
        );
    }
    let bucket = buckets.get_mut(upstream)?;
    bucket.refill(budget, now);
    Some(bucket)
}

/// The engine's facts for `attempt`.
pub(crate) fn facts(attempt: &request::Attempt, budget: BudgetView, jitter: f64) -> Facts<'_> {
    Facts {
        idempotency: attempt.idempotency,
        body: &attempt.body,
        attempt: attempt.attempt,
        claimed_evidence: attempt.claimed_evidence,
        failure: attempt.failure,
        http_status: attempt.http_status,
        retry_after: attempt.retry_after.as_deref(),
        grpc_status: attempt.grpc_status,
        grpc_pushback: attempt.grpc_pushback.as_deref(),
        deadline_remaining: attempt.deadline_remaining,
        first_byte_delivered: attempt.first_byte_delivered,
        runtime_draining: attempt.runtime_draining,
        auth_refresh_attempted: attempt.auth_refresh_attempted,
        previous_backoff: attempt.previous_backoff,
        max_attempts: attempt.max_attempts,
        // Validated when the attempt was read.
        lineage: Lineage::parse(&attempt.lineage).unwrap_or(Lineage::EDGE),
        retried_below: attempt.retried_below.as_deref(),
        budget,
        now: SystemTime::now(),
        jitter,
    }
}

/// The decision for an attempt that the caller's own deadline or
/// cancellation ended after it may have been sent: made here, since there
/// is no time left to ask retryd and nothing left to retry. `Some` only for
/// a call of unknown outcome (the engine's mark, computed by the engine on
/// the same facts), which the adapters surface as ambiguous; `None` for a
/// plain failure.
// Used by the adapters only, each a feature.
#[cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]
pub(crate) fn ended_by_caller(request: &pb::DecideRequest, expired: bool) -> Option<Decision> {
    let mut attempt = request::attempt(request).ok()?;
    // No deadline left: rule 6 (or an earlier rule) denies, and the engine
    // computes the mark from the facts whichever rule did.
    attempt.deadline_remaining = Some(Duration::ZERO);
    let facts = facts(&attempt, BudgetView::OPEN, 0.0);
    let decision = retryd_engine::decide(&facts, &Policy::default());
    let mark = decision.unknown_outcome?;
    // A cancellation is denied as a deadline too: both mean the caller has
    // no time left for this call.
    let why = if expired {
        "the caller's deadline expired"
    } else {
        "the caller cancelled the call"
    };
    Some(Decision {
        verdict: Verdict::Deny(retryd_engine::DenyReason::Deadline),
        rule: 6,
        effective_evidence: decision.effective_evidence,
        evidence_adjusted: decision.evidence_adjusted,
        unknown_outcome: Some(mark),
        decision_id: String::new(),
        tokens_remaining: f64::NAN,
        explanation: format!("{why} after the request may have been sent; not asked"),
        source: Source::EndedByCaller,
        retryd: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(upstream: &str) -> pb::DecideRequest {
        pb::DecideRequest {
            upstream: upstream.into(),
            idempotency: pb::Idempotency::Idempotent as i32,
            attempt: 1,
            failure: pb::FailureKind::Connect as i32,
            ..Default::default()
        }
    }

    fn one_token() -> FallbackPolicy {
        FallbackPolicy::default().upstream(
            "small",
            UpstreamFallback {
                budget: LocalBudget {
                    capacity: 1.0,
                    initial: 1.0,
                    ratio: 0.5,
                    min_per_second: 1.0,
                },
                ..UpstreamFallback::default()
            },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_spends_a_local_token_and_time_refills_it() {
        let fallback = Fallback::new(one_token());
        let decide = || {
            fallback
                .decide(&refused("small"), "test", Source::Fallback)
                .expect("valid")
        };
        assert!(decide().should_retry());
        assert_eq!(fallback.tokens("small"), 0.0);
        assert_eq!(decide().deny_reason(), Some(DenyReason::BudgetExhausted));
        // A denial spends nothing; a second refills one token.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(decide().deny_reason(), Some(DenyReason::BudgetExhausted));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(decide().should_retry());
    }

    #[tokio::test(start_paused = true)]
    async fn first_attempts_fill_the_local_bucket_up_to_its_capacity() {
        let fallback = Fallback::new(one_token());
        assert!(
            fallback
                .decide(&refused("small"), "test", Source::Fallback)
                .expect("valid")
                .should_retry()
        );
        fallback.record_traffic("small", 1);
        assert_eq!(fallback.tokens("small"), 0.5);
        fallback.record_traffic("small", 10);
        assert_eq!(fallback.tokens("small"), 1.0, "capped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_locally_disabled_upstream_is_denied_retries_disabled() {
        let mut policy = FallbackPolicy::default();
        policy.disabled.insert("off".into());
        let decision = Fallback::new(policy)
            .decide(&refused("off"), "test", Source::Fallback)
            .expect("valid");
        assert_eq!(decision.deny_reason(), Some(DenyReason::RetriesDisabled));
        assert_eq!(decision.rule, 5);
    }

    #[test]
    fn the_caller_ending_a_possibly_sent_charge_is_of_unknown_outcome() {
        let charge = pb::DecideRequest {
            upstream: "payments".into(),
            idempotency: pb::Idempotency::NonIdempotent as i32,
            attempt: 1,
            failure: pb::FailureKind::ResponseHeaderTimeout as i32,
            ..Default::default()
        };
        let decision = ended_by_caller(&charge, true).expect("unknown outcome");
        assert_eq!(decision.deny_reason(), Some(DenyReason::Deadline));
        assert_eq!(
            decision.unknown_outcome,
            Some(retryd_engine::UnknownOutcome::Reconcile)
        );
        // Proven not sent, or safe to repeat: a plain failure.
        let not_sent = pb::DecideRequest {
            failure: pb::FailureKind::Connect as i32,
            ..charge.clone()
        };
        assert!(ended_by_caller(&not_sent, true).is_none());
        let safe = pb::DecideRequest {
            idempotency: pb::Idempotency::Safe as i32,
            ..charge
        };
        assert!(ended_by_caller(&safe, true).is_none());
    }

    fn hedge(upstream: &str, k: u32) -> pb::DecideRequest {
        pb::DecideRequest {
            upstream: upstream.into(),
            idempotency: pb::Idempotency::Safe as i32,
            attempt: k,
            hedge: k,
            ..Default::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_local_rule_hedges_only_with_a_delay_set_and_within_its_allowance() {
        let decide = |fallback: &Fallback, request: &pb::DecideRequest| {
            fallback
                .decide(request, "test", Source::Fallback)
                .expect("valid")
        };
        // Off by default.
        let off = Fallback::default();
        off.record_traffic("api", 100);
        assert_eq!(
            decide(&off, &hedge("api", 1)).deny_reason(),
            Some(DenyReason::HedgingOff)
        );
        // A large bucket, so that the allowance is what runs out.
        let fallback = Fallback::new(FallbackPolicy::default().upstream(
            "api",
            UpstreamFallback {
                budget: LocalBudget {
                    capacity: 1000.0,
                    initial: 1000.0,
                    ..LocalBudget::default()
                },
                hedging: Some(LocalHedging::after(Duration::from_millis(20))),
                ..UpstreamFallback::default()
            },
        ));
        // Nothing earned yet: at the cap.
        assert_eq!(
            decide(&fallback, &hedge("api", 1)).deny_reason(),
            Some(DenyReason::HedgeCap)
        );
        // 5% of 30 first attempts: one hedge (and a half).
        fallback.record_traffic("api", 30);
        let before = fallback.tokens("api");
        let granted = decide(&fallback, &hedge("api", 1));
        assert_eq!(granted.backoff(), Duration::ZERO);
        assert!(granted.should_retry(), "{granted:?}");
        assert_eq!(granted.rule, 10);
        assert_eq!(
            fallback.tokens("api"),
            before - 1.0,
            "one retry token spent"
        );
        assert_eq!(
            decide(&fallback, &hedge("api", 1)).deny_reason(),
            Some(DenyReason::HedgeCap)
        );
        fallback.record_traffic("api", 1000);
        // Never NON_IDEMPOTENT; never past max_hedges (1); never without
        // room before the deadline.
        let charge = pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            ..hedge("api", 1)
        };
        assert_eq!(
            decide(&fallback, &charge).deny_reason(),
            Some(DenyReason::HedgingOff)
        );
        assert_eq!(
            decide(&fallback, &hedge("api", 2)).deny_reason(),
            Some(DenyReason::HedgingOff)
        );
        let late = pb::DecideRequest {
            deadline_remaining: Some(crate::pb_duration(Duration::from_millis(10))),
            ..hedge("api", 1)
        };
        assert_eq!(
            decide(&fallback, &late).deny_reason(),
            Some(DenyReason::Deadline)
        );
        assert!(decide(&fallback, &hedge("api", 1)).should_retry());
        // The allowance saves up at most LOCAL_HEDGE_BURST.
        let granted = (0..50)
            .filter(|_| decide(&fallback, &hedge("api", 1)).should_retry())
            .count();
        assert_eq!(granted as f64, LOCAL_HEDGE_BURST - 1.0);
    }

    #[test]
    fn a_hedge_reporting_a_failure_is_refused_naming_the_field() {
        let fallback = Fallback::default();
        let mixed = pb::DecideRequest {
            http_status: 503,
            ..hedge("api", 1)
        };
        let refused = fallback
            .decide(&mixed, "test", Source::Fallback)
            .expect_err("a hedge reports no failure");
        assert_eq!(refused.field, "http_status");
    }
}
