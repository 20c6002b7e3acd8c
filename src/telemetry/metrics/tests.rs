//! Unit tests of the metrics: every label table, counting, rendering.

use super::*;
use crate::budget::{BudgetSnapshot, StoreStats};
use crate::engine::{Body, BudgetView, Evidence, Facts, Idempotency, Lineage, Policy};

/// A decision with `verdict`'s kind: the engine's own answer to a call
/// that was never sent (RETRY) or sent with no response and not
/// idempotent (AMBIGUOUS), or a denial for `reason`.
fn decision(idempotency: Idempotency, evidence: Evidence) -> Decision {
    let body = Body::None;
    let facts = Facts {
        idempotency,
        body: &body,
        attempt: 1,
        claimed_evidence: Some(evidence),
        failure: None,
        http_status: None,
        retry_after: None,
        grpc_status: None,
        grpc_pushback: None,
        deadline_remaining: None,
        first_byte_delivered: false,
        runtime_draining: false,
        auth_refresh_attempted: false,
        previous_backoff: None,
        max_attempts: None,
        lineage: Lineage::EDGE,
        retried_below: None,
        budget: BudgetView::OPEN,
        now: std::time::SystemTime::UNIX_EPOCH,
        jitter: 0.5,
    };
    crate::engine::decide(&facts, &Policy::default())
}

fn retry() -> Decision {
    let decision = decision(Idempotency::Idempotent, Evidence::SentNoResponse);
    assert!(matches!(decision.verdict, Verdict::Retry { .. }));
    decision
}

fn ambiguous() -> Decision {
    let decision = decision(Idempotency::NonIdempotent, Evidence::SentNoResponse);
    assert_eq!(decision.verdict, Verdict::Ambiguous);
    decision
}

fn counter_lines(page: &str, name: &str) -> Vec<String> {
    page.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_verdict_and_reason_has_a_column_of_its_own_and_its_label() {
    let mut seen = std::collections::HashSet::new();
    for (position, &reason) in DenyReason::VARIANTS.iter().enumerate() {
        // The dense cast is the position in the derived list.
        assert_eq!(reason as usize, position, "{reason:?}");
        let index = outcome_index(&Verdict::Deny(reason));
        assert!(index < OUTCOMES);
        assert_eq!(outcome_labels(index), ("deny", reason.as_str()));
        assert!(seen.insert(index), "{reason:?} shares a column");
    }
    let retry = outcome_index(&retry().verdict);
    let ambiguous = outcome_index(&Verdict::Ambiguous);
    assert_eq!(outcome_labels(retry), ("retry", ""));
    assert_eq!(outcome_labels(ambiguous), ("ambiguous", ""));
    assert!(seen.insert(retry) && seen.insert(ambiguous));
    assert_eq!(seen.len(), OUTCOMES);
}

#[test]
fn every_store_operation_has_its_own_series() {
    for (position, &op) in StoreOp::VARIANTS.iter().enumerate() {
        assert_eq!(op as usize, position, "{op:?}");
    }
    let metrics = Metrics::new(["payments"]);
    metrics.record_store(StoreOp::Deposit, Duration::from_micros(30), true);
    metrics.record_store(StoreOp::Withdraw, Duration::from_micros(30), false);
    let page = metrics.render(&[], 1.0, &StoreStats::default());
    let errors = counter_lines(&page, METRIC_STORE_ERRORS);
    let labels: Vec<&str> = StoreOp::VARIANTS.iter().map(|op| op.label()).collect();
    assert_eq!(labels, ["view", "withdraw", "admit", "deposit", "admin"]);
    for label in labels {
        let value = if label == "deposit" { 1 } else { 0 };
        assert!(
            errors.contains(&format!("{METRIC_STORE_ERRORS}{{op=\"{label}\"}} {value}")),
            "{errors:?}"
        );
    }
    assert!(page.contains(&format!(
        "{METRIC_STORE_SECONDS}_count{{op=\"withdraw\"}} 1"
    )));
}

#[test]
fn decisions_are_counted_by_upstream_verdict_and_reason() {
    let metrics = Metrics::new(["payments"]);
    let elapsed = Duration::from_micros(40);
    metrics.record_decision("payments", "anonymous", &retry(), 1, elapsed, None);
    metrics.record_decision("payments", "anonymous", &retry(), 1, elapsed, None);
    metrics.record_decision("payments", "anonymous", &ambiguous(), 1, elapsed, None);
    let exhausted = retry().into_budget_denial(DenyReason::BudgetExhausted);
    metrics.record_decision("payments", "anonymous", &exhausted, 1, elapsed, None);
    // An upstream nobody configured counts as `_other`.
    metrics.record_decision("made-up", "anonymous", &exhausted, 1, elapsed, None);
    let page = metrics.render(&[], 1.0, &StoreStats::default());
    let mut lines = counter_lines(&page, METRIC_DECISIONS);
    lines.sort();
    assert_eq!(
        lines,
        [
            "retryd_decisions_total{upstream=\"_other\",verdict=\"deny\",reason=\"budget_exhausted\"} 1",
            "retryd_decisions_total{upstream=\"payments\",verdict=\"ambiguous\",reason=\"\"} 1",
            "retryd_decisions_total{upstream=\"payments\",verdict=\"deny\",reason=\"budget_exhausted\"} 1",
            "retryd_decisions_total{upstream=\"payments\",verdict=\"retry\",reason=\"\"} 2",
        ]
    );
    assert!(
        page.contains(&format!("{METRIC_DECISION_SECONDS}_count 5")),
        "{page}"
    );
    // Five decisions of 40 µs: all within the 50 µs bucket, none below 25.
    assert!(
        page.contains(&format!(
            "{METRIC_DECISION_SECONDS}_bucket{{le=\"0.00005\"}} 5"
        )),
        "{page}"
    );
    assert!(
        page.contains(&format!(
            "{METRIC_DECISION_SECONDS}_bucket{{le=\"0.000025\"}} 0"
        )),
        "{page}"
    );
}

#[test]
fn every_metric_has_help_and_type_once() {
    let metrics = Metrics::new(["payments"]);
    let page = metrics.render(
        &[budget("payments", 1.0, true)],
        1.0,
        &StoreStats::default(),
    );
    let mut types = std::collections::HashMap::new();
    for line in page.lines().filter(|line| line.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        *types.entry(name.to_owned()).or_insert(0) += 1;
    }
    assert!(types.values().all(|&count| count == 1), "{types:?}");
    for line in page
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count", "_total"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|family| types.contains_key(*family))
            .unwrap_or(name);
        assert!(types.contains_key(family), "no TYPE for {line}");
    }
}

