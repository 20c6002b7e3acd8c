//! Fleet-wide pushback (issue 32): what a decision announces for its
//! upstream, and what the store hands the engine back.
//!
//! A caller's valid Retry-After (seconds or HTTP date) or positive
//! `grpc-retry-pushback-ms` sets the upstream's earliest-retry time to
//! `now + wait`, bounded by the policy's `max_retry_after`; a negative
//! pushback stops the upstream's retries until `now + pushback_stop_window`.
//! Each is "set if later": an announcement never brings an earlier one
//! forward. The store keeps both beside the upstream's budget and reads
//! them in the decision's one store call (the memory store: two atomics of
//! the bucket; Redis: two fields of the bucket's hash, read by the same
//! `HMGET` and written by the same script as the withdrawal, so a decision
//! costs no more commands). The read is of the state before this call's
//! own announcement, so the engine can tell another caller's pushback
//! (`retryd_engine::FleetEffect::Stretched`) from the caller's own.
//!
//! A stop in force is obeyed by the store as the kill switch is: no token
//! is withdrawn for a decision the engine will deny.

use std::time::Duration;

pub use retryd_engine::FleetPushback;

/// What a decision tells the store about its upstream's pushback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Announce {
    /// Nothing: no Retry-After, no pushback.
    #[default]
    Nothing,
    /// No retry of the upstream before `now + wait` (already bounded by
    /// `max_retry_after`; never zero).
    Wait(Duration),
    /// No retry of the upstream at all until `now + window`.
    Stop(Duration),
}

impl Announce {
    /// True if there is something to write.
    pub fn is_set(&self) -> bool {
        !matches!(self, Announce::Nothing)
    }

    /// The announcement as two durations in nanoseconds (0: none): the
    /// earliest-retry time's wait and the stop window.
    pub fn nanos(&self) -> (u64, u64) {
        let nanos = |d: &Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        match self {
            Announce::Nothing => (0, 0),
            Announce::Wait(wait) => (nanos(wait), 0),
            Announce::Stop(window) => (0, nanos(window)),
        }
    }

    /// The same in whole milliseconds, rounded up (a wait is never cut
    /// short), for the Redis scripts.
    pub fn millis(&self) -> (u64, u64) {
        let (wait, stop) = self.nanos();
        (wait.div_ceil(1_000_000), stop.div_ceil(1_000_000))
    }
}

/// What a decision brings to the store about the upstream's pushback.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetCall {
    /// The pushback it reports, to write.
    pub announce: Announce,
    /// The longest fleet wait its RETRY could honour (the room its deadline
    /// leaves, when shorter than `max_retry_after`): a longer wait in force
    /// withdraws nothing, since the engine will deny it (DEADLINE), and
    /// only a final RETRY spends a token. `None`: any wait.
    pub patience: Option<Duration>,
    /// The decision's jitter draw in `[0, 1)`: during a recovery ramp of
    /// share `r`, a token is withdrawn only for a draw below `r` (the
    /// engine admits on the same draw).
    pub draw: f64,
    /// The policy's `ramp_window`: how long the share grows from 0 to 1
    /// after a fault cleared or retries were switched back on (zero: no
    /// ramp).
    pub ramp_window: Duration,
}

impl FleetCall {
    /// Nothing to announce, any wait honoured: a plain check.
    pub const PLAIN: FleetCall = FleetCall {
        announce: Announce::Nothing,
        patience: None,
        draw: 0.0,
        ramp_window: Duration::ZERO,
    };

    /// The pushback in force and the ramp, `elapsed` since the ramp began
    /// (`None`: never), as the engine reads them.
    pub fn fleet(&self, pushback: FleetPushback, elapsed: Option<Duration>) -> FleetPushback {
        let (ramp, ramp_remaining) = ramp(elapsed, self.ramp_window);
        FleetPushback {
            ramp,
            ramp_remaining,
            ..pushback
        }
    }

