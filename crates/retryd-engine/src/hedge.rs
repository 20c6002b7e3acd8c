//! The hedge rule: may a caller send the k-th copy of a call whose first
//! attempt is still running past the hedge delay? Facts in, decision out;
//! the fleet's view of the upstream (its quantiles and the hedges already
//! granted over the window) is an input like the budget view.
//!
//! The order: the kill switch, the policy (none, the idempotency, the
//! number of hedges), the deadline, the fleet's latency (too few samples,
//! uniformly slow, over the window or its recent part), the cap on extra
//! load, then the shared retry budget. A hedge is never AMBIGUOUS: nothing
//! has failed and nothing is in doubt.
//!
//! About 560 lines, half of them the rule's table tests: the policy, the
//! fleet's state and the rule are one reading.

use std::time::Duration;

use super::{BudgetView, Decision, DenyReason, Evidence, Idempotency, Rule, Verdict};

/// An upstream's hedging policy (`[upstreams."name".hedging]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgePolicy {
    /// The latency quantile a first attempt must run past before a hedge
    /// (0 < q < 1).
    pub quantile: f64,
    /// Hedges of one call, at most (1 to 4).
    pub max_hedges: u32,
    /// Hedges granted over the window, at most this share of the first
    /// attempts reported over it (0 < x ≤ 1).
    pub max_extra_load: f64,
    /// The idempotency levels that may be hedged (never NON_IDEMPOTENT).
    pub idempotency: Idempotencies,
    /// The sliding window the quantiles and the cap are taken over.
    pub window: Duration,
    /// First-attempt latencies needed over the window before any hedge.
    pub min_samples: u64,
    /// The upstream is uniformly slow when its p50 is at least this share
    /// of its tail quantile (see [`HedgePolicy::tail_quantile`]).
    pub uniform_ratio: f64,
}

impl HedgePolicy {
    /// The quantile the p50 is compared with to find an upstream uniformly
    /// slow: the hedging quantile, or p99 when that is lower. A tight body
    /// with a sparse tail (2% of calls a second late) has its p95 near its
    /// p50, yet is exactly what hedging is for; what a copy cannot beat is
    /// a distribution without a tail, where even the p99 is near the p50.
    pub fn tail_quantile(&self) -> f64 {
        self.quantile.max(0.99)
    }

    /// A p50 within `uniform_ratio` of the tail quantile: no tail a copy
    /// could beat.
    pub fn is_uniform(&self, p50: Duration, tail: Duration) -> bool {
        p50.as_secs_f64() >= self.uniform_ratio * tail.as_secs_f64()
    }
}

impl Default for HedgePolicy {
    fn default() -> Self {
        HedgePolicy {
            quantile: 0.95,
            max_hedges: 1,
            max_extra_load: 0.05,
            idempotency: Idempotencies::SAFE_AND_IDEMPOTENT,
            window: Duration::from_secs(30),
            min_samples: 100,
            uniform_ratio: 0.8,
        }
    }
}

/// A set of idempotency levels, as bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Idempotencies(u8);

impl Idempotencies {
    /// SAFE and IDEMPOTENT: the default of a hedging policy.
    pub const SAFE_AND_IDEMPOTENT: Idempotencies =
        Idempotencies(1 << Idempotency::Safe as u8 | 1 << Idempotency::Idempotent as u8);

    /// `self` with `level` added.
    pub fn with(self, level: Idempotency) -> Idempotencies {
        Idempotencies(self.0 | 1 << level as u8)
    }

    /// Whether `level` is in the set.
    pub fn contains(self, level: Idempotency) -> bool {
        self.0 & (1 << level as u8) != 0
    }

    /// The levels in the set, SAFE first.
    pub fn iter(self) -> impl Iterator<Item = Idempotency> {
        [
            Idempotency::Safe,
            Idempotency::Idempotent,
            Idempotency::IdempotentWithKey,
            Idempotency::NonIdempotent,
        ]
        .into_iter()
        .filter(move |level| self.contains(*level))
    }
}

/// What the fleet reported about an upstream over the window, as the store
/// last computed it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HedgeState {
    /// First-attempt latencies (successes) counted over the window.
    pub samples: u64,
    /// Their median.
    pub p50: Duration,
    /// Their hedging quantile: the hedge delay.
    pub delay: Duration,
    /// Their tail quantile ([`HedgePolicy::tail_quantile`]).
    pub tail: Duration,
    /// First attempts reported over the window.
    pub first_attempts: u64,
    /// Hedges granted over the window, fleet-wide.
    pub hedges: u64,
    /// The same latencies over the window's most recent part only.
    pub recent: RecentLatency,
}

