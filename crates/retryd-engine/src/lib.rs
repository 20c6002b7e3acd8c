//! The decision engine: given what happened to one attempt, the upstream's
//! policy and a look at its budget, decide RETRY, DENY or AMBIGUOUS.
//!
//! Everything here is a pure function of plain values. There is no async, no
//! clock (callers pass `now`), no randomness (callers pass a uniform `jitter`
//! draw) and no I/O, so every rule is unit-testable without a server. The
//! engine does not log either: it returns its reasons as data.
//!
//! The order of the rules is the specification (`retry-and-ambiguity.md`):
//! [`decide`] evaluates them first to last and the first that applies wins,
//! so a later rule can never re-enable what an earlier one forbade.
//!
//! About 710 lines (tests included) because the decision order, rules 1 to 9 with the HTTP
//! and gRPC status rows, is one function and its types, read top to bottom;
//! evidence, bodies, backoff, gRPC codes and the explanation are modules.
#![forbid(unsafe_code)]

mod backoff;
mod body;
mod evidence;
mod explanation;
mod fleet;
mod grpc;
mod hedge;
pub mod latency;
mod lineage;
mod outcome;
mod retry_after;
#[cfg(test)]
mod tests;

use std::time::{Duration, SystemTime};

pub use backoff::{Backoff, Jitter};
pub use body::{Body, Replayability};
pub use evidence::{Evidence, FailureKind, effective_evidence};
pub use fleet::{FleetPushback, SPREAD as PUSHBACK_SPREAD};
pub use grpc::{GrpcCode, GrpcCodes, Pushback, parse_pushback};
pub use hedge::{
    HedgeFacts, HedgeNote, HedgePolicy, HedgeState, Idempotencies, RecentLatency, Served,
    decide_hedge,
};
pub use lineage::{
    Lineage, LineageError, MAX_LAYER_BYTES, MAX_LINEAGE_ATTEMPT, MAX_LINEAGE_BYTES,
    MAX_LINEAGE_ENTRIES, layer_name, retried_below,
};
pub use outcome::UnknownOutcome;
pub use retry_after::parse_retry_after;
/// `VARIANTS`, the derived list of every variant of [`DenyReason`],
/// [`FailureKind`] and [`GrpcCode`].
pub use strum::VariantArray;

/// How safe it is to execute the operation again, as the caller declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Idempotency {
    /// No side effects.
    Safe,
    /// Repeating has the same effect as doing it once.
    Idempotent,
    /// Idempotent thanks to an idempotency key the upstream honours.
    IdempotentWithKey,
    /// Repeating may repeat the side effect.
    NonIdempotent,
}

impl Idempotency {
    /// SAFE, IDEMPOTENT and IDEMPOTENT_WITH_KEY may be repeated without
    /// duplicating a side effect.
    pub fn is_safely_idempotent(self) -> bool {
        !matches!(self, Idempotency::NonIdempotent)
    }

    /// Its name in logs and spans: `safe`, `idempotent`,
    /// `idempotent_with_key`, `non_idempotent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Idempotency::Safe => "safe",
            Idempotency::Idempotent => "idempotent",
            Idempotency::IdempotentWithKey => "idempotent_with_key",
            Idempotency::NonIdempotent => "non_idempotent",
        }
    }
}

/// The per-upstream policy the engine applies. Built from configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Attempts allowed in all, the first included (at least 1).
    pub max_attempts: u32,
    /// The least time an attempt needs; a deadline leaving less denies.
    pub min_attempt_budget: Duration,
    /// The longest Retry-After that will be waited for.
    pub max_retry_after: Duration,
    /// Whether the upstream registers HTTP 500 as transient.
    pub transient_500: bool,
    /// The gRPC codes this upstream retries (gRFC A6's
    /// `retryableStatusCodes`); how each is retried is rule 9's.
    pub grpc_retryable: GrpcCodes,
    /// Failure kinds this upstream treats as permanent, on top of the
    /// built-in ones.
    pub permanent_failures: Vec<FailureKind>,
    /// How long to wait before a retry.
    pub backoff: Backoff,
    /// Whether a call made inside a retry of an enclosing call may be
    /// retried as well (rule 5).
    pub inside_enclosing_retry: EnclosingRetry,
}

