//! Leased mode: a replica moves whole tokens out of the shared bucket into
//! a lease and spends them locally (a compare-and-swap), batches deposits,
//! and answers views from its lease plus a short-lived reading of the
//! shared bucket. This file owns the mode's state (the lease policy, the
//! return queue, the lease ids; per upstream, `LeaseState`) and its four
//! operations; taking, retiring and returning leases is `leases.rs`, the
//! background rounds `rounds.rs`. After `shutdown` every operation is the
//! exact store's (`exact.rs`), so nothing is left stranded here. It must
//! never spend a token it does not hold in a live lease.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::leases::{Acquisition, LastAcquisition, Lease, Return};
use super::replies::Reply;
use super::shared::{Core, Operations, Upstream, UpstreamState, lock};
use super::{Failure, Mode, RedisConfig, RedisMode, RedisStoreError};
use crate::{
    BucketConfig, BudgetCheck, OnUnavailable, StoreError, UNITS_PER_TOKEN, units_to_tokens,
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
}

/// A reading of the shared bucket, for views.
#[derive(Clone, Copy, Debug)]
pub(super) struct Reading {
    units: u64,
    enabled: bool,
    read_at: Instant,
}

/// What a leased store keeps per upstream, beside the index bookkeeping.
/// Public only in name, as [`Operations::Upstream`] names it.
#[derive(Debug)]
pub struct LeaseState {
    pub(super) lease: Mutex<Option<Arc<Lease>>>,
    /// Units the next lease asks for (see `leases::next_lease_units`).
    pub(super) lease_size: AtomicU64,
    /// One lease acquisition at a time; the others wait for its outcome.
    acquiring: tokio::sync::Mutex<()>,
    acquisitions: AtomicU64,
    last_acquisition: LastAcquisition,
    reading: Mutex<Option<Reading>>,
    /// Reported requests not yet flushed to Redis.
    pub(super) pending_requests: AtomicU64,
    /// Units of a flush on their way to Redis.
    pub(super) in_flight_units: AtomicU64,
}

impl LeaseState {
    pub(super) fn new(lease_units: u64) -> LeaseState {
        LeaseState {
            lease: Mutex::new(None),
            lease_size: AtomicU64::new(lease_units),
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
        *lock(&self.reading) = Some(Reading {
            units: reply.tokens,
            enabled: reply.enabled,
            read_at: Instant::now(),
        });
    }

    /// Its lease and the deposits not yet flushed.
    fn local_units(&self, now: Instant, config: &BucketConfig) -> u64 {
        let pending = config.deposit_units(self.pending_requests.load(Ordering::Acquire));
        self.lease_units(now)
            .saturating_add(pending)
            .saturating_add(self.in_flight_units.load(Ordering::Acquire))
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
    ) -> impl Future<Output = Result<(BudgetCheck, bool), StoreError>> + Send {
        core.view_with_lease(upstream, config, deadline)
    }

    fn check(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        deadline: Instant,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        core.check_with_lease(upstream, config, withdraw, deadline)
    }

    fn try_withdraw(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        core.withdraw_from_lease(upstream, config, deadline)
    }

    fn deposit(
        core: &Arc<Core<Leased>>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        core.deposit_batched(upstream, config, requests, deadline)
    }

    fn round(core: &Arc<Core<Leased>>) -> impl Future<Output = ()> + Send {
        core.settle_leases(false)
    }

    async fn shutdown(core: &Arc<Core<Leased>>) {
        if core.close() {
            core.settle_leases(true).await;
        }
    }
}

impl Core<Leased> {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// A view: this replica's lease and deposits on top of a reading of the
    /// shared bucket (cached for up to 100 ms); an upstream this replica
    /// holds nothing of is read as an exact store reads it.
    async fn view_with_lease(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<(BudgetCheck, bool), StoreError> {
        let known = (!self.is_closed())
            .then(|| {
                self.upstreams
                    .get(upstream)
                    .map(|entry| Arc::clone(entry.value()))
            })
            .flatten();
        let Some(state) = known else {
            return self.direct_view(upstream, config, deadline).await;
        };
        let now = Instant::now();
        let local = state.mode.local_units(now, config);
        // While Redis is believed down a cached reading is not trusted: the
        // upstream's on_unavailable policy answers.
        let cached = state
            .mode
            .cached(now, self.mode.view_cache)
            .filter(|_| self.is_up_for(upstream));
        let reading = match cached {
            Some(reading) => reading,
            None => {
                let reply = match self
                    .run_bucket(&self.scripts.view, upstream, config, &[], deadline)
                    .await
                {
                    Ok(reply) => reply,
                    Err(_) => {
                        let leased = state.mode.lease_units(now);
                        return self.fallback_view(upstream, config, leased).await;
                    }
                };
                self.note_switch(upstream, reply.enabled);
                state.mode.remember(&reply);
                Reading {
                    units: reply.tokens,
                    enabled: reply.enabled,
                    read_at: now,
                }
            }
        };
        Ok((
            BudgetCheck {
                tokens: units_to_tokens(
                    reading
                        .units
                        .saturating_add(local)
                        .min(config.capacity_units()),
                ),
                retries_enabled: reading.enabled,
                withdrew: false,
            },
            true,
        ))
    }

    /// A decision's business with the budget: the view (usually no round
    /// trip), then, if it promises a token, the lease; both within the
    /// call's one deadline.
    async fn check_with_lease(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        deadline: Instant,
    ) -> Result<BudgetCheck, StoreError> {
        if !withdraw {
            return Ok(self.view_with_lease(upstream, config, deadline).await?.0);
        }
        if self.is_closed() {
            return self.direct_check(upstream, config, true, deadline).await;
        }
        let (view, _) = self.view_with_lease(upstream, config, deadline).await?;
        if !view.retries_enabled || view.tokens < 1.0 {
            return Ok(view);
        }
        Ok(
            match self.withdraw_from_lease(upstream, config, deadline).await? {
                Some(left) => BudgetCheck {
                    tokens: left,
                    retries_enabled: true,
                    withdrew: true,
                },
                // Less than a whole token, however much the view promised.
                None => BudgetCheck {
                    tokens: 0.0,
                    retries_enabled: true,
                    withdrew: false,
                },
            },
        )
    }

    async fn withdraw_from_lease(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        if self.is_closed() {
            return self.direct_withdraw(upstream, config, deadline).await;
        }
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return self.fallback_withdraw(upstream, config, failure).await,
            Err(Err(refused)) => return Err(refused),
        };
        self.spend_or_lease(upstream, config, &state, deadline)
            .await
    }

