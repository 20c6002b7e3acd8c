//! A `DecideRequest` read into the engine's terms, with the same checks
//! retryd's edge makes, so that the local fallback refuses what retryd
//! would refuse (naming the same field) and never hides a caller's bug.
//!
//! This module converts and validates; it decides nothing. It must not
//! import the server (nothing here may depend on the `retryd` package):
//! where its checks and the server's could drift, the conformance vectors'
//! `invalid-*` cases run through the fallback too and catch it.

use std::time::Duration;

use retryd_engine::{
    Body, Evidence, FailureKind, GrpcCode, Idempotency, Lineage, Replayability, retried_below,
};
use retryd_proto as pb;

/// Longest upstream or operation name, in bytes (as retryd).
pub(crate) const MAX_NAME_BYTES: usize = 256;
/// Longest Retry-After or pushback value, in bytes.
pub(crate) const MAX_HEADER_BYTES: usize = 256;
/// Most entries in one traffic report.
pub(crate) const MAX_TRAFFIC_ENTRIES: usize = 1024;
const MAX_DURATION: Duration = Duration::from_secs(86_400);
const MAX_PARTS: usize = 64;
const MAX_BODY_DEPTH: usize = 4;
const MAX_BODY_NODES: usize = 256;

/// A request field retryd would refuse: retryd's INVALID_ARGUMENT, or the
/// same check made locally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidRequest {
    /// The field's path, e.g. `body.parts[1].kind`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl InvalidRequest {
    /// Reads retryd's INVALID_ARGUMENT message (`field: reason`).
    pub(crate) fn from_message(message: &str) -> InvalidRequest {
        match message.split_once(": ") {
            Some((field, reason)) => invalid(field, reason),
            None => invalid("", message),
        }
    }
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> InvalidRequest {
    InvalidRequest {
        field: field.into(),
        reason: reason.into(),
    }
}

/// What one failed attempt reported, validated and owned: the engine's
/// `Facts` borrow from it.
#[derive(Clone, Debug)]
pub(crate) struct Attempt {
    pub(crate) idempotency: Idempotency,
    pub(crate) body: Body,
    pub(crate) attempt: u32,
    pub(crate) claimed_evidence: Option<Evidence>,
    pub(crate) failure: Option<FailureKind>,
    pub(crate) http_status: Option<u16>,
    pub(crate) retry_after: Option<String>,
    pub(crate) grpc_status: Option<GrpcCode>,
    pub(crate) grpc_pushback: Option<String>,
    pub(crate) deadline_remaining: Option<Duration>,
    pub(crate) first_byte_delivered: bool,
    pub(crate) runtime_draining: bool,
    pub(crate) auth_refresh_attempted: bool,
    pub(crate) previous_backoff: Option<Duration>,
    pub(crate) max_attempts: Option<u32>,
    /// Validated: parses as a [`Lineage`] (empty at the edge).
    pub(crate) lineage: String,
    pub(crate) retried_below: Option<String>,
    /// 0 for a retry; k >= 1 for the k-th hedge (no failure fields).
    pub(crate) hedge: u32,
}

/// Most hedges of one call a request may ask about (as retryd).
const MAX_HEDGE: u32 = 16;

/// A hedge reports no failure: each failure field is refused by name, as
/// retryd's edge refuses it.
fn hedge_request(request: &pb::DecideRequest) -> Result<(), InvalidRequest> {
    if request.hedge > MAX_HEDGE {
        return Err(invalid(
            "hedge",
            format!(
                "at most {MAX_HEDGE} hedges of one call, not {}",
                request.hedge
            ),
        ));
    }
    for (field, set) in [
        ("evidence", request.evidence != 0),
        ("failure", request.failure != 0),
        ("http_status", request.http_status != 0),
        ("grpc_status_code", request.grpc_status_code != 0),
        (
            "grpc_retry_pushback_ms",
            request.grpc_retry_pushback_ms.is_some(),
        ),
        ("retry_after", !request.retry_after.is_empty()),
        ("retried_below", !request.retried_below.is_empty()),
    ] {
        if set {
            return Err(invalid(
                field,
                "must be empty with hedge >= 1: a hedge reports no failure",
            ));
        }
    }
    Ok(())
}

