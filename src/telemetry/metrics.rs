//! Prometheus metrics: counters and histograms as atomics, indexed so that
//! recording takes no lock and no allocation, rendered as text on scrape.
//!
//! Upstream labels are bounded: the upstreams the configuration named at
//! start keep their own label, every other upstream (a caller's made-up
//! name, a look-alike, one named only by a later reload) counts as
//! `_other`. This holds for the budget gauges as for the counters, so no
//! series ever carries a name a caller chose.
//!
//! About 500 lines because the names, the recording and the rendering of
//! each metric are read together (one place to look for a dashboard); the
//! histograms, the `/metrics` port and the tests are in `metrics/`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

mod histogram;
mod server;
#[cfg(test)]
mod tests;

use self::histogram::Histogram;
pub use self::server::serve_metrics;

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
/// Counter of decisions not made because the caller had given up, by
/// reason (`deadline`: its grpc-timeout passed; `cancelled`: it reset the
/// call). None spent a token.
pub const METRIC_EXPIRED: &str = "retryd_expired_requests_total";

/// Counter of idle upstreams evicted from the store's table.
pub const METRIC_UPSTREAM_EVICTIONS: &str = "retryd_upstream_evictions_total";
/// Counter of calls refused because a new upstream would not fit, by the
/// limit that refused it.
pub const METRIC_UPSTREAM_REFUSALS: &str = "retryd_upstream_refusals_total";

/// Why a new upstream was refused, as the refusal counter labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamLimit {
    /// `limits.max_upstreams`: the store's table is full.
    Store = 0,
    /// `limits.max_upstreams_per_principal`: the caller's share is.
    Principal = 1,
}

impl UpstreamLimit {
    const ALL: [UpstreamLimit; 2] = [UpstreamLimit::Store, UpstreamLimit::Principal];

    fn label(self) -> &'static str {
        match self {
            UpstreamLimit::Store => "max_upstreams",
            UpstreamLimit::Principal => "max_upstreams_per_principal",
        }
    }
}

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

/// Why a decision was not made: the caller had given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::VariantArray)]
pub enum Expiry {
    /// Its `grpc-timeout` passed before the decision (answered
    /// DEADLINE_EXCEEDED).
    Deadline,
    /// It reset the call before the decision (nobody to answer).
    Cancelled,
}

impl Expiry {
    /// The `reason` label: an exhaustive match.
    fn label(self) -> &'static str {
        match self {
            Expiry::Deadline => "deadline",
            Expiry::Cancelled => "cancelled",
        }
    }
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
    expired: [AtomicU64; Expiry::VARIANTS.len()],
    upstream_refusals: [AtomicU64; UpstreamLimit::ALL.len()],
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
            expired: Default::default(),
            upstream_refusals: Default::default(),
        }
    }

    /// Counts a decision not made because its caller had given up.
    pub fn record_expiry(&self, expiry: Expiry) {
        self.expired[expiry as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a call refused because its new upstream did not fit `limit`.
    pub fn record_upstream_refusal(&self, limit: UpstreamLimit) {
        self.upstream_refusals[limit as usize].fetch_add(1, Ordering::Relaxed);
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
        help(
            &mut out,
            METRIC_EXPIRED,
            "counter",
            "Decisions not made because the caller had given up (deadline passed, or cancelled); none spent.",
        );
        for expiry in Expiry::VARIANTS {
            let _ = writeln!(
                out,
                "{METRIC_EXPIRED}{{reason=\"{}\"}} {}",
                expiry.label(),
                self.expired[*expiry as usize].load(Ordering::Relaxed)
            );
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
            METRIC_UPSTREAM_REFUSALS,
            "counter",
            "Calls refused because a new upstream did not fit, by limit.",
        );
        for limit in UpstreamLimit::ALL {
            let _ = writeln!(
                out,
                "{METRIC_UPSTREAM_REFUSALS}{{reason=\"{}\"}} {}",
                limit.label(),
                self.upstream_refusals[limit as usize].load(Ordering::Relaxed)
            );
        }
        help(
            &mut out,
            METRIC_UPSTREAM_EVICTIONS,
            "counter",
            "Idle upstreams evicted from the store's table (memory store).",
        );
        let _ = writeln!(
            out,
            "{METRIC_UPSTREAM_EVICTIONS} {}",
            store.evicted_upstreams
        );
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