/// Whether a layer retries a call it makes while serving a request that is
/// itself a retry (`inside_enclosing_retry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EnclosingRetry {
    /// The enclosing layer is already retrying: do not multiply its
    /// attempts by ours (DENY INSIDE_ENCLOSING_RETRY).
    #[default]
    Deny,
    /// Decide as if the call were not enclosed: every layer retries on its
    /// own budget, as before lineage.
    Allow,
}

impl Default for Policy {
    /// The defaults of the configuration contract.
    fn default() -> Self {
        Policy {
            max_attempts: 3,
            min_attempt_budget: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(60),
            transient_500: false,
            grpc_retryable: GrpcCodes::DEFAULT,
            permanent_failures: Vec::new(),
            backoff: Backoff::default(),
            inside_enclosing_retry: EnclosingRetry::Deny,
        }
    }
}

/// What the engine may know about the upstream's budget, read before deciding.
/// Looking is free: a token is withdrawn only after a RETRY verdict.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetView {
    /// Tokens available; a retry needs one.
    pub tokens: f64,
    /// False while an operator has switched retries off for the upstream.
    pub retries_enabled: bool,
    /// True when the budget store could not be reached and the upstream's
    /// policy is to deny rather than fall back to a local bucket.
    pub unavailable: bool,
}

impl BudgetView {
    /// A budget that allows a retry: deciding on it tells what the verdict
    /// is if the budget allows, before the budget has been read.
    pub const OPEN: BudgetView = BudgetView {
        tokens: f64::INFINITY,
        retries_enabled: true,
        unavailable: false,
    };

    /// The budget store could not be reached and the policy is to deny:
    /// what a decision settles on when its store call failed, or when a
    /// withdrawal's outcome is unknown (never a RETRY).
    pub const UNAVAILABLE: BudgetView = BudgetView {
        tokens: 0.0,
        retries_enabled: true,
        unavailable: true,
    };

    /// True if the budget rules (2 and 5's kill switch) let a retry through.
    /// Every view that allows gives the decision [`BudgetView::OPEN`] gives;
    /// one that does not can only turn it into a DENY (engine property
    /// tests).
    pub fn allows(&self) -> bool {
        !self.unavailable && self.tokens >= 1.0 && self.retries_enabled
    }
}

/// Everything reported about one failed attempt, already validated.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    /// Declared idempotency.
    pub idempotency: Idempotency,
    /// The request body.
    pub body: &'a Body,
    /// Attempts made so far, the failed one included (at least 1).
    pub attempt: u32,
    /// The caller's claim; `None` lets the failure and status speak.
    pub claimed_evidence: Option<Evidence>,
    /// The stage failure, if one was reported.
    pub failure: Option<FailureKind>,
    /// The HTTP status, if a response arrived (100..=599).
    pub http_status: Option<u16>,
    /// The raw Retry-After header, if any.
    pub retry_after: Option<&'a str>,
    /// The gRPC status a gRPC call ended with; never set with `http_status`.
    /// Unlike an HTTP status it proves no response: libraries make codes up.
    pub grpc_status: Option<GrpcCode>,
    /// The raw `grpc-retry-pushback-ms` trailer, if the server sent one.
    pub grpc_pushback: Option<&'a str>,
    /// Time left before the caller's deadline, if it has one.
    pub deadline_remaining: Option<Duration>,
    /// The response's first byte already reached the application.
    pub first_byte_delivered: bool,
    /// The caller's runtime is shutting down.
    pub runtime_draining: bool,
    /// Credentials were already refreshed once for this call.
    pub auth_refresh_attempted: bool,
    /// The backoff before the failed attempt, for decorrelated jitter.
    pub previous_backoff: Option<Duration>,
    /// The caller's own attempt limit, if lower than the policy's.
    pub max_attempts: Option<u32>,
    /// The enclosing calls, if the call is made while serving a request.
    pub lineage: Lineage<'a>,
    /// The layer below that already retried this failure, as the failed
    /// response said (`retryd-retried`); only with a response.
    pub retried_below: Option<&'a str>,
    /// The budget as it was looked at.
    pub budget: BudgetView,
    /// Wall-clock time, to read an HTTP-date Retry-After.
    pub now: SystemTime,
    /// A uniform draw in `[0, 1)` for the backoff jitter.
    pub jitter: f64,
}

