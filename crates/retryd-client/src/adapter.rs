//! What the two adapters (the reqwest middleware and the tower layer)
//! share: what a caller declares about a call ([`Call`]), the decisions
//! made for it ([`Decisions`]), the errors a call ends in
//! ([`AmbiguousError`], [`CallFailed`]), and the step that asks for one
//! decision with the deadline left.
//!
//! Neither adapter decides: both describe an attempt and ask [`Client`].
// Each adapter is a feature; with one of them (or none) off, part of what
// they share goes unused, which is no defect.
#![cfg_attr(not(all(feature = "reqwest", feature = "tower")), allow(dead_code))]

use std::time::Duration;

use retryd_engine::{DenyReason, Idempotency, UnknownOutcome};
use retryd_proto as pb;
use tokio::time::Instant;

use crate::client::{Client, Error};
use crate::decision::Decision;
use crate::request::pb_duration;

/// A hard stop on attempts, whatever retryd or the fallback says.
pub(crate) const MAX_LOOP: u32 = 100;

/// What a caller declares about one call, put in the request's extensions
/// (reqwest-middleware's `RequestBuilder::with_extension`, or a tonic
/// `Request`'s `extensions_mut`). The method never decides idempotency:
/// undeclared, an HTTP request is NON_IDEMPOTENT, or IDEMPOTENT_WITH_KEY
/// when it carries an `Idempotency-Key` header; a gRPC call is
/// NON_IDEMPOTENT.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Call {
    /// The operation's idempotency; `None` means undeclared (see above).
    pub idempotency: Option<Idempotency>,
    /// The upstream (budget and policy); `None` means the adapter's, else
    /// the request's host (HTTP) or authority (gRPC).
    pub upstream: Option<String>,
    /// For retryd's audit; `None` means `METHOD /path` or the gRPC path.
    pub operation: Option<String>,
    /// The caller's own attempt limit; 0 means retryd's.
    pub max_attempts: u32,
    /// The caller's deadline for the whole call, every attempt and backoff
    /// included; `None` means the adapter's default, if any.
    pub deadline: Option<Instant>,
}

impl Call {
    /// A call declared `idempotency`.
    pub fn new(idempotency: Idempotency) -> Call {
        Call {
            idempotency: Some(idempotency),
            ..Call::default()
        }
    }

    /// The same call, to `upstream`.
    pub fn upstream(mut self, upstream: impl Into<String>) -> Call {
        self.upstream = Some(upstream.into());
        self
    }

    /// The same call with a deadline `within` from now.
    pub fn deadline_in(mut self, within: Duration) -> Call {
        self.deadline = Some(Instant::now() + within);
        self
    }

    /// The same call, at most `max_attempts` attempts.
    pub fn max_attempts(mut self, max_attempts: u32) -> Call {
        self.max_attempts = max_attempts;
        self
    }
}

/// The decisions made for a call, in order: in a returned response's
/// extensions (none when the first attempt succeeded) and on the errors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decisions(pub Vec<Decision>);

/// The call may have taken effect upstream and will not be attempted again:
/// an AMBIGUOUS verdict, a DENY carrying an unknown-outcome mark, or the
/// caller's deadline ending a call that may have been sent. Never a plain
/// failure: reconcile, or re-send with the same idempotency key when
/// [`AmbiguousError::resend_with_same_key`] says so.
#[derive(Debug, thiserror::Error)]
#[error("the call may have taken effect upstream ({}, after {attempts} attempt(s)): {}", decision.describe(), decision.explanation)]
pub struct AmbiguousError {
    /// The last decision.
    pub decision: Decision,
    /// Every decision made for the call.
    pub decisions: Vec<Decision>,
    /// Attempts made.
    pub attempts: u32,
    /// The last attempt's status, if a response came (HTTP status or gRPC code).
    pub status: Option<u32>,
    /// The last attempt's error, if it failed without a response.
    pub cause: Option<String>,
}

impl AmbiguousError {
    /// Why no further attempt was made, for a DENY with a mark.
    pub fn deny_reason(&self) -> Option<DenyReason> {
        self.decision.deny_reason()
    }

    /// Whether re-sending with the SAME idempotency key is safe
    /// (IDEMPOTENT_WITH_KEY); otherwise reconcile first.
    pub fn resend_with_same_key(&self) -> bool {
        self.decisions
            .iter()
            .rev()
            .find_map(|decision| decision.unknown_outcome)
            == Some(UnknownOutcome::ResendWithKey)
    }
}

/// A call that failed without a response and that retryd (or the local
/// rule) did not let be attempted again, or whose deadline ended it: a
/// plain failure (it did not take effect, or repeating it is harmless).
#[derive(Debug, thiserror::Error)]
#[error("the call failed after {attempts} attempt(s){}: {cause}", decisions.last().map(|d| format!(" ({})", d.describe())).unwrap_or_default())]
pub struct CallFailed {
    /// Every decision made for the call.
    pub decisions: Vec<Decision>,
    /// Attempts made.
    pub attempts: u32,
    /// The last attempt's error.
    pub cause: String,
    /// Whether the caller's deadline (not a decision) ended the call.
    pub deadline_exceeded: bool,
}

/// What one failed attempt showed, for the decision request.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) evidence: pb::Evidence,
    pub(crate) failure: pb::FailureKind,
    pub(crate) http_status: u32,
    pub(crate) retry_after: String,
    pub(crate) grpc_status: u32,
    pub(crate) grpc_pushback: Option<String>,
    /// The failed response's `retryd-retried`, if it named a valid layer.
    pub(crate) retried_below: String,
}

/// Fills in the deadline left and the previous backoff, and asks.
pub(crate) async fn decide(
    client: &Client,
    mut request: pb::DecideRequest,
    deadline: Option<Instant>,
    previous_backoff: Duration,
) -> Result<(pb::DecideRequest, Decision), Error> {
    if let Some(deadline) = deadline {
        request.deadline_remaining = Some(pb_duration(
            deadline.saturating_duration_since(Instant::now()),
        ));
    }
    if !previous_backoff.is_zero() {
        request.previous_backoff = Some(pb_duration(previous_backoff));
    }
    request.lineage = crate::lineage::inbound_lineage();
    let decision = client.decide(&request).await?;
    Ok((request, decision))
}

/// Truncates `text` to at most `limit` bytes on a character boundary.
pub(crate) fn truncate(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_owned();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}
