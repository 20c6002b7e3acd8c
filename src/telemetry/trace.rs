//! Audit spans through the OpenTelemetry SDK: W3C trace context in (the
//! SDK's `TraceContextPropagator`, `tracestate` kept), one SDK span per
//! call out.
//!
//! A span is started with the caller's context as its remote parent (or as
//! a new root) by the SDK's tracer and sampler, finished with its
//! attributes, and handed by `otlp::QueueProcessor` to the exporter task
//! through a bounded queue that drops and counts rather than waits, because
//! a decision must never wait on telemetry. Without an exporter there is no
//! tracer, and starting a span is a no-op.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, Key, KeyValue, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, Span};

use super::Metrics;
use super::otlp;
use crate::config::TelemetryConfig;

/// The caller's W3C trace context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace.
    pub trace_id: [u8; 16],
    /// The caller's span, parent of ours.
    pub span_id: [u8; 8],
    /// The caller's sampling decision.
    pub sampled: bool,
    /// The `tracestate` header as received (bounded).
    pub trace_state: String,
    /// The same, as the SDK's propagator extracted it: the parent of our
    /// spans, `tracestate` included.
    pub span_context: SpanContext,
}

impl TraceContext {
    /// Parses `traceparent` (and `tracestate`, if any). Returns `None` for a
    /// malformed header, which the W3C specification says to ignore (the
    /// call then starts a new trace).
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        let mut parts = traceparent.trim().split('-');
        let version = parts.next()?;
        let trace_id = parts.next()?;
        let span_id = parts.next()?;
        let flags = parts.next()?;
        // Version 00 has exactly four fields; later versions may add more.
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        // Lower-case hex only, like every other field (found by fuzzing:
        // `from_str_radix` also took "Aa").
        decode_hex::<1>(version)?;
        let trace_id: [u8; 16] = decode_hex(trace_id)?;
        let span_id: [u8; 8] = decode_hex(span_id)?;
        let [flags]: [u8; 1] = decode_hex(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let trace_state = tracestate
            .filter(|state| state.len() <= 512)
            .unwrap_or_default()
            .to_owned();
        // The header passed the checks above (which fuzzing found the
        // SDK's parser too lenient for: it takes short ids and "Aa"), so
        // the SDK's propagator makes the parent, with its `tracestate`.
        let headers = Headers {
            traceparent: traceparent.trim(),
            tracestate: (!trace_state.is_empty()).then_some(trace_state.as_str()),
        };
        let span_context = TraceContextPropagator::new()
            .extract(&headers)
            .span()
            .span_context()
            .clone();
        if !span_context.is_valid() {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
            trace_state,
            span_context,
        })
    }
}

/// The two W3C headers, as the propagator reads them.
struct Headers<'h> {
    traceparent: &'h str,
    tracestate: Option<&'h str>,
}

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(self.traceparent),
            "tracestate" => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

fn decode_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    // Lower-case only, as the specification requires (the hex crate also
    // takes upper case).
    if text.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

