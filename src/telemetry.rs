//! Telemetry: structured logs through `tracing`, an audit span per decision
//! in the OpenTelemetry model (the SDK's propagator, sampler, id generator
//! and resource), exported over OTLP (gRPC or HTTP), and Prometheus metrics
//! in the OpenMetrics format.
//!
//! Nothing here may slow a decision down or fail it: a decision's span is a
//! fixed-size record (`span.rs`) that goes into a bounded queue that drops
//! (and counts, and warns) rather than waits, the exporter encodes and
//! sends on its own task (`otlp.rs`), and counters are plain atomics. Names of spans,
//! attributes and metrics are constants in this file so that dashboards and
//! tests have one place to look.

pub mod metrics;
mod otlp;
mod pace;
mod span;
mod trace;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, TelemetryConfig};

pub use metrics::{
    BUDGET_GAUGES_INTERVAL, BudgetGauges, Metrics, Refusal, StoreOp, UpstreamLimit, serve_metrics,
};
pub(crate) use otlp::SpanBatch;
pub use pace::{Backlog, Paced, Room};
pub use span::{CandidateSpan, DecisionFields, DecisionSpan, DecisionTexts, HedgeSpan, SpanStart};
pub use trace::{Attribute, TraceContext, Tracer, TracerGuard, hex};

/// The span of one decision.
pub const SPAN_DECIDE: &str = "retry.decide";
/// The span of one traffic report.
pub const SPAN_REPORT_TRAFFIC: &str = "retry.report_traffic";
/// The span of an admin call: `retry.admin.<method>`.
pub const SPAN_GET_BUDGET: &str = "retry.admin.get_budget";
/// See [`SPAN_GET_BUDGET`].
pub const SPAN_LIST_BUDGETS: &str = "retry.admin.list_budgets";
/// See [`SPAN_GET_BUDGET`].
pub const SPAN_SET_RETRIES_ENABLED: &str = "retry.admin.set_retries_enabled";
/// See [`SPAN_GET_BUDGET`].
pub const SPAN_RELOAD_CONFIG: &str = "retry.admin.reload_config";

/// `rpc.service` of Decide, DecideStream and ReportTraffic spans.
pub const RPC_SERVICE_DECIDER: &str = "retryd.v1.RetryDecider";
/// `rpc.service` of admin spans.
pub const RPC_SERVICE_ADMIN: &str = "retryd.v1.RetryAdmin";

/// Span attribute names.
pub mod attr {
    /// `grpc`: retryd's own RPC, by the OpenTelemetry RPC conventions.
    pub const RPC_SYSTEM: &str = "rpc.system";
    /// The service retryd answered as (`retryd.v1.RetryDecider`, ...).
    pub const RPC_SERVICE: &str = "rpc.service";
    /// The method retryd answered (`Decide`, `DecideStream`, ...).
    pub const RPC_METHOD: &str = "rpc.method";
    /// The upstream.
    pub const UPSTREAM: &str = "retry.upstream";
    /// The operation.
    pub const OPERATION: &str = "retry.operation";
    /// Attempts so far.
    pub const ATTEMPT: &str = "retry.attempt";
    /// Declared idempotency.
    pub const IDEMPOTENCY: &str = "retry.idempotency";
    /// The caller's claimed evidence (absent when derived).
    pub const EVIDENCE_CLAIMED: &str = "retry.evidence.claimed";
    /// The evidence used.
    pub const EVIDENCE_EFFECTIVE: &str = "retry.evidence.effective";
    /// The stage failure.
    pub const FAILURE: &str = "retry.failure";
    /// The HTTP status of the failed attempt.
    pub const HTTP_STATUS: &str = "http.response.status_code";
    /// retry, deny or ambiguous.
    pub const VERDICT: &str = "retry.verdict";
    /// The deny reason.
    pub const DENY_REASON: &str = "retry.deny_reason";
    /// The rule that decided.
    pub const RULE: &str = "retry.rule";
    /// The backoff in milliseconds.
    pub const BACKOFF_MS: &str = "retry.backoff_ms";
    /// Tokens left after the decision.
    pub const TOKENS_REMAINING: &str = "retry.tokens_remaining";
    /// The decision id returned to the caller.
    pub const DECISION_ID: &str = "retry.decision_id";
    /// The budget store: memory, redis-exact or redis-leased.
    pub const STORE: &str = "retry.store";
    /// The gRPC status code of a failed call: retryd's own on a refused
    /// call's span, the reported attempt's on a decision span (which
    /// describes that attempt, as `http.response.status_code` does).
    pub const GRPC_STATUS: &str = "rpc.grpc.status_code";
    /// False on a shadow decision (the upstream's `enforce = false`).
    pub const ENFORCED: &str = "retry.enforced";
    /// The candidate policy's verdict.
    pub const CANDIDATE_VERDICT: &str = "retry.candidate.verdict";
    /// The candidate policy's deny reason.
    pub const CANDIDATE_DENY_REASON: &str = "retry.candidate.deny_reason";
    /// The rule that decided for the candidate.
    pub const CANDIDATE_RULE: &str = "retry.candidate.rule";
    /// Tokens left in the candidate's budget.
    pub const CANDIDATE_TOKENS_REMAINING: &str = "retry.candidate.tokens_remaining";
    /// Which hedge of a call was asked for (absent on a retry's decision).
    pub const HEDGE: &str = "retry.hedge";
    /// The hedge delay the decision was made on, in milliseconds.
    pub const HEDGE_DELAY_MS: &str = "retry.hedge_delay_ms";
    /// The fleet's median latency the hedge decision saw, in milliseconds.
    pub const HEDGE_P50_MS: &str = "retry.hedge_p50_ms";
    /// Hedges granted over the window before this decision.
    pub const HEDGES_IN_WINDOW: &str = "retry.hedges_in_window";
    /// First attempts reported over the window.
    pub const HEDGE_FIRST_ATTEMPTS: &str = "retry.hedge_first_attempts";
    /// Set when the attempt may have taken effect upstream, whatever the
    /// verdict: `reconcile` or `resend_with_key` (absent otherwise).
    pub const UNKNOWN_OUTCOME: &str = "retry.unknown_outcome";
    /// The deciding layer's depth in its call chain: 1 at the edge, one
    /// more per enclosing call (docs/lineage.md).
    pub const CHAIN_DEPTH: &str = "retry.chain.depth";
    /// The call chain's lineage, `edge:2/middle:1` (absent at the edge).
    pub const CHAIN_LINEAGE: &str = "retry.chain.lineage";
    /// The layer below that had already retried the failure (absent if
    /// none said so).
    pub const CHAIN_RETRIED_BELOW: &str = "retry.chain.retried_below";
    /// The raw `grpc-retry-pushback-ms` the attempt reported.
    pub const GRPC_PUSHBACK: &str = "retry.grpc.pushback_ms";
    /// Entries in a traffic report.
    pub const TRAFFIC_ENTRIES: &str = "retry.traffic.entries";
    /// Requests in a traffic report.
    pub const TRAFFIC_REQUESTS: &str = "retry.traffic.requests";
    /// The kill switch's new state.
    pub const RETRIES_ENABLED: &str = "retry.retries_enabled";
    /// The kill switch's previous state.
    pub const RETRIES_ENABLED_PREVIOUS: &str = "retry.retries_enabled.previous";
    /// Why an operator acted.
    pub const REASON: &str = "retry.admin.reason";
    /// From where an operator acted (the peer address).
    pub const PEER: &str = "retry.admin.peer";
    /// Who acted (the authenticated principal, `anonymous` without auth).
    pub const PRINCIPAL: &str = "retry.admin.principal";
    /// Who asked for a decision or reported traffic (the authenticated
    /// principal, `anonymous` without auth).
    pub const CALLER: &str = "retry.principal";
}