/// Why a retry was denied. `DenyReason::VARIANTS` lists every reason in
/// declaration order (derived), and the variants carry no explicit
/// discriminants, so `reason as usize` is a dense index into it: tables
/// indexed by reason (the metrics) cannot miss one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::VariantArray)]
pub enum DenyReason {
    /// Rule 1.
    MaxAttempts,
    /// Rule 2.
    BudgetExhausted,
    /// Rule 2: the shared budget could not be read and the policy says deny.
    BudgetUnavailable,
    /// Rule 3.
    BodyNotReplayable,
    /// Rule 4.
    ResponseAlreadyDelivered,
    /// Rule 5: the caller is draining.
    RuntimeDraining,
    /// Rule 5: an operator switched retries off.
    RetriesDisabled,
    /// Rule 5: a layer below already retried this failure.
    RetriedBelow,
    /// Rule 5: the call is made inside a retry of an enclosing call.
    InsideEnclosingRetry,
    /// Rule 6, or a Retry-After that cannot be honoured.
    Deadline,
    /// Rule 7.
    PermanentFailure,
    /// Rule 9.
    StatusNotRetryable,
    /// Rule 9: a negative or unparseable gRPC pushback (gRFC A6).
    ServerPushback,
    /// A hedge: no hedging policy, an idempotency it does not allow, beyond
    /// `max_hedges`, or too few latencies learned yet.
    HedgingOff,
    /// A hedge beyond the cap on extra load.
    HedgeCap,
    /// A hedge of an upstream whose p50 is close to its tail quantile.
    UniformlySlow,
}

impl DenyReason {
    /// A stable snake_case name for logs, spans and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::MaxAttempts => "max_attempts",
            DenyReason::BudgetExhausted => "budget_exhausted",
            DenyReason::BudgetUnavailable => "budget_unavailable",
            DenyReason::BodyNotReplayable => "body_not_replayable",
            DenyReason::ResponseAlreadyDelivered => "response_already_delivered",
            DenyReason::RuntimeDraining => "runtime_draining",
            DenyReason::RetriesDisabled => "retries_disabled",
            DenyReason::RetriedBelow => "retried_below",
            DenyReason::InsideEnclosingRetry => "inside_enclosing_retry",
            DenyReason::Deadline => "deadline",
            DenyReason::PermanentFailure => "permanent_failure",
            DenyReason::StatusNotRetryable => "status_not_retryable",
            DenyReason::ServerPushback => "server_pushback",
            DenyReason::HedgingOff => "hedging_off",
            DenyReason::HedgeCap => "hedge_cap",
            DenyReason::UniformlySlow => "uniformly_slow",
        }
    }
}

/// The answer for one attempt.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Try again after `backoff`; refresh credentials first if asked.
    Retry {
        /// How long to wait before the next attempt.
        backoff: Duration,
        /// The 401 case: refresh credentials, then replay.
        refresh_credentials: bool,
    },
    /// Do not try again.
    Deny(DenyReason),
    /// It may have happened upstream: reconcile instead of retrying.
    Ambiguous,
}

impl Verdict {
    /// A stable lower-case name for logs, spans and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Retry { .. } => "retry",
            Verdict::Deny(_) => "deny",
            Verdict::Ambiguous => "ambiguous",
        }
    }
}

/// The step of the decision order that decided (1 to 9).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule(u8);

