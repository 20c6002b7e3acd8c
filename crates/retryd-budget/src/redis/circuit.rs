//! Whether one Redis (a node, or the whole store) is believed reachable.
//! After a connection error, or `TIMEOUTS_TO_OPEN` timeouts in a row,
//! requests stop waiting on Redis and answer from their fallback at once;
//! one request (or the background task) re-probes every `PROBE_INTERVAL`,
//! and the first success closes the circuit again. Lock-free: three
//! atomics.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
// The store's one clock, tokio's (the same instant as `std` outside tests), so
// that a test pausing it moves probes, deadlines and caches together.
use tokio::time::Instant;

/// How often Redis is re-tried while it is believed down.
pub(super) const PROBE_INTERVAL: Duration = Duration::from_millis(150);

/// Timeouts in a row, with no answer between them, that open a circuit.
/// One late answer is not an outage: on a busy machine a live node's
/// answer misses the default 20 ms timeout now and then, and opening on it
/// sent every upstream of that master to its fallback for a whole probe
/// interval (issue 37: 150 ms of fallbacks on a live master). A node that
/// stopped answering times out every request, so waiting for three costs
/// two more timeouts, not an interval.
///
/// In a row means one after the other: a request that was already in
/// flight when an earlier one timed out waited through the same silence,
/// and says nothing more. Counting them opened a live master's circuit
/// after a single 45 ms stall that three upstreams' requests were waiting
/// through together (issue 37, with a Cluster failover under way).
pub(super) const TIMEOUTS_TO_OPEN: u32 = 3;

#[derive(Debug)]
pub(super) struct Circuit {
    origin: Instant,
    up: AtomicBool,
    /// Timeouts since the last answer, while up.
    timeouts: AtomicU32,
    /// Milliseconds since `origin` when the last counted timeout was seen.
    last_timeout: AtomicU64,
    /// Milliseconds since `origin` before which no probe is sent.
    next_probe: AtomicU64,
}

/// What a success or failure changed, for logging once per transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Transition {
    None,
    Opened,
    Closed,
}

impl Circuit {
    pub(super) fn new() -> Circuit {
        Circuit {
            origin: Instant::now(),
            up: AtomicBool::new(true),
            timeouts: AtomicU32::new(0),
            last_timeout: AtomicU64::new(0),
            next_probe: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub(super) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// True if a call may go to Redis now: always while up, else for the
    /// one caller that claims the next probe slot.
    pub(super) fn allow(&self) -> bool {
        if self.is_up() {
            return true;
        }
        self.claim_probe()
    }

    /// True if a probe is due and this caller claimed it.
    pub(super) fn claim_probe(&self) -> bool {
        let now = self.now_ms();
        let next = self.next_probe.load(Ordering::Acquire);
        now >= next
            && self
                .next_probe
                .compare_exchange(
                    next,
                    now + PROBE_INTERVAL.as_millis() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    pub(super) fn success(&self) -> Transition {
        self.timeouts.store(0, Ordering::Release);
        if self.up.swap(true, Ordering::AcqRel) {
            Transition::None
        } else {
            Transition::Closed
        }
    }

    /// A request sent at `sent` that got no answer in time: opens the
    /// circuit at the `TIMEOUTS_TO_OPEN`th in a row (at once while it is
    /// open, to push the next probe back). One sent before the last counted
    /// timeout was seen is not counted: it waited through the same silence.
    pub(super) fn timeout(&self, sent: Instant) -> Transition {
        if !self.is_up() {
            return self.failure();
        }
        let sent = sent.saturating_duration_since(self.origin).as_millis() as u64;
        let now = self.now_ms();
        let last = self.last_timeout.load(Ordering::Acquire);
        if self.timeouts.load(Ordering::Acquire) > 0 && sent < last {
            return Transition::None;
        }
        // Of two timeouts seen together, one counts.
        if self
            .last_timeout
            .compare_exchange(last, now.max(last), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Transition::None;
        }
        if self.timeouts.fetch_add(1, Ordering::AcqRel) + 1 < TIMEOUTS_TO_OPEN {
            return Transition::None;
        }
        self.failure()
    }

    /// A request that failed: the connection is gone (refused, reset,
    /// closed) or the node answered with an error. Opens the circuit.
    pub(super) fn failure(&self) -> Transition {
        self.timeouts.store(0, Ordering::Release);
        self.next_probe.store(
            self.now_ms() + PROBE_INTERVAL.as_millis() as u64,
            Ordering::Release,
        );
        if self.up.swap(false, Ordering::AcqRel) {
            Transition::Opened
        } else {
            Transition::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_probe_per_interval_while_down() {
        let circuit = Circuit::new();
        assert!(circuit.allow());
        assert_eq!(circuit.failure(), Transition::Opened);
        assert_eq!(circuit.failure(), Transition::None);
        assert!(!circuit.allow(), "no probe before the interval");
        std::thread::sleep(PROBE_INTERVAL + Duration::from_millis(5));
        assert!(circuit.allow(), "one probe after it");
        assert!(!circuit.allow(), "and only one");
        assert_eq!(circuit.success(), Transition::Closed);
        assert!(circuit.allow());
    }

    #[test]
    fn timeouts_open_only_in_a_row() {
        let circuit = Circuit::new();
        // Each request sent after the previous one timed out.
        let sent = || {
            std::thread::sleep(Duration::from_millis(2));
            Instant::now()
        };
        for _ in 0..TIMEOUTS_TO_OPEN - 1 {
            assert_eq!(circuit.timeout(sent()), Transition::None);
        }
        assert_eq!(
            circuit.success(),
            Transition::None,
            "an answer between them"
        );
        for _ in 0..TIMEOUTS_TO_OPEN - 1 {
            assert_eq!(circuit.timeout(sent()), Transition::None);
            assert!(circuit.is_up());
        }
        assert_eq!(circuit.timeout(sent()), Transition::Opened);
        assert!(!circuit.allow());
        assert_eq!(circuit.timeout(sent()), Transition::None, "already open");
        assert_eq!(circuit.success(), Transition::Closed);
        assert_eq!(
            circuit.timeout(sent()),
            Transition::None,
            "the count starts again"
        );
        assert!(circuit.is_up());
    }

    #[test]
    fn requests_waiting_through_one_silence_are_one_timeout() {
        let circuit = Circuit::new();
        // Many requests sent together, all timing out in the same stall.
        let together = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        for _ in 0..10 * TIMEOUTS_TO_OPEN {
            assert_eq!(circuit.timeout(together), Transition::None);
        }
        assert!(circuit.is_up(), "one stall is one timeout");
        // The silence goes on: requests sent after it was seen time out too.
        for _ in 0..TIMEOUTS_TO_OPEN - 2 {
            std::thread::sleep(Duration::from_millis(2));
            assert_eq!(circuit.timeout(Instant::now()), Transition::None);
        }
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(circuit.timeout(Instant::now()), Transition::Opened);
    }
}