/// Lower-case hex of `bytes`: trace and span ids, decision ids. Into one
/// buffer of the right size: `hex::encode` collects a char iterator, which
/// cost ~940 instructions per decision id (callgrind), a tenth of a
/// DecideStream item.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    // Cannot fail: the buffer is exactly twice the input.
    let _ = hex::encode_to_slice(bytes, &mut out);
    // Cannot fail either: hex digits are ASCII.
    String::from_utf8(out).unwrap_or_default()
}

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attribute {
    /// A string known at compile time.
    Static(&'static str),
    /// A string.
    Text(String),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
}

impl From<Attribute> for Value {
    /// Without a copy: a static string stays static, an owned one moves.
    fn from(attribute: Attribute) -> Value {
        match attribute {
            Attribute::Static(text) => Value::from(text),
            Attribute::Text(text) => Value::from(text),
            Attribute::Int(int) => Value::I64(int),
            Attribute::Float(float) => Value::F64(float),
            Attribute::Bool(flag) => Value::Bool(flag),
        }
    }
}

/// A started, sampled span.
#[derive(Debug)]
pub struct SpanStart {
    span: Span,
}

impl SpanStart {
    /// The trace it belongs to.
    pub fn trace_id(&self) -> [u8; 16] {
        self.span.span_context().trace_id().to_bytes()
    }
}

/// Starts and finishes spans; cheap to clone.
#[derive(Clone, Debug)]
pub struct Tracer {
    /// The configured sampler's tracer; `None` when tracing is off.
    sampled: Option<SdkTracer>,
    /// An always-on tracer for the audit record of admin calls.
    always: Option<SdkTracer>,
}

/// Stops the exporter, flushing what is queued, when shut down.
#[derive(Debug)]
pub struct TracerGuard {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TracerGuard {
    /// Flushes queued spans (waiting at most `limit`) and stops the exporter.
    pub async fn shutdown(mut self, limit: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            if tokio::time::timeout(limit, task).await.is_err() {
                tracing::warn!("span exporter did not flush in time");
            }
        }
    }
}

/// retryd's own RPC of a span, by its name: the server side of the
/// OpenTelemetry RPC conventions (`rpc.system`, `rpc.service`,
/// `rpc.method`). `rpc.grpc.status_code` is not retryd's own on a
/// decision span: there it is the reported attempt's (see `attr`).
fn rpc_of(name: &str) -> (&'static str, &'static str) {
    match name {
        super::SPAN_DECIDE => (super::RPC_SERVICE_DECIDER, "Decide"),
        super::SPAN_REPORT_TRAFFIC => (super::RPC_SERVICE_DECIDER, "ReportTraffic"),
        super::SPAN_GET_BUDGET => (super::RPC_SERVICE_ADMIN, "GetBudget"),
        super::SPAN_LIST_BUDGETS => (super::RPC_SERVICE_ADMIN, "ListBudgets"),
        super::SPAN_SET_RETRIES_ENABLED => (super::RPC_SERVICE_ADMIN, "SetRetriesEnabled"),
        super::SPAN_RELOAD_CONFIG => (super::RPC_SERVICE_ADMIN, "ReloadConfig"),
        _ => ("", ""),
    }
}

impl Tracer {
    /// A tracer that records nothing.
    pub fn disabled() -> Tracer {
        Tracer {
            sampled: None,
            always: None,
        }
    }

    /// The tracer `config` asks for: disabled without an exporter, else
    /// exporting from a task on the current runtime, holding at most
    /// `config.export_queue` spans in waiting. Connections are made lazily
    /// and retried, so an unreachable collector never stops retryd from
    /// starting.
    pub fn from_config(
        config: &TelemetryConfig,
        metrics: Arc<Metrics>,
    ) -> Result<(Tracer, Option<TracerGuard>), String> {
        let Some(export) = &config.otlp else {
            return Ok((Tracer::disabled(), None));
        };
        let started = otlp::start(config, export, metrics)?;
        Ok((
            Tracer {
                sampled: Some(started.sampled),
                always: Some(started.always),
            },
            Some(TracerGuard {
                stop: Some(started.stop),
                task: Some(started.task),
            }),
        ))
    }

    /// Starts a span under `parent` (or a new root), or returns `None` when
    /// tracing is off or the sampler says no (by default a parent's
    /// sampling decision is followed and roots are sampled).
    pub fn start(&self, parent: Option<&TraceContext>) -> Option<SpanStart> {
        let span = Tracer::span(self.sampled.as_ref()?, parent);
        span.is_recording().then_some(SpanStart { span })
    }

    /// Starts a span that is recorded whatever the caller's sampling flag
    /// and the sampler say, for the audit record of an admin call: a caller
    /// must not be able to switch off the record of its own acts. `None`
    /// only when tracing is off.
    pub fn start_always(&self, parent: Option<&TraceContext>) -> Option<SpanStart> {
        let span = Tracer::span(self.always.as_ref()?, parent);
        Some(SpanStart { span })
    }

    fn span(tracer: &SdkTracer, parent: Option<&TraceContext>) -> Span {
        let context = match parent {
            Some(parent) => Context::new().with_remote_span_context(parent.span_context.clone()),
            None => Context::new(),
        };
        // The name is known when the call ends (`finish`); the kind now.
        tracer
            .span_builder("retry")
            .with_kind(SpanKind::Server)
            .start_with_context(tracer, &context)
    }

    /// Finishes a span and hands it to the exporter's queue (which drops,
    /// and counts, when full). The RPC attributes are added from `name`
    /// unless `attributes` name the method already (a stream's items).
    pub fn finish(
        &self,
        start: SpanStart,
        name: &'static str,
        attributes: Vec<(&'static str, Attribute)>,
        error: Option<String>,
    ) {
        let mut span = start.span;
        span.update_name(name);
        let (service, method) = rpc_of(name);
        let names_method = attributes
            .iter()
            .any(|(key, _)| *key == super::attr::RPC_METHOD);
        span.set_attributes(
            attributes
                .into_iter()
                .map(|(key, value)| KeyValue::new(Key::from_static_str(key), value)),
        );
        span.set_attribute(KeyValue::new(super::attr::RPC_SYSTEM, "grpc"));
        span.set_attribute(KeyValue::new(super::attr::RPC_SERVICE, service));
        if !names_method {
            span.set_attribute(KeyValue::new(super::attr::RPC_METHOD, method));
        }
        if let Some(message) = error {
            span.set_status(Status::error(message));
        }
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_valid_traceparent() {
        let context = TraceContext::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        assert_eq!(hex(&context.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&context.span_id), "00f067aa0ba902b7");
        assert!(context.sampled);
        assert_eq!(context.trace_state, "congo=t61rcWkgMzE");
        let unsampled = TraceContext::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            None,
        )
        .unwrap();
        assert!(!unsampled.sampled);
    }

    #[test]
    fn ignores_malformed_traceparents() {
        for raw in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "Aa-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(raw, None), None, "{raw:?}");
        }
        // A future version may carry more fields.
        assert!(
            TraceContext::parse(
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
                None
            )
            .is_some()
        );
    }
}
