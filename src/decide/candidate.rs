//! Candidate policies, decided beside the live one.
//!
//! A candidate (`[upstreams."x".candidate]`) is decided on every decision
//! of its upstream with the same facts and draw as the live one, on a
//! budget of its own in this process's memory (fed by the same reports and
//! switched by the same kill switch), and never answered: it changes
//! nothing a caller sees, and costs one more engine evaluation and one more
//! bucket operation.

use futures::FutureExt;

use super::Settled;
use crate::budget::{BudgetStore, MemoryBudgetStore, StoreError};
use crate::engine::{Decision, Facts};
use crate::policy::CandidatePolicy;

/// The candidates' budgets, in memory (a candidate needs the memory store:
/// `config` refuses one on Redis), outside any upstream limit. Empty
/// without a candidate.
#[derive(Debug)]
pub(crate) struct Candidates {
    budgets: MemoryBudgetStore,
}

impl Candidates {
    pub(crate) fn new() -> Candidates {
        Candidates {
            budgets: MemoryBudgetStore::new(usize::MAX),
        }
    }

    /// The candidate's decision and tokens left on the live decision's
    /// facts and draw, spending from the candidate's own budget.
    pub(crate) fn decide(
        &self,
        upstream: &str,
        facts: &Facts<'_>,
        candidate: &CandidatePolicy,
    ) -> (Decision, f64) {
        let settled = Settled::hope(facts, &candidate.engine);
        // The memory store answers at once and a candidate's bucket is
        // outside the upstream limit, so neither error happens; were one to,
        // the candidate would read as denied, never as the live answer.
        let checked = self
            .budgets
            .check(upstream, &candidate.bucket, settled.withdraw)
            .now_or_never()
            .unwrap_or_else(|| Err(unanswered()))
            .map_err(|error| StoreError::Unavailable(error.to_string().into()));
        settled
            .settle(checked, facts, &candidate.engine)
            .unwrap_or((
                settled
                    .hoped
                    .into_budget_denial(crate::engine::DenyReason::BudgetUnavailable),
                0.0,
            ))
    }

    /// Switches retries on or off in `upstream`'s candidate budget.
    pub(crate) fn set_enabled(&self, upstream: &str, candidate: &CandidatePolicy, enabled: bool) {
        let _ = self
            .budgets
            .set_retries_enabled(upstream, &candidate.bucket, enabled)
            .now_or_never();
    }

    /// Pays a report's requests into `upstream`'s candidate budget.
    pub(crate) fn deposit(&self, upstream: &str, candidate: &CandidatePolicy, requests: u64) {
        let _ = self
            .budgets
            .deposit(upstream, &candidate.bucket, requests)
            .now_or_never();
    }
}

fn unanswered() -> StoreError {
    StoreError::Unavailable("the candidates' memory store did not answer at once".into())
}
