//! `[telemetry]` validated: where spans go (OTLP over gRPC or HTTP, TLS,
//! headers), what the resource says, sampling, the log format and level,
//! as [`TelemetryConfig`]. The `OTEL_*` variables are resolved against the
//! TOML keys in `otel.rs`. Starting any of it is `crate::telemetry`'s
//! business, not this module's.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

use super::otel::{self, Origin, OtlpProtocol, Sampling};
use super::{InvalidConfig, LogFormat, TelemetrySettings, invalid, parse_duration};

/// Where and how spans are exported.
#[derive(Clone, Debug, PartialEq)]
pub struct OtlpExport {
    /// The URL spans are sent to (for HTTP, with its `/v1/traces` path).
    pub endpoint: String,
    /// gRPC or HTTP/protobuf.
    pub protocol: OtlpProtocol,
    /// Sent with every export; values are secrets and are never printed.
    pub headers: Vec<(String, String)>,
    /// The CA file that signed the collector's certificate, for `https`.
    pub ca_file: Option<PathBuf>,
    /// Its PEM, read and parsed at validation like every other
    /// certificate (so `check-config` refuses a bad one, and nothing binds
    /// a port first); [`OtlpExport::ca_roots`] turns it into trust roots.
    pub ca_pem: Option<Vec<u8>>,
    /// How long one export may take.
    pub timeout: Duration,
}

impl OtlpExport {
    /// The trust roots of `ca_pem`, if one was configured. Validation
    /// already parsed them, so this fails only if that was skipped.
    pub fn ca_roots(&self) -> Result<Option<rustls::RootCertStore>, String> {
        self.ca_pem
            .as_deref()
            .map(|pem| ca_roots(pem).map_err(|reason| format!("telemetry.otlp_ca_file: {reason}")))
            .transpose()
    }
}

/// Every certificate of `pem` as a trust root; at least one.
fn ca_roots(pem: &[u8]) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(pem) {
        let certificate = certificate.map_err(|err| format!("not a PEM certificate: {err}"))?;
        roots
            .add(certificate)
            .map_err(|err| format!("not a usable CA certificate: {err}"))?;
    }
    if roots.is_empty() {
        return Err("no certificate in the file".into());
    }
    Ok(roots)
}

/// The validated `[telemetry]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryConfig {
    /// The exporter; `None` when no endpoint is configured or
    /// `OTEL_SDK_DISABLED=true`: then no exporter runs and spans cost
    /// nothing.
    pub otlp: Option<OtlpExport>,
    /// Sampling.
    pub sampling: Sampling,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Further resource attributes, `service.instance.id` among them if the
    /// operator set one (else `telemetry` draws one per process).
    pub resource_attributes: BTreeMap<String, String>,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_level: String,
    /// Span export queue capacity.
    pub export_queue: usize,
    /// Each resolved setting and where it came from, for `check-config`.
    pub origins: Vec<(&'static str, String, Origin)>,
}

/// Exports longer than this are abandoned (the OpenTelemetry default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn telemetry_config(
    telemetry: &TelemetrySettings,
    env: &BTreeMap<String, String>,
) -> Result<TelemetryConfig, InvalidConfig> {
    let mut origins = Vec::new();
    let sampling = match telemetry.sampling_ratio {
        Some(ratio) if !(0.0..=1.0).contains(&ratio) => {
            return Err(invalid(
                "telemetry.sampling_ratio",
                "must be between 0 and 1",
            ));
        }
        Some(ratio) => {
            origins.push((
                "sampler",
                format!("parentbased_traceidratio {ratio}"),
                Origin::Toml("telemetry.sampling_ratio"),
            ));
            Sampling {
                parent_based: true,
                ratio,
            }
        }
        None => {
            let (sampling, origin) = otel::sampler(env)?;
            origins.push(("sampler", otel::sampler_name(sampling), origin));
            sampling
        }
    };
    if !(1..=1_000_000).contains(&telemetry.export_queue) {
        return Err(invalid(
            "telemetry.export_queue",
            "must be between 1 and 1000000",
        ));
    }
    let (service_name, resource_attributes) = otel::resource(telemetry, env, &mut origins)?;
    let otlp = otlp_export(telemetry, env, &mut origins)?;
    Ok(TelemetryConfig {
        otlp,
        sampling,
        service_name,
        resource_attributes,
        log_format: telemetry.log_format,
        log_level: telemetry.log_level.clone(),
        export_queue: telemetry.export_queue,
        origins,
    })
}

