//! Counting the spans of an `ExportTraceServiceRequest` as its bytes
//! arrive, without decoding or buffering it.
//!
//! The sink shares the benchmark's two cores with retryd, so what it does
//! per byte is taken from the figures being measured. Decoding through
//! tonic and prost first copied each request into one buffer and made a
//! `Bytes` handle per span: about a quarter of the sink's time under perf
//! (BENCHMARKS.md, issue 34). Here only the keys and lengths are read, a
//! few bytes a span; everything else is stepped over where it lies, in
//! whatever chunks HTTP/2 or HTTP/1.1 deliver it.
//!
//! The walk checks what it reads: a field's key, its wire type, that every
//! length ends inside its parent, and that the message ends on a field's
//! end. It reads three levels (the request's `resource_spans`, their
//! `scope_spans`, their `spans`) and steps over every other field.

/// `ExportTraceServiceRequest.resource_spans`, `ResourceSpans.scope_spans`
/// and `ScopeSpans.spans`: the one length-delimited field followed at each
/// level.
const FOLLOWED: [u64; 3] = [1, 2, 2];

/// Why a request is not an `ExportTraceServiceRequest`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Malformed {
    /// A varint longer than ten bytes.
    Varint,
    /// Field number 0.
    FieldZero,
    /// A group or an unknown wire type.
    WireType(u8),
    /// A field that runs past the end of the message that holds it.
    Overrun,
    /// The bytes ended inside a field.
    Truncated,
}

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Malformed::Varint => f.write_str("a varint longer than ten bytes"),
            Malformed::FieldZero => f.write_str("field number 0"),
            Malformed::WireType(wire) => write!(f, "wire type {wire}"),
            Malformed::Overrun => f.write_str("a field runs past the message that holds it"),
            Malformed::Truncated => f.write_str("the message ends inside a field"),
        }
    }
}

/// What is being read.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// A field's key.
    Key,
    /// The length of a length-delimited field with this number.
    Length(u64),
    /// A varint value, stepped over.
    Value,
    /// Bytes stepped over.
    Skip(u64),
}

/// Counts spans over the chunks of one request.
#[derive(Debug)]
pub(crate) struct SpanCounter {
    /// Bytes read so far.
    at: u64,
    /// Where each open message ends: the request's (if known), then the
    /// `ResourceSpans` and the `ScopeSpans` being read.
    ends: [u64; 3],
    /// How many of `ends` are open (1 to 3).
    depth: usize,
    step: Step,
    /// The varint being read, and its bytes so far.
    varint: u64,
    varint_bytes: u32,
    spans: u64,
    bytes: u64,
}

impl SpanCounter {
    /// A counter for a request of `len` bytes, or of unknown length.
    pub(crate) fn new(len: Option<u64>) -> SpanCounter {
        SpanCounter {
            at: 0,
            ends: [len.unwrap_or(u64::MAX), 0, 0],
            depth: 1,
            step: Step::Key,
            varint: 0,
            varint_bytes: 0,
            spans: 0,
            bytes: 0,
        }
    }

    /// Reads the next bytes of the request.
    pub(crate) fn feed(&mut self, mut chunk: &[u8]) -> Result<(), Malformed> {
        while !chunk.is_empty() {
            if let Step::Skip(left) = self.step {
                let taken = left.min(chunk.len() as u64);
                chunk = &chunk[taken as usize..];
                self.at += taken;
                if taken == left {
                    self.step = Step::Key;
                    self.close();
                } else {
                    self.step = Step::Skip(left - taken);
                }
                continue;
            }
            let byte = chunk[0];
            chunk = &chunk[1..];
            self.at += 1;
            if self.at > self.ends[self.depth - 1] {
                return Err(Malformed::Overrun);
            }
            if self.varint_bytes == 10 {
                return Err(Malformed::Varint);
            }
            self.varint |= u64::from(byte & 0x7f) << (7 * self.varint_bytes);
            self.varint_bytes += 1;
            if byte & 0x80 == 0 {
                let value = std::mem::take(&mut self.varint);
                self.varint_bytes = 0;
                self.read(value)?;
            }
        }
        Ok(())
    }

