//! [`Decision`]: what the client acts on, from retryd's answer or from the
//! local rule, in the engine's own types.
//!
//! This module translates answers; it decides nothing.

use std::time::Duration;

use retryd_engine::{DenyReason, Evidence, UnknownOutcome, Verdict};
use retryd_proto as pb;

/// Who made a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// retryd, enforced.
    Retryd,
    /// The local fallback, because retryd did not answer in time.
    Fallback,
    /// The local rule, because retryd's answer was a shadow one (the
    /// upstream has `enforce = false`); retryd's is in [`Decision::retryd`].
    Shadow,
    /// Decided here without asking: the caller's own deadline or
    /// cancellation ended the call after it may have been sent.
    EndedByCaller,
}

/// The decision for one failed attempt.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// RETRY (with its backoff), DENY (with its reason) or AMBIGUOUS.
    pub verdict: Verdict,
    /// The step of the decision order that decided, 1 to 9.
    pub rule: u8,
    /// The evidence used, after weakening the claim to what it proves.
    pub effective_evidence: Evidence,
    /// Whether the claimed evidence was weakened.
    pub evidence_adjusted: bool,
    /// Whether the attempt may have taken effect upstream, whatever the
    /// verdict (issue 36): a DENY carrying it is not a plain failure.
    pub unknown_outcome: Option<UnknownOutcome>,
    /// retryd's decision id (its audit span); empty when decided locally.
    pub decision_id: String,
    /// Tokens left in the budget the decision looked at: retryd's, or the
    /// local bucket's for a fallback or shadow decision.
    pub tokens_remaining: f64,
    /// One line for humans.
    pub explanation: String,
    /// Who decided.
    pub source: Source,
    /// For a shadow answer: retryd's own decision, which was not enforced.
    pub retryd: Option<Box<Decision>>,
}

impl Decision {
    /// Whether the verdict is RETRY.
    pub fn should_retry(&self) -> bool {
        matches!(self.verdict, Verdict::Retry { .. })
    }

    /// The backoff of a RETRY; zero otherwise.
    pub fn backoff(&self) -> Duration {
        match self.verdict {
            Verdict::Retry { backoff, .. } => backoff,
            _ => Duration::ZERO,
        }
    }

    /// Whether a RETRY asks for fresh credentials first (401, UNAUTHENTICATED).
    pub fn refresh_credentials(&self) -> bool {
        matches!(
            self.verdict,
            Verdict::Retry {
                refresh_credentials: true,
                ..
            }
        )
    }

    /// The reason of a DENY.
    pub fn deny_reason(&self) -> Option<DenyReason> {
        match self.verdict {
            Verdict::Deny(reason) => Some(reason),
            _ => None,
        }
    }

    /// Whether the attempt may have taken effect and no further attempt is
    /// allowed: AMBIGUOUS, or a DENY carrying an unknown-outcome mark. Such
    /// a call is never a plain failure.
    pub fn is_outcome_unknown(&self) -> bool {
        match self.verdict {
            Verdict::Ambiguous => true,
            Verdict::Deny(_) => self.unknown_outcome.is_some(),
            Verdict::Retry { .. } => false,
        }
    }

    /// Whether the local rule decided (a fallback or a shadow answer).
    pub fn is_local(&self) -> bool {
        self.source != Source::Retryd
    }