fn name(field: &str, raw: &str) -> Result<(), InvalidRequest> {
    if raw.len() > MAX_NAME_BYTES {
        return Err(invalid(
            field,
            format!("longer than {MAX_NAME_BYTES} bytes"),
        ));
    }
    if raw.chars().any(char::is_control) {
        return Err(invalid(field, "contains control characters"));
    }
    Ok(())
}

fn unknown_enum(field: &str, value: i32) -> InvalidRequest {
    invalid(
        field,
        format!("{value} is not a value the contract defines"),
    )
}

/// Validates `request` as retryd's edge does, in the same order (the first
/// invalid field is the one named).
pub(crate) fn attempt(request: &pb::DecideRequest) -> Result<Attempt, InvalidRequest> {
    if request.upstream.is_empty() {
        return Err(invalid("upstream", "required"));
    }
    name("upstream", &request.upstream)?;
    name("operation", &request.operation)?;
    let idempotency = match pb::Idempotency::try_from(request.idempotency) {
        Ok(pb::Idempotency::Unspecified) => {
            return Err(invalid(
                "idempotency",
                "required: the caller must declare it",
            ));
        }
        Ok(pb::Idempotency::Safe) => Idempotency::Safe,
        Ok(pb::Idempotency::Idempotent) => Idempotency::Idempotent,
        Ok(pb::Idempotency::IdempotentWithKey) => Idempotency::IdempotentWithKey,
        Ok(pb::Idempotency::NonIdempotent) => Idempotency::NonIdempotent,
        Err(_) => return Err(unknown_enum("idempotency", request.idempotency)),
    };
    if request.hedge != 0 {
        hedge_request(request)?;
    }
    let body = match &request.body {
        None => Body::None,
        Some(body) => self::body("body", body, 1, &mut 0)?,
    };
    if request.attempt == 0 {
        return Err(invalid(
            "attempt",
            "must be at least 1 (1 means the first attempt just failed)",
        ));
    }
    let failure = failure_kind(request.failure)?;
    let http_status = match request.http_status {
        0 => None,
        status @ 100..=599 => Some(status as u16),
        other => {
            return Err(invalid(
                "http_status",
                format!("must be 0 (none) or 100 to 599, not {other}"),
            ));
        }
    };
    let grpc_status = match request.grpc_status_code {
        0 => None,
        number => match GrpcCode::from_number(number) {
            Some(_) if http_status.is_some() => {
                return Err(invalid(
                    "grpc_status_code",
                    "set together with http_status: an attempt is HTTP or gRPC, not both",
                ));
            }
            Some(code) => Some(code),
            None => {
                return Err(invalid(
                    "grpc_status_code",
                    format!("must be 0 (none) or a google.rpc.Code from 1 to 16, not {number}"),
                ));
            }
        },
    };
    let grpc_pushback = match &request.grpc_retry_pushback_ms {
        None => None,
        Some(_) if grpc_status.is_none() => {
            return Err(invalid(
                "grpc_retry_pushback_ms",
                "needs grpc_status_code (a pushback trailer ends a gRPC call)",
            ));
        }
        Some(raw) if raw.len() > MAX_HEADER_BYTES => {
            return Err(invalid(
                "grpc_retry_pushback_ms",
                format!("longer than {MAX_HEADER_BYTES} bytes"),
            ));
        }
        Some(raw) => Some(raw.clone()),
    };
    if grpc_status.is_some() && !request.retry_after.is_empty() {
        return Err(invalid(
            "retry_after",
            "an HTTP header; a gRPC call reports grpc_retry_pushback_ms instead",
        ));
    }
    let claimed_evidence = match pb::Evidence::try_from(request.evidence) {
        Ok(pb::Evidence::Unspecified) => {
            // A hedge reports no failure (`hedge_request`).
            if failure.is_none()
                && http_status.is_none()
                && grpc_status.is_none()
                && request.hedge == 0
            {
                return Err(invalid(
                    "evidence",
                    "required when neither failure, http_status nor grpc_status_code says \
                     what happened",
                ));
            }
            None
        }
        Ok(pb::Evidence::NotSent) => Some(Evidence::NotSent),
        Ok(pb::Evidence::SentNoResponse) => Some(Evidence::SentNoResponse),
        Ok(pb::Evidence::ResponseReceived) => {
            if http_status.is_none() && grpc_status.is_none() {
                return Err(invalid(
                    "http_status",
                    "required with EVIDENCE_RESPONSE_RECEIVED (or grpc_status_code)",
                ));
            }
            Some(Evidence::ResponseReceived)
        }
        Ok(pb::Evidence::PartialResponse) => Some(Evidence::PartialResponse),
        Err(_) => return Err(unknown_enum("evidence", request.evidence)),
    };
    if request.retry_after.len() > MAX_HEADER_BYTES {
        return Err(invalid(
            "retry_after",
            format!("longer than {MAX_HEADER_BYTES} bytes"),
        ));
    }
    Ok(Attempt {
        idempotency,
        body,
        attempt: request.attempt,
        claimed_evidence,
        failure,
        http_status,
        retry_after: Some(request.retry_after.clone()).filter(|raw| !raw.is_empty()),
        grpc_status,
        grpc_pushback,
        deadline_remaining: duration("deadline_remaining", request.deadline_remaining.as_ref())?,
        first_byte_delivered: request.first_byte_delivered,
        runtime_draining: request.runtime_draining,
        auth_refresh_attempted: request.auth_refresh_attempted,
        previous_backoff: duration("previous_backoff", request.previous_backoff.as_ref())?,
        max_attempts: (request.max_attempts > 0).then_some(request.max_attempts),
        lineage: Lineage::parse(&request.lineage)
            .map_err(|error| invalid("lineage", error.to_string()))?
            .as_str()
            .to_owned(),
        retried_below: retried_below(
            &request.retried_below,
            claimed_evidence,
            http_status.is_some() || grpc_status.is_some(),
        )
        .map_err(|error| invalid("retried_below", error.to_string()))?
        .map(str::to_owned),
        hedge: request.hedge,
    })
}

