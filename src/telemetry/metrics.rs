//! Prometheus metrics: counters and histograms as atomics, indexed so that
//! recording takes no lock and no allocation, rendered on scrape in the
//! OpenMetrics format by `prometheus-client` (metrics/render.rs), with
//! exemplars (trace ids) on the decision histogram.
//!
//! Upstream labels are bounded: the upstreams the configuration named at
//! start keep their own label, every other upstream (a caller's made-up
//! name, a look-alike, one named only by a later reload) counts as
//! `_other`. This holds for the budget gauges as for the counters, so no
//! series ever carries a name a caller chose. Principals likewise: the
//! principals configured at start (and `anonymous`) have their own label,
//! any later one counts as `_other`.
//!
//! The names and the recording are here; the rendering, the histograms,
//! the `/metrics` port and the tests are in `metrics/`.

use std::collections::HashMap;

/// The label tables' maps: built once from the configuration and only read
/// on the decision path, so they need no defence against crafted keys
/// (nothing a caller sends is ever inserted), and SipHash was ~200
/// instructions per decision (callgrind) where foldhash takes a tenth.
type LabelIndex = HashMap<String, usize, foldhash::fast::RandomState>;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

mod budgets;
mod hedges;
mod histogram;
mod policy_checks;
mod render;
mod server;
#[cfg(test)]
mod tests;

pub use self::budgets::{BUDGET_GAUGES_INTERVAL, BudgetGauges};
use self::hedges::Hedges;
pub use self::hedges::{
    METRIC_HEDGE_DELAY, METRIC_HEDGES, METRIC_HEDGES_WON, METRIC_HEDGING_UNIFORMLY_SLOW,
};
use self::histogram::Histogram;
use self::policy_checks::PolicyChecks;
pub use self::policy_checks::{METRIC_CANDIDATE_DECISIONS, METRIC_SHADOW_DECISIONS};
pub use self::server::serve_metrics;

use crate::engine::{Decision, DenyReason, UnknownOutcome, VariantArray, Verdict};

/// Counter of decisions, by upstream, verdict and reason.
pub const METRIC_DECISIONS: &str = "retryd_decisions_total";
/// Gauge, always 1, whose labels name the build (`version`, `revision`,
/// `profile`): the Prometheus convention for joining a build to its series.
pub const METRIC_BUILD_INFO: &str = "retryd_build_info";
/// Counter of decisions whose attempt may have taken effect upstream, by
/// upstream, deciding rule and what the caller must do (`reconcile`,
/// `resend_with_key`): the writes of unknown outcome, however decided.
pub const METRIC_UNKNOWN_OUTCOMES: &str = "retryd_unknown_outcomes_total";
/// Counter of decisions by depth in a call chain (1 at the edge; `8+` for
/// 8 and deeper) and verdict (docs/lineage.md): how much each layer of a
/// chain retries.
pub const METRIC_CHAIN_DECISIONS: &str = "retryd_chain_decisions_total";
/// Histogram of the time to decide, store round trips included.
pub const METRIC_DECISION_SECONDS: &str = "retryd_decision_duration_seconds";
/// Counter of real requests reported through ReportTraffic.
pub const METRIC_REPORTED_REQUESTS: &str = "retryd_reported_requests_total";
/// Counter of the reported requests that funded the budget: all of them
/// with `adaptive = false`, the share the reported outcomes allow with the
/// adaptive budget (README, "Adaptive budget"). Its rate over
/// `retryd_reported_requests_total`'s is the fleet's adaptive level.
pub const METRIC_FUNDED_REQUESTS: &str = "retryd_funded_requests_total";
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
/// Counter of the times a DecideStream waited for the span export queue
/// to drain (back-pressure, `telemetry/pace.rs`).
pub const METRIC_SPAN_EXPORT_WAITS: &str = "retryd_span_export_waits_total";
/// Counter of the times a DecideStream waited for the decision log's queue
/// to drain (back-pressure, `telemetry/pace.rs`).
pub const METRIC_DECISION_LOG_WAITS: &str = "retryd_decision_log_waits_total";
/// Counter of decision log lines dropped because its queue was full.
pub const METRIC_DECISION_LOG_DROPPED: &str = "retryd_decision_log_dropped_total";
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

