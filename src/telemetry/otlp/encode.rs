//! retryd's spans straight into an OTLP `ExportTraceServiceRequest`: one
//! resource and one scope per batch (retryd has exactly one of each),
//! encoded once at start, then each span's fields and attributes written
//! from its record with no intermediate `KeyValue`s, `AnyValue`s or
//! grouping by scope. What the SDK's generic path
//! (`opentelemetry_proto`'s `group_spans_by_resource_and_scope` and its
//! attribute conversion) cost, ~25k instructions a span, was most of a
//! traced decision's (BENCHMARKS.md, issue 34).
//!
//! The bytes decode to exactly the message the SDK's exporter sends for the
//! same span: the tests below compare the two.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use opentelemetry_proto::tonic::common::v1::InstrumentationScope as ProtoScope;
use opentelemetry_proto::tonic::resource::v1::Resource as ProtoResource;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use prost::Message as _;

use super::super::span::{Finished, Value};

// Field numbers of opentelemetry/proto/trace/v1/trace.proto and
// collector/trace/v1/trace_service.proto.
const REQUEST_RESOURCE_SPANS: u32 = 1;
const RESOURCE_SPANS_RESOURCE: u32 = 1;
const RESOURCE_SPANS_SCOPE_SPANS: u32 = 2;
const RESOURCE_SPANS_SCHEMA_URL: u32 = 3;
const SCOPE_SPANS_SCOPE: u32 = 1;
const SCOPE_SPANS_SPANS: u32 = 2;
const SPAN_TRACE_ID: u32 = 1;
const SPAN_SPAN_ID: u32 = 2;
const SPAN_TRACE_STATE: u32 = 3;
const SPAN_PARENT_SPAN_ID: u32 = 4;
const SPAN_NAME: u32 = 5;
const SPAN_KIND: u32 = 6;
const SPAN_START: u32 = 7;
const SPAN_END: u32 = 8;
const SPAN_ATTRIBUTES: u32 = 9;
const SPAN_STATUS: u32 = 15;
const SPAN_FLAGS: u32 = 16;
const STATUS_MESSAGE: u32 = 2;
const STATUS_CODE: u32 = 3;
const KEY_VALUE_KEY: u32 = 1;
const KEY_VALUE_VALUE: u32 = 2;
const ANY_STRING: u32 = 1;
const ANY_BOOL: u32 = 2;
const ANY_INT: u32 = 3;
const ANY_DOUBLE: u32 = 4;

/// `SPAN_KIND_SERVER`: every span retryd makes is the server side of a call.
const KIND_SERVER: u64 = 2;
/// `STATUS_CODE_ERROR`.
const STATUS_ERROR: u64 = 2;
/// `SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`.
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
/// `SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK`.
const FLAG_IS_REMOTE: u32 = 0x200;

/// Encodes batches; holds the resource and scope, encoded once, and its
/// buffers from one batch to the next.
#[derive(Debug)]
pub(crate) struct Encoder {
    /// `ResourceSpans.resource`, key and length included.
    resource: Vec<u8>,
    /// `ResourceSpans.schema_url`, key and length included (empty if none).
    schema_url: Vec<u8>,
    /// `ScopeSpans.scope`, key and length included.
    scope: Vec<u8>,
    /// A span whose length is not a two-byte varint, while it is moved.
    span: Vec<u8>,
    /// The size of the last request, to size the next one's buffer.
    last_len: usize,
    /// Each request prefixed as a gRPC message (uncompressed, its length).
    grpc: bool,
    /// Buffers of requests sent, for the next ones.
    pool: Arc<Pool>,
}

/// Request buffers back from the transport once it wrote them: a request
/// is hundreds of kilobytes, and a new one each time cost page faults on
/// every export (perf, issue 34).
type Pool = Mutex<Vec<Vec<u8>>>;

/// Buffers kept for reuse, at most: one per export in flight, and the one
/// being encoded.
const POOLED: usize = super::MAX_IN_FLIGHT + 1;
/// A buffer larger than this (a batch of very long spans) is not kept.
const POOLED_CAPACITY: usize = 4 << 20;

