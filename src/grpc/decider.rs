//! `RetryDecider`: Decide and DecideStream (ReportTraffic is `report.rs`).
//!
//! Long (about 580 lines) because it is the decision path end to end, read
//! in one place: `begin` (authorise, validate, decide as if the budget
//! allowed), the one store call, `conclude` (settle, span, log, counters),
//! and the two RPCs that drive them, each in a synchronous form for a store
//! that answers at once and an asynchronous one for Redis.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use futures::{FutureExt, Stream, StreamExt};
use rand::Rng;
use tonic::{Request, Response, Status, Streaming};

use super::candidate as shadow;
use super::deadline;
use super::validate::ValidDecideRequest;
use super::{Live, Service, peer, peer_addr, trace_context, validate};
use crate::auth::{Denied, Principal};
use crate::budget::{BudgetCheck, BudgetStore, StoreError};
use crate::engine::{self, BudgetView, Decision, DenyReason, Evidence, UnknownOutcome, Verdict};
use crate::pb;
use crate::policy::UpstreamPolicy;
use crate::settle::Settled;
use crate::telemetry::StoreOp;
use crate::telemetry::{Attribute, SPAN_DECIDE, TraceContext, attr};
use crate::telemetry::{SpanStart, hex};

/// How many stream items may be in flight at once. Responses still leave
/// in request order; the window only lets store round trips overlap.
const STREAM_WINDOW: usize = 32;

/// The methods, as refusals name them in the audit log.
const RPC_DECIDE: &str = "/retryd.v1.RetryDecider/Decide";
const RPC_DECIDE_STREAM: &str = "/retryd.v1.RetryDecider/DecideStream";

/// A decision up to its one store call: validated, authorized, and decided
/// as if the budget allowed (`hoped`).
struct Begun<'r> {
    principal: &'r Principal,
    valid: ValidDecideRequest<'r>,
    policy: &'r UpstreamPolicy,
    now: SystemTime,
    jitter: f64,
    hoped: Decision,
    /// `hoped` is a RETRY: the store call may spend a token.
    withdraw: bool,
    started: Instant,
    span: Option<SpanStart>,
    /// `rpc.method` of the span: `Decide` or `DecideStream`.
    method: &'static str,
}

impl<S: BudgetStore> Service<S> {
    /// Finishes one decision that [`Service::begin`] started (validated,
    /// decided as if the budget allowed, under the caller's trace context
    /// and the one configuration `live` the caller loaded, so that a reload
    /// never splits a decision): makes the one store call (a read, plus a
    /// withdrawal only if that decision is RETRY), settles the decision on
    /// what the store said, and records it as a span, a log line and
    /// counters.
    async fn decide_one(
        &self,
        begun: Begun<'_>,
        parent: Option<&TraceContext>,
    ) -> Result<pb::DecideResponse, Status> {
        let store = &self.inner.store;
        let asked = Instant::now();
        let checked = store
            .check(begun.valid.upstream, &begun.policy.bucket, begun.withdraw)
            .await;
        let op = if begun.withdraw {
            StoreOp::Withdraw
        } else {
            StoreOp::View
        };
        self.inner
            .metrics
            .record_store(op, asked.elapsed(), checked.is_err());
        self.conclude(begun, checked, parent)
    }

    /// [`Service::decide_one`] without an executor, for a store whose
    /// answers are ready when returned (`BudgetStore::ANSWERS_AT_ONCE`):
    /// no future is boxed or queued per decision, and the store call is not
    /// timed apart (it is part of the decision's duration).
    fn decide_one_now(
        &self,
        begun: Begun<'_>,
        parent: Option<&TraceContext>,
    ) -> Result<pb::DecideResponse, Status> {
        let checked = self
            .inner
            .store
            .check(begun.valid.upstream, &begun.policy.bucket, begun.withdraw)
            .now_or_never()
            // A store that claims to answer at once but did not: nothing
            // was spent that we know of, and no guess is made.
            .unwrap_or_else(|| {
                Err(StoreError::Unavailable(
                    "the budget store did not answer at once".into(),
                ))
            });
        self.conclude(begun, checked, parent)
    }

