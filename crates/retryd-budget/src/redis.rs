//! The shared budget store: token buckets in Redis (one node or a Redis
//! Cluster), so that every retryd replica spends from the same budgets; two
//! store types, [`ExactStore`] and [`LeasedStore`], over one core.
//!
//! This file owns the public surface (the store type, its [`Mode`]s, the
//! one [`BudgetStore`] impl); the work is done in `redis/`, one file per
//! responsibility. It must not decide
//! anything about retries. The design (why two types, what each mode
//! promises, what happens when Redis is slow or down) is the module's doc
//! page, `redis/README.md`.
#![doc = include_str!("redis/README.md")]

// From the top down: each module imports only those below it (and its
// own children), never this file; `redis/README.md` has the map.
mod exact;
mod leased;
mod shared;

mod leases;

mod connection;
mod reachability;

mod cluster;
mod sentinel;

mod circuit;
mod config;
mod error;
mod keys;
mod replies;
mod scripts;
mod slots;
mod socket;
mod url;

use std::fmt;
use std::future::Future;
use std::sync::Arc;

pub use self::config::{
    RedisAccess, RedisConfig, RedisMode, RedisPassword, RedisTls, SentinelConfig,
};
pub use self::exact::Exact;
pub use self::leased::Leased;
pub use self::scripts::CHECK_SOURCE;
pub use self::shared::Mode;
use self::shared::{Core, Source};
pub use self::url::{RedisUrl, redact_url};
use crate::reports::ReportClaim;
use crate::{BucketConfig, BudgetCheck, BudgetSnapshot, BudgetStore, StoreError, StoreStats};

/// Budgets in Redis, shared by every replica that uses the same Redis and
/// key prefix, kept the way `M` says. Cheap to clone: clones share one
/// connection and state.
pub struct RedisBudgetStore<M: Mode> {
    core: Arc<Core<M>>,
}

/// Every withdrawal one atomic script in Redis.
pub type ExactStore = RedisBudgetStore<Exact>;

/// Replicas lease small batches of tokens and spend them locally.
pub type LeasedStore = RedisBudgetStore<Leased>;

impl<M: Mode> Clone for RedisBudgetStore<M> {
    fn clone(&self) -> Self {
        RedisBudgetStore {
            core: Arc::clone(&self.core),
        }
    }
}

impl<M: Mode> fmt::Debug for RedisBudgetStore<M> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RedisBudgetStore")
            .field("mode", &M::MODE)
            .field("available", &self.core.reach.fraction_up())
            .field("upstreams", &self.core.upstreams.len())
            .finish()
    }
}

impl<M: Mode> RedisBudgetStore<M> {
    /// Connects to Redis (one URL) or a Redis Cluster (several URLs, or one
    /// URL of a node with cluster mode on), checks the server version, loads
    /// the scripts and starts the background task. Must run inside a tokio
    /// runtime. Fails, rather than starting blind, if Redis cannot be
    /// reached within 5 s.
    ///
    /// The mode is the type's: `config.mode` is what the caller matched on
    /// to choose `M`, and is not read here.
    pub async fn connect(
        config: &RedisConfig,
        max_upstreams: usize,
    ) -> Result<RedisBudgetStore<M>, StoreError> {
        let core = Core::<M>::connect(config, max_upstreams).await?;
        tracing::info!(
            mode = ?M::MODE,
            cluster = core.connection.is_cluster(),
            "connected to the Redis budget store"
        );
        Ok(RedisBudgetStore { core })
    }

    /// False while any part of Redis is believed unreachable (for a
    /// Cluster: any master).
    pub fn is_available(&self) -> bool {
        self.core.reach.is_up()
    }

    /// The share of the store believed reachable, 0 to 1: for a Cluster,
    /// the share of slots whose master answers; else 1 or 0.
    pub fn availability(&self) -> f64 {
        self.core.reach.fraction_up()
    }

    /// Counters since start.
    pub fn stats(&self) -> StoreStats {
        self.core.stats()
    }

    /// Times the background task panicked and was restarted (should stay 0).
    pub fn background_restarts(&self) -> u64 {
        self.core.counters.restarts()
    }

    /// Hands back what this replica holds: a leased store flushes its
    /// batched deposits and returns every lease, then withdraws one token
    /// at a time, like an exact store, so nothing is left stranded in it.
    pub async fn shutdown(&self) {
        M::shutdown(&self.core).await;
    }
}

impl RedisBudgetStore<Leased> {
    /// Lease acquisitions Redis answered since start (whether or not the
    /// bucket had a token to lease), over every upstream.
    pub fn lease_acquisitions(&self) -> u64 {
        self.core.mode.lease_acquisitions()
    }
}

/// One impl for both modes: what they share is here, what differs is a
/// static call into `M`. Each call takes its one deadline here, at its
/// first poll, so that every Redis request it makes shares it.
impl<M: Mode> BudgetStore for RedisBudgetStore<M> {
    fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<BudgetSnapshot, StoreError>> + Send {
        let core = &self.core;
        async move {
            let (check, source) = M::view(core, upstream, config, core.deadline()).await?;
            Ok(match source {
                Source::Shared { tracked } => check.into_snapshot(upstream, tracked),
                Source::Local => BudgetSnapshot {
                    shared_unavailable: true,
                    ..check.into_snapshot(upstream, true)
                },
            })
        }
    }

    fn check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        let core = &self.core;
        async move { M::check(core, upstream, config, withdraw, core.deadline()).await }
    }

    fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        let core = &self.core;
        async move { M::try_withdraw(core, upstream, config, core.deadline()).await }
    }

    fn claim_report(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        window: std::time::Duration,
    ) -> impl Future<Output = Result<ReportClaim, StoreError>> + Send {
        let core = &self.core;
        async move {
            core.claim_report(id, digest, entries, window, core.deadline())
                .await
        }
    }

    fn settle_report(
        &self,
        id: &str,
        digest: u64,
        applied: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let core = &self.core;
        async move {
            core.settle_report(id, digest, applied, core.deadline())
                .await
        }
    }

    fn admit(
        &self,
        upstreams: &[(&str, &BucketConfig)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.core.admit(upstreams)
    }

    fn deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let core = &self.core;
        async move { M::deposit(core, upstream, config, requests, core.deadline()).await }
    }

    fn set_retries_enabled(
        &self,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.core.set_retries_enabled(upstream, config, enabled)
    }

    fn list<F>(
        &self,
        config_of: F,
    ) -> impl Future<Output = Result<Vec<BudgetSnapshot>, StoreError>> + Send
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        self.core.list(config_of)
    }

    const SHARES_HEDGING: bool = true;

    fn add_hedging(
        &self,
        upstream: &str,
        add: &crate::hedging::HedgeAdd<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let core = &self.core;
        async move { core.add_hedging(upstream, add, core.deadline()).await }
    }

    fn read_hedging(
        &self,
        upstream: &str,
        last_slot: u64,
    ) -> impl Future<Output = Result<Option<crate::hedging::FleetWindow>, StoreError>> + Send {
        let core = &self.core;
        async move {
            core.read_hedging(upstream, last_slot, core.deadline())
                .await
                .map(Some)
        }
    }

    fn is_available(&self) -> bool {
        RedisBudgetStore::is_available(self)
    }

    fn availability(&self) -> f64 {
        RedisBudgetStore::availability(self)
    }

    fn stats(&self) -> StoreStats {
        RedisBudgetStore::stats(self)
    }

    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        M::shutdown(&self.core)
    }
}