/// Counter of real requests reported, by upstream (reports the store
/// applied in full; a report the store failed midway is only in
/// `retryd_reported_requests_total`).
pub const METRIC_UPSTREAM_REPORTED: &str = "retryd_upstream_reported_requests_total";
/// Counter of the reported requests that funded the budget, by upstream
/// (see [`METRIC_FUNDED_REQUESTS`]): over the same rate of
/// `retryd_upstream_reported_requests_total`, the upstream's adaptive level.
pub const METRIC_UPSTREAM_FUNDED: &str = "retryd_upstream_funded_requests_total";
/// Counter of RETRY backoffs stretched past the upstream's earliest-retry
/// time, set by another caller's Retry-After or pushback, by upstream.
pub const METRIC_BACKOFFS_STRETCHED: &str = "retryd_backoffs_stretched_total";
/// Gauge: seconds from the listing until the upstream's fleet-wide pushback
/// ends (its earliest-retry time or stop window); 0 when none is in force.
pub const METRIC_UPSTREAM_PUSHBACK: &str = "retryd_upstream_pushback_seconds";
/// Gauge: the adaptive budget's level as last reported fleet-wide (1
/// before any outcome), by upstream (`_other`: the lowest).
pub const METRIC_UPSTREAM_ADAPTIVE_LEVEL: &str = "retryd_upstream_adaptive_level";
/// Gauge: the recovery ramp's share of retries admitted, 0 to 1 (1: no
/// ramp), by upstream, as of the budget listing (`_other`: the lowest).
pub const METRIC_UPSTREAM_RAMP: &str = "retryd_upstream_ramp";
/// Counter of retries granted (RETRY verdicts), by upstream.
pub const METRIC_RETRIES_GRANTED: &str = "retryd_retries_granted_total";
/// Counter of decisions by principal and verdict.
pub const METRIC_PRINCIPAL_DECISIONS: &str = "retryd_principal_decisions_total";
/// Counter of retries granted, by principal.
pub const METRIC_PRINCIPAL_RETRIES: &str = "retryd_principal_retries_granted_total";
/// Counter of kill-switch flips, by upstream and new state.
pub const METRIC_KILL_SWITCH_FLIPS: &str = "retryd_kill_switch_flips_total";

/// Counter of idle upstreams evicted from the store's table.
pub const METRIC_UPSTREAM_EVICTIONS: &str = "retryd_upstream_evictions_total";
/// Counter of calls refused because a new upstream would not fit, by the
/// limit that refused it.
pub const METRIC_UPSTREAM_REFUSALS: &str = "retryd_upstream_refusals_total";

/// Counter of calls refused for want of a credential or a permission, by
/// gRPC code: every one, whereas the audit log is throttled.
pub const METRIC_CALLS_REFUSED: &str = "retryd_calls_refused_total";

/// Why a call was refused, as the refused-calls counter labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `UNAUTHENTICATED`: no credential, or an unknown one.
    Unauthenticated = 0,
    /// `PERMISSION_DENIED`: a known caller asking for what it may not.
    PermissionDenied = 1,
}

impl Refusal {
    const ALL: [Refusal; 2] = [Refusal::Unauthenticated, Refusal::PermissionDenied];

    fn label(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::PermissionDenied => "permission_denied",
        }
    }
}

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

/// The label of upstreams (and principals) the configuration does not name.
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
    /// By principal label, then verdict (retry, ambiguous, deny).
    principals: Vec<[AtomicU64; 3]>,
    /// By upstream label, then deciding rule (1 to 9), then mark
    /// (reconcile, resend with key).
    unknown_outcomes: Vec<[[AtomicU64; UNKNOWN_OUTCOME_KINDS]; RULES]>,
    /// By depth in the call chain (1 to `CHAIN_DEPTHS`, the last for
    /// deeper ones too), then verdict (retry, ambiguous, deny).
    chain: [[AtomicU64; 3]; CHAIN_DEPTHS],
    latency: Histogram,
}

/// The depths the chain counter tells apart: a deeper decision counts in
/// the last (`8+`). Chains are rarely deeper; the label stays bounded.
const CHAIN_DEPTHS: usize = 8;

/// The `depth` label of a chain counter row.
fn chain_depth_label(row: usize) -> String {
    if row + 1 == CHAIN_DEPTHS {
        format!("{CHAIN_DEPTHS}+")
    } else {
        (row + 1).to_string()
    }
}

/// The rules of the decision order, 1 to 9.
const RULES: usize = 9;
/// `UnknownOutcome`'s variants, in `unknown_outcome_index` order.
const UNKNOWN_OUTCOME_KINDS: usize = 2;

fn unknown_outcome_index(mark: UnknownOutcome) -> usize {
    match mark {
        UnknownOutcome::Reconcile => 0,
        UnknownOutcome::ResendWithKey => 1,
    }
}

