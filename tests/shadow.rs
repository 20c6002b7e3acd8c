//! Shadow upstreams, candidate policies and offline replay (issue 22),
//! against the real binary on loopback.

use retryd_testkit as support;

use std::process::Command;

use retryd_proto as pb;
use support::{Server, binary, replay_json, retryable};

const SERVER: &str = "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nshutdown_grace = \"2s\"\n";

fn report(upstream: &str, requests: u64) -> pb::ReportTrafficRequest {
    pb::ReportTrafficRequest {
        traffic: vec![pb::UpstreamTraffic {
            upstream: upstream.into(),
            requests,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

/// A shadow upstream spends and refills as a live one would while every
/// answer says it is not enforced; enforcing it by reload keeps the level.
#[tokio::test]
async fn a_shadow_budget_drains_and_refills_and_enforcing_it_keeps_its_level() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    let policy = "budget = { capacity = 3.0, initial = 2.0, ratio = 0.5, min_per_second = 0.0 }\n";
    std::fs::write(
        &path,
        format!("{SERVER}[upstreams.pay]\nenforce = false\n{policy}"),
    )
    .unwrap();
    let server = Server::start_file(&path);
    let mut client = server.decider().await;

    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(client.decide(retryable("pay")).await.unwrap().into_inner());
    }
    assert!(answers.iter().all(|answer| answer.shadow), "{answers:?}");
    assert_eq!(answers[0].verdict(), pb::Verdict::Retry);
    assert_eq!(answers[1].tokens_remaining, 0.0);
    assert_eq!(answers[2].deny_reason(), pb::DenyReason::BudgetExhausted);
    // An unconfigured upstream is enforced as ever.
    let other = client
        .decide(retryable("other"))
        .await
        .unwrap()
        .into_inner();
    assert!(!other.shadow);

    // Refilled by reported traffic, as a live budget is.
    client.report_traffic(report("pay", 4)).await.unwrap();
    let refilled = client.decide(retryable("pay")).await.unwrap().into_inner();
    assert_eq!(refilled.verdict(), pb::Verdict::Retry, "{refilled:?}");
    assert!(refilled.shadow);
    assert_eq!(refilled.tokens_remaining, 1.0);
    let scrape = server.scrape();
    assert_eq!(
        metric(&scrape, "retryd_shadow_decisions_total{upstream=\"pay\"}"),
        4.0
    );

    // Enforced from now on, from the level the shadow budget reached.
    std::fs::write(&path, format!("{SERVER}[upstreams.pay]\n{policy}")).unwrap();
    server
        .admin()
        .await
        .reload_config(pb::ReloadConfigRequest {})
        .await
        .unwrap();
    let enforced = client.decide(retryable("pay")).await.unwrap().into_inner();
    assert!(!enforced.shadow, "{enforced:?}");
    assert_eq!(enforced.verdict(), pb::Verdict::Retry);
    assert_eq!(
        enforced.tokens_remaining, 0.0,
        "the shadow level carried over"
    );
    let denied = client.decide(retryable("pay")).await.unwrap().into_inner();
    assert_eq!(denied.deny_reason(), pb::DenyReason::BudgetExhausted);
}

const CANDIDATE: &str = "[upstreams.pay]\n\
    budget = { capacity = 100.0, initial = 5.0, ratio = 0.5, min_per_second = 0.0 }\n\
    candidate = { budget = { initial = 1.0, ratio = 0.1 } }\n";

/// A candidate with a smaller budget diverges exactly as computed here,
/// and the live answers are those of the live policy alone.
#[tokio::test]
async fn a_candidate_counts_its_divergence_and_changes_no_live_answer() {
    let server = Server::start(CANDIDATE);
    let mut client = server.decider().await;
    // Live: 5 tokens, ratio 0.5. Candidate: 1 token, ratio 0.1.
    let mut live = Vec::new();
    for _ in 0..3 {
        live.push(client.decide(retryable("pay")).await.unwrap().into_inner());
    }
    client.report_traffic(report("pay", 20)).await.unwrap(); // live +10, candidate +2
    for _ in 0..4 {
        live.push(client.decide(retryable("pay")).await.unwrap().into_inner());
    }
    // Computed by hand: live 5 → 2, +10 = 12 → 8, every answer a RETRY.
    assert!(
        live.iter()
            .all(|answer| answer.verdict() == pb::Verdict::Retry),
        "{live:?}"
    );
    assert_eq!(live.last().unwrap().tokens_remaining, 8.0);
    assert!(live.iter().all(|answer| !answer.shadow));
    // Candidate: 1 → RETRY, then 2 denials; +2 → 2 RETRYs, then 2 denials.
    let scrape = server.scrape();
    let series = |candidate: &str, reason: &str| {
        metric(
            &scrape,
            &format!(
                "retryd_candidate_decisions_total{{upstream=\"pay\",live=\"retry\",candidate=\"{candidate}\",reason=\"{reason}\"}}"
            ),
        )
    };
    assert_eq!(series("retry", ""), 3.0, "{scrape}");
    assert_eq!(series("deny", "budget_exhausted"), 4.0, "{scrape}");
}

/// Refused, naming the key: an unknown key in a candidate, a key a
/// candidate cannot have, a candidate in [defaults], and a candidate on a
/// store that cannot hold its budget.
#[test]
fn bad_shadow_and_candidate_settings_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[upstreams.pay]\ncandidate = { ratio = 0.1 }\n",
            "upstreams.pay.candidate",
        ),
        (
            "[upstreams.pay]\ncandidate = { enforce = false }\n",
            "upstreams.\"pay\".candidate.enforce",
        ),
        (
            "[defaults]\ncandidate = { max_attempts = 2 }\n",
            "defaults.candidate",
        ),
        (
            "[upstreams.pay]\nenforce = \"sometimes\"\n",
            "upstreams.pay.enforce",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n[upstreams.pay]\ncandidate = { max_attempts = 2 }\n",
            "upstreams.\"pay\".candidate",
        ),
    ];
    for (toml, key) in cases {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, toml).unwrap();
        let output = Command::new(binary())
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{toml}");
        assert!(stderr.contains(key), "{toml}: {stderr}");
    }
}

