//! `RetryAdmin`: budget inspection and the fleet-wide kill switch.

use std::future::Future;

use tonic::{Request, Response, Status};

use super::{Service, trace_context, validate};
use crate::budget::{BudgetSnapshot, BudgetStore};
use crate::pb;
use crate::policy::UpstreamPolicy;
use crate::telemetry::{
    Attribute, SPAN_GET_BUDGET, SPAN_LIST_BUDGETS, SPAN_SET_RETRIES_ENABLED, attr,
};

impl<S: BudgetStore> Service<S> {
    /// Runs an admin call inside a span named `name`, with the attributes
    /// `describe` derives from its answer.
    async fn admin_span<T>(
        &self,
        name: &'static str,
        metadata: &tonic::metadata::MetadataMap,
        call: impl Future<Output = Result<T, Status>>,
        describe: impl FnOnce(&T) -> Vec<(&'static str, Attribute)>,
    ) -> Result<T, Status> {
        let span = self.inner.tracer.start(trace_context(metadata).as_ref());
        let result = call.await;
        match &result {
            Ok(answer) => {
                if let Some(span) = span {
                    self.inner.tracer.finish(span, name, describe(answer), None);
                }
            }
            Err(status) => self.finish_failed(span, name, status),
        }
        result
    }
}

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
        let call = async {
            let upstream = validate::upstream("upstream", &request.get_ref().upstream)?;
            let policy = self.inner.policies.get(upstream);
            let snapshot = self.inner.store.view(upstream, &policy.bucket).await?;
            Ok(budget(snapshot, policy))
        };
        let describe =
            |budget: &pb::Budget| vec![(attr::UPSTREAM, Attribute::Text(budget.upstream.clone()))];
        let budget = self
            .admin_span(SPAN_GET_BUDGET, request.metadata(), call, describe)
            .await?;
        Ok(Response::new(pb::GetBudgetResponse {
            budget: Some(budget),
        }))
    }

    async fn list_budgets(
        &self,
        request: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let policies = &self.inner.policies;
        let call = async {
            let snapshots = self
                .inner
                .store
                .list(|upstream| policies.get(upstream).bucket)
                .await?;
            Ok(snapshots
                .into_iter()
                .map(|snapshot| {
                    let policy = policies.get(&snapshot.upstream);
                    budget(snapshot, policy)
                })
                .collect::<Vec<_>>())
        };
        let budgets = self
            .admin_span(SPAN_LIST_BUDGETS, request.metadata(), call, |_| Vec::new())
            .await?;
        Ok(Response::new(pb::ListBudgetsResponse { budgets }))
    }

    async fn set_retries_enabled(
        &self,
        request: Request<pb::SetRetriesEnabledRequest>,
    ) -> Result<Response<pb::SetRetriesEnabledResponse>, Status> {
        let peer = request.remote_addr();
        let message = request.get_ref();
        let call = async {
            let upstream = validate::upstream("upstream", &message.upstream)?;
            validate::reason("reason", &message.reason)?;
            let policy = self.inner.policies.get(upstream);
            Ok(self
                .inner
                .store
                .set_retries_enabled(upstream, &policy.bucket, message.enabled)
                .await?)
        };
        let describe = |previous: &bool| {
            vec![
                (attr::UPSTREAM, Attribute::Text(message.upstream.clone())),
                (attr::RETRIES_ENABLED, Attribute::Bool(message.enabled)),
                (attr::RETRIES_ENABLED_PREVIOUS, Attribute::Bool(*previous)),
                (attr::REASON, Attribute::Text(message.reason.clone())),
                (
                    attr::PEER,
                    Attribute::Text(peer.map(|p| p.to_string()).unwrap_or_default()),
                ),
            ]
        };
        let previous = self
            .admin_span(SPAN_SET_RETRIES_ENABLED, request.metadata(), call, describe)
            .await?;
        let upstream = message.upstream.as_str();
        let reason = message.reason.as_str();
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
