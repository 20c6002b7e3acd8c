//! `RetryDecider`: Decide, DecideStream and ReportTraffic.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use futures::{Stream, StreamExt};
use rand::Rng;
use tonic::{Request, Response, Status, Streaming};

use super::validate::ValidDecideRequest;
use super::{Live, Service, trace_context, validate};
use crate::auth::{Denied, Principal};
use crate::budget::{BudgetStore, StoreError};
use crate::engine::{self, BudgetView, Decision, DenyReason, Evidence, Idempotency, Verdict};
use crate::pb;
use crate::telemetry::metrics::StoreOp;
use crate::telemetry::trace::hex;
use crate::telemetry::{Attribute, SPAN_DECIDE, SPAN_REPORT_TRAFFIC, TraceContext, attr};

/// How many stream items may be in flight at once. Responses still leave
/// in request order; the window only lets store round trips overlap.
const STREAM_WINDOW: usize = 32;

impl<S: BudgetStore> Service<S> {
    /// Decides one request under the caller's trace context: validate, look
    /// at the budget, decide, spend a token only if the verdict is RETRY,
    /// and record the decision as a span, a log line and counters.
    /// `live` is the configuration the whole decision uses, loaded once by
    /// the caller, so that a reload never splits one decision.
    pub(super) async fn decide_one(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::DecideRequest,
        parent: Option<&TraceContext>,
    ) -> Result<pb::DecideResponse, Status> {
        let started = Instant::now();
        let span = self.inner.tracer.start(parent);
        let valid = match validate::decide_request(request)
            .map_err(Status::from)
            .and_then(|valid| {
                permit(principal, valid.upstream, "upstream")?;
                Ok(valid)
            }) {
            Ok(valid) => valid,
            Err(status) => {
                self.finish_failed(span, SPAN_DECIDE, &status);
                return Err(status);
            }
        };
        let (decision, tokens_remaining) = match self.decide_valid(live, &valid).await {
            Ok(outcome) => outcome,
            Err(status) => {
                self.finish_failed(span, SPAN_DECIDE, &status);
                return Err(status);
            }
        };

        let decision_id = hex(&rand::rng().random::<[u8; 16]>());
        self.inner
            .metrics
            .record_decision(valid.upstream, &decision, started.elapsed());
        tracing::debug!(
            target: "retryd::decision",
            decision_id,
            trace_id = span.as_ref().map(|s| &s.trace_id).or(parent.map(|p| &p.trace_id)).map(|id| hex(id)),
            upstream = valid.upstream,
            operation = valid.operation,
            attempt = valid.attempt,
            evidence = decision.effective_evidence.as_str(),
            verdict = decision.verdict.as_str(),
            rule = decision.rule.number(),
            "decided"
        );
        if let Some(span) = span {
            let attributes =
                self.decision_attributes(&valid, &decision, tokens_remaining, &decision_id);
            self.inner
                .tracer
                .finish(span, SPAN_DECIDE, attributes, None);
        }
        Ok(response(&decision, decision_id, tokens_remaining))
    }

