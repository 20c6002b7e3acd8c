//! The span pipeline: [`Pipeline`], the sampler and a bounded queue of
//! finished spans, and a task that batches them, encodes each batch
//! straight into OTLP protobuf (`encode.rs`: one resource, one scope) and
//! sends it over gRPC (tonic's `Channel`, the encoder's bytes as the HTTP/2
//! body) or HTTP/protobuf (hyper through `opentelemetry-http`), TLS with
//! the configured CA, headers, the exporter's timeout.
//!
//! Why not the SDK's `BatchSpanProcessor` and `opentelemetry-otlp`: the
//! processor drops when its queue is full too, but counts the drops only
//! for its own shutdown log line, and retryd's operators alert on
//! `retryd_spans_dropped_total`; the exporter's generic transform (grouping
//! by resource and scope, converting every `KeyValue`) was most of a
//! traced decision's cost (issue 34). The queue here is a vector under a
//! lock that a decision holds for one `push` and never waits for beyond
//! that (tokio's bounded channel, used before, took a semaphore permit per
//! span on each side, the receiver's under a lock of its own); the export
//! task takes everything queued in one swap, and a DecideStream's spans
//! come 64 at a time from a batch of its own ([`SpanBatch`]), its vector
//! handed over whole rather than its spans copied. A decision
//! wakes the task only once a batch is queued (or the batch window
//! passes), not per span. A full queue drops, counts and warns (at most
//! every ten seconds). Up to sixteen exports are on their way at once,
//! each with the exporter's timeout; a failed export is logged (at most
//! every ten seconds) and counted, and its spans are lost, never retried:
//! the audit trail is best effort, the decisions are not.

mod encode;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use opentelemetry::KeyValue;
use opentelemetry_http::HttpClient as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::Sampler;
use prost::Message as _;
use rand::Rng;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio_rustls::rustls;

use super::pace::{Backlog, Room};
use super::span::Finished;
use super::{Metrics, Throttle};
use crate::config::{OtlpExport, OtlpProtocol, Sampling, TelemetryConfig};

/// Spans per export request, at most.
const MAX_BATCH: usize = 512;
/// A DecideStream's spans go to the queue this many at a time, at most
/// (`SpanBatch`).
const STREAM_BATCH: usize = 64;
/// How long a span may wait for its batch to fill.
const BATCH_WINDOW: Duration = Duration::from_millis(200);
/// Export requests on their way at once, at most: 8,192 spans, ~6 MB of
/// requests. With four, the exporter drained at most 2,048 spans per
/// receiver round trip, and a traced DecideStream left the two cores idle
/// half the time waiting for it (BENCHMARKS.md, issue 34, 2026-12-04).
const MAX_IN_FLIGHT: usize = 16;
/// How often at most a full queue or a failed export is warned about.
const WARNING_INTERVAL: Duration = Duration::from_secs(10);
/// The OTLP/gRPC method.
const GRPC_EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Finished spans waiting for the export task, at most `capacity`.
#[derive(Debug)]
struct Queue {
    spans: Mutex<Waiting>,
    /// How many spans wait, read without the lock: a DecideStream's
    /// back-pressure reads it before every item.
    waiting: AtomicUsize,
    capacity: usize,
    /// Emptied batch vectors, for the streams' next batches.
    spare: Mutex<Vec<Vec<Finished>>>,
    /// Every tracer is gone: the export task sends what is left and ends.
    closed: AtomicBool,
}

/// What waits for the export task: spans queued one at a time, and the
/// streams' batches as they were handed over. A batch is moved in whole,
/// its vector swapped for a spare one: copying its spans into one vector
/// (456 bytes each, into memory the other core wrote last) was 1.5% of a
/// traced stream's CPU under perf (issue 34).
#[derive(Debug, Default)]
struct Waiting {
    spans: Vec<Finished>,
    batches: Vec<Vec<Finished>>,
    /// Spans in both.
    len: usize,
}

impl Waiting {
    fn iter(&self) -> impl Iterator<Item = &Finished> {
        self.spans.iter().chain(self.batches.iter().flatten())
    }
}