/// A request's bytes, its buffer back to the pool once the transport is
/// done with them.
struct Pooled {
    buffer: Vec<u8>,
    start: usize,
    pool: Arc<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buffer[self.start..]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buffer = std::mem::take(&mut self.buffer);
        if buffer.capacity() <= POOLED_CAPACITY {
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            if pool.len() < POOLED {
                pool.push(buffer);
            }
        }
    }
}

impl Encoder {
    /// An encoder for spans of `resource` and `scope`.
    pub(crate) fn new(
        resource: &opentelemetry_sdk::Resource,
        scope: &opentelemetry::InstrumentationScope,
    ) -> Encoder {
        let with_schema = ResourceAttributesWithSchema::from(resource);
        let resource_message = ProtoResource {
            attributes: with_schema.attributes.0,
            dropped_attributes_count: 0,
            entity_refs: vec![],
        };
        let mut encoded_resource = Vec::new();
        message_field(
            RESOURCE_SPANS_RESOURCE,
            &resource_message.encode_to_vec(),
            &mut encoded_resource,
        );
        let mut schema_url = Vec::new();
        if let Some(url) = with_schema.schema_url.filter(|url| !url.is_empty()) {
            bytes_field(RESOURCE_SPANS_SCHEMA_URL, url.as_bytes(), &mut schema_url);
        }
        let mut encoded_scope = Vec::new();
        message_field(
            SCOPE_SPANS_SCOPE,
            &ProtoScope::from((scope, None)).encode_to_vec(),
            &mut encoded_scope,
        );
        Encoder {
            resource: encoded_resource,
            schema_url,
            scope: encoded_scope,
            span: Vec::new(),
            last_len: 0,
            grpc: false,
            pool: Arc::default(),
        }
    }

    /// Each request as a gRPC message: its five-byte prefix (not
    /// compressed, the length) first, so that the transport sends the
    /// bytes as they are.
    pub(crate) fn grpc(mut self) -> Encoder {
        self.grpc = true;
        self
    }

    /// The `ExportTraceServiceRequest` of `batch`. The spans are encoded
    /// into one buffer after room for the request's head (its keys and
    /// lengths, the resource and the scope), which is written in place once
    /// their length is known: the batch is never copied (that copy was
    /// ~660 instructions a span under callgrind), and the request is that
    /// buffer less the head's unused room.
    pub(crate) fn encode<'a>(&mut self, batch: impl IntoIterator<Item = &'a Finished>) -> Bytes {
        // The head at its longest: the gRPC prefix, two keys, two 10-byte
        // varints.
        let prefix = if self.grpc { 5 } else { 0 };
        let room = prefix + 2 * (1 + 10) + self.resource.len() + self.scope.len();
        let mut out = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .unwrap_or_default();
        out.clear();
        out.reserve(room + self.last_len.max(1024) + self.schema_url.len());
        out.resize(room, 0);
        for finished in batch {
            // Into place, with two bytes kept for its length: a span is
            // 128 to 16,383 bytes long (~1 KB), whose length is a two-byte
            // varint; one outside that range goes the long way round.
            encode_key(SCOPE_SPANS_SPANS, WireType::LengthDelimited, &mut out);
            let at = out.len();
            out.extend_from_slice(&[0, 0]);
            encode_span(finished, &mut out);
            let len = out.len() - at - 2;
            if (128..16_384).contains(&len) {
                out[at] = len as u8 | 0x80;
                out[at + 1] = (len >> 7) as u8;
            } else {
                self.span.clear();
                self.span.extend_from_slice(&out[at + 2..]);
                out.truncate(at);
                encode_varint(len as u64, &mut out);
                out.extend_from_slice(&self.span);
            }
        }
        let spans_len = out.len() - room;
        let scope_spans_len = self.scope.len() + spans_len;
        let resource_spans_len = self.resource.len()
            + field_len(scope_spans_len)
            + scope_spans_len
            + self.schema_url.len();
        let mut head = Vec::with_capacity(room);
        encode_key(REQUEST_RESOURCE_SPANS, WireType::LengthDelimited, &mut head);
        encode_varint(resource_spans_len as u64, &mut head);
        head.extend_from_slice(&self.resource);
        encode_key(
            RESOURCE_SPANS_SCOPE_SPANS,
            WireType::LengthDelimited,
            &mut head,
        );
        encode_varint(scope_spans_len as u64, &mut head);
        head.extend_from_slice(&self.scope);
        let mut start = room - head.len();
        out[start..room].copy_from_slice(&head);
        out.extend_from_slice(&self.schema_url);
        let message_len = out.len() - start;
        self.last_len = message_len;
        if self.grpc {
            // A batch is at most MAX_BATCH spans of under 16 KB: far below
            // 4 GiB.
            start -= prefix;
            out[start] = 0;
            out[start + 1..start + prefix].copy_from_slice(&(message_len as u32).to_be_bytes());
        }
        Bytes::from_owner(Pooled {
            buffer: out,
            start,
            pool: Arc::clone(&self.pool),
        })
    }
}

