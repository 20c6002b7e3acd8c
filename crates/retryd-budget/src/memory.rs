//! The embedded budget store: lock-free token buckets in one process.
//!
//! About 600 lines: the buckets, the per-thread index and its consistency
//! with eviction are one mechanism and are read together; the sweep itself
//! is `memory/eviction.rs` and the tests `memory/tests.rs`.
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
//! line threads contend for is the bucket's own.
//!
//! Idle unconfigured buckets are evicted by a sweep off the decision path
//! (`eviction.rs`), only once they hold at least their initial tokens, so a
//! bucket created again later grants nothing the old one would not have. An
//! evicted bucket's tokens are set to [`EVICTED`] in the same
//! compare-and-swap that checked its level, and every operation treats that
//! value as "gone": a thread whose index still holds the old bucket fails
//! on it, drops it and looks the upstream up again, so no thread ever spends
//! from, deposits to or reads an evicted bucket. Each thread prunes evicted
//! buckets from its own index when it sees that the store's eviction count
//! moved (one load of a line that only a sweep writes), so their memory is
//! given back.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{Future, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use thread_local::ThreadLocal;

use super::pushback::{self, FleetCall};
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

mod eviction;

/// The tokens of a bucket that was evicted: no capacity reaches it (it is
/// not a whole number of tokens), and every operation refuses it.
const EVICTED: u64 = u64::MAX;

#[derive(Debug)]
struct Bucket {
    /// Tokens in units, or [`EVICTED`].
    units: AtomicU64,
    /// The floor is credited up to here; it also tells how long the bucket
    /// has been idle, since every operation but the kill switch refills.
    credited_until: AtomicU64,
    retries_enabled: AtomicBool,
    /// The bucket holds a place under `max_upstreams` (it was created for
    /// an unconfigured upstream and has not been evicted).
    counted: AtomicBool,
    /// The fleet's earliest-retry time and the end of a stop window, on
    /// the store's clock (0: never set). Beside the tokens, so a decision
    /// reads them in the cache line it already has (`pushback.rs`).
    pushback_after: AtomicU64,
    pushback_stop: AtomicU64,
    /// When the last recovery ramp began, plus one (0: never), on the
    /// store's clock.
    ramp_from: AtomicU64,
    /// The adaptive level last noted, as `f64` bits.
    level: AtomicU64,
}

impl Bucket {
    fn new(config: &BucketConfig, now: u64) -> Bucket {
        Bucket {
            units: AtomicU64::new(config.initial_units()),
            credited_until: AtomicU64::new(now),
            retries_enabled: AtomicBool::new(true),
            counted: AtomicBool::new(!config.configured),
            pushback_after: AtomicU64::new(0),
            pushback_stop: AtomicU64::new(0),
            ramp_from: AtomicU64::new(0),
            level: AtomicU64::new(1.0f64.to_bits()),
        }
    }

    /// Starts a recovery ramp now.
    fn start_ramp(&self, now: u64) {
        self.ramp_from
            .store(now.saturating_add(1), Ordering::Release);
    }

    /// How long ago the last ramp began.
    fn ramp_elapsed(&self, now: u64) -> Option<std::time::Duration> {
        match self.ramp_from.load(Ordering::Acquire) {
            0 => None,
            from => Some(std::time::Duration::from_nanos(
                now.saturating_sub(from - 1),
            )),
        }
    }

    fn level(&self) -> f64 {
        f64::from_bits(self.level.load(Ordering::Acquire))
    }

    /// The pushback before `fleet.announce`, then the announcement written
    /// "set if later": (earliest-retry time, stop's end), as they were.
    fn announce(&self, fleet: FleetCall, now: u64) -> (u64, u64) {
        let (wait, stop) = fleet.announce.nanos();
        let after = if wait > 0 {
            self.pushback_after
                .fetch_max(now.saturating_add(wait), Ordering::AcqRel)
        } else {
            self.pushback_after.load(Ordering::Acquire)
        };
        let stop = if stop > 0 {
            self.pushback_stop
                .fetch_max(now.saturating_add(stop), Ordering::AcqRel)
        } else {
            self.pushback_stop.load(Ordering::Acquire)
        };
        (after, stop)
    }

