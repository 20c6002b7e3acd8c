//! What a decision tells the store about its upstream's fleet-wide
//! pushback (issue 32; README, "Fleet-wide pushback"): the Retry-After or
//! `grpc-retry-pushback-ms` its caller reported, and the longest fleet wait
//! its RETRY could honour.
//!
//! A valid Retry-After (seconds or HTTP date) or a positive pushback sets
//! the upstream's earliest-retry time `now + wait`, `wait` bounded by the
//! policy's `max_retry_after`; a negative pushback stops the upstream's
//! retries for the policy's `pushback_stop_window`. An unparseable one is
//! the caller's own denial (gRFC A6) and announces nothing: it says nothing
//! about how long the upstream wants.
//!
//! It also brings the decision's jitter draw and the policy's
//! `ramp_window`: during a recovery ramp the store withdraws only for a draw
//! below the ramp's share, and the engine admits on the same draw.

use crate::budget::{Announce, FleetCall};
use crate::engine::{Facts, Pushback, parse_pushback, parse_retry_after};
use crate::policy::UpstreamPolicy;

/// The announcement and patience of a decision on `facts` under `policy`.
pub(super) fn fleet_call(facts: &Facts<'_>, policy: &UpstreamPolicy) -> FleetCall {
    let max = policy.engine.max_retry_after;
    let announce = match facts.grpc_pushback {
        // Each caller follows only what it was told itself.
        _ if !policy.fleet_pushback => Announce::Nothing,
        Some(raw) => match parse_pushback(raw) {
            Pushback::Wait(wait) if !wait.is_zero() => Announce::Wait(wait.min(max)),
            Pushback::Wait(_) => Announce::Nothing,
            // With `retried_below` it is a call chain's per-call signal (a
            // layer below retried this failure: docs/lineage.md), not the
            // upstream asking the fleet to stop: it stops nothing.
            Pushback::DoNotRetry
                if is_negative(raw)
                    && facts.retried_below.is_none()
                    && !policy.pushback_stop_window.is_zero() =>
            {
                Announce::Stop(policy.pushback_stop_window)
            }
            Pushback::DoNotRetry => Announce::Nothing,
        },
        None => match facts
            .retry_after
            .and_then(|raw| parse_retry_after(raw, facts.now))
        {
            Some(wait) if !wait.is_zero() && !max.is_zero() => Announce::Wait(wait.min(max)),
            _ => Announce::Nothing,
        },
    };
    // The engine bounds a fleet wait by max_retry_after and denies one the
    // deadline's room cannot hold: no token is spent for that denial.
    let patience = facts
        .deadline_remaining
        .map(|remaining| remaining.saturating_sub(policy.engine.min_attempt_budget))
        .filter(|room| *room < max);
    FleetCall {
        announce,
        patience,
        draw: facts.jitter,
        ramp_window: policy.ramp_window,
    }
}

/// A pushback written as a negative integer (gRFC A6: "do not retry").
fn is_negative(raw: &str) -> bool {
    raw.trim()
        .parse::<i64>()
        .is_ok_and(|milliseconds| milliseconds < 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Body, BudgetView, Idempotency, Lineage};
    use crate::policy::Policies;
    use std::time::Duration;
    use std::time::SystemTime;

    fn facts<'a>(retry_after: Option<&'a str>, pushback: Option<&'a str>) -> Facts<'a> {
        Facts {
            idempotency: Idempotency::Idempotent,
            body: &Body::None,
            attempt: 1,
            claimed_evidence: None,
            failure: None,
            http_status: Some(429),
            retry_after,
            grpc_status: None,
            grpc_pushback: pushback,
            deadline_remaining: None,
            first_byte_delivered: false,
            runtime_draining: false,
            auth_refresh_attempted: false,
            previous_backoff: None,
            max_attempts: None,
            lineage: Lineage::default(),
            retried_below: None,
            budget: BudgetView::OPEN,
            now: SystemTime::UNIX_EPOCH,
            jitter: 0.5,
        }
    }

    #[test]
    fn what_a_decision_announces() {
        let policy = Policies::default().defaults().clone();
        let call = |retry_after, pushback| fleet_call(&facts(retry_after, pushback), &policy);
        assert_eq!(
            call(Some("2"), None).announce,
            Announce::Wait(Duration::from_secs(2))
        );
        // Bounded by max_retry_after (60 s).
        assert_eq!(
            call(Some("600"), None).announce,
            Announce::Wait(Duration::from_secs(60))
        );
        assert_eq!(call(Some("soon"), None).announce, Announce::Nothing);
        assert_eq!(
            call(None, Some("1500")).announce,
            Announce::Wait(Duration::from_millis(1500))
        );
        assert_eq!(
            call(None, Some("-1")).announce,
            Announce::Stop(Duration::from_secs(5))
        );
        assert_eq!(call(None, Some("x")).announce, Announce::Nothing);
        let plain = call(None, None);
        assert_eq!(plain.announce, Announce::Nothing);
        assert_eq!(plain.patience, None);
        assert_eq!(plain.ramp_window, Duration::from_secs(5));
    }

    #[test]
    fn patience_is_the_deadline_room() {
        let policy = Policies::default().defaults().clone();
        let mut short = facts(None, None);
        short.deadline_remaining = Some(Duration::from_secs(1));
        assert_eq!(
            fleet_call(&short, &policy).patience,
            Some(Duration::from_millis(950))
        );
        short.deadline_remaining = Some(Duration::from_secs(600));
        assert_eq!(fleet_call(&short, &policy).patience, None);
    }
}