impl Rule {
    /// Rule 1: attempts exhausted.
    pub const MAX_ATTEMPTS: Rule = Rule(1);
    /// Rule 2: budget empty.
    pub const BUDGET: Rule = Rule(2);
    /// Rule 3: body not replayable.
    pub const BODY: Rule = Rule(3);
    /// Rule 4: first byte delivered.
    pub const FIRST_BYTE: Rule = Rule(4);
    /// Rule 5: draining, retries switched off, or the call chain's rule:
    /// only one layer retries a failure.
    pub const DRAINING: Rule = Rule(5);
    /// Rule 6: deadline.
    pub const DEADLINE: Rule = Rule(6);
    /// Rule 7: permanent failure.
    pub const PERMANENT: Rule = Rule(7);
    /// Rule 8: sent, no response, not safely idempotent.
    pub const AMBIGUOUS_SEND: Rule = Rule(8);
    /// Rule 9: evidence and status rules.
    pub const STATUS: Rule = Rule(9);
    /// Not a rule of the retry order: a hedge, decided by `decide_hedge`.
    pub const HEDGE: Rule = Rule(10);

    /// The rule's number in the decision order.
    pub fn number(self) -> u8 {
        self.0
    }
}

/// The engine's answer, with the reasons as data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// RETRY, DENY or AMBIGUOUS.
    pub verdict: Verdict,
    /// The rule that decided.
    pub rule: Rule,
    /// The evidence used after validation.
    pub effective_evidence: Evidence,
    /// Whether the caller's claim was weakened.
    pub evidence_adjusted: bool,
    /// Whether the attempt may have taken effect upstream, whatever the
    /// verdict: a DENY carrying it must reach the caller as an
    /// unknown-outcome error, never as a plain failure.
    pub unknown_outcome: Option<UnknownOutcome>,
    /// The status, for the explanation.
    http_status: Option<u16>,
    /// The gRPC code, for the explanation.
    grpc_status: Option<GrpcCode>,
    /// A hedge's numbers; `None` for a retry.
    pub hedge: Option<HedgeNote>,
    /// What the fleet's pushback did to the verdict.
    fleet: FleetEffect,
}

/// What another caller's pushback (the decision's [`FleetPushback`]) did to
/// a decision, for the explanation and a metric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FleetEffect {
    /// Nothing: no pushback in force, or the backoff was as long anyway.
    #[default]
    None,
    /// The RETRY's backoff was stretched to end after the fleet's
    /// earliest-retry time.
    Stretched,
    /// The retry was denied (SERVER_PUSHBACK): a caller's negative pushback
    /// stopped the upstream's retries.
    Stopped,
    /// The retry was denied (BUDGET_EXHAUSTED): the upstream is recovering
    /// and its ramp admits only part of the retries yet.
    Ramped,
    /// The RETRY was admitted by a recovery ramp, its backoff spread over
    /// what is left of it.
    Spread,
}

impl Decision {
    /// What the fleet's pushback did to this decision.
    pub fn fleet_effect(&self) -> FleetEffect {
        self.fleet
    }

    /// The same decision with its verdict replaced by a rule-2 denial: the
    /// service calls this when the withdrawal after a RETRY failed (the last
    /// token went to someone else, or the store became unreachable), which
    /// step 2 would have denied had it seen the budget a moment later.
    pub fn into_budget_denial(self, reason: DenyReason) -> Decision {
        debug_assert!(matches!(
            reason,
            DenyReason::BudgetExhausted | DenyReason::BudgetUnavailable
        ));
        Decision {
            verdict: Verdict::Deny(reason),
            // A hedge keeps its own rule: it was never in the retry order.
            rule: if self.hedge.is_some() {
                Rule::HEDGE
            } else {
                Rule::BUDGET
            },
            ..self
        }
    }
}

/// Decides one failed attempt. Rules are checked in the specification's
/// order and the first that applies decides; see the module docs.
pub fn decide(facts: &Facts<'_>, policy: &Policy) -> Decision {
    decide_in_fleet(facts, policy, FleetPushback::NONE)
}

