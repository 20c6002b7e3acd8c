//! Prometheus metrics: counters and histograms as atomics, indexed so that
//! recording takes no lock and no allocation, rendered as text on scrape.
//!
//! Upstream labels are bounded: the upstreams the configuration named at
//! start keep their own label, every other upstream (a caller's made-up
//! name, a look-alike, one named only by a later reload) counts as
//! `_other`. This holds for the budget gauges as for the counters, so no
//! series ever carries a name a caller chose.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::budget::{BudgetSnapshot, StoreStats};
use crate::engine::{Decision, DenyReason, VariantArray, Verdict};

/// Counter of decisions, by upstream, verdict and reason.
pub const METRIC_DECISIONS: &str = "retryd_decisions_total";
/// Histogram of the time to decide, store round trips included.
pub const METRIC_DECISION_SECONDS: &str = "retryd_decision_duration_seconds";
/// Counter of real requests reported through ReportTraffic.
pub const METRIC_REPORTED_REQUESTS: &str = "retryd_reported_requests_total";
/// Counter of tokens withdrawn (one per RETRY).
pub const METRIC_WITHDRAWALS: &str = "retryd_budget_withdrawals_total";
/// Gauge of tokens per configured tracked upstream; `_other` sums the rest.
pub const METRIC_BUDGET_TOKENS: &str = "retryd_budget_tokens";
/// Gauge: 0 while retries are switched off for the upstream (for `_other`:
/// for any of the upstreams it stands for).
pub const METRIC_RETRIES_ENABLED: &str = "retryd_retries_enabled";
/// Gauge of upstreams with state in the store.
pub const METRIC_TRACKED_UPSTREAMS: &str = "retryd_tracked_upstreams";
/// Histogram of budget store operations, by operation.
pub const METRIC_STORE_SECONDS: &str = "retryd_store_operation_duration_seconds";
/// Counter of failed budget store operations, by operation.
pub const METRIC_STORE_ERRORS: &str = "retryd_store_errors_total";
/// Counter of spans handed to the OTLP exporter and accepted.
pub const METRIC_SPANS_EXPORTED: &str = "retryd_spans_exported_total";
/// Counter of spans dropped because the export queue was full.
pub const METRIC_SPANS_DROPPED: &str = "retryd_spans_dropped_total";
/// Counter of spans lost in failed exports.
pub const METRIC_SPANS_FAILED: &str = "retryd_spans_export_failed_total";

/// Gauge: 1 while the budget store's backend is reachable.
pub const METRIC_STORE_AVAILABLE: &str = "retryd_store_available";
/// Counter of failed backend calls.
pub const METRIC_STORE_BACKEND_ERRORS: &str = "retryd_store_backend_errors_total";
/// Counter of timed-out backend calls.
pub const METRIC_STORE_BACKEND_TIMEOUTS: &str = "retryd_store_backend_timeouts_total";
/// Counter of outages (transitions to unreachable).
pub const METRIC_STORE_OUTAGES: &str = "retryd_store_outages_total";
/// Counter of calls answered from the local fallback bucket.
pub const METRIC_STORE_FALLBACKS: &str = "retryd_store_fallbacks_total";
/// Counter of calls answered unavailable.
pub const METRIC_STORE_UNAVAILABLE: &str = "retryd_store_unavailable_answers_total";
/// Counter of leased tokens forfeited.
pub const METRIC_STORE_FORFEITED: &str = "retryd_store_forfeited_tokens_total";
/// Counter of deposits lost.
pub const METRIC_STORE_LOST_DEPOSITS: &str = "retryd_store_lost_deposits_total";
/// Counter of configuration reloads, by outcome.
pub const METRIC_RELOADS: &str = "retryd_config_reloads_total";

/// The label of upstreams the configuration does not name.
pub const OTHER_UPSTREAM: &str = "_other";

