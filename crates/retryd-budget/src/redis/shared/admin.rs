//! What both stores answer alike, from Redis only: the kill switch and
//! `list`. Neither has a fallback: while Redis is down they answer
//! `Unavailable`. Never on the decision path.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use tokio::time::Instant;

use super::fallback::local_config;
use super::{Circuited, Core, FAN_OUT, Operations, UpstreamState};
use crate::redis::error::Failure;
use crate::redis::replies::INF_SCORE;
use crate::{BucketConfig, BudgetSnapshot, BudgetStore, StoreError, units_to_tokens};

/// The longest a whole `list` may take, however many upstreams it reads
/// (each read is bounded by the store timeout too).
const LIST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl<M: Operations> Core<M> {
    /// [`crate::BudgetStore::set_retries_enabled`], within one deadline.
    pub(in crate::redis) async fn set_retries_enabled(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> Result<bool, StoreError> {
        let deadline = self.deadline();
        let (state, deadline) = match self.admitted(upstream, config, deadline).await {
            Ok(admitted) => admitted,
            Err(Ok(failure)) => return Err(failure.into_error()),
            Err(Err(refused)) => return Err(refused),
        };
        if !enabled {
            // Mark the index first, so the entry of a switched-off upstream
            // never lapses while it is off.
            state.index_score.store(INF_SCORE, Ordering::Release);
            self.write_index(upstream, &state, INF_SCORE, deadline)
                .await;
        }
        let argument = if enabled { "1" } else { "0" };
        let reply = self
            .run_bucket(
                &self.scripts.set_enabled,
                upstream,
                config,
                &[argument],
                deadline,
            )
            .await
            .map_err(Failure::into_error)?;
        self.note_switch(upstream, reply.enabled);
        state.mode.remember(&reply);
        if let Some(score) = self.index_update(&state, &reply) {
            self.write_index(upstream, &state, score, deadline).await;
        }
        Ok(reply.result == 1)
    }

    /// [`crate::BudgetStore::list`]: the index, then every live bucket (32
    /// reads at a time, each bounded by the store timeout, all by
    /// `LIST_DEADLINE`), plus what this replica holds of each; a bucket
    /// whose node did not answer is listed `shared_unavailable`, with this
    /// replica's local reading. Outside the circuit (`Circuited::No`): a
    /// scrape listing thousands of upstreams must never open it for the
    /// decisions, whose path this is not.
    pub(in crate::redis) async fn list<F>(
        self: &Arc<Self>,
        config_of: F,
    ) -> Result<Vec<BudgetSnapshot>, StoreError>
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        let mut invocation = self.scripts.list.prepare_invoke();
        invocation.key(self.keys.index());
        let deadline = Instant::now() + LIST_DEADLINE;
        let names: Vec<String> = self
            .call_outside_circuit(
                Some(self.keys.index()),
                deadline,
                self.connection.invoke(Some(self.keys.index()), &invocation),
            )
            .await
            .map_err(Failure::into_error)?;
        let wanted: Vec<(String, BucketConfig)> = names
            .into_iter()
            .map(|name| {
                let config = config_of(&name);
                (name, config)
            })
            .collect();
        let readings: Vec<_> = futures::stream::iter(wanted)
            .map(|(name, config)| async move {
                let reply = self
                    .run_bucket_with(
                        &self.scripts.view,
                        &name,
                        &config,
                        &[],
                        deadline,
                        Circuited::No,
                    )
                    .await;
                (name, config, reply)
            })
            .buffer_unordered(FAN_OUT)
            .collect()
            .await;
        let now = Instant::now();
        let mut snapshots = Vec::with_capacity(readings.len());
        for (name, config, reply) in readings {
            let Ok(reply) = reply else {
                // Its node did not answer (a Cluster master down, or slow):
                // listed as unavailable, with this replica's local reading.
                let mut local = self.fallback.view(&name, &local_config(&config)).await?;
                local.retries_enabled &= !self.is_known_off(&name);
                snapshots.push(BudgetSnapshot {
                    tracked: true,
                    shared_unavailable: true,
                    ..local
                });
                continue;
            };
            if !reply.tracked {
                continue;
            }
            let local = self
                .upstreams
                .get(name.as_str())
                .map_or(0, |state| state.mode.local_units(now, &config));
            snapshots.push(BudgetSnapshot {
                tokens: units_to_tokens(
                    reply
                        .tokens
                        .saturating_add(local)
                        .min(config.capacity_units()),
                ),
                retries_enabled: reply.enabled,
                tracked: true,
                shared_unavailable: false,
                pushback_remaining: reply.pushback_remaining(),
                adaptive_level: reply.adaptive_level(),
                ramp_elapsed: reply.ramp_elapsed(),
                upstream: name,
            });
        }
        snapshots.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        Ok(snapshots)
    }
}
