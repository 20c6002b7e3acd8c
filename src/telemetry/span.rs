//! What a finished span is on its way to the exporter: its start (ids,
//! parent, trace state, start time), its end time, and its body. A
//! decision's body is [`DecisionSpan`], a fixed-size record captured at
//! decision time (typed fields, the call's strings copied into one buffer),
//! not a list of `KeyValue`s: the decision thread pays one allocation and a
//! few stores, and the attribute names and the OTLP encoding are the
//! export task's work (`otlp/encode.rs`). Other spans (reports, admin
//! calls, refused calls) are rare and keep a list of attributes.
//!
//! [`DecisionSpan::attributes`] and [`Body::attributes`] are the one
//! definition of a span's attributes and their order, which the encoder
//! and the SDK-equivalence test both read.

use crate::texts::Texts;
use std::time::SystemTime;

use opentelemetry::trace::TraceState;

use super::{Attribute, attr};

/// An attribute's value, borrowed from its record.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Value<'a> {
    /// A string.
    Str(&'a str),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
}

impl<'a> From<&'a Attribute> for Value<'a> {
    fn from(attribute: &'a Attribute) -> Value<'a> {
        match attribute {
            Attribute::Static(text) => Value::Str(text),
            Attribute::Text(text) => Value::Str(text),
            Attribute::Int(int) => Value::Int(*int),
            Attribute::Float(float) => Value::Float(*float),
            Attribute::Bool(flag) => Value::Bool(*flag),
        }
    }
}

/// A started, sampled span: what the sampler and the id generator gave,
/// and when it started.
#[derive(Debug)]
pub struct SpanStart {
    pub(crate) trace_id: [u8; 16],
    pub(crate) span_id: [u8; 8],
    /// The caller's span, a remote parent; `None` for a root.
    pub(crate) parent_span_id: Option<[u8; 8]>,
    /// W3C trace flags of this span (sampled).
    pub(crate) flags: u8,
    /// As the sampler returned it (the parent's, by default).
    pub(crate) trace_state: TraceState,
    pub(crate) start: SystemTime,
}

impl SpanStart {
    /// The trace it belongs to.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }
}

/// The candidate policy's part of a decision span.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CandidateSpan {
    /// retry, deny or ambiguous.
    pub verdict: &'static str,
    /// The rule that decided.
    pub rule: u8,
    /// Tokens left in the candidate's budget.
    pub tokens_remaining: f64,
    /// Its deny reason, for a DENY.
    pub deny_reason: Option<&'static str>,
}

/// A hedge decision's part of its span: fixed-size, like the rest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgeSpan {
    /// Which hedge of the call.
    pub hedge: u32,
    /// The hedge delay decided on, in milliseconds.
    pub delay_ms: f64,
    /// The fleet's p50, in milliseconds.
    pub p50_ms: f64,
    /// Hedges granted over the window before this one.
    pub hedges: u64,
    /// First attempts reported over the window.
    pub first_attempts: u64,
}

/// The fixed fields of a decision span (everything but its strings).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecisionFields {
    /// Attempts so far.
    pub attempt: u32,
    /// Declared idempotency.
    pub idempotency: &'static str,
    /// The evidence used.
    pub evidence_effective: &'static str,
    /// retry, deny or ambiguous.
    pub verdict: &'static str,
    /// The rule that decided.
    pub rule: u8,
    /// Tokens left after the decision.
    pub tokens_remaining: f64,
    /// The budget store's label.
    pub store: &'static str,
    /// The caller's claimed evidence.
    pub evidence_claimed: Option<&'static str>,
    /// The stage failure.
    pub failure: Option<&'static str>,
    /// The failed attempt's HTTP status.
    pub http_status: Option<u16>,
    /// The failed attempt's gRPC code.
    pub grpc_status: Option<u32>,
    /// `reconcile` or `resend_with_key`.
    pub unknown_outcome: Option<&'static str>,
    /// The layer's depth in its call chain, when in one.
    pub chain_depth: Option<u32>,
    /// The backoff, for a RETRY.
    pub backoff_ms: Option<f64>,
    /// The reason, for a DENY.
    pub deny_reason: Option<&'static str>,
    /// Answered as not enforced.
    pub shadow: bool,
    /// The candidate's verdict, if the upstream has one.
    pub candidate: Option<CandidateSpan>,
    /// A hedge's numbers; `None` for a retry.
    pub hedge: Option<HedgeSpan>,
    /// `Decide` or `DecideStream`.
    pub method: &'static str,
}

