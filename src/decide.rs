//! The decision pipeline: what retryd does with a failed attempt, apart
//! from how the attempt arrived (`grpc`) and what the decision leaves
//! behind (`record`).
//!
//! A decision is [`Decider::begin`] (authorise the upstream, decide as if
//! the budget allowed, take room in the caller's share), one store call
//! (`BudgetStore::check`, withdrawing a token only for that hoped RETRY),
//! and one settlement on what the store said ([`Settled::settle`]), which
//! the live policy, each candidate and `retryd replay` all go through. The
//! result is a plain [`Decided`]; a refusal is a [`Refused`]. Traffic
//! reports (`report.rs`) and the kill switch are the pipeline's other two
//! ways into the budgets.
//!
//! Invariant: nothing here knows the wire (`pb`, `tonic`), spans, metrics
//! or the decision log. It imports the engine, the budget store, policies,
//! principals and configuration; what its store calls cost goes to the
//! caller's [`Observe`].

mod attempt;
mod candidate;
pub mod names;
mod pacing;
mod pushback;
pub mod replay;
mod report;
mod settle;
mod shares;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures::FutureExt;
use rand::Rng;

use crate::auth::{Auth, Denied, Principal};
use crate::budget::{Announce, BudgetStore, FleetCall, HedgeWindows, StoreError};
use crate::engine::{BudgetView, Decision, Facts, HedgeFacts, Verdict};
use crate::policy::{Policies, UpstreamPolicy};
use crate::telemetry::StoreOp;
pub use attempt::{Attempt, Draw, NO_BODY};
pub use names::InvalidRequest;
pub use report::{Report, Traffic};
pub use settle::{Hedge, Settled};
pub use shares::ShareFull;

/// The reloadable part of the configuration: what a decision decides on,
/// loaded once per call so that a reload never splits a decision.
#[derive(Debug)]
pub struct Live {
    /// Per-upstream policies.
    pub policies: Policies,
    /// Who may call.
    pub auth: Auth,
}

/// Why the pipeline refused a call. `grpc/status.rs` gives each its status.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The principal may not use the upstream.
    #[error(transparent)]
    Denied(#[from] Denied),
    /// The principal holds its whole share of unconfigured upstreams.
    #[error(transparent)]
    ShareFull(#[from] ShareFull),
    /// The store refused (its upstream limit) or could not be reached.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A field the pipeline, not the edge, found unusable (a report id
    /// already used for other entries).
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// Another call with the same report id is still being applied.
    #[error(
        "report_id: another call with this id is still being applied; nothing was applied by this one, re-send it later"
    )]
    ReportInProgress,
    /// A traffic report failed: before any deposit (`failed` is `None`) or
    /// at the deposit of entry `failed`, of `entries`.
    #[error("{refused}")]
    Report {
        /// Why.
        refused: Box<Refused>,
        /// The entry whose deposit failed, if the deposits had begun.
        failed: Option<usize>,
        /// The report's entries.
        entries: usize,
    },
}

/// What the pipeline's store calls cost, for whoever records it (the
/// `Recorder`; `()` records nothing).
pub trait Observe {
    /// One store call, its time and whether it failed.
    fn store_call(&self, op: StoreOp, elapsed: Duration, failed: bool);
    /// A traffic report's entry was deposited: `requests` reported, of
    /// which `funded` funded the budget (fewer with the adaptive budget
    /// when the entry's outcomes show failures).
    fn deposited(&self, upstream: &str, requests: u64, funded: u64);
    /// A traffic report's entry said how many hedged calls a hedge won
    /// (only for an upstream with a hedging policy).
    fn hedges_won(&self, upstream: &str, won: u64);
}

impl Observe for () {
    fn store_call(&self, _: StoreOp, _: Duration, _: bool) {}
    fn deposited(&self, _: &str, _: u64, _: u64) {}
    fn hedges_won(&self, _: &str, _: u64) {}
}

/// The pipeline: the budget store, the candidates' budgets, the
/// principals' shares and the live configuration. Generic over the store,
/// chosen once in `main`: no dynamic dispatch on the decision path.
#[derive(Debug)]
pub struct Decider<S> {
    store: S,
    candidates: candidate::Candidates,
    shares: shares::Shares,
    live: ArcSwap<Live>,
    /// How long a traffic report's id is remembered.
    report_window: Duration,
    /// The hedged upstreams' latencies and hedges over their windows.
    hedges: HedgeWindows,
    /// Upstreams pacing the fleet, as this replica's decisions saw them.
    pacing: pacing::PacingUpstreams,
}