    /// A whole varint has been read as `value`, at `self.at`.
    fn read(&mut self, value: u64) -> Result<(), Malformed> {
        match self.step {
            Step::Key => {
                let field = value >> 3;
                if field == 0 {
                    return Err(Malformed::FieldZero);
                }
                self.step = match value & 7 {
                    0 => Step::Value,
                    1 => Step::Skip(8),
                    2 => Step::Length(field),
                    5 => Step::Skip(4),
                    wire => return Err(Malformed::WireType(wire as u8)),
                };
                self.check(self.at + self.skipping())?;
            }
            Step::Length(field) => {
                let end = self.at.checked_add(value).ok_or(Malformed::Overrun)?;
                self.check(end)?;
                if field != FOLLOWED[self.depth - 1] {
                    self.step = Step::Skip(value);
                } else if self.depth < 3 {
                    self.ends[self.depth] = end;
                    self.depth += 1;
                    self.step = Step::Key;
                } else {
                    self.spans += 1;
                    // The span's key (one byte: field 2) and length too.
                    self.bytes += 1 + varint_len(value) + value;
                    self.step = Step::Skip(value);
                }
            }
            Step::Value => self.step = Step::Key,
            Step::Skip(_) => unreachable!("skipped bytes are not read"),
        }
        if matches!(self.step, Step::Skip(0)) {
            self.step = Step::Key;
        }
        if matches!(self.step, Step::Key) {
            self.close();
        }
        Ok(())
    }

    /// Bytes of the request still to come, if its length is known.
    pub(crate) fn left(&self) -> Option<u64> {
        (self.ends[0] != u64::MAX).then(|| self.ends[0] - self.at)
    }

    /// How many bytes the current step skips.
    fn skipping(&self) -> u64 {
        match self.step {
            Step::Skip(n) => n,
            _ => 0,
        }
    }

    /// A field ending at `end` must end inside the message that holds it.
    fn check(&self, end: u64) -> Result<(), Malformed> {
        if end > self.ends[self.depth - 1] {
            Err(Malformed::Overrun)
        } else {
            Ok(())
        }
    }

    /// Leaves every nested message that ends here.
    fn close(&mut self) {
        while self.depth > 1 && self.at == self.ends[self.depth - 1] {
            self.depth -= 1;
        }
    }

    /// The request has ended: its spans and their bytes (each span's own,
    /// with its key and length), if it ended where a field does.
    pub(crate) fn finish(self) -> Result<(u64, u64), Malformed> {
        let whole = self.ends[0] == u64::MAX || self.at == self.ends[0];
        if self.depth > 1 || !matches!(self.step, Step::Key) || self.varint_bytes > 0 || !whole {
            return Err(Malformed::Truncated);
        }
        Ok((self.spans, self.bytes))
    }
}