/// The latencies of the most recent part of a window (its last sixth: 5 s
/// of a 30 s window). An upstream that turns slow as a whole is uniformly
/// slow there within seconds, while the whole window still holds its fast
/// past and says so only once the slow calls are half of it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecentLatency {
    /// Latencies counted.
    pub samples: u64,
    /// Their median.
    pub p50: Duration,
    /// Their tail quantile ([`HedgePolicy::tail_quantile`]).
    pub tail: Duration,
}

impl RecentLatency {
    /// Uniformly slow by the recent latencies alone: enough of them, and
    /// their p50 within `uniform_ratio` of their tail.
    pub fn is_uniform(&self, policy: &HedgePolicy) -> bool {
        self.samples >= policy.min_samples.max(1) && policy.is_uniform(self.p50, self.tail)
    }
}

/// Whether an upstream may be hedged now, and after how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Served {
    /// Start hedge timers of this length.
    Hedge(Duration),
    /// Fewer than `min_samples` latencies over the window.
    TooFewSamples,
    /// The p50 is within `uniform_ratio` of the tail quantile.
    UniformlySlow,
}

impl HedgeState {
    /// What a client is told about hedging this upstream.
    pub fn served(&self, policy: &HedgePolicy) -> Served {
        if self.samples < policy.min_samples.max(1) {
            Served::TooFewSamples
        } else if policy.is_uniform(self.p50, self.tail) || self.recent.is_uniform(policy) {
            Served::UniformlySlow
        } else {
            Served::Hedge(self.delay)
        }
    }

    /// Hedges the cap allows over the window.
    pub fn cap(&self, policy: &HedgePolicy) -> u64 {
        (policy.max_extra_load * self.first_attempts as f64).floor() as u64
    }
}

/// One hedge request: the k-th copy of a call still in flight.
#[derive(Clone, Copy, Debug)]
pub struct HedgeFacts {
    /// Which hedge of the call this is (1 for the first).
    pub hedge: u32,
    /// The call's declared idempotency.
    pub idempotency: Idempotency,
    /// Time left before the caller's deadline, if it has one.
    pub deadline_remaining: Option<Duration>,
    /// The least time an attempt needs (the upstream's
    /// `min_attempt_budget`).
    pub min_attempt_budget: Duration,
    /// The retry budget as looked at: hedges spend from it.
    pub budget: BudgetView,
}

/// The numbers a hedge decision was made on, for its explanation, span and
/// log line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgeNote {
    /// Which hedge was asked for.
    pub hedge: u32,
    /// The hedge delay served (the quantile), zero without a policy.
    pub delay: Duration,
    /// The fleet's median.
    pub p50: Duration,
    /// The fleet's tail quantile.
    pub tail: Duration,
    /// The policy's quantile (0 without a policy).
    pub quantile: f64,
    /// The policy's tail quantile (0 without a policy).
    pub tail_quantile: f64,
    /// Hedges granted over the window before this one.
    pub hedges: u64,
    /// First attempts reported over the window.
    pub first_attempts: u64,
    /// Latencies counted over the window.
    pub samples: u64,
    /// The window's most recent part.
    pub recent: RecentLatency,
}