/// A decision up to its one store call: authorised, and decided as if the
/// budget allowed.
#[derive(Debug)]
pub struct Begun<'r> {
    principal: &'r Principal,
    attempt: Attempt<'r>,
    policy: &'r UpstreamPolicy,
    draw: Draw,
    settled: Settled,
    /// What the store call tells and asks about the fleet's pushback.
    fleet: FleetCall,
}

/// A decision made: what was decided, on what, for whom. Everything a
/// record of it needs, and nothing of how it is recorded.
#[derive(Debug)]
pub struct Decided<'r> {
    /// The caller.
    pub principal: &'r Principal,
    /// The attempt decided on.
    pub attempt: Attempt<'r>,
    /// The decision's draw.
    pub draw: Draw,
    /// The answer.
    pub decision: Decision,
    /// Tokens left in the upstream's budget after the decision.
    pub tokens_remaining: f64,
    /// Answered as not enforced (the upstream's policy is in shadow mode).
    pub shadow: bool,
    /// The candidate policy's decision and tokens left, if it has one.
    pub candidate: Option<(Decision, f64)>,
    /// The id answered, 32 hex digits.
    pub decision_id: String,
}

impl Decided<'_> {
    /// The facts decided on, as the caller reported them, with the draw.
    pub fn facts(&self) -> Facts<'_> {
        self.attempt.facts(BudgetView::OPEN, self.draw)
    }
}

/// The answer of a future that is ready when first polled (a store with
/// `BudgetStore::ANSWERS_AT_ONCE`): polled once, here, with no executor and
/// nothing boxed or queued. A future that was not ready is dropped and
/// `pending` answers instead; nothing it spent is known.
pub fn at_once<T>(future: impl Future<Output = T>, pending: impl FnOnce() -> T) -> T {
    future.now_or_never().unwrap_or_else(pending)
}

impl<S: BudgetStore> Decider<S> {
    /// A pipeline over `store`, deciding with `live`; each principal holds
    /// at most `share_limit` unconfigured upstreams, each until unused for
    /// `evict_idle_after`; traffic report ids are remembered for
    /// `report_window`.
    pub fn new(
        store: S,
        live: Live,
        share_limit: Option<usize>,
        evict_idle_after: Duration,
        report_window: Duration,
    ) -> Self {
        Decider {
            store,
            candidates: candidate::Candidates::new(),
            shares: shares::Shares::new(share_limit, evict_idle_after),
            live: ArcSwap::from_pointee(live),
            report_window,
            hedges: HedgeWindows::default(),
            pacing: pacing::PacingUpstreams::default(),
        }
    }

    /// The hedged upstreams' windows.
    pub fn hedges(&self) -> &HedgeWindows {
        &self.hedges
    }

    /// What a client is told about hedging `upstream` now; `None` without
    /// a hedging policy.
    pub fn hedging(&self, live: &Live, upstream: &str) -> Option<Hedging> {
        let policy = live.policies.get(upstream).hedging?;
        let state = self.hedges.state(upstream, &policy);
        Some(Hedging {
            served: state.served(&policy),
            state,
            policy,
        })
    }

    /// The budget store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The configuration in force now, for one call: a guard that takes no
    /// reference count (every call cloning and dropping the one shared
    /// `Arc` was two atomic writes to a line every core touches).
    pub fn live(&self) -> arc_swap::Guard<Arc<Live>> {
        self.live.load()
    }

    /// The configuration in force now, to keep.
    pub fn live_full(&self) -> Arc<Live> {
        self.live.load_full()
    }

    /// Swaps in a new configuration: later calls decide on it, calls in
    /// flight finish on the one they loaded.
    pub fn replace_live(&self, live: Live) {
        self.live.store(Arc::new(live));
    }

