//! Leases, leased mode only: what one is (whole tokens this replica alone
//! spends, until half its `lease_ttl`), how big the next one is (doubling
//! for a busy upstream, halving for a quiet one, within a cap), taking one
//! (the acquire script hands the previous one back in the same call),
//! retiring one and queueing its return. An acquisition whose answer never
//! came counts as consumed; a return that fails is forfeited: budgets err
//! towards fewer retries. Spending is in `leased.rs`, the returns are sent
//! by `rounds.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use tokio::time::Instant;

use super::Failure;
use super::leased::{LeaseState, Leased};
use super::shared::{Core, Upstream, bump, lock};
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
    taken_at: Instant,
    /// Local spending ends here, half a `lease_ttl` before Redis forgets
    /// the lease, so that the return arrives while it is still live.
    spend_until: Instant,
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
enum LeaseEnd {
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
fn lease_cap(min_units: u64, max_units: u64, capacity_units: u64) -> u64 {
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

impl LeaseState {
    /// Resizes the next lease after one ended; returns the new size.
    fn resize_lease(&self, end: LeaseEnd, min_units: u64, cap: u64) -> u64 {
        let resize = |size| next_lease_units(size, end, min_units, cap);
        // The closure always answers Some, so this never fails.
        let before = self
            .lease_size
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |size| {
                Some(resize(size))
            })
            .unwrap_or_else(|size| size);
        resize(before)
    }
}

impl Leased {
    /// The largest lease of a bucket (see [`lease_cap`]).
    fn lease_cap(&self, config: &BucketConfig) -> u64 {
        lease_cap(
            self.lease_units,
            self.max_lease_units,
            config.capacity_units(),
        )
    }
}

impl Core<Leased> {
    /// Takes a new lease and spends one token of it. `Ok(Some(left))`: a
    /// token was granted; `Ok(None)`: the bucket had no whole token.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        state: &Arc<Upstream<LeaseState>>,
        deadline: Instant,
    ) -> Result<Option<u64>, Failure> {
        let (mode, held) = (&self.mode, &state.mode);
        // The previous lease (dry, or expired with tokens left) goes back in
        // the same script: until then it occupies room in the bucket.
        let previous = lock(&held.lease).take();
        let (previous_member, previous_unused) = match &previous {
            Some(lease) => (
                lease.member.as_str(),
                lease.remaining.swap(0, Ordering::AcqRel),
            ),
            None => ("", 0),
        };
        let taken_at = Instant::now();
        let end = match &previous {
            Some(_) if previous_unused > 0 => LeaseEnd::LeftOver,
            Some(lease) if taken_at.duration_since(lease.taken_at) <= mode.lease_ttl / 4 => {
                LeaseEnd::DrainedQuickly
            }
            _ => LeaseEnd::Drained,
        };
        // Resized even without a previous lease: the capacity may have
        // been lowered since.
        let requested = held.resize_lease(end, mode.lease_units, mode.lease_cap(config));
        let sequence = mode.lease_sequence.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{sequence}", mode.replica);
        let spend_until = taken_at + mode.lease_ttl / 2;
        let lease_units = requested.to_string();
        let ttl_ms = (mode.lease_ttl.as_millis() as u64).max(1).to_string();
        let unused = previous_unused.to_string();
        let result = self
            .run_bucket(
                &self.scripts.acquire,
                upstream,
                config,
                &[&id, &lease_units, &ttl_ms, previous_member, &unused],
                deadline,
            )
            .await;
        let reply = match result {
            Ok(reply) => reply,
            Err(failure) => {
                if let Some(lease) = previous {
                    match failure {
                        // Redis saw nothing: return the old lease later.
                        Failure::NotSent => {
                            self.queue_return(upstream, state, &lease, previous_unused)
                        }
                        // It may have been credited back, or not: forfeit.
                        Failure::Unknown(_) => {
                            bump(&self.counters.forfeited_units, previous_unused);
                        }
                    }
                }
                return Err(failure);
            }
        };
        bump(&mode.lease_acquisitions, 1);
        self.after_write(upstream, state, &reply);
        let taken = reply.result.max(0) as u64;
        if taken < UNITS_PER_TOKEN {
            return Ok(None);
        }
        let left = taken - UNITS_PER_TOKEN;
        *lock(&held.lease) = Some(Arc::new(Lease {
            member: format!("{id}:{taken}"),
            remaining: AtomicU64::new(left),
            taken_at,
            spend_until,
        }));
        Ok(Some(left))
    }

    /// Takes the upstream's lease out of use if it has expired (or always,
    /// with `all`), queueing what it has left for return.
    pub(super) fn retire_lease(
        &self,
        upstream: &str,
        state: &Upstream<LeaseState>,
        now: Instant,
        all: bool,
    ) {
        let lease = {
            let mut slot = lock(&state.mode.lease);
            match slot.as_ref() {
                Some(lease) if all || now >= lease.spend_until => slot.take(),
                _ => None,
            }
        };
        let Some(lease) = lease else { return };
        // A spender racing with this swap either took its token first or
        // finds nothing: the same unit is never both spent and returned.
        let units = lease.remaining.swap(0, Ordering::AcqRel);
        if units > 0 {
            state.mode.resize_lease(
                LeaseEnd::LeftOver,
                self.mode.lease_units,
                self.mode.lease_cap(&state.config()),
            );
        }
        // Returned even when dry: a live lease occupies room in the bucket.
        self.queue_return(upstream, state, &lease, units);
    }

    fn queue_return(
        &self,
        upstream: &str,
        state: &Upstream<LeaseState>,
        lease: &Lease,
        units: u64,
    ) {
        let mut returns = lock(&self.mode.returns);
        if returns.len() >= self.max_upstreams.max(64) {
            bump(&self.counters.forfeited_units, units);
            return;
        }
        returns.push(Return {
            upstream: upstream.into(),
            member: lease.member.clone(),
            units,
            config: state.config(),
        });
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
    fn an_upstream_starts_at_lease_tokens_and_resizes_atomically() {
        let state = LeaseState::new(2 * T);
        assert_eq!(state.lease_size.load(Ordering::Acquire), 2 * T);
        assert_eq!(
            state.resize_lease(LeaseEnd::DrainedQuickly, 2 * T, 100 * T),
            4 * T
        );
        assert_eq!(
            state.resize_lease(LeaseEnd::LeftOver, 2 * T, 100 * T),
            2 * T
        );
        assert_eq!(state.lease_size.load(Ordering::Acquire), 2 * T);
    }
}
