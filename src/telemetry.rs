//! Telemetry: structured logs through `tracing`, an audit span per decision
//! exported over OTLP/gRPC, and Prometheus metrics.
//!
//! Nothing here may slow a decision down or fail it: spans go into a
//! bounded queue that drops (and counts) rather than waits, the exporter runs
//! on its own task, and counters are plain atomics. Names of spans,
//! attributes and metrics are constants in this file so that dashboards and
//! tests have one place to look.

pub mod metrics;
mod otlp;
pub mod trace;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, TelemetryConfig};

pub use metrics::{Metrics, serve_metrics};
pub use trace::{Attribute, SpanStart, TraceContext, Tracer, TracerGuard};

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

/// Span attribute names.
pub mod attr {
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
    /// The gRPC status code of a failed call.
    pub const GRPC_STATUS: &str = "rpc.grpc.status_code";
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
