//! The embedded budget store: lock-free token buckets in one process.
//!
//! Each bucket is two atomics: the tokens (in units) and the instant up to
//! which the floor has been credited. A refill claims an interval by moving
//! that instant forward with a compare-and-swap, so every nanosecond is
//! credited exactly once however many threads race; a withdrawal is a CAS
//! that never takes the tokens below one whole token's worth. No lock is
//! held across an `.await` because nothing here awaits: the futures are
//! ready when returned.
//!
//! The buckets live in one shared map, and each thread also keeps its own
//! index of the buckets it has used: a decision then finds its bucket with
//! no lock and no write to memory another core reads, so the only cache
//! line threads contend for is the bucket's own. Buckets are never removed,
//! so an index entry never goes stale (an eviction would have to clear the
//! indexes as well).

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::{Future, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use thread_local::ThreadLocal;

use super::{
    BucketConfig, BudgetCheck, BudgetSnapshot, BudgetStore, ReportClaim, ReportLedger, StoreError,
    UNITS_PER_TOKEN, units_to_tokens,
};

/// A source of monotonic nanoseconds. Injected so tests control time.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since an arbitrary fixed origin; never decreases.
    fn now_nanos(&self) -> u64;
}

/// The process's monotonic clock, read coarsely: on Linux the
/// `CLOCK_MONOTONIC_COARSE` clock (the time of the last scheduler tick,
/// 1–4 ms old, read from the vDSO page without touching the hardware
/// counter). A precise reading (`Instant::now`, or the TSC through quanta)
/// was a quarter of a withdrawal's cost in the profile (see BENCHMARKS.md).
///
/// A bucket needs no more: its floor adds about a token per second, so a
/// reading up to one tick late only delays that credit by a tick, and it
/// can never credit more than the time really elapsed. Readings shared by
/// concurrent withdrawals also let them skip the refill entirely.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: u64,
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock {
            origin: coarse_nanos(),
        }
    }
}

impl Clock for MonotonicClock {
    fn now_nanos(&self) -> u64 {
        coarse_nanos().saturating_sub(self.origin)
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn coarse_nanos() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    // u64 nanoseconds last 584 years of uptime.
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn coarse_nanos() -> u64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    ORIGIN
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

/// A clock that moves only when told to, for tests and simulations.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// Moves the clock forward.
    pub fn advance(&self, nanos: u64) {
        self.0.fetch_add(nanos, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_nanos(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
struct Bucket {
    units: AtomicU64,
    credited_until: AtomicU64,
    retries_enabled: AtomicBool,
}

impl Bucket {
    fn new(config: &BucketConfig, now: u64) -> Bucket {
        Bucket {
            units: AtomicU64::new(config.initial_units()),
            credited_until: AtomicU64::new(now),
            retries_enabled: AtomicBool::new(true),
        }
    }

    /// Credits the floor up to `now` and returns the units held (capped at
    /// `capacity`, the current one, which a policy reload may have lowered).
    fn refill(&self, config: &BucketConfig, now: u64, capacity: u64) -> u64 {
        let units_per_nano = config.floor_units_per_nano();
        loop {
            let since = self.credited_until.load(Ordering::Acquire);
            if now <= since {
                break;
            }
            // Less than one whole unit accrued: `config.refill` would credit
            // nothing and consume no time, so skip its float rounding (libm
            // calls on baseline x86-64), which dominated a busy bucket's
            // withdrawal. Only for a positive floor: without one, `refill`
            // consumes the interval, and so must we.
            if units_per_nano > 0.0 && ((now - since) as f64) * units_per_nano < 1.0 {
                break;
            }
            let refill = config.refill(now - since);
            if refill.nanos == 0 {
                break;
            }
            // Whoever moves `credited_until` owns that interval's credit.
            if self
                .credited_until
                .compare_exchange_weak(
                    since,
                    since + refill.nanos,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                if refill.units > 0 {
                    self.add(refill.units, capacity);
                }
                break;
            }
        }
        self.units.load(Ordering::Acquire).min(capacity)
    }

    fn add(&self, units: u64, capacity: u64) {
        // The closure always returns Some, so this cannot fail.
        let _ = self
            .units
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.min(capacity).saturating_add(units).min(capacity))
            });
    }

    /// Withdraws one token: the units left, or the units held (less than a
    /// token) if there was no whole token.
    fn try_withdraw(&self, capacity: u64) -> Result<u64, u64> {
        self.units
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.min(capacity).checked_sub(UNITS_PER_TOKEN)
            })
            .map(|before| before.min(capacity) - UNITS_PER_TOKEN)
            .map_err(|held| held.min(capacity))
    }

