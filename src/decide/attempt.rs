//! One failed attempt as its caller reported it, and the draws a decision
//! adds to it.

use std::time::SystemTime;

use rand::Rng;

use crate::engine::{Body, BudgetView, Facts};

/// A failed attempt, validated (by the edge, or read from a decision log),
/// borrowing its strings from the request.
#[derive(Debug)]
pub struct Attempt<'a> {
    /// The upstream.
    pub upstream: &'a str,
    /// The operation, possibly empty.
    pub operation: &'a str,
    /// The body, as the engine reads it.
    pub body: Body,
    /// 0 for a retry of a failure; k >= 1 for the k-th hedge of a call
    /// still in flight (`reported` then carries no failure).
    pub hedge: u32,
    /// Everything else the caller reported, in the engine's own terms. Its
    /// `body`, `budget`, `now` and `jitter` are not the request's: they are
    /// filled in for each decision by [`Attempt::facts`].
    pub reported: Facts<'a>,
}

/// What [`Attempt::reported`]'s body holds until a decision fills it in.
pub static NO_BODY: Body = Body::None;

impl Attempt<'_> {
    /// The engine's facts for this attempt, with the budget as looked at
    /// and the decision's draw.
    pub fn facts(&self, budget: BudgetView, draw: Draw) -> Facts<'_> {
        Facts {
            body: &self.body,
            budget,
            now: draw.now,
            jitter: draw.jitter,
            ..self.reported
        }
    }
}

/// What a decision draws besides the caller's facts: the wall clock and a
/// uniform jitter in `[0, 1)`. The decision log records both, so that
/// `retryd replay` decides with the same draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// The wall clock, read only for an HTTP-date Retry-After (else the
    /// epoch: nothing else reads it).
    pub now: SystemTime,
    /// The backoff's jitter draw.
    pub jitter: f64,
}

impl Draw {
    /// A fresh draw for `attempt`.
    pub fn fresh(attempt: &Attempt<'_>) -> Draw {
        let now = if attempt.reported.retry_after.is_some() {
            SystemTime::now()
        } else {
            SystemTime::UNIX_EPOCH
        };
        Draw {
            now,
            jitter: rand::rng().random::<f64>(),
        }
    }
}
