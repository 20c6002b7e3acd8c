//! Configuration: built-in defaults, then an optional TOML file, then
//! `RETRYD__SECTION__KEY` environment variables, deserialized into
//! [`Settings`] and converted with `TryFrom` into the typed, validated
//! [`Config`] the service runs on.
//!
//! This is the only module that reads the environment, and every bad value
//! is refused here, naming its key, before any port is bound. Tests build
//! settings from strings and explicit variable maps, never by mutating the
//! process environment.
//!
//! The module is cut by what each part owns: `settings` the serde types
//! (what an operator may write, with each default), `enums` the settings
//! with a fixed set of names, `loading` the file and environment layering
//! and the redaction of its errors, and one
//! validation module per section (`server`, `store`, `telemetry`, `auth`,
//! `policies`); this root holds the error, the validated [`Config`] and
//! the order in which sections are checked.

mod auth;
mod enums;
mod loading;
mod otel;
mod policies;
mod server;
mod settings;
mod store;
mod telemetry;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::auth::Auth;
use crate::policy::Policies;

pub use self::enums::{
    ClientAuth, FailureKindName, JitterName, LogFormat, OnUnavailableName, StoreKind, StoreMode,
};
pub use self::otel::{Origin, VARIABLES as OTEL_VARIABLES};
pub use self::otel::{OtlpProtocol, Sampling};
pub use self::server::{ServerLimits, TlsConfig};
pub use self::settings::{
    AuthSettings, BackoffSettings, BudgetSettings, DecisionLogSettings, LimitSettings,
    PolicySettings, PrincipalSettings, Secret, SentinelSettings, ServerSettings, Settings,
    StoreSettings, StoreTlsSettings, TelemetrySettings, TlsSettings, Urls,
};
pub use self::store::StoreConfig;
pub use self::telemetry::{OtlpExport, TelemetryConfig};

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
    /// `server.allow_unauthenticated`: the operator insists on serving a
    /// non-loopback address without `[auth]`.
    pub allow_unauthenticated: bool,
    /// Who may call, and what for.
    pub auth: Auth,
    /// The budget store.
    pub store: StoreConfig,
    /// Telemetry.
    pub telemetry: TelemetryConfig,
    /// Most distinct upstreams tracked.
    pub max_upstreams: usize,
    /// How traffic report ids are remembered.
    pub report_ids: ReportIds,
    /// Where decisions are logged as JSON lines, if anywhere.
    pub decision_log: Option<DecisionLogConfig>,
    /// Most unconfigured upstreams one principal holds (`None`: no share).
    pub max_upstreams_per_principal: Option<usize>,
    /// How long an unconfigured upstream is idle before it may be evicted.
    pub evict_idle_after: Duration,
    /// Per-upstream policies.
    pub policies: Policies,
}

impl TryFrom<Settings> for Config {
    type Error = InvalidConfig;

    /// Validates section by section, in a fixed order, so that a file with
    /// several faults is always refused for the same first one.
    fn try_from(settings: Settings) -> Result<Config, InvalidConfig> {
        let listen = parse_addr("server.listen", &settings.server.listen)?;
        let metrics_listen = parse_addr("server.metrics_listen", &settings.server.metrics_listen)?;
        let shutdown_grace =
            parse_duration("server.shutdown_grace", &settings.server.shutdown_grace)?;
        let tls = settings
            .server
            .tls
            .as_ref()
            .map(server::tls_config)
            .transpose()?;
        let server_limits = server::server_limits(&settings.server)?;
        let auth = auth::auth(&settings.auth)?;
        server::refuse_public_unauthenticated(listen, &auth, &settings.server)?;
        let store = store::store_config(&settings.store)?;
        let store_default = settings.store.on_unavailable.into();
        let telemetry = telemetry::telemetry_config(&settings.telemetry, &settings.otel)?;
        let policies = policies::policies(&settings, store_default)?;
        let report_ids = report_ids(&settings.limits)?;
        let decision_log = decision_log(&settings.decision_log)?;
        refuse_candidates_off_memory(&store, &policies)?;
        let (max_upstreams_per_principal, evict_idle_after) = limits(&settings, &auth)?;
        Ok(Config {
            listen,
            metrics_listen,
            shutdown_grace,
            tls,
            server_limits,
            allow_unauthenticated: settings.server.allow_unauthenticated,
            auth,
            store,
            telemetry,
            max_upstreams: settings.limits.max_upstreams,
            report_ids,
            decision_log,
            max_upstreams_per_principal,
            evict_idle_after,
            policies,
        })
    }
}

/// `[decision_log]`: where and how many lines may wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionLogConfig {
    /// The file lines are appended to.
    pub path: PathBuf,
    /// Lines waiting to be written, at most.
    pub queue: usize,
    /// The most bytes the file may hold, if bounded.
    pub max_bytes: Option<u64>,
}