fn budget(upstream: &str, tokens: f64, retries_enabled: bool) -> BudgetSnapshot {
    BudgetSnapshot {
        upstream: upstream.to_owned(),
        tokens,
        retries_enabled,
        tracked: true,
        shared_unavailable: false,
        pushback_remaining: None,
        adaptive_level: 1.0,
        ramp_elapsed: None,
    }
}

fn gauge_lines(page: &str) -> Vec<&str> {
    page.lines()
        .filter(|line| {
            line.starts_with("retryd_budget_tokens{") || line.starts_with("retryd_retries_enabled{")
        })
        .collect()
}

#[test]
fn gauges_name_configured_upstreams_and_sum_the_others() {
    let metrics = Metrics::new(["payments", "ledger", "search"]);
    let budgets = [
        budget("ledger", 3.0, false),
        budget("pay\u{202e}ments", 2.0, true),
        budget("payments", 5.5, true),
        budget("payments\u{200b}", 1.0, false),
        budget("zzz", 0.5, true),
    ];
    let page = metrics.render(&budgets, 1.0, &StoreStats::default());
    assert_eq!(
        gauge_lines(&page),
        [
            "retryd_budget_tokens{upstream=\"ledger\"} 3.0",
            "retryd_budget_tokens{upstream=\"payments\"} 5.5",
            "retryd_budget_tokens{upstream=\"_other\"} 3.5",
            "retryd_retries_enabled{upstream=\"ledger\"} 0",
            "retryd_retries_enabled{upstream=\"payments\"} 1",
            "retryd_retries_enabled{upstream=\"_other\"} 0",
        ],
        "{page}"
    );
    assert!(page.contains("\nretryd_tracked_upstreams 5\n"), "{page}");
}

#[test]
fn without_unconfigured_upstreams_there_is_no_other_series() {
    let metrics = Metrics::new(["payments"]);
    let page = metrics.render(
        &[budget("payments", 1.0, true)],
        1.0,
        &StoreStats::default(),
    );
    assert_eq!(
        gauge_lines(&page),
        [
            "retryd_budget_tokens{upstream=\"payments\"} 1.0",
            "retryd_retries_enabled{upstream=\"payments\"} 1",
        ]
    );
    let empty = Metrics::new(["payments"]).render(&[], 1.0, &StoreStats::default());
    assert!(gauge_lines(&empty).is_empty(), "{empty}");
}

#[test]
fn an_upstream_configured_as_other_is_one_series_with_the_others() {
    let metrics = Metrics::new(["_other", "payments"]);
    let page = metrics.render(
        &[budget("_other", 1.0, true), budget("unlisted", 2.0, true)],
        1.0,
        &StoreStats::default(),
    );
    assert_eq!(
        gauge_lines(&page),
        [
            "retryd_budget_tokens{upstream=\"_other\"} 3.0",
            "retryd_retries_enabled{upstream=\"_other\"} 1",
        ]
    );
}

#[test]
fn configured_names_are_escaped_as_the_text_format_requires() {
    // The configuration allows any name but brackets: quotes,
    // backslashes and newlines must not end a label value or a line.
    let names = ["we\"ird", "back\\slash", "new\nline", "tab\tand ü"];
    let metrics = Metrics::new(names);
    let budgets: Vec<BudgetSnapshot> = names.iter().map(|name| budget(name, 1.0, true)).collect();
    let page = metrics.render(&budgets, 1.0, &StoreStats::default());
    for escaped in [
        "\"back\\\\slash\"",
        "\"new\\nline\"",
        "\"tab\tand ü\"",
        "\"we\\\"ird\"",
    ] {
        let tokens = format!("retryd_budget_tokens{{upstream={escaped}}} 1.0");
        assert!(page.lines().any(|line| line == tokens), "{tokens}\n{page}");
    }
    // Every line is a comment or one whole sample: no name broke a line.
    for line in page.lines() {
        assert!(
            line.starts_with("# ") || line.starts_with("retryd_"),
            "{line:?}"
        );
        // `# EOF` closes an OpenMetrics page.
        assert_eq!(page.lines().last(), Some("# EOF"));
    }
}
