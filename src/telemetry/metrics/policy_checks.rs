//! Counters of shadow and candidate decisions (`enforce = false`, and
//! `[upstreams."x".candidate]`), by upstream label: what an operator reads
//! before enforcing a shadow upstream or promoting a candidate ("with ratio
//! 0.05, how many of today's granted retries would have been budget
//! denials"). Bounded: upstream labels are the configured ones (a
//! candidate exists only for those), verdicts three, outcomes the
//! decision counters' columns.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{OUTCOMES, outcome_index, outcome_labels};
use crate::engine::{Decision, Verdict};

/// Counter of decisions answered as not enforced, by upstream.
pub const METRIC_SHADOW_DECISIONS: &str = "retryd_shadow_decisions_total";
/// Counter of decisions by upstream, live verdict, candidate verdict and
/// candidate deny reason.
pub const METRIC_CANDIDATE_DECISIONS: &str = "retryd_candidate_decisions_total";

/// The live verdicts, as a column index.
const LIVE_VERDICTS: [&str; 3] = ["retry", "deny", "ambiguous"];

fn live_index(verdict: &Verdict) -> usize {
    match verdict {
        Verdict::Retry { .. } => 0,
        Verdict::Deny(_) => 1,
        Verdict::Ambiguous => 2,
    }
}

/// Per upstream label: shadow decisions, and candidate outcomes by live
/// verdict.
#[derive(Debug)]
pub(super) struct PolicyChecks {
    shadow: Vec<AtomicU64>,
    candidate: Vec<[[AtomicU64; OUTCOMES]; 3]>,
}

impl PolicyChecks {
    pub(super) fn new(rows: usize) -> PolicyChecks {
        PolicyChecks {
            shadow: (0..rows).map(|_| AtomicU64::new(0)).collect(),
            candidate: (0..rows).map(|_| Default::default()).collect(),
        }
    }

    pub(super) fn record(
        &self,
        row: usize,
        live: &Decision,
        candidate: Option<&Decision>,
        shadow: bool,
    ) {
        if shadow {
            self.shadow[row].fetch_add(1, Ordering::Relaxed);
        }
        if let Some(candidate) = candidate {
            self.candidate[row][live_index(&live.verdict)][outcome_index(&candidate.verdict)]
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The series that counted something (most upstreams have neither a
    /// shadow policy nor a candidate): shadow decisions by upstream, then
    /// candidate outcomes by (upstream, live, candidate, reason).
    #[allow(clippy::type_complexity)]
    pub(super) fn samples(
        &self,
        labels: &[String],
    ) -> (
        Vec<(Vec<(&'static str, String)>, u64)>,
        Vec<(Vec<(&'static str, String)>, u64)>,
    ) {
        let mut shadow = Vec::new();
        for (label, count) in labels.iter().zip(&self.shadow) {
            let count = count.load(Ordering::Relaxed);
            if count > 0 {
                shadow.push((vec![("upstream", label.clone())], count));
            }
        }
        let mut candidate = Vec::new();
        for (label, by_live) in labels.iter().zip(&self.candidate) {
            for (live, outcomes) in LIVE_VERDICTS.iter().zip(by_live) {
                for (index, count) in outcomes.iter().enumerate() {
                    let count = count.load(Ordering::Relaxed);
                    if count == 0 {
                        continue;
                    }
                    let (verdict, reason) = outcome_labels(index);
                    candidate.push((
                        vec![
                            ("upstream", label.clone()),
                            ("live", (*live).to_owned()),
                            ("candidate", verdict.to_owned()),
                            ("reason", reason.to_owned()),
                        ],
                        count,
                    ));
                }
            }
        }
        (shadow, candidate)
    }
}