    /// True if the withdrawal may go ahead: no stop, a wait it bears, and
    /// a draw the ramp admits.
    pub fn lets_through(&self, fleet: &FleetPushback) -> bool {
        !fleet.stop && self.bears(fleet.wait) && fleet.admits(self.draw)
    }

    /// True if a pushback in force of `wait` lets the RETRY through.
    pub fn bears(&self, wait: Duration) -> bool {
        self.patience.is_none_or(|patience| wait <= patience)
    }

    /// The patience in whole milliseconds rounded down (-1: any), for the
    /// Redis scripts.
    pub fn patience_millis(&self) -> i64 {
        self.patience.map_or(-1, |patience| {
            i64::try_from(patience.as_millis()).unwrap_or(i64::MAX)
        })
    }
}

/// A recovery ramp's share and time left, `elapsed` after it began, over
/// `window`: the share grows linearly from 0 to 1 (README, "Recovery").
pub fn ramp(elapsed: Option<Duration>, window: Duration) -> (f64, Duration) {
    match elapsed {
        // Whole nanoseconds, divided once: Redis's script divides the same
        // milliseconds, and one correctly rounded quotient of the same real
        // number is the same double, so both admit on the same draws.
        Some(elapsed) if elapsed < window => (
            elapsed.as_nanos() as f64 / window.as_nanos() as f64,
            window - elapsed,
        ),
        _ => (1.0, Duration::ZERO),
    }
}

/// A level of the adaptive budget below which the upstream is taken as
/// failing: a later report at or above it (successes returning) starts a
/// recovery ramp.
pub const LOW_LEVEL: f64 = 0.5;

/// The pushback in force at `now` given the earliest-retry time `after`
/// and the stop's end `stop` (in the same clock's units per nanosecond
/// scale, 0 for none).
pub fn in_force(after: u64, stop: u64, now: u64, nanos_per_unit: u64) -> FleetPushback {
    FleetPushback {
        wait: Duration::from_nanos(after.saturating_sub(now).saturating_mul(nanos_per_unit)),
        stop: stop > now,
        ..FleetPushback::NONE
    }
}

/// How long from now no retry may land, for `GetBudget`: the later of the
/// earliest-retry time and the stop's end; `None` when neither is in force.
pub fn remaining(after: u64, stop: u64, now: u64, nanos_per_unit: u64) -> Option<Duration> {
    let until = after.max(stop);
    (until > now).then(|| Duration::from_nanos((until - now).saturating_mul(nanos_per_unit)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_up_to_milliseconds() {
        let wait = Announce::Wait(Duration::from_micros(1500));
        assert_eq!(wait.nanos(), (1_500_000, 0));
        assert_eq!(wait.millis(), (2, 0));
        assert_eq!(Announce::Stop(Duration::from_secs(5)).millis(), (0, 5000));
        assert!(!Announce::Nothing.is_set());
    }

    #[test]
    fn a_ramp_grows_linearly_over_its_window() {
        let window = Duration::from_secs(5);
        assert_eq!(ramp(None, window), (1.0, Duration::ZERO));
        assert_eq!(
            ramp(Some(Duration::from_secs(1)), window),
            (0.2, Duration::from_secs(4))
        );
        assert_eq!(ramp(Some(window), window), (1.0, Duration::ZERO));
        assert_eq!(ramp(Some(Duration::ZERO), Duration::ZERO).0, 1.0);
    }

    #[test]
    fn only_what_has_not_ended_is_in_force() {
        assert_eq!(in_force(0, 0, 10, 1), FleetPushback::NONE);
        let fleet = in_force(30, 12, 10, 1_000_000);
        assert_eq!(fleet.wait, Duration::from_millis(20));
        assert!(fleet.stop);
        assert!(!in_force(30, 10, 10, 1).stop);
        assert_eq!(remaining(5, 9, 10, 1), None);
        assert_eq!(remaining(30, 40, 10, 1), Some(Duration::from_nanos(30)));
    }
}
