//! The configuration file as an operator writes it: serde types whose
//! every section and key is optional.
//!
//! Each default is written once. A section's keys default to its
//! `Default` impl here (`#[serde(default)]` on the struct reads it, so no
//! key has a default function besides); a policy's keys are all `Option`,
//! since an absent key inherits, and their defaults are the engine's
//! `Policy::default()` and the budget's `BucketConfig::default()`, which
//! `store.on_unavailable` takes its default from too.
//!
//! Nothing here validates beyond what serde's types say (a number is a
//! number, a name is one of its enum's, an unknown key is refused); what a
//! value means, and whether it is allowed, is the section modules'
//! business.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::budget::BucketConfig;
use crate::budget::redis::redact_url;

use super::enums::{
    ClientAuth, EnclosingRetryName, FailureKindName, GrpcCodeName, JitterName, LogFormat,
    OnUnavailableName, StoreKind, StoreMode, names_or_commas,
};

/// The configuration file as written: every section optional.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// `[server]`
    pub server: ServerSettings,
    /// `[store]`
    pub store: StoreSettings,
    /// `[telemetry]`
    pub telemetry: TelemetrySettings,
    /// `[limits]`
    pub limits: LimitSettings,
    /// `[auth]`
    pub auth: AuthSettings,
    /// `[decision_log]`
    pub decision_log: DecisionLogSettings,
    /// `[defaults]`: the policy of every upstream not named below.
    pub defaults: PolicySettings,
    /// `[upstreams."name"]`: only what differs from the defaults.
    pub upstreams: BTreeMap<String, PolicySettings>,
    /// The standard `OTEL_*` environment variables, as loading found them
    /// (never from the file): `[telemetry]` resolves them against its keys.
    #[serde(skip)]
    pub otel: BTreeMap<String, String>,
}

/// `[server]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSettings {
    /// The gRPC address.
    pub listen: String,
    /// The Prometheus `/metrics` address.
    pub metrics_listen: String,
    /// How long in-flight calls get to finish on SIGTERM.
    pub shutdown_grace: String,
    /// Listen beyond loopback without `[auth]`: refused unless this is set.
    pub allow_unauthenticated: bool,
    /// Largest request message accepted, in bytes.
    pub max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// Requests in progress per connection; more are refused with
    /// RESOURCE_EXHAUSTED rather than queued. 0 (the default) leaves the
    /// bound to `max_concurrent_streams`, which HTTP/2 enforces for free.
    pub max_concurrent_requests: usize,
    /// Longest a call may take before it is cancelled; `"0s"` (the default)
    /// sets no timer, since every store operation is already bounded by
    /// `store.timeout`.
    pub request_timeout: String,
    /// Most connections open at once (lowered to fit the process's file
    /// limit); at the bound a new connection takes the place of one that
    /// has not authenticated, or an idle one, and is closed at once only
    /// when every connection is authenticated and busy.
    pub max_connections: usize,
    /// Longest a new connection may take to finish its TLS handshake and
    /// send the HTTP/2 preface before it is closed.
    pub handshake_timeout: String,
    /// Longest a connection may go, once past its handshake, without a
    /// call that authenticated; then it is closed (only with `[auth]`).
    pub authenticate_timeout: String,
    /// Longest a connection may stay open with no call in progress.
    pub idle_timeout: String,
    /// Most connections open at once from one IP address.
    pub max_connections_per_address: usize,
    /// Longest a request message may take to arrive in full, whatever
    /// `request_timeout` says: a unary call's body from the call's start,
    /// each message of a stream from its first byte.
    pub receive_timeout: String,
    /// `[server.tls]`: TLS, and mTLS with a client CA.
    pub tls: Option<TlsSettings>,
}

/// `[server.tls]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
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

/// `[auth]`
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSettings {
    /// `[[auth.principals]]`: with at least one, every call must
    /// authenticate.
    pub principals: Vec<PrincipalSettings>,
}

/// `[[auth.principals]]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
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

