//! `[telemetry]` validated: the exporter's endpoint, sampling, the log
//! format and level as [`TelemetryConfig`]. Starting any of it is
//! `crate::telemetry`'s business, not this module's.

use super::{InvalidConfig, LogFormat, TelemetrySettings, invalid};

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

pub(super) fn telemetry_config(
    telemetry: &TelemetrySettings,
) -> Result<TelemetryConfig, InvalidConfig> {
    if !(0.0..=1.0).contains(&telemetry.sampling_ratio) {
        return Err(invalid(
            "telemetry.sampling_ratio",
            "must be between 0 and 1",
        ));
    }
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
        log_format: telemetry.log_format,
        log_level: telemetry.log_level.clone(),
        export_queue: telemetry.export_queue,
    };
    if !(1..=1_000_000).contains(&telemetry.export_queue) {
        return Err(invalid(
            "telemetry.export_queue",
            "must be between 1 and 1000000",
        ));
    }
    Ok(telemetry)
}