/// The strings of a decision span, borrowed from the call.
#[derive(Clone, Copy, Debug)]
pub struct DecisionTexts<'a> {
    /// The decision id answered.
    pub decision_id: &'a str,
    /// The upstream.
    pub upstream: &'a str,
    /// The operation.
    pub operation: &'a str,
    /// The calling principal.
    pub caller: &'a str,
    /// The raw `grpc-retry-pushback-ms`.
    pub grpc_pushback: Option<&'a str>,
    /// The call chain's lineage, in a chain.
    pub lineage: Option<&'a str>,
    /// The layer below that retried.
    pub retried_below: Option<&'a str>,
}

/// Indices into [`DecisionSpan`]'s strings.
const DECISION_ID: usize = 0;
const UPSTREAM: usize = 1;
const OPERATION: usize = 2;
const CALLER: usize = 3;
const PUSHBACK: usize = 4;
const LINEAGE: usize = 5;
const RETRIED_BELOW: usize = 6;
const TEXTS: usize = 7;

/// A decision's span as captured at decision time.
#[derive(Clone, Debug, PartialEq)]
pub struct DecisionSpan {
    /// The call's strings, indexed by the constants above.
    texts: Texts<TEXTS>,
    fields: DecisionFields,
}

impl DecisionSpan {
    /// Copies `texts` into one buffer beside `fields`.
    pub fn new(texts: DecisionTexts<'_>, fields: DecisionFields) -> DecisionSpan {
        let parts = [
            Some(texts.decision_id),
            Some(texts.upstream),
            Some(texts.operation),
            Some(texts.caller),
            texts.grpc_pushback,
            texts.lineage,
            texts.retried_below,
        ];
        let texts = Texts::pack(parts);
        DecisionSpan { texts, fields }
    }

    fn text(&self, index: usize) -> Option<&str> {
        self.texts.get(index)
    }

    fn required(&self, index: usize) -> &str {
        self.text(index).unwrap_or_default()
    }

