//! Idle eviction for the memory store: the sweep that takes unconfigured
//! buckets out of the table once dropping them can grant nothing, so that
//! the table returns to its steady size after a flood of names. It runs
//! beside decisions, never inside one: it takes the shared map's shard
//! locks (which a decision's fast path does not) and leaves each thread to
//! prune its own index (see `MemoryBudgetStore::near`).
//!
//! The rule: a bucket is evicted when its upstream is not configured, its
//! retries are on, nothing has used it for the sweep's `idle` time, and it
//! holds at least its initial tokens (counting the floor credit due). A
//! bucket created again later starts at `initial`, which is no more than the
//! evicted one held, so the bound initial + ratio × reported + floor ×
//! elapsed holds across evictions; the kill switch is never lost with one.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Bucket, Clock, EVICTED, MemoryBudgetStore};
use crate::BucketConfig;

impl<C: Clock> MemoryBudgetStore<C> {
    /// Evicts every bucket the rule above allows and returns how many.
    /// `config_of` gives each upstream's current bucket parameters (which
    /// say whether it is configured); it runs under a shard lock of the
    /// store, so it must not call the store.
    ///
    /// An upstream the configuration has named since its bucket was created
    /// gives its place under `max_upstreams` back here.
    pub fn evict_idle<F>(&self, idle: Duration, config_of: F) -> usize
    where
        F: Fn(&str) -> BucketConfig,
    {
        let now = self.clock.now_nanos();
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        let mut evicted = 0;
        self.buckets.retain(|upstream, bucket| {
            let config = config_of(upstream);
            if config.configured {
                self.uncount(bucket);
                return true;
            }
            let gone = self.try_evict(bucket, &config, now, idle);
            evicted += usize::from(gone);
            !gone
        });
        if evicted > 0 {
            // Release: a thread that sees the new count sees the evictions.
            self.evictions.fetch_add(evicted as u64, Ordering::Release);
        }
        evicted
    }

    /// Upstreams holding a place under `max_upstreams` now.
    pub fn counted_upstreams(&self) -> usize {
        self.tracked.load(Ordering::Acquire)
    }

    /// Buckets evicted since the store started.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Acquire)
    }

    fn uncount(&self, bucket: &Bucket) {
        if bucket.counted.swap(false, Ordering::AcqRel) {
            self.tracked.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Marks `bucket` evicted if the rule allows, under its shard's write
    /// lock (so nobody finds it in the map meanwhile).
    fn try_evict(&self, bucket: &Bucket, config: &BucketConfig, now: u64, idle: u64) -> bool {
        if !bucket.retries_enabled.load(Ordering::SeqCst) {
            return false;
        }
        let since = bucket.credited_until.load(Ordering::Acquire);
        if now.saturating_sub(since) < idle {
            return false;
        }
        let held = bucket.units.load(Ordering::Acquire);
        if held == EVICTED {
            return false;
        }
        let capacity = config.capacity_units();
        let due = config.refill(now - since).units;
        let level = held.min(capacity).saturating_add(due).min(capacity);
        if level < config.initial_units() {
            return false;
        }
        // Any withdrawal, deposit or refill since `held` was read fails this.
        if bucket
            .units
            .compare_exchange(held, EVICTED, Ordering::SeqCst, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        // Retries switched off in between: keep the bucket, as it was (no
        // operation changes an evicted bucket, so `held` is still its level).
        if !bucket.retries_enabled.load(Ordering::SeqCst) {
            bucket.units.store(held, Ordering::SeqCst);
            return false;
        }
        self.uncount(bucket);
        true
    }
}
