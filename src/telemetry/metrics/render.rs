//! The scrape page: every metric through `prometheus-client`'s OpenMetrics
//! encoder, except the decision histogram, whose exemplars that crate can
//! only make under a lock (see histogram.rs), written beside it in the same
//! format before the closing `# EOF`.
//!
//! A scrape copies the atomics into owned families, then encodes them: the
//! encoder wants a `'static` collector, and a scrape is rare enough that
//! the copy does not matter.

use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    CounterValueEncoder, DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue,
    GaugeValueEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::histogram::{Histogram, Totals};
use super::*;
use crate::budget::{BudgetSnapshot, StoreStats};

/// The content type of the page.
pub(super) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A sample's value: integers stay integers on the page.
#[derive(Clone, Copy, Debug)]
enum Number {
    Int(u64),
    Float(f64),
}

impl EncodeCounterValue for Number {
    fn encode(&self, encoder: &mut CounterValueEncoder) -> Result<(), std::fmt::Error> {
        match self {
            Number::Int(n) => EncodeCounterValue::encode(n, encoder),
            Number::Float(x) => EncodeCounterValue::encode(x, encoder),
        }
    }
}

impl EncodeGaugeValue for Number {
    fn encode(&self, encoder: &mut GaugeValueEncoder) -> Result<(), std::fmt::Error> {
        match self {
            Number::Int(n) => EncodeGaugeValue::encode(n, encoder),
            Number::Float(x) => EncodeGaugeValue::encode(x, encoder),
        }
    }
}

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
enum Samples {
    Scalars(Vec<(Labels, Number)>),
    Histograms(Vec<(Labels, Totals)>),
}

impl std::fmt::Debug for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Totals")
            .field("count", &self.count)
            .finish()
    }
}

/// One metric family, copied at scrape time. Counter names are given
/// without `_total`: the encoder adds it, as OpenMetrics requires.
#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    samples: Samples,
}

#[derive(Debug)]
struct Page(Vec<Family>);

