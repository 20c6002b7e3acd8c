//! Leased mode: a replica moves whole tokens out of the shared bucket into
//! a lease and spends them locally (a compare-and-swap), batches deposits,
//! and answers views from its lease plus a short-lived reading of the
//! shared bucket. This file owns the mode's state (the lease policy, the
//! return queue, the lease ids; per upstream, `LeaseState`) and its
//! `Operations`; the four operations and taking a lease are
//! `leased/spend.rs`, its part of the background round (flushing deposits,
//! retiring and returning leases) `leased/returns.rs`, and what a lease is
//! `leases.rs`. After `shutdown` every operation is the core's direct one
//! (as an exact store's), so nothing is left stranded here. It must never
//! spend a token it does not hold in a live lease.
//!
//! The mode sits above the core: it and its modules import `shared.rs` and
//! the leaf modules, and nothing below imports them.

mod returns;
mod spend;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::config::{RedisConfig, RedisMode};
use super::leases::{Acquisition, LastAcquisition, Lease, LeaseSize, Return, lease_cap};
use super::replies::Reply;
use super::shared::{Core, Mode, Operations, Source, UpstreamState, lock};
use crate::{
    Announce, BucketConfig, BudgetCheck, FleetCall, FleetPushback, StoreError, UNITS_PER_TOKEN,
    units_to_tokens,
};

/// Deposits are flushed and leases swept this often.
const TICK: Duration = Duration::from_millis(5);
/// Longest a view trusts a reading of the shared bucket.
const VIEW_CACHE: Duration = Duration::from_millis(100);

/// The leased mode of [`super::RedisBudgetStore`]: replicas lease small
/// batches of tokens and spend them locally. What it holds per store.
#[derive(Debug)]
pub struct Leased {
    /// The first and smallest lease (`lease_tokens`).
    pub(super) lease_units: u64,
    /// The largest lease (`max_lease_tokens`), before the capacity cap.
    pub(super) max_lease_units: u64,
    pub(super) lease_ttl: Duration,
    view_cache: Duration,
    /// Leases to hand back, by the next background round.
    pub(super) returns: Mutex<Vec<Return>>,
    /// This replica's part of every lease id.
    pub(super) replica: String,
    pub(super) lease_sequence: AtomicU64,
    /// Lease acquisitions Redis answered, for tests and benches.
    pub(super) lease_acquisitions: AtomicU64,
}

impl Leased {
    pub(super) fn lease_acquisitions(&self) -> u64 {
        self.lease_acquisitions.load(Ordering::Relaxed)
    }

    /// The largest lease of a bucket (see [`lease_cap`]).
    fn lease_cap(&self, config: &BucketConfig) -> u64 {
        lease_cap(
            self.lease_units,
            self.max_lease_units,
            config.capacity_units(),
        )
    }
}

/// A reading of the shared bucket, for views.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reading {
    units: u64,
    enabled: bool,
    read_at: Instant,
    /// The fleet's pushback as read (the earliest-retry time and a stop
    /// window's end, on this replica's clock): a leased decision obeys
    /// it from the cache, as it obeys the kill switch.
    after: Option<Instant>,
    stop: Option<Instant>,
    /// The last recovery ramp's start and the adaptive level, as read.
    ramp_from: Option<Instant>,
    level: f64,
}

impl Reading {
    /// What a bucket script answered, read at `now`.
    fn of(reply: &Reply, now: Instant) -> Reading {
        let at = |ms: i64| {
            let ahead = ms.saturating_sub(reply.now_ms);
            (ahead > 0).then(|| now + Duration::from_millis(ahead as u64))
        };
        Reading {
            units: reply.tokens,
            enabled: reply.enabled,
            read_at: now,
            after: at(reply.pushback_ms),
            stop: at(reply.stop_ms),
            ramp_from: reply
                .ramp_elapsed()
                .map(|elapsed| now.checked_sub(elapsed).unwrap_or(now)),
            level: reply.adaptive_level(),
        }
    }

    /// How long ago the last ramp began, at `now`; and the level.
    fn ramp(&self, now: Instant) -> (Option<Duration>, f64) {
        (
            self.ramp_from
                .map(|from| now.saturating_duration_since(from)),
            self.level,
        )
    }

    /// The pushback in force at `now`, and how long no retry may land.
    fn pushback(&self, now: Instant) -> (FleetPushback, Option<Duration>) {
        let left = |until: Option<Instant>| {
            until.map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
        };
        let (wait, stop) = (left(self.after), left(self.stop));
        let fleet = FleetPushback {
            wait,
            stop: !stop.is_zero(),
            ..FleetPushback::NONE
        };
        let remaining = wait.max(stop);
        (fleet, (!remaining.is_zero()).then_some(remaining))
    }
}

/// What a leased store keeps per upstream, beside the index bookkeeping.
/// Public only in name, as [`Operations::Upstream`] names it.
#[derive(Debug)]
pub struct LeaseState {
    pub(super) lease: Mutex<Option<Arc<Lease>>>,
    /// Units the next lease asks for (see `leases::next_lease_units`).
    lease_size: LeaseSize,
    /// One lease acquisition at a time; the others wait for its outcome.
    acquiring: tokio::sync::Mutex<()>,
    acquisitions: AtomicU64,
    last_acquisition: LastAcquisition,
    reading: Mutex<Option<Reading>>,
    /// Reported requests not yet flushed to Redis.
    pub(super) pending_requests: AtomicU64,
    /// Units of a flush on their way to Redis (not in a view: see
    /// `local_units`).
    pub(super) in_flight_units: AtomicU64,
}

