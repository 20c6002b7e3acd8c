//! `[defaults]` and `[upstreams."name"]` validated: each upstream's policy
//! resolved once, as the defaults with only what the section names
//! overridden, into [`Policies`].
//!
//! The defaults of a policy are the engine's `Policy::default()` and the
//! budget's `BucketConfig::default()`: none is written again here.

use std::collections::HashMap;
use std::time::Duration;

use crate::budget::{BucketConfig, OnUnavailable};
use crate::engine::Policy;
use crate::policy::{
    CandidatePolicy, DEFAULT_PUSHBACK_STOP_WINDOW, DEFAULT_RAMP_WINDOW, Policies, UpstreamPolicy,
};

use super::{InvalidConfig, PolicySettings, Settings, invalid, parse_duration};

/// Every upstream's policy; `store_default` is `store.on_unavailable`, the
/// default of upstreams that do not say.
pub(super) fn policies(
    settings: &Settings,
    store_default: OnUnavailable,
) -> Result<Policies, InvalidConfig> {
    if settings.limits.max_upstreams == 0 {
        return Err(invalid("limits.max_upstreams", "must be at least 1"));
    }
    if settings.upstreams.len() > settings.limits.max_upstreams {
        return Err(invalid(
            "upstreams",
            "names more upstreams than limits.max_upstreams",
        ));
    }

    let base = UpstreamPolicy {
        engine: Policy::default(),
        bucket: BucketConfig {
            on_unavailable: store_default,
            ..BucketConfig::default()
        },
        enforce: true,
        adaptive: true,
        pushback_stop_window: DEFAULT_PUSHBACK_STOP_WINDOW,
        fleet_pushback: true,
        ramp_window: DEFAULT_RAMP_WINDOW,
        candidate: None,
    };
    if settings.defaults.candidate.is_some() {
        return Err(invalid(
            "defaults.candidate",
            "a candidate policy is set per upstream ([upstreams.\"name\".candidate]), where its divergence is measured",
        ));
    }
    let defaults = resolve_policy("defaults", &base, &settings.defaults)?;
    let mut named = HashMap::with_capacity(settings.upstreams.len());
    for (upstream, overrides) in &settings.upstreams {
        let key = format!("upstreams.{upstream:?}");
        if upstream.is_empty() || upstream.len() > 256 {
            return Err(invalid(key, "an upstream name must be 1 to 256 bytes"));
        }
        let mut policy = resolve_policy(&key, &defaults, overrides)?;
        if let Some(candidate) = &overrides.candidate {
            policy.candidate = Some(Box::new(resolve_candidate(
                &format!("{key}.candidate"),
                &policy,
                candidate,
            )?));
        }
        named.insert(upstream.clone(), policy);
    }
    Ok(Policies::new(defaults, named))
}

/// A candidate: the live policy with what `overrides` names changed.
fn resolve_candidate(
    section: &str,
    live: &UpstreamPolicy,
    overrides: &PolicySettings,
) -> Result<CandidatePolicy, InvalidConfig> {
    for (name, set) in [
        ("enforce", overrides.enforce.is_some()),
        ("candidate", overrides.candidate.is_some()),
        ("on_unavailable", overrides.on_unavailable.is_some()),
        ("adaptive", overrides.adaptive.is_some()),
        (
            "pushback_stop_window",
            overrides.pushback_stop_window.is_some(),
        ),
        ("ramp_window", overrides.ramp_window.is_some()),
        ("fleet_pushback", overrides.fleet_pushback.is_some()),
    ] {
        if set {
            return Err(invalid(
                format!("{section}.{name}"),
                "not a key of a candidate policy (a candidate is never enforced, has no store outage of its own, and is funded as the live policy is)",
            ));
        }
    }
    let resolved = resolve_policy(section, live, overrides)?;
    Ok(CandidatePolicy {
        engine: resolved.engine,
        bucket: resolved.bucket,
    })
}

