//! Hedging end to end, through the real gRPC pipeline in this process on
//! the memory store: reports carrying latency histograms make a hedge
//! delay appear in the next `ReportTrafficResponse` and in `GetBudget`; a
//! hedge Decide is granted, spends from the retry budget, and is capped at
//! 5% of the first attempts; a uniformly slow upstream is not hedged and
//! says why; bad histograms and hedges reporting a failure are refused by
//! field and spend nothing.

mod hedging_common;
mod in_process_server;

use hedging_common::{InProcess, budget, entry, hedge, millis, report, turns_slow};
use retryd_budget::MemoryBudgetStore;
use retryd_proto as pb;

/// `fast` (no hedging key but the section: every default), `slow` (the
/// same policy), and `plain` (no hedging). No initial tokens and no floor:
/// every token comes from a report.
const CONFIG: &str = r#"
[defaults]
budget = { capacity = 1000.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams.fast.hedging]
quantile = 0.95

[upstreams.slow.hedging]
quantile = 0.95

[upstreams.plain]
max_attempts = 3

[upstreams.turning.hedging]
window = "6s"
"#;

#[tokio::test]
async fn a_reported_tail_is_served_as_a_delay_then_hedged_up_to_the_cap() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;

    // Before any latency: hedging is known, but not on yet.
    let first = report(&mut client, vec![entry("fast", 0, &[])]).await;
    // An empty histogram is a valid one (no bucket at all).
    let first = first.unwrap();
    assert_eq!(first.hedging.len(), 1);
    assert!(!first.hedging[0].enabled);
    let early = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(early.deny_reason(), pb::DenyReason::HedgingOff, "{early:?}");
    assert!(
        early.explanation.contains("0 samples"),
        "{}",
        early.explanation
    );

    // 200 first attempts: 180 at 10 ms, 20 at 100 ms. The p95 (rank 190)
    // is in the 100 ms bucket, the p50 in the 10 ms one.
    let answer = report(
        &mut client,
        vec![
            entry("fast", 200, &[(10, 180), (100, 20)]),
            entry("plain", 200, &[(10, 200)]),
            // The same upstream twice: one entry in the answer.
            entry("fast", 0, &[]),
        ],
    )
    .await
    .unwrap();
    assert_eq!(answer.hedging.len(), 1, "{:?}", answer.hedging);
    let served = &answer.hedging[0];
    assert_eq!(served.upstream, "fast");
    assert!(served.enabled, "{served:?}");
    let delay = millis(&served.delay);
    assert!((87.5..=112.5).contains(&delay), "{delay} ms");
    assert_eq!(served.max_hedges, 1);
    assert_eq!(
        served.idempotency,
        vec![
            pb::Idempotency::Safe as i32,
            pb::Idempotency::Idempotent as i32
        ]
    );
    let shown = budget(&server, "fast").await;
    assert_eq!(shown.hedging.as_ref(), Some(served));
    assert!(budget(&server, "plain").await.hedging.is_none());
    // 200 requests at ratio 0.5.
    assert_eq!(shown.tokens, 100.0);

    // The cap: 5% of 200 first attempts is 10 hedges, each one token of
    // the retry budget.
    for granted in 1..=10 {
        let answer = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry, "{answer:?}");
        assert_eq!(answer.backoff, Some(prost_types::Duration::default()));
        assert_eq!(answer.tokens_remaining, 100.0 - granted as f64);
        assert!(
            answer.explanation.starts_with("hedge 1 now"),
            "{}",
            answer.explanation
        );
    }
    let capped = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(capped.deny_reason(), pb::DenyReason::HedgeCap, "{capped:?}");
    assert!(
        capped
            .explanation
            .contains("10 hedges of 200 first attempts"),
        "{}",
        capped.explanation
    );
    // A denied hedge spent nothing; a retry still has the rest.
    assert_eq!(budget(&server, "fast").await.tokens, 90.0);
    // More first attempts raise the cap.
    report(&mut client, vec![entry("fast", 100, &[(10, 100)])])
        .await
        .unwrap();
    let more = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(more.verdict(), pb::Verdict::Retry, "{more:?}");

    // Beyond max_hedges, a non-idempotent call, an upstream without a
    // policy: hedging is off for them.
    for request in [
        hedge("fast", 2),
        pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            ..hedge("fast", 1)
        },
        pb::DecideRequest {
            idempotency: pb::Idempotency::IdempotentWithKey as i32,
            ..hedge("fast", 1)
        },
        hedge("plain", 1),
    ] {
        let answer = client.decide(request.clone()).await.unwrap().into_inner();
        assert_eq!(
            answer.deny_reason(),
            pb::DenyReason::HedgingOff,
            "{request:?}"
        );
        assert_eq!(answer.unknown_outcome(), pb::UnknownOutcome::None);
    }
    assert!(
        client
            .decide(hedge("plain", 1))
            .await
            .unwrap()
            .into_inner()
            .explanation
            .contains("no hedging policy")
    );
}

