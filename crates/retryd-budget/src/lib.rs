//! Retry budgets: one token bucket per upstream, filled as a fraction of
//! real traffic plus a small floor per second, spent one token per RETRY.
//!
//! This crate owns the [`BudgetStore`] trait and the bucket arithmetic that
//! every store shares. It knows nothing of gRPC or of the decision rules.
//!
//! The invariant every store keeps, across all its replicas: retries allowed
//! ≤ initial + ratio × reported requests + floor × elapsed time, and the
//! tokens held are never above capacity nor below zero.
//!
//! The adaptive budget's rule (`adaptive.rs`) decides how many of a
//! report's requests fund retries, from how its attempts ended; it never
//! funds more than were reported, so the invariant holds with it.

pub mod adaptive;
pub mod hedging;
pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
pub mod reports;

use std::future::Future;
use std::time::Duration;

use retryd_engine::BudgetView;

pub use adaptive::Outcomes;
pub use hedging::{FleetWindow, HedgeAdd, HedgeWindows};
pub use memory::MemoryBudgetStore;
#[cfg(feature = "redis")]
pub use redis::{ExactStore, LeasedStore, RedisBudgetStore, RedisConfig, RedisMode, RedisUrl};
pub use reports::{ReportClaim, ReportLedger};

/// Tokens are kept as integers of this many units per token, so that stores
/// can update them with integer atomics (or Redis integers) and never drift.
pub const UNITS_PER_TOKEN: u64 = 1_000_000;

/// The parameters of one upstream's bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketConfig {
    /// The most tokens the bucket holds (the burst).
    pub capacity: f64,
    /// Tokens in a bucket when it is first created.
    pub initial: f64,
    /// Tokens deposited per reported real request.
    pub ratio: f64,
    /// Tokens added per second whatever the traffic, so that a quiet
    /// upstream can still retry.
    pub min_per_second: f64,
    /// What a shared store does when it cannot reach its backend.
    pub on_unavailable: OnUnavailable,
    /// The configuration names this upstream. Named upstreams never count
    /// against the store's upstream limit, so that a flood of made-up names
    /// cannot make a configured upstream undecidable; they are bounded by
    /// the configuration itself.
    pub configured: bool,
}

/// What a shared store does for an upstream while its backend (Redis) is
/// unreachable. The memory store is never unavailable and ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnUnavailable {
    /// Keep deciding from a conservative bucket local to this replica.
    #[default]
    Local,
    /// Deny every retry with a reason of its own until the store is back.
    Deny,
}

impl Default for BucketConfig {
    /// The defaults of the configuration contract.
    fn default() -> Self {
        BucketConfig {
            capacity: 100.0,
            initial: 100.0,
            ratio: 0.1,
            min_per_second: 1.0,
            on_unavailable: OnUnavailable::Local,
            configured: false,
        }
    }
}

impl BucketConfig {
    /// Capacity in units.
    pub fn capacity_units(&self) -> u64 {
        tokens_to_units(self.capacity)
    }

    /// Initial tokens in units, never above capacity.
    pub fn initial_units(&self) -> u64 {
        tokens_to_units(self.initial).min(self.capacity_units())
    }

    /// Units deposited for `requests` reported real requests.
    pub fn deposit_units(&self, requests: u64) -> u64 {
        tokens_to_units(self.ratio * requests as f64)
    }

    /// The floor in units per nanosecond: the one double every store's
    /// refill arithmetic starts from (the Redis scripts receive it as text).
    pub fn floor_units_per_nano(&self) -> f64 {
        self.min_per_second * UNITS_PER_TOKEN as f64 / 1e9
    }

    /// The floor's refill over `elapsed_nanos`: the units to credit and the
    /// nanoseconds that credit accounts for.
    ///
    /// Only the time actually turned into whole units is consumed, so that
    /// frequent refills cannot round a slow floor down to nothing; the
    /// consumed time is rounded up, so rounding never credits more than the
    /// floor allows.
    pub fn refill(&self, elapsed_nanos: u64) -> Refill {
        let units_per_nano = self.floor_units_per_nano();
        // NaN cannot occur (config validates) but must not credit either.
        if units_per_nano.is_nan() || units_per_nano <= 0.0 {
            // No floor: the whole interval passes with nothing to credit.
            return Refill {
                units: 0,
                nanos: elapsed_nanos,
            };
        }
        let units = (elapsed_nanos as f64 * units_per_nano).floor();
        let units = if units >= u64::MAX as f64 {
            u64::MAX
        } else {
            units as u64
        };
        let nanos = ((units as f64 / units_per_nano).ceil() as u64).min(elapsed_nanos);
        Refill { units, nanos }
    }
}

