//! Telemetry: structured logs through `tracing`, and decision metrics in
//! Prometheus text format on a small HTTP endpoint.
//!
//! Metric names are constants here. Counters are plain atomics indexed by
//! (upstream label, outcome), so recording a decision takes no lock and no
//! allocation. Upstream labels are bounded: the upstreams the configuration
//! names keep their own label, every other upstream counts as `_other`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

use crate::budget::BudgetSnapshot;
use crate::config::{LogFormat, TelemetryConfig};
use crate::engine::{Decision, DenyReason, Verdict};

/// Counter of decisions, by upstream, verdict and reason.
pub const METRIC_DECISIONS: &str = "retryd_decisions_total";
/// Histogram of the time to decide, store round trips included.
pub const METRIC_DECISION_SECONDS: &str = "retryd_decision_duration_seconds";
/// Counter of real requests reported through ReportTraffic.
pub const METRIC_REPORTED_REQUESTS: &str = "retryd_reported_requests_total";
/// Gauge of tokens per tracked upstream.
pub const METRIC_BUDGET_TOKENS: &str = "retryd_budget_tokens";
/// Gauge: 0 while retries are switched off for the upstream.
pub const METRIC_RETRIES_ENABLED: &str = "retryd_retries_enabled";
/// Gauge of upstreams with state in the store.
pub const METRIC_TRACKED_UPSTREAMS: &str = "retryd_tracked_upstreams";

/// The label of upstreams the configuration does not name.
pub const OTHER_UPSTREAM: &str = "_other";
/// Most upstreams listed with their own token gauge in one scrape.
const MAX_BUDGET_SERIES: usize = 1000;

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

// Outcomes: retry, ambiguous, then one per deny reason.
const DENY_REASONS: [DenyReason; 10] = [
    DenyReason::MaxAttempts,
    DenyReason::BudgetExhausted,
    DenyReason::BudgetUnavailable,
    DenyReason::BodyNotReplayable,
    DenyReason::ResponseAlreadyDelivered,
    DenyReason::RuntimeDraining,
    DenyReason::RetriesDisabled,
    DenyReason::Deadline,
    DenyReason::PermanentFailure,
    DenyReason::StatusNotRetryable,
];
const OUTCOMES: usize = 2 + DENY_REASONS.len();

fn outcome_index(verdict: &Verdict) -> usize {
    match verdict {
        Verdict::Retry { .. } => 0,
        Verdict::Ambiguous => 1,
        Verdict::Deny(reason) => {
            2 + DENY_REASONS
                .iter()
                .position(|known| known == reason)
                .expect("DENY_REASONS lists every reason")
        }
    }
}

fn outcome_labels(index: usize) -> (&'static str, &'static str) {
    match index {
        0 => ("retry", ""),
        1 => ("ambiguous", ""),
        n => ("deny", DENY_REASONS[n - 2].as_str()),
    }
}

/// Upper bounds of the latency histogram, in seconds.
const LATENCY_BOUNDS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1,
];

/// Process-wide counters, recorded by the gRPC edge and rendered on scrape.
#[derive(Debug)]
pub struct Metrics {
    labels: Vec<String>,
    index: HashMap<String, usize>,
    decisions: Vec<[AtomicU64; OUTCOMES]>,
    latency_buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    latency_count: AtomicU64,
    latency_sum_nanos: AtomicU64,
    reported_requests: AtomicU64,
}

