//! Configuration: built-in defaults, then an optional TOML file, then
//! `RETRYD__SECTION__KEY` environment variables, deserialized into
//! [`Settings`] and converted with `TryFrom` into the typed, validated
//! [`Config`] the service runs on.
//!
//! This is the only module that reads the environment, and every bad value
//! is refused here, naming its key, before any port is bound. Tests build
//! settings from strings and explicit variable maps, never by mutating the
//! process environment.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::auth::{Auth, Pattern, Principal};
use crate::budget::redis::{RedisConfig, RedisMode, RedisUrl, redact_url};
use crate::budget::{BucketConfig, OnUnavailable};
use crate::engine::{FailureKind, Jitter, Policy};
use crate::policy::{Policies, UpstreamPolicy};

/// The prefix of environment overrides: `RETRYD__STORE__KIND=redis`.
pub const ENV_PREFIX: &str = "RETRYD";

/// A configuration that cannot be used, naming the key at fault.
///
/// Its messages are shown to operators (stderr, logs, `ReloadConfig`'s
/// status), so none of them quotes a line of the file or a credential in a
/// URL: a `store.url` often carries the Redis password.
#[derive(Debug, thiserror::Error)]
pub enum InvalidConfig {
    /// The file or the environment could not be read or parsed. The message
    /// is the config crate's, with URL credentials redacted; the error
    /// itself is not kept as a source, because printing the chain (as
    /// `anyhow`'s `{:#}` does) would show them again.
    #[error("cannot load configuration: {0}")]
    Load(String),
    /// The file is not TOML. The line is not quoted, since it may hold a
    /// secret; the position and the key, when the line names one, say
    /// where.
    #[error(
        "{}TOML syntax error at line {line}, column {column}: {message}",
        key.as_ref().map(|key| format!("{key}: ")).unwrap_or_default()
    )]
    Syntax {
        /// The dotted key on the offending line (or its table), if any.
        key: Option<String>,
        /// 1-based line.
        line: usize,
        /// 1-based column, in characters.
        column: usize,
        /// What the TOML parser expected.
        message: String,
    },
    /// A key holds a value that is not allowed.
    #[error("{key}: {reason}")]
    Value {
        /// The dotted key, e.g. `defaults.backoff.base`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> InvalidConfig {
    InvalidConfig::Value {
        key: key.into(),
        reason: reason.into(),
    }
}

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
    pub client_auth: Option<String>,
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
    pub kind: String,
    /// Redis URL(s); several means Redis Cluster.
    pub url: Option<Urls>,
    /// `exact` or `leased`.
    #[serde(default = "default_store_mode")]
    pub mode: String,
    /// `local` or `deny`: the default for upstreams that do not say.
    #[serde(default = "default_on_unavailable")]
    pub on_unavailable: String,
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

fn default_store_kind() -> String {
    "memory".into()
}
fn default_store_mode() -> String {
    "exact".into()
}
fn default_on_unavailable() -> String {
    "local".into()
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
    pub log_format: String,
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
fn default_log_format() -> String {
    "text".into()
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
    pub permanent_failures: Option<Vec<String>>,
    /// `local` or `deny` while the shared store is unreachable.
    pub on_unavailable: Option<String>,
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
    pub jitter: Option<String>,
}

impl Settings {
    /// Loads settings from an optional TOML file and the process
    /// environment. Only `main` should call this.
    pub fn load(path: Option<&Path>) -> Result<Settings, InvalidConfig> {
        let toml = match path {
            Some(path) => std::fs::read_to_string(path).map_err(|err| {
                invalid(path.display().to_string(), format!("cannot read: {err}"))
            })?,
            None => String::new(),
        };
        Settings::from_sources(&toml, None)
    }

    /// Settings from TOML text and, if given, an explicit map of environment
    /// variables (`None` reads the process environment).
    pub fn from_sources(
        toml: &str,
        environment: Option<HashMap<String, String>>,
    ) -> Result<Settings, InvalidConfig> {
        // The config crate reads `a[3]` in a key as an array index and
        // allocates up to it, so a key like `"x[200000000000]"` aborts the
        // process (found by fuzzing). No retryd key has brackets: refuse
        // them, by name, before the config crate sees them.
        // Text that is not TOML is refused here too: the TOML parser's own
        // message quotes the offending line, which may be a `store.url`
        // with its password, so it is placed by line, column and key
        // instead.
        let table = toml
            .parse::<toml::Table>()
            .map_err(|error| syntax_error(toml, &error))?;
        refuse_bracketed_keys("", &table)?;
        let process_environment;
        let variables = match &environment {
            Some(map) => map,
            None => {
                process_environment = std::env::vars().collect::<HashMap<_, _>>();
                &process_environment
            }
        };
        if let Some(name) = variables
            .keys()
            .find(|name| name.starts_with(ENV_PREFIX) && name.contains(['[', ']']))
        {
            return Err(invalid(
                name.clone(),
                "variable names may not contain '[' or ']'",
            ));
        }
        let builder = config::Config::builder()
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix(ENV_PREFIX)
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    .source(environment),
            );
        builder
            .build()
            .and_then(|merged| merged.try_deserialize())
            // Serde quotes a value of the wrong type, which may be a URL
            // with credentials (a `RETRYD__` variable set to the wrong key).
            .map_err(|error| InvalidConfig::Load(redact_urls_in(&error.to_string())))
    }

    /// Settings from TOML text alone, for tests and `check-config`.
    pub fn from_toml(toml: &str) -> Result<Settings, InvalidConfig> {
        Settings::from_sources(toml, Some(HashMap::new()))
    }
}

