//! Whether a failed attempt may have taken effect upstream: the mark every
//! decision carries, whichever rule decided (issue 36).
//!
//! The seed makes AMBIGUOUS a third answer because "reporting a plain
//! failure would tell the caller the request did not happen, which may be
//! false". Rules 1 to 7 come before the rules that answer AMBIGUOUS, so a
//! denial of a possibly-executed payment (an empty budget, the last
//! attempt) would hide exactly that. The mark is computed from the facts
//! alone, never from the verdict, so no rule can hide it.
//!
//! This module must not depend on the budget or the policy: whether the
//! request took effect upstream does not change with how much budget is
//! left or which codes the upstream retries.

use super::{Evidence, Facts, GrpcCode, Idempotency};

/// The attempt may have taken effect upstream, and repeating it is not
/// harmless by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnknownOutcome {
    /// NON_IDEMPOTENT: the caller must reconcile (ask the upstream) before
    /// it reports a failure or sends the request again.
    Reconcile,
    /// IDEMPOTENT_WITH_KEY: it may have happened, and re-sending with the
    /// same idempotency key is safe (the upstream deduplicates); a new key
    /// is not.
    ResendWithKey,
}

impl UnknownOutcome {
    /// A stable snake_case name for logs, spans and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownOutcome::Reconcile => "reconcile",
            UnknownOutcome::ResendWithKey => "resend_with_key",
        }
    }
}

/// The mark for `facts`, given the evidence step 0 derived. Set exactly
/// where rule 8 or the status rules would answer AMBIGUOUS had no earlier
/// rule denied (for a keyed call: would, were it not keyed): the operation
/// is not safely repeatable without its key, and the evidence
/// (SENT_NO_RESPONSE; a partial 2xx/3xx response, or one with no status) or
/// the status (502, 503, 504, gRPC UNAVAILABLE or DEADLINE_EXCEEDED) leaves
/// the outcome open. Never set on a proven NOT_SENT, nor when a final
/// response settled the outcome (a 4xx, a 500).
///
/// One difference from "what rule 9 would answer" is deliberate: a gRPC
/// UNAVAILABLE the upstream's policy does not retry, or one carrying a
/// "do not retry" pushback, is still of unknown outcome. The policy says
/// whether to retry, not whether the server ran the call.
pub(crate) fn unknown_outcome(facts: &Facts<'_>, effective: Evidence) -> Option<UnknownOutcome> {
    let mark = match facts.idempotency {
        Idempotency::Safe | Idempotency::Idempotent => return None,
        Idempotency::NonIdempotent => UnknownOutcome::Reconcile,
        Idempotency::IdempotentWithKey => UnknownOutcome::ResendWithKey,
    };
    let status_leaves_it_open = || match (facts.http_status, facts.grpc_status) {
        (Some(status), _) => matches!(status, 502..=504),
        (None, Some(code)) => matches!(code, GrpcCode::Unavailable | GrpcCode::DeadlineExceeded),
        (None, None) => false,
    };
    let open = match effective {
        Evidence::NotSent => false,
        Evidence::SentNoResponse => true,
        // The effect happened and its result was lost on the way, unless an
        // error status says what happened.
        Evidence::PartialResponse => match (facts.http_status, facts.grpc_status) {
            (None, None) | (Some(200..=399), _) => true,
            _ => status_leaves_it_open(),
        },
        Evidence::ResponseReceived => status_leaves_it_open(),
    };
    open.then_some(mark)
}
