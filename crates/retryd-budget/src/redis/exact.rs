//! Exact mode: every operation is one script on the upstream's keys
//! (after its admission to the index), so withdrawals are atomic across the
//! fleet and a fleet short of budget grants exactly the budget. The mode
//! holds nothing of its own, per store or per upstream.
//!
//! The direct operations here are generic over the mode because a leased
//! store answers with them too, once it has shut down and handed its
//! leases back. They must not consult any per-upstream mode state.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::shared::{Core, Operations};
use super::{Mode, RedisConfig, RedisMode};
use crate::{BucketConfig, BudgetCheck, StoreError, units_to_tokens};

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
    ) -> impl Future<Output = Result<(BudgetCheck, bool), StoreError>> + Send {
        core.direct_view(upstream, config, deadline)
    }

    fn check(
        core: &Arc<Core<Exact>>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        deadline: Instant,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        core.direct_check(upstream, config, withdraw, deadline)
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

impl<M: Operations> Core<M> {
    /// The budget without spending, read from Redis, and whether it is
    /// tracked; creates nothing.
    pub(super) async fn direct_view(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<(BudgetCheck, bool), StoreError> {
        let reply = match self
            .run_bucket(&self.scripts.view, upstream, config, &[], deadline)
            .await
        {
            Ok(reply) => reply,
            Err(_) => return self.fallback_view(upstream, config, 0).await,
        };
        self.note_switch(upstream, reply.enabled);
        let tokens = if reply.tracked {
            reply.tokens.min(config.capacity_units())
        } else {
            reply.tokens
        };
        Ok((
            BudgetCheck {
                tokens: units_to_tokens(tokens),
                retries_enabled: reply.enabled,
                withdrew: false,
            },
            reply.tracked,
        ))
    }

    /// A decision's business with the budget: one script that reads and,
    /// if asked, withdraws.
    pub(super) async fn direct_check(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        deadline: Instant,
    ) -> Result<BudgetCheck, StoreError> {
        if !withdraw {
            return Ok(self.direct_view(upstream, config, deadline).await?.0);
        }
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return self.fallback_check(upstream, config, failure).await,
            Err(Err(refused)) => return Err(refused),
        };
        match self
            .run_bucket(&self.scripts.check, upstream, config, &["1"], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(BudgetCheck {
                    tokens: units_to_tokens(reply.tokens),
                    retries_enabled: reply.enabled,
                    withdrew: reply.result == 1,
                })
            }
            Err(failure) => self.fallback_check(upstream, config, failure).await,
        }
    }

    pub(super) async fn direct_withdraw(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return self.fallback_withdraw(upstream, config, failure).await,
            Err(Err(refused)) => return Err(refused),
        };
        match self
            .run_bucket(&self.scripts.withdraw, upstream, config, &[], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok((reply.result == 1).then(|| units_to_tokens(reply.tokens)))
            }
            Err(failure) => self.fallback_withdraw(upstream, config, failure).await,
        }
    }

    pub(super) async fn direct_deposit(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => {
                return self
                    .fallback_deposit(upstream, config, requests, failure)
                    .await;
            }
            Err(Err(refused)) => return Err(refused),
        };
        let units = config.deposit_units(requests).to_string();
        match self
            .run_bucket(&self.scripts.deposit, upstream, config, &[&units], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(())
            }
            Err(failure) => {
                self.fallback_deposit(upstream, config, requests, failure)
                    .await
            }
        }
    }
}