    /// The decision proper, on a validated request, with one store call.
    ///
    /// The budget (rules 2 and 5) can only turn a would-be verdict into a
    /// DENY. So the engine first decides as if the budget allowed: if that
    /// is RETRY, the store is asked to withdraw a token in the same call
    /// that reads the budget; if not, only to read it. Whenever the budget
    /// read does not allow, the engine decides again on what was read (pure,
    /// no I/O). A shared store thus answers every decision in one round
    /// trip instead of a view plus a withdrawal.
    async fn decide_valid(
        &self,
        live: &Live,
        valid: &ValidDecideRequest<'_>,
    ) -> Result<(Decision, f64), Status> {
        let policy = live.policies.get(valid.upstream);
        // Only an HTTP-date Retry-After reads the wall clock.
        let now = if valid.retry_after.is_some() {
            SystemTime::now()
        } else {
            SystemTime::UNIX_EPOCH
        };
        let mut facts = valid.facts(BudgetView::OPEN, now, rand::rng().random::<f64>());
        let hoped = engine::decide(&facts, &policy.engine);
        let withdraw = matches!(hoped.verdict, Verdict::Retry { .. });

        let started = Instant::now();
        let checked = self
            .inner
            .store
            .check(valid.upstream, &policy.bucket, withdraw)
            .await;
        let op = if withdraw {
            StoreOp::Withdraw
        } else {
            StoreOp::View
        };
        self.inner
            .metrics
            .record_store(op, started.elapsed(), checked.is_err());
        facts.budget = match checked {
            Ok(check) if check.withdrew => return Ok((hoped, check.tokens)),
            Ok(check) => BudgetView::from(&check),
            // The store already fell back to a local bucket if the policy
            // allows; this error means the policy is to deny. A withdrawal
            // whose outcome is unknown is not a RETRY either.
            Err(StoreError::Unavailable(_)) => BudgetView {
                tokens: 0.0,
                retries_enabled: true,
                unavailable: true,
            },
            Err(other) => return Err(other.into()),
        };
        let tokens = facts.budget.tokens;
        if facts.budget.allows() && !withdraw {
            return Ok((hoped, tokens));
        }
        let decision = engine::decide(&facts, &policy.engine);
        Ok(match decision.verdict {
            // The read allowed a retry but no token came with it: someone
            // else took the last one in between (leased mode's view is a
            // cached reading).
            Verdict::Retry { .. } => (
                decision.into_budget_denial(DenyReason::BudgetExhausted),
                0.0,
            ),
            _ => (decision, tokens),
        })
    }

    fn decision_attributes(
        &self,
        valid: &ValidDecideRequest<'_>,
        decision: &Decision,
        tokens_remaining: f64,
        decision_id: &str,
    ) -> Vec<(&'static str, Attribute)> {
        let mut attributes = vec![
            (attr::DECISION_ID, Attribute::Text(decision_id.to_owned())),
            (attr::UPSTREAM, Attribute::Text(valid.upstream.to_owned())),
            (attr::OPERATION, Attribute::Text(valid.operation.to_owned())),
            (attr::ATTEMPT, Attribute::Int(i64::from(valid.attempt))),
            (
                attr::IDEMPOTENCY,
                Attribute::Static(idempotency_name(valid.idempotency)),
            ),
            (
                attr::EVIDENCE_EFFECTIVE,
                Attribute::Static(decision.effective_evidence.as_str()),
            ),
            (attr::VERDICT, Attribute::Static(decision.verdict.as_str())),
            (
                attr::RULE,
                Attribute::Int(i64::from(decision.rule.number())),
            ),
            (attr::TOKENS_REMAINING, Attribute::Float(tokens_remaining)),
            (attr::STORE, Attribute::Static(self.inner.store_label)),
        ];
        if let Some(claimed) = valid.claimed_evidence {
            attributes.push((attr::EVIDENCE_CLAIMED, Attribute::Static(claimed.as_str())));
        }
        if let Some(failure) = valid.failure {
            attributes.push((attr::FAILURE, Attribute::Static(failure.as_str())));
        }
        if let Some(status) = valid.http_status {
            attributes.push((attr::HTTP_STATUS, Attribute::Int(i64::from(status))));
        }
        match decision.verdict {
            Verdict::Retry { backoff, .. } => {
                attributes.push((
                    attr::BACKOFF_MS,
                    Attribute::Float(backoff.as_secs_f64() * 1000.0),
                ));
            }
            Verdict::Deny(reason) => {
                attributes.push((attr::DENY_REASON, Attribute::Static(reason.as_str())))
            }
            Verdict::Ambiguous => {}
        }
        attributes
    }

