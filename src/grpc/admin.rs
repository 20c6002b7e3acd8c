//! `RetryAdmin`: budget inspection and the fleet-wide kill switch.

use std::future::Future;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::{Live, Service, trace_context, validate};
use crate::auth::{Denied, Principal};
use crate::budget::{BudgetSnapshot, BudgetStore};
use crate::pb;
use crate::policy::UpstreamPolicy;
use crate::telemetry::{
    Attribute, SPAN_GET_BUDGET, SPAN_LIST_BUDGETS, SPAN_RELOAD_CONFIG, SPAN_SET_RETRIES_ENABLED,
    attr,
};

impl<S: BudgetStore> Service<S> {
    /// Runs an admin call for an admin principal, inside a span named
    /// `name` with the attributes `describe` derives from its answer.
    async fn admin_call<M, T, F, Fut>(
        &self,
        name: &'static str,
        request: &Request<M>,
        call: F,
        describe: impl FnOnce(&T, &Principal) -> Vec<(&'static str, Attribute)>,
    ) -> Result<(T, Arc<Principal>), Status>
    where
        F: FnOnce(Arc<Live>) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let span = self
            .inner
            .tracer
            .start(trace_context(request.metadata()).as_ref());
        let live = self.policies();
        let principal = match self.authenticate(&live, request).and_then(|principal| {
            if principal.admin {
                Ok(Arc::clone(principal))
            } else {
                Err(Denied::PermissionDenied(format!(
                    "principal {:?} lacks the admin role",
                    principal.name
                ))
                .into())
            }
        }) {
            Ok(principal) => principal,
            Err(status) => {
                self.finish_failed(span, name, &status);
                return Err(status);
            }
        };
        let result = call(live).await;
        match &result {
            Ok(answer) => {
                if let Some(span) = span {
                    let attributes = describe(answer, &principal);
                    self.inner.tracer.finish(span, name, attributes, None);
                }
            }
            Err(status) => self.finish_failed(span, name, status),
        }
        result.map(|answer| (answer, principal))
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
        let wanted = &request.get_ref().upstream;
        let call = |live: Arc<Live>| async move {
            let upstream = validate::upstream("upstream", wanted)?;
            let policy = live.policies.get(upstream);
            let snapshot = self.inner.store.view(upstream, &policy.bucket).await?;
            Ok(budget(snapshot, policy))
        };
        let describe = |budget: &pb::Budget, _: &Principal| {
            vec![(attr::UPSTREAM, Attribute::Text(budget.upstream.clone()))]
        };
        let (budget, _) = self
            .admin_call(SPAN_GET_BUDGET, &request, call, describe)
            .await?;
        Ok(Response::new(pb::GetBudgetResponse {
            budget: Some(budget),
        }))
    }

    async fn list_budgets(
        &self,
        request: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let call = |live: Arc<Live>| async move {
            let policies = &live.policies;
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
        let (budgets, _) = self
            .admin_call(SPAN_LIST_BUDGETS, &request, call, |_, _| Vec::new())
            .await?;
        Ok(Response::new(pb::ListBudgetsResponse { budgets }))
    }

    async fn set_retries_enabled(
        &self,
        request: Request<pb::SetRetriesEnabledRequest>,
    ) -> Result<Response<pb::SetRetriesEnabledResponse>, Status> {
        let peer = request.remote_addr();
        let message = request.get_ref();
        let call = |live: Arc<Live>| async move {
            let upstream = validate::upstream("upstream", &message.upstream)?;
            validate::reason("reason", &message.reason)?;
            let policy = live.policies.get(upstream);
            Ok(self
                .inner
                .store
                .set_retries_enabled(upstream, &policy.bucket, message.enabled)
                .await?)
        };
        let describe = |previous: &bool, principal: &Principal| {
            vec![
                (attr::PRINCIPAL, Attribute::Text(principal.name.clone())),
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
        let (previous, principal) = self
            .admin_call(SPAN_SET_RETRIES_ENABLED, &request, call, describe)
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
            principal = principal.name,
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

    async fn reload_config(
        &self,
        request: Request<pb::ReloadConfigRequest>,
    ) -> Result<Response<pb::ReloadConfigResponse>, Status> {
        let call = |_: Arc<Live>| async { Ok(self.reload()?) };
        let describe = |_: &(usize, Vec<&'static str>), principal: &Principal| {
            vec![(attr::PRINCIPAL, Attribute::Text(principal.name.clone()))]
        };
        let ((named, restart_required), principal) = self
            .admin_call(SPAN_RELOAD_CONFIG, &request, call, describe)
            .await?;
        tracing::warn!(target: "retryd::audit", principal = principal.name, "configuration reloaded by RetryAdmin");
        Ok(Response::new(pb::ReloadConfigResponse {
            named_upstreams: named as u32,
            restart_required: restart_required.into_iter().map(str::to_owned).collect(),
        }))
    }
}