impl Default for ServerSettings {
    /// The defaults of `[server]`: the only place they are written.
    fn default() -> Self {
        ServerSettings {
            listen: "127.0.0.1:50051".into(),
            metrics_listen: "127.0.0.1:9464".into(),
            shutdown_grace: "10s".into(),
            allow_unauthenticated: false,
            max_message_bytes: 64 * 1024,
            max_concurrent_streams: 128,
            max_concurrent_requests: 0,
            request_timeout: "0s".into(),
            max_connections: 10_000,
            handshake_timeout: "10s".into(),
            authenticate_timeout: "5s".into(),
            idle_timeout: "5m".into(),
            max_connections_per_address: 1000,
            receive_timeout: "10s".into(),
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
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreSettings {
    /// `memory` or `redis`.
    pub kind: StoreKind,
    /// Redis URL(s); several means Redis Cluster.
    pub url: Option<Urls>,
    /// `exact` or `leased`.
    pub mode: StoreMode,
    /// `local` or `deny`: the default for upstreams that do not say.
    pub on_unavailable: OnUnavailableName,
    /// How long a store operation may take before it counts as failed.
    pub timeout: String,
    /// Leased mode: tokens taken from Redis per lease, at first and at least.
    pub lease_tokens: f64,
    /// Leased mode: the most tokens one lease may grow to.
    pub max_lease_tokens: f64,
    /// Leased mode: how long a lease lives before unspent tokens expire.
    pub lease_ttl: String,
    /// Prefix of every Redis key, so several deployments can share a Redis.
    pub key_prefix: String,
    /// The ACL user, overriding one in the URL.
    pub username: Option<String>,
    /// The password, overriding one in the URL (better: `password_file`,
    /// `password_env` or `RETRYD__STORE__PASSWORD`, so it is not in the
    /// TOML).
    pub password: Option<Secret>,
    /// A file holding the password (a mounted Kubernetes Secret); one
    /// trailing newline is dropped.
    pub password_file: Option<String>,
    /// The name of an environment variable holding the password.
    pub password_env: Option<String>,
    /// The value of `password_env`, as loading found it (never from the
    /// file).
    #[serde(skip)]
    pub password_env_value: Option<Secret>,
    /// `[store.tls]`: the CA and client certificate for `rediss://`.
    pub tls: Option<StoreTlsSettings>,
    /// `[store.sentinel]`: the URLs are then the sentinels'.
    pub sentinel: Option<SentinelSettings>,
}

/// A secret as written: `Debug` shows `***`.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// `[store.tls]`
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreTlsSettings {
    /// PEM CA certificates to trust instead of the public roots.
    pub ca_file: Option<String>,
    /// PEM client certificate chain, for mutual TLS (with `key_file`).
    pub cert_file: Option<String>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<String>,
    /// Accept any server certificate. Insecure: tests and emergencies only;
    /// warned at startup.
    pub insecure_skip_verify: bool,
}

/// `[store.sentinel]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SentinelSettings {
    /// The name the sentinels monitor the primary under.
    pub master_name: String,
}

impl Default for StoreSettings {
    /// The defaults of `[store]`: the only place they are written, but for
    /// `on_unavailable`, which is the budget's own default.
    fn default() -> Self {
        StoreSettings {
            kind: StoreKind::Memory,
            url: None,
            mode: StoreMode::Exact,
            on_unavailable: BucketConfig::default().on_unavailable.into(),
            timeout: "20ms".into(),
            lease_tokens: 5.0,
            max_lease_tokens: 1000.0,
            lease_ttl: "2s".into(),
            key_prefix: "retryd".into(),
            username: None,
            password: None,
            password_file: None,
            password_env: None,
            password_env_value: None,
            tls: None,
            sentinel: None,
        }
    }
}

/// `[telemetry]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// OTLP collector; none (and no `OTEL_EXPORTER_OTLP_*ENDPOINT`) means
    /// no exporter runs.
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http/protobuf`.
    pub otlp_protocol: Option<String>,
    /// Headers sent with every export (an API key, a tenant).
    pub otlp_headers: BTreeMap<String, String>,
    /// A PEM file of the CA that signed the collector's certificate.
    pub otlp_ca_file: Option<String>,
    /// How long one export may take, e.g. `"10s"`.
    pub otlp_timeout: Option<String>,
    /// The resource's `service.name`.
    pub service_name: Option<String>,
    /// More resource attributes (`deployment.environment`, ...).
    pub resource_attributes: BTreeMap<String, String>,
    /// The fraction of root decisions whose spans are sampled (0 to 1); a
    /// caller's sampled flag is followed.
    pub sampling_ratio: Option<f64>,
    /// `text` or `json`.
    pub log_format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `retryd=debug`.
    pub log_level: String,
    /// Finished spans waiting for export, at most; beyond it spans are
    /// dropped (and counted) rather than slowing decisions.
    pub export_queue: usize,
}

impl Default for TelemetrySettings {
    /// The defaults of `[telemetry]`: the only place they are written
    /// (the exporter's, which `OTEL_*` may set, are in `config/otel.rs`).
    fn default() -> Self {
        TelemetrySettings {
            otlp_endpoint: None,
            otlp_protocol: None,
            otlp_headers: BTreeMap::new(),
            otlp_ca_file: None,
            otlp_timeout: None,
            service_name: None,
            resource_attributes: BTreeMap::new(),
            sampling_ratio: None,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            export_queue: 8192,
        }
    }
}

/// `[decision_log]`: every decision and report as a JSON line, for
/// `retryd replay`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecisionLogSettings {
    /// The file lines are appended to; none means no log.
    pub path: Option<String>,
    /// Lines waiting to be written, at most; beyond it lines are dropped
    /// (and counted) rather than slowing decisions.
    pub queue: usize,
    /// The most bytes the file may hold, 0 for no bound; lines that would
    /// pass it are dropped (and counted) until the file is rotated and
    /// reopened (SIGHUP).
    pub max_bytes: u64,
}

impl Default for DecisionLogSettings {
    fn default() -> Self {
        DecisionLogSettings {
            path: None,
            queue: 65_536,
            max_bytes: 0,
        }
    }
}

/// `[limits]`
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitSettings {
    /// Distinct upstreams whose budgets are tracked; beyond it, decisions
    /// for new upstreams are refused with RESOURCE_EXHAUSTED.
    pub max_upstreams: usize,
    /// How long a traffic report id is remembered, e.g. `"10m"`.
    pub report_id_window: String,
    /// Most report ids the memory store remembers at once.
    pub max_report_ids: usize,
    /// With `[auth]`, the most unconfigured upstreams one principal may
    /// hold at once; 0 = no share of its own (only `max_upstreams`).
    /// Unset: with two or more principals, an equal share of
    /// `max_upstreams` each (so that no team's flood refuses another's new
    /// upstreams); with one, none.
    pub max_upstreams_per_principal: Option<usize>,
    /// An unconfigured upstream idle this long, its bucket back at its
    /// initial tokens, is forgotten (memory store; Redis expires keys).
    pub evict_idle_after: String,
}

impl Default for LimitSettings {
    /// The defaults of `[limits]`: the only place they are written.
    fn default() -> Self {
        LimitSettings {
            max_upstreams: 10_000,
            report_id_window: "10m".into(),
            max_report_ids: 100_000,
            max_upstreams_per_principal: None,
            evict_idle_after: "60s".to_owned(),
        }
    }
}

/// A policy as written: every key optional, so an upstream names only what
/// differs from `[defaults]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicySettings {
    /// Attempts in all, the first included.
    pub max_attempts: Option<u32>,
    /// Least time an attempt needs, e.g. `"50ms"`.
    pub min_attempt_budget: Option<String>,
    /// Longest Retry-After waited for.
    pub max_retry_after: Option<String>,
    /// Whether 500 is transient for this upstream.
    pub transient_500: Option<bool>,
    /// The gRPC codes retried, e.g. `["unavailable", "internal"]`; replaces
    /// the default list.
    #[serde(default, deserialize_with = "names_or_commas")]
    pub grpc_retryable_codes: Option<Vec<GrpcCodeName>>,
    /// Extra permanent failure kinds, e.g. `["connect"]`; from the
    /// environment, comma-separated (`connect,dns`).
    #[serde(default, deserialize_with = "names_or_commas")]
    pub permanent_failures: Option<Vec<FailureKindName>>,
    /// `local` or `deny` while the shared store is unreachable.
    pub on_unavailable: Option<OnUnavailableName>,
    /// `deny` (the default) or `allow`: whether a call made inside a retry
    /// of an enclosing call may be retried too (docs/lineage.md).
    pub inside_enclosing_retry: Option<EnclosingRetryName>,
    /// False: decide and count, on a shadow budget, but tell callers the
    /// decision is not enforced.
    pub enforce: Option<bool>,
    /// False: every reported request funds the budget, whatever the
    /// reported outcomes (the adaptive budget, on by default, funds only
    /// the share the outcomes allow; README, "Adaptive budget").
    pub adaptive: Option<bool>,
    /// A policy evaluated beside this one on every decision (any of these
    /// keys, except `enforce` and `candidate`), never enforced.
    pub candidate: Option<Box<PolicySettings>>,
    /// The retry budget.
    pub budget: BudgetSettings,
    /// The backoff.
    pub backoff: BackoffSettings,
    /// Hedging (README, "Hedging"): opted into per upstream, off without
    /// the section.
    pub hedging: Option<HedgingSettings>,
}

/// `[upstreams."name".hedging]`: every key optional, the section itself
/// turns hedging on.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HedgingSettings {
    /// The first-attempt latency quantile a call must run past, in (0, 1).
    pub quantile: Option<f64>,
    /// Hedges of one call, 1 to 4.
    pub max_hedges: Option<u32>,
    /// Hedges over the window, at most this share of first attempts.
    pub max_extra_load: Option<f64>,
    /// The idempotency levels hedged, e.g. `["SAFE", "IDEMPOTENT"]`.
    #[serde(default, deserialize_with = "names_or_commas")]
    pub idempotency: Option<Vec<String>>,
    /// The sliding window, e.g. `"30s"`.
    pub window: Option<String>,
    /// Latencies needed over the window before any hedge.
    pub min_samples: Option<u64>,
    /// p50 at least this share of the quantile: uniformly slow.
    pub uniform_ratio: Option<f64>,
}

/// `budget = { ... }`
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackoffSettings {
    /// First step, e.g. `"50ms"`.
    pub base: Option<String>,
    /// Cap, e.g. `"5s"`.
    pub max: Option<String>,
    /// `full` or `decorrelated`.
    pub jitter: Option<JitterName>,
}