    /// A decision's check on a tracked bucket: refill, then withdraw one
    /// token if asked to and retries are on.
    fn check(&self, config: &BucketConfig, now: u64, withdraw: bool) -> BudgetCheck {
        let capacity = config.capacity_units();
        let held = self.refill(config, now, capacity);
        let retries_enabled = self.retries_enabled.load(Ordering::Acquire);
        let (units, withdrew) = if withdraw && retries_enabled {
            match self.try_withdraw(capacity) {
                Ok(left) => (left, true),
                Err(held) => (held, false),
            }
        } else {
            (held, false)
        };
        BudgetCheck {
            tokens: units_to_tokens(units),
            retries_enabled,
            withdrew,
        }
    }
}

/// One thread's index of the buckets it has used, by upstream.
///
/// Aligned to its own cache lines (two, for the adjacent-line prefetcher):
/// `ThreadLocal` lays the threads' values out side by side, and every
/// lookup writes the `RefCell`'s borrow flag, so unpadded indexes of two
/// threads shared a line and contended as the shard lock did.
#[derive(Debug, Default)]
#[repr(align(128))]
struct NearBuckets(RefCell<HashMap<Arc<str>, Arc<Bucket>>>);

/// In-memory budgets for one process (the default store).
#[derive(Debug)]
pub struct MemoryBudgetStore<C: Clock = MonotonicClock> {
    /// Every bucket; taking a shard lock here is the slow path.
    buckets: DashMap<Arc<str>, Arc<Bucket>>,
    /// Each thread's index into `buckets`. The shared map's read lock is an
    /// atomic write to a line every core touches: on a busy upstream it cost
    /// more than the bucket's own compare-and-swap (see BENCHMARKS.md).
    near: ThreadLocal<NearBuckets>,
    tracked: AtomicUsize,
    max_upstreams: usize,
    /// Traffic-report ids seen lately, for idempotent re-sends.
    reports: ReportLedger,
    clock: C,
}

/// Report ids a memory store remembers at most, unless told otherwise: at
/// about 200 bytes each (a 128-byte id at most, its entry and its place in
/// the expiry queue), 20 MB.
pub const DEFAULT_MAX_REPORT_IDS: usize = 100_000;

impl MemoryBudgetStore<MonotonicClock> {
    /// A store tracking at most `max_upstreams` distinct upstreams.
    pub fn new(max_upstreams: usize) -> Self {
        Self::with_clock(max_upstreams, MonotonicClock::default())
    }
}

impl<C: Clock> MemoryBudgetStore<C> {
    /// A store on the given clock.
    pub fn with_clock(max_upstreams: usize, clock: C) -> Self {
        MemoryBudgetStore {
            buckets: DashMap::new(),
            near: ThreadLocal::new(),
            tracked: AtomicUsize::new(0),
            max_upstreams,
            reports: ReportLedger::new(DEFAULT_MAX_REPORT_IDS),
            clock,
        }
    }

    /// The same store, remembering at most `max_ids` traffic-report ids.
    pub fn with_max_report_ids(mut self, max_ids: usize) -> Self {
        self.reports = ReportLedger::new(max_ids);
        self
    }

