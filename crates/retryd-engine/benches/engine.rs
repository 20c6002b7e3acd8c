//! The engine's `decide`, one benchmark per verdict kind and per rule that
//! takes a distinct path (earliest exit, the whole rule list, Retry-After
//! parsing, multipart bodies), plus the human explanation the gRPC edge
//! formats for every response.
//!
//! The engine is pure, so these numbers are the whole cost of a decision
//! minus the budget store and the transport. `scripts/bench` reads the
//! results from `target/criterion/engine/*`.

use std::hint::black_box;
use std::time::{Duration, SystemTime};

use criterion::{Criterion, criterion_group, criterion_main};
use retryd_engine::{
    self, Body, BudgetView, DenyReason, Evidence, Facts, FailureKind, GrpcCode, Idempotency,
    Lineage, Policy, Replayability, Verdict,
};

/// One benchmark case: the facts minus the borrowed body, and the verdict it
/// must produce (checked once before measuring, so a silent change in the
/// rules cannot turn a "retry" benchmark into a cheap early denial).
struct Case {
    name: &'static str,
    body: Body,
    facts: fn(&Body) -> Facts<'_>,
    expect: fn(&Verdict) -> bool,
}

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

/// A RETRY-shaped baseline: idempotent, first attempt, connect failure,
/// budget full, 2 s of deadline left.
fn base(body: &Body) -> Facts<'_> {
    Facts {
        idempotency: Idempotency::Idempotent,
        body,
        attempt: 1,
        claimed_evidence: Some(Evidence::NotSent),
        failure: Some(FailureKind::Connect),
        http_status: None,
        retry_after: None,
        grpc_status: None,
        grpc_pushback: None,
        deadline_remaining: Some(Duration::from_secs(2)),
        first_byte_delivered: false,
        runtime_draining: false,
        auth_refresh_attempted: false,
        previous_backoff: None,
        max_attempts: None,
        lineage: Lineage::EDGE,
        retried_below: None,
        budget: BudgetView {
            tokens: 100.0,
            retries_enabled: true,
            unavailable: false,
        },
        now: now(),
        jitter: 0.37,
    }
}

fn is_retry(verdict: &Verdict) -> bool {
    matches!(verdict, Verdict::Retry { .. })
}
fn is_deny(verdict: &Verdict) -> bool {
    matches!(verdict, Verdict::Deny(_))
}
fn is_ambiguous(verdict: &Verdict) -> bool {
    matches!(verdict, Verdict::Ambiguous)
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "retry_not_sent",
            body: Body::Bytes,
            facts: base,
            expect: is_retry,
        },
        Case {
            name: "retry_503_retry_after_seconds",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: None,
                failure: None,
                http_status: Some(503),
                retry_after: Some("1"),
                ..base(body)
            },
            expect: is_retry,
        },
        Case {
            name: "retry_429_retry_after_date",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: None,
                failure: None,
                http_status: Some(429),
                // 1 s after `now()`.
                retry_after: Some("Fri, 15 Jan 2027 08:00:01 GMT"),
                ..base(body)
            },
            expect: is_retry,
        },
        Case {
            name: "grpc_unavailable",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: Some(Evidence::ResponseReceived),
                failure: None,
                grpc_status: Some(GrpcCode::Unavailable),
                ..base(body)
            },
            expect: is_retry,
        },
        Case {
            // The slowest gRPC path: the pushback is parsed (twice: the
            // code's row, then the backoff floor) inside a deadline.
            name: "grpc_resource_exhausted_pushback",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: Some(Evidence::ResponseReceived),
                failure: None,
                grpc_status: Some(GrpcCode::ResourceExhausted),
                grpc_pushback: Some("300"),
                ..base(body)
            },
            expect: is_retry,
        },
        Case {
            name: "grpc_pushback_garbage_denied",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: Some(Evidence::ResponseReceived),
                failure: None,
                grpc_status: Some(GrpcCode::Unavailable),
                grpc_pushback: Some("soon"),
                ..base(body)
            },
            expect: |verdict| *verdict == Verdict::Deny(DenyReason::ServerPushback),
        },
        Case {
            name: "retry_401_refresh",
            body: Body::None,
            facts: |body| Facts {
                idempotency: Idempotency::Safe,
                claimed_evidence: None,
                failure: None,
                http_status: Some(401),
                ..base(body)
            },
            expect: is_retry,
        },
        Case {
            name: "retry_multipart_8_parts",
            body: Body::Multipart(vec![
                Body::Bytes,
                Body::EncodedValue,
                Body::ReopenableSupplier,
                Body::PublisherFactory(Replayability::Replayable),
                Body::Bytes,
                Body::Bytes,
                Body::EncodedValue,
                Body::None,
            ]),
            facts: base,
            expect: is_retry,
        },
        Case {
            name: "deny_max_attempts",
            body: Body::Bytes,
            facts: |body| Facts {
                attempt: 3,
                ..base(body)
            },
            expect: is_deny,
        },
        Case {
            name: "deny_budget_exhausted",
            body: Body::Bytes,
            facts: |body| Facts {
                budget: BudgetView {
                    tokens: 0.5,
                    retries_enabled: true,
                    unavailable: false,
                },
                ..base(body)
            },
            expect: is_deny,
        },
        Case {
            name: "deny_permanent_failure",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: None,
                failure: Some(FailureKind::TlsCertificateInvalid),
                ..base(body)
            },
            expect: is_deny,
        },
        Case {
            // Every rule is checked before the answer: the longest path.
            name: "deny_status_not_retryable",
            body: Body::Bytes,
            facts: |body| Facts {
                claimed_evidence: Some(Evidence::ResponseReceived),
                failure: None,
                http_status: Some(404),
                ..base(body)
            },
            expect: is_deny,
        },
        Case {
            name: "ambiguous_sent_no_response",
            body: Body::Bytes,
            facts: |body| Facts {
                idempotency: Idempotency::NonIdempotent,
                claimed_evidence: Some(Evidence::NotSent),
                failure: Some(FailureKind::GenericIo),
                ..base(body)
            },
            expect: is_ambiguous,
        },
        Case {
            name: "ambiguous_503_non_idempotent",
            body: Body::Bytes,
            facts: |body| Facts {
                idempotency: Idempotency::NonIdempotent,
                claimed_evidence: None,
                failure: None,
                http_status: Some(503),
                ..base(body)
            },
            expect: is_ambiguous,
        },
    ]
}

fn decide(c: &mut Criterion) {
    let policy = Policy::default();
    let mut group = c.benchmark_group("engine");
    for case in cases() {
        let facts = (case.facts)(&case.body);
        let decision = retryd_engine::decide(&facts, &policy);
        assert!(
            (case.expect)(&decision.verdict),
            "{}: unexpected {decision:?}",
            case.name
        );
        group.bench_function(case.name, |b| {
            b.iter(|| retryd_engine::decide(black_box(&facts), black_box(&policy)))
        });
    }
    group.finish();

    // The explanation is built by the gRPC edge for every response; it is
    // engine code (`Decision::explanation`), so it is measured here too.
    let mut group = c.benchmark_group("explain");
    for name in [
        "retry_not_sent",
        "deny_status_not_retryable",
        "ambiguous_sent_no_response",
    ] {
        let case = cases()
            .into_iter()
            .find(|case| case.name == name)
            .expect("the case list names it");
        let decision = retryd_engine::decide(&(case.facts)(&case.body), &policy);
        group.bench_function(name, |b| b.iter(|| black_box(&decision).explanation()));
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = decide
}
criterion_main!(benches);