    async fn report_traffic(
        &self,
        live: &Live,
        principal: &Principal,
        request: &pb::ReportTrafficRequest,
    ) -> Result<u32, Status> {
        let entries = validate::traffic_report(request)?;
        // All or nothing: a report naming a forbidden upstream deposits
        // nowhere.
        for (index, (upstream, _)) in entries.iter().enumerate() {
            permit(principal, upstream, &format!("traffic[{index}].upstream"))?;
        }
        let mut accepted = 0;
        for (upstream, requests) in entries {
            let policy = live.policies.get(upstream);
            let depositing = Instant::now();
            let deposited = self
                .inner
                .store
                .deposit(upstream, &policy.bucket, requests)
                .await;
            self.inner.metrics.record_store(
                StoreOp::Deposit,
                depositing.elapsed(),
                deposited.is_err(),
            );
            deposited?;
            self.inner.metrics.record_deposit(requests);
            accepted += 1;
        }
        Ok(accepted)
    }
}

/// Refuses an upstream the principal may not use.
fn permit(principal: &Principal, upstream: &str, field: &str) -> Result<(), Status> {
    if principal.may_use(upstream) {
        Ok(())
    } else {
        Err(Denied::PermissionDenied(format!(
            "{field}: principal {:?} may not use upstream {upstream:?}",
            principal.name
        ))
        .into())
    }
}

fn idempotency_name(idempotency: Idempotency) -> &'static str {
    match idempotency {
        Idempotency::Safe => "safe",
        Idempotency::Idempotent => "idempotent",
        Idempotency::IdempotentWithKey => "idempotent_with_key",
        Idempotency::NonIdempotent => "non_idempotent",
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
        // One load of the configuration serves authentication and decision.
        let live = self.policies();
        let principal = self.authenticate(&live, &request)?;
        let parent = trace_context(request.metadata());
        self.decide_one(&live, &principal, request.get_ref(), parent.as_ref())
            .await
            .map(Response::new)
    }

    type DecideStreamStream = DecideResponseStream;

    async fn decide_stream(
        &self,
        request: Request<Streaming<pb::DecideRequest>>,
    ) -> Result<Response<Self::DecideStreamStream>, Status> {
        // The caller authenticates once for the stream; each item is still
        // checked against the upstreams it may use.
        let principal = self.authenticate(&self.policies(), &request)?;
        let service = self.clone();
        // Every item's span is a child of the stream's trace context.
        let parent = trace_context(request.metadata()).map(Arc::new);
        let responses = request
            .into_inner()
            .map(move |item| {
                let service = service.clone();
                let parent = parent.clone();
                let principal = Arc::clone(&principal);
                async move {
                    match item {
                        // A bad item is answered in place, so one caller's
                        // mistake does not tear down a shared sidecar stream.
                        Ok(request) => Ok(service
                            .decide_one(
                                &service.policies(),
                                &principal,
                                &request,
                                parent.as_deref(),
                            )
                            .await
                            .unwrap_or_else(|status| pb::DecideResponse {
                                error: Some(pb::StreamError {
                                    code: status.code() as i32,
                                    message: status.message().to_owned(),
                                }),
                                ..pb::DecideResponse::default()
                            })),
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
        let live = self.policies();
        let principal = self.authenticate(&live, &request)?;
        let span = self
            .inner
            .tracer
            .start(trace_context(request.metadata()).as_ref());
        match Service::report_traffic(self, &live, &principal, request.get_ref()).await {
            Ok(accepted) => {
                if let Some(span) = span {
                    let requests: u64 = request
                        .get_ref()
                        .traffic
                        .iter()
                        .map(|entry| entry.requests)
                        .sum();
                    let attributes = vec![
                        (attr::TRAFFIC_ENTRIES, Attribute::Int(i64::from(accepted))),
                        (attr::TRAFFIC_REQUESTS, Attribute::Int(requests as i64)),
                    ];
                    self.inner
                        .tracer
                        .finish(span, SPAN_REPORT_TRAFFIC, attributes, None);
                }
                Ok(Response::new(pb::ReportTrafficResponse { accepted }))
            }
            Err(status) => {
                self.finish_failed(span, SPAN_REPORT_TRAFFIC, &status);
                Err(status)
            }
        }
    }
}