fn failure_kind(raw: i32) -> Result<Option<FailureKind>, InvalidRequest> {
    use pb::FailureKind as Pb;
    let kind = match Pb::try_from(raw) {
        Ok(Pb::Unspecified) => return Ok(None),
        Ok(Pb::Dns) => FailureKind::Dns,
        Ok(Pb::Connect) => FailureKind::Connect,
        Ok(Pb::PoolTimeout) => FailureKind::PoolTimeout,
        Ok(Pb::PreRequestTls) => FailureKind::PreRequestTls,
        Ok(Pb::ProfileRejection) => FailureKind::ProfileRejection,
        Ok(Pb::Http2RefusedStream) => FailureKind::Http2RefusedStream,
        Ok(Pb::GoawayUnprocessed) => FailureKind::GoawayUnprocessed,
        Ok(Pb::PartialWrite) => FailureKind::PartialWrite,
        Ok(Pb::ResponseHeaderTimeout) => FailureKind::ResponseHeaderTimeout,
        Ok(Pb::ConnectionReset) => FailureKind::ConnectionReset,
        Ok(Pb::DecodeReset) => FailureKind::DecodeReset,
        Ok(Pb::InterruptedStream) => FailureKind::InterruptedStream,
        Ok(Pb::GenericIo) => FailureKind::GenericIo,
        Ok(Pb::TlsCertificateInvalid) => FailureKind::TlsCertificateInvalid,
        Ok(Pb::RequestEncoding) => FailureKind::RequestEncoding,
        Err(_) => return Err(unknown_enum("failure", raw)),
    };
    Ok(Some(kind))
}

