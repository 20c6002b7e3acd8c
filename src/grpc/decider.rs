//! `RetryDecider`: Decide, DecideStream and ReportTraffic.

use std::pin::Pin;
use std::time::{Instant, SystemTime};

use futures::{Stream, StreamExt};
use rand::Rng;
use tonic::{Request, Response, Status, Streaming};

use super::{Service, validate};
use crate::budget::{BudgetStore, StoreError};
use crate::engine::{self, BudgetView, Decision, DenyReason, Evidence, Facts, Verdict};
use crate::pb;

/// How many stream items may be in flight at once. Responses still leave
/// in request order; the window only lets store round trips overlap.
const STREAM_WINDOW: usize = 32;

impl<S: BudgetStore> Service<S> {
    /// Decides one request: validate, look at the budget, decide, and spend
    /// a token only if the verdict is RETRY.
    pub(super) async fn decide_one(
        &self,
        request: &pb::DecideRequest,
    ) -> Result<pb::DecideResponse, Status> {
        let started = Instant::now();
        let valid = validate::decide_request(request)?;
        let policy = self.inner.policies.get(valid.upstream);
        let store = &self.inner.store;

        let view = match store.view(valid.upstream, &policy.bucket).await {
            Ok(snapshot) => BudgetView::from(&snapshot),
            Err(StoreError::Unavailable(_)) => BudgetView {
                tokens: 0.0,
                retries_enabled: true,
                unavailable: true,
            },
            Err(other) => return Err(other.into()),
        };
        let facts = Facts {
            idempotency: valid.idempotency,
            body: &valid.body,
            attempt: valid.attempt,
            claimed_evidence: valid.claimed_evidence,
            failure: valid.failure,
            http_status: valid.http_status,
            retry_after: valid.retry_after,
            deadline_remaining: valid.deadline_remaining,
            first_byte_delivered: valid.first_byte_delivered,
            runtime_draining: valid.runtime_draining,
            auth_refresh_attempted: valid.auth_refresh_attempted,
            previous_backoff: valid.previous_backoff,
            max_attempts: valid.max_attempts,
            budget: view,
            now: SystemTime::now(),
            jitter: rand::rng().random::<f64>(),
        };
        let mut decision = engine::decide(&facts, &policy.engine);
        let mut tokens_remaining = view.tokens;
        if let Verdict::Retry { .. } = decision.verdict {
            match store.try_withdraw(valid.upstream, &policy.bucket).await {
                Ok(Some(left)) => tokens_remaining = left,
                // Someone else took the last token after we looked.
                Ok(None) => {
                    decision = decision.into_budget_denial(DenyReason::BudgetExhausted);
                    tokens_remaining = 0.0;
                }
                // A withdrawal whose outcome is unknown is not a RETRY.
                Err(StoreError::Unavailable(_)) => {
                    decision = decision.into_budget_denial(DenyReason::BudgetUnavailable);
                }
                Err(other) => return Err(other.into()),
            }
        }

        let decision_id = format!("{:032x}", rand::rng().random::<u128>());
        self.inner
            .metrics
            .record_decision(valid.upstream, &decision, started.elapsed());
        tracing::debug!(
            target: "retryd::decision",
            decision_id,
            upstream = valid.upstream,
            operation = valid.operation,
            attempt = valid.attempt,
            evidence = decision.effective_evidence.as_str(),
            verdict = decision.verdict.as_str(),
            rule = decision.rule.number(),
            "decided"
        );
        Ok(response(&decision, decision_id, tokens_remaining))
    }

    async fn report_traffic(&self, request: &pb::ReportTrafficRequest) -> Result<u32, Status> {
        let entries = validate::traffic_report(request)?;
        let mut accepted = 0;
        for (upstream, requests) in entries {
            let policy = self.inner.policies.get(upstream);
            self.inner
                .store
                .deposit(upstream, &policy.bucket, requests)
                .await?;
            self.inner.metrics.record_deposit(requests);
            accepted += 1;
        }
        Ok(accepted)
    }
}