// Outcomes: retry, ambiguous, then one per deny reason, in the order of
// `DenyReason::VARIANTS` (derived, so a new reason gets its column and its
// label without a list to keep here).
const OUTCOMES: usize = 2 + DenyReason::VARIANTS.len();

const RETRY_OUTCOME: usize = 0;
const AMBIGUOUS_OUTCOME: usize = 1;

/// The counter column of a verdict: an exhaustive match and a dense cast,
/// so that nothing on the decision path looks a label up or can fail to.
fn outcome_index(verdict: &Verdict) -> usize {
    match verdict {
        Verdict::Retry { .. } => RETRY_OUTCOME,
        Verdict::Ambiguous => AMBIGUOUS_OUTCOME,
        Verdict::Deny(reason) => 2 + *reason as usize,
    }
}

/// The `verdict` and `reason` labels of a counter column.
fn outcome_labels(index: usize) -> (&'static str, &'static str) {
    match index {
        RETRY_OUTCOME => ("retry", ""),
        AMBIGUOUS_OUTCOME => ("ambiguous", ""),
        n => ("deny", DenyReason::VARIANTS[n - 2].as_str()),
    }
}

/// Upper bounds of the latency histograms, in seconds.
const LATENCY_BOUNDS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn record(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        if let Some(bucket) = LATENCY_BOUNDS.iter().position(|bound| seconds <= *bound) {
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        Histogram::render_sum(std::iter::once(self), out, name, labels);
    }

    /// Renders the sum of `histograms` as one.
    fn render_sum<'h>(
        histograms: impl Iterator<Item = &'h Histogram> + Clone,
        out: &mut String,
        name: &str,
        labels: &str,
    ) {
        let load = |counter: fn(&Histogram) -> &AtomicU64| -> u64 {
            histograms
                .clone()
                .map(|histogram| counter(histogram).load(Ordering::Relaxed))
                .sum()
        };
        let separator = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bucket, bound) in LATENCY_BOUNDS.iter().enumerate() {
            cumulative += histograms
                .clone()
                .map(|histogram| histogram.buckets[bucket].load(Ordering::Relaxed))
                .sum::<u64>();
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{separator}le=\"{bound}\"}} {cumulative}"
            );
        }
        let count = load(|histogram| &histogram.count);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{separator}le=\"+Inf\"}} {count}"
        );
        let sum = load(|histogram| &histogram.sum_nanos) as f64 / 1e9;
        let braces = |labels: &str| {
            if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

/// Decision counters and latency as one thread records them. Every
/// decision bumps a counter and a histogram; with all threads on the same
/// atomics those cache lines bounced between cores (4% of a DecideStream
/// profile), so each thread records into its own shard, picked round-robin
/// on its first decision, and a scrape sums the shards.
#[derive(Debug)]
#[repr(align(128))]
struct DecisionShard {
    /// By upstream label, then outcome.
    decisions: Vec<[AtomicU64; OUTCOMES]>,
    latency: Histogram,
}

/// The shard the calling thread records into, among `shards`.
fn shard_of_this_thread(shards: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    MINE.with(|mine| *mine) % shards
}

/// A budget store operation, for the store metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::VariantArray)]
pub enum StoreOp {
    /// A decision's store call that only reads the budget.
    View,
    /// A decision's store call that reads and may withdraw a token.
    Withdraw,
    /// Admitting a traffic report's upstreams, all at once, before any
    /// deposit (see `BudgetStore::admit`).
    Admit,
    /// Depositing reported traffic.
    Deposit,
    /// Switching retries on or off, or listing.
    Admin,
}

impl StoreOp {
    /// The `op` label: an exhaustive match, so a new operation cannot
    /// compile without one.
    fn label(self) -> &'static str {
        match self {
            StoreOp::View => "view",
            StoreOp::Withdraw => "withdraw",
            StoreOp::Admit => "admit",
            StoreOp::Deposit => "deposit",
            StoreOp::Admin => "admin",
        }
    }
}