/// The result of [`BucketConfig::refill`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refill {
    /// Units to add (before the capacity cap).
    pub units: u64,
    /// Nanoseconds of the interval those units account for.
    pub nanos: u64,
}

/// Converts tokens to units, rounding half away from zero, saturating;
/// negative and NaN become zero.
pub fn tokens_to_units(tokens: f64) -> u64 {
    let units = tokens * UNITS_PER_TOKEN as f64;
    // Not `f64::round`: on baseline x86-64 it is a libm call, and every
    // budget operation converts the capacity. Rounding by hand is exact:
    // below 2^53 `units - whole` loses nothing (Sterbenz), and above it
    // every double is already whole.
    if units.is_nan() || units <= 0.0 {
        0
    } else if units >= u64::MAX as f64 {
        u64::MAX
    } else {
        let whole = units as u64;
        whole + u64::from(units - whole as f64 >= 0.5)
    }
}

/// Converts units back to tokens.
pub fn units_to_tokens(units: u64) -> f64 {
    units as f64 / UNITS_PER_TOKEN as f64
}

/// One upstream's budget as a store reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetSnapshot {
    /// The upstream.
    pub upstream: String,
    /// Tokens available now.
    pub tokens: f64,
    /// False while an operator has switched retries off.
    pub retries_enabled: bool,
    /// False if the store holds no state for the upstream yet.
    pub tracked: bool,
    /// True if the shared budget could not be read (a shared store believed
    /// down, or that did not answer): `tokens` is then this replica's local
    /// fallback bucket, not the fleet's budget. Always false for the memory
    /// store.
    pub shared_unavailable: bool,
}

/// What one decision learns from an upstream's budget, and whether it
/// spent a token: the answer of [`BudgetStore::check`]. It carries no name,
/// so the decision path allocates nothing for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetCheck {
    /// Tokens available now: after the withdrawal, if one was made.
    pub tokens: f64,
    /// False while an operator has switched retries off.
    pub retries_enabled: bool,
    /// True if this check withdrew one token.
    pub withdrew: bool,
}

impl BudgetCheck {
    /// The same reading under the upstream's name, as admin answers carry it.
    pub fn into_snapshot(self, upstream: &str, tracked: bool) -> BudgetSnapshot {
        BudgetSnapshot {
            upstream: upstream.to_owned(),
            tokens: self.tokens,
            retries_enabled: self.retries_enabled,
            tracked,
            shared_unavailable: false,
        }
    }
}

impl From<&BudgetCheck> for BudgetView {
    fn from(check: &BudgetCheck) -> Self {
        BudgetView {
            tokens: check.tokens,
            retries_enabled: check.retries_enabled,
            unavailable: false,
        }
    }
}

impl From<&BudgetSnapshot> for BudgetView {
    fn from(snapshot: &BudgetSnapshot) -> Self {
        BudgetView {
            tokens: snapshot.tokens,
            retries_enabled: snapshot.retries_enabled,
            unavailable: false,
        }
    }
}

/// What can go wrong in a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store refuses to track another upstream: a flood of distinct
    /// names must not grow memory without bound.
    #[error("too many distinct upstreams are tracked (limit {limit})")]
    TooManyUpstreams {
        /// The configured limit.
        limit: usize,
    },
    /// The backing store could not be reached or answered an error.
    #[error("budget store unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A place that keeps retry budgets. The trait is async and fallible so a
