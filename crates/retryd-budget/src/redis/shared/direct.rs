//! The direct operations: each one script on the upstream's keys (after
//! its admission to the index), answered from the fallback when Redis
//! gives no answer. They are the exact mode's operations, and a leased
//! store's once it has shut down and handed its leases back, so they are
//! generic over the mode and must not consult any per-upstream mode state.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Core, Operations, Source, UpstreamState};
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
                adaptive_level: reply.adaptive_level(),
                ramp_elapsed: reply.ramp_elapsed(),
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
            let mut view = self.direct_view(upstream, config, deadline).await?.0;
            view.pushback = fleet.fleet(view.pushback, view.ramp_elapsed);
            return Ok(view);
        }
        let (wait_ms, stop_ms) = fleet.announce.millis();
        let (wait_ms, stop_ms) = (wait_ms.to_string(), stop_ms.to_string());
        let patience = fleet.patience_millis().to_string();
        // The exact double, as the refill's floor is passed.
        let draw = format!("{:?}", fleet.draw);
        let window = fleet.ramp_window.as_millis().to_string();
        if !withdraw {
            // An announcement alone: its two fields in the bucket's hash,
            // which expire with it, and no admission (nothing is budgeted).
            return match self
                .run_bucket(
                    &self.scripts.check,
                    upstream,
                    config,
                    &["0", &wait_ms, &stop_ms, &patience, &draw, &window],
                    deadline,
                )
                .await
            {
                Ok(reply) => Ok(self.checked(upstream, config, &reply, fleet)),
                Err(_) => Ok(self.fallback_view(upstream, config, 0).await?.0),
            };
        }
        let (state, deadline) = match self.admitted(upstream, config, deadline).await {
            Ok(admitted) => admitted,
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
                &["1", &wait_ms, &stop_ms, &patience, &draw, &window],
                deadline,
            )
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(BudgetCheck {
                    withdrew: reply.result == 1,
                    ..self.checked(upstream, config, &reply, fleet)
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
        fleet: FleetCall,
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
            pushback: fleet.fleet(reply.pushback(), reply.ramp_elapsed()),
            pushback_remaining: reply.pushback_remaining(),
            adaptive_level: reply.adaptive_level(),
            ramp_elapsed: reply.ramp_elapsed(),
        }
    }

    /// Notes a report entry's adaptive level (one script; see
    /// `level.lua`). Redis not answering loses the note: the level and
    /// the recovery ramp are the fleet's pacing, never its bound.
    pub(in crate::redis) async fn direct_note_level(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        level: f64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let millionths = |level: f64| ((level.clamp(0.0, 1.0) * 1e6).round() as u64).to_string();
        let reply = self
            .run_bucket(
                &self.scripts.level,
                upstream,
                config,
                &[&millionths(level), &millionths(crate::pushback::LOW_LEVEL)],
                deadline,
            )
            .await;
        if let Ok(reply) = reply {
            if let Some(state) = self.upstreams.get(upstream) {
                state.mode.remember(&reply);
            }
        }
        Ok(())
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