fn response(decision: &Decision, decision_id: String, tokens_remaining: f64) -> pb::DecideResponse {
    let (verdict, backoff, deny_reason, refresh_credentials) = match decision.verdict {
        Verdict::Retry {
            backoff,
            refresh_credentials,
        } => (
            pb::Verdict::Retry,
            Some(backoff),
            pb::DenyReason::Unspecified,
            refresh_credentials,
        ),
        Verdict::Deny(reason) => (pb::Verdict::Deny, None, deny_reason(reason), false),
        Verdict::Ambiguous => (
            pb::Verdict::Ambiguous,
            None,
            pb::DenyReason::Unspecified,
            false,
        ),
    };
    let backoff = backoff.unwrap_or_default();
    pb::DecideResponse {
        verdict: verdict as i32,
        backoff: Some(prost_types::Duration {
            seconds: backoff.as_secs() as i64,
            nanos: backoff.subsec_nanos() as i32,
        }),
        deny_reason: deny_reason as i32,
        refresh_credentials,
        rule: u32::from(decision.rule.number()),
        effective_evidence: evidence(decision.effective_evidence) as i32,
        evidence_adjusted: decision.evidence_adjusted,
        decision_id,
        tokens_remaining,
        explanation: decision.to_string(),
        error: None,
    }
}

fn deny_reason(reason: DenyReason) -> pb::DenyReason {
    match reason {
        DenyReason::MaxAttempts => pb::DenyReason::MaxAttempts,
        DenyReason::BudgetExhausted => pb::DenyReason::BudgetExhausted,
        DenyReason::BudgetUnavailable => pb::DenyReason::BudgetUnavailable,
        DenyReason::BodyNotReplayable => pb::DenyReason::BodyNotReplayable,
        DenyReason::ResponseAlreadyDelivered => pb::DenyReason::ResponseAlreadyDelivered,
        DenyReason::RuntimeDraining => pb::DenyReason::RuntimeDraining,
        DenyReason::RetriesDisabled => pb::DenyReason::RetriesDisabled,
        DenyReason::Deadline => pb::DenyReason::Deadline,
        DenyReason::PermanentFailure => pb::DenyReason::PermanentFailure,
        DenyReason::StatusNotRetryable => pb::DenyReason::StatusNotRetryable,
    }
}

fn evidence(evidence: Evidence) -> pb::Evidence {
    match evidence {
        Evidence::NotSent => pb::Evidence::NotSent,
        Evidence::SentNoResponse => pb::Evidence::SentNoResponse,
        Evidence::ResponseReceived => pb::Evidence::ResponseReceived,
        Evidence::PartialResponse => pb::Evidence::PartialResponse,
    }
}

type DecideResponseStream = Pin<Box<dyn Stream<Item = Result<pb::DecideResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<S: BudgetStore> pb::retry_decider_server::RetryDecider for Service<S> {
    async fn decide(
        &self,
        request: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        self.decide_one(request.get_ref()).await.map(Response::new)
    }

    type DecideStreamStream = DecideResponseStream;

    async fn decide_stream(
        &self,
        request: Request<Streaming<pb::DecideRequest>>,
    ) -> Result<Response<Self::DecideStreamStream>, Status> {
        let service = self.clone();
        let responses = request
            .into_inner()
            .map(move |item| {
                let service = service.clone();
                async move {
                    match item {
                        // A bad item is answered in place, so one caller's
                        // mistake does not tear down a shared sidecar stream.
                        Ok(request) => {
                            Ok(service.decide_one(&request).await.unwrap_or_else(|status| {
                                pb::DecideResponse {
                                    error: Some(pb::StreamError {
                                        code: status.code() as i32,
                                        message: status.message().to_owned(),
                                    }),
                                    ..pb::DecideResponse::default()
                                }
                            }))
                        }
                        // The transport failed: end the stream with it.
                        Err(status) => Err(status),
                    }
                }
            })
            .buffered(STREAM_WINDOW);
        Ok(Response::new(Box::pin(responses)))
    }

    async fn report_traffic(
        &self,
        request: Request<pb::ReportTrafficRequest>,
    ) -> Result<Response<pb::ReportTrafficResponse>, Status> {
        let accepted = Service::report_traffic(self, request.get_ref()).await?;
        Ok(Response::new(pb::ReportTrafficResponse { accepted }))
    }
}
