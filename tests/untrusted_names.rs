//! What callers name reaches operators only within bounds: `/metrics`
//! gauges carry only the upstreams the configuration names (any other
//! upstream, look-alikes and bidirectional controls included, is summed
//! under `_other`, as the counters do), and an admin `reason` with control
//! or bidirectional-control characters is refused before it reaches the
//! audit log, changing nothing.
//!
//! Black-box: the real binary on loopback, memory store.

use retryd_testkit as support;

use retryd_proto as pb;
use support::{Server, retryable};
use tonic::Code;

/// The value of the one series named exactly `series` in a scrape.
fn value(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|value| value.parse().expect("a number"))
    })
}

#[tokio::test]
async fn gauges_carry_only_configured_upstreams() {
    let server = Server::start(
        "[defaults]\nbudget = { capacity = 10.0, initial = 10.0, ratio = 0.0, min_per_second = 0.0 }\n\
         [upstreams.payments]\nmax_attempts = 3\n",
    );
    let mut decider = server.decider().await;
    let mut admin = server.admin().await;
    // A look-alike of a configured name with a right-to-left override, and
    // a name the configuration does not know: each tracked, each spending.
    let spoof = "pay\u{202e}ments";
    for upstream in ["payments", spoof, "unlisted"] {
        let response = decider
            .decide(retryable(upstream))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.verdict(), pb::Verdict::Retry, "{upstream:?}");
    }
    decider
        .report_traffic(pb::ReportTrafficRequest {
            traffic: [spoof, "unlisted", "payments"]
                .into_iter()
                .map(|upstream| pb::UpstreamTraffic {
                    upstream: upstream.into(),
                    requests: 1,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "unlisted".into(),
            enabled: false,
            reason: "INC-7: unlisted upstream melting".into(),
        })
        .await
        .unwrap();

    let scrape = server.scrape();
    for line in scrape.lines() {
        assert!(
            !line.contains('\u{202e}') && !line.contains("unlisted"),
            "a series names a caller's upstream: {line:?}"
        );
    }
    let expected = [
        ("retryd_tracked_upstreams", 3.0),
        ("retryd_budget_tokens{upstream=\"payments\"}", 9.0),
        ("retryd_retries_enabled{upstream=\"payments\"}", 1.0),
        // The two others, summed: 9 tokens each.
        ("retryd_budget_tokens{upstream=\"_other\"}", 18.0),
        // Off for one of them: 0.
        ("retryd_retries_enabled{upstream=\"_other\"}", 0.0),
    ];
    for (series, wanted) in expected {
        assert_eq!(value(&scrape, series), Some(wanted), "{series}\n{scrape}");
    }
    let gauges = scrape
        .lines()
        .filter(|line| {
            line.starts_with("retryd_budget_tokens{") || line.starts_with("retryd_retries_enabled{")
        })
        .count();
    assert_eq!(gauges, 4, "one series per label and gauge:\n{scrape}");
}

#[tokio::test]
async fn an_admin_reason_with_control_characters_changes_nothing() {
    let server = Server::start("");
    let mut admin = server.admin().await;
    let mut decider = server.decider().await;
    for reason in [
        "x\u{1b}[31m",
        "a\nb",
        "nul\0",
        "tab\there",
        "c1\u{85}",
        "bidi \u{202e}",
        "isolate \u{2066}",
        // A line separator ends a line for JSON log readers (issue 29).
        "line \u{2028}separator",
    ] {
        let status = admin
            .set_retries_enabled(pb::SetRetriesEnabledRequest {
                upstream: "payments".into(),
                enabled: false,
                reason: reason.into(),
            })
            .await
            .expect_err("a reason with control characters is refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{reason:?}");
        assert!(
            status.message().starts_with("reason"),
            "{reason:?}: {}",
            status.message()
        );
    }
    let budget = admin
        .get_budget(pb::GetBudgetRequest {
            upstream: "payments".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(budget.retries_enabled, "nothing was switched off");
    assert!(!budget.tracked, "nothing was created");
    let response = decider
        .decide(retryable("payments"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.verdict(), pb::Verdict::Retry);

    // Ordinary prose, in any script, still goes through.
    let switched = admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "payments".into(),
            enabled: false,
            reason: "INC-9 — Zahlungen überlastet, 支払い".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(switched.previous && !switched.enabled);
}
