//! Exact mode: every operation is one script on the upstream's keys
//! (after its admission to the index), so withdrawals are atomic across the
//! fleet and a fleet short of budget grants exactly the budget, less one
//! token per withdrawal whose answer came past the store timeout (Redis
//! applied it; the replica answered from its fallback and counted that in
//! `retryd_store_fallbacks_total`). The mode
//! holds nothing of its own, per store or per upstream. Its operations
//! are the core's direct ones (`shared/direct.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::config::{RedisConfig, RedisMode};
use super::shared::{Core, Mode, Operations, Source};
use crate::{BucketConfig, BudgetCheck, FleetCall, StoreError};

/// The exact mode of [`super::RedisBudgetStore`]: every withdrawal is one
/// atomic script call. It has no state of its own.
#[derive(Debug)]
pub struct Exact(());

impl Mode for Exact {
    const MODE: RedisMode = RedisMode::Exact;
}

impl Operations for Exact {
    type Upstream = ();

    // The background task only probes and tidies.
    const TICK: Duration = Duration::from_millis(25);

    fn new(_config: &RedisConfig) -> Exact {
        Exact(())
    }

    fn upstream(&self) {}

    fn view(
        core: &Arc<Core<Exact>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<(BudgetCheck, Source), StoreError>> + Send {
        core.direct_view(upstream, config, deadline)
    }

    fn check(
        core: &Arc<Core<Exact>>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
        deadline: Instant,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        core.direct_check(upstream, config, withdraw, fleet, deadline)
    }

    fn try_withdraw(
        core: &Arc<Core<Exact>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        core.direct_withdraw(upstream, config, deadline)
    }

    fn deposit(
        core: &Arc<Core<Exact>>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        core.direct_deposit(upstream, config, requests, deadline)
    }

    fn round(_core: &Arc<Core<Exact>>) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    fn shutdown(core: &Arc<Core<Exact>>) -> impl Future<Output = ()> + Send {
        core.close();
        std::future::ready(())
    }
}
