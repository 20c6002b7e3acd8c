//! One warning when retryd becomes unreachable and one when it answers
//! again, with what happened meanwhile as counts (as the Go client's
//! `outage.go`): a fallback decision or a traffic batch not taken is a
//! count, never a line of its own.
//!
//! It logs through `tracing` (target `retryd_client`) and knows nothing of
//! gRPC.

use std::sync::Mutex;

use tokio::time::Instant;

/// The outage state and its counts.
#[derive(Debug, Default)]
pub(crate) struct OutageLog {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    since: Option<Instant>,
    decisions: u64,
    reports: u64,
    outages: u64,
}

/// What the outage log has counted, for callers and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutageCounts {
    /// Whether retryd is believed unreachable now.
    pub unreachable: bool,
    /// Outages begun since the client was made (each warned about once).
    pub outages: u64,
    /// Decisions the local rule made in the current (or last) outage.
    pub decisions: u64,
    /// Traffic batches not taken in the current (or last) outage.
    pub reports: u64,
}

impl OutageLog {
    fn begin(state: &mut State) -> bool {
        if state.since.is_some() {
            return false;
        }
        state.since = Some(Instant::now());
        state.decisions = 0;
        state.reports = 0;
        state.outages += 1;
        true
    }

    /// A decision the local rule made because retryd did not answer.
    pub(crate) fn fallback(&self, cause: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let began = Self::begin(&mut state);
        state.decisions += 1;
        drop(state);
        if began {
            tracing::warn!(
                target: "retryd_client",
                "retryd: unreachable ({cause}); the local rule decides until it answers again (one warning per outage)"
            );
        }
    }

    /// A traffic batch retryd did not take; it is kept and re-sent.
    pub(crate) fn report_failed(&self, cause: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let began = Self::begin(&mut state);
        state.reports += 1;
        drop(state);
        if began {
            tracing::warn!(
                target: "retryd_client",
                "retryd: unreachable ({cause}); traffic counts are kept and re-sent when it answers again (one warning per outage)"
            );
        }
    }

    /// A call retryd answered: ends an outage if one was on.
    pub(crate) fn answered(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(since) = state.since.take() else {
            return;
        };
        let (decisions, reports) = (state.decisions, state.reports);
        drop(state);
        tracing::warn!(
            target: "retryd_client",
            "retryd: answering again after {:?} unreachable; meanwhile {decisions} decision(s) were made by the local rule and {reports} traffic batch(es) were not taken (kept, re-sent)",
            since.elapsed()
        );
    }

    pub(crate) fn counts(&self) -> OutageCounts {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        OutageCounts {
            unreachable: state.since.is_some(),
            outages: state.outages,
            decisions: state.decisions,
            reports: state.reports,
        }
    }
}