impl LeaseState {
    pub(super) fn new(lease_units: u64) -> LeaseState {
        LeaseState {
            lease: Mutex::new(None),
            lease_size: LeaseSize::new(lease_units),
            acquiring: tokio::sync::Mutex::new(()),
            acquisitions: AtomicU64::new(0),
            last_acquisition: LastAcquisition::new(Acquisition::Acquired),
            reading: Mutex::new(None),
            pending_requests: AtomicU64::new(0),
            in_flight_units: AtomicU64::new(0),
        }
    }

    fn spend(&self, now: Instant) -> Option<u64> {
        let lease = lock(&self.lease).clone()?;
        lease.try_spend(now)
    }

    fn lease_units(&self, now: Instant) -> u64 {
        lock(&self.lease)
            .as_ref()
            .map_or(0, |lease| lease.available(now))
    }

    fn has_lease(&self) -> bool {
        lock(&self.lease).is_some()
    }

    /// This replica's own announcement, in its cached reading at once (the
    /// script's reply tells the pushback as it was before it).
    fn announced(&self, announce: Announce, now: Instant) {
        if let Some(reading) = lock(&self.reading).as_mut() {
            let later = |until: &mut Option<Instant>, by: Duration| {
                if !by.is_zero() {
                    *until = Some(until.map_or(now + by, |until| until.max(now + by)));
                }
            };
            let (wait, stop) = announce.nanos();
            later(&mut reading.after, Duration::from_nanos(wait));
            later(&mut reading.stop, Duration::from_nanos(stop));
        }
    }

    fn cached(&self, now: Instant, fresh_for: Duration) -> Option<Reading> {
        lock(&self.reading).filter(|reading| now.duration_since(reading.read_at) < fresh_for)
    }

    /// Tokens left after spending from the lease: what it still holds plus
    /// the last reading of the shared bucket.
    fn left(&self, left: u64, config: &BucketConfig) -> f64 {
        let shared = lock(&self.reading).map_or(0, |reading| reading.units);
        units_to_tokens(left.saturating_add(shared).min(config.capacity_units()))
    }
}

impl UpstreamState for LeaseState {
    fn remember(&self, reply: &Reply) {
        *lock(&self.reading) = Some(Reading::of(reply, Instant::now()));
    }

    /// Its lease and the deposits not yet sent. Not a flush on its way:
    /// Redis may have applied it already, and a reading taken since then
    /// holds it, so adding it could show tokens twice (seen at the default
    /// 20 ms timeout: a report of 5 read as 10, the flush's reply still
    /// to be handled). Left out, it is missing from a view for at most one
    /// round trip, until the flush's reply becomes the reading.
    fn local_units(&self, now: Instant, config: &BucketConfig) -> u64 {
        let pending = config.deposit_units(self.pending_requests.load(Ordering::Acquire));
        self.lease_units(now).saturating_add(pending)
    }

    fn holds_anything(&self) -> bool {
        self.has_lease()
            || self.pending_requests.load(Ordering::Acquire) > 0
            || self.in_flight_units.load(Ordering::Acquire) > 0
    }
}

impl Mode for Leased {
    const MODE: RedisMode = RedisMode::Leased;
}

impl Operations for Leased {
    type Upstream = LeaseState;

    const TICK: Duration = TICK;

    fn new(config: &RedisConfig) -> Leased {
        let lease_tokens = config.lease_tokens.floor().max(1.0);
        let lease_units = lease_tokens as u64 * UNITS_PER_TOKEN;
        // `as` saturates: a huge maximum is the capacity cap's business.
        let max_lease_units = (config.max_lease_tokens.floor() as u64)
            .saturating_mul(UNITS_PER_TOKEN)
            .max(lease_units);
        Leased {
            lease_units,
            max_lease_units,
            lease_ttl: config.lease_ttl,
            view_cache: VIEW_CACHE.min(config.lease_ttl / 2),
            returns: Mutex::new(Vec::new()),
            replica: format!("{:016x}", rand::random::<u64>()),
            lease_sequence: AtomicU64::new(0),
            lease_acquisitions: AtomicU64::new(0),
        }
    }

    fn upstream(&self) -> LeaseState {
        LeaseState::new(self.lease_units)
    }

    fn view(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<(BudgetCheck, Source), StoreError>> + Send {
        spend::view_with_lease(core, upstream, config, deadline)
    }

    fn check(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
        deadline: Instant,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        spend::check_with_lease(core, upstream, config, withdraw, fleet, deadline)
    }

    fn try_withdraw(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        spend::withdraw_from_lease(core, upstream, config, deadline)
    }

    fn deposit(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        spend::deposit_batched(core, upstream, config, requests, deadline)
    }

    fn round(core: &Arc<Core<Leased>>) -> impl Future<Output = ()> + Send {
        returns::settle_leases(core, false)
    }

    async fn shutdown(core: &Arc<Core<Leased>>) {
        if core.close() {
            returns::settle_leases(core, true).await;
        }
    }
}
