//! The direct operations: each one script on the upstream's keys (after
//! its admission to the index), answered from the fallback when Redis
//! gives no answer. They are the exact mode's operations, and a leased
//! store's once it has shut down and handed its leases back, so they are
//! generic over the mode and must not consult any per-upstream mode state.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Core, Operations, Source};
use crate::{BucketConfig, BudgetCheck, FleetCall, StoreError, units_to_tokens};

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
                pushback: reply.pushback(),
                pushback_remaining: reply.pushback_remaining(),
            },
            Source::Shared {
                tracked: reply.tracked,
            },
        ))
    }

    /// A decision's business with the budget: one script that reads,
    /// writes the pushback the decision announces, and, if asked,
    /// withdraws.
    pub(in crate::redis) async fn direct_check(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
        deadline: Instant,
    ) -> Result<BudgetCheck, StoreError> {
        if !withdraw && !fleet.announce.is_set() {
            return Ok(self.direct_view(upstream, config, deadline).await?.0);
        }
        let (wait_ms, stop_ms) = fleet.announce.millis();
        let (wait_ms, stop_ms) = (wait_ms.to_string(), stop_ms.to_string());
        let patience = fleet.patience_millis().to_string();
        if !withdraw {
            // An announcement alone: its two fields in the bucket's hash,
            // which expire with it, and no admission (nothing is budgeted).
            return match self
                .run_bucket(
                    &self.scripts.check,
                    upstream,
                    config,
                    &["0", &wait_ms, &stop_ms, &patience],
                    deadline,
                )
                .await
            {
                Ok(reply) => Ok(self.checked(upstream, config, &reply)),
                Err(_) => Ok(self.fallback_view(upstream, config, 0).await?.0),
            };
        }
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => {
                return self.fallback_check(upstream, config, failure, fleet).await;
            }
            Err(Err(refused)) => return Err(refused),
        };
        match self
            .run_bucket(
                &self.scripts.check,
                upstream,
                config,
                &["1", &wait_ms, &stop_ms, &patience],
                deadline,
            )
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(BudgetCheck {
                    withdrew: reply.result == 1,
                    ..self.checked(upstream, config, &reply)
                })
            }
            Err(failure) => self.fallback_check(upstream, config, failure, fleet).await,
        }
    }

    /// A check script's reading, nothing withdrawn.
    fn checked(
        &self,
        upstream: &str,
        config: &BucketConfig,
        reply: &crate::redis::replies::Reply,
    ) -> BudgetCheck {
        self.note_switch(upstream, reply.enabled);
        let tokens = if reply.tracked {
            reply.tokens.min(config.capacity_units())
        } else {
            reply.tokens
        };
        BudgetCheck {
            tokens: units_to_tokens(tokens),
            retries_enabled: reply.enabled,
            withdrew: false,
            pushback: reply.pushback(),
            pushback_remaining: reply.pushback_remaining(),
        }
    }

    pub(in crate::redis) async fn direct_withdraw(
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

    pub(in crate::redis) async fn direct_deposit(
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