/// Applies `overrides` on top of `base`, validating every value.
fn resolve_policy(
    section: &str,
    base: &UpstreamPolicy,
    overrides: &PolicySettings,
) -> Result<UpstreamPolicy, InvalidConfig> {
    let key = |name: &str| format!("{section}.{name}");
    let mut engine = base.engine.clone();
    let mut bucket = base.bucket;

    if let Some(max_attempts) = overrides.max_attempts {
        if !(1..=100).contains(&max_attempts) {
            return Err(invalid(key("max_attempts"), "must be between 1 and 100"));
        }
        engine.max_attempts = max_attempts;
    }
    if let Some(raw) = &overrides.min_attempt_budget {
        engine.min_attempt_budget = parse_duration(&key("min_attempt_budget"), raw)?;
    }
    if let Some(raw) = &overrides.max_retry_after {
        engine.max_retry_after = parse_duration(&key("max_retry_after"), raw)?;
    }
    if let Some(transient) = overrides.transient_500 {
        engine.transient_500 = transient;
    }
    if let Some(names) = &overrides.grpc_retryable_codes {
        engine.grpc_retryable = names.iter().map(|name| name.0).collect();
    }
    if let Some(names) = &overrides.permanent_failures {
        engine.permanent_failures = names.iter().map(|name| name.0).collect();
    }
    if let Some(enclosing) = overrides.inside_enclosing_retry {
        engine.inside_enclosing_retry = enclosing.into();
    }
    if let Some(on_unavailable) = overrides.on_unavailable {
        bucket.on_unavailable = on_unavailable.into();
    }
    let enforce = overrides.enforce.unwrap_or(base.enforce);
    let adaptive = overrides.adaptive.unwrap_or(base.adaptive);
    let pushback_stop_window = match &overrides.pushback_stop_window {
        Some(raw) => {
            let window = parse_duration(&key("pushback_stop_window"), raw)?;
            if window > Duration::from_secs(3600) {
                return Err(invalid(key("pushback_stop_window"), "must be at most 1h"));
            }
            window
        }
        None => base.pushback_stop_window,
    };
    let fleet_pushback = overrides.fleet_pushback.unwrap_or(base.fleet_pushback);
    let ramp_window = match &overrides.ramp_window {
        Some(raw) => {
            let window = parse_duration(&key("ramp_window"), raw)?;
            if window > Duration::from_secs(3600) {
                return Err(invalid(key("ramp_window"), "must be at most 1h"));
            }
            window
        }
        None => base.ramp_window,
    };

    let budget = &overrides.budget;
    let non_negative = |name: &str, value: Option<f64>, target: &mut f64| {
        if let Some(value) = value {
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(
                    key(&format!("budget.{name}")),
                    "must be a finite number ≥ 0",
                ));
            }
            *target = value;
        }
        Ok(())
    };
    // A bucket whose capacity shrinks keeps its initial tokens within it,
    // unless the section sets `initial` itself.
    non_negative("capacity", budget.capacity, &mut bucket.capacity)?;
    if budget.capacity.is_some() && budget.initial.is_none() {
        bucket.initial = bucket.initial.min(bucket.capacity);
    }
    non_negative("initial", budget.initial, &mut bucket.initial)?;
    non_negative("ratio", budget.ratio, &mut bucket.ratio)?;
    non_negative(
        "min_per_second",
        budget.min_per_second,
        &mut bucket.min_per_second,
    )?;
    if bucket.capacity < 1.0 {
        return Err(invalid(
            key("budget.capacity"),
            "must be at least 1 (a retry costs one token)",
        ));
    }
    if bucket.capacity > 1e9 {
        return Err(invalid(key("budget.capacity"), "must be at most 1e9"));
    }
    if bucket.initial > bucket.capacity {
        return Err(invalid(
            key("budget.initial"),
            "must not exceed budget.capacity",
        ));
    }

    let backoff = &overrides.backoff;
    if let Some(raw) = &backoff.base {
        engine.backoff.base = parse_duration(&key("backoff.base"), raw)?;
    }
    if let Some(raw) = &backoff.max {
        engine.backoff.max = parse_duration(&key("backoff.max"), raw)?;
    }
    if let Some(jitter) = backoff.jitter {
        engine.backoff.jitter = jitter.into();
    }
    if engine.backoff.base > engine.backoff.max {
        return Err(invalid(key("backoff.base"), "must not exceed backoff.max"));
    }
    Ok(UpstreamPolicy {
        engine,
        bucket,
        enforce,
        adaptive,
        pushback_stop_window,
        fleet_pushback,
        ramp_window,
        candidate: None,
    })
}