/// Decides a hedge. `policy` is `None` for an upstream without hedging.
pub fn decide_hedge(
    facts: &HedgeFacts,
    policy: Option<&HedgePolicy>,
    state: &HedgeState,
) -> Decision {
    let note = HedgeNote {
        hedge: facts.hedge,
        delay: state.delay,
        p50: state.p50,
        tail: state.tail,
        quantile: policy.map_or(0.0, |policy| policy.quantile),
        tail_quantile: policy.map_or(0.0, HedgePolicy::tail_quantile),
        hedges: state.hedges,
        first_attempts: state.first_attempts,
        samples: state.samples,
        recent: state.recent,
    };
    let answer = |verdict| Decision {
        verdict,
        rule: Rule::HEDGE,
        effective_evidence: Evidence::SentNoResponse,
        evidence_adjusted: false,
        unknown_outcome: None,
        http_status: None,
        grpc_status: None,
        hedge: Some(note),
        fleet: crate::FleetEffect::None,
    };
    let deny = |reason| answer(Verdict::Deny(reason));
    if !facts.budget.retries_enabled {
        return deny(DenyReason::RetriesDisabled);
    }
    let Some(policy) = policy else {
        return deny(DenyReason::HedgingOff);
    };
    if !policy.idempotency.contains(facts.idempotency)
        || facts.idempotency == Idempotency::NonIdempotent
        || facts.hedge > policy.max_hedges
    {
        return deny(DenyReason::HedgingOff);
    }
    if let Some(remaining) = facts.deadline_remaining {
        if remaining < facts.min_attempt_budget {
            return deny(DenyReason::Deadline);
        }
    }
    match state.served(policy) {
        // Not learned yet: hedging is not on (the client was told
        // `enabled = false`), which is no statement about the upstream.
        Served::TooFewSamples => return deny(DenyReason::HedgingOff),
        Served::UniformlySlow => return deny(DenyReason::UniformlySlow),
        Served::Hedge(_) => {}
    }
    if state.hedges >= state.cap(policy) {
        return deny(DenyReason::HedgeCap);
    }
    if facts.budget.unavailable {
        return deny(DenyReason::BudgetUnavailable);
    }
    if facts.budget.tokens < 1.0 {
        return deny(DenyReason::BudgetExhausted);
    }
    answer(Verdict::Retry {
        backoff: Duration::ZERO,
        refresh_credentials: false,
    })
}

