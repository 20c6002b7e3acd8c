//! Per-upstream policy: the engine's rules and the budget's parameters for
//! each upstream, resolved once from configuration so that a decision looks
//! its policy up with one hash probe and no allocation.

use std::collections::HashMap;

use crate::budget::BucketConfig;
use crate::engine::{HedgePolicy, Policy};

/// Everything configured for one upstream.
#[derive(Clone, Debug, PartialEq)]
pub struct UpstreamPolicy {
    /// The decision rules' parameters.
    pub engine: Policy,
    /// The retry budget's parameters.
    pub bucket: BucketConfig,
    /// False in shadow mode: decisions are answered as not enforced (the
    /// budget they spend and are paid into is then only a shadow of one).
    pub enforce: bool,
    /// True (the default): a traffic report funds the budget only with the
    /// share of its requests its outcomes allow (`retryd_budget::adaptive`).
    /// `adaptive = false` funds every reported request, as before.
    pub adaptive: bool,
    /// A policy evaluated beside this one, on a budget of its own.
    pub candidate: Option<Box<CandidatePolicy>>,
    /// The hedging policy, if the upstream opted in.
    pub hedging: Option<HedgePolicy>,
}

/// A candidate policy: decided on every decision of its upstream beside
/// the live one, with its own budget fed by the same reports, never
/// answered.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidatePolicy {
    /// The candidate's rules.
    pub engine: Policy,
    /// The candidate's budget.
    pub bucket: BucketConfig,
}

/// The policy of every upstream: the named ones, and the defaults for all
/// others.
#[derive(Clone, Debug, PartialEq)]
pub struct Policies {
    defaults: UpstreamPolicy,
    named: HashMap<String, UpstreamPolicy>,
}

impl Policies {
    /// Policies from the defaults and the upstreams that differ. The named
    /// upstreams' buckets are marked configured (outside the store's
    /// upstream limit), the defaults' not, whatever the caller passed.
    pub fn new(mut defaults: UpstreamPolicy, mut named: HashMap<String, UpstreamPolicy>) -> Self {
        defaults.bucket.configured = false;
        defaults.candidate = None;
        // Hedging is opted into per upstream only.
        defaults.hedging = None;
        for policy in named.values_mut() {
            policy.bucket.configured = true;
            if let Some(candidate) = &mut policy.candidate {
                candidate.bucket.configured = true;
            }
        }
        Policies { defaults, named }
    }

    /// The policy that applies to `upstream`.
    pub fn get(&self, upstream: &str) -> &UpstreamPolicy {
        self.named.get(upstream).unwrap_or(&self.defaults)
    }

    /// The policy for upstreams the configuration does not name.
    pub fn defaults(&self) -> &UpstreamPolicy {
        &self.defaults
    }

    /// The upstreams the configuration names, in no particular order.
    pub fn named(&self) -> impl Iterator<Item = (&str, &UpstreamPolicy)> {
        self.named
            .iter()
            .map(|(name, policy)| (name.as_str(), policy))
    }
}

impl Default for Policies {
    fn default() -> Self {
        Policies::new(
            UpstreamPolicy {
                engine: Policy::default(),
                bucket: BucketConfig::default(),
                enforce: true,
                adaptive: true,
                candidate: None,
                hedging: None,
            },
            HashMap::new(),
        )
    }
}
