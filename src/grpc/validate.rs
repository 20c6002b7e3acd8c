//! Request validation: protobuf messages in, domain values out, or an
//! [`InvalidRequest`] naming the field. Nothing is spent before this passes.

use std::time::{Duration, SystemTime};

use crate::budget::Outcomes;
use crate::decide::{Attempt, NO_BODY, Traffic};
use crate::engine::{
    Body, BudgetView, Evidence, Facts, FailureKind, GrpcCode, Idempotency, Lineage, Replayability,
    retried_below,
};
use crate::pb;

/// Longest Retry-After value, in bytes.
pub const MAX_RETRY_AFTER_BYTES: usize = 256;
/// Longest `grpc-retry-pushback-ms` value, in bytes.
pub const MAX_PUSHBACK_BYTES: usize = 256;
/// Longest admin reason, in bytes.
pub const MAX_REASON_BYTES: usize = 1024;
/// Longest duration accepted in a request.
pub const MAX_DURATION: Duration = Duration::from_secs(86_400);
/// Most parts of one multipart body.
pub const MAX_PARTS: usize = 64;
/// Deepest nesting of multipart bodies.
pub const MAX_BODY_DEPTH: usize = 4;
/// Most body nodes in one request, all levels together.
pub const MAX_BODY_NODES: usize = 256;
/// Most entries in one traffic report.
pub const MAX_TRAFFIC_ENTRIES: usize = 1024;
/// Longest traffic report id, in bytes.
pub const MAX_REPORT_ID_BYTES: usize = 128;

mod hedging;

pub use hedging::{MAX_HEDGE, MAX_REPORTED_LATENCIES};
use hedging::{hedge_request, latency_histogram};

pub use crate::decide::names::{InvalidRequest, MAX_NAME_BYTES, upstream};
use crate::decide::names::{invalid, name};

/// Validates a decide request into the attempt it reports.
pub fn decide_request(request: &pb::DecideRequest) -> Result<Attempt<'_>, InvalidRequest> {
    let upstream = upstream("upstream", &request.upstream)?;
    let operation = name("operation", &request.operation)?;
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
        Some(body) => {
            let mut nodes = 0;
            self::body("body", body, 1, &mut nodes)?
        }
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
        Some(raw) if raw.len() > MAX_PUSHBACK_BYTES => {
            return Err(invalid(
                "grpc_retry_pushback_ms",
                format!("longer than {MAX_PUSHBACK_BYTES} bytes"),
            ));
        }
        Some(raw) => Some(raw.as_str()),
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
    if request.retry_after.len() > MAX_RETRY_AFTER_BYTES {
        return Err(invalid(
            "retry_after",
            format!("longer than {MAX_RETRY_AFTER_BYTES} bytes"),
        ));
    }
    let retry_after = Some(request.retry_after.as_str()).filter(|raw| !raw.is_empty());
    let lineage =
        Lineage::parse(&request.lineage).map_err(|error| invalid("lineage", error.to_string()))?;
    let retried_below = retried_below(
        &request.retried_below,
        claimed_evidence,
        http_status.is_some() || grpc_status.is_some(),
    )
    .map_err(|error| invalid("retried_below", error.to_string()))?;
    let deadline_remaining = duration("deadline_remaining", request.deadline_remaining.as_ref())?;
    let previous_backoff = duration("previous_backoff", request.previous_backoff.as_ref())?;
    Ok(Attempt {
        upstream,
        operation,
        body,
        hedge: request.hedge,
        reported: Facts {
            idempotency,
            body: &NO_BODY,
            attempt: request.attempt,
            claimed_evidence,
            failure,
            http_status,
            retry_after,
            grpc_status,
            grpc_pushback,
            deadline_remaining,
            first_byte_delivered: request.first_byte_delivered,
            runtime_draining: request.runtime_draining,
            auth_refresh_attempted: request.auth_refresh_attempted,
            previous_backoff,
            max_attempts: (request.max_attempts > 0).then_some(request.max_attempts),
            lineage,
            retried_below,
            budget: BudgetView::OPEN,
            now: SystemTime::UNIX_EPOCH,
            jitter: 0.0,
        },
    })
}