    async fn spend_or_lease(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        state: &Arc<Upstream<LeaseState>>,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        let held = &state.mode;
        // `deny` means no retry while Redis is down, lease or not; `local`
        // spends what its lease already reserved before its local bucket.
        if !self.is_up_for(upstream) && config.on_unavailable == OnUnavailable::Deny {
            return self
                .fallback_withdraw(upstream, config, Failure::NotSent)
                .await;
        }
        if let Some(left) = held.spend(Instant::now()) {
            return Ok(Some(held.left(left, config)));
        }
        // The lease is dry or expired: one task asks Redis for another while
        // the others wait for its answer rather than each asking in turn.
        let generation = held.acquisitions.load(Ordering::Acquire);
        let Ok(_guard) = tokio::time::timeout_at(deadline, held.acquiring.lock()).await else {
            return self
                .fallback_withdraw(upstream, config, Failure::Unknown(RedisStoreError::Timeout))
                .await;
        };
        if held.acquisitions.load(Ordering::Acquire) != generation {
            if let Some(left) = held.spend(Instant::now()) {
                return Ok(Some(held.left(left, config)));
            }
            match held.last_acquisition.load() {
                Acquisition::Empty => return Ok(None),
                Acquisition::Failed => {
                    return self
                        .fallback_withdraw(upstream, config, Failure::NotSent)
                        .await;
                }
                // Others spent that lease already: take a new one.
                Acquisition::Acquired => {}
            }
        }
        // Out of time after waiting: answer from the fallback and leave the
        // lease, untouched, to the next task, which has time of its own.
        if Instant::now() >= deadline {
            return self
                .fallback_withdraw(upstream, config, Failure::Unknown(RedisStoreError::Timeout))
                .await;
        }
        let outcome = self.acquire(upstream, config, state, deadline).await;
        let (code, answer) = match outcome {
            Ok(Some(left)) => (Acquisition::Acquired, Ok(Some(held.left(left, config)))),
            Ok(None) => (Acquisition::Empty, Ok(None)),
            // Redis is believed down: the tasks that waited for this answer
            // take it too rather than each trying in turn.
            Err(failure) if !self.is_up_for(upstream) => (
                Acquisition::Failed,
                self.fallback_withdraw(upstream, config, failure).await,
            ),
            // Redis is up and only this task ran short of its deadline (it
            // waited long for the lock): the next one tries for itself.
            Err(failure) => return self.fallback_withdraw(upstream, config, failure).await,
        };
        held.last_acquisition.store(code);
        held.acquisitions.fetch_add(1, Ordering::AcqRel);
        answer
    }

    /// A deposit, counted here and flushed to Redis by the next round
    /// (`rounds.rs`); while Redis is down, the upstream's policy answers.
    async fn deposit_batched(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        if self.is_closed() {
            return self
                .direct_deposit(upstream, config, requests, deadline)
                .await;
        }
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => {
                return self
                    .fallback_deposit(upstream, config, requests, failure)
                    .await;
            }
            Err(Err(refused)) => return Err(refused),
        };
        if !self.is_up_for(upstream) {
            // Not batched for a Redis that is down: the policy answers.
            return self
                .fallback_deposit(upstream, config, requests, Failure::NotSent)
                .await;
        }
        // Counted under the map's lock, so housekeeping cannot drop the
        // entry between the lookup and the count.
        let entry = self
            .upstreams
            .entry(upstream.into())
            .or_insert_with(|| Arc::clone(&state));
        entry
            .mode
            .pending_requests
            .fetch_add(requests, Ordering::AcqRel);
        Ok(())
    }
}
