//! The span pipeline behind the SDK's tracer: `QueueProcessor`, a span
//! processor with a bounded queue, and a task that batches finished spans
//! into the SDK's OTLP exporter (gRPC or HTTP/protobuf, TLS with the
//! configured CA, headers).
//!
//! Why not the SDK's `BatchSpanProcessor`: it drops when its queue is full
//! too, but counts the drops only for its own shutdown log line, and
//! retryd's operators alert on `retryd_spans_dropped_total`. The queue here
//! is tokio's bounded channel, `try_send` only: the decision path never
//! waits. Exports run one at a time with the exporter's timeout; a failed
//! export is logged (at most every ten seconds) and counted, and its spans
//! are lost, never retried: the audit trail is best effort, the decisions
//! are not.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _, SpanProcessor,
};
use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_rustls::rustls;

use super::Metrics;
use crate::config::{OtlpExport, OtlpProtocol, Sampling, TelemetryConfig};

/// Spans per export request, at most.
const MAX_BATCH: usize = 512;
/// How long a span may wait for its batch to fill.
const BATCH_WINDOW: Duration = Duration::from_millis(200);

/// Hands finished spans to the exporter task; drops (and counts) when the
/// queue is full.
#[derive(Clone, Debug)]
struct QueueProcessor {
    queue: mpsc::Sender<SpanData>,
    metrics: Arc<Metrics>,
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            self.metrics.spans_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // The exporter task is stopped (and flushed) by `TracerGuard`.
        Ok(())
    }
}

/// What `start` made.
pub(super) struct Started {
    pub(super) sampled: SdkTracer,
    pub(super) always: SdkTracer,
    pub(super) stop: oneshot::Sender<()>,
    pub(super) task: JoinHandle<()>,
}

/// The resource every span is exported with: `service.name`,
/// `service.version`, `service.instance.id` (the operator's, or one drawn
/// per process so that replicas are told apart), and the configured rest.
pub(super) fn resource(config: &TelemetryConfig) -> Resource {
    let mut attributes = config.resource_attributes.clone();
    attributes
        .entry("service.version".into())
        .or_insert_with(|| crate::build::SERVICE_VERSION.into());
    attributes
        .entry("service.instance.id".into())
        .or_insert_with(random_uuid);
    Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .with_attributes(
            attributes
                .into_iter()
                .map(|(key, value)| KeyValue::new(key, value)),
        )
        .build()
}