/// [`decide`] under the upstream's fleet-wide pushback, as the budget store
/// read it: a RETRY's backoff ends no earlier than the fleet's
/// earliest-retry time (spread after it, `fleet.rs`), and a stop in force
/// turns a RETRY into DENY SERVER_PUSHBACK (rule 9). It can only lengthen
/// a backoff or turn a RETRY into a DENY: every other verdict is
/// [`decide`]'s.
pub fn decide_in_fleet(facts: &Facts<'_>, policy: &Policy, fleet: FleetPushback) -> Decision {
    // An HTTP status or a pushback trailer can only have come from the
    // server; a gRPC code alone may be the library's own.
    let answered = facts.http_status.is_some() || facts.grpc_pushback.is_some();
    let (effective, evidence_adjusted) =
        effective_evidence(facts.claimed_evidence, facts.failure, answered);
    // Computed from the facts, before any rule, so that no rule can hide
    // a possibly-executed call behind a plain denial.
    let unknown_outcome = outcome::unknown_outcome(facts, effective);
    let answer = |verdict, rule| Decision {
        verdict,
        rule,
        effective_evidence: effective,
        evidence_adjusted,
        unknown_outcome,
        http_status: facts.http_status,
        grpc_status: facts.grpc_status,
        hedge: None,
        fleet: FleetEffect::None,
    };
    let deny = |reason, rule| answer(Verdict::Deny(reason), rule);

    // 1. Attempts exhausted. The caller may only lower the policy's limit.
    let max_attempts = match facts.max_attempts {
        Some(own) => own.min(policy.max_attempts),
        None => policy.max_attempts,
    };
    if facts.attempt >= max_attempts {
        return deny(DenyReason::MaxAttempts, Rule::MAX_ATTEMPTS);
    }
    // 2. Budget empty. Checked on a view; the token is spent by the caller
    // only once the whole decision is RETRY. A budget that cannot be read
    // is no budget: retries must not flood an upstream while we are blind.
    if facts.budget.unavailable {
        return deny(DenyReason::BudgetUnavailable, Rule::BUDGET);
    }
    if facts.budget.tokens < 1.0 {
        return deny(DenyReason::BudgetExhausted, Rule::BUDGET);
    }
    // 3. Body not replayable.
    if facts.body.replayability() == Replayability::OneShot {
        return deny(DenyReason::BodyNotReplayable, Rule::BODY);
    }
    // 4. First byte already delivered.
    if facts.first_byte_delivered {
        return deny(DenyReason::ResponseAlreadyDelivered, Rule::FIRST_BYTE);
    }
    // 5. Runtime draining, or the operator's kill switch.
    if facts.runtime_draining {
        return deny(DenyReason::RuntimeDraining, Rule::DRAINING);
    }
    if !facts.budget.retries_enabled {
        return deny(DenyReason::RetriesDisabled, Rule::DRAINING);
    }
    // 5, in a call chain: the layer nearest the failure retries it
    // (docs/lineage.md). One that already did, or was denied, said so on
    // its response; retrying here would multiply its attempts by ours.
    if facts.retried_below.is_some() {
        return deny(DenyReason::RetriedBelow, Rule::DRAINING);
    }
    // And while a layer above is retrying the request we serve, our
    // retries would multiply its attempts.
    if facts.lineage.enclosing_retry().is_some()
        && policy.inside_enclosing_retry == EnclosingRetry::Deny
    {
        return deny(DenyReason::InsideEnclosingRetry, Rule::DRAINING);
    }
    // 6. Not enough deadline left for even one more attempt.
    if let Some(remaining) = facts.deadline_remaining {
        if remaining < policy.min_attempt_budget {
            return deny(DenyReason::Deadline, Rule::DEADLINE);
        }
    }
    // 7. Permanent failure.
    if let Some(failure) = facts.failure {
        if failure.is_permanent() || policy.permanent_failures.contains(&failure) {
            return deny(DenyReason::PermanentFailure, Rule::PERMANENT);
        }
    }
    // 8. It may have happened, and repeating it may duplicate it.
    if effective == Evidence::SentNoResponse && !facts.idempotency.is_safely_idempotent() {
        return answer(Verdict::Ambiguous, Rule::AMBIGUOUS_SEND);
    }
    // 9. Evidence and status.
    match status_rule(facts, policy, effective) {
        // Another caller's negative pushback stopped the upstream's retries.
        StatusOutcome::Retry { .. } if fleet.stop => Decision {
            fleet: FleetEffect::Stopped,
            ..deny(DenyReason::ServerPushback, Rule::STATUS)
        },
        // The upstream is recovering: its ramp admits a growing share of
        // the retries (a budget rule: what the budget lets through).
        StatusOutcome::Retry { .. } if !fleet.admits(facts.jitter) => Decision {
            fleet: FleetEffect::Ramped,
            ..deny(DenyReason::BudgetExhausted, Rule::BUDGET)
        },
        StatusOutcome::Retry {
            refresh_credentials,
        } => match backoff_within_deadline(facts, policy, refresh_credentials, fleet) {
            Some((backoff, effect)) => Decision {
                fleet: effect,
                ..answer(
                    Verdict::Retry {
                        backoff,
                        refresh_credentials,
                    },
                    Rule::STATUS,
                )
            },
            None => deny(DenyReason::Deadline, Rule::DEADLINE),
        },
        StatusOutcome::Ambiguous => answer(Verdict::Ambiguous, Rule::STATUS),
        StatusOutcome::Deny(reason) => deny(reason, Rule::STATUS),
    }
}