/// networked store fits; the memory store answers with ready futures, so it
/// pays no allocation or scheduling for that.
///
/// Every method takes the upstream's [`BucketConfig`] because policies can
/// change at run time and the store must apply the current one.
pub trait BudgetStore: Send + Sync + 'static {
    /// True if every future this store returns is ready when returned (it
    /// never waits on I/O), so the service may decide without an executor:
    /// no future boxed and queued per stream item. False by default.
    const ANSWERS_AT_ONCE: bool = false;

    /// The budget now, without spending. An upstream the store does not
    /// track yet reads as a fresh bucket (and is not created by looking).
    fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<BudgetSnapshot, StoreError>> + Send;

    /// A decision's whole business with the budget, in one step (one round
    /// trip for a shared store): reads the budget and, if `withdraw` is set,
    /// withdraws one token when a whole one is there **and** retries are
    /// switched on. Without `withdraw` it is [`BudgetStore::view`] (and, like
    /// it, creates nothing); with it, [`BudgetStore::try_withdraw`] guarded
    /// by the kill switch.
    ///
    /// The caller sets `withdraw` when the verdict would be RETRY if the
    /// budget allowed, so a decision never needs a second call.
    fn check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send;

    /// Withdraws one token if at least one is there. Returns the tokens left
    /// after the withdrawal, or `None` if there was not a whole token.
    fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send;

    /// Gives every one of `upstreams` (each with its current bucket
    /// parameters; a name may repeat) a place under the store's upstream
    /// limit, or none that lacks one: if the new ones do not all fit, nothing
    /// changes and the answer is [`StoreError::TooManyUpstreams`]. The
    /// memory store creates their buckets, a shared store enters them in
    /// its index; either way an admitted upstream reads as a fresh bucket
    /// until something is deposited or withdrawn, so admitting moves no
    /// budget.
    ///
    /// A traffic report admits all its upstreams before it deposits, so
    /// that a report going over the limit deposits nowhere. After `Ok`, a
    /// [`BudgetStore::deposit`] to these upstreams does not fail for the
    /// limit (a shared store may still fail it for an outage). Never called
    /// on the decision path.
    ///
    /// A shared store whose backend is unreachable answers as the
    /// upstreams' `on_unavailable` policies will: `Unavailable` if any of
    /// them is `deny`, else it admits them all to its local fallback.
    fn admit(
        &self,
        upstreams: &[(&str, &BucketConfig)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Claims a traffic report's `id` before its deposits: `entries` is the
    /// report's length and `digest` a hash of its entries in order (the
    /// same id with other entries is [`ReportClaim::Conflict`]). The id is
    /// remembered for `window`, fleet-wide on a shared store. After
    /// [`ReportClaim::Fresh`] or [`ReportClaim::Applied`] the caller applies
    /// the rest and calls [`BudgetStore::settle_report`]; see
    /// [`reports`]. A shared store whose backend is unreachable fails.
    fn claim_report(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        window: Duration,
    ) -> impl Future<Output = Result<ReportClaim, StoreError>> + Send;

    /// Settles a claimed report id: its first `applied` entries need no
    /// applying again (a partial failure at entry i settles i + 1: entry i
    /// may have landed, so it is never re-applied).
    fn settle_report(
        &self,
        id: &str,
        digest: u64,
        applied: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deposits `ratio × requests` tokens, capped at capacity.
    fn deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Switches retries on or off for the upstream. Returns the previous
    /// state.
    fn set_retries_enabled(
        &self,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Every tracked upstream's budget, ordered by name. `config_of` gives
    /// each upstream's current bucket parameters.
    fn list<F>(
        &self,
        config_of: F,
    ) -> impl Future<Output = Result<Vec<BudgetSnapshot>, StoreError>> + Send
    where
        F: Fn(&str) -> BucketConfig + Send;

    /// True for a store whose hedging window is shared by replicas (Redis):
    /// reports add to it with [`BudgetStore::add_hedging`] and replicas
    /// read it with [`BudgetStore::read_hedging`]. False: the process's own
    /// window is the fleet's (the memory store).
    const SHARES_HEDGING: bool = false;

    /// Adds a report's (or a replica's granted hedges') counts to one slot
    /// of the upstream's shared window. Never on the decision path.
    fn add_hedging(
        &self,
        upstream: &str,
        add: &hedging::HedgeAdd<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (upstream, add);
        std::future::ready(Ok(()))
    }

    /// The upstream's shared window ending at slot `last_slot`, summed;
    /// `None` from a store that shares none. Never on the decision path.
    fn read_hedging(
        &self,
        upstream: &str,
        last_slot: u64,
    ) -> impl Future<Output = Result<Option<hedging::FleetWindow>, StoreError>> + Send {
        let _ = (upstream, last_slot);
        std::future::ready(Ok(None))
    }

    /// False while the store's backend is believed unreachable (for the
    /// health service and a metric). The memory store is always available.
    fn is_available(&self) -> bool {
        true
    }

    /// The share of the backend believed reachable, 0 to 1 (for a metric):
    /// a Redis Cluster with one master down is partly reachable. By
    /// default 1 or 0, from [`BudgetStore::is_available`].
    fn availability(&self) -> f64 {
        if self.is_available() { 1.0 } else { 0.0 }
    }

    /// Counters since start, for metrics. The memory store counts only
    /// its evictions.
    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }

    /// Forgets the unconfigured upstreams that have been idle for `idle`
    /// and whose buckets hold at least their initial tokens, so that a
    /// bucket made again later grants nothing the old one would not have;
    /// returns how many. `config_of` gives each upstream's current bucket
    /// parameters and must not call the store. Never called on the decision
    /// path (the server runs it from a task of its own).
    ///
    /// The memory store evicts here. A shared store does nothing (the
    /// default): its keys and index entries expire in the backend by the
    /// same rule.
    fn evict_idle<F>(&self, idle: std::time::Duration, config_of: F) -> usize
    where
        F: Fn(&str) -> BucketConfig,
    {
        let _ = (idle, config_of);
        0
    }

    /// Hands back what this replica holds (leased tokens, batched deposits)
    /// before the process exits. Bounded by the store's own timeouts; the
    /// store keeps answering afterwards, from its backend only.
    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// Counters a store keeps since it started, monotonic, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// Backend calls that failed or timed out.
    pub backend_errors: u64,
    /// Of those, the ones that timed out.
    pub backend_timeouts: u64,
    /// Times the backend was found unreachable (transitions to unavailable).
    pub outages: u64,
    /// Calls answered from the local fallback bucket while the backend was
    /// unreachable (`on_unavailable = local`).
    pub fallbacks: u64,
    /// Calls answered `StoreError::Unavailable` (`on_unavailable = deny`).
    pub unavailable_answers: u64,
    /// Leased tokens neither spent nor returned (the lease expired, or its
    /// return failed): budget lost, never over-granted.
    pub forfeited_tokens: f64,
    /// Reported requests whose deposit was lost (a fleet then retries less).
    pub lost_deposits: u64,
    /// Idle upstreams evicted (the memory store; Redis expires keys itself).
    pub evicted_upstreams: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refill_credits_the_floor() {
        let config = BucketConfig {
            min_per_second: 2.0,
            ..BucketConfig::default()
        };
        assert_eq!(
            config.refill(1_000_000_000),
            Refill {
                units: 2 * UNITS_PER_TOKEN,
                nanos: 1_000_000_000
            }
        );
        let none = BucketConfig {
            min_per_second: 0.0,
            ..config
        };
        assert_eq!(none.refill(5), Refill { units: 0, nanos: 5 });
    }

    #[test]
    fn a_slow_floor_survives_frequent_refills() {
        // 0.001 tokens per second is one unit per millisecond: refilling
        // every 100 µs must not round every interval down to nothing.
        let config = BucketConfig {
            min_per_second: 0.001,
            ..BucketConfig::default()
        };
        let (mut clock, mut accounted, mut credited) = (0u64, 0u64, 0u64);
        for _ in 0..10_000 {
            clock += 100_000;
            let refill = config.refill(clock - accounted);
            accounted += refill.nanos;
            credited += refill.units;
        }
        assert_eq!(credited, 1000, "one second at 0.001/s is 1000 units");
    }

    proptest! {
        #[test]
        fn tokens_round_to_units_as_f64_round_does(tokens in prop_oneof![
            -1e3f64..1e16,
            (0u64..1 << 40).prop_map(|units| units as f64 / 1e6 + 0.5e-6),
            any::<f64>(),
        ]) {
            let rounded = (tokens * UNITS_PER_TOKEN as f64).round();
            let expected = if rounded.is_nan() || rounded <= 0.0 {
                0
            } else if rounded >= u64::MAX as f64 {
                u64::MAX
            } else {
                rounded as u64
            };
            prop_assert_eq!(tokens_to_units(tokens), expected);
        }

        #[test]
        fn refill_never_credits_more_than_elapsed_allows(
            per_second in 0.0f64..10_000.0,
            elapsed in 0u64..10_000_000_000,
        ) {
            let config = BucketConfig { min_per_second: per_second, ..BucketConfig::default() };
            let refill = config.refill(elapsed);
            prop_assert!(refill.nanos <= elapsed);
            let allowed = per_second * UNITS_PER_TOKEN as f64 * refill.nanos as f64 / 1e9;
            prop_assert!(refill.units as f64 <= allowed + 1e-6);
        }
    }
}