    fn is_evicted(&self) -> bool {
        self.units.load(Ordering::Acquire) == EVICTED
    }

    /// Credits the floor up to `now` and returns the units held (capped at
    /// `capacity`, the current one, which a policy reload may have lowered),
    /// or `None` if the bucket was evicted.
    fn refill(&self, config: &BucketConfig, now: u64, capacity: u64) -> Option<u64> {
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
                    // An eviction in between is seen by the load below.
                    self.add(refill.units, capacity);
                }
                break;
            }
        }
        let held = self.units.load(Ordering::Acquire);
        (held != EVICTED).then(|| held.min(capacity))
    }

    /// Adds units up to `capacity`; false (and nothing added) if the
    /// bucket was evicted.
    fn add(&self, units: u64, capacity: u64) -> bool {
        self.units
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held != EVICTED).then(|| held.min(capacity).saturating_add(units).min(capacity))
            })
            .is_ok()
    }

    /// Withdraws one token: `Some(Ok(units left))`, `Some(Err(units held))`
    /// (less than a token) if there was no whole token, `None` if the
    /// bucket was evicted.
    fn try_withdraw(&self, capacity: u64) -> Option<Result<u64, u64>> {
        match self
            .units
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                if held == EVICTED {
                    return None;
                }
                held.min(capacity).checked_sub(UNITS_PER_TOKEN)
            }) {
            Ok(before) => Some(Ok(before.min(capacity) - UNITS_PER_TOKEN)),
            Err(EVICTED) => None,
            Err(held) => Some(Err(held.min(capacity))),
        }
    }

    /// A decision's check on a tracked bucket: refill, then withdraw one
    /// token if asked to and retries are on; `None` if it was evicted.
    fn check(
        &self,
        config: &BucketConfig,
        now: u64,
        withdraw: bool,
        fleet: FleetCall,
    ) -> Option<BudgetCheck> {
        let capacity = config.capacity_units();
        let held = self.refill(config, now, capacity)?;
        let retries_enabled = self.retries_enabled.load(Ordering::Acquire);
        let (after, stop) = self.announce(fleet, now);
        let ramp_elapsed = self.ramp_elapsed(now);
        let pushback = fleet.fleet(pushback::in_force(after, stop, now, 1), ramp_elapsed);
        let (units, withdrew) = if withdraw && retries_enabled && fleet.lets_through(&pushback) {
            match self.try_withdraw(capacity)? {
                Ok(left) => (left, true),
                Err(held) => (held, false),
            }
        } else {
            (held, false)
        };
        Some(BudgetCheck {
            tokens: units_to_tokens(units),
            retries_enabled,
            withdrew,
            pushback,
            pushback_remaining: pushback::remaining(after, stop, now, 1),
            adaptive_level: self.level(),
            ramp_elapsed,
        })
    }
}

/// One thread's index of the buckets it has used, by upstream.
///
/// Aligned to its own cache lines (two, for the adjacent-line prefetcher):
/// `ThreadLocal` lays the threads' values out side by side, and every
/// lookup writes the `RefCell`'s borrow flag, so unpadded indexes of two
/// threads shared a line and contended as the shard lock did.
///
/// `pruned` is the store's eviction count when this index last dropped its
/// evicted buckets.
#[derive(Debug, Default)]
#[repr(align(128))]
struct NearBuckets {
    map: RefCell<HashMap<Arc<str>, Arc<Bucket>>>,
    pruned: Cell<u64>,
}

