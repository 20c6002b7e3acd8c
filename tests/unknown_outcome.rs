//! Issue 36 through real gRPC: a denied retry never hides that the call may
//! have happened. Each case the issue lists is answered with its deny reason
//! (or AMBIGUOUS) and the unknown-outcome mark; the controls carry none. The
//! mark is then counted, written to the decision log and kept by replay.

use std::time::Duration;

use retryd_proto as pb;
use retryd_testkit::{Server, replay_json};

/// A payment-like call whose response timed out: sent, no response.
fn charge(upstream: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "POST /v1/charges".into(),
        idempotency: pb::Idempotency::NonIdempotent as i32,
        attempt: 1,
        failure: pb::FailureKind::ResponseHeaderTimeout as i32,
        deadline_remaining: Some(prost_types::Duration {
            seconds: 2,
            nanos: 0,
        }),
        ..Default::default()
    }
}

const CONFIG: &str = r#"
[upstreams."empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }
"#;

#[tokio::test]
async fn every_denial_of_a_possibly_executed_call_says_so() {
    let logged = retryd_testkit::LoggedConfig::new(CONFIG);
    let (config, log) = (&logged.config, &logged.log);
    let server = Server::start_file(config);
    let mut client = server.decider().await;

    use pb::DenyReason as Why;
    use pb::UnknownOutcome as Mark;
    let status = |code: u32| pb::DecideRequest {
        failure: 0,
        http_status: code,
        ..charge("pay")
    };
    let cases: Vec<(&str, pb::DecideRequest, pb::Verdict, Why, Mark)> = vec![
        (
            "budget empty",
            charge("empty"),
            pb::Verdict::Deny,
            Why::BudgetExhausted,
            Mark::Reconcile,
        ),
        (
            "attempts used up",
            pb::DecideRequest {
                attempt: 3,
                ..charge("pay")
            },
            pb::Verdict::Deny,
            Why::MaxAttempts,
            Mark::Reconcile,
        ),
        (
            "deadline spent",
            pb::DecideRequest {
                deadline_remaining: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 10_000_000,
                }),
                ..charge("pay")
            },
            pb::Verdict::Deny,
            Why::Deadline,
            Mark::Reconcile,
        ),
        (
            "one-shot body",
            pb::DecideRequest {
                body: Some(pb::Body {
                    kind: pb::BodyKind::InputStream as i32,
                    ..Default::default()
                }),
                ..charge("pay")
            },
            pb::Verdict::Deny,
            Why::BodyNotReplayable,
            Mark::Reconcile,
        ),
        (
            "draining",
            pb::DecideRequest {
                runtime_draining: true,
                ..charge("pay")
            },
            pb::Verdict::Deny,
            Why::RuntimeDraining,
            Mark::Reconcile,
        ),
        (
            "502 on a POST",
            status(502),
            pb::Verdict::Ambiguous,
            Why::Unspecified,
            Mark::Reconcile,
        ),
        (
            "504 on a POST, last attempt",
            pb::DecideRequest {
                attempt: 3,
                ..status(504)
            },
            pb::Verdict::Deny,
            Why::MaxAttempts,
            Mark::Reconcile,
        ),
        (
            "504 on a POST, budget empty",
            pb::DecideRequest {
                upstream: "empty".into(),
                ..status(504)
            },
            pb::Verdict::Deny,
            Why::BudgetExhausted,
            Mark::Reconcile,
        ),
        (
            "a timeout with budget left",
            charge("pay"),
            pb::Verdict::Ambiguous,
            Why::Unspecified,
            Mark::Reconcile,
        ),
        (
            "keyed, budget empty",
            pb::DecideRequest {
                idempotency: pb::Idempotency::IdempotentWithKey as i32,
                ..charge("empty")
            },
            pb::Verdict::Deny,
            Why::BudgetExhausted,
            Mark::ResendWithKey,
        ),
        // The controls.
        (
            "proven NOT_SENT",
            pb::DecideRequest {
                failure: pb::FailureKind::Connect as i32,
                ..charge("empty")
            },
            pb::Verdict::Deny,
            Why::BudgetExhausted,
            Mark::None,
        ),
        (
            "a 4xx",
            status(409),
            pb::Verdict::Deny,
            Why::StatusNotRetryable,
            Mark::None,
        ),
        (
            "a SAFE call",
            pb::DecideRequest {
                idempotency: pb::Idempotency::Safe as i32,
                operation: "GET /v1/charges/1".into(),
                ..charge("empty")
            },
            pb::Verdict::Deny,
            Why::BudgetExhausted,
            Mark::None,
        ),
    ];
    let mut marked = 0;
    for (name, request, verdict, reason, mark) in &cases {
        let answer = client.decide(request.clone()).await.unwrap().into_inner();
        assert_eq!(answer.verdict(), *verdict, "{name}: {answer:?}");
        assert_eq!(answer.deny_reason(), *reason, "{name}: {answer:?}");
        assert_eq!(answer.unknown_outcome(), *mark, "{name}: {answer:?}");
        let says_so = answer.explanation.contains("may have taken effect")
            || answer.explanation.contains("outcome upstream is unknown");
        assert_eq!(
            says_so,
            *mark != Mark::None,
            "{name}: {}",
            answer.explanation
        );
        if *mark != Mark::None {
            marked += 1;
        }
    }

    // Counted per upstream and deciding rule (the configured "empty" by
    // name, "pay" as `_other`).
    let scrape = server.scrape();
    let counted: u64 = scrape
        .lines()
        .filter(|line| line.starts_with("retryd_unknown_outcomes_total{"))
        .map(|line| line.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(counted, marked, "{scrape}");
    assert!(
        scrape.contains(
            r#"retryd_unknown_outcomes_total{upstream="empty",rule="2",outcome="reconcile"} 2"#
        ),
        "{scrape}"
    );
    assert!(
        scrape.contains(r#"retryd_unknown_outcomes_total{upstream="empty",rule="2",outcome="resend_with_key"} 1"#),
        "{scrape}"
    );
    // The channel closes on this runtime while the blocking wait runs
    // elsewhere; an open one would hold the drain for its grace period.
    drop(client);
    let stopped = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.terminate(Duration::from_secs(10))
    })
    .await
    .unwrap();
    assert!(
        stopped.is_some_and(|status| status.success()),
        "{stopped:?}"
    );

    // The decision log keeps the mark, and replay keeps it too.
    let lines = logged.decisions(cases.len()).await;
    assert_eq!(lines.len(), cases.len());
    let logged = lines
        .iter()
        .filter(|line| line.get("unknown_outcome").is_some())
        .count();
    assert_eq!(logged as u64, marked);
    assert_eq!(lines[0]["unknown_outcome"], "reconcile");
    assert_eq!(lines[9]["unknown_outcome"], "resend_with_key");
    let replayed = replay_json(config, log);
    let total: u64 = replayed["upstreams"]
        .as_object()
        .unwrap()
        .values()
        .map(|upstream| {
            assert_eq!(upstream["changed"], 0, "{replayed:#}");
            upstream["unknown_outcomes"].as_u64().unwrap()
        })
        .sum();
    assert_eq!(total, marked, "{replayed:#}");
}