/// The `outcome` label of an unknown-outcome column.
fn unknown_outcome_label(index: usize) -> &'static str {
    [UnknownOutcome::Reconcile, UnknownOutcome::ResendWithKey][index].as_str()
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
    index: LabelIndex,
    principal_labels: Vec<String>,
    principal_index: LabelIndex,
    shards: Box<[DecisionShard]>,
    reported_requests: AtomicU64,
    funded_requests: AtomicU64,
    /// By upstream label: not on the decision path, so not sharded.
    upstream_reported: Box<[AtomicU64]>,
    upstream_funded: Box<[AtomicU64]>,
    /// By upstream label: stretched backoffs are rare (another caller's
    /// pushback in force), so not sharded either.
    stretched: Box<[AtomicU64]>,
    /// By upstream label, then the new state (off, on).
    flips: Box<[[AtomicU64; 2]]>,
    /// Indexed by `StoreOp as usize`, in the order of `StoreOp::VARIANTS`.
    store_latency: [Histogram; StoreOp::VARIANTS.len()],
    store_errors: [AtomicU64; StoreOp::VARIANTS.len()],
    /// Spans accepted by the collector.
    pub spans_exported: AtomicU64,
    /// Spans dropped because the export queue was full.
    pub spans_dropped: AtomicU64,
    /// Spans lost in failed exports.
    pub spans_failed: AtomicU64,
    /// Times a DecideStream waited for the span export queue to drain.
    pub span_export_waits: AtomicU64,
    /// Decision log lines dropped because its queue was full.
    pub decision_log_dropped: AtomicU64,
    /// Times a DecideStream waited for the decision log's queue to drain.
    pub decision_log_waits: AtomicU64,
    reloads: [AtomicU64; 2],
    expired: [AtomicU64; Expiry::VARIANTS.len()],
    policy_checks: PolicyChecks,
    hedges: Hedges,
    upstream_refusals: [AtomicU64; UpstreamLimit::ALL.len()],
    calls_refused: [AtomicU64; Refusal::ALL.len()],
}