/// Most requests (or outcomes of one kind) one traffic report entry may
/// carry: more than a billion between two reports is a bug in the caller,
/// and would fill any bucket anyway.
pub const MAX_REPORTED_REQUESTS: u64 = 1_000_000_000;

/// Validates a traffic report into its entries, in order: the upstream,
/// the first attempts sent and, when the caller reports them, how its
/// attempts ended (each count bounded like `requests`).
pub fn traffic_report(
    request: &pb::ReportTrafficRequest,
) -> Result<Vec<Traffic<'_>>, InvalidRequest> {
    if request.traffic.len() > MAX_TRAFFIC_ENTRIES {
        return Err(invalid(
            "traffic",
            format!("more than {MAX_TRAFFIC_ENTRIES} entries"),
        ));
    }
    request
        .traffic
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            let upstream = upstream(&format!("traffic[{index}].upstream"), &entry.upstream)?;
            for (field, count) in [
                ("requests", entry.requests),
                ("successes", entry.successes),
                ("failures", entry.failures),
                ("retry_successes", entry.retry_successes),
                ("retry_failures", entry.retry_failures),
                ("hedges_won", entry.hedges_won),
            ] {
                if count > MAX_REPORTED_REQUESTS {
                    return Err(invalid(
                        format!("traffic[{index}].{field}"),
                        "more than 1e9 in one report",
                    ));
                }
            }
            let latencies = latency_histogram(
                &format!("traffic[{index}].latency_successes"),
                entry.latency_successes.as_ref(),
            )?;
            // Validated like the successes; not kept: the delay is how long
            // a healthy call takes (`retryd_budget::hedging`).
            latency_histogram(
                &format!("traffic[{index}].latency_failures"),
                entry.latency_failures.as_ref(),
            )?;
            Ok(Traffic {
                upstream,
                requests: entry.requests,
                hedges_won: entry.hedges_won,
                latencies: latencies.map(Box::new),
                outcomes: Outcomes {
                    successes: entry.successes,
                    failures: entry.failures,
                    retry_successes: entry.retry_successes,
                    retry_failures: entry.retry_failures,
                },
            })
        })
        .collect()
}

/// Validates a traffic report's id: `None` when empty (no deduplication),
/// else 1 to 128 printable ASCII characters (it becomes a Redis key and
/// appears in logs).
pub fn report_id(raw: &str) -> Result<Option<&str>, InvalidRequest> {
    if raw.is_empty() {
        return Ok(None);
    }
    if raw.len() > MAX_REPORT_ID_BYTES {
        return Err(invalid(
            "report_id",
            format!("longer than {MAX_REPORT_ID_BYTES} bytes"),
        ));
    }
    if !raw.bytes().all(|byte| (0x20..0x7f).contains(&byte)) {
        return Err(invalid(
            "report_id",
            "must be printable ASCII (a UUID, for example)",
        ));
    }
    Ok(Some(raw))
}

/// Validates a free-text reason for the audit log: bounded, free of
/// control characters (as names are), and free of the Unicode
/// bidirectional controls, which would make an audit line read otherwise
/// than it is written. Any script's letters and punctuation pass.
pub fn reason<'a>(field: &str, raw: &'a str) -> Result<&'a str, InvalidRequest> {
    if raw.len() > MAX_REASON_BYTES {
        return Err(invalid(
            field,
            format!("longer than {MAX_REASON_BYTES} bytes"),
        ));
    }
    if raw.chars().any(char::is_control) {
        return Err(invalid(field, "contains control characters"));
    }
    if raw.chars().any(is_bidi_control) {
        return Err(invalid(field, "contains bidirectional control characters"));
    }
    // U+2028 and U+2029 are not control characters either, yet JSON log
    // readers and JavaScript end a line at them: a forged audit line.
    if raw.chars().any(|c| matches!(c, '\u{2028}' | '\u{2029}')) {
        return Err(invalid(field, "contains line or paragraph separators"));
    }
    Ok(raw)
}

/// The Unicode bidirectional formatting characters (UAX #9): the Arabic
/// letter mark, the implicit marks, the embeddings and overrides, and the
/// isolates. They are format characters, not control characters, so
/// `char::is_control` lets them through.
fn is_bidi_control(character: char) -> bool {
    matches!(
        character,
        '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
    )
}

