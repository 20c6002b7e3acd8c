//! `RetryAdmin`: budget inspection and the fleet-wide kill switch.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use super::status::store_status;
use super::{Live, Service, peer_addr, trace_context, validate};
use crate::auth::{Denied, Principal};
use crate::budget::{BudgetSnapshot, BudgetStore};
use crate::decide::Observe;
use crate::pb;
use crate::policy::UpstreamPolicy;
use crate::telemetry::{
    Attribute, SPAN_GET_BUDGET, SPAN_LIST_BUDGETS, SPAN_RELOAD_CONFIG, SPAN_SET_RETRIES_ENABLED,
    StoreOp, attr,
};

impl<S: BudgetStore> Service<S> {
    /// Runs the admin call `rpc` for an admin principal, inside a span
    /// named `name` with the attributes `describe` derives from its answer.
    /// The span is recorded whatever the caller's sampling flag, refused
    /// attempts included, with the peer's address; refusals are also
    /// logged for audit.
    async fn admin_call<M, T, F, Fut>(
        &self,
        rpc: &'static str,
        name: &'static str,
        request: &Request<M>,
        call: F,
        describe: impl FnOnce(&T, &Principal) -> Vec<(&'static str, Attribute)>,
    ) -> Result<(T, Arc<Principal>), Status>
    where
        F: FnOnce(Arc<Live>, Arc<Principal>) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let recorder = self.recorder();
        let span = recorder
            .tracer()
            .start_always(trace_context(request.metadata()).as_ref());
        let peer = peer_addr(request);
        let peer_attribute = || {
            (
                attr::PEER,
                Attribute::Text(peer.map(|p| p.to_string()).unwrap_or_default()),
            )
        };
        let live = self.policies();
        let principal = match self.authenticate(&live, request, rpc) {
            Ok(principal) => Arc::clone(principal),
            Err(status) => {
                recorder.finish_failed(span, name, &status, vec![peer_attribute()]);
                return Err(status);
            }
        };
        let result = if principal.admin {
            call(live, Arc::clone(&principal)).await
        } else {
            Err(Denied::PermissionDenied(format!(
                "principal {:?} lacks the admin role",
                principal.name
            ))
            .into())
        };
        match &result {
            Ok(answer) => {
                if let Some(span) = span {
                    let attributes = describe(answer, &principal);
                    recorder.tracer().finish(span, name, attributes, None);
                }
            }
            Err(status) => {
                recorder.audit_refusal(rpc, peer, Some(&principal.name), status);
                let attributes = vec![
                    peer_attribute(),
                    (attr::PRINCIPAL, Attribute::Text(principal.name.clone())),
                ];
                recorder.finish_failed(span, name, status, attributes);
            }
        }
        result.map(|answer| (answer, principal))
    }
}

/// Refuses an admin act on an upstream outside the principal's patterns:
/// an admin's role is scoped like its decisions.
fn permit(principal: &Principal, upstream: &str) -> Result<(), Status> {
    if principal.may_use(upstream) {
        Ok(())
    } else {
        Err(Denied::PermissionDenied(format!(
            "upstream: principal {:?} may not administer upstream {upstream:?}",
            principal.name
        ))
        .into())
    }
}

fn budget(
    snapshot: BudgetSnapshot,
    policy: &UpstreamPolicy,
    hedging: Option<pb::Hedging>,
) -> pb::Budget {
    pb::Budget {
        hedging,
        upstream: snapshot.upstream,
        tokens: snapshot.tokens,
        capacity: policy.bucket.capacity,
        ratio: policy.bucket.ratio,
        min_per_second: policy.bucket.min_per_second,
        retries_enabled: snapshot.retries_enabled,
        tracked: snapshot.tracked,
        shared_unavailable: snapshot.shared_unavailable,
        adaptive: policy.adaptive,
        pushback_remaining: snapshot.pushback_remaining.map(duration),
        adaptive_level: if policy.adaptive {
            snapshot.adaptive_level
        } else {
            1.0
        },
        ramp: crate::budget::pushback::ramp(snapshot.ramp_elapsed, policy.ramp_window).0,
    }
}

impl<S: BudgetStore> Service<S> {
    /// An admin act's store call, timed and counted as `op="admin"` like
    /// the decisions' and reports' store calls are under their own ops.
    async fn timed_admin<T, E>(&self, call: impl Future<Output = Result<T, E>>) -> Result<T, E> {
        let asked = Instant::now();
        let result = call.await;
        self.recorder()
            .store_call(StoreOp::Admin, asked.elapsed(), result.is_err());
        result
    }
}