    /// Everything before the store call. A refusal is recorded here.
    fn begin<'r>(
        &self,
        live: &'r Live,
        principal: &'r Principal,
        request: &'r pb::DecideRequest,
        parent: Option<&TraceContext>,
        method: &'static str,
    ) -> Result<Begun<'r>, Status> {
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
                let caller = (attr::CALLER, Attribute::Text(principal.name.clone()));
                let method = (attr::RPC_METHOD, Attribute::Static(method));
                self.finish_failed_with(span, SPAN_DECIDE, &status, vec![caller, method]);
                return Err(status);
            }
        };
        let policy = live.policies.get(valid.upstream);
        // Only an HTTP-date Retry-After reads the wall clock.
        let now = if valid.reported.retry_after.is_some() {
            SystemTime::now()
        } else {
            SystemTime::UNIX_EPOCH
        };
        let jitter = rand::rng().random::<f64>();
        // The budget (rules 2 and 5) can only turn a verdict into a DENY, so
        // only a RETRY here needs a token, and then the store withdraws it
        // in the same call that reads the budget.
        let hoped = engine::decide(&valid.facts(BudgetView::OPEN, now, jitter), &policy.engine);
        let withdraw = matches!(hoped.verdict, Verdict::Retry { .. });
        // Only a withdrawal makes the store track an upstream, so only it
        // takes room in the caller's share.
        if withdraw && !policy.bucket.configured {
            if let Err(status) = self.claim_share(principal, [valid.upstream]) {
                let caller = (attr::CALLER, Attribute::Text(principal.name.clone()));
                self.finish_failed_with(span, SPAN_DECIDE, &status, vec![caller]);
                return Err(status);
            }
        }
        Ok(Begun {
            principal,
            valid,
            policy,
            now,
            jitter,
            hoped,
            withdraw,
            started,
            span,
            method,
        })
    }

    /// Everything after the store call: the decision on what the store
    /// said, then the records and the response.
    fn conclude(
        &self,
        begun: Begun<'_>,
        checked: Result<BudgetCheck, StoreError>,
        parent: Option<&TraceContext>,
    ) -> Result<pb::DecideResponse, Status> {
        let valid = &begun.valid;
        let settled = Settled {
            hoped: begun.hoped,
            withdraw: begun.withdraw,
        };
        let facts = valid.facts(BudgetView::OPEN, begun.now, begun.jitter);
        let (decision, tokens_remaining) = match checked {
            Ok(check) => settled.on(&check, &facts, &begun.policy.engine),
            // The store already fell back to a local bucket if the policy
            // allows; this error means the policy is to deny. A withdrawal
            // whose outcome is unknown is not a RETRY either.
            Err(StoreError::Unavailable(_)) => settled.on_view(
                BudgetView {
                    tokens: 0.0,
                    retries_enabled: true,
                    unavailable: true,
                },
                &facts,
                &begun.policy.engine,
            ),
            Err(other) => {
                let status = self.store_refusal(other);
                self.finish_failed(begun.span, SPAN_DECIDE, &status);
                return Err(status);
            }
        };
        let upstream_policy = begun.policy;
        let candidate = upstream_policy
            .candidate
            .as_deref()
            .map(|candidate| self.decide_candidate(valid.upstream, &facts, candidate));
        let shadow = !upstream_policy.enforce;
        self.inner.metrics.record_policy_checks(
            valid.upstream,
            &decision,
            candidate.as_ref().map(|(decision, _)| decision),
            shadow,
        );

        let decision_id = hex(&rand::rng().random::<[u8; 16]>());
        let span_trace = begun.span.as_ref().map(SpanStart::trace_id);
        self.inner.metrics.record_decision(
            valid.upstream,
            &begun.principal.name,
            &decision,
            begun.started.elapsed(),
            span_trace,
        );
        let (deny_reason, backoff_ms) = match decision.verdict {
            Verdict::Deny(reason) => (Some(reason.as_str()), None),
            Verdict::Retry { backoff, .. } => (None, Some(backoff.as_secs_f64() * 1000.0)),
            Verdict::Ambiguous => (None, None),
        };
        tracing::debug!(
            target: "retryd::decision",
            decision_id,
            trace_id = span_trace.or(parent.map(|p| p.trace_id)).map(|id| hex(&id)),
            upstream = valid.upstream,
            operation = valid.operation,
            principal = begun.principal.name,
            attempt = valid.reported.attempt,
            evidence = decision.effective_evidence.as_str(),
            failure = valid.reported.failure.map(|failure| failure.as_str()),
            http_status = valid.reported.http_status,
            grpc_status = valid.reported.grpc_status.map(|code| code.number()),
            verdict = decision.verdict.as_str(),
            deny_reason,
            backoff_ms,
            rule = decision.rule.number(),
            unknown_outcome = decision.unknown_outcome.map(UnknownOutcome::as_str),
            "decided"
        );
        if let Some(span) = begun.span {
            let mut attributes = self.decision_attributes(
                begun.principal,
                valid,
                &decision,
                tokens_remaining,
                &decision_id,
            );
            shadow::attributes(&mut attributes, shadow, candidate.as_ref());
            attributes.push((attr::RPC_METHOD, Attribute::Static(begun.method)));
            self.inner
                .tracer
                .finish(span, SPAN_DECIDE, attributes, None);
        }
        if let Some(log) = &self.inner.decision_log {
            log.decision(
                &begun.principal.name,
                valid.upstream,
                valid.operation,
                &facts,
                &decision,
                tokens_remaining,
                shadow,
                &decision_id,
            );
        }
        let mut answer = response(&decision, decision_id, tokens_remaining);
        answer.shadow = shadow;
        Ok(answer)
    }

    fn decision_attributes(
        &self,
        principal: &Principal,
        valid: &ValidDecideRequest<'_>,
        decision: &Decision,
        tokens_remaining: f64,
        decision_id: &str,
    ) -> Vec<(&'static str, Attribute)> {
        let mut attributes = vec![
            (attr::DECISION_ID, Attribute::Text(decision_id.to_owned())),
            (attr::UPSTREAM, Attribute::Text(valid.upstream.to_owned())),
            (attr::OPERATION, Attribute::Text(valid.operation.to_owned())),
            (
                attr::ATTEMPT,
                Attribute::Int(i64::from(valid.reported.attempt)),
            ),
            (
                attr::IDEMPOTENCY,
                Attribute::Static(crate::decision_log::idempotency_name(
                    valid.reported.idempotency,
                )),
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
            (attr::CALLER, Attribute::Text(principal.name.clone())),
        ];
        if let Some(claimed) = valid.reported.claimed_evidence {
            attributes.push((attr::EVIDENCE_CLAIMED, Attribute::Static(claimed.as_str())));
        }
        if let Some(failure) = valid.reported.failure {
            attributes.push((attr::FAILURE, Attribute::Static(failure.as_str())));
        }
        if let Some(status) = valid.reported.http_status {
            attributes.push((attr::HTTP_STATUS, Attribute::Int(i64::from(status))));
        }
        if let Some(code) = valid.reported.grpc_status {
            attributes.push((attr::GRPC_STATUS, Attribute::Int(i64::from(code.number()))));
        }
        if let Some(pushback) = valid.reported.grpc_pushback {
            attributes.push((attr::GRPC_PUSHBACK, Attribute::Text(pushback.to_owned())));
        }
        if let Some(mark) = decision.unknown_outcome {
            attributes.push((attr::UNKNOWN_OUTCOME, Attribute::Static(mark.as_str())));
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
}

impl<S: BudgetStore> Service<S> {
    /// `Err(DEADLINE_EXCEEDED)` once a stream's deadline has passed.
    fn within(&self, deadline: Option<Instant>) -> Result<(), Status> {
        match deadline {
            Some(deadline) => deadline::expired(deadline, &self.inner.metrics),
            None => Ok(()),
        }
    }
}

/// Refuses an upstream the principal may not use.
pub(super) fn permit(principal: &Principal, upstream: &str, field: &str) -> Result<(), Status> {
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
        explanation: decision.explanation(),
        error: None,
        shadow: false,
        unknown_outcome: unknown_outcome(decision.unknown_outcome) as i32,
    }
}

fn unknown_outcome(mark: Option<UnknownOutcome>) -> pb::UnknownOutcome {
    match mark {
        None => pb::UnknownOutcome::None,
        Some(UnknownOutcome::Reconcile) => pb::UnknownOutcome::Reconcile,
        Some(UnknownOutcome::ResendWithKey) => pb::UnknownOutcome::ResendWithKey,
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
        DenyReason::ServerPushback => pb::DenyReason::ServerPushback,
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
        let live = self.live();
        let principal = self.authenticate(&live, &request, RPC_DECIDE)?;
        let received = peer(&request).and_then(|peer| peer.received.get());
        if let Some(deadline) = deadline::caller_deadline(request.metadata(), received) {
            deadline::still_wanted(deadline, &self.inner.metrics).await?;
        }
        let parent = trace_context(request.metadata());
        let begun = self.begin(
            &live,
            principal,
            request.get_ref(),
            parent.as_ref(),
            "Decide",
        );
        let answer = match begun {
            Ok(begun) if S::ANSWERS_AT_ONCE => self.decide_one_now(begun, parent.as_ref()),
            Ok(begun) => self.decide_one(begun, parent.as_ref()).await,
            Err(status) => Err(status),
        };
        if let Err(status) = &answer {
            let peer = peer_addr(&request);
            self.audit_refusal(RPC_DECIDE, peer, Some(&principal.name), status);
        }
        answer.map(Response::new)
    }

    type DecideStreamStream = DecideResponseStream;

    async fn decide_stream(
        &self,
        request: Request<Streaming<pb::DecideRequest>>,
    ) -> Result<Response<Self::DecideStreamStream>, Status> {
        // The caller authenticates once for the stream; each item is still
        // checked against the upstreams it may use.
        let principal = Arc::clone(self.authenticate(&self.live(), &request, RPC_DECIDE_STREAM)?);
        // The stream's deadline covers every item: one arriving after it is
        // answered DEADLINE_EXCEEDED in place, and spends nothing.
        let received = peer(&request).and_then(|peer| peer.received.get());
        let deadline = deadline::caller_deadline(request.metadata(), received);
        // Every item's span is a child of the stream's trace context.
        let parent = trace_context(request.metadata()).map(Arc::new);
        let peer = peer_addr(&request);
        let items = request.into_inner();
        // A bad item is answered in place, so one caller's mistake does not
        // tear down a shared sidecar stream; a transport error ends it.
        let answered = move |service: &Service<S>,
                             principal: &Principal,
                             answer: Result<pb::DecideResponse, Status>| {
            answer.unwrap_or_else(|status| {
                service.audit_refusal(RPC_DECIDE_STREAM, peer, Some(&principal.name), &status);
                pb::DecideResponse {
                    error: Some(pb::StreamError {
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    }),
                    ..pb::DecideResponse::default()
                }
            })
        };
        let service = self.clone();
        let responses: DecideResponseStream = if S::ANSWERS_AT_ONCE {
            // Decided in the stream's own poll, one item after the other:
            // no future per item to box, queue and reorder.
            Box::pin(items.map(move |item| {
                item.map(|request| {
                    let live = service.live();
                    let answer = service
                        .within(deadline)
                        .and_then(|()| {
                            service.begin(
                                &live,
                                &principal,
                                &request,
                                parent.as_deref(),
                                "DecideStream",
                            )
                        })
                        .and_then(|begun| service.decide_one_now(begun, parent.as_deref()));
                    answered(&service, &principal, answer)
                })
            }))
        } else {
            Box::pin(
                items
                    .map(move |item| {
                        let service = service.clone();
                        let parent = parent.clone();
                        let principal = Arc::clone(&principal);
                        async move {
                            let request = item?;
                            let live = service.live();
                            let begun = service.within(deadline).and_then(|()| {
                                service.begin(
                                    &live,
                                    &principal,
                                    &request,
                                    parent.as_deref(),
                                    "DecideStream",
                                )
                            });
                            let answer = match begun {
                                Ok(begun) => service.decide_one(begun, parent.as_deref()).await,
                                Err(status) => Err(status),
                            };
                            Ok(answered(&service, &principal, answer))
                        }
                    })
                    .buffered(STREAM_WINDOW),
            )
        };
        Ok(Response::new(responses))
    }

    async fn report_traffic(
        &self,
        request: Request<pb::ReportTrafficRequest>,
    ) -> Result<Response<pb::ReportTrafficResponse>, Status> {
        let traffic = request.get_ref().traffic.clone();
        let answer = self.report_traffic_call(request).await;
        // Per upstream, what this call applied: every entry after those an
        // earlier call with the same report id applied. (A report the store
        // failed midway is counted in the total only: which of its entries
        // landed is in its status message, not in a value.)
        if let Ok(response) = &answer {
            let applied = response.get_ref().already_applied as usize;
            for entry in traffic.iter().skip(applied) {
                self.inner
                    .metrics
                    .record_reported(&entry.upstream, entry.requests);
            }
        }
        answer
    }
}