    /// Calls `f` with each attribute, in the order the span has always
    /// had them.
    pub(crate) fn attributes(&self, mut f: impl FnMut(&'static str, Value<'_>)) {
        let fields = &self.fields;
        f(attr::DECISION_ID, Value::Str(self.required(DECISION_ID)));
        f(attr::UPSTREAM, Value::Str(self.required(UPSTREAM)));
        f(attr::OPERATION, Value::Str(self.required(OPERATION)));
        f(attr::ATTEMPT, Value::Int(i64::from(fields.attempt)));
        f(attr::IDEMPOTENCY, Value::Str(fields.idempotency));
        f(
            attr::EVIDENCE_EFFECTIVE,
            Value::Str(fields.evidence_effective),
        );
        f(attr::VERDICT, Value::Str(fields.verdict));
        f(attr::RULE, Value::Int(i64::from(fields.rule)));
        f(
            attr::TOKENS_REMAINING,
            Value::Float(fields.tokens_remaining),
        );
        f(attr::STORE, Value::Str(fields.store));
        f(attr::CALLER, Value::Str(self.required(CALLER)));
        if let Some(claimed) = fields.evidence_claimed {
            f(attr::EVIDENCE_CLAIMED, Value::Str(claimed));
        }
        if let Some(failure) = fields.failure {
            f(attr::FAILURE, Value::Str(failure));
        }
        if let Some(status) = fields.http_status {
            f(attr::HTTP_STATUS, Value::Int(i64::from(status)));
        }
        if let Some(code) = fields.grpc_status {
            f(attr::GRPC_STATUS, Value::Int(i64::from(code)));
        }
        if let Some(pushback) = self.text(PUSHBACK) {
            f(attr::GRPC_PUSHBACK, Value::Str(pushback));
        }
        if let Some(mark) = fields.unknown_outcome {
            f(attr::UNKNOWN_OUTCOME, Value::Str(mark));
        }
        // The chain's attributes only in a chain: an edge decision's span
        // is as it was.
        if let (Some(depth), Some(lineage)) = (fields.chain_depth, self.text(LINEAGE)) {
            f(attr::CHAIN_DEPTH, Value::Int(i64::from(depth)));
            f(attr::CHAIN_LINEAGE, Value::Str(lineage));
        }
        if let Some(layer) = self.text(RETRIED_BELOW) {
            f(attr::CHAIN_RETRIED_BELOW, Value::Str(layer));
        }
        if let Some(backoff) = fields.backoff_ms {
            f(attr::BACKOFF_MS, Value::Float(backoff));
        }
        if let Some(reason) = fields.deny_reason {
            f(attr::DENY_REASON, Value::Str(reason));
        }
        if fields.shadow {
            f(attr::ENFORCED, Value::Bool(false));
        }
        if let Some(candidate) = &fields.candidate {
            f(attr::CANDIDATE_VERDICT, Value::Str(candidate.verdict));
            f(attr::CANDIDATE_RULE, Value::Int(i64::from(candidate.rule)));
            f(
                attr::CANDIDATE_TOKENS_REMAINING,
                Value::Float(candidate.tokens_remaining),
            );
            if let Some(reason) = candidate.deny_reason {
                f(attr::CANDIDATE_DENY_REASON, Value::Str(reason));
            }
        }
        if let Some(hedge) = &fields.hedge {
            f(attr::HEDGE, Value::Int(i64::from(hedge.hedge)));
            f(attr::HEDGE_DELAY_MS, Value::Float(hedge.delay_ms));
            f(attr::HEDGE_P50_MS, Value::Float(hedge.p50_ms));
            let int = |n: u64| Value::Int(i64::try_from(n).unwrap_or(i64::MAX));
            f(attr::HEDGES_IN_WINDOW, int(hedge.hedges));
            f(attr::HEDGE_FIRST_ATTEMPTS, int(hedge.first_attempts));
        }
        f(attr::RPC_METHOD, Value::Str(fields.method));
        f(attr::RPC_SYSTEM, Value::Str("grpc"));
        f(attr::RPC_SERVICE, Value::Str(super::RPC_SERVICE_DECIDER));
    }
}

/// What a span says besides its start and end.
// A decision's record is inline on purpose: boxing it would be one more
// allocation per decision, on the decision's thread.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Body {
    /// A decision's span, `retry.decide`, never failed.
    Decision(DecisionSpan),
    /// Any other span: its name, attributes and error, if it failed.
    Other {
        name: &'static str,
        attributes: Vec<(&'static str, Attribute)>,
        error: Option<String>,
    },
}

impl Body {
    /// The span's name.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Body::Decision(_) => super::SPAN_DECIDE,
            Body::Other { name, .. } => name,
        }
    }

    /// The error message, if the span records a failure.
    pub(crate) fn error(&self) -> Option<&str> {
        match self {
            Body::Decision(_) => None,
            Body::Other { error, .. } => error.as_deref(),
        }
    }

    /// Calls `f` with each attribute: the RPC attributes come from the
    /// name unless the attributes name the method already (a stream's
    /// items).
    pub(crate) fn attributes(&self, mut f: impl FnMut(&'static str, Value<'_>)) {
        match self {
            Body::Decision(span) => span.attributes(f),
            Body::Other {
                name, attributes, ..
            } => {
                let (service, method) = super::trace::rpc_of(name);
                let mut names_method = false;
                for (key, value) in attributes {
                    names_method |= *key == attr::RPC_METHOD;
                    f(key, Value::from(value));
                }
                f(attr::RPC_SYSTEM, Value::Str("grpc"));
                f(attr::RPC_SERVICE, Value::Str(service));
                if !names_method {
                    f(attr::RPC_METHOD, Value::Str(method));
                }
            }
        }
    }
}

/// A finished span, queued for export.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) start: SpanStart,
    pub(crate) end: SystemTime,
    pub(crate) body: Body,
}
