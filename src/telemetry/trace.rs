//! Audit spans: W3C trace context in, one span per call out.
//!
//! A span is started with the caller's `traceparent` as its parent (or as a
//! new root), finished with its attributes, and handed to the exporter task
//! through a bounded queue. `try_send` never waits: a full queue drops the
//! span and counts it, because a decision must never wait on telemetry.
//! Without an OTLP endpoint there is no queue and starting a span is a
//! no-op.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::Rng;
use tokio::sync::mpsc;

use super::Metrics;
use super::otlp;

/// The caller's W3C trace context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace.
    pub trace_id: [u8; 16],
    /// The caller's span, parent of ours.
    pub span_id: [u8; 8],
    /// The caller's sampling decision.
    pub sampled: bool,
    /// The `tracestate` header, passed along untouched.
    pub trace_state: String,
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
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
            trace_state,
        })
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

/// A started, sampled span.
#[derive(Clone, Debug)]
pub struct SpanStart {
    /// The trace it belongs to.
    pub trace_id: [u8; 16],
    /// Its own id.
    pub span_id: [u8; 8],
    /// The caller's span, if the call carried a trace context.
    pub parent_span_id: Option<[u8; 8]>,
    trace_state: String,
    start_unix_nanos: u64,
}

/// A finished span on its way to the exporter.
#[derive(Debug)]
pub(super) struct SpanRecord {
    pub(super) name: &'static str,
    pub(super) start: SpanStart,
    pub(super) end_unix_nanos: u64,
    pub(super) attributes: Vec<(&'static str, Attribute)>,
    pub(super) error: Option<String>,
}

impl SpanRecord {
    pub(super) fn trace_state(&self) -> &str {
        &self.start.trace_state
    }
    pub(super) fn start_unix_nanos(&self) -> u64 {
        self.start.start_unix_nanos
    }
}

/// Starts and finishes spans; cheap to clone.
#[derive(Clone, Debug)]
pub struct Tracer {
    queue: Option<mpsc::Sender<SpanRecord>>,
    sampling_ratio: f64,
    metrics: Arc<Metrics>,
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

impl Tracer {
    /// A tracer that records nothing.
    pub fn disabled(metrics: Arc<Metrics>) -> Tracer {
        Tracer {
            queue: None,
            sampling_ratio: 0.0,
            metrics,
        }
    }

    /// A tracer exporting to `endpoint` over OTLP/gRPC from a task on the
    /// current runtime, holding at most `queue_capacity` spans in waiting. The connection is made lazily and retried, so an
    /// unreachable collector never stops retryd from starting.
    pub fn start_exporter(
        endpoint: &str,
        sampling_ratio: f64,
        queue_capacity: usize,
        metrics: Arc<Metrics>,
    ) -> Result<(Tracer, TracerGuard), String> {
        let (queue, receiver) = mpsc::channel(queue_capacity.max(1));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = otlp::spawn(endpoint, receiver, stopped, Arc::clone(&metrics))?;
        Ok((
            Tracer {
                queue: Some(queue),
                sampling_ratio,
                metrics,
            },
            TracerGuard {
                stop: Some(stop),
                task: Some(task),
            },
        ))
    }

    /// Starts a span under `parent` (or a new root), or returns `None` when
    /// tracing is off or the span is not sampled. A parent's sampling
    /// decision is followed; roots are sampled at the configured ratio.
    pub fn start(&self, parent: Option<&TraceContext>) -> Option<SpanStart> {
        self.queue.as_ref()?;
        match parent {
            Some(parent) if !parent.sampled => None,
            Some(_) => Some(self.span(parent)),
            None => {
                let ratio = self.sampling_ratio;
                (ratio > 0.0 && rand::rng().random::<f64>() < ratio).then(|| self.span(None))
            }
        }
    }

    /// Starts a span that is recorded whatever the caller's sampling flag
    /// and the sampling ratio say, for the audit record of an admin call: a
    /// caller must not be able to switch off the record of its own acts.
    /// `None` only when tracing is off.
    pub fn start_always(&self, parent: Option<&TraceContext>) -> Option<SpanStart> {
        self.queue.as_ref()?;
        Some(self.span(parent))
    }

    fn span(&self, parent: Option<&TraceContext>) -> SpanStart {
        let mut rng = rand::rng();
        let (trace_id, parent_span_id, trace_state) = match parent {
            Some(parent) => (
                parent.trace_id,
                Some(parent.span_id),
                parent.trace_state.clone(),
            ),
            None => (rng.random::<[u8; 16]>(), None, String::new()),
        };
        SpanStart {
            trace_id,
            span_id: rng.random::<[u8; 8]>(),
            parent_span_id,
            trace_state,
            start_unix_nanos: unix_nanos(),
        }
    }

    /// Finishes a span and queues it for export, dropping it (and counting
    /// the drop) if the queue is full.
    pub fn finish(
        &self,
        start: SpanStart,
        name: &'static str,
        attributes: Vec<(&'static str, Attribute)>,
        error: Option<String>,
    ) {
        let Some(queue) = &self.queue else { return };
        let record = SpanRecord {
            name,
            start,
            end_unix_nanos: unix_nanos(),
            attributes,
            error,
        };
        if queue.try_send(record).is_err() {
            self.metrics.spans_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
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