enum StatusOutcome {
    Retry { refresh_credentials: bool },
    Ambiguous,
    Deny(DenyReason),
}

/// Rule 9: by evidence, then by status.
fn status_rule(facts: &Facts<'_>, policy: &Policy, effective: Evidence) -> StatusOutcome {
    let retry = StatusOutcome::Retry {
        refresh_credentials: false,
    };
    let safely_idempotent = facts.idempotency.is_safely_idempotent();
    let retry_if_idempotent_else_ambiguous = || {
        if safely_idempotent {
            StatusOutcome::Retry {
                refresh_credentials: false,
            }
        } else {
            StatusOutcome::Ambiguous
        }
    };
    match effective {
        // Proven never received: repeating cannot duplicate anything,
        // whatever code the library made up for it.
        Evidence::NotSent => return retry,
        // Rule 8 already answered the operations that are not idempotent.
        // A gRPC code still speaks: the library's own CANCELLED, or the
        // RESOURCE_EXHAUSTED of an oversized message, is no reason to retry.
        Evidence::SentNoResponse if facts.grpc_status.is_none() => return retry,
        Evidence::SentNoResponse => {}
        Evidence::PartialResponse => match (facts.http_status, facts.grpc_status) {
            // The effect happened and its result was lost on the way.
            (None, None) | (Some(200..=399), _) => return retry_if_idempotent_else_ambiguous(),
            _ => {}
        },
        Evidence::ResponseReceived => {}
    }
    if let Some(code) = facts.grpc_status {
        return grpc_rule(code, facts, policy);
    }
    match facts.http_status {
        Some(408) => retry,
        Some(425) if facts.attempt == 1 => retry,
        Some(429) => retry,
        Some(401) if facts.idempotency == Idempotency::Safe && !facts.auth_refresh_attempted => {
            StatusOutcome::Retry {
                refresh_credentials: true,
            }
        }
        Some(500) if policy.transient_500 && safely_idempotent => retry,
        Some(502..=504) => retry_if_idempotent_else_ambiguous(),
        _ => StatusOutcome::Deny(DenyReason::StatusNotRetryable),
    }
}

