//! The configuration file as an operator writes it: serde types whose
//! every section and key is optional, each with its default.
//!
//! Nothing here validates beyond what serde's types say (a number is a
//! number, an unknown key is refused); what a value means, and whether it
//! is allowed, is the section modules' business.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::budget::redis::redact_url;

use super::enums::{
    ClientAuth, FailureKindName, JitterName, LogFormat, OnUnavailableName, StoreKind, StoreMode,
};

/// The configuration file as written: every section optional.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// `[server]`
    #[serde(default)]
    pub server: ServerSettings,
    /// `[store]`
    #[serde(default)]
    pub store: StoreSettings,
    /// `[telemetry]`
    #[serde(default)]
    pub telemetry: TelemetrySettings,
    /// `[limits]`
    #[serde(default)]
    pub limits: LimitSettings,
    /// `[auth]`
    #[serde(default)]
    pub auth: AuthSettings,
    /// `[defaults]`: the policy of every upstream not named below.
    #[serde(default)]
    pub defaults: PolicySettings,
    /// `[upstreams."name"]`: only what differs from the defaults.
    #[serde(default)]
    pub upstreams: BTreeMap<String, PolicySettings>,
}

/// `[server]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// The gRPC address.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// The Prometheus `/metrics` address.
    #[serde(default = "default_metrics_listen")]
    pub metrics_listen: String,
    /// How long in-flight calls get to finish on SIGTERM.
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace: String,
    /// Listen beyond loopback without `[auth]`: refused unless this is set.
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Largest request message accepted, in bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per connection.
    #[serde(default = "default_max_concurrent_streams")]
    pub max_concurrent_streams: u32,
    /// Requests in progress per connection; more are refused with
    /// RESOURCE_EXHAUSTED rather than queued. 0 (the default) leaves the
    /// bound to `max_concurrent_streams`, which HTTP/2 enforces for free.
    #[serde(default)]
    pub max_concurrent_requests: usize,
    /// Longest a call may take before it is cancelled; `"0s"` (the default)
    /// sets no timer, since every store operation is already bounded by
    /// `store.timeout`.
    #[serde(default = "default_request_timeout")]
    pub request_timeout: String,
    /// Most connections open at once; more are closed as soon as they are
    /// accepted (and the bound is lowered to fit the process's file limit).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Longest a new connection may take to finish its TLS handshake and
    /// send the HTTP/2 preface before it is closed.
    #[serde(default = "default_handshake_timeout")]
    pub handshake_timeout: String,
    /// `[server.tls]`: TLS, and mTLS with a client CA.
    pub tls: Option<TlsSettings>,
}

/// `[server.tls]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM certificate chain of the server.
    pub cert_file: String,
    /// PEM private key of the server.
    pub key_file: String,
    /// PEM CA bundle that client certificates must chain to (mTLS).
    pub client_ca_file: Option<String>,
    /// With a client CA: `required` (default) or `optional` (callers may
    /// authenticate with an API key instead). A written `required` needs
    /// `client_ca_file`; unset, it is `required` when there is a client CA
    /// and means nothing without one (TLS without mTLS).
    #[serde(default)]
    pub client_auth: Option<ClientAuth>,
}

fn default_max_message_bytes() -> usize {
    64 * 1024
}
fn default_max_concurrent_streams() -> u32 {
    128
}
fn default_request_timeout() -> String {
    "0s".into()
}
fn default_max_connections() -> usize {
    10_000
}
fn default_handshake_timeout() -> String {
    "10s".into()
}

/// `[auth]`
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSettings {
    /// `[[auth.principals]]`: with at least one, every call must
    /// authenticate.
    #[serde(default)]
    pub principals: Vec<PrincipalSettings>,
}

/// `[[auth.principals]]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalSettings {
    /// Name, for logs and audit.
    pub name: String,
    /// SHA-256 (hex) of each API key it may present (`retryd hash-key`).
    #[serde(default)]
    pub api_keys_sha256: Vec<String>,
    /// mTLS certificate identities (DNS/URI SAN or CN) it may present.
    #[serde(default)]
    pub identities: Vec<String>,
    /// Upstream patterns it may decide and report for (`*` wildcards).
    #[serde(default)]
    pub upstreams: Vec<String>,
    /// Whether it may call RetryAdmin.
    #[serde(default)]
    pub admin: bool,
}

fn default_listen() -> String {
    "127.0.0.1:50051".into()
}
fn default_metrics_listen() -> String {
    "127.0.0.1:9464".into()
}
fn default_shutdown_grace() -> String {
    "10s".into()
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            listen: default_listen(),
            metrics_listen: default_metrics_listen(),
            shutdown_grace: default_shutdown_grace(),
            allow_unauthenticated: false,
            max_message_bytes: default_max_message_bytes(),
            max_concurrent_streams: default_max_concurrent_streams(),
            max_concurrent_requests: 0,
            request_timeout: default_request_timeout(),
            max_connections: default_max_connections(),
            handshake_timeout: default_handshake_timeout(),
            tls: None,
        }
    }
}

/// One URL or several (Redis Cluster nodes), as written. `Debug` redacts
/// credentials, like [`RedisUrl`]'s.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Urls {
    /// `url = "redis://127.0.0.1:6379"`
    One(String),
    /// `url = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]`
    Many(Vec<String>),
}

