//! What a call leaves behind: metrics, its span in the caller's trace, the
//! decision log and the throttled audit of refusals. The only code that
//! knows what a decision leaves behind ([`Recorder::record`] of a
//! [`Decided`]); the pipeline reports its store calls here through
//! [`Observe`].
//!
//! Invariant: recording never blocks or fails a call (spans go to a
//! bounded queue, log lines to a bounded writer, both counting drops), and
//! nothing here decides: it imports the pipeline's records, not its parts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::budget::StoreError;
use crate::decide::{Decided, Observe, Refused};
use crate::decision_log::DecisionLog;
use crate::engine::{UnknownOutcome, Verdict};
use crate::telemetry::{
    Attribute, CandidateSpan, DecisionFields, DecisionSpan, DecisionTexts, HedgeSpan, Metrics,
    Refusal, SPAN_DECIDE, SpanBatch, SpanStart, StoreOp, Throttle, TraceContext, Tracer,
    UpstreamLimit, attr, hex,
};

/// How often at most a full share is logged.
const SHARE_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Records calls. One per service, shared by every call.
#[derive(Debug)]
pub struct Recorder {
    metrics: Arc<Metrics>,
    tracer: Tracer,
    /// How the store is labelled on spans: memory, redis-exact, …
    store_label: &'static str,
    /// Every decision and report as a JSON line, if configured.
    decision_log: Option<DecisionLog>,
    /// Refused calls are logged ten at once, then one a second, with a
    /// count of the others: a caller probing keys must not flood the log.
    refusals: Throttle,
    /// A principal at its share is logged at most once per interval.
    full_shares: Throttle,
}

/// A decision's record in the making: its span and when it started.
#[derive(Debug)]
pub struct Recording {
    span: Option<SpanStart>,
    started: Instant,
    /// `rpc.method` of the span: `Decide` or `DecideStream`.
    method: &'static str,
}

impl Recorder {
    /// A recorder into `metrics` and `tracer`, labelling spans with the
    /// store's `store_label`.
    pub fn new(metrics: Arc<Metrics>, tracer: Tracer, store_label: &'static str) -> Recorder {
        Recorder {
            metrics,
            tracer,
            store_label,
            decision_log: None,
            refusals: Throttle::new(Duration::from_secs(1), 10),
            full_shares: Throttle::new(SHARE_WARNING_INTERVAL, 1),
        }
    }

    /// Writes decisions, reports and kill-switch flips to `log` too.
    pub fn with_decision_log(&mut self, mut log: DecisionLog) {
        log.count_drops_in(Arc::clone(&self.metrics));
        self.decision_log = Some(log);
    }

    /// Has the decision log, if any, write out every line it holds (at
    /// shutdown); false if it could not within `within`.
    pub fn flush_decision_log(&self, within: Duration) -> bool {
        self.decision_log
            .as_ref()
            .is_none_or(|log| log.flush(within))
    }

    /// Has the decision log, if any, reopen its file (log rotation).
    pub fn reopen_decision_log(&self) {
        if let Some(log) = &self.decision_log {
            log.reopen();
        }
    }

    /// The metrics recorded into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The tracer spans go to.
    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    /// A DecideStream's span batch (`telemetry::SpanBatch`), for
    /// [`Recorder::paced`] and [`Recorder::record`]; `None` when tracing is
    /// off.
    pub(crate) fn stream_batch(&self) -> Option<Arc<SpanBatch>> {
        self.tracer.stream_batch()
    }

    /// `items`, each polled only once the span export queue and the
    /// decision log's have room: a DecideStream's back-pressure
    /// (`telemetry/pace.rs`); its span `batch` is queued whenever no item
    /// is ready. Neither on, a pass-through.
    pub(crate) fn paced<S>(
        &self,
        items: S,
        batch: Option<Arc<SpanBatch>>,
    ) -> crate::telemetry::Paced<S> {
        let backlogs = self
            .tracer
            .backlog()
            .into_iter()
            .chain(self.decision_log.as_ref().map(DecisionLog::backlog))
            .collect();
        crate::telemetry::Paced::new(items, backlogs, batch)
    }

    /// Starts the record of a decision under the caller's trace context.
    pub fn start(&self, parent: Option<&TraceContext>, method: &'static str) -> Recording {
        Recording {
            span: self.tracer.start(parent),
            started: Instant::now(),
            method,
        }
    }

