//! The pipeline's answers in protobuf: a [`Decided`] as a
//! `DecideResponse` (requests go the other way in `validate.rs`).

use crate::decide::{Decided, Hedging};
use crate::engine::{Decision, DenyReason, Evidence, Idempotency, Served, UnknownOutcome, Verdict};
use crate::pb;

/// The response to a decision.
pub(super) fn response(decided: &Decided<'_>) -> pb::DecideResponse {
    let decision = &decided.decision;
    let mut answer = decision_response(
        decision,
        decided.decision_id.clone(),
        decided.tokens_remaining,
        // From the facts, so that a chain's denial names its layers.
        decision.explanation_in(&decided.attempt.reported),
    );
    answer.shadow = decided.shadow;
    answer
}

/// An upstream's hedging as served to clients.
pub(super) fn hedging(upstream: &str, hedging: &Hedging) -> pb::Hedging {
    let (enabled, delay) = match hedging.served {
        Served::Hedge(delay) => (true, delay),
        Served::TooFewSamples | Served::UniformlySlow => (false, std::time::Duration::ZERO),
    };
    pb::Hedging {
        upstream: upstream.to_owned(),
        enabled,
        delay: Some(prost_types::Duration {
            seconds: delay.as_secs() as i64,
            nanos: delay.subsec_nanos() as i32,
        }),
        max_hedges: hedging.policy.max_hedges,
        idempotency: hedging
            .policy
            .idempotency
            .iter()
            .map(|level| {
                (match level {
                    Idempotency::Safe => pb::Idempotency::Safe,
                    Idempotency::Idempotent => pb::Idempotency::Idempotent,
                    Idempotency::IdempotentWithKey => pb::Idempotency::IdempotentWithKey,
                    Idempotency::NonIdempotent => pb::Idempotency::NonIdempotent,
                }) as i32
            })
            .collect(),
    }
}

fn decision_response(
    decision: &Decision,
    decision_id: String,
    tokens_remaining: f64,
    explanation: String,
) -> pb::DecideResponse {
    let (verdict, backoff, deny_reason, refresh_credentials) = match decision.verdict {
        Verdict::Retry {
            backoff,
            refresh_credentials,
        } => (
            pb::Verdict::Retry,
            Some(backoff),
            pb::DenyReason::Unspecified,
            refresh_credentials,
        ),
        Verdict::Deny(reason) => (pb::Verdict::Deny, None, deny_reason(reason), false),
        Verdict::Ambiguous => (
            pb::Verdict::Ambiguous,
            None,
            pb::DenyReason::Unspecified,
            false,
        ),
    };
    let backoff = backoff.unwrap_or_default();
    pb::DecideResponse {
        verdict: verdict as i32,
        backoff: Some(prost_types::Duration {
            seconds: backoff.as_secs() as i64,
            nanos: backoff.subsec_nanos() as i32,
        }),
        deny_reason: deny_reason as i32,
        refresh_credentials,
        rule: u32::from(decision.rule.number()),
        effective_evidence: evidence(decision.effective_evidence) as i32,
        evidence_adjusted: decision.evidence_adjusted,
        decision_id,
        tokens_remaining,
        explanation,
        error: None,
        shadow: false,
        unknown_outcome: unknown_outcome(decision.unknown_outcome) as i32,
    }
}

fn unknown_outcome(mark: Option<UnknownOutcome>) -> pb::UnknownOutcome {
    match mark {
        None => pb::UnknownOutcome::None,
        Some(UnknownOutcome::Reconcile) => pb::UnknownOutcome::Reconcile,
        Some(UnknownOutcome::ResendWithKey) => pb::UnknownOutcome::ResendWithKey,
    }
}

fn deny_reason(reason: DenyReason) -> pb::DenyReason {
    match reason {
        DenyReason::MaxAttempts => pb::DenyReason::MaxAttempts,
        DenyReason::BudgetExhausted => pb::DenyReason::BudgetExhausted,
        DenyReason::BudgetUnavailable => pb::DenyReason::BudgetUnavailable,
        DenyReason::BodyNotReplayable => pb::DenyReason::BodyNotReplayable,
        DenyReason::ResponseAlreadyDelivered => pb::DenyReason::ResponseAlreadyDelivered,
        DenyReason::RuntimeDraining => pb::DenyReason::RuntimeDraining,
        DenyReason::RetriesDisabled => pb::DenyReason::RetriesDisabled,
        DenyReason::RetriedBelow => pb::DenyReason::RetriedBelow,
        DenyReason::InsideEnclosingRetry => pb::DenyReason::InsideEnclosingRetry,
        DenyReason::Deadline => pb::DenyReason::Deadline,
        DenyReason::PermanentFailure => pb::DenyReason::PermanentFailure,
        DenyReason::StatusNotRetryable => pb::DenyReason::StatusNotRetryable,
        DenyReason::ServerPushback => pb::DenyReason::ServerPushback,
        DenyReason::HedgingOff => pb::DenyReason::HedgingOff,
        DenyReason::HedgeCap => pb::DenyReason::HedgeCap,
        DenyReason::UniformlySlow => pb::DenyReason::UniformlySlow,
    }
}

fn evidence(evidence: Evidence) -> pb::Evidence {
    match evidence {
        Evidence::NotSent => pb::Evidence::NotSent,
        Evidence::SentNoResponse => pb::Evidence::SentNoResponse,
        Evidence::ResponseReceived => pb::Evidence::ResponseReceived,
        Evidence::PartialResponse => pb::Evidence::PartialResponse,
    }
}