impl Queue {
    fn new(capacity: usize) -> Queue {
        Queue {
            // Room for a few batches from the start: growing under the
            // lock is a copy of every span waiting.
            spans: Mutex::new(Waiting {
                spans: Vec::with_capacity(capacity.min(4 * MAX_BATCH)),
                batches: Vec::new(),
                len: 0,
            }),
            waiting: AtomicUsize::new(0),
            capacity,
            spare: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Queues `span` and says how many now wait, or `None` (the span
    /// dropped) when the queue is full.
    fn push(&self, span: Finished) -> Option<usize> {
        // A panic cannot leave the vector half pushed: poisoning is ignored.
        let mut queued = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        if queued.len >= self.capacity {
            // The span's strings are freed after the lock is let go.
            drop(queued);
            return None;
        }
        queued.spans.push(span);
        queued.len += 1;
        let waiting = queued.len;
        self.waiting.store(waiting, Ordering::Relaxed);
        Some(waiting)
    }

    /// Queues as many of `spans` as there is room for, emptying it (all
    /// of them by taking its vector, which a spare one replaces); how many
    /// now wait, and how many were dropped.
    fn push_all(&self, spans: &mut Vec<Finished>) -> (usize, usize) {
        // Taken before the queue's lock, never under it.
        let spare = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(STREAM_BATCH));
        let mut queued = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        let room = self.capacity.saturating_sub(queued.len);
        let dropped = spans.len().saturating_sub(room);
        queued.len += spans.len() - dropped;
        if dropped == 0 {
            queued.batches.push(std::mem::replace(spans, spare));
        } else {
            queued.spans.extend(spans.drain(..spans.len() - dropped));
        }
        let waiting = queued.len;
        self.waiting.store(waiting, Ordering::Relaxed);
        drop(queued);
        // Dropped ones are freed after the lock is let go.
        spans.clear();
        (waiting, dropped)
    }

    /// Moves every span waiting into `into`, which must be empty; the
    /// queue keeps `into`'s allocation for the next spans.
    fn take(&self, into: &mut Waiting) {
        debug_assert!(into.spans.is_empty() && into.batches.is_empty());
        let mut queued = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::swap(&mut *queued, into);
        queued.len = 0;
        self.waiting.store(0, Ordering::Relaxed);
    }

    /// Empties what was taken, keeping the batches' vectors for reuse (as
    /// many as could be waiting at once).
    fn recycle(&self, taken: &mut Waiting) {
        taken.spans.clear();
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        for mut batch in taken.batches.drain(..) {
            if spare.len() >= self.capacity.div_ceil(STREAM_BATCH) {
                break;
            }
            // The spans' strings are freed here, on the export task.
            batch.clear();
            spare.push(batch);
        }
        // The batches not kept went with the drain.
    }

    fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

/// What the tracer holds: the sampler and the producer side of the queue.
#[derive(Debug)]
pub(super) struct Pipeline {
    pub(super) sampler: Sampler,
    queue: Arc<Queue>,
    /// Wake the export task once this many spans wait.
    wake_at: usize,
    /// Set once the task was woken for the spans waiting; the task clears it.
    woken: Arc<AtomicBool>,
    wake: Arc<Notify>,
    metrics: Arc<Metrics>,
    drops: Throttle,
    /// Back-pressure (`pace.rs`): a DecideStream waits while this many
    /// spans or more are queued (half the queue).
    backlog_at: usize,
    /// The export task's progress, which streams waiting wait for.
    room: Arc<Room>,
    /// The DecideStreams' batches, which the export task empties at every
    /// batch window.
    batches: Arc<Batches>,
}

/// The live `SpanBatch`es.
type Batches = Mutex<Vec<std::sync::Weak<SpanBatch>>>;

impl Backlog for Pipeline {
    fn over_half(&self) -> bool {
        self.queue.waiting() >= self.backlog_at
    }

    fn room(&self) -> &Room {
        &self.room
    }

    fn count_wait(&self) {
        self.metrics
            .span_export_waits
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Pipeline {
    /// Queues a finished span; drops, counts and warns when the queue is
    /// full.
    pub(super) fn push(&self, finished: Finished) {
        match self.queue.push(finished) {
            Some(waiting) => self.queued(waiting),
            None => self.dropped(1),
        }
    }

    /// Queues `spans` (emptying it), as [`Pipeline::push`] does each.
    fn push_all(&self, spans: &mut Vec<Finished>) {
        let (waiting, dropped) = self.queue.push_all(spans);
        self.queued(waiting);
        if dropped > 0 {
            self.dropped(dropped as u64);
        }
    }

    /// Wakes the export task once a batch waits.
    fn queued(&self, waiting: usize) {
        if waiting >= self.wake_at && !self.woken.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    fn dropped(&self, spans: u64) {
        self.metrics
            .spans_dropped
            .fetch_add(spans, Ordering::Relaxed);
        self.drops.log(|suppressed| {
            tracing::warn!(
                suppressed,
                "the span export queue is full (telemetry.export_queue): spans dropped, counted in retryd_spans_dropped_total"
            );
        });
    }
}

/// One DecideStream's finished spans on their way to the queue. A stream
/// decides an item after the other on one task, each item's span pushed
/// under this batch's own lock, which no other core touches; the shared
/// queue's lock, which the runtime's every worker takes, is taken once per
/// [`STREAM_BATCH`] spans. (One lock per span on the shared queue was 5-9%
/// of a traced stream's CPU under perf, mostly its cache line moving
/// between the two cores.) The rest goes to the queue when the stream has
/// no item ready (`Paced`), when the stream ends, and, so that a stream
/// whose caller stopped reading holds no span back for long, by the
/// export task at every batch window.
#[derive(Debug)]
pub(crate) struct SpanBatch {
    spans: Mutex<Vec<Finished>>,
    pipeline: Arc<Pipeline>,
}

impl SpanBatch {
    /// A batch for one stream, known to the export task.
    pub(super) fn new(pipeline: &Arc<Pipeline>) -> Arc<SpanBatch> {
        let batch = Arc::new(SpanBatch {
            spans: Mutex::new(Vec::with_capacity(STREAM_BATCH)),
            pipeline: Arc::clone(pipeline),
        });
        let mut batches = pipeline
            .batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // A new stream is also when the ended ones are forgotten.
        batches.retain(|batch| batch.strong_count() > 0);
        batches.push(Arc::downgrade(&batch));
        batch
    }

    pub(super) fn push(&self, finished: Finished) {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        spans.push(finished);
        if spans.len() >= STREAM_BATCH {
            self.pipeline.push_all(&mut spans);
        }
    }

    /// Queues what the batch holds.
    pub(crate) fn flush(&self) {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        if !spans.is_empty() {
            self.pipeline.push_all(&mut spans);
        }
    }
}

impl Drop for SpanBatch {
    fn drop(&mut self) {
        self.flush();
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.queue.closed.store(true, Ordering::Release);
        self.wake.notify_one();
    }
}

/// What `start` made.
pub(super) struct Started {
    pub(super) pipeline: Pipeline,
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

/// Builds the pipeline and spawns the export task on the current runtime.
pub(super) fn start(
    config: &TelemetryConfig,
    export: &OtlpExport,
    metrics: Arc<Metrics>,
) -> Result<Started, String> {
    let resource = resource(config);
    let scope = opentelemetry::InstrumentationScope::builder("retryd")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let encoder = match export.protocol {
        OtlpProtocol::Grpc => encode::Encoder::new(&resource, &scope).grpc(),
        OtlpProtocol::HttpProtobuf => encode::Encoder::new(&resource, &scope),
    };
    let transport = Transport::new(export)?;
    let capacity = config.export_queue.max(1);
    let queue = Arc::new(Queue::new(capacity));
    let batches = Arc::new(Batches::default());
    let woken = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    let room = Arc::new(Room::new(
        "the span exporter is not keeping up: DecideStreams no longer wait for it, and spans are dropped when its queue is full (retryd_spans_dropped_total)",
    ));
    let pipeline = Pipeline {
        sampler: sampler(config.sampling),
        queue: Arc::clone(&queue),
        wake_at: MAX_BATCH.min(capacity / 2).max(1),
        woken: Arc::clone(&woken),
        wake: Arc::clone(&wake),
        metrics: Arc::clone(&metrics),
        drops: Throttle::new(WARNING_INTERVAL, 1),
        backlog_at: (capacity / 2).max(1),
        room: Arc::clone(&room),
        batches: Arc::clone(&batches),
    };
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(run(
        Exporter {
            encoder,
            transport: Arc::new(transport),
            endpoint: export.endpoint.clone(),
            metrics,
            last_warning: None,
        },
        queue,
        batches,
        Wakes {
            woken,
            wake,
            room,
            backlog_at: (capacity / 2).max(1),
        },
        stopped,
    ));
    Ok(Started {
        pipeline,
        stop,
        task,
    })
}

/// Where batches go.
// One per process, made once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Transport {
    Grpc {
        channel: tonic::transport::Channel,
        /// The configured headers, and gRPC's own.
        headers: http::HeaderMap,
        timeout: Duration,
    },
    Http {
        client: opentelemetry_http::hyper::HyperClient<
            hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        >,
        endpoint: http::Uri,
        headers: http::HeaderMap,
        timeout: Duration,
    },
}

impl Transport {
    fn new(export: &OtlpExport) -> Result<Transport, String> {
        let roots = export.ca_roots()?;
        match export.protocol {
            OtlpProtocol::Grpc => {
                let mut metadata = tonic::metadata::MetadataMap::new();
                for (name, value) in &export.headers {
                    let key = tonic::metadata::MetadataKey::from_bytes(name.as_bytes())
                        .map_err(|_| format!("telemetry: header {name:?} is not valid"))?;
                    let value = value.parse().map_err(|_| {
                        format!("telemetry: the value of header {name:?} is not valid")
                    })?;
                    metadata.insert(key, value);
                }
                let mut endpoint = tonic::transport::Endpoint::from_shared(export.endpoint.clone())
                    .map_err(|err| format!("telemetry: the OTLP endpoint: {err}"))?
                    .timeout(export.timeout);
                if export.endpoint.starts_with("https://") {
                    let tls = match &export.ca_pem {
                        Some(pem) => tonic::transport::ClientTlsConfig::new()
                            .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                        None => tonic::transport::ClientTlsConfig::new().with_webpki_roots(),
                    };
                    endpoint = endpoint
                        .tls_config(tls)
                        .map_err(|err| format!("telemetry: TLS: {err}"))?;
                }
                let mut headers = metadata.into_headers();
                headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
                headers.insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/grpc"),
                );
                Ok(Transport::Grpc {
                    channel: endpoint.connect_lazy(),
                    headers,
                    timeout: export.timeout,
                })
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
                let mut headers = http::HeaderMap::new();
                for (name, value) in &export.headers {
                    let key = http::HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| format!("telemetry: header {name:?} is not valid"))?;
                    let value = http::HeaderValue::from_str(value).map_err(|_| {
                        format!("telemetry: the value of header {name:?} is not valid")
                    })?;
                    headers.insert(key, value);
                }
                headers.insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/x-protobuf"),
                );
                let endpoint = export
                    .endpoint
                    .parse()
                    .map_err(|err| format!("telemetry: the OTLP endpoint: {err}"))?;
                Ok(Transport::Http {
                    client,
                    endpoint,
                    headers,
                    timeout: export.timeout,
                })
            }
        }
    }

    /// Sends one encoded request; how many spans the receiver rejected, if
    /// it said so.
    async fn send(&self, body: Bytes) -> Result<u64, String> {
        match self {
            Transport::Grpc {
                channel,
                headers,
                timeout,
            } => {
                // The request is the encoder's bytes, gRPC prefix included,
                // handed to the channel as they are: tonic's client would
                // copy them into an encode buffer of its own, a new one
                // each request.
                let call = async {
                    use tonic::codegen::Service as _;
                    let mut channel = channel.clone();
                    std::future::poll_fn(|cx| channel.poll_ready(cx))
                        .await
                        .map_err(|err| format!("connection: {}", error_chain(&err)))?;
                    let mut request =
                        http::Request::new(tonic::body::Body::new(http_body_util::Full::new(body)));
                    *request.method_mut() = http::Method::POST;
                    *request.uri_mut() = http::Uri::from_static(GRPC_EXPORT);
                    *request.version_mut() = http::Version::HTTP_2;
                    *request.headers_mut() = headers.clone();
                    let response = channel
                        .call(request)
                        .await
                        .map_err(|err| format!("connection: {}", error_chain(&err)))?;
                    grpc_answer(response).await
                };
                tokio::time::timeout(*timeout, call)
                    .await
                    .map_err(|_| "timed out".to_owned())?
            }
            Transport::Http {
                client,
                endpoint,
                headers,
                timeout,
            } => {
                let mut request = http::Request::new(body);
                *request.method_mut() = http::Method::POST;
                *request.uri_mut() = endpoint.clone();
                *request.headers_mut() = headers.clone();
                let response = tokio::time::timeout(*timeout, client.send_bytes(request))
                    .await
                    .map_err(|_| "timed out".to_owned())?
                    .map_err(|err| err.to_string())?;
                if !response.status().is_success() {
                    return Err(format!("HTTP status {}", response.status()));
                }
                Ok(ExportTraceServiceResponse::decode(response.into_body())
                    .map_or(0, |response| rejected(&response)))
            }
        }
    }
}

/// What a gRPC answer says: the spans rejected, or the failure (a status
/// other than OK, in the headers of a trailers-only answer or in the
/// trailers).
async fn grpc_answer(response: http::Response<tonic::body::Body>) -> Result<u64, String> {
    use http_body_util::BodyExt as _;
    let (head, body) = response.into_parts();
    if let Some(failure) = grpc_failure(&head.headers) {
        return Err(failure);
    }
    if head.status != http::StatusCode::OK {
        return Err(format!("HTTP status {}", head.status));
    }
    let answer = body
        .collect()
        .await
        .map_err(|err| format!("the answer: {err}"))?;
    match answer.trailers() {
        Some(trailers) if trailers.contains_key(GRPC_STATUS) => {
            if let Some(failure) = grpc_failure(trailers) {
                return Err(failure);
            }
        }
        // A trailers-only OK has its status in the headers.
        _ if head.headers.contains_key(GRPC_STATUS) => {}
        _ => return Err("the answer has no grpc-status".to_owned()),
    }
    // One message, not compressed (none was asked for), or none.
    let bytes = answer.to_bytes();
    let message = match bytes.split_first_chunk::<5>() {
        Some(([0, len @ ..], rest)) if rest.len() == u32::from_be_bytes(*len) as usize => rest,
        Some(_) => return Err("the answer is not one uncompressed message".to_owned()),
        None => &[],
    };
    ExportTraceServiceResponse::decode(message)
        .map(|response| rejected(&response))
        .map_err(|err| format!("the answer: {err}"))
}

const GRPC_STATUS: &str = "grpc-status";

/// `Some` naming the code and message when `headers` carry a grpc-status
/// other than OK.
fn grpc_failure(headers: &http::HeaderMap) -> Option<String> {
    let status = headers.get(GRPC_STATUS)?;
    let code = status
        .to_str()
        .ok()
        .and_then(|code| code.parse::<i32>().ok())
        .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
    if code == tonic::Code::Ok {
        return None;
    }
    let message = headers
        .get("grpc-message")
        .map(|message| percent_decoded(message.as_bytes()))
        .unwrap_or_default();
    Some(format!("{code:?}: {message}"))
}

/// grpc-message as the receiver wrote it: percent-encoded on the wire;
/// bounded, as a receiver's words in retryd's log.
fn percent_decoded(raw: &[u8]) -> String {
    let mut bytes = Vec::with_capacity(raw.len());
    let mut rest = raw;
    while let Some((&byte, tail)) = rest.split_first() {
        let hex = |at: usize| tail.get(at).and_then(|digit| (*digit as char).to_digit(16));
        match (byte, hex(0), hex(1)) {
            (b'%', Some(high), Some(low)) => {
                bytes.push((high * 16 + low) as u8);
                rest = &tail[2..];
            }
            _ => {
                bytes.push(byte);
                rest = tail;
            }
        }
    }
    String::from_utf8_lossy(&bytes).chars().take(512).collect()
}

/// An error and its sources, as one line: a transport error's `Display`
/// alone says only "transport error".
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

/// Spans a receiver said it rejected (a partial success).
fn rejected(response: &ExportTraceServiceResponse) -> u64 {
    response
        .partial_success
        .as_ref()
        .map_or(0, |partial| partial.rejected_spans.max(0) as u64)
}

/// Encodes, sends and counts.
struct Exporter {
    encoder: encode::Encoder,
    transport: Arc<Transport>,
    endpoint: String,
    metrics: Arc<Metrics>,
    last_warning: Option<Instant>,
}

/// An export on its way: how many spans, and how it went.
type Sending = std::pin::Pin<Box<dyn Future<Output = (u64, Result<u64, String>)> + Send>>;

impl Exporter {
    /// Encodes `batch` into a request on its way.
    fn send(&mut self, batch: &[&Finished]) -> Sending {
        let count = batch.len() as u64;
        let body = self.encoder.encode(batch.iter().copied());
        let transport = Arc::clone(&self.transport);
        Box::pin(async move { (count, transport.send(body).await) })
    }

    /// Counts what an export did, and warns of a failure (at most every
    /// ten seconds).
    fn sent(&mut self, (count, result): (u64, Result<u64, String>)) {
        let (exported, failed, error) = match result {
            Ok(rejected) => {
                let rejected = rejected.min(count);
                let error =
                    (rejected > 0).then(|| format!("the receiver rejected {rejected} spans"));
                (count - rejected, rejected, error)
            }
            Err(error) => (0, count, Some(error)),
        };
        self.metrics
            .spans_exported
            .fetch_add(exported, Ordering::Relaxed);
        self.metrics
            .spans_failed
            .fetch_add(failed, Ordering::Relaxed);
        if let Some(error) = error {
            let quiet = self
                .last_warning
                .is_some_and(|at| at.elapsed() < WARNING_INTERVAL);
            if !quiet {
                self.last_warning = Some(Instant::now());
                tracing::warn!(
                    endpoint = %crate::budget::redis::redact_url(&self.endpoint),
                    %error,
                    spans = failed,
                    "span export failed; spans dropped"
                );
            }
        }
    }
}

/// How producers wake the export task.
struct Wakes {
    woken: Arc<AtomicBool>,
    wake: Arc<Notify>,
    /// Streams waiting for room are woken here each time the task makes
    /// progress (a batch on its way, the queue emptied).
    room: Arc<Room>,
    /// `Pipeline::backlog_at`.
    backlog_at: usize,
}

impl Wakes {
    /// The task made progress: streams waiting for room look again, and
    /// once under half the queue waits, the exporter is keeping up again
    /// (streams wait for it again rather than have spans dropped).
    fn progressed(&self, queue: &Queue) {
        self.room.progressed(queue.waiting() >= self.backlog_at);
    }
}

/// The export task: waits until a batch is queued or `BATCH_WINDOW`
/// passes, takes what is queued and sends it in batches of up to
/// `MAX_BATCH`, up to `MAX_IN_FLIGHT` at once, so that a receiver's round
/// trip (on a busy machine, tens of milliseconds before it is scheduled)
/// does not stop the queue from draining; on stop, or once every tracer is
/// gone, what is queued and in flight, then returns.
async fn run(
    mut exporter: Exporter,
    queue: Arc<Queue>,
    batches: Arc<Batches>,
    wakes: Wakes,
    mut stop: oneshot::Receiver<()>,
) {
    use futures::StreamExt as _;
    let mut taken = Waiting {
        spans: Vec::with_capacity(queue.capacity.min(4 * MAX_BATCH)),
        ..Waiting::default()
    };
    let mut in_flight = futures::stream::FuturesUnordered::<Sending>::new();
    // A tick that wakes keep from being put off: under load the task is
    // woken every few milliseconds, and a sleep begun anew at each turn
    // never ran out, so a stream's batch was never taken.
    let mut sweeps = tokio::time::interval(BATCH_WINDOW);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let (stopping, sweep) = tokio::select! {
            () = wakes.wake.notified() => (false, false),
            _ = sweeps.tick() => (false, true),
            Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                exporter.sent(done);
                continue;
            }
            _ = &mut stop => (true, true),
        };
        wakes.woken.store(false, Ordering::Release);
        // Read before the take: a span queued after the last tracer went
        // is impossible, so nothing is left behind.
        let closed = queue.closed.load(Ordering::Acquire);
        queue.take(&mut taken);
        if sweep {
            take_batches(&batches, &mut taken.spans);
        }
        let mut spans = taken.iter();
        loop {
            let batch: Vec<&Finished> = spans.by_ref().take(MAX_BATCH).collect();
            if batch.is_empty() {
                break;
            }
            // While this waits, the queue fills again: at most one queue's
            // worth is held here besides it.
            while in_flight.len() >= MAX_IN_FLIGHT {
                if let Some(done) = in_flight.next().await {
                    exporter.sent(done);
                }
            }
            in_flight.push(exporter.send(&batch));
            wakes.progressed(&queue);
        }
        drop(spans);
        queue.recycle(&mut taken);
        wakes.progressed(&queue);
        if stopping || closed {
            while let Some(done) = in_flight.next().await {
                exporter.sent(done);
            }
            return;
        }
    }
}

/// Moves what the streams' batches hold into `taken`: a span waits at most
/// a batch window in a stream's batch.
fn take_batches(batches: &Batches, taken: &mut Vec<Finished>) {
    let batches: Vec<Arc<SpanBatch>> = {
        let mut batches = batches.lock().unwrap_or_else(PoisonError::into_inner);
        batches.retain(|batch| batch.strong_count() > 0);
        batches
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    };
    for batch in batches {
        taken.append(&mut batch.spans.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::StreamBody;
    use hyper::body::Frame;

    use super::*;

    fn answer(
        headers: &[(&'static str, &'static str)],
        data: Option<Vec<u8>>,
        trailers: &[(&'static str, &'static str)],
    ) -> http::Response<tonic::body::Body> {
        let mut frames: Vec<Result<Frame<Bytes>, Infallible>> = Vec::new();
        if let Some(data) = data {
            frames.push(Ok(Frame::data(Bytes::from(data))));
        }
        if !trailers.is_empty() {
            let mut map = http::HeaderMap::new();
            for (name, value) in trailers {
                map.insert(*name, http::HeaderValue::from_static(value));
            }
            frames.push(Ok(Frame::trailers(map)));
        }
        let mut response = http::Response::new(tonic::body::Body::new(StreamBody::new(
            futures::stream::iter(frames),
        )));
        for (name, value) in headers {
            response
                .headers_mut()
                .insert(*name, http::HeaderValue::from_static(value));
        }
        response
    }

    fn message(response: &ExportTraceServiceResponse) -> Vec<u8> {
        let encoded = response.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        framed.extend_from_slice(&encoded);
        framed
    }

    #[tokio::test]
    async fn grpc_answers_are_read_as_a_grpc_client_reads_them() {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTracePartialSuccess;
        let ok = ExportTraceServiceResponse::default();
        let partial = ExportTraceServiceResponse {
            partial_success: Some(ExportTracePartialSuccess {
                rejected_spans: 7,
                error_message: "too old".into(),
            }),
        };
        // A message, then OK in the trailers.
        let got = grpc_answer(answer(&[], Some(message(&ok)), &[("grpc-status", "0")])).await;
        assert_eq!(got, Ok(0));
        let got = grpc_answer(answer(
            &[],
            Some(message(&partial)),
            &[("grpc-status", "0")],
        ))
        .await;
        assert_eq!(got, Ok(7));
        // Trailers-only: the status in the headers.
        assert_eq!(
            grpc_answer(answer(&[("grpc-status", "0")], None, &[])).await,
            Ok(0)
        );
        let got = grpc_answer(answer(
            &[
                ("grpc-status", "14"),
                ("grpc-message", "collector%20is%20down"),
            ],
            None,
            &[],
        ))
        .await;
        assert_eq!(got, Err("Unavailable: collector is down".to_owned()));
        // A failure in the trailers.
        let got = grpc_answer(answer(&[], None, &[("grpc-status", "8")])).await;
        assert_eq!(got, Err("ResourceExhausted: ".to_owned()));
        // No status at all, a compressed or torn message: failures, never
        // taken for exported.
        assert!(
            grpc_answer(answer(&[], Some(message(&ok)), &[]))
                .await
                .is_err()
        );
        let mut compressed = message(&ok);
        compressed[0] = 1;
        assert!(
            grpc_answer(answer(&[], Some(compressed), &[("grpc-status", "0")]))
                .await
                .is_err()
        );
        let mut torn = message(&partial);
        torn.pop();
        assert!(
            grpc_answer(answer(&[], Some(torn), &[("grpc-status", "0")]))
                .await
                .is_err()
        );
        // Not HTTP 200.
        let mut refused = answer(&[], None, &[]);
        *refused.status_mut() = http::StatusCode::BAD_GATEWAY;
        assert_eq!(
            grpc_answer(refused).await,
            Err("HTTP status 502 Bad Gateway".to_owned())
        );
    }

    #[test]
    fn grpc_messages_are_percent_decoded_and_bounded() {
        assert_eq!(percent_decoded(b"a%20b"), "a b");
        // Not an escape: kept as it is.
        assert_eq!(percent_decoded(b"100%"), "100%");
        assert_eq!(percent_decoded(b"%zz%4"), "%zz%4");
        assert_eq!(percent_decoded(b"caf%C3%A9"), "café");
        assert_eq!(percent_decoded("x".repeat(2_000).as_bytes()).len(), 512);
    }

    /// A span told apart by its span id.
    fn span(n: u8) -> Finished {
        Finished {
            start: crate::telemetry::span::SpanStart {
                trace_id: [1; 16],
                span_id: [n; 8],
                parent_span_id: None,
                flags: 1,
                trace_state: opentelemetry::trace::TraceState::default(),
                start: std::time::SystemTime::UNIX_EPOCH,
            },
            end: std::time::SystemTime::UNIX_EPOCH,
            body: crate::telemetry::span::Body::Other {
                name: crate::telemetry::SPAN_REPORT_TRAFFIC,
                attributes: Vec::new(),
                error: None,
            },
        }
    }

    fn ids(waiting: &Waiting) -> Vec<u8> {
        let mut ids: Vec<u8> = waiting.iter().map(|span| span.start.span_id[0]).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn a_batch_is_queued_whole_or_as_far_as_there_is_room_and_its_vector_reused() {
        let queue = Queue::new(6);
        assert_eq!(queue.push(span(0)), Some(1));
        // Room for the whole batch: its vector is taken, a spare one given.
        let mut batch: Vec<Finished> = (1..4).map(span).collect();
        let given = batch.as_ptr();
        assert_eq!(queue.push_all(&mut batch), (4, 0));
        assert!(batch.is_empty() && batch.capacity() >= STREAM_BATCH);
        // Room for two of three: the last one is dropped.
        batch.extend((4..7).map(span));
        assert_eq!(queue.push_all(&mut batch), (6, 1));
        assert!(batch.is_empty());
        assert_eq!(queue.push(span(7)), None);
        assert_eq!(queue.waiting(), 6);

        let mut taken = Waiting::default();
        queue.take(&mut taken);
        assert_eq!(queue.waiting(), 0);
        assert_eq!(ids(&taken), [0, 1, 2, 3, 4, 5]);
        // The queue is empty and takes spans again.
        assert_eq!(queue.push(span(8)), Some(1));
        queue.recycle(&mut taken);
        assert!(taken.iter().next().is_none());
        // The batch's vector, emptied, is the next stream batch's.
        let mut next = vec![span(9)];
        queue.push_all(&mut next);
        assert_eq!(next.as_ptr(), given);
        let mut taken = Waiting::default();
        queue.take(&mut taken);
        assert_eq!(ids(&taken), [8, 9]);
    }
}