    /// Reads retryd's answer. `None` for an answer this client cannot read
    /// (a verdict or reason newer than it): the caller falls back.
    pub(crate) fn from_pb(response: &pb::DecideResponse) -> Option<Decision> {
        let backoff = response.backoff.map_or(Duration::ZERO, |backoff| {
            Duration::new(
                backoff.seconds.max(0) as u64,
                backoff.nanos.clamp(0, 999_999_999) as u32,
            )
        });
        let verdict = match pb::Verdict::try_from(response.verdict).ok()? {
            pb::Verdict::Retry => Verdict::Retry {
                backoff,
                refresh_credentials: response.refresh_credentials,
            },
            pb::Verdict::Deny => Verdict::Deny(deny_reason(response.deny_reason)?),
            pb::Verdict::Ambiguous => Verdict::Ambiguous,
            pb::Verdict::Unspecified => return None,
        };
        let effective_evidence = match pb::Evidence::try_from(response.effective_evidence).ok()? {
            pb::Evidence::NotSent => Evidence::NotSent,
            pb::Evidence::SentNoResponse => Evidence::SentNoResponse,
            pb::Evidence::ResponseReceived => Evidence::ResponseReceived,
            pb::Evidence::PartialResponse => Evidence::PartialResponse,
            pb::Evidence::Unspecified => return None,
        };
        let unknown_outcome = match pb::UnknownOutcome::try_from(response.unknown_outcome) {
            Ok(pb::UnknownOutcome::None) => None,
            Ok(pb::UnknownOutcome::Reconcile) => Some(UnknownOutcome::Reconcile),
            Ok(pb::UnknownOutcome::ResendWithKey) => Some(UnknownOutcome::ResendWithKey),
            // A mark newer than this client: the outcome is at least open.
            Err(_) => Some(UnknownOutcome::Reconcile),
        };
        Some(Decision {
            verdict,
            rule: u8::try_from(response.rule).unwrap_or(u8::MAX),
            effective_evidence,
            evidence_adjusted: response.evidence_adjusted,
            unknown_outcome,
            decision_id: response.decision_id.clone(),
            tokens_remaining: response.tokens_remaining,
            explanation: response.explanation.clone(),
            source: Source::Retryd,
            retryd: None,
        })
    }

    /// The verdict and, for a DENY, its reason: `deny budget_exhausted`.
    pub fn describe(&self) -> String {
        match self.verdict {
            Verdict::Deny(reason) => format!("deny {}", reason.as_str()),
            other => other.as_str().to_owned(),
        }
    }
}

fn deny_reason(raw: i32) -> Option<DenyReason> {
    use pb::DenyReason as Pb;
    Some(match Pb::try_from(raw).ok()? {
        Pb::Unspecified => return None,
        Pb::MaxAttempts => DenyReason::MaxAttempts,
        Pb::BudgetExhausted => DenyReason::BudgetExhausted,
        Pb::BodyNotReplayable => DenyReason::BodyNotReplayable,
        Pb::ResponseAlreadyDelivered => DenyReason::ResponseAlreadyDelivered,
        Pb::RuntimeDraining => DenyReason::RuntimeDraining,
        Pb::Deadline => DenyReason::Deadline,
        Pb::PermanentFailure => DenyReason::PermanentFailure,
        Pb::StatusNotRetryable => DenyReason::StatusNotRetryable,
        Pb::RetriesDisabled => DenyReason::RetriesDisabled,
        Pb::BudgetUnavailable => DenyReason::BudgetUnavailable,
        Pb::ServerPushback => DenyReason::ServerPushback,
        Pb::RetriedBelow => DenyReason::RetriedBelow,
        Pb::InsideEnclosingRetry => DenyReason::InsideEnclosingRetry,
        Pb::HedgingOff => DenyReason::HedgingOff,
        Pb::HedgeCap => DenyReason::HedgeCap,
        Pb::UniformlySlow => DenyReason::UniformlySlow,
    })
}

/// The wire name of a deny reason (`DENY_REASON_BUDGET_EXHAUSTED`).
pub fn deny_reason_name(reason: DenyReason) -> &'static str {
    use pb::DenyReason as Pb;
    let wire = match reason {
        DenyReason::MaxAttempts => Pb::MaxAttempts,
        DenyReason::BudgetExhausted => Pb::BudgetExhausted,
        DenyReason::BudgetUnavailable => Pb::BudgetUnavailable,
        DenyReason::BodyNotReplayable => Pb::BodyNotReplayable,
        DenyReason::ResponseAlreadyDelivered => Pb::ResponseAlreadyDelivered,
        DenyReason::RuntimeDraining => Pb::RuntimeDraining,
        DenyReason::RetriesDisabled => Pb::RetriesDisabled,
        DenyReason::Deadline => Pb::Deadline,
        DenyReason::PermanentFailure => Pb::PermanentFailure,
        DenyReason::StatusNotRetryable => Pb::StatusNotRetryable,
        DenyReason::ServerPushback => Pb::ServerPushback,
        DenyReason::RetriedBelow => Pb::RetriedBelow,
        DenyReason::InsideEnclosingRetry => Pb::InsideEnclosingRetry,
        DenyReason::HedgingOff => Pb::HedgingOff,
        DenyReason::HedgeCap => Pb::HedgeCap,
        DenyReason::UniformlySlow => Pb::UniformlySlow,
    };
    wire.as_str_name()
}