impl fmt::Debug for Urls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Urls::One(url) => f.debug_tuple("One").field(&redact_url(url)).finish(),
            Urls::Many(urls) => f
                .debug_tuple("Many")
                .field(&urls.iter().map(|url| redact_url(url)).collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// `[store]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSettings {
    /// `memory` or `redis`.
    #[serde(default = "default_store_kind")]
    pub kind: StoreKind,
    /// Redis URL(s); several means Redis Cluster.
    pub url: Option<Urls>,
    /// `exact` or `leased`.
    #[serde(default = "default_store_mode")]
    pub mode: StoreMode,
    /// `local` or `deny`: the default for upstreams that do not say.
    #[serde(default = "default_on_unavailable")]
    pub on_unavailable: OnUnavailableName,
    /// How long a store operation may take before it counts as failed.
    #[serde(default = "default_store_timeout")]
    pub timeout: String,
    /// Leased mode: tokens taken from Redis per lease, at first and at least.
    #[serde(default = "default_lease_tokens")]
    pub lease_tokens: f64,
    /// Leased mode: the most tokens one lease may grow to.
    #[serde(default = "default_max_lease_tokens")]
    pub max_lease_tokens: f64,
    /// Leased mode: how long a lease lives before unspent tokens expire.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: String,
    /// Prefix of every Redis key, so several deployments can share a Redis.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
}

fn default_store_kind() -> StoreKind {
    StoreKind::Memory
}
fn default_store_mode() -> StoreMode {
    StoreMode::Exact
}
fn default_on_unavailable() -> OnUnavailableName {
    OnUnavailableName::Local
}
fn default_store_timeout() -> String {
    "20ms".into()
}
fn default_lease_tokens() -> f64 {
    5.0
}
fn default_max_lease_tokens() -> f64 {
    1000.0
}
fn default_lease_ttl() -> String {
    "2s".into()
}
fn default_key_prefix() -> String {
    "retryd".into()
}

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            kind: default_store_kind(),
            url: None,
            mode: default_store_mode(),
            on_unavailable: default_on_unavailable(),
            timeout: default_store_timeout(),
            lease_tokens: default_lease_tokens(),
            max_lease_tokens: default_max_lease_tokens(),
            lease_ttl: default_lease_ttl(),
            key_prefix: default_key_prefix(),
        }
    }
}

/// `[telemetry]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    /// OTLP/gRPC collector; none means no exporter runs.
    pub otlp_endpoint: Option<String>,
    /// The fraction of decisions whose spans are sampled (0 to 1).
    #[serde(default = "default_sampling_ratio")]
    pub sampling_ratio: f64,
    /// `text` or `json`.
    #[serde(default = "default_log_format")]
    pub log_format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `retryd=debug`.
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Finished spans waiting for export, at most; beyond it spans are
    /// dropped (and counted) rather than slowing decisions.
    #[serde(default = "default_export_queue")]
    pub export_queue: usize,
}

fn default_export_queue() -> usize {
    8192
}

fn default_sampling_ratio() -> f64 {
    1.0
}
fn default_log_format() -> LogFormat {
    LogFormat::Text
}
fn default_log_level() -> String {
    "info".into()
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        TelemetrySettings {
            otlp_endpoint: None,
            sampling_ratio: default_sampling_ratio(),
            log_format: default_log_format(),
            log_level: default_log_level(),
            export_queue: default_export_queue(),
        }
    }
}

/// `[limits]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    /// Distinct upstreams whose budgets are tracked; beyond it, decisions
    /// for new upstreams are refused with RESOURCE_EXHAUSTED.
    #[serde(default = "default_max_upstreams")]
    pub max_upstreams: usize,
}

fn default_max_upstreams() -> usize {
    10_000
}

impl Default for LimitSettings {
    fn default() -> Self {
        LimitSettings {
            max_upstreams: default_max_upstreams(),
        }
    }
}

/// A policy as written: every key optional, so an upstream names only what
/// differs from `[defaults]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySettings {
    /// Attempts in all, the first included.
    pub max_attempts: Option<u32>,
    /// Least time an attempt needs, e.g. `"50ms"`.
    pub min_attempt_budget: Option<String>,
    /// Longest Retry-After waited for.
    pub max_retry_after: Option<String>,
    /// Whether 500 is transient for this upstream.
    pub transient_500: Option<bool>,
    /// Extra permanent failure kinds, e.g. `["connect"]`.
    pub permanent_failures: Option<Vec<FailureKindName>>,
    /// `local` or `deny` while the shared store is unreachable.
    pub on_unavailable: Option<OnUnavailableName>,
    /// The retry budget.
    #[serde(default)]
    pub budget: BudgetSettings,
    /// The backoff.
    #[serde(default)]
    pub backoff: BackoffSettings,
}

/// `budget = { ... }`
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSettings {
    /// Most tokens held.
    pub capacity: Option<f64>,
    /// Tokens at creation.
    pub initial: Option<f64>,
    /// Tokens per reported real request.
    pub ratio: Option<f64>,
    /// Tokens per second regardless of traffic.
    pub min_per_second: Option<f64>,
}

/// `backoff = { ... }`
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffSettings {
    /// First step, e.g. `"50ms"`.
    pub base: Option<String>,
    /// Cap, e.g. `"5s"`.
    pub max: Option<String>,
    /// `full` or `decorrelated`.
    pub jitter: Option<JitterName>,
}