impl Decision {
    /// A granted hedge turned down because the upstream's fleet-wide
    /// pushback is in force (another caller's Retry-After or pushback, or a
    /// stop): a hedge is sent now or never, and now is before the time the
    /// upstream asked for.
    pub fn into_pushback_denial(self) -> Decision {
        Decision {
            verdict: Verdict::Deny(DenyReason::ServerPushback),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> HedgeState {
        HedgeState {
            samples: 1_000,
            p50: Duration::from_millis(10),
            delay: Duration::from_millis(40),
            tail: Duration::from_millis(200),
            first_attempts: 1_000,
            hedges: 0,
            recent: RecentLatency::default(),
        }
    }

    fn facts() -> HedgeFacts {
        HedgeFacts {
            hedge: 1,
            idempotency: Idempotency::Idempotent,
            deadline_remaining: None,
            min_attempt_budget: Duration::from_millis(50),
            budget: BudgetView {
                tokens: 5.0,
                retries_enabled: true,
                unavailable: false,
            },
        }
    }

    fn verdict(facts: HedgeFacts, policy: Option<&HedgePolicy>, state: HedgeState) -> Verdict {
        decide_hedge(&facts, policy, &state).verdict
    }

    #[test]
    fn the_order_of_the_hedge_rule() {
        let policy = HedgePolicy::default();
        let deny = Verdict::Deny;
        let granted = Verdict::Retry {
            backoff: Duration::ZERO,
            refresh_credentials: false,
        };
        assert_eq!(verdict(facts(), Some(&policy), state()), granted);
        let off = BudgetView {
            retries_enabled: false,
            ..facts().budget
        };
        let cases: [(HedgeFacts, Option<&HedgePolicy>, HedgeState, Verdict); 10] = [
            (
                HedgeFacts {
                    budget: off,
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::RetriesDisabled),
            ),
            (facts(), None, state(), deny(DenyReason::HedgingOff)),
            (
                HedgeFacts {
                    idempotency: Idempotency::NonIdempotent,
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::HedgingOff),
            ),
            (
                HedgeFacts {
                    idempotency: Idempotency::IdempotentWithKey,
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::HedgingOff),
            ),
            (
                HedgeFacts {
                    hedge: 2,
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::HedgingOff),
            ),
            (
                HedgeFacts {
                    deadline_remaining: Some(Duration::from_millis(49)),
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::Deadline),
            ),
            (
                facts(),
                Some(&policy),
                HedgeState {
                    samples: 99,
                    ..state()
                },
                deny(DenyReason::HedgingOff),
            ),
            (
                facts(),
                Some(&policy),
                HedgeState {
                    p50: Duration::from_millis(170),
                    ..state()
                },
                deny(DenyReason::UniformlySlow),
            ),
            (
                facts(),
                Some(&policy),
                HedgeState {
                    hedges: 50,
                    ..state()
                },
                deny(DenyReason::HedgeCap),
            ),
            (
                HedgeFacts {
                    budget: BudgetView {
                        tokens: 0.5,
                        ..facts().budget
                    },
                    ..facts()
                },
                Some(&policy),
                state(),
                deny(DenyReason::BudgetExhausted),
            ),
        ];
        for (index, (facts, policy, state, expected)) in cases.into_iter().enumerate() {
            assert_eq!(verdict(facts, policy, state), expected, "case {index}");
        }
        // 49 granted of 1,000 first attempts: the 50th is still in the cap.
        assert_eq!(
            verdict(
                facts(),
                Some(&policy),
                HedgeState {
                    hedges: 49,
                    ..state()
                }
            ),
            granted
        );
    }

    /// A tight body with a 2% tail a second late: the p95 is near the p50,
    /// but the p99 is not, and the upstream is hedged. Slowed as a whole
    /// (p99 near p50), it is not.
    #[test]
    fn a_sparse_tail_is_hedged_and_a_uniform_slowness_is_not() {
        let policy = HedgePolicy::default();
        let tail = HedgeState {
            p50: Duration::from_millis(10),
            delay: Duration::from_millis(12),
            tail: Duration::from_secs(1),
            ..state()
        };
        assert_eq!(
            tail.served(&policy),
            Served::Hedge(Duration::from_millis(12))
        );
        let slow = HedgeState {
            p50: Duration::from_millis(500),
            delay: Duration::from_millis(540),
            tail: Duration::from_millis(560),
            ..state()
        };
        assert_eq!(slow.served(&policy), Served::UniformlySlow);
        // Turned slow a few seconds ago: the window still holds its fast
        // past (p50 10 ms, p99 a second), its most recent part is slow as
        // a whole, and a copy would be as slow as the first.
        let turned = HedgeState {
            recent: RecentLatency {
                samples: 400,
                p50: Duration::from_millis(200),
                tail: Duration::from_millis(220),
            },
            ..tail
        };
        assert_eq!(turned.served(&policy), Served::UniformlySlow);
        // Too few recent latencies say nothing, nor does a recent part
        // with a tail of its own.
        for recent in [
            RecentLatency {
                samples: 99,
                ..turned.recent
            },
            RecentLatency {
                tail: Duration::from_secs(1),
                ..turned.recent
            },
        ] {
            let state = HedgeState { recent, ..tail };
            assert_eq!(state.served(&policy), tail.served(&policy));
        }
        assert_eq!(policy.tail_quantile(), 0.99);
        let high = HedgePolicy {
            quantile: 0.999,
            ..policy
        };
        assert_eq!(high.tail_quantile(), 0.999);
    }

    #[test]
    fn a_hedge_is_never_ambiguous_nor_hides_an_outcome() {
        let policy = HedgePolicy::default();
        for idempotency in [
            Idempotency::Safe,
            Idempotency::Idempotent,
            Idempotency::IdempotentWithKey,
            Idempotency::NonIdempotent,
        ] {
            for hedges in [0, 49, 50] {
                let decision = decide_hedge(
                    &HedgeFacts {
                        idempotency,
                        ..facts()
                    },
                    Some(&policy),
                    &HedgeState { hedges, ..state() },
                );
                assert_ne!(decision.verdict, Verdict::Ambiguous);
                assert_eq!(decision.unknown_outcome, None);
                assert_eq!(decision.rule, Rule::HEDGE);
            }
        }
    }

    #[test]
    fn the_explanation_gives_the_numbers() {
        let policy = HedgePolicy::default();
        let text = decide_hedge(&facts(), Some(&policy), &state()).explanation();
        assert!(text.starts_with("hedge 1 now"), "{text}");
        assert!(
            text.contains("delay 40ms at p95, p50 10ms, p99 200ms over 1000 samples"),
            "{text}"
        );
        let text = decide_hedge(
            &facts(),
            Some(&policy),
            &HedgeState {
                hedges: 50,
                ..state()
            },
        )
        .explanation();
        assert!(text.contains("50 hedges of 1000 first attempts"), "{text}");
        let text = decide_hedge(
            &facts(),
            Some(&policy),
            &HedgeState {
                p50: Duration::from_millis(170),
                ..state()
            },
        )
        .explanation();
        assert!(text.contains("uniformly slow"), "{text}");
    }
}
