//! The Redis store's validated configuration: the server's `[store]` for
//! `kind = "redis"` is converted into these types, which this crate owns so
//! that the store depends on nothing of the server.

use std::fmt;
use std::time::Duration;

use super::url::RedisUrl;

/// How the Redis store behaves: which of the two store types the server
/// builds, [`super::ExactStore`] or [`super::LeasedStore`]. A store's mode
/// is its type; this value is only for choosing it, and for labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisMode {
    /// Every withdrawal is one atomic script call.
    Exact,
    /// Replicas lease small batches of tokens and spend them locally.
    Leased,
}

/// The validated `[store]` for Redis.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisConfig {
    /// One URL for a single node, several for a cluster.
    pub urls: Vec<RedisUrl>,
    /// Exact or leased: the store type to build (`connect` does not read
    /// it; the type is the mode).
    pub mode: RedisMode,
    /// Per-operation timeout.
    pub timeout: Duration,
    /// Tokens per lease, at first and at least.
    pub lease_tokens: f64,
    /// The most tokens a lease may grow to (also capped at a quarter of
    /// the bucket's capacity).
    pub max_lease_tokens: f64,
    /// Lease lifetime.
    pub lease_ttl: Duration,
    /// Key prefix.
    pub key_prefix: String,
    /// How to reach and authenticate to Redis: Sentinel, TLS, credentials.
    pub access: RedisAccess,
}

/// How to reach Redis beyond its URLs: through Sentinel, over TLS, as which
/// ACL user. The default is none of them (plain `redis://`, credentials in
/// the URL if any).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RedisAccess {
    /// Set for a primary watched by Sentinel: [`RedisConfig::urls`] are
    /// then the sentinels', and the store follows the primary they name.
    pub sentinel: Option<SentinelConfig>,
    /// TLS material, for `rediss://` URLs.
    pub tls: RedisTls,
    /// An ACL user name, overriding any in the URLs.
    pub username: Option<String>,
    /// A password, overriding any in the URLs.
    pub password: Option<RedisPassword>,
}

/// A primary watched by Sentinel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The name the sentinels monitor the primary under (`sentinel monitor
    /// <name> ...`).
    pub master_name: String,
}

/// TLS to Redis, when the URLs say `rediss://`: PEM bytes already parsed
/// once by the configuration (so a bad file fails validation, naming its
/// key, before any port is bound). `Debug` never shows the key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA certificates to trust instead of the public roots.
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate chain and its private key, for mutual TLS.
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// Accept any server certificate: for tests and emergencies only; the
    /// server warns at startup while it is set.
    pub insecure_skip_verify: bool,
}

impl fmt::Debug for RedisTls {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RedisTls")
            .field("ca", &self.ca_pem.as_ref().map(Vec::len))
            .field("client_certificate", &self.client_pem.is_some())
            .field("insecure_skip_verify", &self.insecure_skip_verify)
            .finish()
    }
}

/// A Redis password that prints as `***`; only the connection reads it,
/// through [`RedisPassword::expose`].
#[derive(Clone, PartialEq, Eq)]
pub struct RedisPassword(String);

impl RedisPassword {
    /// Wraps a password.
    pub fn new(password: impl Into<String>) -> RedisPassword {
        RedisPassword(password.into())
    }

    /// The password itself: only for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RedisPassword {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("RedisPassword(***)")
    }
}
