//! Answers while Redis is unreachable (or a request got no answer), per
//! upstream as its `on_unavailable` says: `local` from a bucket of this
//! replica's with no initial tokens and no floor, funded only by deposits
//! Redis never received; `deny` with `StoreError::Unavailable`. Local and
//! immediate: nothing here waits on Redis, so a fallback adds nothing to a
//! call's deadline. The same for both modes.

use super::{Core, Operations, Source, bump};
use crate::redis::error::{Failure, RedisStoreError, unavailable};
use crate::{
    BucketConfig, BudgetCheck, BudgetStore, FleetCall, OnUnavailable, StoreError, units_to_tokens,
};

/// The parameters of the fallback bucket: same capacity and ratio, no
/// initial tokens, no floor (see the module docs for why).
pub(in crate::redis) fn local_config(config: &BucketConfig) -> BucketConfig {
    BucketConfig {
        initial: 0.0,
        min_per_second: 0.0,
        ..*config
    }
}

impl<M: Operations> Core<M> {
    /// Admission while Redis is unreachable: the deposits that follow will
    /// go where each upstream's `on_unavailable` sends them. If one of them
    /// denies, its deposit would fail, so the report is refused whole;
    /// otherwise every upstream is admitted to the local fallback (all or
    /// none), where deposits Redis never saw go.
    pub(in crate::redis) async fn admit_locally(
        &self,
        upstreams: &[(&str, &BucketConfig)],
        failure: Failure,
    ) -> Result<(), StoreError> {
        if upstreams
            .iter()
            .any(|(_, config)| config.on_unavailable == OnUnavailable::Deny)
        {
            bump(&self.counters.unavailable, 1);
            return Err(failure.into_error());
        }
        let local: Vec<(&str, BucketConfig)> = upstreams
            .iter()
            .map(|(upstream, config)| (*upstream, local_config(config)))
            .collect();
        let local: Vec<(&str, &BucketConfig)> = local
            .iter()
            .map(|(upstream, config)| (*upstream, config))
            .collect();
        self.fallback.admit(&local).await
    }

    /// A view while Redis is unreachable: the local bucket plus what this
    /// replica's lease holds (`leased_units`, 0 for an exact store), under
    /// the last known kill switch.
    pub(in crate::redis) async fn fallback_view(
        &self,
        upstream: &str,
        config: &BucketConfig,
        leased_units: u64,
    ) -> Result<(BudgetCheck, Source), StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                let mut check = self
                    .fallback
                    .check(upstream, &local_config(config), false)
                    .await?;
                check.tokens += units_to_tokens(leased_units);
                check.retries_enabled &= !self.is_known_off(upstream);
                Ok((check, Source::Local))
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(unavailable(RedisStoreError::CircuitOpen))
            }
        }
    }

    /// A decision's check that Redis did not answer: the local bucket,
    /// under the last known kill switch. A RETRY from here is paid by a
    /// local token, whatever happened to the shared one.
    pub(in crate::redis) async fn fallback_check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        failure: Failure,
        fleet: FleetCall,
    ) -> Result<BudgetCheck, StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                let off = self.is_known_off(upstream);
                // The pushback is kept locally too while Redis is away.
                let mut check = self
                    .fallback
                    .check_in_fleet(upstream, &local_config(config), !off, fleet)
                    .await?;
                check.retries_enabled &= !off;
                Ok(check)
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }

    pub(in crate::redis) async fn fallback_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
        failure: Failure,
    ) -> Result<Option<f64>, StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                self.fallback
                    .try_withdraw(upstream, &local_config(config))
                    .await
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }

    pub(in crate::redis) async fn fallback_deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        failure: Failure,
    ) -> Result<(), StoreError> {
        match (config.on_unavailable, failure) {
            // Redis never saw these requests: the local bucket may have them.
            (OnUnavailable::Local, Failure::NotSent) => {
                bump(&self.counters.fallbacks, 1);
                self.fallback
                    .deposit(upstream, &local_config(config), requests)
                    .await
            }
            // Redis may have counted them: counting them again could grant
            // twice, so they are lost.
            (OnUnavailable::Local, Failure::Unknown(_)) => {
                bump(&self.counters.lost_deposits, requests);
                Ok(())
            }
            (OnUnavailable::Deny, failure) => {
                bump(&self.counters.lost_deposits, requests);
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_bucket_has_no_initial_tokens_and_no_floor() {
        let config = BucketConfig::default();
        let local = local_config(&config);
        assert_eq!(local.initial, 0.0);
        assert_eq!(local.min_per_second, 0.0);
        assert_eq!(local.capacity, config.capacity);
        assert_eq!(local.ratio, config.ratio);
    }
}