    /// Records a decision: policy and decision counters, the debug log
    /// line, its span (into its stream's `batch`, if it has one) and its
    /// decision-log line.
    pub(crate) fn record(
        &self,
        recording: Recording,
        parent: Option<&TraceContext>,
        decided: &Decided<'_>,
        batch: Option<&SpanBatch>,
    ) {
        let attempt = &decided.attempt;
        let decision = &decided.decision;
        self.metrics.record_policy_checks(
            attempt.upstream,
            decision,
            decided.candidate.as_ref().map(|(decision, _)| decision),
            decided.shadow,
        );
        if decision.hedge.is_some() {
            self.metrics.record_hedge(attempt.upstream, decision);
        }
        let span_trace = recording.span.as_ref().map(SpanStart::trace_id);
        let took = recording.started.elapsed();
        // The span's end, from the latency just measured: the span and the
        // exemplar read no clock of their own.
        let ended = recording.span.as_ref().map(|span| span.start + took);
        let exemplar = span_trace.zip(ended);
        self.metrics.record_decision(
            attempt.upstream,
            &decided.principal.name,
            decision,
            attempt.reported.lineage.depth(),
            took,
            exemplar,
        );
        let (deny_reason, backoff_ms) = match decision.verdict {
            Verdict::Deny(reason) => (Some(reason.as_str()), None),
            Verdict::Retry { backoff, .. } => (None, Some(backoff.as_secs_f64() * 1000.0)),
            Verdict::Ambiguous => (None, None),
        };
        let reported = &attempt.reported;
        tracing::debug!(
            target: "retryd::decision",
            decision_id = decided.decision_id,
            trace_id = span_trace.or(parent.map(|p| p.trace_id)).map(|id| hex(&id)),
            upstream = attempt.upstream,
            operation = attempt.operation,
            principal = decided.principal.name,
            attempt = reported.attempt,
            evidence = decision.effective_evidence.as_str(),
            failure = reported.failure.map(|failure| failure.as_str()),
            http_status = reported.http_status,
            grpc_status = reported.grpc_status.map(|code| code.number()),
            verdict = decision.verdict.as_str(),
            deny_reason,
            backoff_ms,
            rule = decision.rule.number(),
            unknown_outcome = decision.unknown_outcome.map(UnknownOutcome::as_str),
            "decided"
        );
        if let (Some(span), Some(ended)) = (recording.span, ended) {
            let record = self.decision_span(decided, recording.method);
            self.tracer.finish_decision(span, record, ended, batch);
        }
        if let Some(log) = &self.decision_log {
            log.decision(decided);
        }
    }

    /// Records a decision refused with `status`: its span, naming the
    /// caller when authenticated.
    pub fn refused_decision(&self, recording: Recording, principal: &str, status: &tonic::Status) {
        let attributes = vec![
            (attr::CALLER, Attribute::Text(principal.to_owned())),
            (attr::RPC_METHOD, Attribute::Static(recording.method)),
        ];
        self.finish_failed(recording.span, SPAN_DECIDE, status, attributes);
    }

