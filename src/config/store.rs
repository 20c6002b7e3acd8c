//! `[store]` validated: which budget store runs, and the Redis store's
//! [`RedisConfig`] with every value the client would refuse only at
//! connect time refused here, so that `check-config` catches it.

#[cfg(test)]
mod tests;

use std::time::Duration;

use tokio_rustls::rustls::RootCertStore;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::budget::redis::{
    RedisAccess, RedisConfig, RedisMode, RedisPassword, RedisTls, RedisUrl, SentinelConfig,
};

use super::{
    InvalidConfig, StoreKind, StoreSettings, StoreTlsSettings, Urls, invalid, parse_duration,
};

/// Which budget store to run.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreConfig {
    /// The embedded in-memory store.
    Memory,
    /// The shared Redis store (boxed: its TLS material and credentials
    /// make it far larger than `Memory`).
    Redis(Box<RedisConfig>),
}

pub(super) fn store_config(store: &StoreSettings) -> Result<StoreConfig, InvalidConfig> {
    match store.kind {
        StoreKind::Memory => Ok(StoreConfig::Memory),
        StoreKind::Redis => Ok(StoreConfig::Redis(Box::new(redis_config(store)?))),
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
    let access = redis_access(store, &urls)?;
    Ok(RedisConfig {
        access,
        urls,
        mode: RedisMode::from(store.mode),
        timeout,
        lease_tokens: store.lease_tokens,
        max_lease_tokens: store.max_lease_tokens,
        lease_ttl,
        key_prefix: store.key_prefix.clone(),
    })
}

/// Sentinel, TLS and credentials. Files are read and certificates and keys
/// parsed here, so that a bad one fails validation, naming its key, before
/// any port is bound; no message quotes a file's content.
fn redis_access(store: &StoreSettings, urls: &[RedisUrl]) -> Result<RedisAccess, InvalidConfig> {
    let tls_urls = urls.iter().filter(|url| url.is_tls()).count();
    if tls_urls != 0 && tls_urls != urls.len() {
        return Err(invalid(
            "store.url",
            "mixes redis:// and rediss:// URLs: every node is reached alike",
        ));
    }
    let tls = match &store.tls {
        Some(_) if tls_urls == 0 => {
            return Err(invalid(
                "store.tls",
                "is set but the URLs are redis://; TLS to Redis needs rediss:// URLs",
            ));
        }
        Some(settings) => redis_tls(settings)?,
        None => RedisTls::default(),
    };
    let sentinel = match &store.sentinel {
        Some(sentinel) if sentinel.master_name.trim().is_empty() => {
            return Err(invalid("store.sentinel.master_name", "must not be empty"));
        }
        Some(sentinel) => Some(SentinelConfig {
            master_name: sentinel.master_name.clone(),
        }),
        None => None,
    };
    if store.username.as_deref().is_some_and(str::is_empty) {
        return Err(invalid("store.username", "must not be empty"));
    }
    Ok(RedisAccess {
        sentinel,
        tls,
        username: store.username.clone(),
        password: redis_password(store)?,
    })
}

fn redis_password(store: &StoreSettings) -> Result<Option<RedisPassword>, InvalidConfig> {
    let given = [
        store.password.is_some(),
        store.password_file.is_some(),
        store.password_env.is_some(),
    ];
    if given.iter().filter(|given| **given).count() > 1 {
        return Err(invalid(
            "store.password",
            "set at most one of store.password, store.password_file and store.password_env",
        ));
    }
    let (key, password) = if let Some(password) = &store.password {
        ("store.password", password.0.clone())
    } else if let Some(path) = &store.password_file {
        let text = std::fs::read_to_string(path).map_err(|error| {
            invalid(
                "store.password_file",
                format!("cannot read {path:?}: {}", error.kind()),
            )
        })?;
        // A file written by `echo` or a Secret mount may end in a newline.
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let text = text.strip_suffix('\r').unwrap_or(text);
        ("store.password_file", text.to_owned())
    } else if let Some(name) = &store.password_env {
        let Some(value) = &store.password_env_value else {
            return Err(invalid(
                "store.password_env",
                format!("the environment variable {name:?} is not set"),
            ));
        };
        ("store.password_env", value.0.clone())
    } else {
        return Ok(None);
    };
    if password.is_empty() {
        return Err(invalid(key, "the password is empty"));
    }
    Ok(Some(RedisPassword::new(password)))
}

fn redis_tls(settings: &StoreTlsSettings) -> Result<RedisTls, InvalidConfig> {
    let read = |key: &str, path: &str| {
        std::fs::read(path).map_err(|error| invalid(key, format!("cannot read {path:?}: {error}")))
    };
    let certificates = |key: &str, pem: &[u8]| {
        let chain = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| invalid(key, format!("is not a PEM certificate file: {error}")))?;
        if chain.is_empty() {
            return Err(invalid(key, "holds no PEM certificate"));
        }
        Ok(chain)
    };
    let ca_pem = match &settings.ca_file {
        Some(path) => {
            let pem = read("store.tls.ca_file", path)?;
            let mut roots = RootCertStore::empty();
            for certificate in certificates("store.tls.ca_file", &pem)? {
                roots.add(certificate).map_err(|error| {
                    invalid("store.tls.ca_file", format!("not a usable CA: {error}"))
                })?;
            }
            Some(pem)
        }
        None => None,
    };
    let client_pem = match (&settings.cert_file, &settings.key_file) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                "store.tls.key_file",
                "required with store.tls.cert_file",
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                "store.tls.cert_file",
                "required with store.tls.key_file",
            ));
        }
        (Some(cert_path), Some(key_path)) => {
            let cert_pem = read("store.tls.cert_file", cert_path)?;
            certificates("store.tls.cert_file", &cert_pem)?;
            let key_pem = read("store.tls.key_file", key_path)?;
            // The key's error never quotes the key.
            PrivateKeyDer::from_pem_slice(&key_pem)
                .map_err(|_| invalid("store.tls.key_file", "holds no PEM private key"))?;
            Some((cert_pem, key_pem))
        }
    };
    Ok(RedisTls {
        ca_pem,
        client_pem,
        insecure_skip_verify: settings.insecure_skip_verify,
    })
}
