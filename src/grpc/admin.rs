//! `RetryAdmin`: budget inspection and the fleet-wide kill switch.

use tonic::{Request, Response, Status};

use super::{Service, validate};
use crate::budget::{BudgetSnapshot, BudgetStore};
use crate::pb;
use crate::policy::UpstreamPolicy;

fn budget(snapshot: BudgetSnapshot, policy: &UpstreamPolicy) -> pb::Budget {
    pb::Budget {
        upstream: snapshot.upstream,
        tokens: snapshot.tokens,
        capacity: policy.bucket.capacity,
        ratio: policy.bucket.ratio,
        min_per_second: policy.bucket.min_per_second,
        retries_enabled: snapshot.retries_enabled,
        tracked: snapshot.tracked,
    }
}

#[tonic::async_trait]
impl<S: BudgetStore> pb::retry_admin_server::RetryAdmin for Service<S> {
    async fn get_budget(
        &self,
        request: Request<pb::GetBudgetRequest>,
    ) -> Result<Response<pb::GetBudgetResponse>, Status> {
        let upstream = validate::upstream("upstream", &request.get_ref().upstream)?;
        let policy = self.inner.policies.get(upstream);
        let snapshot = self.inner.store.view(upstream, &policy.bucket).await?;
        Ok(Response::new(pb::GetBudgetResponse {
            budget: Some(budget(snapshot, policy)),
        }))
    }

    async fn list_budgets(
        &self,
        _request: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let policies = &self.inner.policies;
        let snapshots = self
            .inner
            .store
            .list(|upstream| policies.get(upstream).bucket)
            .await?;
        let budgets = snapshots
            .into_iter()
            .map(|snapshot| {
                let policy = policies.get(&snapshot.upstream);
                budget(snapshot, policy)
            })
            .collect();
        Ok(Response::new(pb::ListBudgetsResponse { budgets }))
    }

    async fn set_retries_enabled(
        &self,
        request: Request<pb::SetRetriesEnabledRequest>,
    ) -> Result<Response<pb::SetRetriesEnabledResponse>, Status> {
        let peer = request.remote_addr();
        let message = request.get_ref();
        let upstream = validate::upstream("upstream", &message.upstream)?;
        let reason = validate::reason("reason", &message.reason)?;
        let policy = self.inner.policies.get(upstream);
        let previous = self
            .inner
            .store
            .set_retries_enabled(upstream, &policy.bucket, message.enabled)
            .await?;
        // The kill switch is an audited act: who, what, why.
        tracing::warn!(
            target: "retryd::audit",
            upstream,
            enabled = message.enabled,
            previous,
            reason,
            peer = ?peer,
            "retries {} for upstream",
            if message.enabled { "switched on" } else { "switched off" }
        );
        Ok(Response::new(pb::SetRetriesEnabledResponse {
            upstream: upstream.to_owned(),
            enabled: message.enabled,
            previous,
        }))
    }
}
