//! Leases, leased mode only, as values: what one is (whole tokens this
//! replica alone spends, until half its `lease_ttl`), how big the next one
//! is (doubling for a busy upstream, halving for a quiet one, within a
//! cap), how the last acquisition went, and a lease to hand back. A leaf:
//! it knows no core and no connection; taking, retiring and returning
//! leases is the mode's (`leased/spend.rs`, `leased/returns.rs`).

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use tokio::time::Instant;

use crate::{BucketConfig, UNITS_PER_TOKEN};

/// How the last acquisition of an upstream went, for the tasks that waited
/// for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Acquisition {
    /// A lease was granted.
    Acquired,
    /// The shared bucket had no whole token.
    Empty,
    /// Redis did not answer and is believed down.
    Failed,
}

/// The last [`Acquisition`], written by the task that asked Redis and read
/// by the tasks that waited for it (one byte, so no lock).
#[derive(Debug)]
pub(super) struct LastAcquisition(AtomicU8);

impl LastAcquisition {
    pub(super) fn new(acquisition: Acquisition) -> LastAcquisition {
        LastAcquisition(AtomicU8::new(acquisition as u8))
    }

    pub(super) fn load(&self) -> Acquisition {
        match self.0.load(Ordering::Acquire) {
            1 => Acquisition::Empty,
            2 => Acquisition::Failed,
            _ => Acquisition::Acquired,
        }
    }

    pub(super) fn store(&self, acquisition: Acquisition) {
        self.0.store(acquisition as u8, Ordering::Release);
    }
}

/// Whole tokens taken from the shared bucket, spent by this replica alone.
#[derive(Debug)]
pub(super) struct Lease {
    /// `<lease id>:<units>`, the member of the upstream's lease set.
    pub(super) member: String,
    pub(super) remaining: AtomicU64,
    /// When it was asked for, to tell a lease that ran dry quickly (the
    /// next should be bigger) from one that merely ran dry.
    pub(super) taken_at: Instant,
    /// Local spending ends here, half a `lease_ttl` before Redis forgets
    /// the lease, so that the return arrives while it is still live.
    pub(super) spend_until: Instant,
}

impl Lease {
    /// Spends one token: a compare-and-swap, never check-then-decrement.
    /// Returns the units left.
    pub(super) fn try_spend(&self, now: Instant) -> Option<u64> {
        if now >= self.spend_until {
            return None;
        }
        self.remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_sub(UNITS_PER_TOKEN)
            })
            .ok()
            .map(|before| before - UNITS_PER_TOKEN)
    }

    pub(super) fn available(&self, now: Instant) -> u64 {
        if now >= self.spend_until {
            0
        } else {
            self.remaining.load(Ordering::Acquire)
        }
    }
}

/// How a lease ended, as far as the size of the next one is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaseEnd {
    /// Spent within a quarter of `lease_ttl`: demand outruns the lease, and
    /// every refill is a round trip others wait for.
    DrainedQuickly,
    /// Spent, but not quickly, or nothing to judge by: the size fits.
    Drained,
    /// Expired or handed back with tokens left: the lease was bigger than
    /// the demand, and the surplus sat idle in this replica.
    LeftOver,
}

/// The largest lease for a bucket, in units: `max_units`, and a quarter of
/// the capacity so that one replica never holds most of a small bucket,
/// both in whole tokens; never below `min_units` (`lease_tokens`), the size
/// a lease always had.
pub(super) fn lease_cap(min_units: u64, max_units: u64, capacity_units: u64) -> u64 {
    let whole = |units: u64| units / UNITS_PER_TOKEN * UNITS_PER_TOKEN;
    whole(max_units.min(capacity_units / 4)).max(min_units)
}

/// The size of the next lease, in units: double after one that ran dry
/// quickly (fewer round trips for a busy upstream), half after one that
/// had tokens left (fewer tokens idle for a quiet one), within
/// `min_units..=cap`. Sizes stay whole tokens: the acquire script leases
/// only whole tokens, and a fraction would be returned unspent.
fn next_lease_units(current: u64, end: LeaseEnd, min_units: u64, cap: u64) -> u64 {
    let next = match end {
        LeaseEnd::DrainedQuickly => current.saturating_mul(2),
        LeaseEnd::Drained => current,
        LeaseEnd::LeftOver => current / 2 / UNITS_PER_TOKEN * UNITS_PER_TOKEN,
    };
    next.min(cap).max(min_units)
}