/// Lets log lines through at a bounded rate: `burst` at once, then one per
/// interval (the generic cell rate algorithm), saying how many were held
/// back since the last. For what a flood of refused calls or shed
/// connections logs, so that the log cannot be flooded in turn, while an
/// isolated event is always logged. Lock-free, for handlers on every worker
/// thread.
#[derive(Debug)]
pub struct Throttle {
    origin: Instant,
    interval: u64,
    /// How far ahead of now the schedule may run: `burst` intervals.
    tolerance: u64,
    /// The theoretical time of the next line, in nanoseconds since `origin`.
    next: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    /// A throttle letting `burst` lines through at once, then one per
    /// `interval`.
    pub fn new(interval: Duration, burst: u32) -> Throttle {
        let interval = interval.as_nanos() as u64;
        Throttle {
            origin: Instant::now(),
            interval,
            tolerance: interval.saturating_mul(u64::from(burst.saturating_sub(1))),
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Calls `log` with the number of lines held back since the last one,
    /// if the rate allows; otherwise counts this one as held back.
    pub fn log(&self, log: impl FnOnce(u64)) {
        let now = self.origin.elapsed().as_nanos() as u64;
        let mut next = self.next.load(Ordering::Relaxed);
        loop {
            if next > now.saturating_add(self.tolerance) {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let scheduled = next.max(now).saturating_add(self.interval);
            match self.next.compare_exchange_weak(
                next,
                scheduled,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(current) => next = current,
            }
        }
        log(self.suppressed.swap(0, Ordering::Relaxed));
    }

    /// Calls `log` with the number of lines held back since the last one,
    /// if any were: run on a timer, so that the count of a burst is written
    /// when the burst ends, not only with the next line, which may never
    /// come.
    pub fn flush(&self, log: impl FnOnce(u64)) {
        let held_back = self.suppressed.swap(0, Ordering::Relaxed);
        if held_back > 0 {
            log(held_back);
        }
    }
}

/// Starts logging to stderr in the configured format and level.
pub fn init_logs(config: &TelemetryConfig) -> Result<(), String> {
    let filter = EnvFilter::try_new(&config.log_level)
        .map_err(|err| format!("telemetry.log_level: {err}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let result = match config.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|err| format!("cannot start logging: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_a_burst_through_then_counts_the_rest() {
        let throttle = Throttle::new(Duration::from_secs(3600), 3);
        let mut logged = Vec::new();
        for _ in 0..10 {
            throttle.log(|suppressed| logged.push(suppressed));
        }
        assert_eq!(logged, [0, 0, 0]);
        assert_eq!(throttle.suppressed.load(Ordering::Relaxed), 7);
        // With no interval to wait, everything goes through.
        let throttle = Throttle::new(Duration::ZERO, 1);
        for _ in 0..3 {
            throttle.log(|suppressed| logged.push(suppressed));
        }
        assert_eq!(logged, [0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_flush_writes_what_was_held_back_once() {
        let throttle = Throttle::new(Duration::from_secs(3600), 1);
        for _ in 0..5 {
            throttle.log(|_| {});
        }
        let mut flushed = Vec::new();
        throttle.flush(|held_back| flushed.push(held_back));
        throttle.flush(|held_back| flushed.push(held_back));
        assert_eq!(flushed, [4], "four held back, written once");
    }
}
