//! Settling a decision on what the budget said. The pipeline decides first
//! as if the budget allowed (`hoped`), asks the store once (withdrawing a
//! token only if `hoped` is a RETRY), then settles on the answer with
//! [`Settled::settle`]: the one code for the live policy, for a candidate
//! policy and for `retryd replay`, so that all three decide alike.

use crate::budget::{BudgetCheck, StoreError};
use crate::engine::{
    self, BudgetView, Decision, DenyReason, Facts, HedgeFacts, HedgePolicy, HedgeState, Verdict,
};

/// A decision before the store call.
#[derive(Clone, Copy, Debug)]
pub struct Settled {
    /// The decision as if the budget allowed.
    pub hoped: Decision,
    /// `hoped` is a RETRY: the store call is asked to withdraw.
    pub withdraw: bool,
    /// For a hedge, what it was decided on: settled by the hedge rule, on
    /// the same facts and the fleet's state as read once.
    pub hedge: Option<Hedge>,
}

/// What a hedge is decided on, apart from the budget.
#[derive(Clone, Copy, Debug)]
pub struct Hedge {
    /// The hedge's facts (their budget is replaced by the store's view).
    pub facts: HedgeFacts,
    /// The upstream's hedging policy, if any.
    pub policy: Option<HedgePolicy>,
    /// The fleet's state over the window.
    pub state: HedgeState,
}

impl Settled {
    /// Decides `facts` (their budget is ignored) as if the budget allowed.
    pub fn hope(facts: &Facts<'_>, policy: &engine::Policy) -> Settled {
        let hoped = engine::decide(
            &Facts {
                budget: BudgetView::OPEN,
                ..*facts
            },
            policy,
        );
        Settled {
            hoped,
            withdraw: matches!(hoped.verdict, Verdict::Retry { .. }),
            hedge: None,
        }
    }

    /// Decides a hedge as if the budget allowed.
    pub fn hope_hedge(hedge: Hedge) -> Settled {
        let hoped = engine::decide_hedge(
            &HedgeFacts {
                budget: BudgetView::OPEN,
                ..hedge.facts
            },
            hedge.policy.as_ref(),
            &hedge.state,
        );
        Settled {
            hoped,
            withdraw: matches!(hoped.verdict, Verdict::Retry { .. }),
            hedge: Some(hedge),
        }
    }

    /// The decision and the tokens left, given what the store answered.
    /// An unreachable store (after any local fallback the policy allows)
    /// and a withdrawal of unknown outcome settle as unavailable: never a
    /// RETRY. Only an error that refuses the call (the upstream limit) is
    /// returned.
    pub fn settle(
        &self,
        checked: Result<BudgetCheck, StoreError>,
        facts: &Facts<'_>,
        policy: &engine::Policy,
    ) -> Result<(Decision, f64), StoreError> {
        let view = match checked {
            Ok(check) if check.withdrew => return Ok((self.hoped, check.tokens)),
            Ok(check) => BudgetView::from(&check),
            Err(StoreError::Unavailable(_)) => BudgetView::UNAVAILABLE,
            Err(refused) => return Err(refused),
        };
        // Allowed, and nothing to spend: the hoped decision stands.
        if view.allows() && !self.withdraw {
            return Ok((self.hoped, view.tokens));
        }
        // The engine decides again on what was read (pure, no I/O).
        let decision = match &self.hedge {
            Some(hedge) => engine::decide_hedge(
                &HedgeFacts {
                    budget: view,
                    ..hedge.facts
                },
                hedge.policy.as_ref(),
                &hedge.state,
            ),
            None => engine::decide(
                &Facts {
                    budget: view,
                    ..*facts
                },
                policy,
            ),
        };
        Ok(match decision.verdict {
            // The read allowed a retry but no token came with it: someone
            // else took the last one in between (leased mode's read is a
            // cached reading).
            Verdict::Retry { .. } => (
                decision.into_budget_denial(DenyReason::BudgetExhausted),
                0.0,
            ),
            _ => (decision, view.tokens),
        })
    }
}
