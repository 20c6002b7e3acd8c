//! The OTLP/gRPC span exporter: a task that batches finished spans and
//! sends them to the collector with the official OpenTelemetry protobuf
//! types.
//!
//! Exports run one at a time with a timeout. While one is slow the queue
//! fills and `Tracer::finish` drops new spans: the decision path never
//! waits. A failed export is logged (at most every ten seconds) and
//! counted, and its spans are lost, never retried: the audit trail is best
//! effort, the decisions are not.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{
    ResourceSpans, ScopeSpans, Span, Status, span, status,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::transport::Endpoint;

use super::Metrics;
use super::trace::{Attribute, SpanRecord};

/// Spans per export request, at most.
const MAX_BATCH: usize = 512;
/// How long a span may wait for its batch to fill.
const BATCH_WINDOW: Duration = Duration::from_millis(200);
/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// Spawns the exporter on the current runtime.
pub(super) fn spawn(
    endpoint: &str,
    mut queue: mpsc::Receiver<SpanRecord>,
    mut stop: oneshot::Receiver<()>,
    metrics: Arc<Metrics>,
) -> Result<JoinHandle<()>, String> {
    let channel = Endpoint::from_shared(endpoint.to_owned())
        .map_err(|err| format!("telemetry.otlp_endpoint: {err}"))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(EXPORT_TIMEOUT)
        .connect_lazy();
    let mut client = TraceServiceClient::new(channel);
    let endpoint = endpoint.to_owned();
    Ok(tokio::spawn(async move {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut last_warning: Option<Instant> = None;
        loop {
            let stopping = tokio::select! {
                received = queue.recv() => match received {
                    Some(record) => { batch.push(record); false }
                    None => true,
                },
                _ = &mut stop => true,
            };
            if stopping {
                // Flush what is already queued, then stop.
                while let Ok(record) = queue.try_recv() {
                    batch.push(record);
                }
            } else {
                let window = tokio::time::sleep(BATCH_WINDOW);
                tokio::pin!(window);
                while batch.len() < MAX_BATCH {
                    tokio::select! {
                        received = queue.recv() => match received {
                            Some(record) => batch.push(record),
                            None => break,
                        },
                        () = &mut window => break,
                    }
                }
            }
            while !batch.is_empty() {
                let chunk: Vec<SpanRecord> = batch.drain(..batch.len().min(MAX_BATCH)).collect();
                let count = chunk.len() as u64;
                let request = export_request(chunk);
                match tokio::time::timeout(EXPORT_TIMEOUT, client.export(request)).await {
                    Ok(Ok(_)) => {
                        metrics.spans_exported.fetch_add(count, Ordering::Relaxed);
                    }
                    outcome => {
                        metrics.spans_failed.fetch_add(count, Ordering::Relaxed);
                        let quiet =
                            last_warning.is_some_and(|at| at.elapsed() < Duration::from_secs(10));
                        if !quiet {
                            last_warning = Some(Instant::now());
                            let error = match outcome {
                                Ok(Err(status)) => status.to_string(),
                                _ => "timed out".to_owned(),
                            };
                            tracing::warn!(
                                endpoint,
                                error,
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
    }))
}

/// Consumes the records, so their strings move into the request instead of
/// being copied.
fn export_request(records: Vec<SpanRecord>) -> ExportTraceServiceRequest {
    let spans = records.into_iter().map(span).collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![
                    key_value("service.name", Attribute::Static("retryd")),
                    key_value(
                        "service.version",
                        Attribute::Static(env!("CARGO_PKG_VERSION")),
                    ),
                ],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "retryd".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

fn span(record: SpanRecord) -> Span {
    let start_time_unix_nano = record.start_unix_nanos();
    let trace_state = record.trace_state().to_owned();
    let status = match record.error {
        Some(message) => Status {
            message,
            code: status::StatusCode::Error as i32,
        },
        None => Status {
            message: String::new(),
            code: status::StatusCode::Unset as i32,
        },
    };
    Span {
        trace_id: record.start.trace_id.to_vec(),
        span_id: record.start.span_id.to_vec(),
        trace_state,
        parent_span_id: record
            .start
            .parent_span_id
            .map(|id| id.to_vec())
            .unwrap_or_default(),
        // W3C flags: sampled (only sampled spans, and the audit spans of
        // admin calls, which are recorded whatever the caller's flag).
        flags: 1,
        name: record.name.to_owned(),
        kind: span::SpanKind::Server as i32,
        start_time_unix_nano,
        end_time_unix_nano: record.end_unix_nanos,
        attributes: record
            .attributes
            .into_iter()
            .map(|(key, value)| key_value(key, value))
            .collect(),
        status: Some(status),
        ..Default::default()
    }
}

fn key_value(key: &str, value: Attribute) -> KeyValue {
    let value = match value {
        Attribute::Static(text) => any_value::Value::StringValue(text.to_owned()),
        Attribute::Text(text) => any_value::Value::StringValue(text),
        Attribute::Int(int) => any_value::Value::IntValue(int),
        Attribute::Float(float) => any_value::Value::DoubleValue(float),
        Attribute::Bool(flag) => any_value::Value::BoolValue(flag),
    };
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}