/// A recorded log replayed under its own configuration gives back every
/// recorded verdict; under the candidate promoted to live, the candidate
/// counts the metrics showed for the same traffic.
#[tokio::test]
async fn replay_reproduces_the_log_and_matches_the_candidate_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("decisions.jsonl");
    let live_config = dir.path().join("live.toml");
    std::fs::write(
        &live_config,
        format!(
            "{SERVER}[decision_log]\npath = {:?}\n{CANDIDATE}",
            log.display().to_string()
        ),
    )
    .unwrap();
    let mut server = Server::start_file(&live_config);
    let mut client = server.decider().await;
    let kinds = [
        retryable("pay"),
        pb::DecideRequest {
            failure: 0,
            http_status: 404,
            ..retryable("pay")
        },
        pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            failure: pb::FailureKind::ConnectionReset as i32,
            ..retryable("pay")
        },
        retryable("elsewhere"),
    ];
    for round in 0..6 {
        for kind in &kinds {
            client.decide(kind.clone()).await.unwrap();
        }
        if round % 2 == 0 {
            client.report_traffic(report("pay", 10)).await.unwrap();
        }
    }
    let scrape = server.scrape();
    server.terminate(std::time::Duration::from_secs(10));

    let same = replay_json(&live_config, &log);
    for upstream in ["pay", "elsewhere"] {
        let replayed = &same["upstreams"][upstream];
        assert_eq!(replayed["changed"], 0, "{same:#}");
        assert_eq!(replayed["recorded"], replayed["replayed"], "{same:#}");
    }
    assert_eq!(same["upstreams"]["pay"]["decisions"], 18);
    assert_eq!(same["upstreams"]["pay"]["reported"], 30);

    // The candidate promoted: what the candidate metrics counted.
    let promoted = dir.path().join("promoted.toml");
    std::fs::write(
        &promoted,
        "[upstreams.pay]\nbudget = { capacity = 100.0, initial = 1.0, ratio = 0.1, min_per_second = 0.0 }\n",
    )
    .unwrap();
    let candidate = replay_json(&promoted, &log);
    let pay = &candidate["upstreams"]["pay"];
    let counted = |verdict: &str, reason: &str| -> f64 {
        ["retry", "deny", "ambiguous"]
            .iter()
            .map(|live| {
                metric(
                    &scrape,
                    &format!(
                        "retryd_candidate_decisions_total{{upstream=\"pay\",live=\"{live}\",candidate=\"{verdict}\",reason=\"{reason}\"}}"
                    ),
                )
            })
            .sum()
    };
    assert_eq!(
        pay["replayed"]["retry"].as_f64().unwrap(),
        counted("retry", ""),
        "{candidate:#}\n{scrape}"
    );
    assert_eq!(
        pay["replayed_denials"]["budget_exhausted"]
            .as_f64()
            .unwrap_or(0.0),
        counted("deny", "budget_exhausted"),
        "{candidate:#}"
    );
    assert!(
        pay["retries_now_budget_denials"].as_u64().unwrap() > 0,
        "{candidate:#}"
    );
}