/// The exporter: each setting from its TOML key if set, else from the
/// signal's `OTEL_EXPORTER_OTLP_TRACES_*` variable, else the general
/// `OTEL_EXPORTER_OTLP_*` one, else the default.
fn otlp_export(
    telemetry: &TelemetrySettings,
    env: &BTreeMap<String, String>,
    origins: &mut Vec<(&'static str, String, Origin)>,
) -> Result<Option<OtlpExport>, InvalidConfig> {
    let (protocol, origin) = match &telemetry.otlp_protocol {
        Some(raw) => (
            otel::protocol("telemetry.otlp_protocol", raw)?,
            Origin::Toml("telemetry.otlp_protocol"),
        ),
        None => match otel::lookup(env, "PROTOCOL") {
            Some((name, raw)) => (otel::protocol(name, raw)?, Origin::Env(name)),
            // retryd's exporter spoke gRPC before it honoured OTEL_*.
            None => (OtlpProtocol::Grpc, Origin::Default),
        },
    };
    let Some((endpoint, endpoint_origin)) = otel::endpoint(telemetry, env, protocol)? else {
        origins.push(("exporter", "none (no endpoint)".into(), Origin::Default));
        return Ok(None);
    };
    if otel::sdk_disabled(env) {
        origins.push((
            "exporter",
            "none (disabled)".into(),
            Origin::Env("OTEL_SDK_DISABLED"),
        ));
        return Ok(None);
    }
    origins.push(("otlp endpoint", endpoint.clone(), endpoint_origin));
    origins.push(("otlp protocol", protocol.as_str().into(), origin));
    let headers = otel::headers(telemetry, env, origins)?;
    let ca_file = match &telemetry.otlp_ca_file {
        Some(path) => Some((path.clone(), Origin::Toml("telemetry.otlp_ca_file"))),
        None => otel::lookup(env, "CERTIFICATE")
            .map(|(name, path)| (path.to_owned(), Origin::Env(name))),
    };
    let ca_pem = match &ca_file {
        Some((path, origin)) => {
            origins.push(("otlp CA file", path.clone(), *origin));
            let key = match origin {
                Origin::Toml(name) | Origin::Env(name) => *name,
                Origin::Default => "telemetry.otlp_ca_file",
            };
            let pem = std::fs::read(path)
                .map_err(|err| invalid(key, format!("cannot read {path:?}: {err}")))?;
            ca_roots(&pem).map_err(|reason| invalid(key, format!("{path:?}: {reason}")))?;
            Some(pem)
        }
        None => None,
    };
    let timeout = match &telemetry.otlp_timeout {
        Some(raw) => (
            parse_duration("telemetry.otlp_timeout", raw)?,
            Origin::Toml("telemetry.otlp_timeout"),
        ),
        None => match otel::lookup(env, "TIMEOUT") {
            Some((name, raw)) => (
                raw.trim()
                    .parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|_| invalid(name, format!("{raw:?} is not milliseconds")))?,
                Origin::Env(name),
            ),
            None => (DEFAULT_TIMEOUT, Origin::Default),
        },
    };
    if timeout.0.is_zero() {
        return Err(invalid("telemetry.otlp_timeout", "must be above zero"));
    }
    origins.push(("otlp timeout", format!("{:?}", timeout.0), timeout.1));
    Ok(Some(OtlpExport {
        endpoint,
        protocol,
        headers,
        ca_file: ca_file.map(|(path, _)| PathBuf::from(path)),
        ca_pem,
        timeout: timeout.0,
    }))
}
