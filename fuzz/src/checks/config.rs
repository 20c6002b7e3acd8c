//! Fuzz target `config`: a TOML file loaded and validated; what passes
//! keeps every documented bound, and its policies decide without breaking
//! the engine's invariants (`decide`'s oracle).

use std::time::Duration;

use retryd::config::{Config, InvalidConfig, Settings, StoreConfig};
use retryd::grpc::validate;
use retryd_engine::{self as engine, BudgetView, Facts, Idempotency, Lineage, Policy};

use super::decide::check_decision;
use super::now;

/// The top-level sections of the configuration file.
const SECTIONS: [&str; 6] = [
    "server",
    "store",
    "telemetry",
    "limits",
    "defaults",
    "upstreams",
];

/// Fuzz target `config`: the input as a TOML file.
pub fn config(data: &[u8]) {
    check_config(&String::from_utf8_lossy(data));
}

/// Loading any text never panics; a refusal names the key at fault; what
/// is accepted keeps every documented bound, and its policies decide
/// without breaking the engine's invariants.
pub fn check_config(toml: &str) {
    let settings = match Settings::from_toml(toml) {
        Ok(settings) => settings,
        Err(error) => return check_config_error(&error),
    };
    match Config::try_from(settings) {
        Ok(config) => check_valid_config(&config),
        Err(error) => check_config_error(&error),
    }
}

fn check_config_error(error: &InvalidConfig) {
    let message = error.to_string();
    assert!(!message.is_empty());
    if let InvalidConfig::Value { key, reason } = error {
        assert!(!reason.is_empty(), "{message}");
        assert!(message.starts_with(key.as_str()), "{message}");
        // Keys with brackets are refused wherever they stand, by their own
        // name (the config crate would expand them as array indices).
        if key.contains(['[', ']']) {
            return;
        }
        let section = key.split('.').next().unwrap_or_default();
        assert!(
            SECTIONS.contains(&section),
            "key {key:?} is not in a section"
        );
        assert!(
            key == "upstreams" || key.len() > section.len() + 1,
            "key {key:?} is not a dotted path"
        );
    }
}

fn check_valid_config(config: &Config) {
    let telemetry = &config.telemetry;
    assert!((0.0..=1.0).contains(&telemetry.sampling.ratio));
    if let Some(export) = &telemetry.otlp {
        assert!(export.endpoint.starts_with("http://") || export.endpoint.starts_with("https://"));
    }
    assert!(config.max_upstreams >= 1);
    assert!(config.shutdown_grace <= Duration::from_secs(86_400));
    if let StoreConfig::Redis(redis) = &config.store {
        assert!(!redis.urls.is_empty());
        for url in &redis.urls {
            let url = url.expose_credentials();
            assert!(url.starts_with("redis://") || url.starts_with("rediss://"));
        }
        assert!(!redis.timeout.is_zero());
        assert!(redis.lease_tokens.is_finite() && redis.lease_tokens >= 1.0);
        assert!(redis.lease_ttl >= Duration::from_millis(10));
        assert!(!redis.key_prefix.is_empty() && !redis.key_prefix.contains(['{', '}']));
    }
    let named: Vec<_> = config.policies.named().collect();
    assert!(named.len() <= config.max_upstreams);
    let defaults = config.policies.defaults();
    for (name, policy) in std::iter::once(("", defaults)).chain(named) {
        assert!(name.len() <= validate::MAX_NAME_BYTES, "{name:?}");
        let engine = &policy.engine;
        let day = Duration::from_secs(86_400);
        assert!((1..=100).contains(&engine.max_attempts), "{name:?}");
        assert!(engine.min_attempt_budget <= day, "{name:?}");
        assert!(engine.max_retry_after <= day, "{name:?}");
        assert!(engine.backoff.base <= engine.backoff.max, "{name:?}");
        assert!(engine.backoff.max <= day, "{name:?}");
        let bucket = &policy.bucket;
        assert!((1.0..=1e9).contains(&bucket.capacity), "{name:?}");
        assert!(
            (0.0..=bucket.capacity).contains(&bucket.initial),
            "{name:?}"
        );
        assert!(bucket.ratio.is_finite() && bucket.ratio >= 0.0, "{name:?}");
        assert!(
            bucket.min_per_second.is_finite() && bucket.min_per_second >= 0.0,
            "{name:?}"
        );
        decide_under(engine);
    }
}

/// A handful of retryable attempts under a policy that configuration
/// accepted: the engine's invariants hold for every policy it can be given.
fn decide_under(policy: &Policy) {
    let body = engine::Body::Bytes;
    for (attempt, status, retry_after, deadline, previous) in [
        (1, Some(503), None, None, None),
        (
            1,
            Some(429),
            Some("120"),
            Some(Duration::from_secs(30)),
            None,
        ),
        (2, None, Some("1"), None, Some(Duration::from_secs(86_400))),
        (99, Some(401), None, Some(Duration::from_secs(86_400)), None),
    ] {
        let facts = Facts {
            idempotency: Idempotency::Safe,
            body: &body,
            attempt,
            claimed_evidence: None,
            failure: None,
            http_status: status,
            retry_after,
            grpc_status: None,
            grpc_pushback: None,
            deadline_remaining: deadline,
            first_byte_delivered: false,
            runtime_draining: false,
            auth_refresh_attempted: false,
            previous_backoff: previous,
            max_attempts: None,
            lineage: Lineage::EDGE,
            retried_below: None,
            budget: BudgetView {
                tokens: 10.0,
                retries_enabled: true,
                unavailable: false,
            },
            now: now(),
            jitter: 0.999_999,
        };
        check_decision(&facts, policy, &engine::decide(&facts, policy));
    }
}