/// Wire types.
#[derive(Clone, Copy)]
enum WireType {
    Varint = 0,
    SixtyFourBit = 1,
    LengthDelimited = 2,
    ThirtyTwoBit = 5,
}

/// A field's key. By hand rather than through `prost::encoding`, whose
/// `BufMut` calls cost ~10 instructions a byte: a span is ~200 of them.
#[inline(always)]
fn encode_key(tag: u32, wire_type: WireType, out: &mut Vec<u8>) {
    encode_varint(u64::from(tag << 3 | wire_type as u32), out);
}

#[inline(always)]
fn encode_varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[inline(always)]
fn encoded_len_varint(value: u64) -> usize {
    // Nearly every length in a span is under 128: one byte, with no
    // arithmetic (the division below was 3% of a traced server's samples
    // under perf).
    if value < 0x80 {
        1
    } else {
        // 1 byte per 7 bits.
        (64 - value.leading_zeros() as usize).div_ceil(7)
    }
}

/// The key and length of a length-delimited field of `len` bytes (its
/// field number below 16, as every one here is).
#[inline(always)]
fn field_len(len: usize) -> usize {
    1 + encoded_len_varint(len as u64)
}

fn message_field(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    bytes_field(tag, bytes, out);
}

#[inline(always)]
fn bytes_field(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

fn encode_span(finished: &Finished, out: &mut Vec<u8>) {
    let start = &finished.start;
    bytes_field(SPAN_TRACE_ID, &start.trace_id, out);
    bytes_field(SPAN_SPAN_ID, &start.span_id, out);
    let trace_state = start.trace_state.header();
    if !trace_state.is_empty() {
        bytes_field(SPAN_TRACE_STATE, trace_state.as_bytes(), out);
    }
    if let Some(parent) = &start.parent_span_id {
        bytes_field(SPAN_PARENT_SPAN_ID, parent, out);
    }
    bytes_field(SPAN_NAME, finished.body.name().as_bytes(), out);
    encode_key(SPAN_KIND, WireType::Varint, out);
    encode_varint(KIND_SERVER, out);
    encode_key(SPAN_START, WireType::SixtyFourBit, out);
    out.extend_from_slice(&nanos(start.start).to_le_bytes());
    encode_key(SPAN_END, WireType::SixtyFourBit, out);
    out.extend_from_slice(&nanos(finished.end).to_le_bytes());
    finished
        .body
        .attributes(|key, value| encode_attribute(key, value, out));
    // The SDK's exporter always sends a status, empty when unset.
    encode_key(SPAN_STATUS, WireType::LengthDelimited, out);
    match finished.body.error() {
        None => encode_varint(0, out),
        Some(message) => {
            let message_len = if message.is_empty() {
                0
            } else {
                field_len(message.len()) + message.len()
            };
            encode_varint((message_len + 2) as u64, out);
            if !message.is_empty() {
                bytes_field(STATUS_MESSAGE, message.as_bytes(), out);
            }
            encode_key(STATUS_CODE, WireType::Varint, out);
            encode_varint(STATUS_ERROR, out);
        }
    }
    let remote = if start.parent_span_id.is_some() {
        FLAG_IS_REMOTE
    } else {
        0
    };
    encode_key(SPAN_FLAGS, WireType::ThirtyTwoBit, out);
    out.extend_from_slice(&(u32::from(start.flags) | FLAG_HAS_IS_REMOTE | remote).to_le_bytes());
}

#[inline(always)]
fn encode_attribute(key: &str, value: Value<'_>, out: &mut Vec<u8>) {
    let value_len = match value {
        Value::Str(text) => field_len(text.len()) + text.len(),
        Value::Bool(_) => 2,
        Value::Int(int) => 1 + encoded_len_varint(int as u64),
        Value::Float(_) => 9,
    };
    let key_value_len = field_len(key.len()) + key.len() + field_len(value_len) + value_len;
    out.reserve(key_value_len + 3);
    if key_value_len < 128 {
        // Nearly every attribute: each key and length one byte, written
        // as a few fixed-size copies rather than a push each (the pushes
        // were a third of encoding a span under callgrind).
        out.extend_from_slice(&[
            key_of(SPAN_ATTRIBUTES, WireType::LengthDelimited),
            key_value_len as u8,
            key_of(KEY_VALUE_KEY, WireType::LengthDelimited),
            key.len() as u8,
        ]);
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(&[
            key_of(KEY_VALUE_VALUE, WireType::LengthDelimited),
            value_len as u8,
        ]);
    } else {
        encode_key(SPAN_ATTRIBUTES, WireType::LengthDelimited, out);
        encode_varint(key_value_len as u64, out);
        bytes_field(KEY_VALUE_KEY, key.as_bytes(), out);
        encode_key(KEY_VALUE_VALUE, WireType::LengthDelimited, out);
        encode_varint(value_len as u64, out);
    }
    match value {
        Value::Str(text) if text.len() < 128 => {
            out.extend_from_slice(&[
                key_of(ANY_STRING, WireType::LengthDelimited),
                text.len() as u8,
            ]);
            out.extend_from_slice(text.as_bytes());
        }
        Value::Str(text) => bytes_field(ANY_STRING, text.as_bytes(), out),
        Value::Bool(flag) => {
            out.extend_from_slice(&[key_of(ANY_BOOL, WireType::Varint), u8::from(flag)]);
        }
        Value::Int(int) => {
            out.push(key_of(ANY_INT, WireType::Varint));
            encode_varint(int as u64, out);
        }
        Value::Float(float) => {
            out.push(key_of(ANY_DOUBLE, WireType::SixtyFourBit));
            out.extend_from_slice(&float.to_le_bytes());
        }
    }
}

/// The one-byte key of a field numbered below 16.
const fn key_of(tag: u32, wire_type: WireType) -> u8 {
    (tag << 3 | wire_type as u32) as u8
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{
        SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
    };
    use opentelemetry::{InstrumentationScope, KeyValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

    use super::*;
    use crate::telemetry::span::{
        Body, CandidateSpan, DecisionFields, DecisionSpan, DecisionTexts, SpanStart,
    };
    use crate::telemetry::{Attribute, SPAN_REPORT_TRAFFIC, attr};

    fn resource() -> Resource {
        Resource::builder_empty()
            .with_service_name("retryd-test")
            .with_attributes([
                KeyValue::new("service.instance.id", "instance-1"),
                KeyValue::new("deployment.environment.name", "test"),
            ])
            .build()
    }

    fn scope() -> InstrumentationScope {
        InstrumentationScope::builder("retryd")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build()
    }

    fn start(parent: bool, trace_state: &str) -> SpanStart {
        SpanStart {
            trace_id: [0x4b; 16],
            span_id: [7, 6, 5, 4, 3, 2, 1, 0],
            parent_span_id: parent.then_some([0, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]),
            flags: 1,
            trace_state: if trace_state.is_empty() {
                TraceState::default()
            } else {
                trace_state.parse().unwrap()
            },
            start: UNIX_EPOCH + Duration::from_nanos(1_764_000_000_123_456_789),
        }
    }

    fn fields() -> DecisionFields {
        DecisionFields {
            attempt: 2,
            idempotency: "idempotent",
            evidence_effective: "not_sent",
            verdict: "retry",
            rule: 4,
            tokens_remaining: 9.5,
            store: "memory",
            evidence_claimed: Some("not_sent"),
            failure: Some("connect"),
            http_status: Some(503),
            grpc_status: Some(14),
            unknown_outcome: Some("reconcile"),
            chain_depth: Some(2),
            backoff_ms: Some(12.25),
            deny_reason: None,
            shadow: true,
            candidate: Some(CandidateSpan {
                verdict: "deny",
                rule: 9,
                tokens_remaining: -0.5,
                deny_reason: Some("budget_exhausted"),
            }),
            hedge: None,
            method: "DecideStream",
        }
    }

    fn texts() -> DecisionTexts<'static> {
        DecisionTexts {
            decision_id: "0123456789abcdef0123456789abcdef",
            upstream: "payments",
            operation: "",
            caller: "checkout",
            grpc_pushback: Some("250"),
            lineage: Some("edge:2/middle:1"),
            retried_below: Some("middle"),
        }
    }

    /// The SDK's `SpanData` of the same span, with the same attributes as
    /// `KeyValue`s: what the SDK's exporter was given before.
    fn span_data(finished: &Finished) -> SpanData {
        let start = &finished.start;
        let mut attributes = Vec::new();
        finished.body.attributes(|key, value| {
            attributes.push(match value {
                Value::Str(text) => KeyValue::new(key, text.to_owned()),
                Value::Int(int) => KeyValue::new(key, int),
                Value::Float(float) => KeyValue::new(key, float),
                Value::Bool(flag) => KeyValue::new(key, flag),
            })
        });
        SpanData {
            span_context: SpanContext::new(
                TraceId::from_bytes(start.trace_id),
                SpanId::from_bytes(start.span_id),
                TraceFlags::new(start.flags),
                false,
                start.trace_state.clone(),
            ),
            parent_span_id: start
                .parent_span_id
                .map_or(SpanId::INVALID, SpanId::from_bytes),
            parent_span_is_remote: start.parent_span_id.is_some(),
            span_kind: SpanKind::Server,
            name: Cow::Borrowed(finished.body.name()),
            start_time: start.start,
            end_time: finished.end,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: match finished.body.error() {
                Some(message) => Status::error(message.to_owned()),
                None => Status::Unset,
            },
            instrumentation_scope: scope(),
        }
    }

    fn batch() -> Vec<Finished> {
        let end = UNIX_EPOCH + Duration::from_nanos(1_764_000_000_223_456_789);
        let mut plain = fields();
        plain.candidate = None;
        plain.shadow = false;
        plain.chain_depth = None;
        plain.backoff_ms = None;
        plain.deny_reason = Some("not_retryable");
        plain.method = "Decide";
        let edge = DecisionTexts {
            grpc_pushback: None,
            lineage: None,
            retried_below: None,
            ..texts()
        };
        vec![
            Finished {
                start: start(true, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
                end,
                body: Body::Decision(DecisionSpan::new(texts(), fields())),
            },
            Finished {
                start: start(false, ""),
                end,
                body: Body::Decision(DecisionSpan::new(edge, plain)),
            },
            Finished {
                start: start(true, ""),
                end,
                body: Body::Other {
                    name: SPAN_REPORT_TRAFFIC,
                    attributes: vec![
                        (attr::TRAFFIC_ENTRIES, Attribute::Int(3)),
                        (attr::CALLER, Attribute::Text("checkout".into())),
                        (attr::ENFORCED, Attribute::Bool(true)),
                    ],
                    error: None,
                },
            },
            Finished {
                start: start(false, ""),
                end,
                body: Body::Other {
                    name: crate::telemetry::SPAN_DECIDE,
                    attributes: vec![
                        (attr::CALLER, Attribute::Static("anonymous")),
                        (attr::RPC_METHOD, Attribute::Static("Decide")),
                        (attr::GRPC_STATUS, Attribute::Int(3)),
                    ],
                    error: Some("traffic[3].failures: must be ...".into()),
                },
            },
            Finished {
                start: start(false, ""),
                end,
                body: Body::Other {
                    name: crate::telemetry::SPAN_GET_BUDGET,
                    attributes: vec![(attr::GRPC_STATUS, Attribute::Int(16))],
                    error: Some(String::new()),
                },
            },
        ]
    }

    #[test]
    fn a_batch_decodes_to_what_the_sdk_exporter_sends() {
        let resource = resource();
        let batch = batch();
        let ours = ExportTraceServiceRequest::decode(
            Encoder::new(&resource, &scope()).encode(&batch).as_ref(),
        )
        .unwrap();
        let sdk = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                batch.iter().map(span_data).collect(),
                &ResourceAttributesWithSchema::from(&resource),
            ),
        };
        assert_eq!(ours, sdk);
        // And byte for byte as prost encodes that message.
        assert_eq!(
            Encoder::new(&resource, &scope()).encode(&batch),
            sdk.encode_to_vec()
        );
    }

    #[test]
    fn spans_of_any_length_decode_as_the_sdk_sends_them() {
        let resource = resource();
        let end = UNIX_EPOCH + Duration::from_secs(2);
        let long = "x".repeat(20_000);
        let batch = vec![
            // A short span: no attributes but the RPC ones.
            Finished {
                start: start(false, ""),
                end,
                body: Body::Other {
                    name: crate::telemetry::SPAN_RELOAD_CONFIG,
                    attributes: vec![],
                    error: None,
                },
            },
            // Over 16 KB.
            Finished {
                start: start(true, ""),
                end,
                body: Body::Other {
                    name: crate::telemetry::SPAN_SET_RETRIES_ENABLED,
                    attributes: vec![(attr::REASON, Attribute::Text(long))],
                    error: None,
                },
            },
            // Attributes either side of a one-byte length: the value's,
            // the key and value's together.
            Finished {
                start: start(false, ""),
                end,
                body: Body::Other {
                    name: crate::telemetry::SPAN_SET_RETRIES_ENABLED,
                    attributes: [90, 100, 106, 107, 126, 127, 128]
                        .map(|len| (attr::REASON, Attribute::Text("y".repeat(len))))
                        .into(),
                    error: None,
                },
            },
        ];
        let sdk = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                batch.iter().map(span_data).collect(),
                &ResourceAttributesWithSchema::from(&resource),
            ),
        };
        assert_eq!(
            Encoder::new(&resource, &scope()).encode(&batch),
            sdk.encode_to_vec()
        );
    }

    #[test]
    fn varints_are_as_prost_writes_them() {
        for value in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut ours = Vec::new();
            encode_varint(value, &mut ours);
            let mut theirs = Vec::new();
            prost::encoding::encode_varint(value, &mut theirs);
            assert_eq!(ours, theirs, "{value}");
            assert_eq!(encoded_len_varint(value), theirs.len(), "{value}");
        }
    }

    #[test]
    fn the_encoder_is_reused_across_batches() {
        let resource = resource();
        let mut encoder = Encoder::new(&resource, &scope());
        let batch = batch();
        let first = encoder.encode(&batch);
        let single = encoder.encode(&batch[1..2]);
        assert_eq!(encoder.encode(&batch), first);
        let decoded = ExportTraceServiceRequest::decode(single.as_ref()).unwrap();
        assert_eq!(decoded.resource_spans.len(), 1);
        assert_eq!(decoded.resource_spans[0].scope_spans.len(), 1);
        assert_eq!(decoded.resource_spans[0].scope_spans[0].spans.len(), 1);
    }

    #[test]
    fn a_grpc_request_is_the_message_behind_its_prefix_and_buffers_come_back() {
        let resource = resource();
        let mut plain = Encoder::new(&resource, &scope());
        let mut grpc = Encoder::new(&resource, &scope()).grpc();
        let batch = batch();
        let message = plain.encode(&batch);
        let framed = grpc.encode(&batch);
        let (prefix, rest) = framed.split_at(5);
        assert_eq!(prefix[0], 0, "not compressed");
        assert_eq!(
            u32::from_be_bytes(prefix[1..].try_into().unwrap()) as usize,
            message.len()
        );
        assert_eq!(rest, message.as_ref());
        // Sent and dropped, its buffer is the next request's: the same
        // bytes again, from the pool.
        drop(framed);
        assert_eq!(grpc.pool.lock().unwrap().len(), 1);
        let again = grpc.encode(&batch[..1]);
        assert!(grpc.pool.lock().unwrap().is_empty());
        assert_eq!(&again[5..], plain.encode(&batch[..1]).as_ref());
        // Held by the transport, a buffer is not reused.
        let held = grpc.encode(&batch);
        let next = grpc.encode(&batch);
        assert_eq!(held, next);
        assert_ne!(held.as_ptr(), next.as_ptr());
    }
}
