//! `[defaults]` and `[upstreams."name"]` validated: each upstream's policy
//! resolved once, as the defaults with only what the section names
//! overridden, into [`Policies`].
//!
//! The defaults of a policy are the engine's `Policy::default()` and the
//! budget's `BucketConfig::default()`: none is written again here.

use std::collections::HashMap;
use std::time::Duration;

use crate::budget::{BucketConfig, OnUnavailable};
use crate::engine::{HedgePolicy, Idempotencies, Idempotency, Policy};
use crate::policy::{CandidatePolicy, Policies, UpstreamPolicy};

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
        candidate: None,
        hedging: None,
    };
    if settings.defaults.hedging.is_some() {
        return Err(invalid(
            "defaults.hedging",
            "hedging is opted into per upstream ([upstreams.\"name\".hedging]): its delay and its cap are measured per upstream, and an upstream without a policy costs nothing",
        ));
    }
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
        ("hedging", overrides.hedging.is_some()),
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
    let hedging = match &overrides.hedging {
        None => base.hedging,
        Some(settings) => Some(hedging(&key("hedging"), settings)?),
    };
    let adaptive = overrides.adaptive.unwrap_or(base.adaptive);

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
        candidate: None,
        hedging,
    })
}

/// `[upstreams."name".hedging]` validated over `HedgePolicy::default()`.
fn hedging(
    section: &str,
    settings: &super::settings::HedgingSettings,
) -> Result<HedgePolicy, InvalidConfig> {
    let key = |name: &str| format!("{section}.{name}");
    let mut policy = HedgePolicy::default();
    if let Some(quantile) = settings.quantile {
        if !(quantile > 0.0 && quantile < 1.0) {
            return Err(invalid(key("quantile"), "must be above 0 and below 1"));
        }
        policy.quantile = quantile;
    }
    if let Some(max_hedges) = settings.max_hedges {
        if !(1..=4).contains(&max_hedges) {
            return Err(invalid(key("max_hedges"), "must be between 1 and 4"));
        }
        policy.max_hedges = max_hedges;
    }
    if let Some(share) = settings.max_extra_load {
        if !(share > 0.0 && share <= 1.0) {
            return Err(invalid(
                key("max_extra_load"),
                "must be above 0 and at most 1",
            ));
        }
        policy.max_extra_load = share;
    }
    if let Some(names) = &settings.idempotency {
        let mut levels = Idempotencies::default();
        for name in names {
            let level = match name.to_ascii_uppercase().as_str() {
                "SAFE" => Idempotency::Safe,
                "IDEMPOTENT" => Idempotency::Idempotent,
                "IDEMPOTENT_WITH_KEY" => Idempotency::IdempotentWithKey,
                "NON_IDEMPOTENT" => {
                    return Err(invalid(
                        key("idempotency"),
                        "NON_IDEMPOTENT is never hedged: a second copy may repeat its effect",
                    ));
                }
                _ => {
                    return Err(invalid(
                        key("idempotency"),
                        format!(
                            "{name:?} is not one of \"SAFE\", \"IDEMPOTENT\", \"IDEMPOTENT_WITH_KEY\""
                        ),
                    ));
                }
            };
            levels = levels.with(level);
        }
        if levels == Idempotencies::default() {
            return Err(invalid(
                key("idempotency"),
                "must name at least one level (remove the section to turn hedging off)",
            ));
        }
        policy.idempotency = levels;
    }
    if let Some(raw) = &settings.window {
        let window = parse_duration(&key("window"), raw)?;
        if window < Duration::from_secs(1) || window > Duration::from_secs(3_600) {
            return Err(invalid(key("window"), "must be between 1s and 1h"));
        }
        policy.window = window;
    }
    if let Some(min_samples) = settings.min_samples {
        if min_samples == 0 || min_samples > 1_000_000_000 {
            return Err(invalid(key("min_samples"), "must be between 1 and 1e9"));
        }
        policy.min_samples = min_samples;
    }
    if let Some(ratio) = settings.uniform_ratio {
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(invalid(
                key("uniform_ratio"),
                "must be above 0 and at most 1",
            ));
        }
        policy.uniform_ratio = ratio;
    }
    Ok(policy)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use crate::config::tests::{config, error_of};
    use crate::config::{Config, Settings};
    use crate::engine::{HedgePolicy, Idempotencies, Idempotency};

    #[test]
    fn hedging_is_opted_into_per_upstream_with_the_documented_defaults() {
        let config =
            config("[upstreams.pay.hedging]\n[upstreams.other]\nmax_attempts = 2\n").unwrap();
        assert_eq!(
            config.policies.get("pay").hedging,
            Some(HedgePolicy::default())
        );
        let defaults = HedgePolicy::default();
        assert_eq!(defaults.quantile, 0.95);
        assert_eq!(defaults.max_hedges, 1);
        assert_eq!(defaults.max_extra_load, 0.05);
        assert_eq!(defaults.window, Duration::from_secs(30));
        assert_eq!(defaults.min_samples, 100);
        assert_eq!(defaults.uniform_ratio, 0.8);
        assert_eq!(defaults.idempotency, Idempotencies::SAFE_AND_IDEMPOTENT);
        assert_eq!(config.policies.get("other").hedging, None);
        assert_eq!(config.policies.get("unnamed").hedging, None);
        let set = crate::config::tests::config(
            "[upstreams.pay.hedging]\nquantile = 0.99\nmax_hedges = 2\nmax_extra_load = 0.1\n\
             idempotency = [\"SAFE\", \"idempotent_with_key\"]\nwindow = \"10s\"\nmin_samples = 5\n\
             uniform_ratio = 0.5\n",
        )
        .unwrap();
        let policy = set.policies.get("pay").hedging.unwrap();
        assert_eq!(
            policy,
            HedgePolicy {
                quantile: 0.99,
                max_hedges: 2,
                max_extra_load: 0.1,
                idempotency: Idempotencies::default()
                    .with(Idempotency::Safe)
                    .with(Idempotency::IdempotentWithKey),
                window: Duration::from_secs(10),
                min_samples: 5,
                uniform_ratio: 0.5,
            }
        );
    }

    #[test]
    fn hedging_keys_are_refused_by_name() {
        for (toml, key) in [
            ("[defaults.hedging]\n", "defaults.hedging"),
            (
                "[upstreams.p.hedging]\nquantile = 1.0\n",
                "upstreams.\"p\".hedging.quantile",
            ),
            (
                "[upstreams.p.hedging]\nquantile = 0.0\n",
                "upstreams.\"p\".hedging.quantile",
            ),
            (
                "[upstreams.p.hedging]\nmax_hedges = 5\n",
                "upstreams.\"p\".hedging.max_hedges",
            ),
            (
                "[upstreams.p.hedging]\nmax_hedges = 0\n",
                "upstreams.\"p\".hedging.max_hedges",
            ),
            (
                "[upstreams.p.hedging]\nmax_extra_load = 0.0\n",
                "upstreams.\"p\".hedging.max_extra_load",
            ),
            (
                "[upstreams.p.hedging]\nmax_extra_load = 1.5\n",
                "upstreams.\"p\".hedging.max_extra_load",
            ),
            (
                "[upstreams.p.hedging]\nidempotency = [\"SAFE\", \"NON_IDEMPOTENT\"]\n",
                "upstreams.\"p\".hedging.idempotency",
            ),
            (
                "[upstreams.p.hedging]\nidempotency = [\"MAYBE\"]\n",
                "upstreams.\"p\".hedging.idempotency",
            ),
            (
                "[upstreams.p.hedging]\nidempotency = []\n",
                "upstreams.\"p\".hedging.idempotency",
            ),
            (
                "[upstreams.p.hedging]\nwindow = \"500ms\"\n",
                "upstreams.\"p\".hedging.window",
            ),
            (
                "[upstreams.p.hedging]\nmin_samples = 0\n",
                "upstreams.\"p\".hedging.min_samples",
            ),
            (
                "[upstreams.p.hedging]\nuniform_ratio = 0.0\n",
                "upstreams.\"p\".hedging.uniform_ratio",
            ),
            (
                "[upstreams.p.candidate.hedging]\n",
                "upstreams.\"p\".candidate.hedging",
            ),
        ] {
            let error = error_of(toml);
            assert!(error.starts_with(&key.to_string()), "{toml}: {error}");
        }
        assert!(
            error_of("[upstreams.p.hedging]\nidempotency = [\"NON_IDEMPOTENT\"]\n")
                .contains("never hedged")
        );
    }

    #[test]
    fn hedging_from_the_environment() {
        let environment = HashMap::from([
            (
                "RETRYD__UPSTREAMS__PAY__HEDGING__QUANTILE".to_owned(),
                "0.9".to_owned(),
            ),
            (
                "RETRYD__UPSTREAMS__PAY__HEDGING__IDEMPOTENCY".to_owned(),
                "SAFE,IDEMPOTENT_WITH_KEY".to_owned(),
            ),
        ]);
        let settings =
            Settings::from_sources("[upstreams.pay.hedging]\n", Some(environment)).unwrap();
        let config = Config::try_from(settings).unwrap();
        let policy = config.policies.get("pay").hedging.unwrap();
        assert_eq!(policy.quantile, 0.9);
        assert!(policy.idempotency.contains(Idempotency::IdempotentWithKey));
        assert!(!policy.idempotency.contains(Idempotency::Idempotent));
    }
}