    /// Everything before the store call: the upstream authorised for
    /// `principal`, the decision as if the budget allowed, and, for an
    /// unconfigured upstream the store will track (a hoped RETRY, or a
    /// Retry-After or pushback to keep for the fleet), room in the
    /// principal's share.
    pub fn begin<'r>(
        &self,
        live: &'r Live,
        principal: &'r Principal,
        attempt: Attempt<'r>,
        draw: Draw,
    ) -> Result<Begun<'r>, Refused> {
        self.begin_with(live, principal, attempt, draw, None)
    }

    /// [`Decider::begin`], a hedge decided on `hedge_state` rather than on
    /// the fleet's state now: `retryd replay`, deciding a logged hedge on
    /// the state it was decided on live.
    pub fn begin_with<'r>(
        &self,
        live: &'r Live,
        principal: &'r Principal,
        attempt: Attempt<'r>,
        draw: Draw,
        hedge_state: Option<crate::engine::HedgeState>,
    ) -> Result<Begun<'r>, Refused> {
        permit(principal, attempt.upstream, "upstream")?;
        let policy = live.policies.get(attempt.upstream);
        let facts = attempt.facts(BudgetView::OPEN, draw);
        // The budget (rules 2 and 5) can only turn a verdict into a DENY, so
        // only a RETRY here needs a token, and then the store withdraws it
        // in the same call that reads the budget.
        let settled = if attempt.hedge > 0 {
            // A hedge: the fleet's state is read once, here, and the hedge
            // rule decides on it; the budget step is the retries' own.
            let state = hedge_state.unwrap_or_else(|| {
                policy
                    .hedging
                    .map(|hedging| self.hedges.state(attempt.upstream, &hedging))
                    .unwrap_or_default()
            });
            Settled::hope_hedge(Hedge {
                facts: HedgeFacts {
                    hedge: attempt.hedge,
                    idempotency: attempt.reported.idempotency,
                    deadline_remaining: attempt.reported.deadline_remaining,
                    min_attempt_budget: policy.engine.min_attempt_budget,
                    budget: BudgetView::OPEN,
                },
                policy: policy.hedging,
                state,
            })
        } else {
            Settled::hope(&facts, &policy.engine)
        };
        // The caller's Retry-After or pushback, for every caller of the
        // upstream: written by the same store call (`pushback.rs`).
        let mut fleet = pushback::fleet_call(&facts, policy);
        if attempt.hedge > 0 {
            // A hedge cannot wait: while the upstream's fleet-wide pushback
            // is in force the store withdraws nothing for it, and it is
            // denied SERVER_PUSHBACK (settle.rs).
            fleet.patience = Some(Duration::ZERO);
        }
        if !policy.bucket.configured {
            if settled.withdraw {
                self.shares.claim(&principal.name, [attempt.upstream])?;
            } else if fleet.announce.is_set()
                && self
                    .shares
                    .claim(&principal.name, [attempt.upstream])
                    .is_err()
            {
                // An announcement makes the store keep state for the name
                // (a bucket, or its fields in Redis), so it takes a place
                // in the share as a withdrawal does; past the share it is
                // not kept, rather than refuse a decision that spends
                // nothing (the caller's own answer is unchanged).
                fleet.announce = Announce::Nothing;
            }
        }
        Ok(Begun {
            principal,
            attempt,
            policy,
            draw,
            settled,
            fleet,
        })
    }

    /// The one store call (a read, plus a withdrawal only for a hoped
    /// RETRY), then the settlement on its answer and the candidate's
    /// decision beside it.
    pub async fn decide<'r>(
        &self,
        begun: Begun<'r>,
        observe: &impl Observe,
    ) -> Result<Decided<'r>, Refused> {
        let upstream = begun.attempt.upstream;
        let withdraw = begun.settled.withdraw;
        let facts = begun.attempt.facts(BudgetView::OPEN, begun.draw);
        let fleet = begun.fleet;
        let checked = if S::ANSWERS_AT_ONCE {
            // Part of the decision's own time: not timed apart.
            self.store
                .check_in_fleet(upstream, &begun.policy.bucket, withdraw, fleet)
                .await
        } else {
            let asked = Instant::now();
            let checked = self
                .store
                .check_in_fleet(upstream, &begun.policy.bucket, withdraw, fleet)
                .await;
            let op = if withdraw {
                StoreOp::Withdraw
            } else {
                StoreOp::View
            };
            observe.store_call(op, asked.elapsed(), checked.is_err());
            checked
        };
        if let Ok(check) = &checked {
            // The fleet's pacing as read, or this caller's own announcement.
            let announced = match fleet.announce {
                Announce::Wait(wait) => wait,
                _ => Duration::ZERO,
            };
            let read = if check.pushback.stop {
                Duration::ZERO
            } else {
                check.pushback.wait
            };
            self.pacing.note(upstream, announced.max(read));
        }
        let (decision, tokens_remaining) =
            begun
                .settled
                .settle(checked, &facts, &begun.policy.engine)?;
        let hedge = begun.settled.hedge;
        if let (
            Some(Hedge {
                policy: Some(policy),
                ..
            }),
            Verdict::Retry { .. },
        ) = (hedge, decision.verdict)
        {
            // Counted once granted, for the cap over the window.
            self.hedges.count_hedge(upstream, &policy);
        }
        // A candidate policy has no hedging of its own: it decides retries.
        let candidate = begun
            .policy
            .candidate
            .as_deref()
            .filter(|_| hedge.is_none())
            .map(|candidate| self.candidates.decide(upstream, &facts, candidate));
        Ok(Decided {
            principal: begun.principal,
            attempt: begun.attempt,
            draw: begun.draw,
            decision,
            tokens_remaining,
            shadow: !begun.policy.enforce,
            candidate,
            decision_id: crate::telemetry::hex(&rand::rng().random::<[u8; 16]>()),
        })
    }

    /// [`Decider::decide`] for a store that answers at once, without an
    /// executor (see [`at_once`]).
    pub fn decide_now<'r>(
        &self,
        begun: Begun<'r>,
        observe: &impl Observe,
    ) -> Result<Decided<'r>, Refused> {
        at_once(self.decide(begun, observe), || {
            Err(Refused::Store(StoreError::Unavailable(
                "the budget store did not answer at once".into(),
            )))
        })
    }

    /// Switches retries on or off for `upstream` fleet-wide (and in its
    /// candidate's budget, so that the switch is not counted as the
    /// candidate's divergence). Returns whether they were on before.
    pub async fn set_retries_enabled(
        &self,
        live: &Live,
        principal: &Principal,
        upstream: &str,
        enabled: bool,
        observe: &impl Observe,
    ) -> Result<bool, Refused> {
        let policy = live.policies.get(upstream);
        let configured = policy.bucket.configured;
        // An unconfigured name switched off takes a bucket the store never
        // evicts (a kill switch is never lost): it holds a place in the
        // admin's share for as long, so that a scoped admin cannot fill the
        // table every team decides from with names.
        if !configured && !enabled {
            self.shares.pin(&principal.name, upstream)?;
        }
        let asked = Instant::now();
        let previous = self
            .store
            .set_retries_enabled(upstream, &policy.bucket, enabled)
            .await;
        observe.store_call(StoreOp::Admin, asked.elapsed(), previous.is_err());
        let previous = previous.inspect_err(|_| {
            // Refused or unreachable: no bucket is pinned, so neither is
            // the name.
            if !configured {
                self.shares.unpin(upstream);
            }
        })?;
        if !configured && enabled {
            self.shares.unpin(upstream);
        }
        if let Some(candidate) = &policy.candidate {
            self.candidates.set_enabled(upstream, candidate, enabled);
        }
        Ok(previous)
    }

    /// One eviction sweep: the store forgets idle unconfigured upstreams
    /// (the memory store; see `BudgetStore::evict_idle`) and each
    /// principal's share what it has not used for `idle`. Returns the
    /// upstreams evicted.
    pub fn sweep(&self, idle: Duration) -> usize {
        let live = self.live();
        let evicted = self
            .store
            .evict_idle(idle, |upstream| live.policies.get(upstream).bucket);
        self.shares.forget_idle();
        evicted
    }
}

/// An upstream's hedging as served to clients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hedging {
    /// Hedge now after a delay, or not, and why.
    pub served: crate::engine::Served,
    /// The fleet's state over the window.
    pub state: crate::engine::HedgeState,
    /// The policy.
    pub policy: crate::engine::HedgePolicy,
}

/// Refuses an upstream the principal may not use, naming the request's
/// `field`.
pub fn permit(principal: &Principal, upstream: &str, field: &str) -> Result<(), Denied> {
    if principal.may_use(upstream) {
        Ok(())
    } else {
        Err(Denied::PermissionDenied(format!(
            "{field}: principal {:?} may not use upstream {upstream:?}",
            principal.name
        )))
    }
}