fn varint_len(value: u64) -> u64 {
    u64::from((64 - (value | 1).leading_zeros()).div_ceil(7))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::{
        AnyValue, InstrumentationScope, KeyValue, any_value,
    };
    use opentelemetry_proto::tonic::resource::v1::Resource;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};
    use prost::Message as _;

    fn span(n: usize) -> Span {
        Span {
            trace_id: vec![n as u8; 16],
            span_id: vec![7; 8],
            name: "retry.decide".into(),
            kind: 2,
            start_time_unix_nano: 1_700_000_000_000_000_000 + n as u64,
            end_time_unix_nano: 1_700_000_000_000_000_100 + n as u64,
            attributes: (0..n % 5)
                .map(|i| KeyValue {
                    key: format!("retry.attribute_{i}"),
                    value: Some(AnyValue {
                        value: Some(any_value::Value::StringValue("x".repeat(n * 13 % 300))),
                    }),
                    ..KeyValue::default()
                })
                .collect(),
            status: Some(Status::default()),
            flags: 0x100,
            ..Span::default()
        }
    }

    /// A request of `resources` × `scopes` × `per_scope` spans, with a
    /// resource and a scope that are stepped over, and the bytes of its
    /// spans as a receiver counts them.
    fn request(resources: usize, scopes: usize, per_scope: usize) -> (Vec<u8>, u64, u64) {
        let mut n = 0;
        let mut bytes = 0;
        let request = ExportTraceServiceRequest {
            resource_spans: (0..resources)
                .map(|_| ResourceSpans {
                    resource: Some(Resource {
                        attributes: vec![KeyValue {
                            key: "service.name".into(),
                            value: Some(AnyValue {
                                value: Some(any_value::Value::StringValue("retryd".into())),
                            }),
                            ..KeyValue::default()
                        }],
                        ..Resource::default()
                    }),
                    scope_spans: (0..scopes)
                        .map(|_| ScopeSpans {
                            scope: Some(InstrumentationScope {
                                name: "retryd".into(),
                                version: "1".into(),
                                ..InstrumentationScope::default()
                            }),
                            spans: (0..per_scope)
                                .map(|_| {
                                    n += 1;
                                    let span = span(n);
                                    let len = span.encoded_len() as u64;
                                    bytes += 1 + varint_len(len) + len;
                                    span
                                })
                                .collect(),
                            schema_url: "https://opentelemetry.io/schemas/1.0".into(),
                        })
                        .collect(),
                    schema_url: String::new(),
                })
                .collect(),
        };
        (request.encode_to_vec(), n as u64, bytes)
    }

    fn count(chunks: &[&[u8]], len: Option<u64>) -> Result<(u64, u64), Malformed> {
        let mut counter = SpanCounter::new(len);
        for chunk in chunks {
            counter.feed(chunk)?;
        }
        counter.finish()
    }

    #[test]
    fn every_span_is_counted_whatever_the_chunks() {
        for (resources, scopes, per_scope) in [(0, 0, 0), (1, 1, 1), (1, 1, 40), (2, 3, 7)] {
            let (bytes, spans, span_bytes) = request(resources, scopes, per_scope);
            let len = Some(bytes.len() as u64);
            assert_eq!(count(&[&bytes], len), Ok((spans, span_bytes)));
            assert_eq!(count(&[&bytes], None), Ok((spans, span_bytes)));
            // Cut in two at every place, and into chunks of every small size.
            for cut in 0..bytes.len() {
                let (a, b) = bytes.split_at(cut);
                assert_eq!(count(&[a, b], len), Ok((spans, span_bytes)), "cut at {cut}");
            }
            for size in 1..40 {
                let chunks: Vec<&[u8]> = bytes.chunks(size).collect();
                assert_eq!(count(&chunks, None), Ok((spans, span_bytes)), "size {size}");
            }
        }
    }

    #[test]
    fn a_request_cut_short_or_running_over_is_refused() {
        let (bytes, _, _) = request(1, 2, 5);
        for cut in 1..bytes.len() {
            let short = &bytes[..cut];
            // Cut inside a field, or where the declared length says there
            // is more.
            assert!(
                count(&[short], Some(bytes.len() as u64)).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0x08);
        assert_eq!(
            count(&[&longer], Some(bytes.len() as u64)),
            Err(Malformed::Overrun)
        );
    }

    #[test]
    fn bytes_that_are_not_protobuf_are_refused() {
        assert_eq!(count(&[b"abc"], None), Err(Malformed::Truncated));
        assert_eq!(count(&[&[0x00]], None), Err(Malformed::FieldZero));
        assert_eq!(count(&[&[0x0b]], None), Err(Malformed::WireType(3)));
        assert_eq!(
            count(&[&[0x08; 1], &[0xff; 11]], None),
            Err(Malformed::Varint)
        );
        // A resource_spans whose length runs past its request.
        assert_eq!(
            count(&[&[0x0a, 0x05, 0x12]], Some(3)),
            Err(Malformed::Overrun)
        );
        // A span whose length runs past its ScopeSpans.
        assert_eq!(
            count(&[&[0x0a, 0x04, 0x12, 0x02, 0x12, 0x05]], None),
            Err(Malformed::Overrun)
        );
        // An empty request has no spans.
        assert_eq!(count(&[], Some(0)), Ok((0, 0)));
    }
}
