//! The standard OpenTelemetry environment variables, resolved against the
//! `[telemetry]` keys.
//!
//! Precedence, per setting: a `[telemetry]` key (from the file or its
//! `RETRYD__TELEMETRY__*` override) wins; else the trace-specific
//! `OTEL_EXPORTER_OTLP_TRACES_*` variable; else the general
//! `OTEL_EXPORTER_OTLP_*` one; else the default. This is the
//! specification's order (code and files above the environment), so a
//! file that says where spans go is not redirected by a stray variable.
//! `OTEL_SDK_DISABLED=true` is the exception: it turns export off
//! whatever the file says, as it does in every SDK. The variables come
//! from `Settings::otel` (loading.rs): nothing here reads the process
//! environment.
//!
//! The OpenTelemetry vocabulary the settings are written in (the transport,
//! the sampler) is defined here; `telemetry.rs` builds on it, never the
//! other way round.

use std::collections::BTreeMap;
use std::fmt;

use super::{InvalidConfig, TelemetrySettings, invalid};

/// The OTLP transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318, path `/v1/traces`).
    HttpProtobuf,
}

impl OtlpProtocol {
    /// The name `OTEL_EXPORTER_OTLP_PROTOCOL` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Which spans are recorded: the SDK's samplers, as `OTEL_TRACES_SAMPLER`
/// names them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Follow a caller's sampled flag (the `parentbased_*` samplers).
    pub parent_based: bool,
    /// The fraction of the rest (roots, or all without `parent_based`).
    pub ratio: f64,
}

/// Where a resolved setting came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A `[telemetry]` key.
    Toml(&'static str),
    /// An `OTEL_*` variable.
    Env(&'static str),
    /// Nothing set it.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Toml(key) => write!(f, "from {key}"),
            Origin::Env(name) => write!(f, "from {name}"),
            Origin::Default => f.write_str("default"),
        }
    }
}

/// Every variable retryd honours, for `check-config` and the README.
pub const VARIABLES: [&str; 18] = [
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    // Recognised only to be named by `check-config`.
    "OTEL_TRACES_EXPORTER",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_PROPAGATORS",
];

/// The trace-specific variable of `setting`, else the general one: the
/// name that was set and its value. An empty value counts as unset, as
/// the specification says.
pub(super) fn lookup<'e>(
    env: &'e BTreeMap<String, String>,
    setting: &str,
) -> Option<(&'static str, &'e str)> {
    let names: [&'static str; 2] = match setting {
        "ENDPOINT" => [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ],
        "PROTOCOL" => [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ],
        "HEADERS" => [
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ],
        "CERTIFICATE" => [
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ],
        _ => [
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ],
    };
    names.into_iter().find_map(|name| {
        let value = env.get(name)?.trim();
        (!value.is_empty()).then_some((name, value))
    })
}

/// `OTEL_SDK_DISABLED=true` (case-insensitive; any other value is false).
pub(super) fn sdk_disabled(env: &BTreeMap<String, String>) -> bool {
    env.get("OTEL_SDK_DISABLED")
        .is_some_and(|value| value.trim().eq_ignore_ascii_case("true"))
}

pub(super) fn protocol(key: &str, raw: &str) -> Result<OtlpProtocol, InvalidConfig> {
    match raw.trim() {
        "grpc" => Ok(OtlpProtocol::Grpc),
        "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
        other => Err(invalid(
            key,
            format!(
                "{other:?}: expected \"grpc\" or \"http/protobuf\" (http/json is not built in)"
            ),
        )),
    }
}

/// The endpoint, if any. For HTTP the general variable (and a TOML URL
/// without a path) is a base to which `/v1/traces` is appended; the
/// trace-specific variable is used as it is (the specification's rule).
pub(super) fn endpoint(
    telemetry: &TelemetrySettings,
    env: &BTreeMap<String, String>,
    protocol: OtlpProtocol,
) -> Result<Option<(String, Origin)>, InvalidConfig> {
    let (key, raw, origin) = match &telemetry.otlp_endpoint {
        Some(raw) => (
            "telemetry.otlp_endpoint",
            raw.as_str(),
            Origin::Toml("telemetry.otlp_endpoint"),
        ),
        None => match lookup(env, "ENDPOINT") {
            Some((name, raw)) => (name, raw, Origin::Env(name)),
            None => return Ok(None),
        },
    };
    let Some(rest) = raw
        .strip_prefix("http://")
        .or_else(|| raw.strip_prefix("https://"))
    else {
        return Err(invalid(key, "must be an http:// or https:// URL"));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(invalid(key, "must name a host"));
    }
    let has_path = rest.trim_end_matches('/').contains('/');
    let append = match origin {
        Origin::Toml(_) => !has_path,
        Origin::Env(name) => name == "OTEL_EXPORTER_OTLP_ENDPOINT",
        Origin::Default => false,
    };
    let endpoint = if protocol == OtlpProtocol::HttpProtobuf && append {
        format!("{}/v1/traces", raw.trim_end_matches('/'))
    } else {
        raw.to_owned()
    };
    Ok(Some((endpoint, origin)))
}