/// Process-wide counters, recorded by the gRPC edge and the exporter and
/// rendered on scrape.
#[derive(Debug)]
pub struct Metrics {
    labels: Vec<String>,
    index: HashMap<String, usize>,
    shards: Box<[DecisionShard]>,
    reported_requests: AtomicU64,
    /// Indexed by `StoreOp as usize`, in the order of `StoreOp::VARIANTS`.
    store_latency: [Histogram; StoreOp::VARIANTS.len()],
    store_errors: [AtomicU64; StoreOp::VARIANTS.len()],
    /// Spans accepted by the collector.
    pub spans_exported: AtomicU64,
    /// Spans dropped because the export queue was full.
    pub spans_dropped: AtomicU64,
    /// Spans lost in failed exports.
    pub spans_failed: AtomicU64,
    reloads: [AtomicU64; 2],
}

impl Metrics {
    /// Metrics with a label of their own for each of `named_upstreams`.
    pub fn new<'a>(named_upstreams: impl IntoIterator<Item = &'a str>) -> Metrics {
        // An upstream configured as `_other` is counted with the others:
        // two series with one label would make the exposition invalid.
        let mut labels: Vec<String> = named_upstreams
            .into_iter()
            .filter(|name| *name != OTHER_UPSTREAM)
            .map(str::to_owned)
            .collect();
        labels.sort();
        labels.dedup();
        labels.push(OTHER_UPSTREAM.to_owned());
        let index = labels
            .iter()
            .enumerate()
            .take(labels.len() - 1)
            .map(|(i, label)| (label.clone(), i))
            .collect();
        // One shard per core is enough: the runtime has a worker per core.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let shards = (0..cores.min(64))
            .map(|_| DecisionShard {
                decisions: labels.iter().map(|_| Default::default()).collect(),
                latency: Histogram::default(),
            })
            .collect();
        Metrics {
            labels,
            index,
            shards,
            reported_requests: AtomicU64::new(0),
            store_latency: Default::default(),
            store_errors: Default::default(),
            spans_exported: AtomicU64::new(0),
            spans_dropped: AtomicU64::new(0),
            spans_failed: AtomicU64::new(0),
            reloads: Default::default(),
        }
    }

    /// Counts a configuration reload, applied or refused.
    pub fn record_reload(&self, applied: bool) {
        self.reloads[usize::from(!applied)].fetch_add(1, Ordering::Relaxed);
    }

    /// The row of an upstream's label: its own if the configuration names
    /// it, else `_other`'s (the last).
    fn row(&self, upstream: &str) -> usize {
        self.index
            .get(upstream)
            .copied()
            .unwrap_or(self.labels.len() - 1)
    }

    /// Counts one decision and how long it took.
    pub fn record_decision(&self, upstream: &str, decision: &Decision, elapsed: Duration) {
        let row = self.row(upstream);
        let shard = &self.shards[shard_of_this_thread(self.shards.len())];
        shard.decisions[row][outcome_index(&decision.verdict)].fetch_add(1, Ordering::Relaxed);
        shard.latency.record(elapsed);
    }

    /// Decisions of one upstream label and outcome, over every shard.
    fn decisions(&self, row: usize, outcome: usize) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.decisions[row][outcome].load(Ordering::Relaxed))
            .sum()
    }

    /// Counts reported real requests.
    pub fn record_deposit(&self, requests: u64) {
        self.reported_requests
            .fetch_add(requests, Ordering::Relaxed);
    }

    /// Records one store operation's latency and outcome.
    pub fn record_store(&self, op: StoreOp, elapsed: Duration, failed: bool) {
        let index = op as usize;
        self.store_latency[index].record(elapsed);
        if failed {
            self.store_errors[index].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The Prometheus text exposition of every metric, with the budgets
    /// the store reported at scrape time.
    pub fn render(
        &self,
        budgets: &[BudgetSnapshot],
        store_available: bool,
        store: &StoreStats,
    ) -> String {
        let mut out = String::with_capacity(8192);
        let help = |out: &mut String, name: &str, kind: &str, text: &str| {
            let _ = writeln!(out, "# HELP {name} {text}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
        };
        help(
            &mut out,
            METRIC_DECISIONS,
            "counter",
            "Retry decisions by upstream, verdict and deny reason.",
        );
        for (row, label) in self.labels.iter().enumerate() {
            for outcome in 0..OUTCOMES {
                let value = self.decisions(row, outcome);
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
        help(
            &mut out,
            METRIC_DECISION_SECONDS,
            "histogram",
            "Time to decide, store round trips included.",
        );
        Histogram::render_sum(
            self.shards.iter().map(|shard| &shard.latency),
            &mut out,
            METRIC_DECISION_SECONDS,
            "",
        );

        let counters = [
            (
                METRIC_REPORTED_REQUESTS,
                "Real requests reported through ReportTraffic.",
                &self.reported_requests,
            ),
            (
                METRIC_SPANS_EXPORTED,
                "Decision spans accepted by the OTLP collector.",
                &self.spans_exported,
            ),
            (
                METRIC_SPANS_DROPPED,
                "Spans dropped because the export queue was full.",
                &self.spans_dropped,
            ),
            (
                METRIC_SPANS_FAILED,
                "Spans lost in failed OTLP exports.",
                &self.spans_failed,
            ),
        ];
        for (name, text, counter) in counters {
            help(&mut out, name, "counter", text);
            let _ = writeln!(out, "{name} {}", counter.load(Ordering::Relaxed));
        }
        // One token per RETRY: the RETRY decisions, not a counter of its own.
        help(
            &mut out,
            METRIC_WITHDRAWALS,
            "counter",
            "Tokens withdrawn, one per RETRY.",
        );
        let retries: u64 = (0..self.labels.len())
            .map(|row| self.decisions(row, RETRY_OUTCOME))
            .sum();
        let _ = writeln!(out, "{METRIC_WITHDRAWALS} {retries}");

        help(
            &mut out,
            METRIC_STORE_SECONDS,
            "histogram",
            "Budget store operation latency.",
        );
        for (op, histogram) in StoreOp::VARIANTS.iter().zip(&self.store_latency) {
            let op = op.label();
            histogram.render(&mut out, METRIC_STORE_SECONDS, &format!("op=\"{op}\""));
        }
        help(
            &mut out,
            METRIC_STORE_ERRORS,
            "counter",
            "Failed budget store operations.",
        );
        for (op, counter) in StoreOp::VARIANTS.iter().zip(&self.store_errors) {
            let op = op.label();
            let _ = writeln!(
                out,
                "{METRIC_STORE_ERRORS}{{op=\"{op}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }

        help(
            &mut out,
            METRIC_STORE_AVAILABLE,
            "gauge",
            "1 while the budget store's backend is reachable.",
        );
        let _ = writeln!(
            out,
            "{METRIC_STORE_AVAILABLE} {}",
            u8::from(store_available)
        );
        let store_counters: [(&str, &str, f64); 7] = [
            (
                METRIC_STORE_BACKEND_ERRORS,
                "Backend calls that failed or timed out.",
                store.backend_errors as f64,
            ),
            (
                METRIC_STORE_BACKEND_TIMEOUTS,
                "Backend calls that timed out.",
                store.backend_timeouts as f64,
            ),
            (
                METRIC_STORE_OUTAGES,
                "Times the backend was found unreachable.",
                store.outages as f64,
            ),
            (
                METRIC_STORE_FALLBACKS,
                "Calls answered from the local fallback bucket.",
                store.fallbacks as f64,
            ),
            (
                METRIC_STORE_UNAVAILABLE,
                "Calls answered unavailable (on_unavailable = deny).",
                store.unavailable_answers as f64,
            ),
            (
                METRIC_STORE_FORFEITED,
                "Leased tokens neither spent nor returned.",
                store.forfeited_tokens,
            ),
            (
                METRIC_STORE_LOST_DEPOSITS,
                "Batched deposits that never reached the backend.",
                store.lost_deposits as f64,
            ),
        ];
        for (name, text, value) in store_counters {
            help(&mut out, name, "counter", text);
            let _ = writeln!(out, "{name} {value}");
        }

        help(
            &mut out,
            METRIC_RELOADS,
            "counter",
            "Configuration reloads, applied or refused.",
        );
        for (outcome, counter) in ["applied", "refused"].iter().zip(&self.reloads) {
            let _ = writeln!(
                out,
                "{METRIC_RELOADS}{{outcome=\"{outcome}\"}} {}",
                counter.load(Ordering::Relaxed)
            );
        }

        help(
            &mut out,
            METRIC_TRACKED_UPSTREAMS,
            "gauge",
            "Upstreams with budget state.",
        );
        let _ = writeln!(out, "{METRIC_TRACKED_UPSTREAMS} {}", budgets.len());
        // The gauges are labelled as the counters are: a tracked upstream
        // the configuration does not name is added into `_other`. A label
        // without tracked upstreams has no series.
        let mut gauges: Vec<Option<Gauges>> = vec![None; self.labels.len()];
        for budget in budgets {
            let gauge = gauges[self.row(&budget.upstream)].get_or_insert(Gauges {
                tokens: 0.0,
                retries_enabled: true,
            });
            gauge.tokens += budget.tokens;
            gauge.retries_enabled &= budget.retries_enabled;
        }
        let labelled = || {
            self.labels
                .iter()
                .zip(&gauges)
                .filter_map(|(label, gauge)| gauge.map(|gauge| (escape(label), gauge)))
        };
        help(
            &mut out,
            METRIC_BUDGET_TOKENS,
            "gauge",
            "Tokens in the upstream's retry budget (_other: the sum over unconfigured upstreams).",
        );
        for (label, gauge) in labelled() {
            let _ = writeln!(
                out,
                "{METRIC_BUDGET_TOKENS}{{upstream=\"{label}\"}} {}",
                gauge.tokens
            );
        }
        help(
            &mut out,
            METRIC_RETRIES_ENABLED,
            "gauge",
            "0 while an operator has switched retries off (_other: for any unconfigured upstream).",
        );
        for (label, gauge) in labelled() {
            let _ = writeln!(
                out,
                "{METRIC_RETRIES_ENABLED}{{upstream=\"{label}\"}} {}",
                u8::from(gauge.retries_enabled)
            );
        }
        out
    }
}

/// The budget gauges of one upstream label at scrape time.
#[derive(Clone, Copy, Debug)]
struct Gauges {
    tokens: f64,
    retries_enabled: bool,
}

/// Label values escape backslash, quote and newline, as the text exposition
/// format requires; every other character may appear as it is.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// How long a scraper has to send its request head, and a connection to
/// live: a peer that opens the port and never speaks, or reads slowly, is
/// closed.
const SCRAPE_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
const SCRAPE_CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Serves `GET /metrics` over HTTP/1.1 (hyper) on `listener` until
/// `shutdown` completes. `scrape` renders the page; every other path is a
/// 404. Keep-alive is allowed (Prometheus reuses its connection), within
/// the bounds above.
pub async fn serve_metrics<F, Fut>(
    listener: TcpListener,
    scrape: F,
    shutdown: impl Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = String> + Send,
{
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // EMFILE and the like repeat at once: do not spin.
                    tracing::warn!(error = %err, "metrics listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let scrape = scrape.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let scrape = scrape.clone();
                async move { Ok::<_, std::convert::Infallible>(respond(&request, scrape).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(SCRAPE_HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(SCRAPE_CONNECTION_LIFETIME, connection).await;
        });
    }
}

async fn respond<F, Fut>(
    request: &hyper::Request<Incoming>,
    scrape: F,
) -> hyper::Response<Full<Bytes>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = String>,
{
    let (status, body) =
        if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
            (hyper::StatusCode::OK, scrape().await)
        } else {
            (
                hyper::StatusCode::NOT_FOUND,
                "not found: try GET /metrics\n".to_owned(),
            )
        };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Body, BudgetView, Evidence, Facts, Idempotency, Policy};

    /// A decision with `verdict`'s kind: the engine's own answer to a call
    /// that was never sent (RETRY) or sent with no response and not
    /// idempotent (AMBIGUOUS), or a denial for `reason`.
    fn decision(idempotency: Idempotency, evidence: Evidence) -> Decision {
        let body = Body::None;
        let facts = Facts {
            idempotency,
            body: &body,
            attempt: 1,
            claimed_evidence: Some(evidence),
            failure: None,
            http_status: None,
            retry_after: None,
            deadline_remaining: None,
            first_byte_delivered: false,
            runtime_draining: false,
            auth_refresh_attempted: false,
            previous_backoff: None,
            max_attempts: None,
            budget: BudgetView::OPEN,
            now: std::time::SystemTime::UNIX_EPOCH,
            jitter: 0.5,
        };
        crate::engine::decide(&facts, &Policy::default())
    }

    fn retry() -> Decision {
        let decision = decision(Idempotency::Idempotent, Evidence::SentNoResponse);
        assert!(matches!(decision.verdict, Verdict::Retry { .. }));
        decision
    }

    fn ambiguous() -> Decision {
        let decision = decision(Idempotency::NonIdempotent, Evidence::SentNoResponse);
        assert_eq!(decision.verdict, Verdict::Ambiguous);
        decision
    }

    fn counter_lines(page: &str, name: &str) -> Vec<String> {
        page.lines()
            .filter(|line| line.starts_with(&format!("{name}{{")))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_verdict_and_reason_has_a_column_of_its_own_and_its_label() {
        let mut seen = std::collections::HashSet::new();
        for (position, &reason) in DenyReason::VARIANTS.iter().enumerate() {
            // The dense cast is the position in the derived list.
            assert_eq!(reason as usize, position, "{reason:?}");
            let index = outcome_index(&Verdict::Deny(reason));
            assert!(index < OUTCOMES);
            assert_eq!(outcome_labels(index), ("deny", reason.as_str()));
            assert!(seen.insert(index), "{reason:?} shares a column");
        }
        let retry = outcome_index(&retry().verdict);
        let ambiguous = outcome_index(&Verdict::Ambiguous);
        assert_eq!(outcome_labels(retry), ("retry", ""));
        assert_eq!(outcome_labels(ambiguous), ("ambiguous", ""));
        assert!(seen.insert(retry) && seen.insert(ambiguous));
        assert_eq!(seen.len(), OUTCOMES);
    }

    #[test]
    fn every_store_operation_has_its_own_series() {
        for (position, &op) in StoreOp::VARIANTS.iter().enumerate() {
            assert_eq!(op as usize, position, "{op:?}");
        }
        let metrics = Metrics::new(["payments"]);
        metrics.record_store(StoreOp::Deposit, Duration::from_micros(30), true);
        metrics.record_store(StoreOp::Withdraw, Duration::from_micros(30), false);
        let page = metrics.render(&[], true, &StoreStats::default());
        let errors = counter_lines(&page, METRIC_STORE_ERRORS);
        let labels: Vec<&str> = StoreOp::VARIANTS.iter().map(|op| op.label()).collect();
        assert_eq!(labels, ["view", "withdraw", "admit", "deposit", "admin"]);
        for label in labels {
            let value = if label == "deposit" { 1 } else { 0 };
            assert!(
                errors.contains(&format!("{METRIC_STORE_ERRORS}{{op=\"{label}\"}} {value}")),
                "{errors:?}"
            );
        }
        assert!(page.contains(&format!(
            "{METRIC_STORE_SECONDS}_count{{op=\"withdraw\"}} 1"
        )));
    }

    #[test]
    fn decisions_are_counted_by_upstream_verdict_and_reason() {
        let metrics = Metrics::new(["payments"]);
        let elapsed = Duration::from_micros(40);
        metrics.record_decision("payments", &retry(), elapsed);
        metrics.record_decision("payments", &retry(), elapsed);
        metrics.record_decision("payments", &ambiguous(), elapsed);
        let exhausted = retry().into_budget_denial(DenyReason::BudgetExhausted);
        metrics.record_decision("payments", &exhausted, elapsed);
        // An upstream nobody configured counts as `_other`.
        metrics.record_decision("made-up", &exhausted, elapsed);
        let page = metrics.render(&[], true, &StoreStats::default());
        let mut lines = counter_lines(&page, METRIC_DECISIONS);
        lines.sort();
        assert_eq!(
            lines,
            [
                "retryd_decisions_total{upstream=\"_other\",verdict=\"deny\",reason=\"budget_exhausted\"} 1",
                "retryd_decisions_total{upstream=\"payments\",verdict=\"ambiguous\",reason=\"\"} 1",
                "retryd_decisions_total{upstream=\"payments\",verdict=\"deny\",reason=\"budget_exhausted\"} 1",
                "retryd_decisions_total{upstream=\"payments\",verdict=\"retry\",reason=\"\"} 2",
            ]
        );
        assert!(
            page.contains(&format!("{METRIC_DECISION_SECONDS}_count 5")),
            "{page}"
        );
        // Five decisions of 40 µs: all within the 50 µs bucket, none below 25.
        assert!(
            page.contains(&format!(
                "{METRIC_DECISION_SECONDS}_bucket{{le=\"0.00005\"}} 5"
            )),
            "{page}"
        );
        assert!(
            page.contains(&format!(
                "{METRIC_DECISION_SECONDS}_bucket{{le=\"0.000025\"}} 0"
            )),
            "{page}"
        );
    }

    #[test]
    fn every_metric_has_help_and_type_once() {
        let metrics = Metrics::new(["payments"]);
        let page = metrics.render(
            &[budget("payments", 1.0, true)],
            true,
            &StoreStats::default(),
        );
        let mut types = std::collections::HashMap::new();
        for line in page.lines().filter(|line| line.starts_with("# TYPE ")) {
            let name = line.split_whitespace().nth(2).unwrap();
            *types.entry(name.to_owned()).or_insert(0) += 1;
        }
        assert!(types.values().all(|&count| count == 1), "{types:?}");
        for line in page
            .lines()
            .filter(|line| !line.starts_with('#') && !line.is_empty())
        {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|family| types.contains_key(*family))
                .unwrap_or(name);
            assert!(types.contains_key(family), "no TYPE for {line}");
        }
    }

    fn budget(upstream: &str, tokens: f64, retries_enabled: bool) -> BudgetSnapshot {
        BudgetSnapshot {
            upstream: upstream.to_owned(),
            tokens,
            retries_enabled,
            tracked: true,
        }
    }

    fn gauge_lines(page: &str) -> Vec<&str> {
        page.lines()
            .filter(|line| {
                line.starts_with("retryd_budget_tokens{")
                    || line.starts_with("retryd_retries_enabled{")
            })
            .collect()
    }

    #[test]
    fn gauges_name_configured_upstreams_and_sum_the_others() {
        let metrics = Metrics::new(["payments", "ledger", "search"]);
        let budgets = [
            budget("ledger", 3.0, false),
            budget("pay\u{202e}ments", 2.0, true),
            budget("payments", 5.5, true),
            budget("payments\u{200b}", 1.0, false),
            budget("zzz", 0.5, true),
        ];
        let page = metrics.render(&budgets, true, &StoreStats::default());
        assert_eq!(
            gauge_lines(&page),
            [
                "retryd_budget_tokens{upstream=\"ledger\"} 3",
                "retryd_budget_tokens{upstream=\"payments\"} 5.5",
                "retryd_budget_tokens{upstream=\"_other\"} 3.5",
                "retryd_retries_enabled{upstream=\"ledger\"} 0",
                "retryd_retries_enabled{upstream=\"payments\"} 1",
                "retryd_retries_enabled{upstream=\"_other\"} 0",
            ],
            "{page}"
        );
        assert!(page.contains("\nretryd_tracked_upstreams 5\n"), "{page}");
    }

    #[test]
    fn without_unconfigured_upstreams_there_is_no_other_series() {
        let metrics = Metrics::new(["payments"]);
        let page = metrics.render(
            &[budget("payments", 1.0, true)],
            true,
            &StoreStats::default(),
        );
        assert_eq!(
            gauge_lines(&page),
            [
                "retryd_budget_tokens{upstream=\"payments\"} 1",
                "retryd_retries_enabled{upstream=\"payments\"} 1",
            ]
        );
        let empty = Metrics::new(["payments"]).render(&[], true, &StoreStats::default());
        assert!(gauge_lines(&empty).is_empty(), "{empty}");
    }

    #[test]
    fn an_upstream_configured_as_other_is_one_series_with_the_others() {
        let metrics = Metrics::new(["_other", "payments"]);
        let page = metrics.render(
            &[budget("_other", 1.0, true), budget("unlisted", 2.0, true)],
            true,
            &StoreStats::default(),
        );
        assert_eq!(
            gauge_lines(&page),
            [
                "retryd_budget_tokens{upstream=\"_other\"} 3",
                "retryd_retries_enabled{upstream=\"_other\"} 1",
            ]
        );
    }

    #[test]
    fn configured_names_are_escaped_as_the_text_format_requires() {
        // The configuration allows any name but brackets: quotes,
        // backslashes and newlines must not end a label value or a line.
        let names = ["we\"ird", "back\\slash", "new\nline", "tab\tand ü"];
        let metrics = Metrics::new(names);
        let budgets: Vec<BudgetSnapshot> =
            names.iter().map(|name| budget(name, 1.0, true)).collect();
        let page = metrics.render(&budgets, true, &StoreStats::default());
        for escaped in [
            "\"back\\\\slash\"",
            "\"new\\nline\"",
            "\"tab\tand ü\"",
            "\"we\\\"ird\"",
        ] {
            let tokens = format!("retryd_budget_tokens{{upstream={escaped}}} 1");
            assert!(page.lines().any(|line| line == tokens), "{tokens}\n{page}");
        }
        // Every line is a comment or one whole sample: no name broke a line.
        for line in page.lines() {
            assert!(
                line.starts_with("# ") || line.starts_with("retryd_"),
                "{line:?}"
            );
        }
        assert_eq!(escape("a\\\"\n"), "a\\\\\\\"\\n");
    }
}

#[cfg(test)]
mod server_tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Reads one HTTP/1.1 response with a Content-Length body.
    async fn response(stream: &mut tokio::net::TcpStream) -> (String, String) {
        let mut raw = Vec::new();
        let mut byte = [0u8; 1];
        while !raw.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "closed early");
            raw.push(byte[0]);
        }
        let head = String::from_utf8(raw).unwrap();
        let length: usize = head
            .lines()
            .find_map(|line| {
                line.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_owned)
            })
            .expect("a content-length")
            .trim()
            .parse()
            .unwrap();
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await.unwrap();
        (head, String::from_utf8(body).unwrap())
    }

    #[tokio::test]
    async fn serves_metrics_with_keep_alive_and_404_elsewhere() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_metrics(
            listener,
            || async { "retryd_up 1\n".to_owned() },
            async {
                let _ = stopped.await;
            },
        ));
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        for _ in 0..2 {
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let (head, body) = response(&mut stream).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            assert!(head.contains("text/plain; version=0.0.4"), "{head}");
            assert_eq!(body, "retryd_up 1\n");
        }
        stream
            .write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (head, _) = response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        let _ = stop.send(());
        server.await.unwrap();
    }
}
