//! Audit spans in the OpenTelemetry model: W3C trace context in (the SDK's
//! `TraceContextPropagator`, `tracestate` kept), one span per call out.
//!
//! A span is started with the caller's context as its remote parent (or as
//! a new root) the way the SDK's tracer starts one: ids from the SDK's
//! `RandomIdGenerator`, the decision from the SDK's `Sampler` (configured
//! by `telemetry.sampling_*` or `OTEL_TRACES_SAMPLER`), the trace state it
//! returns. What is kept is only that start ([`SpanStart`]); a decision is
//! finished into a fixed-size record ([`DecisionSpan`]) and handed to the
//! exporter task through a bounded queue that drops and counts rather than
//! waits, because a decision must never wait on telemetry. The SDK's own
//! span object (a `Vec<KeyValue>` built on the decision's thread, then
//! regrouped and converted by the generic OTLP exporter) cost a traced
//! decision ~45k instructions (issue 34). Without an exporter there is no
//! pipeline, and starting a span is a no-op.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanKind, TraceContextExt, TraceFlags};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, ShouldSample,
};

use super::Metrics;
use super::otlp;
use super::span::{Body, DecisionSpan, Finished, SpanStart};
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

/// Starts and finishes spans; cheap to clone.
#[derive(Clone, Debug)]
pub struct Tracer {
    /// The sampler, ids and export queue; `None` when tracing is off.
    pipeline: Option<Arc<otlp::Pipeline>>,
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
pub(super) fn rpc_of(name: &str) -> (&'static str, &'static str) {
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
        Tracer { pipeline: None }
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
                pipeline: Some(Arc::new(started.pipeline)),
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
        let pipeline = self.pipeline.as_ref()?;
        start_with(&pipeline.sampler, parent)
    }

    /// Starts a span that is recorded whatever the caller's sampling flag
    /// and the sampler say, for the audit record of an admin call: a caller
    /// must not be able to switch off the record of its own acts. `None`
    /// only when tracing is off.
    pub fn start_always(&self, parent: Option<&TraceContext>) -> Option<SpanStart> {
        self.pipeline.as_ref()?;
        start_with(&Sampler::AlwaysOn, parent)
    }

    /// The export queue, for a DecideStream's back-pressure (`pace.rs`);
    /// `None` when tracing is off.
    pub fn backlog(&self) -> Option<Arc<dyn super::Backlog>> {
        self.pipeline
            .as_ref()
            .map(|pipeline| Arc::clone(pipeline) as Arc<dyn super::Backlog>)
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
        self.push(
            start,
            Body::Other {
                name,
                attributes,
                error,
            },
        );
    }

    /// A batch for one DecideStream's spans (`otlp::SpanBatch`); `None`
    /// when tracing is off.
    pub(crate) fn stream_batch(&self) -> Option<Arc<otlp::SpanBatch>> {
        self.pipeline.as_ref().map(otlp::SpanBatch::new)
    }

    /// Finishes a decision's span (`retry.decide`) from its record, at
    /// `end`: its start plus the decision's latency, measured once for the
    /// histogram and the span (a clock read is ~2% of a traced DecideStream
    /// item). Into its stream's `batch`, if it has one.
    pub(crate) fn finish_decision(
        &self,
        start: SpanStart,
        span: DecisionSpan,
        end: SystemTime,
        batch: Option<&otlp::SpanBatch>,
    ) {
        if let Some(pipeline) = &self.pipeline {
            let finished = Finished {
                start,
                end,
                body: Body::Decision(span),
            };
            match batch {
                Some(batch) => batch.push(finished),
                None => pipeline.push(finished),
            }
        }
    }

    fn push(&self, start: SpanStart, body: Body) {
        if let Some(pipeline) = &self.pipeline {
            pipeline.push(Finished {
                start,
                end: SystemTime::now(),
                body,
            });
        }
    }
}

/// What the SDK's tracer does to start a span, without building one: ids
/// from the SDK's generator, the SDK's sampler asked with the caller's
/// context, the trace flags and state it gives.
fn start_with(sampler: &Sampler, parent: Option<&TraceContext>) -> Option<SpanStart> {
    let ids = RandomIdGenerator::default();
    let context = match parent {
        Some(parent) => Context::new().with_remote_span_context(parent.span_context.clone()),
        None => Context::new(),
    };
    let span_id = ids.new_span_id();
    let (trace_id, parent_flags) = match parent {
        Some(parent) => (
            parent.span_context.trace_id(),
            parent.span_context.trace_flags(),
        ),
        None => (ids.new_trace_id(), TraceFlags::default()),
    };
    // The name is known when the call ends; the sampler sees the one the
    // SDK's span had at its start.
    let result = sampler.should_sample(
        Some(&context),
        trace_id,
        "retry",
        &SpanKind::Server,
        &[],
        &[],
    );
    let flags = match result.decision {
        SamplingDecision::Drop => return None,
        SamplingDecision::RecordOnly => parent_flags.with_sampled(false),
        SamplingDecision::RecordAndSample => parent_flags.with_sampled(true),
    };
    Some(SpanStart {
        trace_id: trace_id.to_bytes(),
        span_id: span_id.to_bytes(),
        parent_span_id: parent.map(|parent| parent.span_context.span_id().to_bytes()),
        flags: flags.to_u8(),
        trace_state: result.trace_state,
        start: SystemTime::now(),
    })
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
