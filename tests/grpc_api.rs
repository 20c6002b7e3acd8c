//! Black-box tests of the gRPC API against the real binary on a loopback
//! port, with the embedded memory store.

use retryd_testkit as support;

use std::time::Duration;

use retryd_proto as pb;
use support::{Server, millis, retryable};
use tonic::Code;

#[tokio::test]
async fn each_verdict_kind() {
    // No floor, so that the token count is exact.
    let server = Server::start("[defaults]\nbudget = { min_per_second = 0.0 }\n");
    let mut client = server.decider().await;

    let retry = client
        .decide(retryable("orders"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(retry.verdict(), pb::Verdict::Retry, "{retry:?}");
    assert_eq!(retry.rule, 9);
    assert_eq!(retry.effective_evidence(), pb::Evidence::NotSent);
    assert!(
        millis(retry.backoff) < 50,
        "full jitter below base on attempt 1"
    );
    assert_eq!(retry.decision_id.len(), 32);
    assert_eq!(retry.tokens_remaining, 99.0, "one token spent");
    assert!(
        retry.explanation.starts_with("retry after"),
        "{}",
        retry.explanation
    );

    let deny = client
        .decide(pb::DecideRequest {
            failure: 0,
            http_status: 404,
            ..retryable("orders")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deny.verdict(), pb::Verdict::Deny);
    assert_eq!(deny.deny_reason(), pb::DenyReason::StatusNotRetryable);
    assert_eq!(deny.effective_evidence(), pb::Evidence::ResponseReceived);
    assert_eq!(deny.tokens_remaining, 99.0, "a denial spends nothing");

    let ambiguous = client
        .decide(pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            evidence: pb::Evidence::NotSent as i32,
            failure: pb::FailureKind::GenericIo as i32,
            ..retryable("payments")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ambiguous.verdict(), pb::Verdict::Ambiguous);
    assert_eq!(ambiguous.rule, 8);
    assert_eq!(ambiguous.effective_evidence(), pb::Evidence::SentNoResponse);
    assert!(
        ambiguous.evidence_adjusted,
        "a claimed NOT_SENT with generic I/O is weakened"
    );
    assert!(
        ambiguous.explanation.contains("weakened"),
        "{}",
        ambiguous.explanation
    );

    let refresh = client
        .decide(pb::DecideRequest {
            idempotency: pb::Idempotency::Safe as i32,
            failure: 0,
            http_status: 401,
            ..retryable("orders")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(refresh.verdict(), pb::Verdict::Retry);
    assert!(refresh.refresh_credentials);
    assert_eq!(millis(refresh.backoff), 0);
}

#[tokio::test]
async fn traffic_fills_a_budget_that_decide_spends_exactly() {
    let server = Server::start(
        r#"
        [upstreams.quiet]
        budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }
        "#,
    );
    let mut client = server.decider().await;
    let mut admin = server.admin().await;

    let empty = client
        .decide(retryable("quiet"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(empty.deny_reason(), pb::DenyReason::BudgetExhausted);
    assert_eq!(empty.rule, 2);

    let accepted = client
        .report_traffic(pb::ReportTrafficRequest {
            traffic: vec![
                pb::UpstreamTraffic {
                    upstream: "quiet".into(),
                    requests: 30,
                    ..Default::default()
                },
                pb::UpstreamTraffic {
                    upstream: "quiet".into(),
                    requests: 20,
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .accepted;
    assert_eq!(accepted, 2);
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "quiet".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(
        (budget.tokens - 5.0).abs() < 1e-9,
        "50 requests × 0.1 = 5 tokens: {budget:?}"
    );
    assert!(budget.tracked);

    let mut verdicts = Vec::new();
    for _ in 0..8 {
        let response = client
            .decide(retryable("quiet"))
            .await
            .unwrap()
            .into_inner();
        verdicts.push((response.verdict(), response.deny_reason()));
    }
    let retries = verdicts
        .iter()
        .filter(|(v, _)| *v == pb::Verdict::Retry)
        .count();
    assert_eq!(retries, 5, "{verdicts:?}");
    assert!(verdicts[..5].iter().all(|(v, _)| *v == pb::Verdict::Retry));
    assert!(
        verdicts[5..]
            .iter()
            .all(|v| *v == (pb::Verdict::Deny, pb::DenyReason::BudgetExhausted))
    );

    // Reports are capped at capacity.
    client
        .report_traffic(pb::ReportTrafficRequest {
            traffic: vec![pb::UpstreamTraffic {
                upstream: "quiet".into(),
                requests: 1_000,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "quiet".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert_eq!(budget.tokens, 10.0);
}

#[tokio::test]
async fn denials_and_ambiguity_never_spend() {
    let server = Server::start("");
    let mut client = server.decider().await;
    let mut admin = server.admin().await;
    for status in [400, 404, 500, 501] {
        let response = client
            .decide(pb::DecideRequest {
                failure: 0,
                http_status: status,
                ..retryable("ledger")
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.verdict(), pb::Verdict::Deny);
    }
    for _ in 0..5 {
        let response = client
            .decide(pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                failure: pb::FailureKind::ResponseHeaderTimeout as i32,
                ..retryable("ledger")
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.verdict(), pb::Verdict::Ambiguous);
    }
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "ledger".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert_eq!(budget.tokens, 100.0);
    assert!(!budget.tracked, "looking does not even create state");
}

#[tokio::test]
async fn the_kill_switch() {
    let server = Server::start("");
    let mut client = server.decider().await;
    let mut admin = server.admin().await;

    let switched = admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "search".into(),
            enabled: false,
            reason: "INC-42: upstream melting".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(switched.previous);
    assert!(!switched.enabled);

    let denied = client
        .decide(retryable("search"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(denied.deny_reason(), pb::DenyReason::RetriesDisabled);
    assert_eq!(denied.rule, 5);
    let other = client
        .decide(retryable("catalog"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        other.verdict(),
        pb::Verdict::Retry,
        "other upstreams are unaffected"
    );

    let listed = admin
        .list_budgets(pb::ListBudgetsRequest {})
        .await
        .unwrap()
        .into_inner()
        .budgets;
    let names: Vec<_> = listed
        .iter()
        .map(|b| (b.upstream.as_str(), b.retries_enabled))
        .collect();
    assert_eq!(names, [("catalog", true), ("search", false)]);
    assert!(
        server.logs().contains("INC-42"),
        "the switch is audited with its reason"
    );

    admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "search".into(),
            enabled: true,
            reason: "recovered".into(),
        })
        .await
        .unwrap();
    // Switched back on, retries return along the recovery ramp (README,
    // "Recovery"): GetBudget shows it under way, and a retry is admitted
    // only on a draw below its share, which starts at 0.
    let ramping = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "search".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(ramping.retries_enabled && ramping.ramp < 1.0, "{ramping:?}");
    let again = client
        .decide(retryable("search"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        again.verdict() == pb::Verdict::Retry
            || (again.deny_reason() == pb::DenyReason::BudgetExhausted
                && again.explanation.contains("recovering")),
        "{again:?}"
    );
}

#[tokio::test]
async fn decide_stream_keeps_order_over_ten_thousand_requests() {
    let server = Server::start(
        r#"
        [defaults]
        max_retry_after = "24h"
        budget = { capacity = 1000000.0, initial = 1000000.0 }
        "#,
    );
    let mut client = server.decider().await;
    const N: usize = 10_000;
    // Each request is built so that its answer says which request it was:
    // a 429 whose Retry-After (in seconds) is the request's index sets the
    // backoff's whole seconds; every 500th request is invalid.
    let request = |i: usize| {
        if i % 500 == 499 {
            return pb::DecideRequest {
                upstream: String::new(),
                ..retryable("stream")
            };
        }
        // The deadline leaves exactly i seconds of room: every caller's
        // 429 sets the upstream's earliest-retry time fleet-wide (README,
        // "Fleet-wide pushback"), and a later item's backoff, stretched
        // past an earlier item's time and spread, is cut to its room.
        pb::DecideRequest {
            failure: 0,
            http_status: 429,
            retry_after: i.to_string(),
            deadline_remaining: Some(prost_types::Duration {
                seconds: i as i64,
                nanos: 50_000_000,
            }),
            ..retryable("stream")
        }
    };
    let requests = tokio_stream::iter((0..N).map(request));
    let mut responses = client.decide_stream(requests).await.unwrap().into_inner();
    let mut seen = 0;
    while let Some(response) = responses.message().await.unwrap() {
        let i = seen;
        if i % 500 == 499 {
            let error = response
                .error
                .clone()
                .expect("an invalid item carries an error");
            assert_eq!(error.code, Code::InvalidArgument as i32);
            assert!(error.message.starts_with("upstream:"), "{}", error.message);
            assert_eq!(response.verdict(), pb::Verdict::Unspecified);
        } else {
            assert_eq!(
                response.verdict(),
                pb::Verdict::Retry,
                "item {i}: {response:?}"
            );
            assert_eq!(
                response.backoff.unwrap().seconds,
                i as i64,
                "item {i} out of order"
            );
        }
        seen += 1;
    }
    assert_eq!(seen, N);
}

#[tokio::test]
async fn bad_input_is_refused_by_field_spends_nothing_and_the_server_survives() {
    let server = Server::start("");
    let mut client = server.decider().await;
    let base = || retryable("guarded");
    let duration = |seconds, nanos| Some(prost_types::Duration { seconds, nanos });
    let body = |kind: pb::BodyKind, declared: pb::Replayability, parts: Vec<pb::Body>| {
        Some(pb::Body {
            kind: kind as i32,
            declared: declared as i32,
            parts,
        })
    };
    let leaf = |kind: pb::BodyKind| pb::Body {
        kind: kind as i32,
        ..Default::default()
    };
    let mut deep = leaf(pb::BodyKind::Bytes);
    for _ in 0..5 {
        deep = pb::Body {
            kind: pb::BodyKind::Multipart as i32,
            declared: 0,
            parts: vec![deep],
        };
    }
    let cases: Vec<(&str, pb::DecideRequest)> = vec![
        (
            "upstream",
            pb::DecideRequest {
                upstream: String::new(),
                ..base()
            },
        ),
        (
            "upstream",
            pb::DecideRequest {
                upstream: "u".repeat(257),
                ..base()
            },
        ),
        (
            "upstream",
            pb::DecideRequest {
                upstream: "evil\nlog line".into(),
                ..base()
            },
        ),
        (
            "operation",
            pb::DecideRequest {
                operation: "o".repeat(300),
                ..base()
            },
        ),
        (
            "idempotency",
            pb::DecideRequest {
                idempotency: 0,
                ..base()
            },
        ),
        (
            "idempotency",
            pb::DecideRequest {
                idempotency: 42,
                ..base()
            },
        ),
        (
            "attempt",
            pb::DecideRequest {
                attempt: 0,
                ..base()
            },
        ),
        (
            "evidence",
            pb::DecideRequest {
                evidence: 9,
                ..base()
            },
        ),
        (
            "evidence",
            pb::DecideRequest {
                failure: 0,
                ..base()
            },
        ),
        (
            "failure",
            pb::DecideRequest {
                failure: 99,
                ..base()
            },
        ),
        (
            "failure",
            pb::DecideRequest {
                failure: -1,
                ..base()
            },
        ),
        (
            "http_status",
            pb::DecideRequest {
                http_status: 99,
                ..base()
            },
        ),
        (
            "http_status",
            pb::DecideRequest {
                http_status: 600,
                ..base()
            },
        ),
        (
            "http_status",
            pb::DecideRequest {
                failure: 0,
                evidence: pb::Evidence::ResponseReceived as i32,
                ..base()
            },
        ),
        (
            "retry_after",
            pb::DecideRequest {
                retry_after: "9".repeat(300),
                ..base()
            },
        ),
        (
            "deadline_remaining",
            pb::DecideRequest {
                deadline_remaining: duration(-1, 0),
                ..base()
            },
        ),
        (
            "deadline_remaining",
            pb::DecideRequest {
                deadline_remaining: duration(0, -5),
                ..base()
            },
        ),
        (
            "deadline_remaining",
            pb::DecideRequest {
                deadline_remaining: duration(10_000_000, 0),
                ..base()
            },
        ),
        (
            "previous_backoff",
            pb::DecideRequest {
                previous_backoff: duration(1, 2_000_000_000),
                ..base()
            },
        ),
        (
            "body.kind",
            pb::DecideRequest {
                body: body_kind(77),
                ..base()
            },
        ),
        (
            "body.declared",
            pb::DecideRequest {
                body: body(
                    pb::BodyKind::PublisherFactory,
                    pb::Replayability::Unspecified,
                    vec![],
                ),
                ..base()
            },
        ),
        (
            "body.declared",
            pb::DecideRequest {
                body: body(pb::BodyKind::Bytes, pb::Replayability::OneShot, vec![]),
                ..base()
            },
        ),
        (
            "body.parts",
            pb::DecideRequest {
                body: body(
                    pb::BodyKind::Multipart,
                    pb::Replayability::Unspecified,
                    vec![],
                ),
                ..base()
            },
        ),
        (
            "body.parts",
            pb::DecideRequest {
                body: body(
                    pb::BodyKind::Bytes,
                    pb::Replayability::Unspecified,
                    vec![leaf(pb::BodyKind::Bytes)],
                ),
                ..base()
            },
        ),
        (
            "body.parts[1].kind",
            pb::DecideRequest {
                body: body(
                    pb::BodyKind::Multipart,
                    pb::Replayability::Unspecified,
                    vec![
                        leaf(pb::BodyKind::Bytes),
                        pb::Body {
                            kind: -3,
                            ..Default::default()
                        },
                    ],
                ),
                ..base()
            },
        ),
        (
            "body.parts[0].parts[0].parts[0].parts",
            pb::DecideRequest {
                body: Some(deep),
                ..base()
            },
        ),
    ];
    assert!(cases.len() >= 20);
    for (field, request) in cases {
        let status = client.decide(request.clone()).await.expect_err(field);
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(
            status.message().starts_with(&format!("{field}:")),
            "expected field {field}, got {:?}",
            status.message()
        );
    }

    // Traffic reports and admin calls validate too.
    let status = client
        .report_traffic(pb::ReportTrafficRequest {
            traffic: vec![
                pb::UpstreamTraffic {
                    upstream: "guarded".into(),
                    requests: 10,
                    ..Default::default()
                },
                pb::UpstreamTraffic {
                    upstream: String::new(),
                    requests: 1,
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("traffic[1].upstream:"),
        "{}",
        status.message()
    );
    // An outcome count out of bounds is refused the same way, naming the
    // entry and the count, after valid entries that then deposit nothing.
    for field in ["successes", "failures", "retry_successes", "retry_failures"] {
        let mut bad = pb::UpstreamTraffic {
            upstream: "guarded".into(),
            requests: 1,
            ..Default::default()
        };
        let over = 1_000_000_001;
        match field {
            "successes" => bad.successes = over,
            "failures" => bad.failures = over,
            "retry_successes" => bad.retry_successes = over,
            _ => bad.retry_failures = over,
        }
        let good = pb::UpstreamTraffic {
            upstream: "guarded".into(),
            requests: 10,
            successes: 10,
            ..Default::default()
        };
        let status = client
            .report_traffic(pb::ReportTrafficRequest {
                traffic: vec![good.clone(), good, bad],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}");
        assert!(
            status
                .message()
                .starts_with(&format!("traffic[2].{field}:")),
            "{}",
            status.message()
        );
    }
    let mut admin = server.admin().await;
    let status = admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: String::new(),
            enabled: false,
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert!(
        status.message().starts_with("upstream:"),
        "{}",
        status.message()
    );

    // Nothing was spent or created, not even by the valid first entry of
    // the refused report, and the server still answers.
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "guarded".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert_eq!((budget.tokens, budget.tracked), (100.0, false));
    let after = client.decide(base()).await.unwrap().into_inner();
    assert_eq!(after.verdict(), pb::Verdict::Retry);
}

fn body_kind(kind: i32) -> Option<pb::Body> {
    Some(pb::Body {
        kind,
        ..Default::default()
    })
}

#[tokio::test]
async fn too_many_upstreams_is_resource_exhausted() {
    let server = Server::start("[limits]\nmax_upstreams = 2\n");
    let mut client = server.decider().await;
    for upstream in ["a", "b"] {
        let response = client
            .decide(retryable(upstream))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.verdict(), pb::Verdict::Retry);
    }
    let status = client.decide(retryable("c")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().starts_with("upstream:"),
        "{}",
        status.message()
    );
    // Known upstreams keep working.
    let response = client.decide(retryable("a")).await.unwrap().into_inner();
    assert_eq!(response.verdict(), pb::Verdict::Retry);
}

#[tokio::test]
async fn health_reflection_and_graceful_shutdown() {
    let mut server = Server::start("");
    for service in ["", "retryd.v1.RetryDecider", "retryd.v1.RetryAdmin"] {
        assert_eq!(
            server.health(service).await.unwrap(),
            support::ServingStatus::Serving,
            "{service:?}"
        );
    }
    // The memory store is all there is and always reachable: both store
    // entries read SERVING once the health task has set them.
    for service in ["retryd.v1.BudgetStore", "retryd.v1.BudgetStore.Any"] {
        server
            .health_becomes(service, support::ServingStatus::Serving)
            .await;
    }
    let probe = std::process::Command::new(support::binary())
        .args(["health", "--addr", &server.grpc.to_string()])
        .output()
        .unwrap();
    assert!(probe.status.success(), "{probe:?}");

    let status = server
        .terminate(Duration::from_secs(10))
        .expect("retryd exits on SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn check_config_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[upstreams.\"payments-api\"]\nmax_attempts = 2\nbudget = { capacity = 20.0 }\n",
    )
    .unwrap();
    let output = std::process::Command::new(support::binary())
        .args(["check-config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[defaults]\nbackoff = { base = \"fast\" }\n").unwrap();
    let output = std::process::Command::new(support::binary())
        .args(["check-config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("defaults.backoff.base"), "{stderr}");

    // A bad value refuses to serve before binding anything.
    let output = std::process::Command::new(support::binary())
        .args(["serve", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(output.stdout.is_empty(), "no ready line was printed");
}

#[tokio::test]
async fn reflection_lists_the_services_for_grpcurl() {
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;

    let server = Server::start("");
    let mut client = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("{response:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    for expected in [
        "retryd.v1.RetryDecider",
        "retryd.v1.RetryAdmin",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }
}

/// An attempt is HTTP or gRPC: naming both, a code outside 1-16, a
/// pushback without a code or a Retry-After on a gRPC call is
/// INVALID_ARGUMENT naming the field, and spends nothing.
#[tokio::test]
async fn bad_grpc_outcomes_name_the_field_and_spend_nothing() {
    let server = Server::start("[defaults]\nbudget = { initial = 5.0, min_per_second = 0.0 }\n");
    let mut client = server.decider().await;
    let mut admin = server.admin().await;
    let grpc = |code: u32| pb::DecideRequest {
        failure: 0,
        evidence: pb::Evidence::ResponseReceived as i32,
        grpc_status_code: code,
        ..retryable("stock")
    };
    let cases = [
        (
            pb::DecideRequest {
                http_status: 503,
                ..grpc(14)
            },
            "grpc_status_code",
        ),
        (grpc(17), "grpc_status_code"),
        (grpc(u32::MAX), "grpc_status_code"),
        (
            pb::DecideRequest {
                grpc_retry_pushback_ms: Some("100".into()),
                http_status: 503,
                grpc_status_code: 0,
                ..grpc(0)
            },
            "grpc_retry_pushback_ms",
        ),
        (
            pb::DecideRequest {
                grpc_retry_pushback_ms: Some("1".repeat(257)),
                ..grpc(8)
            },
            "grpc_retry_pushback_ms",
        ),
        (
            pb::DecideRequest {
                retry_after: "1".into(),
                ..grpc(14)
            },
            "retry_after",
        ),
    ];
    for (request, field) in cases {
        let status = client.decide(request.clone()).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{request:?}: {status:?}"
        );
        assert!(
            status.message().starts_with(field),
            "{field}: {}",
            status.message()
        );
    }
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "stock".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(!budget.tracked, "an invalid request created no bucket");
    // A valid gRPC retry spends exactly one token of the five.
    let granted = client.decide(grpc(14)).await.unwrap().into_inner();
    assert_eq!(granted.verdict(), pb::Verdict::Retry, "{granted:?}");
    assert_eq!(granted.tokens_remaining, 4.0);
}

/// The build's identity (issue 30): `retryd --version` names the version,
/// the git revision the binary was built from and the profile, and the
/// `retryd_build_info` gauge carries the same labels.
#[tokio::test]
async fn the_build_names_its_version_revision_and_profile() {
    let identity = support::build_identity();
    assert_eq!(identity.version, env!("CARGO_PKG_VERSION"));
    assert!(
        identity.revision == "unknown"
            || (identity.revision.len() == 12
                && identity.revision.bytes().all(|b| b.is_ascii_hexdigit())),
        "{identity:?}"
    );
    assert!(
        ["debug", "release"].contains(&identity.profile.as_str()),
        "{identity:?}"
    );
    // Built from this checkout (unless the tests were pointed at a binary
    // elsewhere): the revision is this checkout's HEAD.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned());
    let ours = std::path::Path::new(support::binary()).starts_with(env!("CARGO_MANIFEST_DIR"));
    if let (true, Some(head)) = (ours, head) {
        assert_eq!(identity.revision, head, "rebuilt since the last commit?");
    }
    let server = Server::start("");
    let scrape = server.scrape();
    let series = format!(
        "retryd_build_info{{version=\"{}\",revision=\"{}\",profile=\"{}\"}} 1",
        identity.version, identity.revision, identity.profile
    );
    assert!(scrape.contains(&series), "{series} in {scrape}");
}

/// Admin acts' store calls are timed and counted under `op="admin"`, as
/// the decisions' and reports' are under theirs (issue 30: it was never
/// recorded).
#[tokio::test]
async fn admin_store_calls_are_timed_as_admin() {
    let server = Server::start("");
    let mut decider = server.decider().await;
    decider.decide(retryable("orders")).await.unwrap();
    let mut admin = server.admin().await;
    admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "orders".into(),
        })
        .await
        .unwrap();
    admin.list_budgets(pb::ListBudgetsRequest {}).await.unwrap();
    admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "orders".into(),
            enabled: false,
            reason: "test".into(),
        })
        .await
        .unwrap();
    let scrape = server.scrape();
    let series = "retryd_store_operation_duration_seconds_count{op=\"admin\"} 3";
    assert!(scrape.contains(series), "{series} in {scrape}");
}