#[tonic::async_trait]
impl<S: BudgetStore> pb::retry_admin_server::RetryAdmin for Service<S> {
    async fn get_budget(
        &self,
        request: Request<pb::GetBudgetRequest>,
    ) -> Result<Response<pb::GetBudgetResponse>, Status> {
        let wanted = &request.get_ref().upstream;
        let call = |live: Arc<Live>, principal: Arc<Principal>| async move {
            let upstream = validate::upstream("upstream", wanted)?;
            permit(&principal, upstream)?;
            let policy = live.policies.get(upstream);
            let snapshot = self
                .timed_admin(self.store().view(upstream, &policy.bucket))
                .await
                .map_err(store_status)?;
            let hedging = self.decider().hedging(&live, upstream).map(|served| {
                super::report::record_hedging(self.recorder(), upstream, &served);
                super::answer::hedging(upstream, &served)
            });
            Ok(budget(snapshot, policy, hedging))
        };
        let describe = |budget: &pb::Budget, _: &Principal| {
            vec![(attr::UPSTREAM, Attribute::Text(budget.upstream.clone()))]
        };
        let (budget, _) = self
            .admin_call(
                "/retryd.v1.RetryAdmin/GetBudget",
                SPAN_GET_BUDGET,
                &request,
                call,
                describe,
            )
            .await?;
        Ok(Response::new(pb::GetBudgetResponse {
            budget: Some(budget),
        }))
    }

    async fn list_budgets(
        &self,
        request: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let call = |live: Arc<Live>, principal: Arc<Principal>| async move {
            let policies = &live.policies;
            let snapshots = self
                .timed_admin(self.store().list(|upstream| policies.get(upstream).bucket))
                .await
                .map_err(store_status)?;
            // An admin sees the budgets of the upstreams it administers.
            Ok(snapshots
                .into_iter()
                .filter(|snapshot| principal.may_use(&snapshot.upstream))
                .map(|snapshot| {
                    let policy = policies.get(&snapshot.upstream);
                    let hedging = self
                        .decider()
                        .hedging(&live, &snapshot.upstream)
                        .map(|served| super::answer::hedging(&snapshot.upstream, &served));
                    budget(snapshot, policy, hedging)
                })
                .collect::<Vec<_>>())
        };
        let (budgets, _) = self
            .admin_call(
                "/retryd.v1.RetryAdmin/ListBudgets",
                SPAN_LIST_BUDGETS,
                &request,
                call,
                |_, _| Vec::new(),
            )
            .await?;
        Ok(Response::new(pb::ListBudgetsResponse { budgets }))
    }

    async fn set_retries_enabled(
        &self,
        request: Request<pb::SetRetriesEnabledRequest>,
    ) -> Result<Response<pb::SetRetriesEnabledResponse>, Status> {
        let peer = peer_addr(&request);
        let message = request.get_ref();
        let call = |live: Arc<Live>, principal: Arc<Principal>| async move {
            let upstream = validate::upstream("upstream", &message.upstream)?;
            validate::reason("reason", &message.reason)?;
            permit(&principal, upstream)?;
            let previous = self
                .decider()
                .set_retries_enabled(
                    &live,
                    &principal,
                    upstream,
                    message.enabled,
                    self.recorder(),
                )
                .await
                .map_err(|refused| self.refusal(refused))?;
            self.recorder()
                .switched(upstream, message.enabled, previous);
            Ok(previous)
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
            .admin_call(
                "/retryd.v1.RetryAdmin/SetRetriesEnabled",
                SPAN_SET_RETRIES_ENABLED,
                &request,
                call,
                describe,
            )
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
            peer = peer.map(|peer| peer.to_string()),
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
        // Global: it applies the file the operator wrote, whatever it names.
        let call = |_: Arc<Live>, _: Arc<Principal>| async { Ok(self.try_reload().await?) };
        let describe = |_: &(usize, Vec<&'static str>), principal: &Principal| {
            vec![(attr::PRINCIPAL, Attribute::Text(principal.name.clone()))]
        };
        let ((named, restart_required), principal) = self
            .admin_call(
                "/retryd.v1.RetryAdmin/ReloadConfig",
                SPAN_RELOAD_CONFIG,
                &request,
                call,
                describe,
            )
            .await?;
        tracing::warn!(target: "retryd::audit", principal = principal.name, "configuration reloaded by RetryAdmin");
        Ok(Response::new(pb::ReloadConfigResponse {
            named_upstreams: named as u32,
            restart_required: restart_required.into_iter().map(str::to_owned).collect(),
        }))
    }
}

/// A duration on the wire.
fn duration(duration: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: duration.subsec_nanos() as i32,
    }
}