impl Metrics {
    /// Metrics with a label of their own for each of `named_upstreams`.
    pub fn new<'a>(named_upstreams: impl IntoIterator<Item = &'a str>) -> Metrics {
        Metrics::with_principals(named_upstreams, ["anonymous"])
    }

    /// Metrics with a label of their own for each of `named_upstreams` and
    /// of `principals`.
    pub fn with_principals<'a, 'p>(
        named_upstreams: impl IntoIterator<Item = &'a str>,
        principals: impl IntoIterator<Item = &'p str>,
    ) -> Metrics {
        let (labels, index) = label_table(named_upstreams);
        let (principal_labels, principal_index) = label_table(principals);
        // One shard per core is enough: the runtime has a worker per core.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let shards = (0..cores.min(64))
            .map(|_| DecisionShard {
                decisions: labels.iter().map(|_| Default::default()).collect(),
                principals: principal_labels
                    .iter()
                    .map(|_| Default::default())
                    .collect(),
                unknown_outcomes: labels.iter().map(|_| Default::default()).collect(),
                chain: Default::default(),
                latency: Histogram::default(),
            })
            .collect();
        let labels_len = labels.len();
        Metrics {
            upstream_reported: labels.iter().map(|_| AtomicU64::new(0)).collect(),
            upstream_funded: labels.iter().map(|_| AtomicU64::new(0)).collect(),
            stretched: labels.iter().map(|_| AtomicU64::new(0)).collect(),
            flips: labels.iter().map(|_| Default::default()).collect(),
            labels,
            index,
            principal_labels,
            principal_index,
            shards,
            reported_requests: AtomicU64::new(0),
            funded_requests: AtomicU64::new(0),
            store_latency: Default::default(),
            store_errors: Default::default(),
            spans_exported: AtomicU64::new(0),
            spans_dropped: AtomicU64::new(0),
            spans_failed: AtomicU64::new(0),
            span_export_waits: AtomicU64::new(0),
            decision_log_dropped: AtomicU64::new(0),
            decision_log_waits: AtomicU64::new(0),
            reloads: Default::default(),
            expired: Default::default(),
            upstream_refusals: Default::default(),
            calls_refused: Default::default(),
            policy_checks: PolicyChecks::new(labels_len),
            hedges: Hedges::new(labels_len),
        }
    }

    /// Counts a shadow decision and a candidate's verdict beside the live
    /// one. Nothing for an upstream with neither (a branch, no lookup).
    pub fn record_policy_checks(
        &self,
        upstream: &str,
        live: &Decision,
        candidate: Option<&Decision>,
        shadow: bool,
    ) {
        if shadow || candidate.is_some() {
            self.policy_checks
                .record(self.row(upstream), live, candidate, shadow);
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

    /// Counts a call refused for want of a credential or a permission.
    pub fn record_call_refused(&self, refusal: Refusal) {
        self.calls_refused[refusal as usize].fetch_add(1, Ordering::Relaxed);
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

    /// Counts one decision (by upstream and by principal) and how long it
    /// took; with the trace id of its span, if sampled, and when it ended,
    /// as the exemplar of its latency bucket. No lock, no allocation: a map
    /// lookup per label and relaxed atomics in this thread's shard.
    pub fn record_decision(
        &self,
        upstream: &str,
        principal: &str,
        decision: &Decision,
        depth: u32,
        elapsed: Duration,
        exemplar: Option<([u8; 16], std::time::SystemTime)>,
    ) {
        let row = self.row(upstream);
        if decision.fleet_effect() == crate::engine::FleetEffect::Stretched {
            self.stretched[row].fetch_add(1, Ordering::Relaxed);
        }
        let shard = &self.shards[shard_of_this_thread(self.shards.len())];
        let outcome = outcome_index(&decision.verdict);
        shard.decisions[row][outcome].fetch_add(1, Ordering::Relaxed);
        let principal_row = self
            .principal_index
            .get(principal)
            .copied()
            .unwrap_or(self.principal_labels.len() - 1);
        shard.principals[principal_row][outcome.min(2)].fetch_add(1, Ordering::Relaxed);
        let depth_row = (depth.max(1) as usize).min(CHAIN_DEPTHS) - 1;
        shard.chain[depth_row][outcome.min(2)].fetch_add(1, Ordering::Relaxed);
        if let Some(mark) = decision.unknown_outcome {
            let rule = usize::from(decision.rule.number()).clamp(1, RULES) - 1;
            shard.unknown_outcomes[row][rule][unknown_outcome_index(mark)]
                .fetch_add(1, Ordering::Relaxed);
        }
        shard.latency.record_traced(elapsed, exemplar);
    }

    /// Counts a hedge decision (`decision.hedge` is set).
    pub fn record_hedge(&self, upstream: &str, decision: &Decision) {
        self.hedges.record(self.row(upstream), decision);
    }

    /// Counts hedged calls to `upstream` that a hedge won, as reported.
    pub fn record_hedges_won(&self, upstream: &str, won: u64) {
        self.hedges.won(self.row(upstream), won);
    }

    /// Sets the hedge delay served for `upstream` (zero while it is not
    /// hedged) and whether it is uniformly slow.
    pub fn record_hedging(&self, upstream: &str, delay: Duration, uniformly_slow: bool) {
        self.hedges
            .served(self.row(upstream), delay, uniformly_slow);
    }

    /// Counts real requests reported for `upstream` (applied in full).
    pub fn record_reported(&self, upstream: &str, requests: u64) {
        self.upstream_reported[self.row(upstream)].fetch_add(requests, Ordering::Relaxed);
    }

    /// Counts an operator switching retries for `upstream` to `enabled`
    /// (only a change of state is a flip).
    pub fn record_flip(&self, upstream: &str, enabled: bool) {
        self.flips[self.row(upstream)][usize::from(enabled)].fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions of one upstream label and outcome, over every shard.
    fn decisions(&self, row: usize, outcome: usize) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.decisions[row][outcome].load(Ordering::Relaxed))
            .sum()
    }

    /// Counts reported real requests, and those of them that funded the
    /// budget.
    pub fn record_deposit(&self, upstream: &str, requests: u64, funded: u64) {
        self.upstream_funded[self.row(upstream)].fetch_add(funded, Ordering::Relaxed);
        self.reported_requests
            .fetch_add(requests, Ordering::Relaxed);
        self.funded_requests.fetch_add(funded, Ordering::Relaxed);
    }

    /// Records one store operation's latency and outcome.
    pub fn record_store(&self, op: StoreOp, elapsed: Duration, failed: bool) {
        let index = op as usize;
        self.store_latency[index].record(elapsed);
        if failed {
            self.store_errors[index].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Labels sorted and deduplicated, `_other` last (a name configured as
/// `_other` is counted with the others: two series with one label would
/// make the exposition invalid), and the index of all but `_other`.
fn label_table<'a>(names: impl IntoIterator<Item = &'a str>) -> (Vec<String>, LabelIndex) {
    let mut labels: Vec<String> = names
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
    (labels, index)
}