/// In-memory budgets for one process (the default store).
#[derive(Debug)]
pub struct MemoryBudgetStore<C: Clock = MonotonicClock> {
    /// Every bucket; taking a shard lock here is the slow path.
    buckets: DashMap<Arc<str>, Arc<Bucket>>,
    /// Each thread's index into `buckets`. The shared map's read lock is an
    /// atomic write to a line every core touches: on a busy upstream it cost
    /// more than the bucket's own compare-and-swap (see BENCHMARKS.md).
    near: ThreadLocal<NearBuckets>,
    /// Buckets holding a place under `max_upstreams`.
    tracked: AtomicUsize,
    max_upstreams: usize,
    /// Traffic-report ids seen lately, for idempotent re-sends.
    reports: ReportLedger,
    /// Buckets evicted since start; written only by a sweep, read by every
    /// operation to tell whether its thread's index needs pruning.
    evictions: AtomicU64,
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
            evictions: AtomicU64::new(0),
            clock,
        }
    }

    /// The same store, remembering at most `max_ids` traffic-report ids.
    pub fn with_max_report_ids(mut self, max_ids: usize) -> Self {
        self.reports = ReportLedger::new(max_ids);
        self
    }

    /// This thread's index, first cleared of evicted buckets if a sweep
    /// evicted any since it was last pruned: one load on the common path.
    fn near(&self) -> &NearBuckets {
        let near = self.near.get_or_default();
        let evictions = self.evictions.load(Ordering::Acquire);
        if near.pruned.get() != evictions {
            near.map
                .borrow_mut()
                .retain(|_, bucket| !bucket.is_evicted());
            near.pruned.set(evictions);
        }
        near
    }

    /// Runs `f` on the upstream's bucket, creating the bucket if needed and
    /// allowed. `f` answers `None` when it found the bucket evicted (having
    /// changed nothing): the upstream is then looked up again, and found
    /// anew or created, so nothing is ever done to an evicted bucket.
    fn with_bucket<T>(
        &self,
        upstream: &str,
        config: &BucketConfig,
        f: impl Fn(&Bucket, u64) -> Option<T>,
    ) -> Result<T, StoreError> {
        let now = self.clock.now_nanos();
        let near = self.near();
        let found = near.map.borrow().get(upstream).map(|bucket| f(bucket, now));
        match found {
            Some(Some(answer)) => return Ok(answer),
            Some(None) => {
                near.map.borrow_mut().remove(upstream);
            }
            None => {}
        }
        loop {
            let (key, bucket) = self.shared_or_new(upstream, config, now)?;
            // An eviction can only take a bucket that has been idle for a
            // while, so a bucket just found or made is not taken again.
            if let Some(answer) = f(&bucket, now) {
                near.map.borrow_mut().insert(key, bucket);
                return Ok(answer);
            }
        }
    }

    /// The upstream's bucket from the shared map, created there if new and
    /// allowed.
    fn shared_or_new(
        &self,
        upstream: &str,
        config: &BucketConfig,
        now: u64,
    ) -> Result<(Arc<str>, Arc<Bucket>), StoreError> {
        Ok(match self.buckets.entry(upstream.into()) {
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
        })
    }

    /// [`BudgetStore::admit`]: room for every new upstream is reserved in
    /// one step, then their buckets are created. Off the decision path: it
    /// takes shard locks, which a decision's `check` avoids.
    fn admit_all(&self, upstreams: &[(&str, &BucketConfig)]) -> Result<(), StoreError> {
        let mut new: Vec<(&str, &BucketConfig)> = {
            let near = self.near().map.borrow();
            upstreams
                .iter()
                .filter(|(upstream, _)| {
                    // An evicted bucket still in the index is no bucket.
                    near.get(*upstream).is_none_or(|bucket| bucket.is_evicted())
                        && !self.buckets.contains_key(*upstream)
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
    fn look(&self, upstream: &str, config: &BucketConfig, fleet: FleetCall) -> (BudgetCheck, bool) {
        let near = self.near();
        let now = self.clock.now_nanos();
        let found = near
            .map
            .borrow()
            .get(upstream)
            .map(|bucket| bucket.check(config, now, false, fleet));
        match found {
            Some(Some(check)) => return (check, true),
            Some(None) => {
                near.map.borrow_mut().remove(upstream);
            }
            None => {}
        }
        let shared = self
            .buckets
            .get(upstream)
            .map(|entry| (Arc::clone(entry.key()), Arc::clone(entry.value())));
        // Evicted since the map lookup: then it is as good as absent.
        if let Some((key, bucket)) = shared {
            if let Some(check) = bucket.check(config, now, false, fleet) {
                near.map.borrow_mut().insert(key, bucket);
                return (check, true);
            }
        }
        (
            BudgetCheck {
                tokens: units_to_tokens(config.initial_units()),
                retries_enabled: true,
                withdrew: false,
                pushback: pushback::FleetPushback::NONE,
                pushback_remaining: None,
                adaptive_level: 1.0,
                ramp_elapsed: None,
            },
            false,
        )
    }
}

impl<C: Clock> BudgetStore for MemoryBudgetStore<C> {
    // Every method returns `std::future::Ready`.
    const ANSWERS_AT_ONCE: bool = true;

    fn stats(&self) -> crate::StoreStats {
        crate::StoreStats {
            evicted_upstreams: self.evictions(),
            ..crate::StoreStats::default()
        }
    }

    fn evict_idle<F>(&self, idle: std::time::Duration, config_of: F) -> usize
    where
        F: Fn(&str) -> BucketConfig,
    {
        MemoryBudgetStore::evict_idle(self, idle, config_of)
    }

    fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<BudgetSnapshot, StoreError>> + Send {
        let (check, tracked) = self.look(upstream, config, FleetCall::PLAIN);
        ready(Ok(check.into_snapshot(upstream, tracked)))
    }

    fn check_in_fleet(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        ready(if withdraw {
            self.with_bucket(upstream, config, |bucket, now| {
                bucket.check(config, now, true, fleet)
            })
        } else if fleet.announce.is_set() {
            // An announcement needs a bucket to live in: made (under the
            // upstream limit) if need be; past the limit it is dropped
            // rather than refuse a decision that spends nothing.
            match self.with_bucket(upstream, config, |bucket, now| {
                bucket.check(config, now, false, fleet)
            }) {
                Err(StoreError::TooManyUpstreams { .. }) => {
                    Ok(self.look(upstream, config, fleet).0)
                }
                checked => checked,
            }
        } else {
            Ok(self.look(upstream, config, fleet).0)
        })
    }

    fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        ready(self.with_bucket(upstream, config, |bucket, now| {
            let capacity = config.capacity_units();
            bucket.refill(config, now, capacity)?;
            Some(bucket.try_withdraw(capacity)?.ok().map(units_to_tokens))
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
            bucket.refill(config, now, capacity)?;
            bucket
                .add(config.deposit_units(requests), capacity)
                .then_some(())
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
        ready(self.with_bucket(upstream, config, |bucket, now| {
            // SeqCst, with the sweep's compare-and-swap and re-check: either
            // the sweep sees the switch (and keeps the bucket) or this sees
            // the eviction (and switches the new bucket). A kill switch is
            // never lost with an evicted bucket.
            let previous = bucket.retries_enabled.swap(enabled, Ordering::SeqCst);
            // Released: the retries come back along the ramp.
            if enabled && !previous {
                bucket.start_ramp(now);
            }
            (bucket.units.load(Ordering::SeqCst) != EVICTED).then_some(previous)
        }))
    }

    fn note_level(
        &self,
        upstream: &str,
        config: &BucketConfig,
        level: f64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        ready(self.with_bucket(upstream, config, |bucket, now| {
            let before = f64::from_bits(bucket.level.swap(level.to_bits(), Ordering::AcqRel));
            if before < pushback::LOW_LEVEL && level >= pushback::LOW_LEVEL {
                bucket.start_ramp(now);
            }
            (!bucket.is_evicted()).then_some(())
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
            .filter_map(|entry| {
                let config = config_of(entry.key());
                // An evicted bucket still in the map is about to leave it.
                let units = entry
                    .value()
                    .refill(&config, now, config.capacity_units())?;
                let bucket = entry.value();
                Some(BudgetSnapshot {
                    upstream: entry.key().to_string(),
                    tokens: units_to_tokens(units),
                    retries_enabled: bucket.retries_enabled.load(Ordering::Acquire),
                    tracked: true,
                    shared_unavailable: false,
                    pushback_remaining: pushback::remaining(
                        bucket.pushback_after.load(Ordering::Acquire),
                        bucket.pushback_stop.load(Ordering::Acquire),
                        now,
                        1,
                    ),
                    adaptive_level: bucket.level(),
                    ramp_elapsed: bucket.ramp_elapsed(now),
                })
            })
            .collect();
        snapshots.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        ready(Ok(snapshots))
    }
}

#[cfg(test)]
mod tests;