/// Rule 9 for a gRPC code: the HTTP table's counterpart, row by row, from
/// the gRPC status-code guide and gRFC A6.
fn grpc_rule(code: GrpcCode, facts: &Facts<'_>, policy: &Policy) -> StatusOutcome {
    let retry = StatusOutcome::Retry {
        refresh_credentials: false,
    };
    let pushback = facts.grpc_pushback.map(parse_pushback);
    // A6: a negative or unparseable pushback means "do not retry", on any
    // code, whatever the upstream lists.
    if pushback == Some(Pushback::DoNotRetry) {
        return StatusOutcome::Deny(DenyReason::ServerPushback);
    }
    if !policy.grpc_retryable.contains(code) {
        return StatusOutcome::Deny(DenyReason::StatusNotRetryable);
    }
    let safely_idempotent = facts.idempotency.is_safely_idempotent();
    match code {
        // The server (or a proxy) may have run the call before failing, as
        // with 502-504; a deadline is a response that never came, as with
        // SENT_NO_RESPONSE.
        GrpcCode::Unavailable | GrpcCode::DeadlineExceeded if safely_idempotent => retry,
        GrpcCode::Unavailable | GrpcCode::DeadlineExceeded => StatusOutcome::Ambiguous,
        // Like 429 + Retry-After, but only with a pushback: without one the
        // code is also what a library reports for an oversized message,
        // which no retry fixes.
        GrpcCode::ResourceExhausted if pushback.is_some() => retry,
        GrpcCode::ResourceExhausted => StatusOutcome::Deny(DenyReason::StatusNotRetryable),
        // Like 401: one refresh-and-replay for calls with no side effects.
        GrpcCode::Unauthenticated
            if facts.idempotency == Idempotency::Safe && !facts.auth_refresh_attempted =>
        {
            StatusOutcome::Retry {
                refresh_credentials: true,
            }
        }
        GrpcCode::Unauthenticated => StatusOutcome::Deny(DenyReason::StatusNotRetryable),
        // INTERNAL, UNKNOWN and any other code the upstream registers: like
        // a transient 500, only for calls that are safely idempotent.
        _ if safely_idempotent => retry,
        _ => StatusOutcome::Deny(DenyReason::StatusNotRetryable),
    }
}

/// The backoff of a RETRY and what the fleet's pushback or ramp did to it,
/// or `None` when a Retry-After (the caller's or the fleet's) cannot be
/// honoured (too long for the policy, or not fitting the deadline).
fn backoff_within_deadline(
    facts: &Facts<'_>,
    policy: &Policy,
    refresh_credentials: bool,
    fleet: FleetPushback,
) -> Option<(Duration, FleetEffect)> {
    // Retry-After (HTTP) or a valid pushback (gRPC): the server's floor.
    let floor = match facts.grpc_pushback.map(parse_pushback) {
        Some(Pushback::Wait(wait)) => Some(wait),
        _ => facts
            .retry_after
            .and_then(|raw| parse_retry_after(raw, facts.now)),
    };
    if let Some(floor) = floor {
        if floor > policy.max_retry_after {
            return None;
        }
    }
    // A credential refresh is not upstream overload: replay at once.
    let computed = if refresh_credentials {
        Duration::ZERO
    } else {
        policy
            .backoff
            .compute(facts.attempt, facts.previous_backoff, facts.jitter)
    };
    let floor = floor.unwrap_or(Duration::ZERO);
    let own = computed.max(floor);
    // The fleet's earliest-retry time, spread after it; its wait (not the
    // spread) is a floor like the caller's own Retry-After.
    let ceiling = policy
        .backoff
        .ceiling(facts.attempt, facts.previous_backoff);
    let fleet_wait = fleet.wait.min(policy.max_retry_after);
    let (backoff, effect) = match fleet.floor(ceiling, facts.jitter, policy.max_retry_after) {
        Some(stretched) if stretched > own => (stretched, FleetEffect::Stretched),
        _ => (own, FleetEffect::None),
    };
    // During a recovery ramp the admitted retries are spread over what is
    // left of it (not a floor: the deadline may cut it short).
    let spread = fleet.ramp_spread(facts.jitter);
    let (backoff, effect) = if spread > backoff {
        (spread, FleetEffect::Spread)
    } else {
        (backoff, effect)
    };
    let floor = floor.max(fleet_wait);
    match facts.deadline_remaining {
        None => Some((backoff, effect)),
        Some(remaining) => {
            // Rule 6 guarantees remaining >= min_attempt_budget.
            let room = remaining.saturating_sub(policy.min_attempt_budget);
            if floor > room {
                None
            } else {
                Some((backoff.min(room), effect))
            }
        }
    }
}