fn decision_log(
    settings: &DecisionLogSettings,
) -> Result<Option<DecisionLogConfig>, InvalidConfig> {
    let Some(path) = &settings.path else {
        return Ok(None);
    };
    if path.trim().is_empty() {
        return Err(invalid("decision_log.path", "must name a file"));
    }
    if settings.queue == 0 {
        return Err(invalid("decision_log.queue", "must be at least 1"));
    }
    Ok(Some(DecisionLogConfig {
        path: PathBuf::from(path),
        queue: settings.queue,
        max_bytes: (settings.max_bytes > 0).then_some(settings.max_bytes),
    }))
}

/// A candidate's budget lives in this process's memory: on a shared store
/// each replica would hold a fraction of it, fed by a fraction of the
/// reports, so its divergence figures would not mean what they say.
fn refuse_candidates_off_memory(
    store: &StoreConfig,
    policies: &Policies,
) -> Result<(), InvalidConfig> {
    if matches!(store, StoreConfig::Memory) {
        return Ok(());
    }
    match policies
        .named()
        .find(|(_, policy)| policy.candidate.is_some())
    {
        Some((name, _)) => Err(invalid(
            format!("upstreams.{name:?}.candidate"),
            "needs store.kind = \"memory\": the Redis store holds one budget per upstream, shared by every replica, and a candidate's budget is per process",
        )),
        None => Ok(()),
    }
}

/// How traffic report ids are remembered (`limits.report_id_window`,
/// `limits.max_report_ids`): long enough to cover a client's re-sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReportIds {
    /// How long an id is remembered after its first report.
    pub window: Duration,
    /// Most ids the memory store holds (the Redis store expires its keys
    /// instead).
    pub max_ids: usize,
}

fn report_ids(limits: &LimitSettings) -> Result<ReportIds, InvalidConfig> {
    let window = parse_duration("limits.report_id_window", &limits.report_id_window)?;
    if window < Duration::from_secs(1) {
        return Err(invalid(
            "limits.report_id_window",
            "must be at least 1s (a client's re-sends must fit in it)",
        ));
    }
    if limits.max_report_ids == 0 {
        return Err(invalid("limits.max_report_ids", "must be at least 1"));
    }
    Ok(ReportIds {
        window,
        max_ids: limits.max_report_ids,
    })
}

/// `[limits]` beyond `max_upstreams` (which `policies` checks).
fn limits(settings: &Settings, auth: &Auth) -> Result<(Option<usize>, Duration), InvalidConfig> {
    const PER_PRINCIPAL: &str = "limits.max_upstreams_per_principal";
    let limits = &settings.limits;
    // Principals, not names: without authentication there is one, the
    // anonymous caller.
    let principals = if auth.is_enabled() {
        auth.principal_names().len()
    } else {
        1
    };
    let per_principal = match limits.max_upstreams_per_principal {
        // Unset with several principals: equal shares, which sum to at most
        // `max_upstreams`, so each principal always has room of its own.
        None if principals > 1 => Some((limits.max_upstreams / principals).max(1)),
        None | Some(0) => None,
        Some(_) if !auth.is_enabled() => {
            return Err(invalid(
                PER_PRINCIPAL,
                "needs [auth] principals: without authentication every caller is one",
            ));
        }
        Some(share) if share > limits.max_upstreams => {
            return Err(invalid(
                PER_PRINCIPAL,
                "must be at most limits.max_upstreams",
            ));
        }
        Some(share) => Some(share),
    };
    let idle = parse_duration("limits.evict_idle_after", &limits.evict_idle_after)?;
    // A sweep runs a few times per idle period; below a second it would
    // take the table's locks too often for what it frees.
    if idle < Duration::from_secs(1) {
        return Err(invalid("limits.evict_idle_after", "must be at least 1s"));
    }
    Ok((per_principal, idle))
}

impl Config {
    /// Loads and validates: what `serve` and `check-config` run.
    pub fn load(path: Option<&Path>) -> Result<Config, InvalidConfig> {
        Config::try_from(Settings::load(path)?)
    }

    /// Loads and validates a file for a reload: as [`Config::load`], but a
    /// file that sets nothing is refused. At startup an empty file means
    /// the defaults; on a reload it is far more often a file caught between
    /// an editor's truncate and its write, and applying it would replace
    /// every principal and policy with the defaults.
    pub fn load_for_reload(path: Option<&Path>) -> Result<Config, InvalidConfig> {
        let Some(path) = path else {
            return Config::load(None);
        };
        let toml = std::fs::read_to_string(path)
            .map_err(|err| invalid(path.display().to_string(), format!("cannot read: {err}")))?;
        if toml
            .parse::<toml::Table>()
            .is_ok_and(|table| table.is_empty())
        {
            return Err(invalid(
                path.display().to_string(),
                "sets nothing (empty, or caught while being written); a reload needs the whole configuration, so the running one is kept",
            ));
        }
        Config::try_from(Settings::from_sources(&toml, None)?)
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