    /// Finishes the span of a call that failed with `status`, with
    /// `attributes` beside the status code.
    pub fn finish_failed(
        &self,
        span: Option<SpanStart>,
        name: &'static str,
        status: &tonic::Status,
        mut attributes: Vec<(&'static str, Attribute)>,
    ) {
        if let Some(span) = span {
            attributes.push((attr::GRPC_STATUS, Attribute::Int(status.code() as i64)));
            self.tracer
                .finish(span, name, attributes, Some(status.message().to_owned()));
        }
    }

    /// Counts what a refusal says about the upstream limits: a full share
    /// (warned about, naming the principal, at most once per interval) or
    /// the store's own limit.
    pub fn note(&self, refused: &Refused) {
        match refused {
            Refused::ShareFull(full) => {
                self.metrics
                    .record_upstream_refusal(UpstreamLimit::Principal);
                self.full_shares.log(|suppressed| {
                    tracing::warn!(
                        principal = full.principal,
                        limit = full.limit,
                        suppressed,
                        "a principal holds its whole share of unconfigured upstreams (limits.max_upstreams_per_principal); its new upstreams are refused"
                    );
                });
            }
            Refused::Store(StoreError::TooManyUpstreams { .. }) => {
                self.metrics.record_upstream_refusal(UpstreamLimit::Store);
            }
            Refused::Report { refused, .. } => self.note(refused),
            _ => {}
        }
    }

    /// Logs a call refused for want of a credential or a permission, on the
    /// audit target, throttled. Other failures are not refusals and are
    /// not logged here.
    pub fn audit_refusal(
        &self,
        rpc: &str,
        peer: Option<SocketAddr>,
        principal: Option<&str>,
        status: &tonic::Status,
    ) {
        let refusal = match status.code() {
            tonic::Code::Unauthenticated => Refusal::Unauthenticated,
            tonic::Code::PermissionDenied => Refusal::PermissionDenied,
            _ => return,
        };
        // Counted always: the log below is throttled, and global, so one
        // peer's flood would otherwise hide another's refusals.
        self.metrics.record_call_refused(refusal);
        self.refusals.log(|suppressed| {
            tracing::warn!(
                target: "retryd::audit",
                rpc,
                peer = peer.map(|peer| peer.to_string()),
                principal,
                code = ?status.code(),
                reason = status.message(),
                suppressed,
                "call refused"
            );
        });
    }

    /// Logs how many refused calls the audit throttle held back since its
    /// last line, if any.
    pub fn flush_refusals(&self) {
        self.refusals.flush(|suppressed| {
            tracing::warn!(
                target: "retryd::audit",
                suppressed,
                "calls refused and not logged one by one (see retryd_calls_refused_total)"
            );
        });
    }

    /// Records a kill-switch flip (`previous` is what it was before).
    pub fn switched(&self, upstream: &str, enabled: bool, previous: bool) {
        if previous != enabled {
            self.metrics.record_flip(upstream, enabled);
        }
        if let Some(log) = &self.decision_log {
            log.retries_enabled(upstream, enabled);
        }
    }

    /// Records `requests` real requests reported for `upstream` by a
    /// report's call (entries an earlier call applied are not counted).
    pub fn reported(&self, upstream: &str, requests: u64) {
        self.metrics.record_reported(upstream, requests);
    }

    /// The decision's span as a fixed record: what the decision knows,
    /// copied once; the attributes are named and encoded on the export task.
    fn decision_span(&self, decided: &Decided<'_>, method: &'static str) -> DecisionSpan {
        let attempt = &decided.attempt;
        let reported = &attempt.reported;
        let decision = &decided.decision;
        let lineage = reported.lineage;
        let in_chain = !lineage.as_str().is_empty();
        let (backoff_ms, deny_reason) = match decision.verdict {
            Verdict::Retry { backoff, .. } => (Some(backoff.as_secs_f64() * 1000.0), None),
            Verdict::Deny(reason) => (None, Some(reason.as_str())),
            Verdict::Ambiguous => (None, None),
        };
        let candidate = decided
            .candidate
            .as_ref()
            .map(|(decision, tokens)| CandidateSpan {
                verdict: decision.verdict.as_str(),
                rule: decision.rule.number(),
                tokens_remaining: *tokens,
                deny_reason: match decision.verdict {
                    Verdict::Deny(reason) => Some(reason.as_str()),
                    _ => None,
                },
            });
        DecisionSpan::new(
            DecisionTexts {
                decision_id: &decided.decision_id,
                upstream: attempt.upstream,
                operation: attempt.operation,
                caller: &decided.principal.name,
                grpc_pushback: reported.grpc_pushback,
                lineage: in_chain.then(|| lineage.as_str()),
                retried_below: reported.retried_below,
            },
            DecisionFields {
                attempt: reported.attempt,
                idempotency: reported.idempotency.as_str(),
                evidence_effective: decision.effective_evidence.as_str(),
                verdict: decision.verdict.as_str(),
                rule: decision.rule.number(),
                tokens_remaining: decided.tokens_remaining,
                store: self.store_label,
                evidence_claimed: reported.claimed_evidence.map(|claimed| claimed.as_str()),
                failure: reported.failure.map(|failure| failure.as_str()),
                http_status: reported.http_status,
                grpc_status: reported.grpc_status.map(|code| code.number()),
                unknown_outcome: decision.unknown_outcome.map(UnknownOutcome::as_str),
                chain_depth: in_chain.then(|| lineage.depth()),
                backoff_ms,
                deny_reason,
                shadow: decided.shadow,
                candidate,
                hedge: decision.hedge.map(|note| HedgeSpan {
                    hedge: note.hedge,
                    delay_ms: note.delay.as_secs_f64() * 1000.0,
                    p50_ms: note.p50.as_secs_f64() * 1000.0,
                    hedges: note.hedges,
                    first_attempts: note.first_attempts,
                }),
                method,
            },
        )
    }
}

impl Observe for Recorder {
    fn store_call(&self, op: StoreOp, elapsed: Duration, failed: bool) {
        self.metrics.record_store(op, elapsed, failed);
    }

    fn deposited(&self, upstream: &str, requests: u64, funded: u64) {
        self.metrics.record_deposit(upstream, requests, funded);
        // The log keeps what was deposited, so that a replay deposits it.
        if let Some(log) = &self.decision_log {
            log.report(upstream, funded);
        }
    }

    fn hedges_won(&self, upstream: &str, won: u64) {
        self.metrics.record_hedges_won(upstream, won);
    }
}