#[tokio::test]
async fn a_uniformly_slow_upstream_is_not_hedged() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    // Every call takes about 100 ms: the p50 is the p95.
    let answer = report(
        &mut client,
        vec![entry("slow", 500, &[(100, 400), (105, 100)])],
    )
    .await
    .unwrap();
    assert!(!answer.hedging[0].enabled, "{:?}", answer.hedging);
    assert_eq!(millis(&answer.hedging[0].delay), 0.0);
    let denied = client.decide(hedge("slow", 1)).await.unwrap().into_inner();
    assert_eq!(
        denied.deny_reason(),
        pb::DenyReason::UniformlySlow,
        "{denied:?}"
    );
    assert!(
        denied.explanation.contains("uniformly slow"),
        "{}",
        denied.explanation
    );
    assert_eq!(budget(&server, "slow").await.tokens, 250.0);
}

/// An upstream that turns slow as a whole is not hedged within its
/// window's last sixth (1 s of a 6 s window), although its window still
/// holds the fast calls and their tail from before: a copy would be as
/// slow as the first attempt (`hedging_common::turns_slow`).
#[tokio::test]
async fn an_upstream_turned_slow_is_not_hedged_within_a_sixth_of_its_window() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    turns_slow("turning", &mut client.clone(), &mut client).await;
}

#[tokio::test]
async fn the_kill_switch_and_an_empty_budget_stop_hedges() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    // Two first attempts but 200 latencies (a caller may report latencies
    // of attempts counted in an earlier report).
    report(&mut client, vec![entry("fast", 2, &[(10, 180), (200, 20)])])
        .await
        .unwrap();
    // Two requests: a cap of 0.1 hedge, so none.
    let capped = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(capped.deny_reason(), pb::DenyReason::HedgeCap, "{capped:?}");
    report(&mut client, vec![entry("fast", 198, &[])])
        .await
        .unwrap();
    // 200 requests: 100 tokens, all spent on retries.
    let mut retries = 0;
    loop {
        let answer = client
            .decide(retryd_testkit::retryable("fast"))
            .await
            .unwrap()
            .into_inner();
        if answer.verdict() != pb::Verdict::Retry {
            assert_eq!(answer.deny_reason(), pb::DenyReason::BudgetExhausted);
            break;
        }
        retries += 1;
    }
    assert_eq!(retries, 100);
    let empty = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(
        empty.deny_reason(),
        pb::DenyReason::BudgetExhausted,
        "{empty:?}"
    );
    assert!(
        empty.explanation.starts_with("deny hedge 1"),
        "{}",
        empty.explanation
    );

    report(&mut client, vec![entry("fast", 20, &[])])
        .await
        .unwrap();
    server
        .admin()
        .await
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "fast".into(),
            enabled: false,
            reason: "test".into(),
        })
        .await
        .unwrap();
    let off = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(
        off.deny_reason(),
        pb::DenyReason::RetriesDisabled,
        "{off:?}"
    );
    assert_eq!(budget(&server, "fast").await.tokens, 10.0);
}

#[tokio::test]
async fn bad_histograms_and_hedges_with_a_failure_are_refused_by_field() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    let bad = |counts: &[(u32, u64)]| pb::UpstreamTraffic {
        latency_successes: Some(pb::LatencyHistogram {
            counts: counts.iter().copied().collect(),
        }),
        ..entry("fast", 10, &[])
    };
    for (traffic, field) in [
        (
            vec![entry("fast", 10, &[]), bad(&[(16, 1), (300, 1)])],
            "traffic[1].latency_successes.counts[300]",
        ),
        (
            vec![bad(&[(20, 0)])],
            "traffic[0].latency_successes.counts[20]",
        ),
        (
            vec![bad(&[(20, 600_000_000), (21, 600_000_000)])],
            "traffic[0].latency_successes.counts",
        ),
        (
            vec![pb::UpstreamTraffic {
                latency_failures: Some(pb::LatencyHistogram {
                    counts: [(238, 1)].into_iter().collect(),
                }),
                ..entry("fast", 10, &[])
            }],
            "traffic[0].latency_failures.counts[238]",
        ),
    ] {
        let status = report(&mut client, traffic).await.expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "{}",
            status.message()
        );
    }
    // Nothing was deposited, nothing recorded.
    let shown = budget(&server, "fast").await;
    assert_eq!(shown.tokens, 0.0);
    assert!(!shown.hedging.unwrap().enabled);

    for (request, field) in [
        (
            pb::DecideRequest {
                evidence: pb::Evidence::SentNoResponse as i32,
                ..hedge("fast", 1)
            },
            "evidence",
        ),
        (
            pb::DecideRequest {
                http_status: 503,
                ..hedge("fast", 1)
            },
            "http_status",
        ),
        (
            pb::DecideRequest {
                failure: pb::FailureKind::Connect as i32,
                ..hedge("fast", 1)
            },
            "failure",
        ),
        (
            pb::DecideRequest {
                retry_after: "1".into(),
                ..hedge("fast", 1)
            },
            "retry_after",
        ),
        (hedge("fast", 17), "hedge"),
    ] {
        let status = client.decide(request).await.expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "{}",
            status.message()
        );
    }
}