/// A lease to hand back to Redis.
#[derive(Debug)]
pub(super) struct Return {
    pub(super) upstream: Box<str>,
    pub(super) member: String,
    pub(super) units: u64,
    pub(super) config: BucketConfig,
}

/// The size of an upstream's next lease, in units (see
/// [`next_lease_units`]), resized by whichever task saw a lease end.
#[derive(Debug)]
pub(super) struct LeaseSize(AtomicU64);

impl LeaseSize {
    pub(super) fn new(units: u64) -> LeaseSize {
        LeaseSize(AtomicU64::new(units))
    }

    /// Resizes the next lease after one ended; returns the new size.
    pub(super) fn resize(&self, end: LeaseEnd, min_units: u64, cap: u64) -> u64 {
        let resize = |size| next_lease_units(size, end, min_units, cap);
        // The closure always answers Some, so this never fails.
        let before = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |size| {
                Some(resize(size))
            })
            .unwrap_or_else(|size| size);
        resize(before)
    }

    #[cfg(test)]
    fn load(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = UNITS_PER_TOKEN;

    #[test]
    fn leases_double_when_drained_quickly_and_halve_when_left_over() {
        let (min, cap) = (5 * T, 1000 * T);
        let next = |size, end| next_lease_units(size, end, min, cap);
        assert_eq!(next(5 * T, LeaseEnd::DrainedQuickly), 10 * T);
        assert_eq!(next(10 * T, LeaseEnd::Drained), 10 * T);
        assert_eq!(next(40 * T, LeaseEnd::LeftOver), 20 * T);
        // Halving stays in whole tokens and never goes below the minimum.
        assert_eq!(next(25 * T, LeaseEnd::LeftOver), 12 * T);
        assert_eq!(next(8 * T, LeaseEnd::LeftOver), 5 * T);
        assert_eq!(next(5 * T, LeaseEnd::LeftOver), 5 * T);
        // Doubling stops at the cap, and never overflows.
        assert_eq!(next(640 * T, LeaseEnd::DrainedQuickly), 1000 * T);
        assert_eq!(next(1000 * T, LeaseEnd::DrainedQuickly), 1000 * T);
        assert_eq!(
            next_lease_units(u64::MAX, LeaseEnd::DrainedQuickly, 0, u64::MAX),
            u64::MAX
        );
        // A lowered cap applies at once, even to a lease that fitted.
        assert_eq!(
            next_lease_units(800 * T, LeaseEnd::Drained, min, 100 * T),
            100 * T
        );
        // From the minimum up to the cap and back, by steps of two.
        let mut size = min;
        let mut grown = vec![size];
        while size < cap {
            size = next(size, LeaseEnd::DrainedQuickly);
            grown.push(size / T);
        }
        assert_eq!(grown[1..], [10, 20, 40, 80, 160, 320, 640, 1000]);
        let mut steps = 0;
        while size > min {
            size = next(size, LeaseEnd::LeftOver);
            steps += 1;
        }
        assert_eq!((size, steps), (min, 8));
    }

    #[test]
    fn leases_are_capped_at_a_quarter_of_the_capacity_in_whole_tokens() {
        // A large bucket: max_lease_tokens caps.
        assert_eq!(lease_cap(5 * T, 1000 * T, 1_000_000_000 * T), 1000 * T);
        // A small one: a quarter of its capacity, in whole tokens.
        assert_eq!(lease_cap(5 * T, 1000 * T, 100 * T), 25 * T);
        assert_eq!(lease_cap(T, 1000 * T, 30 * T), 7 * T);
        assert_eq!(lease_cap(T, 1000 * T, 30 * T + T / 2), 7 * T);
        // Never below lease_tokens, which is what a lease always was.
        assert_eq!(lease_cap(5 * T, 1000 * T, 8 * T), 5 * T);
        assert_eq!(lease_cap(5 * T, 5 * T, 1_000 * T), 5 * T);
    }

    #[test]
    fn a_lease_size_starts_at_lease_tokens_and_resizes_atomically() {
        let size = LeaseSize::new(2 * T);
        assert_eq!(size.load(), 2 * T);
        assert_eq!(size.resize(LeaseEnd::DrainedQuickly, 2 * T, 100 * T), 4 * T);
        assert_eq!(size.resize(LeaseEnd::LeftOver, 2 * T, 100 * T), 2 * T);
        assert_eq!(size.load(), 2 * T);
    }
}
