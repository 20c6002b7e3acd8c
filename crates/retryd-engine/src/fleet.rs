//! Fleet-wide pushback as an input to the decision (issue 32).
//!
//! A Retry-After or `grpc-retry-pushback-ms` one caller reported for an
//! upstream sets that upstream's earliest-retry time for every caller; the
//! budget store keeps it (per process, or in Redis for the fleet) and hands
//! it to the decision as a [`FleetPushback`]: how long from now no retry
//! may land, and whether a negative pushback has stopped the upstream's
//! retries. The engine stays pure: the store reads and writes the time, the
//! engine only turns it into a backoff or a denial.
//!
//! The spread: a RETRY under a fleet pushback of `wait` waits
//! `wait + jitter × max(ceiling, wait × SPREAD)`, where `ceiling` is the
//! policy's own backoff for the attempt (the same jitter draw scales both,
//! so the spread stays uniform), so the callers held back by one
//! announcement do not all land at its instant: a 2 s Retry-After spreads
//! them over the 500 ms after it.

use std::time::Duration;

/// The share of the remaining fleet pushback the retries held back by it
/// are spread over, after it ends (at least the policy's own backoff).
pub const SPREAD: f64 = 0.25;

/// What the budget store knew of the upstream's fleet-wide pushback when
/// the decision read its budget (before this call's own announcement).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetPushback {
    /// How long from now no retry of the upstream may land (zero: none in
    /// force), already bounded by the policy's `max_retry_after` when set.
    pub wait: Duration,
    /// A caller reported a negative pushback and its stop window has not
    /// ended: retries of the upstream are denied (SERVER_PUSHBACK).
    pub stop: bool,
    /// The share of retries admitted while the upstream recovers (after a
    /// fault cleared, or retries were switched back on), 0 to 1: 1 when no
    /// ramp is under way. A RETRY is admitted when the decision's jitter
    /// draw is below it (the store withdrew on the same draw).
    pub ramp: f64,
    /// How long the ramp has left: an admitted RETRY's backoff is spread
    /// over it, so the retries of a recovering upstream do not all land
    /// at once.
    pub ramp_remaining: Duration,
}

impl Default for FleetPushback {
    fn default() -> Self {
        FleetPushback::NONE
    }
}

impl FleetPushback {
    /// No pushback in force: [`crate::decide`] decides on this.
    pub const NONE: FleetPushback = FleetPushback {
        wait: Duration::ZERO,
        stop: false,
        ramp: 1.0,
        ramp_remaining: Duration::ZERO,
    };

    /// True if something is in force.
    pub fn is_set(&self) -> bool {
        self.stop || !self.wait.is_zero() || self.ramping()
    }

    /// True while a recovery ramp is under way.
    pub fn ramping(&self) -> bool {
        self.ramp < 1.0
    }

    /// True if the ramp admits a RETRY drawn `jitter`.
    pub fn admits(&self, jitter: f64) -> bool {
        !self.ramping() || jitter < self.ramp
    }

    /// The backoff an admitted RETRY is spread to during a ramp: its draw,
    /// rescaled to `[0, 1)` among the admitted ones (`jitter / ramp`), times
    /// what is left of the ramp.
    pub fn ramp_spread(&self, jitter: f64) -> Duration {
        if !self.ramping() || self.ramp <= 0.0 || !jitter.is_finite() {
            return Duration::ZERO;
        }
        self.ramp_remaining
            .mul_f64((jitter / self.ramp).clamp(0.0, 1.0))
    }

    /// The backoff that ends no earlier than the fleet's earliest-retry
    /// time, spread after it: `wait + jitter × max(ceiling, wait × SPREAD)`
    /// (see the module docs). `ceiling` is the policy's backoff ceiling for
    /// the attempt, `jitter` the decision's draw in `[0, 1)`; `max` bounds
    /// `wait` (the policy's `max_retry_after`).
    pub fn floor(&self, ceiling: Duration, jitter: f64, max: Duration) -> Option<Duration> {
        if self.wait.is_zero() {
            return None;
        }
        let wait = self.wait.min(max);
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let window = ceiling.max(wait.mul_f64(SPREAD));
        Some(wait.saturating_add(window.mul_f64(jitter)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn nothing_in_force_sets_no_floor() {
        assert_eq!(FleetPushback::NONE.floor(MS * 50, 0.5, MS * 60_000), None);
        assert!(!FleetPushback::NONE.is_set());
    }

    #[test]
    fn the_floor_ends_after_the_wait_spread_over_a_quarter_of_it() {
        let fleet = FleetPushback {
            wait: MS * 2000,
            ..FleetPushback::NONE
        };
        let max = MS * 60_000;
        assert_eq!(fleet.floor(MS * 50, 0.0, max), Some(MS * 2000));
        assert_eq!(fleet.floor(MS * 50, 0.5, max), Some(MS * 2250));
        // A long policy backoff widens the window.
        assert_eq!(fleet.floor(MS * 4000, 0.5, max), Some(MS * 4000));
        // Bounded by max_retry_after.
        assert_eq!(fleet.floor(MS * 50, 0.0, MS * 1000), Some(MS * 1000));
    }
}

#[cfg(test)]
mod ramp_tests {
    use super::*;

    #[test]
    fn a_ramp_admits_its_share_and_spreads_them_over_what_is_left() {
        let ramp = FleetPushback {
            ramp: 0.25,
            ramp_remaining: Duration::from_secs(4),
            ..FleetPushback::NONE
        };
        assert!(ramp.is_set());
        assert!(ramp.admits(0.1));
        assert!(!ramp.admits(0.25));
        assert_eq!(ramp.ramp_spread(0.125), Duration::from_secs(2));
        assert!(FleetPushback::NONE.admits(0.99));
        assert_eq!(FleetPushback::NONE.ramp_spread(0.5), Duration::ZERO);
    }
}
