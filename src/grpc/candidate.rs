//! An upstream's candidate policy, decided beside the live one; the shadow
//! and candidate marks on a decision's span.
//!
//! A candidate (`[upstreams."x".candidate]`) is decided on every decision
//! of its upstream with the same facts and jitter as the live one, on a
//! budget of its own in this process's memory (fed by the same reports),
//! and never answered: it changes nothing a caller sees, and costs one more
//! engine evaluation and one more bucket operation.

use futures::FutureExt;

use super::Service;
use crate::budget::BudgetStore;
use crate::engine::{BudgetView, Decision, Facts, Verdict};
use crate::policy::CandidatePolicy;
use crate::settle::Settled;
use crate::telemetry::{Attribute, attr};

impl<S: BudgetStore> Service<S> {
    /// The candidate's decision on the live decision's facts and jitter,
    /// spending from the candidate's own budget.
    pub(super) fn decide_candidate(
        &self,
        upstream: &str,
        facts: &Facts<'_>,
        candidate: &CandidatePolicy,
    ) -> (Decision, f64) {
        let settled = Settled::hope(facts, &candidate.engine);
        let checked = self
            .inner
            .candidates
            .check(upstream, &candidate.bucket, settled.withdraw)
            .now_or_never();
        match checked {
            Some(Ok(check)) => settled.on(&check, facts, &candidate.engine),
            // The memory store answers at once, and a candidate's bucket is
            // outside its upstream limit: this does not happen. Were it to,
            // the candidate would read as denied, never the live answer.
            _ => settled.on_view(
                BudgetView {
                    tokens: 0.0,
                    retries_enabled: true,
                    unavailable: true,
                },
                facts,
                &candidate.engine,
            ),
        }
    }

    /// Switches retries on or off in `upstream`'s candidate budget.
    pub(super) fn set_candidate_enabled(
        &self,
        upstream: &str,
        candidate: &CandidatePolicy,
        enabled: bool,
    ) {
        let _ = self
            .inner
            .candidates
            .set_retries_enabled(upstream, &candidate.bucket, enabled)
            .now_or_never();
    }

    /// Pays a report's requests into `upstream`'s candidate budget.
    pub(super) fn deposit_candidate(
        &self,
        upstream: &str,
        candidate: &CandidatePolicy,
        requests: u64,
    ) {
        let _ = self
            .inner
            .candidates
            .deposit(upstream, &candidate.bucket, requests)
            .now_or_never();
    }
}

/// The shadow mark and the candidate's verdict on a decision's span.
pub(super) fn attributes(
    attributes: &mut Vec<(&'static str, Attribute)>,
    shadow: bool,
    candidate: Option<&(Decision, f64)>,
) {
    if shadow {
        attributes.push((attr::ENFORCED, Attribute::Bool(false)));
    }
    if let Some((decision, tokens)) = candidate {
        attributes.push((
            attr::CANDIDATE_VERDICT,
            Attribute::Static(decision.verdict.as_str()),
        ));
        attributes.push((
            attr::CANDIDATE_RULE,
            Attribute::Int(i64::from(decision.rule.number())),
        ));
        attributes.push((attr::CANDIDATE_TOKENS_REMAINING, Attribute::Float(*tokens)));
        if let Verdict::Deny(reason) = decision.verdict {
            attributes.push((
                attr::CANDIDATE_DENY_REASON,
                Attribute::Static(reason.as_str()),
            ));
        }
    }
}