impl Metrics {
    /// Metrics with a label of their own for each of `named_upstreams`.
    pub fn new<'a>(named_upstreams: impl IntoIterator<Item = &'a str>) -> Metrics {
        let mut labels: Vec<String> = named_upstreams.into_iter().map(str::to_owned).collect();
        labels.sort();
        labels.dedup();
        labels.push(OTHER_UPSTREAM.to_owned());
        let index = labels
            .iter()
            .enumerate()
            .take(labels.len() - 1)
            .map(|(i, label)| (label.clone(), i))
            .collect();
        let decisions = labels.iter().map(|_| Default::default()).collect();
        Metrics {
            labels,
            index,
            decisions,
            latency_buckets: Default::default(),
            latency_count: AtomicU64::new(0),
            latency_sum_nanos: AtomicU64::new(0),
            reported_requests: AtomicU64::new(0),
        }
    }

    /// Counts one decision and how long it took.
    pub fn record_decision(&self, upstream: &str, decision: &Decision, elapsed: Duration) {
        let row = self
            .index
            .get(upstream)
            .copied()
            .unwrap_or(self.labels.len() - 1);
        self.decisions[row][outcome_index(&decision.verdict)].fetch_add(1, Ordering::Relaxed);
        let seconds = elapsed.as_secs_f64();
        if let Some(bucket) = LATENCY_BOUNDS.iter().position(|bound| seconds <= *bound) {
            self.latency_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Counts reported real requests.
    pub fn record_deposit(&self, requests: u64) {
        self.reported_requests
            .fetch_add(requests, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of every metric, with the budgets
    /// the store reported at scrape time.
    pub fn render(&self, budgets: &[BudgetSnapshot]) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP {METRIC_DECISIONS} Retry decisions by upstream, verdict and deny reason."
        );
        let _ = writeln!(out, "# TYPE {METRIC_DECISIONS} counter");
        for (row, label) in self.labels.iter().enumerate() {
            for (outcome, counter) in self.decisions[row].iter().enumerate() {
                let value = counter.load(Ordering::Relaxed);
                if value == 0 {
                    continue;
                }
                let (verdict, reason) = outcome_labels(outcome);
                let _ = writeln!(
                    out,
                    "{METRIC_DECISIONS}{{upstream=\"{}\",verdict=\"{verdict}\",reason=\"{reason}\"}} {value}",
                    escape(label)
                );
            }
        }

        let _ = writeln!(
            out,
            "# HELP {METRIC_DECISION_SECONDS} Time to decide, store round trips included."
        );
        let _ = writeln!(out, "# TYPE {METRIC_DECISION_SECONDS} histogram");
        let mut cumulative = 0;
        for (bound, counter) in LATENCY_BOUNDS.iter().zip(&self.latency_buckets) {
            cumulative += counter.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{METRIC_DECISION_SECONDS}_bucket{{le=\"{bound}\"}} {cumulative}"
            );
        }
        let count = self.latency_count.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{METRIC_DECISION_SECONDS}_bucket{{le=\"+Inf\"}} {count}"
        );
        let sum = self.latency_sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{METRIC_DECISION_SECONDS}_sum {sum}");
        let _ = writeln!(out, "{METRIC_DECISION_SECONDS}_count {count}");

        let _ = writeln!(
            out,
            "# HELP {METRIC_REPORTED_REQUESTS} Real requests reported through ReportTraffic."
        );
        let _ = writeln!(out, "# TYPE {METRIC_REPORTED_REQUESTS} counter");
        let reported = self.reported_requests.load(Ordering::Relaxed);
        let _ = writeln!(out, "{METRIC_REPORTED_REQUESTS} {reported}");

        let _ = writeln!(
            out,
            "# HELP {METRIC_TRACKED_UPSTREAMS} Upstreams with budget state."
        );
        let _ = writeln!(out, "# TYPE {METRIC_TRACKED_UPSTREAMS} gauge");
        let _ = writeln!(out, "{METRIC_TRACKED_UPSTREAMS} {}", budgets.len());
        let _ = writeln!(
            out,
            "# HELP {METRIC_BUDGET_TOKENS} Tokens in the upstream's retry budget."
        );
        let _ = writeln!(out, "# TYPE {METRIC_BUDGET_TOKENS} gauge");
        for budget in budgets.iter().take(MAX_BUDGET_SERIES) {
            let _ = writeln!(
                out,
                "{METRIC_BUDGET_TOKENS}{{upstream=\"{}\"}} {}",
                escape(&budget.upstream),
                budget.tokens
            );
        }
        let _ = writeln!(
            out,
            "# HELP {METRIC_RETRIES_ENABLED} 0 while an operator has switched retries off."
        );
        let _ = writeln!(out, "# TYPE {METRIC_RETRIES_ENABLED} gauge");
        for budget in budgets.iter().take(MAX_BUDGET_SERIES) {
            let _ = writeln!(
                out,
                "{METRIC_RETRIES_ENABLED}{{upstream=\"{}\"}} {}",
                escape(&budget.upstream),
                u8::from(budget.retries_enabled)
            );
        }
        out
    }
}

/// Label values escape backslash, quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes. `scrape`
/// renders the page. This is deliberately a minimal HTTP/1.1 responder (one
/// request per connection): Prometheus needs nothing more, and it keeps an
/// HTTP framework off the dependency list.
pub async fn serve_metrics<F, Fut>(
    listener: TcpListener,
    scrape: F,
    shutdown: impl Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = String> + Send,
{
    tokio::pin!(shutdown);
    loop {
        let (mut stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    tracing::warn!(error = %err, "metrics listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let scrape = scrape.clone();
        tokio::spawn(async move {
            let mut request = Vec::with_capacity(1024);
            let mut buffer = [0u8; 1024];
            // Read the request head, bounded in size and time.
            let head = tokio::time::timeout(Duration::from_secs(5), async {
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                true
            })
            .await;
            if head != Ok(true) {
                return;
            }
            let line = request.split(|b| *b == b'\r').next().unwrap_or_default();
            let (status, body) =
                if line.starts_with(b"GET /metrics ") || line.starts_with(b"GET /metrics?") {
                    ("200 OK", scrape().await)
                } else {
                    ("404 Not Found", "not found: try /metrics\n".to_owned())
                };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}