fn refuse_bracketed_keys(prefix: &str, table: &toml::Table) -> Result<(), InvalidConfig> {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        if key.contains(['[', ']']) {
            return Err(invalid(
                path,
                "keys (and upstream names) may not contain '[' or ']'",
            ));
        }
        match value {
            toml::Value::Table(inner) => refuse_bracketed_keys(&path, inner)?,
            toml::Value::Array(items) => {
                for item in items {
                    if let toml::Value::Table(inner) = item {
                        refuse_bracketed_keys(&path, inner)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Which budget store to run.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreConfig {
    /// The embedded in-memory store.
    Memory,
    /// The shared Redis store.
    Redis(RedisConfig),
}

/// `text` (an error message) with every URL in it redacted. A URL inside a
/// quoted string (`string "redis://…"`, as serde quotes values) runs to the
/// closing quote; elsewhere, to the next whitespace.
fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(separator) = rest.find("://") {
        let scheme_start = rest[..separator]
            .char_indices()
            .rev()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |(at, c)| at + c.len_utf8());
        let quoted = rest[..scheme_start].ends_with('"');
        let after = &rest[separator..];
        let length = if quoted {
            // To the first quote not escaped by a backslash.
            let mut escaped = false;
            after
                .char_indices()
                .find(|&(_, c)| {
                    let end = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .map_or(after.len(), |(at, _)| at)
        } else {
            after.find(char::is_whitespace).unwrap_or(after.len())
        };
        let url_end = separator + length;
        out.push_str(&rest[..scheme_start]);
        out.push_str(&redact_url(&rest[scheme_start..url_end]));
        rest = &rest[url_end..];
    }
    out.push_str(rest);
    out
}

/// A TOML syntax error, placed by line and column and, when the line (or
/// the table it is in) names a key, by key; the line itself is not quoted.
fn syntax_error(toml: &str, error: &toml::de::Error) -> InvalidConfig {
    let start = error.span().map_or(0, |span| span.start).min(toml.len());
    let before = toml.get(..start).unwrap_or(toml);
    let line_index = before.matches('\n').count();
    let line_start = before.rfind('\n').map_or(0, |at| at + 1);
    let column = before[line_start..].chars().count() + 1;
    let lines: Vec<&str> = toml.lines().collect();
    // Only text made of key characters is shown: never a URL or a value.
    let is_key = |text: &str| {
        !text.is_empty()
            && text.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '"' | '\'' | ' ')
            })
    };
    let table = lines
        .get(..=line_index.min(lines.len().saturating_sub(1)))
        .unwrap_or_default()
        .iter()
        .rev()
        .find_map(|line| {
            let header = line.split('#').next().unwrap_or_default().trim();
            let inner = header.strip_prefix('[')?.strip_suffix(']')?;
            let inner = inner.trim_start_matches('[').trim_end_matches(']').trim();
            is_key(inner).then_some(inner)
        });
    let key = lines
        .get(line_index)
        .and_then(|line| line.split_once('='))
        .map(|(key, _)| key.trim())
        .filter(|key| is_key(key));
    let key = match (table, key) {
        (Some(table), Some(key)) => Some(format!("{table}.{key}")),
        (table, key) => table.or(key).map(str::to_owned),
    };
    InvalidConfig::Syntax {
        key,
        line: line_index + 1,
        column,
        message: redact_urls_in(error.message().trim()),
    }
}

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The validated `[telemetry]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryConfig {
    /// OTLP/gRPC endpoint, if any.
    pub otlp_endpoint: Option<String>,
    /// Sampling ratio in 0..=1.
    pub sampling_ratio: f64,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_level: String,
    /// Span export queue capacity.
    pub export_queue: usize,
}

/// The validated `[server.tls]`, files read. Its `Debug` leaves the private
/// key out, so that no log line or panic message can carry it.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert_pem: Vec<u8>,
    /// PEM private key.
    pub key_pem: Vec<u8>,
    /// PEM client CA bundle, for mTLS.
    pub client_ca_pem: Option<Vec<u8>>,
    /// Whether a client certificate may be absent (mTLS optional).
    pub client_auth_optional: bool,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &format_args!("<redacted>"))
            .field(
                "client_ca_pem",
                &self.client_ca_pem.as_ref().map(|pem| pem.len()),
            )
            .field("client_auth_optional", &self.client_auth_optional)
            .finish()
    }
}

/// Transport limits of the gRPC server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request message, bytes.
    pub max_message_bytes: usize,
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// Requests in progress per connection, if limited.
    pub max_concurrent_requests: Option<usize>,
    /// Per-call time limit, if any.
    pub request_timeout: Option<Duration>,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Time a connection has for its TLS handshake and HTTP/2 preface.
    pub handshake_timeout: Duration,
}

/// The validated configuration the service runs on.
#[derive(Clone, Debug)]
pub struct Config {
    /// gRPC address.
    pub listen: SocketAddr,
    /// Prometheus address.
    pub metrics_listen: SocketAddr,
    /// Time allowed for in-flight calls on shutdown.
    pub shutdown_grace: Duration,
    /// TLS of the gRPC port, if any.
    pub tls: Option<TlsConfig>,
    /// Transport limits.
    pub server_limits: ServerLimits,
    /// Who may call, and what for.
    pub auth: Auth,
    /// The budget store.
    pub store: StoreConfig,
    /// Telemetry.
    pub telemetry: TelemetryConfig,
    /// Most distinct upstreams tracked.
    pub max_upstreams: usize,
    /// Per-upstream policies.
    pub policies: Policies,
}

impl TryFrom<Settings> for Config {
    type Error = InvalidConfig;

    fn try_from(settings: Settings) -> Result<Config, InvalidConfig> {
        let listen = parse_addr("server.listen", &settings.server.listen)?;
        let metrics_listen = parse_addr("server.metrics_listen", &settings.server.metrics_listen)?;
        let shutdown_grace =
            parse_duration("server.shutdown_grace", &settings.server.shutdown_grace)?;
        let tls = settings.server.tls.as_ref().map(tls_config).transpose()?;
        let server_limits = server_limits(&settings.server)?;
        let auth = auth(&settings.auth)?;
        // Without authentication, anyone who can reach the port can drain
        // budgets and switch retries off: only loopback, unless insisted.
        if !listen.ip().is_loopback()
            && !auth.is_enabled()
            && !settings.server.allow_unauthenticated
        {
            return Err(invalid(
                "server.listen",
                format!(
                    "{listen} is not a loopback address and [auth] names no principal; configure [auth] or set server.allow_unauthenticated = true"
                ),
            ));
        }

        let store = match settings.store.kind.as_str() {
            "memory" => StoreConfig::Memory,
            "redis" => StoreConfig::Redis(redis_config(&settings.store)?),
            other => {
                return Err(invalid(
                    "store.kind",
                    format!("must be \"memory\" or \"redis\", not {other:?}"),
                ));
            }
        };
        let store_default =
            parse_on_unavailable("store.on_unavailable", &settings.store.on_unavailable)?;

        let telemetry = &settings.telemetry;
        if !(0.0..=1.0).contains(&telemetry.sampling_ratio) {
            return Err(invalid(
                "telemetry.sampling_ratio",
                "must be between 0 and 1",
            ));
        }
        let log_format = match telemetry.log_format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(invalid(
                    "telemetry.log_format",
                    format!("must be \"text\" or \"json\", not {other:?}"),
                ));
            }
        };
        if let Some(endpoint) = &telemetry.otlp_endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    "must be an http:// or https:// URL",
                ));
            }
        }
        let telemetry = TelemetryConfig {
            otlp_endpoint: telemetry.otlp_endpoint.clone(),
            sampling_ratio: telemetry.sampling_ratio,
            log_format,
            log_level: telemetry.log_level.clone(),
            export_queue: telemetry.export_queue,
        };
        if !(1..=1_000_000).contains(&telemetry.export_queue) {
            return Err(invalid(
                "telemetry.export_queue",
                "must be between 1 and 1000000",
            ));
        }

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
        };
        let defaults = resolve_policy("defaults", &base, &settings.defaults)?;
        let mut named = HashMap::with_capacity(settings.upstreams.len());
        for (upstream, overrides) in &settings.upstreams {
            let key = format!("upstreams.{upstream:?}");
            if upstream.is_empty() || upstream.len() > 256 {
                return Err(invalid(key, "an upstream name must be 1 to 256 bytes"));
            }
            named.insert(
                upstream.clone(),
                resolve_policy(&key, &defaults, overrides)?,
            );
        }

        Ok(Config {
            listen,
            metrics_listen,
            shutdown_grace,
            tls,
            server_limits,
            auth,
            store,
            telemetry,
            max_upstreams: settings.limits.max_upstreams,
            policies: Policies::new(defaults, named),
        })
    }
}

impl Config {
    /// Loads and validates: what `serve` and `check-config` run.
    pub fn load(path: Option<&Path>) -> Result<Config, InvalidConfig> {
        Config::try_from(Settings::load(path)?)
    }
}

fn tls_config(tls: &TlsSettings) -> Result<TlsConfig, InvalidConfig> {
    let read = |key: &str, path: &str| {
        std::fs::read(path).map_err(|err| invalid(key, format!("cannot read {path:?}: {err}")))
    };
    let cert_pem = read("server.tls.cert_file", &tls.cert_file)?;
    let key_pem = read("server.tls.key_file", &tls.key_file)?;
    let client_ca_pem = tls
        .client_ca_file
        .as_deref()
        .map(|path| read("server.tls.client_ca_file", path))
        .transpose()?;
    for (key, pem) in [
        ("server.tls.cert_file", Some(&cert_pem)),
        ("server.tls.key_file", Some(&key_pem)),
        ("server.tls.client_ca_file", client_ca_pem.as_ref()),
    ] {
        if pem.is_some_and(|pem| !pem.windows(11).any(|w| w == b"-----BEGIN ")) {
            return Err(invalid(key, "is not a PEM file"));
        }
    }
    let client_auth_optional = match tls.client_auth.as_deref() {
        None | Some("required") => false,
        Some("optional") => true,
        Some(other) => {
            return Err(invalid(
                "server.tls.client_auth",
                format!("must be \"required\" or \"optional\", not {other:?}"),
            ));
        }
    };
    // Without a client CA no client certificate is even asked for, so a
    // written "required" would silently require nothing.
    if tls.client_auth.as_deref() == Some("required") && client_ca_pem.is_none() {
        return Err(invalid(
            "server.tls.client_ca_file",
            "required when server.tls.client_auth = \"required\": without a client CA no client certificate is asked for, so nothing would be required",
        ));
    }
    Ok(TlsConfig {
        cert_pem,
        key_pem,
        client_ca_pem,
        client_auth_optional,
    })
}

fn server_limits(server: &ServerSettings) -> Result<ServerLimits, InvalidConfig> {
    if !(1024..=16 * 1024 * 1024).contains(&server.max_message_bytes) {
        return Err(invalid(
            "server.max_message_bytes",
            "must be between 1024 and 16777216",
        ));
    }
    if server.max_concurrent_streams == 0 {
        return Err(invalid(
            "server.max_concurrent_streams",
            "must be at least 1",
        ));
    }
    let request_timeout = parse_duration("server.request_timeout", &server.request_timeout)?;
    if server.max_connections == 0 {
        return Err(invalid("server.max_connections", "must be at least 1"));
    }
    let handshake_timeout = parse_duration("server.handshake_timeout", &server.handshake_timeout)?;
    if handshake_timeout.is_zero() {
        return Err(invalid(
            "server.handshake_timeout",
            "must be more than 0s: a connection that never speaks would be kept forever",
        ));
    }
    Ok(ServerLimits {
        max_message_bytes: server.max_message_bytes,
        max_concurrent_streams: server.max_concurrent_streams,
        max_concurrent_requests: (server.max_concurrent_requests > 0)
            .then_some(server.max_concurrent_requests),
        request_timeout: (!request_timeout.is_zero()).then_some(request_timeout),
        max_connections: server.max_connections,
        handshake_timeout,
    })
}

fn auth(settings: &AuthSettings) -> Result<Auth, InvalidConfig> {
    if settings.principals.is_empty() {
        return Ok(Auth::disabled());
    }
    let mut principals = Vec::with_capacity(settings.principals.len());
    let mut names = std::collections::HashSet::new();
    // Credentials are compared as the server will compare them: a key by
    // its decoded bytes (hex digits in either case are one hash), a DNS
    // name case-insensitively (RFC 6125). Each maps to the index of the
    // principal that holds it first, for the message.
    let mut keys = HashMap::new();
    let mut identities = HashMap::new();
    for (index, principal) in settings.principals.iter().enumerate() {
        let key = |name: &str| format!("auth.principals[{index}].{name}");
        if principal.name.is_empty() || !names.insert(principal.name.as_str()) {
            return Err(invalid(key("name"), "must be non-empty and unique"));
        }
        if principal.api_keys_sha256.is_empty() && principal.identities.is_empty() {
            return Err(invalid(
                key("api_keys_sha256"),
                "a principal needs an API key hash or an identity",
            ));
        }
        let mut hashes = Vec::new();
        for (entry, hex) in principal.api_keys_sha256.iter().enumerate() {
            let entry_key = key(&format!("api_keys_sha256[{entry}]"));
            let hash = decode_sha256(hex).ok_or_else(|| {
                invalid(
                    &entry_key,
                    "each entry must be 64 hex digits (retryd hash-key)",
                )
            })?;
            if let Some(holder) = keys.insert(hash, index) {
                return Err(invalid(
                    entry_key,
                    format!(
                        "a key belongs to one principal only: auth.principals[{holder}] already holds this hash (hex digits compare in either case)"
                    ),
                ));
            }
            hashes.push(hash);
        }
        for (entry, identity) in principal.identities.iter().enumerate() {
            let entry_key = key(&format!("identities[{entry}]"));
            if identity.is_empty() {
                return Err(invalid(
                    entry_key,
                    "identities must be non-empty and belong to one principal only",
                ));
            }
            if let Some(holder) = identities.insert(identity_for_comparison(identity), index) {
                return Err(invalid(
                    entry_key,
                    format!(
                        "identities must be non-empty and belong to one principal only: auth.principals[{holder}] already holds {identity:?} (DNS names compare in any case)"
                    ),
                ));
            }
        }
        principals.push((
            Principal {
                name: principal.name.clone(),
                upstreams: principal.upstreams.iter().map(Pattern::new).collect(),
                admin: principal.admin,
            },
            hashes,
            principal.identities.clone(),
        ));
    }
    Ok(Auth::new(principals))
}

/// An identity as it is compared for duplicates: a URI (a SPIFFE ID, say)
/// as written, since its path is case-sensitive; anything else is a DNS
/// name or a common name, which RFC 6125 compares in any ASCII case.
fn identity_for_comparison(identity: &str) -> String {
    if identity.contains("://") {
        identity.to_owned()
    } else {
        identity.to_ascii_lowercase()
    }
}

fn decode_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim().to_ascii_lowercase();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
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
    let mode = match store.mode.as_str() {
        "exact" => RedisMode::Exact,
        "leased" => RedisMode::Leased,
        other => {
            return Err(invalid(
                "store.mode",
                format!("must be \"exact\" or \"leased\", not {other:?}"),
            ));
        }
    };
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
        mode,
        timeout,
        lease_tokens: store.lease_tokens,
        max_lease_tokens: store.max_lease_tokens,
        lease_ttl,
        key_prefix: store.key_prefix.clone(),
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
    if let Some(names) = &overrides.permanent_failures {
        engine.permanent_failures = names
            .iter()
            .map(|name| {
                FailureKind::from_name(name).ok_or_else(|| {
                    invalid(
                        key("permanent_failures"),
                        format!("unknown failure kind {name:?}"),
                    )
                })
            })
            .collect::<Result<_, _>>()?;
    }
    if let Some(raw) = &overrides.on_unavailable {
        bucket.on_unavailable = parse_on_unavailable(&key("on_unavailable"), raw)?;
    }

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
    if let Some(raw) = &backoff.jitter {
        engine.backoff.jitter = match raw.as_str() {
            "full" => Jitter::Full,
            "decorrelated" => Jitter::Decorrelated,
            other => {
                return Err(invalid(
                    key("backoff.jitter"),
                    format!("must be \"full\" or \"decorrelated\", not {other:?}"),
                ));
            }
        };
    }
    if engine.backoff.base > engine.backoff.max {
        return Err(invalid(key("backoff.base"), "must not exceed backoff.max"));
    }
    Ok(UpstreamPolicy { engine, bucket })
}

fn parse_on_unavailable(key: &str, raw: &str) -> Result<OnUnavailable, InvalidConfig> {
    match raw {
        "local" => Ok(OnUnavailable::Local),
        "deny" => Ok(OnUnavailable::Deny),
        other => Err(invalid(
            key,
            format!("must be \"local\" or \"deny\", not {other:?}"),
        )),
    }
}

fn parse_addr(key: &str, raw: &str) -> Result<SocketAddr, InvalidConfig> {
    raw.parse()
        .map_err(|_| invalid(key, format!("{raw:?} is not an IP:port address")))
}

/// Durations are strings such as `"50ms"` or `"5s"`, at most a day.
fn parse_duration(key: &str, raw: &str) -> Result<Duration, InvalidConfig> {
    let duration = humantime::parse_duration(raw.trim()).map_err(|err| {
        invalid(
            key,
            format!("{raw:?} is not a duration like \"50ms\" or \"5s\" ({err})"),
        )
    })?;
    if duration > Duration::from_secs(86_400) {
        return Err(invalid(key, "must be at most 24h"));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_debug_leaves_the_private_key_out() {
        let tls = TlsConfig {
            cert_pem: b"-----BEGIN CERTIFICATE-----".to_vec(),
            key_pem: b"-----BEGIN PRIVATE KEY-----\nsecret-key-bytes".to_vec(),
            client_ca_pem: None,
            client_auth_optional: false,
        };
        let printed = format!("{tls:?}");
        assert!(!printed.contains("secret-key-bytes"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }

    fn config(toml: &str) -> Result<Config, InvalidConfig> {
        Config::try_from(Settings::from_toml(toml)?)
    }

    fn error_of(toml: &str) -> String {
        config(toml).expect_err("must be refused").to_string()
    }

    #[test]
    fn no_file_gives_the_documented_defaults() {
        let config = config("").unwrap();
        assert_eq!(config.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(config.metrics_listen, "127.0.0.1:9464".parse().unwrap());
        assert_eq!(config.store, StoreConfig::Memory);
        assert_eq!(config.policies.defaults().engine, Policy::default());
        assert_eq!(config.policies.defaults().bucket, BucketConfig::default());
    }

    #[test]
    fn the_design_example_parses() {
        let config = config(
            r#"
            [server]
            listen = "127.0.0.1:50051"
            metrics_listen = "127.0.0.1:9464"
            [store]
            kind = "memory"
            [defaults]
            max_attempts = 3
            min_attempt_budget = "50ms"
            max_retry_after = "60s"
            transient_500 = false
            budget = { capacity = 100.0, initial = 100.0, ratio = 0.1, min_per_second = 1.0 }
            backoff = { base = "50ms", max = "5s", jitter = "full" }
            [upstreams."payments-api"]
            max_attempts = 2
            budget = { capacity = 20.0 }
            "#,
        )
        .unwrap();
        let payments = config.policies.get("payments-api");
        assert_eq!(payments.engine.max_attempts, 2);
        assert_eq!(payments.bucket.capacity, 20.0);
        assert_eq!(
            payments.bucket.initial, 20.0,
            "initial shrinks with capacity"
        );
        assert_eq!(payments.bucket.ratio, 0.1, "inherited from defaults");
        assert_eq!(config.policies.get("other").engine.max_attempts, 3);
    }

    #[test]
    fn upstream_names_keep_their_case_and_dots() {
        let config = config("[upstreams.\"Payments.API\"]\nmax_attempts = 2\n").unwrap();
        assert_eq!(config.policies.get("Payments.API").engine.max_attempts, 2);
        assert_eq!(config.policies.get("payments.api").engine.max_attempts, 3);
    }

    #[test]
    fn environment_overrides_the_file() {
        let environment = HashMap::from([
            ("RETRYD__STORE__KIND".to_string(), "redis".to_string()),
            (
                "RETRYD__STORE__URL".to_string(),
                "redis://127.0.0.1:6390".to_string(),
            ),
            (
                "RETRYD__DEFAULTS__MAX_ATTEMPTS".to_string(),
                "5".to_string(),
            ),
            (
                "RETRYD__SERVER__LISTEN".to_string(),
                "127.0.0.1:7000".to_string(),
            ),
        ]);
        let settings =
            Settings::from_sources("[defaults]\nmax_attempts = 2\n", Some(environment)).unwrap();
        let config = Config::try_from(settings).unwrap();
        assert_eq!(config.policies.defaults().engine.max_attempts, 5);
        assert_eq!(config.listen.port(), 7000);
        match config.store {
            StoreConfig::Redis(redis) => assert_eq!(redis.urls, ["redis://127.0.0.1:6390"]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            ("[server]\nlisten = \"nowhere\"", "server.listen"),
            ("[store]\nkind = \"etcd\"", "store.kind"),
            ("[store]\nkind = \"redis\"", "store.url"),
            ("[store]\nkind = \"redis\"\nurl = \"http://x\"", "store.url"),
            (
                "[store]\nkind = \"redis\"\nurl = \"rediss://x:6380\"",
                "store.url",
            ),
            (
                "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmode = \"fast\"",
                "store.mode",
            ),
            (
                "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nlease_tokens = 20.0\nmax_lease_tokens = 10.0",
                "store.max_lease_tokens",
            ),
            (
                "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmax_lease_tokens = inf",
                "store.max_lease_tokens",
            ),
            ("[telemetry]\nlog_format = \"xml\"", "telemetry.log_format"),
            (
                "[telemetry]\nsampling_ratio = 2.0",
                "telemetry.sampling_ratio",
            ),
            ("[defaults]\nmax_attempts = 0", "defaults.max_attempts"),
            (
                "[defaults]\nmin_attempt_budget = \"5 parsecs\"",
                "defaults.min_attempt_budget",
            ),
            (
                "[defaults]\nbudget = { capacity = -1.0 }",
                "defaults.budget.capacity",
            ),
            (
                "[defaults]\nbudget = { initial = 500.0 }",
                "defaults.budget.initial",
            ),
            (
                "[defaults]\nbackoff = { jitter = \"equal\" }",
                "defaults.backoff.jitter",
            ),
            (
                "[defaults]\nbackoff = { base = \"10s\", max = \"1s\" }",
                "defaults.backoff.base",
            ),
            (
                "[upstreams.pay]\npermanent_failures = [\"gremlins\"]",
                "upstreams.\"pay\".permanent_failures",
            ),
            (
                "[upstreams.pay]\non_unavailable = \"panic\"",
                "upstreams.\"pay\".on_unavailable",
            ),
            ("[limits]\nmax_upstreams = 0", "limits.max_upstreams"),
            ("[server]\nlisten = \"0.0.0.0:50051\"", "server.listen"),
            (
                "[server]\nrequest_timeout = \"soon\"",
                "server.request_timeout",
            ),
            (
                "[server]\nmax_message_bytes = 10",
                "server.max_message_bytes",
            ),
            (
                "[server.tls]\ncert_file = \"/nonexistent.pem\"\nkey_file = \"/nonexistent.pem\"",
                "server.tls.cert_file",
            ),
            (
                "[[auth.principals]]\nname = \"a\"",
                "auth.principals[0].api_keys_sha256",
            ),
            (
                "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"abc\"]",
                "auth.principals[0].api_keys_sha256",
            ),
            (
                "[[auth.principals]]\nname = \"a\"\nidentities = [\"x\"]\n[[auth.principals]]\nname = \"a\"\nidentities = [\"y\"]",
                "auth.principals[1].name",
            ),
        ];
        for (toml, key) in cases {
            let message = error_of(toml);
            assert!(
                message.starts_with(key),
                "{toml:?} gave {message:?}, expected key {key}"
            );
        }
    }

    #[test]
    fn leases_grow_to_a_thousand_tokens_unless_told() {
        let redis = |toml: &str| match config(toml).unwrap().store {
            StoreConfig::Redis(redis) => redis,
            other => panic!("{other:?}"),
        };
        let base = "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\n";
        let defaults = redis(base);
        assert_eq!(
            (defaults.lease_tokens, defaults.max_lease_tokens),
            (5.0, 1000.0)
        );
        // A fixed lease size: as many tokens at most as at least.
        let fixed = redis(&format!(
            "{base}lease_tokens = 7.0\nmax_lease_tokens = 7.0\n"
        ));
        assert_eq!(fixed.max_lease_tokens, 7.0);
    }

    #[test]
    fn public_listen_needs_auth_or_insistence() {
        let insisted =
            config("[server]\nlisten = \"0.0.0.0:50051\"\nallow_unauthenticated = true\n").unwrap();
        assert!(!insisted.auth.is_enabled());
        let key = "0".repeat(64);
        let with_auth = config(&format!(
            "[server]\nlisten = \"0.0.0.0:50051\"\n[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{key}\"]\nupstreams = [\"*\"]\n"
        ))
        .unwrap();
        assert!(with_auth.auth.is_enabled());
    }

    #[test]
    fn one_key_hash_in_two_cases_is_one_key() {
        // Hex digits decode the same in either case (and with surrounding
        // space), so these are one key: two principals holding it would
        // have the later one silently win.
        let lower = format!("ab12{}", "0".repeat(60));
        let principals = |a: &str, b: &str| {
            format!(
                "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{a}\"]\nupstreams = [\"*\"]\n[[auth.principals]]\nname = \"b\"\napi_keys_sha256 = [\"{b}\"]\nupstreams = [\"*\"]\n"
            )
        };
        for other in [
            lower.clone(),
            lower.to_ascii_uppercase(),
            format!("AB12{}", "0".repeat(60)),
            format!(" {lower} "),
        ] {
            let message = error_of(&principals(&lower, &other));
            assert!(
                message.starts_with("auth.principals[1].api_keys_sha256[0]:")
                    && message.contains("auth.principals[0]"),
                "{other:?} gave {message:?}"
            );
        }
        // Twice in one principal, in two cases: the same refusal.
        let message = error_of(&format!(
            "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{lower}\", \"{}\"]\n",
            lower.to_ascii_uppercase()
        ));
        assert!(
            message.starts_with("auth.principals[0].api_keys_sha256[1]:"),
            "{message}"
        );
    }

    #[test]
    fn one_dns_identity_in_two_cases_is_one_identity() {
        // RFC 6125: DNS names compare case-insensitively, so a certificate
        // for `ops.example.com` is one for `OPS.Example.com`. URIs (SPIFFE
        // IDs) keep a case-sensitive path, so they stay distinct.
        let principals = |a: &str, b: &str| {
            format!(
                "[[auth.principals]]\nname = \"a\"\nidentities = [\"{a}\"]\nupstreams = [\"*\"]\n[[auth.principals]]\nname = \"b\"\nidentities = [\"{b}\"]\nupstreams = [\"*\"]\n"
            )
        };
        let message = error_of(&principals("ops.example.com", "OPS.Example.com"));
        assert!(
            message.starts_with("auth.principals[1].identities[0]:")
                && message.contains("auth.principals[0]"),
            "{message}"
        );
        let distinct = config(&principals(
            "spiffe://example.org/ns/ops",
            "spiffe://example.org/ns/OPS",
        ))
        .unwrap();
        assert!(distinct.auth.is_enabled());
    }

    #[test]
    fn bracketed_keys_are_refused_not_expanded() {
        // The config crate would read this as an index and try to allocate.
        let message = error_of("\"x[200000000000000000]\" = 1");
        assert!(message.starts_with("x[200000000000000000]:"), "{message}");
        let message = error_of("[upstreams.\"a[1]\"]\nmax_attempts = 2");
        assert!(message.starts_with("upstreams.a[1]:"), "{message}");
        let environment = HashMap::from([("RETRYD__X[9]".to_string(), "1".to_string())]);
        let error = Settings::from_sources("", Some(environment)).unwrap_err();
        assert!(error.to_string().starts_with("RETRYD__X[9]:"), "{error}");
    }

    #[test]
    fn required_client_auth_needs_a_client_ca() {
        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("any.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let pem = pem.display();
        let tls = |extra: &str| {
            format!("[server.tls]\ncert_file = \"{pem}\"\nkey_file = \"{pem}\"\n{extra}")
        };
        // "required" with no CA to require a certificate from: refused.
        let message = error_of(&tls("client_auth = \"required\"\n"));
        assert!(
            message.starts_with("server.tls.client_ca_file:") && message.contains("client_auth"),
            "{message}"
        );
        // TLS without mTLS (client_auth unset) stays allowed; with a CA,
        // an unset client_auth means "required".
        let plain = config(&tls("")).unwrap().tls.unwrap();
        assert!(plain.client_ca_pem.is_none());
        for (extra, optional) in [
            ("", false),
            ("client_auth = \"required\"\n", false),
            ("client_auth = \"optional\"\n", true),
        ] {
            let mtls = config(&tls(&format!("client_ca_file = \"{pem}\"\n{extra}")))
                .unwrap()
                .tls
                .unwrap();
            assert!(mtls.client_ca_pem.is_some());
            assert_eq!(mtls.client_auth_optional, optional, "{extra:?}");
        }
    }

    const PASSWORD: &str = "hunter2-secret-9f3a";

    #[test]
    fn redis_urls_print_without_their_credentials() {
        let cases = [
            (
                "redis://:hunter2-secret-9f3a@cache:6379/0",
                "redis://***@cache:6379/0",
            ),
            (
                "redis://ops:hunter2-secret-9f3a@cache:6379",
                "redis://***@cache:6379",
            ),
            // A password written without its `:` is in the user name.
            ("redis://hunter2-secret-9f3a@cache", "redis://***@cache"),
            // Raw `@`, `/`, `?` in a password: still all userinfo.
            (
                "redis://:hunter2/secret?9f3a@x@cache:6379",
                "redis://***@cache:6379",
            ),
            // A password where the host should be.
            ("redis://:hunter2-secret-9f3a", "redis://:***"),
            (
                "redis://cache:6379/0?password=hunter2-secret-9f3a",
                "redis://cache:6379/0?***",
            ),
            (
                "redis://u:hunter2-secret-9f3a@[::1]:6379/2",
                "redis://***@[::1]:6379/2",
            ),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("hunter2-secret-9f3a", "***"),
        ];
        for (raw, shown) in cases {
            let url = RedisUrl::from(raw);
            assert_eq!(url.to_string(), shown, "{raw}");
            assert_eq!(format!("{url:?}"), format!("RedisUrl({shown:?})"));
            assert_eq!(url.expose_credentials(), raw);
            assert!(!shown.contains("hunter2"), "{shown}");
        }

        // Nothing that holds one prints it either.
        let toml = format!("[store]\nkind = \"redis\"\nurl = \"redis://:{PASSWORD}@cache:6379\"\n");
        let settings = Settings::from_toml(&toml).unwrap();
        assert!(!format!("{settings:?}").contains(PASSWORD));
        let config = Config::try_from(settings).unwrap();
        assert!(!format!("{config:?}").contains(PASSWORD));
        let many = Urls::Many(vec![format!("redis://:{PASSWORD}@a:7000")]);
        assert_eq!(format!("{many:?}"), "Many([\"redis://***@a:7000\"])");
    }

    #[test]
    fn configuration_errors_name_the_key_without_the_password() {
        let url_line = |url: &str| format!("[store]\nkind = \"redis\"\nurl = {url}\n");
        let cases = [
            (
                url_line(&format!("\"http://:{PASSWORD}@cache:6379\"")),
                "store.url: \"http://***@cache:6379\" is not a redis:// URL",
            ),
            (
                url_line(&format!("\"rediss://:{PASSWORD}@cache:6380\"")),
                "store.url: \"rediss://***@cache:6380\": TLS",
            ),
            (
                url_line(&format!("[\"redis://a:7000\", \"redis://:{PASSWORD}\"]")),
                "store.url: \"redis://:***\" names no host",
            ),
            (
                url_line(&format!("\"redis://:{PASSWORD}@cache:x6379\"")),
                "store.url: \"redis://***@cache:***\": the port is not a number",
            ),
            (
                url_line(&format!("\"redis://:{PASSWORD}@cache:6379")),
                "store.url: TOML syntax error at line 3, column ",
            ),
            (
                format!("[store] # comment\nkind = \"redis\"\npassword = '{PASSWORD}\n"),
                "store.password: TOML syntax error at line 3, column ",
            ),
            (
                format!("[store]\nurl = [\n  \"redis://:{PASSWORD}@a:1\n]\n"),
                "store: TOML syntax error at line 3, column ",
            ),
            (
                format!("{PASSWORD}\n"),
                "TOML syntax error at line 1, column 20: ",
            ),
            (
                format!("[server]\nallow_unauthenticated = \"redis://u:{PASSWORD}@cache\"\n"),
                "cannot load configuration: invalid type: string \"redis://***@cache\"",
            ),
        ];
        for (toml, expected) in &cases {
            let error = config(toml).expect_err("must be refused");
            let message = error.to_string();
            assert!(message.starts_with(expected), "{toml:?} gave {message:?}");
            assert!(!message.contains(PASSWORD), "{message}");
            // No source to print the unredacted text again.
            assert!(std::error::Error::source(&error).is_none(), "{message}");
        }

        let environment = |url: String| {
            HashMap::from([
                ("RETRYD__STORE__KIND".to_string(), "redis".to_string()),
                ("RETRYD__STORE__URL".to_string(), url),
            ])
        };
        for url in [
            format!("rediss://:{PASSWORD}@cache:6380"),
            format!("http://:{PASSWORD}@cache:6379"),
        ] {
            let settings = Settings::from_sources("", Some(environment(url))).unwrap();
            let message = Config::try_from(settings).unwrap_err().to_string();
            assert!(message.starts_with("store.url: \""), "{message}");
            assert!(message.contains("cache:63"), "{message}");
            assert!(!message.contains(PASSWORD), "{message}");
        }
        let wrong_type = HashMap::from([(
            "RETRYD__SERVER__ALLOW_UNAUTHENTICATED".to_string(),
            format!("redis://:{PASSWORD}@cache:6379"),
        )]);
        let message = Settings::from_sources("", Some(wrong_type))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("server.allow_unauthenticated"),
            "{message}"
        );
        assert!(!message.contains(PASSWORD), "{message}");
    }

    #[test]
    fn urls_in_free_text_are_redacted() {
        let cases = [
            (
                "expected a boolean, not string \"redis://u:p\\\"w@h:1\" in `x`",
                "expected a boolean, not string \"redis://***@h:1\" in `x`",
            ),
            ("at redis://:pw@h:1 then", "at redis://***@h:1 then"),
            // Unquoted, a URL runs to whitespace, so punctuation glued to it
            // is hidden with its port: on the safe side.
            ("at redis://:pw@h:1, then", "at redis://***@h:*** then"),
            (
                "two: redis://:a@h:1 https://u:b@web/x",
                "two: redis://***@h:1 https://***@web/x",
            ),
            ("no url here", "no url here"),
            ("é://u:p@h and ://", "é://***@h and ://"),
        ];
        for (text, redacted) in cases {
            assert_eq!(redact_urls_in(text), redacted);
        }
    }

    proptest::proptest! {
        #[test]
        fn any_password_is_hidden(
            password in "\\PC*",
            host in "[a-z0-9.-]{1,20}",
        ) {
            let url = format!("redis://user:{password}@{host}:6379/0");
            proptest::prop_assert_eq!(redact_url(&url), format!("redis://***@{host}:6379/0"));
            // Quoted by serde in a message, escapes and all.
            let message = format!("invalid type: string {url:?}, expected a boolean");
            proptest::prop_assert_eq!(
                redact_urls_in(&message),
                format!("invalid type: string \"redis://***@{host}:6379/0\", expected a boolean")
            );
        }

        #[test]
        fn syntax_errors_never_quote_the_file(
            head in "[a-z\\[\\]=\" \\n]{0,40}",
            password in "[!-~]{12,24}",
        ) {
            let toml = format!("{head}\nurl = \"redis://:{password}@cache:6379\n");
            if let Err(error) = Settings::from_toml(&toml) {
                let message = error.to_string();
                proptest::prop_assert!(!message.contains(&password), "{}", message);
            }
        }

        #[test]
        fn redaction_never_panics(text in "\\PC*") {
            let _ = redact_urls_in(&text);
            let _ = redact_url(&text);
            let _ = Settings::from_toml(&text);
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let message = error_of("[defaults]\nmax_atempts = 3");
        assert!(message.contains("max_atempts"), "{message}");
        let message = error_of("[serverr]\nlisten = \"127.0.0.1:1\"");
        assert!(message.contains("serverr"), "{message}");
    }
}