#[tokio::test]
async fn a_shadow_upstream_answers_hedges_as_not_enforced() {
    let config =
        format!("{CONFIG}\n[upstreams.shadowed]\nenforce = false\n[upstreams.shadowed.hedging]\n");
    let server = InProcess::start(&config, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    report(
        &mut client,
        vec![entry("shadowed", 200, &[(10, 180), (100, 20)])],
    )
    .await
    .unwrap();
    // As a retry there: decided and spent on the shadow budget, answered
    // as not enforced.
    let answer = client
        .decide(hedge("shadowed", 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Retry, "{answer:?}");
    assert!(answer.shadow);
    assert_eq!(budget(&server, "shadowed").await.tokens, 99.0);
}

/// `retryd replay` decides a logged hedge again on the fleet's state it was
/// decided on live (logged with it): the same verdicts, nothing changed.
#[tokio::test]
async fn a_logged_hedge_replays_to_the_same_decision() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("decisions.jsonl");
    let config = format!(
        "{CONFIG}\n[decision_log]\npath = {:?}\n",
        log.to_str().unwrap()
    );
    let server = InProcess::start(&config, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    report(
        &mut client,
        vec![entry("fast", 40, &[(10, 180), (100, 20)])],
    )
    .await
    .unwrap();
    // 2 granted (5% of 40), then capped; a non-idempotent one is off.
    let mut verdicts = Vec::new();
    for request in [
        hedge("fast", 1),
        hedge("fast", 1),
        hedge("fast", 1),
        pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            ..hedge("fast", 1)
        },
    ] {
        verdicts.push(client.decide(request).await.unwrap().into_inner().verdict());
    }
    assert_eq!(
        verdicts,
        [
            pb::Verdict::Retry,
            pb::Verdict::Retry,
            pb::Verdict::Deny,
            pb::Verdict::Deny
        ]
    );
    server.flush_log();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("\"hedge\":{\"k\":1"), "{text}");
    let path = dir.path().join("replay.toml");
    std::fs::write(&path, CONFIG).unwrap();
    let config = retryd::config::Config::load(Some(&path)).unwrap();
    let replayed = retryd::decide::replay::replay(&config, text.as_bytes()).unwrap();
    let fast = &replayed.upstreams["fast"];
    assert_eq!(fast.decisions, 4);
    assert_eq!(fast.changed, 0, "{fast:?}");
    assert_eq!(fast.replayed.retry, 2);
    assert_eq!(fast.replayed_denials.get("hedge_cap"), Some(&1));
    assert_eq!(fast.replayed_denials.get("hedging_off"), Some(&1));
}

/// Another caller's Retry-After sets the upstream's earliest-retry time
/// fleet-wide: a hedge, sent now or never, is then denied SERVER_PUSHBACK
/// and spends nothing, while the upstream is otherwise hedged.
#[tokio::test]
async fn a_hedge_is_not_sent_while_another_callers_pushback_holds() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    report(
        &mut client,
        vec![entry("fast", 200, &[(10, 180), (100, 20)])],
    )
    .await
    .unwrap();
    let before = budget(&server, "fast").await.tokens;
    assert!(before >= 2.0, "{before} tokens");
    let announced = client
        .decide(pb::DecideRequest {
            upstream: "fast".into(),
            idempotency: pb::Idempotency::Safe as i32,
            attempt: 1,
            evidence: pb::Evidence::ResponseReceived as i32,
            http_status: 503,
            retry_after: "30".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(announced.verdict(), pb::Verdict::Retry, "{announced:?}");
    let left = budget(&server, "fast").await.tokens;
    let denied = client.decide(hedge("fast", 1)).await.unwrap().into_inner();
    assert_eq!(
        (denied.verdict(), denied.deny_reason()),
        (pb::Verdict::Deny, pb::DenyReason::ServerPushback),
        "{denied:?}"
    );
    assert_eq!(
        budget(&server, "fast").await.tokens,
        left,
        "a denied hedge spends nothing"
    );
}

#[tokio::test]
async fn hedges_won_as_callers_report_them_are_counted_per_hedged_upstream() {
    let server = InProcess::start(CONFIG, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    let won = |upstream: &str, won: u64| pb::UpstreamTraffic {
        hedges_won: won,
        ..entry(upstream, 10, &[(10, 10)])
    };
    report(&mut client, vec![won("fast", 3), won("plain", 5)])
        .await
        .unwrap();
    report(&mut client, vec![won("fast", 2), won("slow", 0)])
        .await
        .unwrap();
    let page = server.metrics_page();
    let series: Vec<&str> = page
        .lines()
        .filter(|line| line.starts_with("retryd_hedges_won_total{"))
        .collect();
    // Only an upstream with a hedging policy counts them; none for 0.
    assert_eq!(
        series,
        vec![r#"retryd_hedges_won_total{upstream="fast"} 5"#],
        "{page}"
    );
    // Bounded like every reported count, naming the field.
    let refused = report(&mut client, vec![won("fast", 2_000_000_000)])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("traffic[0].hedges_won"),
        "{}",
        refused.message()
    );
}