/// A random (version 4) UUID, as the conventions suggest for an instance id.
fn random_uuid() -> String {
    let mut bytes: [u8; 16] = rand::rng().random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = super::hex(&bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

fn sampler(sampling: Sampling) -> Sampler {
    let ratio = match sampling.ratio {
        1.0 => Sampler::AlwaysOn,
        0.0 => Sampler::AlwaysOff,
        ratio => Sampler::TraceIdRatioBased(ratio),
    };
    if sampling.parent_based {
        Sampler::ParentBased(Box::new(ratio))
    } else {
        ratio
    }
}

/// Builds the exporter and the tracers, and spawns the export task on the
/// current runtime.
pub(super) fn start(
    config: &TelemetryConfig,
    export: &OtlpExport,
    metrics: Arc<Metrics>,
) -> Result<Started, String> {
    let resource = resource(config);
    let mut exporter = exporter(export)?;
    exporter.set_resource(&resource);
    let (queue, receiver) = mpsc::channel(config.export_queue.max(1));
    let processor = QueueProcessor {
        queue,
        metrics: Arc::clone(&metrics),
    };
    let scope = opentelemetry::InstrumentationScope::builder("retryd")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let provider = |sampler: Sampler| {
        SdkTracerProvider::builder()
            .with_span_processor(processor.clone())
            .with_sampler(sampler)
            .with_resource(resource.clone())
            .build()
    };
    let sampled = provider(self::sampler(config.sampling)).tracer_with_scope(scope.clone());
    let always = provider(Sampler::AlwaysOn).tracer_with_scope(scope);
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(run(
        exporter,
        export.endpoint.clone(),
        receiver,
        stopped,
        metrics,
    ));
    Ok(Started {
        sampled,
        always,
        stop,
        task,
    })
}

fn exporter(export: &OtlpExport) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let roots = export.ca_roots()?;
    let built = match export.protocol {
        OtlpProtocol::Grpc => {
            let mut metadata = tonic::metadata::MetadataMap::new();
            for (name, value) in &export.headers {
                let key = tonic::metadata::MetadataKey::from_bytes(name.as_bytes())
                    .map_err(|_| format!("telemetry: header {name:?} is not valid"))?;
                let value = value
                    .parse()
                    .map_err(|_| format!("telemetry: the value of header {name:?} is not valid"))?;
                metadata.insert(key, value);
            }
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(export.endpoint.clone())
                .with_timeout(export.timeout)
                .with_metadata(metadata);
            if export.endpoint.starts_with("https://") {
                let tls = match &export.ca_pem {
                    Some(pem) => tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                    None => tonic::transport::ClientTlsConfig::new().with_webpki_roots(),
                };
                builder = builder.with_tls_config(tls);
            }
            builder.build()
        }
        OtlpProtocol::HttpProtobuf => {
            let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("telemetry: TLS: {err}"))?;
            let tls = match roots {
                Some(roots) => tls.with_root_certificates(roots),
                None => tls.with_root_certificates(rustls::RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                }),
            }
            .with_no_client_auth();
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .build();
            let client =
                opentelemetry_http::hyper::HyperClient::new(connector, export.timeout, None);
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(export.endpoint.clone())
                .with_protocol(Protocol::HttpBinary)
                .with_timeout(export.timeout)
                .with_headers(export.headers.iter().cloned().collect::<HashMap<_, _>>())
                .with_http_client(client)
                .build()
        }
    };
    built.map_err(|err| format!("telemetry: cannot build the OTLP exporter: {err}"))
}

/// The export task: batches of up to `MAX_BATCH` spans, or what arrived
/// within `BATCH_WINDOW`; on stop, what is queued, then returns.
async fn run(
    exporter: opentelemetry_otlp::SpanExporter,
    endpoint: String,
    mut queue: mpsc::Receiver<SpanData>,
    mut stop: oneshot::Receiver<()>,
    metrics: Arc<Metrics>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut last_warning: Option<Instant> = None;
    loop {
        let stopping = tokio::select! {
            received = queue.recv() => match received {
                Some(span) => { batch.push(span); false }
                None => true,
            },
            _ = &mut stop => true,
        };
        if stopping {
            while let Ok(span) = queue.try_recv() {
                batch.push(span);
            }
        } else {
            let window = tokio::time::sleep(BATCH_WINDOW);
            tokio::pin!(window);
            while batch.len() < MAX_BATCH {
                tokio::select! {
                    received = queue.recv() => match received {
                        Some(span) => batch.push(span),
                        None => break,
                    },
                    () = &mut window => break,
                }
            }
        }
        while !batch.is_empty() {
            let chunk: Vec<SpanData> = batch.drain(..batch.len().min(MAX_BATCH)).collect();
            let count = chunk.len() as u64;
            match exporter.export(chunk).await {
                Ok(()) => {
                    metrics.spans_exported.fetch_add(count, Ordering::Relaxed);
                }
                Err(error) => {
                    metrics.spans_failed.fetch_add(count, Ordering::Relaxed);
                    let quiet =
                        last_warning.is_some_and(|at| at.elapsed() < Duration::from_secs(10));
                    if !quiet {
                        last_warning = Some(Instant::now());
                        tracing::warn!(
                            endpoint = %crate::budget::redis::redact_url(&endpoint),
                            %error,
                            spans = count,
                            "span export failed; spans dropped"
                        );
                    }
                }
            }
        }
        if stopping {
            return;
        }
    }
}
