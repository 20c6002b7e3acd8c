//! The Redis store's validated configuration: the server's `[store]` for
//! `kind = "redis"` is converted into these types, which this crate owns so
//! that the store depends on nothing of the server.

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
}
