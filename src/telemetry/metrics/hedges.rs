//! Hedging's metrics, by upstream label: hedge decisions granted and
//! denied (by reason), the hedge delay served and whether the upstream is
//! uniformly slow, and the hedges that won, as the callers report them
//! (`UpstreamTraffic.hedges_won`: only a caller knows which copy answered;
//! granted minus won is the hedges that lost). Bounded like every upstream
//! label; only upstreams that have had a hedge decision, a served delay or
//! a won hedge show a series.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::{Decision, DenyReason, VariantArray, Verdict};

/// Counter of hedge decisions by upstream, outcome (`granted`, `denied`)
/// and reason (empty when granted).
pub const METRIC_HEDGES: &str = "retryd_hedges_total";
/// Counter of hedged calls a hedge won, by upstream, as callers report.
pub const METRIC_HEDGES_WON: &str = "retryd_hedges_won_total";
/// Gauge of the hedge delay served, by upstream (0 while not hedged).
pub const METRIC_HEDGE_DELAY: &str = "retryd_hedge_delay_seconds";
/// Gauge, 1 while the upstream is uniformly slow (not hedged), by upstream.
pub const METRIC_HEDGING_UNIFORMLY_SLOW: &str = "retryd_hedging_uniformly_slow";

/// Never served: no series.
const UNSET: u64 = u64::MAX;

type Series = Vec<(Vec<(&'static str, String)>, u64)>;
type FloatSeries = Vec<(Vec<(&'static str, String)>, f64)>;

#[derive(Debug)]
pub(super) struct Hedges {
    /// By upstream label: granted, then one column per deny reason.
    decisions: Vec<[AtomicU64; 1 + DenyReason::VARIANTS.len()]>,
    /// By upstream label: the delay served, in nanoseconds, or `UNSET`.
    delay_nanos: Vec<AtomicU64>,
    /// By upstream label: 0 or 1, or `UNSET`.
    uniformly_slow: Vec<AtomicU64>,
    /// By upstream label: hedges won, as reported (0: no series).
    won: Vec<AtomicU64>,
}

/// What [`Hedges::samples`] reads: decisions, delays (seconds), the
/// uniformly-slow flags and the hedges won.
pub(super) struct HedgeSamples {
    pub(super) decisions: Series,
    pub(super) delays: FloatSeries,
    pub(super) uniformly_slow: Series,
    pub(super) won: Series,
}

impl Hedges {
    pub(super) fn new(rows: usize) -> Hedges {
        Hedges {
            decisions: (0..rows).map(|_| Default::default()).collect(),
            delay_nanos: (0..rows).map(|_| AtomicU64::new(UNSET)).collect(),
            uniformly_slow: (0..rows).map(|_| AtomicU64::new(UNSET)).collect(),
            won: (0..rows).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(super) fn record(&self, row: usize, decision: &Decision) {
        let column = match decision.verdict {
            Verdict::Deny(reason) => 1 + reason as usize,
            _ => 0,
        };
        self.decisions[row][column].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn won(&self, row: usize, won: u64) {
        self.won[row].fetch_add(won, Ordering::Relaxed);
    }

    pub(super) fn served(&self, row: usize, delay: std::time::Duration, uniformly_slow: bool) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(UNSET - 1);
        self.delay_nanos[row].store(nanos, Ordering::Relaxed);
        self.uniformly_slow[row].store(u64::from(uniformly_slow), Ordering::Relaxed);
    }

    /// The decisions counted, the delays, the flags and the hedges won, for
    /// the rows that have any.
    pub(super) fn samples(&self, labels: &[String]) -> HedgeSamples {
        let mut decisions = Vec::new();
        for (label, columns) in labels.iter().zip(&self.decisions) {
            for (column, count) in columns.iter().enumerate() {
                let count = count.load(Ordering::Relaxed);
                if count == 0 {
                    continue;
                }
                let (outcome, reason) = match column {
                    0 => ("granted", ""),
                    n => ("denied", DenyReason::VARIANTS[n - 1].as_str()),
                };
                decisions.push((
                    vec![
                        ("upstream", label.clone()),
                        ("outcome", outcome.to_owned()),
                        ("reason", reason.to_owned()),
                    ],
                    count,
                ));
            }
        }
        let mut delays = Vec::new();
        let mut slow = Vec::new();
        for ((label, delay), flag) in labels
            .iter()
            .zip(&self.delay_nanos)
            .zip(&self.uniformly_slow)
        {
            let delay = delay.load(Ordering::Relaxed);
            if delay != UNSET {
                delays.push((vec![("upstream", label.clone())], delay as f64 / 1e9));
            }
            let flag = flag.load(Ordering::Relaxed);
            if flag != UNSET {
                slow.push((vec![("upstream", label.clone())], flag));
            }
        }
        let won = labels
            .iter()
            .zip(&self.won)
            .map(|(label, won)| (label, won.load(Ordering::Relaxed)))
            .filter(|&(_, won)| won > 0)
            .map(|(label, won)| (vec![("upstream", label.clone())], won))
            .collect();
        HedgeSamples {
            decisions,
            delays,
            uniformly_slow: slow,
            won,
        }
    }
}