impl Collector for Page {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in &self.0 {
            let mut metric =
                encoder.encode_descriptor(family.name, family.help, None, family.kind)?;
            match &family.samples {
                Samples::Scalars(samples) => {
                    for (labels, value) in samples {
                        let mut series = metric.encode_family(labels)?;
                        match family.kind {
                            MetricType::Counter => {
                                series.encode_counter::<NoLabelSet, _, u64>(value, None)?
                            }
                            _ => series.encode_gauge(value)?,
                        }
                    }
                }
                Samples::Histograms(samples) => {
                    for (labels, totals) in samples {
                        metric
                            .encode_family(labels)?
                            .encode_histogram::<NoLabelSet>(
                                totals.sum_seconds,
                                totals.count,
                                &totals.buckets,
                                None,
                            )?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn counter(name: &'static str, help: &'static str, samples: Vec<(Labels, Number)>) -> Family {
    Family {
        name: name.strip_suffix("_total").unwrap_or(name),
        help,
        kind: MetricType::Counter,
        samples: Samples::Scalars(samples),
    }
}

fn gauge(name: &'static str, help: &'static str, samples: Vec<(Labels, Number)>) -> Family {
    Family {
        name,
        help,
        kind: MetricType::Gauge,
        samples: Samples::Scalars(samples),
    }
}

fn one(value: Number) -> Vec<(Labels, Number)> {
    vec![(Vec::new(), value)]
}

/// The budget gauges of one upstream label at scrape time.
#[derive(Clone, Copy, Debug)]
struct Gauges {
    tokens: f64,
    retries_enabled: bool,
    /// The longest pushback in force among the label's upstreams, seconds.
    pushback: f64,
    /// The lowest adaptive level among them.
    level: f64,
    /// The lowest recovery ramp share among them.
    ramp: f64,
}

impl Metrics {
    /// The OpenMetrics page of every metric, with the budgets the store
    /// reported at scrape time.
    pub fn render(
        &self,
        budgets: &[BudgetSnapshot],
        store_available: f64,
        store: &StoreStats,
    ) -> String {
        self.render_with_ramps(budgets, store_available, store, &|_| {
            std::time::Duration::ZERO
        })
    }

    /// [`Metrics::render`], with each upstream's `ramp_window` for the
    /// `retryd_upstream_ramp` gauge (a zero window: no ramp, 1).
    pub fn render_with_ramps(
        &self,
        budgets: &[BudgetSnapshot],
        store_available: f64,
        store: &StoreStats,
        ramp_window_of: &dyn Fn(&str) -> std::time::Duration,
    ) -> String {
        let load = |counter: &AtomicU64| Number::Int(counter.load(Ordering::Relaxed));
        let by_upstream = |value: &dyn Fn(usize) -> u64| -> Vec<(Labels, Number)> {
            self.labels
                .iter()
                .enumerate()
                .map(|(row, label)| (vec![("upstream", label.clone())], Number::Int(value(row))))
                .collect()
        };
        let mut families = vec![gauge(
            METRIC_BUILD_INFO,
            "The build serving: its version, git revision and Cargo profile (always 1).",
            vec![(
                vec![
                    ("version", crate::build::VERSION.to_owned()),
                    ("revision", crate::build::REVISION.to_owned()),
                    ("profile", crate::build::PROFILE.to_owned()),
                ],
                Number::Int(1),
            )],
        )];

        let mut decisions = Vec::new();
        for (row, label) in self.labels.iter().enumerate() {
            for outcome in 0..OUTCOMES {
                let value = self.decisions(row, outcome);
                if value == 0 {
                    continue;
                }
                let (verdict, reason) = outcome_labels(outcome);
                decisions.push((
                    vec![
                        ("upstream", label.clone()),
                        ("verdict", verdict.to_owned()),
                        ("reason", reason.to_owned()),
                    ],
                    Number::Int(value),
                ));
            }
        }
        families.push(counter(
            METRIC_DECISIONS,
            "Retry decisions by upstream, verdict and deny reason.",
            decisions,
        ));
        let mut unknown_outcomes = Vec::new();
        for (row, label) in self.labels.iter().enumerate() {
            for rule in 0..RULES {
                for kind in 0..UNKNOWN_OUTCOME_KINDS {
                    let value: u64 = self
                        .shards
                        .iter()
                        .map(|shard| {
                            shard.unknown_outcomes[row][rule][kind].load(Ordering::Relaxed)
                        })
                        .sum();
                    if value == 0 {
                        continue;
                    }
                    unknown_outcomes.push((
                        vec![
                            ("upstream", label.clone()),
                            ("rule", (rule + 1).to_string()),
                            ("outcome", unknown_outcome_label(kind).to_owned()),
                        ],
                        Number::Int(value),
                    ));
                }
            }
        }
        families.push(counter(
            METRIC_UNKNOWN_OUTCOMES,
            "Decisions whose attempt may have taken effect upstream (whatever the verdict), by upstream, deciding rule and what the caller must do.",
            unknown_outcomes,
        ));
        let mut chain = Vec::new();
        for row in 0..CHAIN_DEPTHS {
            for (column, verdict) in ["retry", "ambiguous", "deny"].iter().enumerate() {
                let value: u64 = self
                    .shards
                    .iter()
                    .map(|shard| shard.chain[row][column].load(Ordering::Relaxed))
                    .sum();
                // The edge's row always, so that a ratio to it has a
                // denominator; deeper ones once a chain reaches them.
                if value == 0 && row > 0 {
                    continue;
                }
                chain.push((
                    vec![
                        ("depth", chain_depth_label(row)),
                        ("verdict", (*verdict).to_owned()),
                    ],
                    Number::Int(value),
                ));
            }
        }
        families.push(counter(
            METRIC_CHAIN_DECISIONS,
            "Decisions by depth in the call chain (1: no enclosing call; 8+: 8 and deeper) and verdict.",
            chain,
        ));
        families.push(counter(
            METRIC_RETRIES_GRANTED,
            "Retries granted (RETRY verdicts) by upstream.",
            by_upstream(&|row| self.decisions(row, RETRY_OUTCOME)),
        ));
        families.push(counter(
            METRIC_BACKOFFS_STRETCHED,
            "RETRY backoffs stretched past the upstream's earliest-retry time, set by another caller's Retry-After or pushback, by upstream.",
            by_upstream(&|row| self.stretched[row].load(Ordering::Relaxed)),
        ));
        families.push(counter(
            METRIC_UPSTREAM_REPORTED,
            "Real requests reported by upstream (reports applied in full).",
            by_upstream(&|row| self.upstream_reported[row].load(Ordering::Relaxed)),
        ));
        families.push(counter(
            METRIC_UPSTREAM_FUNDED,
            "Reported requests that funded the retry budget, by upstream (the adaptive budget's level, over the reported).",
            by_upstream(&|row| self.upstream_funded[row].load(Ordering::Relaxed)),
        ));
        let mut principal_decisions = Vec::new();
        let mut principal_retries = Vec::new();
        for (row, label) in self.principal_labels.iter().enumerate() {
            for (column, verdict) in ["retry", "ambiguous", "deny"].iter().enumerate() {
                let value: u64 = self
                    .shards
                    .iter()
                    .map(|shard| shard.principals[row][column].load(Ordering::Relaxed))
                    .sum();
                if column == 0 {
                    principal_retries
                        .push((vec![("principal", label.clone())], Number::Int(value)));
                }
                principal_decisions.push((
                    vec![
                        ("principal", label.clone()),
                        ("verdict", (*verdict).to_owned()),
                    ],
                    Number::Int(value),
                ));
            }
        }
        families.push(counter(
            METRIC_PRINCIPAL_DECISIONS,
            "Decisions by calling principal and verdict (_other: principals configured after start).",
            principal_decisions,
        ));
        families.push(counter(
            METRIC_PRINCIPAL_RETRIES,
            "Retries granted by calling principal.",
            principal_retries,
        ));
        let mut flips = Vec::new();
        for (row, label) in self.labels.iter().enumerate() {
            for (state, enabled) in ["false", "true"].iter().enumerate() {
                flips.push((
                    vec![
                        ("upstream", label.clone()),
                        ("enabled", (*enabled).to_owned()),
                    ],
                    load(&self.flips[row][state]),
                ));
            }
        }
        families.push(counter(
            METRIC_KILL_SWITCH_FLIPS,
            "Kill-switch flips by upstream and the state switched to.",
            flips,
        ));

        let scalars: [(&'static str, &'static str, &AtomicU64); 8] = [
            (
                METRIC_REPORTED_REQUESTS,
                "Real requests reported through ReportTraffic.",
                &self.reported_requests,
            ),
            (
                METRIC_FUNDED_REQUESTS,
                "Reported requests that funded the retry budget (the adaptive budget funds only the share their outcomes allow).",
                &self.funded_requests,
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
            (
                METRIC_SPAN_EXPORT_WAITS,
                "Times a DecideStream waited, before its next item, for the span export queue (over half full) to drain.",
                &self.span_export_waits,
            ),
            (
                METRIC_DECISION_LOG_DROPPED,
                "Decision log lines dropped because its queue was full.",
                &self.decision_log_dropped,
            ),
            (
                METRIC_DECISION_LOG_WAITS,
                "Times a DecideStream waited, before its next item, for the decision log's queue (over half full) to drain.",
                &self.decision_log_waits,
            ),
        ];
        for (name, help, value) in scalars {
            families.push(counter(name, help, one(load(value))));
        }
        families.push(counter(
            METRIC_EXPIRED,
            "Decisions not made because the caller had given up (deadline passed, or cancelled); none spent.",
            Expiry::VARIANTS
                .iter()
                .map(|expiry| {
                    (
                        vec![("reason", expiry.label().to_owned())],
                        load(&self.expired[*expiry as usize]),
                    )
                })
                .collect(),
        ));
        families.push(counter(
            METRIC_CALLS_REFUSED,
            "Calls refused for want of a credential or a permission, by gRPC code.",
            Refusal::ALL
                .iter()
                .map(|refusal| {
                    (
                        vec![("code", refusal.label().to_owned())],
                        load(&self.calls_refused[*refusal as usize]),
                    )
                })
                .collect(),
        ));
        families.push(counter(
            METRIC_UPSTREAM_REFUSALS,
            "Calls refused because a new upstream did not fit, by limit.",
            UpstreamLimit::ALL
                .iter()
                .map(|limit| {
                    (
                        vec![("reason", limit.label().to_owned())],
                        load(&self.upstream_refusals[*limit as usize]),
                    )
                })
                .collect(),
        ));
        families.push(counter(
            METRIC_UPSTREAM_EVICTIONS,
            "Idle upstreams evicted from the store's table (memory store).",
            one(Number::Int(store.evicted_upstreams)),
        ));
        let (shadow, candidate) = self.policy_checks.samples(&self.labels);
        let ints = |samples: Vec<(Labels, u64)>| {
            samples
                .into_iter()
                .map(|(labels, value)| (labels, Number::Int(value)))
                .collect()
        };
        families.push(counter(
            METRIC_SHADOW_DECISIONS,
            "Decisions answered as not enforced (the upstream's enforce = false).",
            ints(shadow),
        ));
        families.push(counter(
            METRIC_CANDIDATE_DECISIONS,
            "Decisions by live verdict and by what the upstream's candidate policy decided.",
            ints(candidate),
        ));
        let hedges = self.hedges.samples(&self.labels);
        families.push(counter(
            METRIC_HEDGES,
            "Hedge decisions by upstream, outcome (granted, denied) and deny reason.",
            ints(hedges.decisions),
        ));
        families.push(counter(
            METRIC_HEDGES_WON,
            "Hedged calls whose answer came from a hedge, by upstream, as callers report.",
            ints(hedges.won),
        ));
        families.push(gauge(
            METRIC_HEDGE_DELAY,
            "The hedge delay served per upstream (0 while it is not hedged).",
            hedges
                .delays
                .into_iter()
                .map(|(labels, seconds)| (labels, Number::Float(seconds)))
                .collect(),
        ));
        families.push(gauge(
            METRIC_HEDGING_UNIFORMLY_SLOW,
            "1 while the upstream is uniformly slow (p50 close to its tail quantile): not hedged.",
            ints(hedges.uniformly_slow),
        ));
        // One token per RETRY: the RETRY decisions, not a counter of its own.
        let retries: u64 = (0..self.labels.len())
            .map(|row| self.decisions(row, RETRY_OUTCOME))
            .sum();
        families.push(counter(
            METRIC_WITHDRAWALS,
            "Tokens withdrawn, one per RETRY.",
            one(Number::Int(retries)),
        ));
        families.push(Family {
            name: METRIC_STORE_SECONDS,
            help: "Budget store operation latency.",
            kind: MetricType::Histogram,
            samples: Samples::Histograms(
                StoreOp::VARIANTS
                    .iter()
                    .zip(&self.store_latency)
                    .map(|(op, histogram)| {
                        (
                            vec![("op", op.label().to_owned())],
                            Histogram::totals(std::iter::once(histogram)),
                        )
                    })
                    .collect(),
            ),
        });
        families.push(counter(
            METRIC_STORE_ERRORS,
            "Failed budget store operations.",
            StoreOp::VARIANTS
                .iter()
                .zip(&self.store_errors)
                .map(|(op, counter)| (vec![("op", op.label().to_owned())], load(counter)))
                .collect(),
        ));
        families.push(gauge(
            METRIC_STORE_AVAILABLE,
            "The share of the budget store's backend believed reachable: 1 when all of it, 0 during an outage, the share of slots whose master answers while one Redis Cluster master is down.",
            // 0 and 1 exactly as before (alerts compare with them); a
            // fraction only for a partly reachable Cluster.
            one(if store_available >= 1.0 {
                Number::Int(1)
            } else if store_available <= 0.0 {
                Number::Int(0)
            } else {
                Number::Float(store_available)
            }),
        ));
        let store_counters: [(&'static str, &'static str, Number); 7] = [
            (
                METRIC_STORE_BACKEND_ERRORS,
                "Backend calls that failed or timed out.",
                Number::Int(store.backend_errors),
            ),
            (
                METRIC_STORE_BACKEND_TIMEOUTS,
                "Backend calls that timed out.",
                Number::Int(store.backend_timeouts),
            ),
            (
                METRIC_STORE_OUTAGES,
                "Times the backend was found unreachable.",
                Number::Int(store.outages),
            ),
            (
                METRIC_STORE_FALLBACKS,
                "Calls answered from the local fallback bucket.",
                Number::Int(store.fallbacks),
            ),
            (
                METRIC_STORE_UNAVAILABLE,
                "Calls answered unavailable (on_unavailable = deny).",
                Number::Int(store.unavailable_answers),
            ),
            (
                METRIC_STORE_FORFEITED,
                "Leased tokens neither spent nor returned.",
                Number::Float(store.forfeited_tokens),
            ),
            (
                METRIC_STORE_LOST_DEPOSITS,
                "Batched deposits that never reached the backend.",
                Number::Int(store.lost_deposits),
            ),
        ];
        for (name, help, value) in store_counters {
            families.push(counter(name, help, one(value)));
        }
        families.push(counter(
            METRIC_RELOADS,
            "Configuration reloads, applied or refused.",
            ["applied", "refused"]
                .iter()
                .zip(&self.reloads)
                .map(|(outcome, counter)| (vec![("outcome", (*outcome).to_owned())], load(counter)))
                .collect(),
        ));
        families.push(gauge(
            METRIC_TRACKED_UPSTREAMS,
            "Upstreams with budget state.",
            one(Number::Int(budgets.len() as u64)),
        ));
        // The gauges are labelled as the counters are: a tracked upstream
        // the configuration does not name is added into `_other`. A label
        // without tracked upstreams has no series.
        let mut gauges: Vec<Option<Gauges>> = vec![None; self.labels.len()];
        for budget in budgets {
            let gauge = gauges[self.row(&budget.upstream)].get_or_insert(Gauges {
                tokens: 0.0,
                retries_enabled: true,
                pushback: 0.0,
                level: 1.0,
                ramp: 1.0,
            });
            gauge.level = gauge.level.min(budget.adaptive_level);
            let window = ramp_window_of(&budget.upstream);
            gauge.ramp = gauge
                .ramp
                .min(crate::budget::pushback::ramp(budget.ramp_elapsed, window).0);
            gauge.tokens += budget.tokens;
            gauge.retries_enabled &= budget.retries_enabled;
            if let Some(remaining) = budget.pushback_remaining {
                gauge.pushback = gauge.pushback.max(remaining.as_secs_f64());
            }
        }
        let labelled = |value: fn(Gauges) -> Number| -> Vec<(Labels, Number)> {
            self.labels
                .iter()
                .zip(&gauges)
                .filter_map(|(label, gauge)| {
                    gauge.map(|gauge| (vec![("upstream", label.clone())], value(gauge)))
                })
                .collect()
        };
        families.push(gauge(
            METRIC_BUDGET_TOKENS,
            "Tokens in the upstream's retry budget (_other: the sum over unconfigured upstreams).",
            labelled(|gauge| Number::Float(gauge.tokens)),
        ));
        families.push(gauge(
            METRIC_RETRIES_ENABLED,
            "0 while an operator has switched retries off (_other: for any unconfigured upstream).",
            labelled(|gauge| Number::Int(u64::from(gauge.retries_enabled))),
        ));
        families.push(gauge(
            METRIC_UPSTREAM_PUSHBACK,
            "Seconds until the upstream's fleet-wide pushback ends (earliest-retry time or stop window), 0 when none (_other: the longest).",
            labelled(|gauge| Number::Float(gauge.pushback)),
        ));
        families.push(gauge(
            METRIC_UPSTREAM_ADAPTIVE_LEVEL,
            "The adaptive budget's level as last reported fleet-wide, 0 to 1 (_other: the lowest).",
            labelled(|gauge| Number::Float(gauge.level)),
        ));
        families.push(gauge(
            METRIC_UPSTREAM_RAMP,
            "The share of retries admitted while the upstream recovers, 0 to 1; 1 when no ramp is under way (_other: the lowest).",
            labelled(|gauge| Number::Float(gauge.ramp)),
        ));

        let mut registry = Registry::default();
        registry.register_collector(Box::new(Page(families)));
        let mut out = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
        Histogram::render_with_exemplars(
            self.shards.iter().map(|shard| &shard.latency),
            &mut out,
            METRIC_DECISION_SECONDS,
            "Time to decide, store round trips included.",
        );
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }
}