fn body(
    field: &str,
    body: &pb::Body,
    depth: usize,
    nodes: &mut usize,
) -> Result<Body, InvalidRequest> {
    use pb::BodyKind as Pb;
    *nodes += 1;
    if *nodes > MAX_BODY_NODES {
        return Err(invalid(
            field,
            format!("the body has more than {MAX_BODY_NODES} parts in all"),
        ));
    }
    let kind =
        Pb::try_from(body.kind).map_err(|_| unknown_enum(&format!("{field}.kind"), body.kind))?;
    let declared = pb::Replayability::try_from(body.declared)
        .map_err(|_| unknown_enum(&format!("{field}.declared"), body.declared))?;
    if kind != Pb::PublisherFactory && declared != pb::Replayability::Unspecified {
        return Err(invalid(
            format!("{field}.declared"),
            "only a publisher factory declares its replayability",
        ));
    }
    if kind != Pb::Multipart && !body.parts.is_empty() {
        return Err(invalid(
            format!("{field}.parts"),
            "only a multipart body has parts",
        ));
    }
    Ok(match kind {
        Pb::None => Body::None,
        Pb::Bytes => Body::Bytes,
        Pb::EncodedValue => Body::EncodedValue,
        Pb::ReopenableSupplier => Body::ReopenableSupplier,
        Pb::InputStream => Body::InputStream,
        Pb::Publisher => Body::Publisher,
        Pb::PublisherFactory => Body::PublisherFactory(match declared {
            pb::Replayability::Unspecified => {
                return Err(invalid(
                    format!("{field}.declared"),
                    "required for a publisher factory",
                ));
            }
            pb::Replayability::Replayable => Replayability::Replayable,
            pb::Replayability::Reopenable => Replayability::Reopenable,
            pb::Replayability::OneShot => Replayability::OneShot,
        }),
        Pb::Multipart => {
            if body.parts.is_empty() || body.parts.len() > MAX_PARTS {
                return Err(invalid(
                    format!("{field}.parts"),
                    format!("a multipart body needs 1 to {MAX_PARTS} parts"),
                ));
            }
            if depth >= MAX_BODY_DEPTH {
                return Err(invalid(
                    format!("{field}.parts"),
                    format!("multipart nested deeper than {MAX_BODY_DEPTH}"),
                ));
            }
            let parts = body
                .parts
                .iter()
                .enumerate()
                .map(|(index, part)| {
                    self::body(&format!("{field}.parts[{index}]"), part, depth + 1, nodes)
                })
                .collect::<Result<_, _>>()?;
            Body::Multipart(parts)
        }
    })
}

fn duration(
    field: &str,
    raw: Option<&prost_types::Duration>,
) -> Result<Option<Duration>, InvalidRequest> {
    let Some(raw) = raw else { return Ok(None) };
    if raw.seconds < 0 || raw.nanos < 0 {
        return Err(invalid(field, "must not be negative"));
    }
    if raw.nanos >= 1_000_000_000 {
        return Err(invalid(field, "nanos must be below 1e9"));
    }
    let duration = Duration::new(raw.seconds as u64, raw.nanos as u32);
    if duration > MAX_DURATION {
        return Err(invalid(field, "must be at most 24h"));
    }
    Ok(Some(duration))
}

/// A protobuf duration of `duration` (saturating at 24 h, the contract's
/// limit, so that a caller's long deadline is never refused).
pub fn pb_duration(duration: Duration) -> prost_types::Duration {
    let duration = duration.min(MAX_DURATION);
    prost_types::Duration {
        seconds: duration.as_secs() as i64,
        nanos: duration.subsec_nanos() as i32,
    }
}

/// The wire value of an engine idempotency.
// Used by the adapters only, each a feature.
#[cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]
pub(crate) fn pb_idempotency(idempotency: Idempotency) -> pb::Idempotency {
    match idempotency {
        Idempotency::Safe => pb::Idempotency::Safe,
        Idempotency::Idempotent => pb::Idempotency::Idempotent,
        Idempotency::IdempotentWithKey => pb::Idempotency::IdempotentWithKey,
        Idempotency::NonIdempotent => pb::Idempotency::NonIdempotent,
    }
}
