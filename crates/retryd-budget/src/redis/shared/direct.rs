//! The direct operations: each one script on the upstream's keys (after
//! its admission to the index), answered from the fallback when Redis
//! gives no answer. They are the exact mode's operations, and a leased
//! store's once it has shut down and handed its leases back, so they are
//! generic over the mode and must not consult any per-upstream mode state.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Core, Operations, Source};
use crate::{BucketConfig, BudgetCheck, StoreError, units_to_tokens};

impl<M: Operations> Core<M> {
    /// The budget without spending, read from Redis, and whether it is
    /// tracked; creates nothing.
    pub(in crate::redis) async fn direct_view(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<(BudgetCheck, Source), StoreError> {
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
            Source::Shared {
                tracked: reply.tracked,
            },
        ))
    }

    /// A decision's business with the budget: one script that reads and,
    /// if asked, withdraws.
    pub(in crate::redis) async fn direct_check(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        deadline: Instant,
    ) -> Result<BudgetCheck, StoreError> {
        if !withdraw {
            return Ok(self.direct_view(upstream, config, deadline).await?.0);
        }
        let (state, deadline) = match self.admitted(upstream, config, deadline).await {
            Ok(admitted) => admitted,
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

    pub(in crate::redis) async fn direct_withdraw(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        let (state, deadline) = match self.admitted(upstream, config, deadline).await {
            Ok(admitted) => admitted,
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

    pub(in crate::redis) async fn direct_deposit(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let (state, deadline) = match self.admitted(upstream, config, deadline).await {
            Ok(admitted) => admitted,
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