/// Headers: the general variable's, overridden per name by the
/// trace-specific variable's, overridden by `telemetry.otlp_headers`.
/// Values are secrets: origins name the headers only.
pub(super) fn headers(
    telemetry: &TelemetrySettings,
    env: &BTreeMap<String, String>,
    origins: &mut Vec<(&'static str, String, Origin)>,
) -> Result<Vec<(String, String)>, InvalidConfig> {
    let mut headers: BTreeMap<String, (String, Origin)> = BTreeMap::new();
    for name in [
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    ] {
        if let Some(raw) = env.get(name) {
            for (key, value) in pairs(name, raw)? {
                headers.insert(key.to_ascii_lowercase(), (value, Origin::Env(name)));
            }
        }
    }
    for (key, value) in &telemetry.otlp_headers {
        headers.insert(
            key.to_ascii_lowercase(),
            (value.clone(), Origin::Toml("telemetry.otlp_headers")),
        );
    }
    for (key, (value, origin)) in &headers {
        let valid_name = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        let source = match origin {
            Origin::Toml(name) | Origin::Env(name) => *name,
            Origin::Default => "",
        };
        if !valid_name || value.bytes().any(|b| b.is_ascii_control()) {
            return Err(invalid(
                source,
                format!("header {key:?} is not a valid HTTP header"),
            ));
        }
        origins.push(("otlp header", format!("{key} (value hidden)"), *origin));
    }
    Ok(headers
        .into_iter()
        .map(|(key, (value, _))| (key, value))
        .collect())
}

/// `key=value,key=value` with percent-encoded values (W3C Baggage
/// octets, as `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_RESOURCE_ATTRIBUTES`
/// are written).
fn pairs(name: &str, raw: &str) -> Result<Vec<(String, String)>, InvalidConfig> {
    raw.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| invalid(name, "expected key=value pairs separated by commas"))?;
            let value = percent_decode(value.trim()).ok_or_else(|| {
                invalid(
                    name,
                    format!("the value of {:?} is badly percent-encoded", key.trim()),
                )
            })?;
            Ok((key.trim().to_owned(), value))
        })
        .collect()
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `service.name` and the other resource attributes:
/// `OTEL_RESOURCE_ATTRIBUTES`, overridden by `OTEL_SERVICE_NAME` for the
/// name, overridden by the `[telemetry]` keys.
pub(super) fn resource(
    telemetry: &TelemetrySettings,
    env: &BTreeMap<String, String>,
    origins: &mut Vec<(&'static str, String, Origin)>,
) -> Result<(String, BTreeMap<String, String>), InvalidConfig> {
    let mut attributes: BTreeMap<String, (String, Origin)> = BTreeMap::new();
    if let Some(raw) = env.get("OTEL_RESOURCE_ATTRIBUTES") {
        for (key, value) in pairs("OTEL_RESOURCE_ATTRIBUTES", raw)? {
            attributes.insert(key, (value, Origin::Env("OTEL_RESOURCE_ATTRIBUTES")));
        }
    }
    for (key, value) in &telemetry.resource_attributes {
        attributes.insert(
            key.clone(),
            (value.clone(), Origin::Toml("telemetry.resource_attributes")),
        );
    }
    let from_attributes = attributes.remove("service.name");
    let (service_name, origin) = match (&telemetry.service_name, env.get("OTEL_SERVICE_NAME")) {
        (Some(name), _) => (name.clone(), Origin::Toml("telemetry.service_name")),
        (None, Some(name)) if !name.trim().is_empty() => {
            (name.trim().to_owned(), Origin::Env("OTEL_SERVICE_NAME"))
        }
        _ => from_attributes.unwrap_or(("retryd".to_owned(), Origin::Default)),
    };
    if service_name.is_empty() {
        return Err(invalid("telemetry.service_name", "may not be empty"));
    }
    origins.push(("service.name", service_name.clone(), origin));
    for (key, (value, origin)) in &attributes {
        origins.push(("resource attribute", format!("{key}={value}"), *origin));
    }
    Ok((
        service_name,
        attributes
            .into_iter()
            .map(|(key, (value, _))| (key, value))
            .collect(),
    ))
}

/// `OTEL_TRACES_SAMPLER` (and `_ARG`), default `parentbased_always_on`.
pub(super) fn sampler(env: &BTreeMap<String, String>) -> Result<(Sampling, Origin), InvalidConfig> {
    let Some(name) = env.get("OTEL_TRACES_SAMPLER").map(|name| name.trim()) else {
        let sampling = Sampling {
            parent_based: true,
            ratio: 1.0,
        };
        return Ok((sampling, Origin::Default));
    };
    let ratio = || -> Result<f64, InvalidConfig> {
        match env.get("OTEL_TRACES_SAMPLER_ARG") {
            None => Ok(1.0),
            Some(raw) => raw
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|ratio| (0.0..=1.0).contains(ratio))
                .ok_or_else(|| {
                    invalid(
                        "OTEL_TRACES_SAMPLER_ARG",
                        "must be a number between 0 and 1",
                    )
                }),
        }
    };
    let (parent_based, ratio) = match name {
        "always_on" => (false, 1.0),
        "always_off" => (false, 0.0),
        "traceidratio" => (false, ratio()?),
        "parentbased_always_on" => (true, 1.0),
        "parentbased_always_off" => (true, 0.0),
        "parentbased_traceidratio" => (true, ratio()?),
        other => {
            return Err(invalid(
                "OTEL_TRACES_SAMPLER",
                format!(
                    "{other:?}: expected always_on, always_off, traceidratio or their parentbased_ forms"
                ),
            ));
        }
    };
    Ok((
        Sampling {
            parent_based,
            ratio,
        },
        Origin::Env("OTEL_TRACES_SAMPLER"),
    ))
}

/// The sampler's `OTEL_TRACES_SAMPLER` spelling.
pub(super) fn sampler_name(sampling: Sampling) -> String {
    let prefix = if sampling.parent_based {
        "parentbased_"
    } else {
        ""
    };
    match sampling.ratio {
        1.0 => format!("{prefix}always_on"),
        0.0 => format!("{prefix}always_off"),
        ratio => format!("{prefix}traceidratio {ratio}"),
    }
}
