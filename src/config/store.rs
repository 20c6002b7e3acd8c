//! `[store]` validated: which budget store runs, and the Redis store's
//! [`RedisConfig`] with every value the client would refuse only at
//! connect time refused here, so that `check-config` catches it.

use std::time::Duration;

use crate::budget::redis::{RedisConfig, RedisMode, RedisUrl};

use super::{InvalidConfig, StoreKind, StoreSettings, Urls, invalid, parse_duration};

/// Which budget store to run.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreConfig {
    /// The embedded in-memory store.
    Memory,
    /// The shared Redis store.
    Redis(RedisConfig),
}

pub(super) fn store_config(store: &StoreSettings) -> Result<StoreConfig, InvalidConfig> {
    match store.kind {
        StoreKind::Memory => Ok(StoreConfig::Memory),
        StoreKind::Redis => Ok(StoreConfig::Redis(redis_config(store)?)),
    }
}

fn redis_config(store: &StoreSettings) -> Result<RedisConfig, InvalidConfig> {
    let urls = match &store.url {
        None => {
            return Err(invalid(
                "store.url",
                "required when store.kind is \"redis\"",
            ));
        }
        Some(Urls::One(url)) => vec![url.clone()],
        Some(Urls::Many(urls)) => urls.clone(),
    };
    if urls.is_empty() {
        return Err(invalid("store.url", "names no Redis node"));
    }
    // What the client would refuse only at connect time is refused here,
    // so that check-config catches it.
    let urls = urls
        .iter()
        .map(|url| RedisUrl::parse(url).map_err(|reason| invalid("store.url", reason)))
        .collect::<Result<Vec<_>, _>>()?;
    let timeout = parse_duration("store.timeout", &store.timeout)?;
    if timeout.is_zero() {
        return Err(invalid("store.timeout", "must be above zero"));
    }
    if !(store.lease_tokens >= 1.0 && store.lease_tokens.is_finite()) {
        return Err(invalid("store.lease_tokens", "must be at least 1"));
    }
    if !(store.max_lease_tokens >= store.lease_tokens && store.max_lease_tokens.is_finite()) {
        return Err(invalid(
            "store.max_lease_tokens",
            format!(
                "must be finite and at least store.lease_tokens ({})",
                store.lease_tokens
            ),
        ));
    }
    let lease_ttl = parse_duration("store.lease_ttl", &store.lease_ttl)?;
    if lease_ttl < Duration::from_millis(10) {
        return Err(invalid("store.lease_ttl", "must be at least 10ms"));
    }
    if store.key_prefix.is_empty() || store.key_prefix.contains(['{', '}']) {
        return Err(invalid(
            "store.key_prefix",
            "must be non-empty and contain no braces",
        ));
    }
    Ok(RedisConfig {
        urls,
        mode: RedisMode::from(store.mode),
        timeout,
        lease_tokens: store.lease_tokens,
        max_lease_tokens: store.max_lease_tokens,
        lease_ttl,
        key_prefix: store.key_prefix.clone(),
    })
}
