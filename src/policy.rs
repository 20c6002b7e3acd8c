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
    /// How long a caller's negative gRPC pushback stops every caller's
    /// retries of the upstream (0: only the caller's own).
    pub pushback_stop_window: std::time::Duration,
    /// True (the default): a caller's Retry-After or pushback sets the
    /// upstream's earliest-retry time (or stop) for every caller.
    pub fleet_pushback: bool,
    /// How long the share of retries admitted grows from 0 to 1 after the
    /// upstream recovers or retries are switched back on (0: no ramp).
    pub ramp_window: std::time::Duration,
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

/// How long a negative pushback stops every caller's retries of its
/// upstream, unless the policy says: 5 s, long enough to cover the
/// backoffs of the retries already asked for around it (the default
/// backoff caps at 5 s), short enough that an upstream that sent one stray
/// negative pushback is not left without retries for long.
pub const DEFAULT_PUSHBACK_STOP_WINDOW: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a recovery ramp lasts unless the policy says: 5 s, the
/// default backoff's cap, so that the retries a recovering upstream is
/// asked to take are spread over at least as long as a caller would have
/// waited anyway, and short enough that a recovered upstream has its full
/// budget back within seconds.
pub const DEFAULT_RAMP_WINDOW: std::time::Duration = std::time::Duration::from_secs(5);

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
                pushback_stop_window: DEFAULT_PUSHBACK_STOP_WINDOW,
                fleet_pushback: true,
                ramp_window: DEFAULT_RAMP_WINDOW,
                candidate: None,
                hedging: None,
            },
            HashMap::new(),
        )
    }
}
