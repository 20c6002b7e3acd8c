//! What callers name reaches operators only within bounds: an admin
//! `reason` with control or bidirectional-control characters is refused
//! before it reaches the audit log, changing nothing.
//!
//! Black-box: the real binary on loopback, memory store.

mod support;

use retryd::pb;
use support::{Server, retryable};
use tonic::Code;

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
