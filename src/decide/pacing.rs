//! Upstreams that are pacing the fleet: a Retry-After or a positive
//! `grpc-retry-pushback-ms` in force for them fleet-wide, as this replica
//! last saw it in a decision's store call.
//!
//! While an upstream paces, the failures its callers report are mostly its
//! own announced 429s (or RESOURCE_EXHAUSTED with a pushback): the upstream
//! answered and said when to come back, which is not the ill health the
//! adaptive budget is for. Counted as failures, they took the deposits to
//! nothing during a 4 s window of `429 Retry-After: 2`, so that when the
//! announced time came the budget was at its floor and a third of the calls
//! that naive retries completed failed (docs/fleet.md, `pushback`). So a
//! report entry for a pacing upstream funds all its requests and leaves the
//! adaptive level where it is; the fleet-wide pushback already keeps every
//! retry behind the announced time. A negative pushback ("do not retry")
//! is not pacing: it stops retries and the rule applies.
//!
//! Only this replica's view: one that decided nothing for the upstream
//! lately does not know, and funds by the outcomes as usual (the
//! conservative side). The funded count is what the decision log keeps, so
//! `retryd replay` deposits what the live service did.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How long after an announced time the upstream still counts as pacing:
/// the failures of the window's last moments arrive with the callers' next
/// reports, about a second later (every client's default interval).
pub(super) const REPORT_GRACE: Duration = Duration::from_secs(2);

/// Pacing upstreams by name, until when (the announced time plus
/// [`REPORT_GRACE`]). Names enter only from decisions the store answered
/// with a pushback in force, so they are bounded as the store's upstreams
/// are; an expired one is removed when next looked at.
#[derive(Debug, Default)]
pub(super) struct PacingUpstreams {
    until: Mutex<HashMap<Box<str>, Instant>>,
}

impl PacingUpstreams {
    /// `upstream` paces for `wait` from now (zero: nothing to note).
    pub(super) fn note(&self, upstream: &str, wait: Duration) {
        if wait.is_zero() {
            return;
        }
        let until = Instant::now() + wait + REPORT_GRACE;
        let mut paced = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        match paced.get_mut(upstream) {
            Some(known) => *known = (*known).max(until),
            None => {
                paced.insert(upstream.into(), until);
            }
        }
    }

    /// True while `upstream` paces (or did within the grace).
    pub(super) fn holds(&self, upstream: &str) -> bool {
        let mut paced = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if paced.is_empty() {
            return false;
        }
        let now = Instant::now();
        paced.retain(|_, until| *until > now);
        paced.contains_key(upstream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_upstream_paces_until_its_announced_time_and_the_grace() {
        let paced = PacingUpstreams::default();
        assert!(!paced.holds("a"));
        paced.note("a", Duration::ZERO);
        assert!(!paced.holds("a"));
        paced.note("a", Duration::from_secs(2));
        // A shorter wait seen later does not shorten it.
        paced.note("a", Duration::from_millis(100));
        assert!(paced.holds("a") && !paced.holds("b"));
        tokio::time::advance(Duration::from_secs(2) + REPORT_GRACE - Duration::from_millis(1))
            .await;
        assert!(paced.holds("a"));
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!paced.holds("a"));
        assert!(
            paced.until.lock().unwrap().is_empty(),
            "expired names leave"
        );
    }
}