    /// Runs `f` on the upstream's bucket, creating the bucket if needed and
    /// allowed.
    fn with_bucket<T>(
        &self,
        upstream: &str,
        config: &BucketConfig,
        f: impl FnOnce(&Bucket, u64) -> T,
    ) -> Result<T, StoreError> {
        let now = self.clock.now_nanos();
        let near = self.near.get_or_default();
        if let Some(bucket) = near.0.borrow().get(upstream) {
            return Ok(f(bucket, now));
        }
        let (key, bucket) = match self.buckets.entry(upstream.into()) {
            Entry::Occupied(entry) => (Arc::clone(entry.key()), Arc::clone(entry.get())),
            Entry::Vacant(entry) => {
                // Configured upstreams are outside the limit (see
                // `BucketConfig::configured`).
                if !config.configured {
                    let limit = self.max_upstreams;
                    self.tracked
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                            (n < limit).then_some(n + 1)
                        })
                        .map_err(|_| StoreError::TooManyUpstreams { limit })?;
                }
                let key = Arc::clone(entry.key());
                let bucket = Arc::clone(entry.insert(Arc::new(Bucket::new(config, now))).value());
                (key, bucket)
            }
        };
        let answer = f(&bucket, now);
        near.0.borrow_mut().insert(key, bucket);
        Ok(answer)
    }

    /// [`BudgetStore::admit`]: room for every new upstream is reserved in
    /// one step, then their buckets are created. Off the decision path: it
    /// takes shard locks, which a decision's `check` avoids.
    fn admit_all(&self, upstreams: &[(&str, &BucketConfig)]) -> Result<(), StoreError> {
        let mut new: Vec<(&str, &BucketConfig)> = {
            let near = self.near.get_or_default().0.borrow();
            upstreams
                .iter()
                .filter(|(upstream, _)| {
                    !near.contains_key(*upstream) && !self.buckets.contains_key(*upstream)
                })
                .copied()
                .collect()
        };
        if new.is_empty() {
            return Ok(());
        }
        new.sort_unstable_by(|a, b| a.0.cmp(b.0));
        new.dedup_by(|a, b| a.0 == b.0);
        let limit = self.max_upstreams;
        let counted = new.iter().filter(|(_, config)| !config.configured).count();
        self.tracked
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(counted).filter(|total| *total <= limit)
            })
            .map_err(|_| StoreError::TooManyUpstreams { limit })?;
        // Someone may have created one of these buckets since we looked:
        // its reserved room goes back. Until it does, a racing newcomer may
        // be refused that room; the limit is never exceeded.
        let now = self.clock.now_nanos();
        let mut unused = 0;
        for (upstream, config) in new {
            match self.buckets.entry(upstream.into()) {
                Entry::Occupied(_) if !config.configured => unused += 1,
                Entry::Occupied(_) => {}
                Entry::Vacant(entry) => {
                    entry.insert(Arc::new(Bucket::new(config, now)));
                }
            }
        }
        if unused > 0 {
            self.tracked.fetch_sub(unused, Ordering::AcqRel);
        }
        Ok(())
    }

    /// A look that creates nothing: the check of a bucket that exists, or
    /// what a fresh one would hold. Returns whether the bucket exists.
    fn look(&self, upstream: &str, config: &BucketConfig) -> (BudgetCheck, bool) {
        let near = self.near.get_or_default();
        if let Some(bucket) = near.0.borrow().get(upstream) {
            return (bucket.check(config, self.clock.now_nanos(), false), true);
        }
        let shared = self
            .buckets
            .get(upstream)
            .map(|entry| (Arc::clone(entry.key()), Arc::clone(entry.value())));
        match shared {
            Some((key, bucket)) => {
                let check = bucket.check(config, self.clock.now_nanos(), false);
                near.0.borrow_mut().insert(key, bucket);
                (check, true)
            }
            None => (
                BudgetCheck {
                    tokens: units_to_tokens(config.initial_units()),
                    retries_enabled: true,
                    withdrew: false,
                },
                false,
            ),
        }
    }
}

impl<C: Clock> BudgetStore for MemoryBudgetStore<C> {
    // Every method returns `std::future::Ready`.
    const ANSWERS_AT_ONCE: bool = true;

    fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<BudgetSnapshot, StoreError>> + Send {
        let (check, tracked) = self.look(upstream, config);
        ready(Ok(check.into_snapshot(upstream, tracked)))
    }

    fn check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        ready(if withdraw {
            self.with_bucket(upstream, config, |bucket, now| {
                bucket.check(config, now, true)
            })
        } else {
            Ok(self.look(upstream, config).0)
        })
    }

    fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        ready(self.with_bucket(upstream, config, |bucket, now| {
            let capacity = config.capacity_units();
            bucket.refill(config, now, capacity);
            bucket.try_withdraw(capacity).ok().map(units_to_tokens)
        }))
    }

    fn admit(
        &self,
        upstreams: &[(&str, &BucketConfig)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        ready(self.admit_all(upstreams))
    }

    fn deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        ready(self.with_bucket(upstream, config, |bucket, now| {
            let capacity = config.capacity_units();
            bucket.refill(config, now, capacity);
            bucket.add(config.deposit_units(requests), capacity);
        }))
    }

    fn claim_report(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        window: std::time::Duration,
    ) -> impl Future<Output = Result<ReportClaim, StoreError>> + Send {
        let window = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        let now = self.clock.now_nanos();
        ready(Ok(self.reports.claim(id, digest, entries, now, window)))
    }

    fn settle_report(
        &self,
        id: &str,
        digest: u64,
        applied: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.reports.settle(id, digest, applied);
        ready(Ok(()))
    }

    fn set_retries_enabled(
        &self,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        ready(self.with_bucket(upstream, config, |bucket, _| {
            bucket.retries_enabled.swap(enabled, Ordering::AcqRel)
        }))
    }

    fn list<F>(
        &self,
        config_of: F,
    ) -> impl Future<Output = Result<Vec<BudgetSnapshot>, StoreError>> + Send
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        let now = self.clock.now_nanos();
        let mut snapshots: Vec<BudgetSnapshot> = self
            .buckets
            .iter()
            .map(|entry| {
                let config = config_of(entry.key());
                BudgetSnapshot {
                    upstream: entry.key().to_string(),
                    tokens: units_to_tokens(entry.value().refill(
                        &config,
                        now,
                        config.capacity_units(),
                    )),
                    retries_enabled: entry.value().retries_enabled.load(Ordering::Acquire),
                    tracked: true,
                }
            })
            .collect();
        snapshots.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        ready(Ok(snapshots))
    }
}

#[cfg(test)]
mod tests;