fn unknown_enum(field: &str, value: i32) -> InvalidRequest {
    invalid(
        field,
        format!("{value} is not a value the contract defines"),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(upstream: &str, requests: u64) -> pb::UpstreamTraffic {
        pb::UpstreamTraffic {
            upstream: upstream.into(),
            requests,
            ..Default::default()
        }
    }

    #[test]
    fn a_report_keeps_its_outcomes() {
        let request = pb::ReportTrafficRequest {
            traffic: vec![
                entry("a", 10),
                pb::UpstreamTraffic {
                    successes: 7,
                    failures: 3,
                    retry_successes: 2,
                    retry_failures: MAX_REPORTED_REQUESTS,
                    ..entry("b", 10)
                },
            ],
            ..Default::default()
        };
        let entries = traffic_report(&request).unwrap();
        assert_eq!(entries[0], Traffic::requests("a", 10));
        assert_eq!(
            entries[1].outcomes,
            Outcomes {
                successes: 7,
                failures: 3,
                retry_successes: 2,
                retry_failures: MAX_REPORTED_REQUESTS,
            }
        );
    }

    #[test]
    fn an_outcome_over_the_bound_names_its_field() {
        let over = MAX_REPORTED_REQUESTS + 1;
        type Set = fn(&mut pb::UpstreamTraffic, u64);
        let cases: [(&str, Set); 5] = [
            ("requests", |entry, n| entry.requests = n),
            ("successes", |entry, n| entry.successes = n),
            ("failures", |entry, n| entry.failures = n),
            ("retry_successes", |entry, n| entry.retry_successes = n),
            ("retry_failures", |entry, n| entry.retry_failures = n),
        ];
        for (field, set) in cases {
            let mut bad = entry("c", 1);
            set(&mut bad, over);
            let request = pb::ReportTrafficRequest {
                traffic: vec![entry("a", 1), entry("b", 1), bad],
                ..Default::default()
            };
            let error = traffic_report(&request).expect_err(field);
            assert_eq!(error.field, format!("traffic[2].{field}"));
            assert!(
                error
                    .to_string()
                    .starts_with(&format!("traffic[2].{field}: ")),
                "{error}"
            );
            let mut max = entry("c", 1);
            set(&mut max, u64::MAX);
            let request = pb::ReportTrafficRequest {
                traffic: vec![max],
                ..Default::default()
            };
            assert_eq!(
                traffic_report(&request).expect_err(field).field,
                format!("traffic[0].{field}")
            );
        }
    }

    #[test]
    fn a_reason_refuses_control_and_bidirectional_characters() {
        let refused = [
            ("x\u{1b}[31m", "control"),
            ("a\nb", "control"),
            ("a\r\nb", "control"),
            ("nul\0", "control"),
            ("tab\there", "control"),
            ("del\u{7f}", "control"),
            ("c1\u{85}", "control"),
            ("c1\u{9b}31m", "control"),
            ("arabic mark \u{61c}", "bidirectional"),
            ("rlm \u{200f}", "bidirectional"),
            ("lre \u{202a}", "bidirectional"),
            ("rlo pay\u{202e}ments", "bidirectional"),
            ("lri \u{2066}", "bidirectional"),
            ("pdi \u{2069}", "bidirectional"),
            ("ls \u{2028}forged", "separator"),
            ("ps \u{2029}forged", "separator"),
        ];
        for (raw, kind) in refused {
            let error = reason("reason", raw).expect_err(raw);
            assert_eq!(error.field, "reason", "{raw:?}");
            assert!(error.reason.contains(kind), "{raw:?}: {error}");
            assert!(error.to_string().starts_with("reason: "), "{error}");
        }
    }

    #[test]
    fn a_reason_keeps_prose_in_any_script() {
        for raw in [
            "",
            "INC-42: upstream melting",
            "INC-9 — Zahlungen überlastet, 支払い, مدفوعات",
            // Joiners are not bidirectional controls: emoji and Indic
            // scripts need them.
            "on fire 👩\u{200d}🚒",
        ] {
            assert_eq!(reason("reason", raw), Ok(raw));
        }
        let long = "x".repeat(MAX_REASON_BYTES + 1);
        assert!(reason("reason", &long).is_err());
        assert!(reason("reason", &long[1..]).is_ok());
    }
}
