//! Issue 31 through real gRPC: a failure deep in a call chain is retried by
//! one layer, not once per hop (docs/lineage.md).
//!
//! Three layers (edge → middle → back) each call the next and retry through
//! retryd as a client library does: on a failed attempt, Decide with the
//! inbound lineage and the failed response's `retryd-retried` mark; send
//! the next attempt with this layer's own entry appended; when retryd says
//! no more, fail upward with the mark. The back layer calls the failing
//! upstream, whose requests are counted. Budgets are large, so what limits
//! the retries is the chain rule alone, not a budget.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};

use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use retryd_testkit::Server;
use tonic::transport::Channel;

const LAYERS: [&str; 3] = ["edge", "middle", "back"];

const CONFIG: &str = r#"
[defaults]
max_attempts = 3
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 0.0 }

[upstreams."allow-db"]
inside_enclosing_retry = "allow"
"#;

/// What the failing upstream does: fail its first `failures` requests
/// (all of them by default), counting every request it receives.
struct Upstream {
    failures: u32,
    received: AtomicU32,
}

impl Upstream {
    fn failing(failures: u32) -> Upstream {
        Upstream {
            failures,
            received: AtomicU32::new(0),
        }
    }

    /// One request: true if it succeeded.
    fn call(&self) -> bool {
        self.received.fetch_add(1, Ordering::Relaxed) >= self.failures
    }
}

/// How the layers use retryd.
#[derive(Clone, Copy, PartialEq)]
enum Chain {
    /// Today's clients without lineage: each hop decides on its own.
    EveryHop,
    /// With lineage and the upward mark.
    Lineage,
    /// With lineage, but the back layer's failed responses carry no mark
    /// (a service without the inbound middleware, or a failure the layer
    /// above saw as a timeout).
    LineageUnmarkedBack,
}

/// A failed call as the layer above sees it: its response's mark, if the
/// layer that answered had already retried or been denied.
struct Failed {
    retried_below: Option<&'static str>,
}

type Call<'a> = Pin<Box<dyn Future<Output = Result<(), Failed>> + Send + 'a>>;

/// Serves one request at `layer` (0 = edge), made with `lineage`: calls
/// the next layer (or, at the back, the upstream named `db`) with retries
/// decided by retryd.
fn serve<'a>(
    retryd: &'a mut RetryDeciderClient<Channel>,
    upstream: &'a Upstream,
    db: &'a str,
    chain: Chain,
    layer: usize,
    lineage: String,
) -> Call<'a> {
    Box::pin(async move {
        let name = LAYERS[layer];
        let callee = LAYERS.get(layer + 1).copied().unwrap_or(db);
        let mut attempt = 1;
        loop {
            let own = match lineage.as_str() {
                "" => format!("{name}:{attempt}"),
                enclosing => format!("{enclosing}/{name}:{attempt}"),
            };
            let outcome = if layer + 1 < LAYERS.len() {
                serve(retryd, upstream, db, chain, layer + 1, own).await
            } else if upstream.call() {
                Ok(())
            } else {
                Err(Failed {
                    retried_below: None,
                })
            };
            let Err(failed) = outcome else {
                return Ok(());
            };
            let (lineage_sent, mark_sent) = match chain {
                Chain::EveryHop => (String::new(), String::new()),
                Chain::Lineage | Chain::LineageUnmarkedBack => (
                    lineage.clone(),
                    failed.retried_below.unwrap_or_default().to_owned(),
                ),
            };
            let answer = retryd
                .decide(pb::DecideRequest {
                    upstream: callee.to_owned(),
                    operation: "GET /v1/things".into(),
                    idempotency: pb::Idempotency::Safe as i32,
                    attempt,
                    http_status: 503,
                    lineage: lineage_sent,
                    retried_below: mark_sent,
                    ..Default::default()
                })
                .await
                .expect("a valid Decide")
                .into_inner();
            if answer.verdict() != pb::Verdict::Retry {
                // Denied (or out of attempts): say so to the layer above.
                let unmarked = chain == Chain::LineageUnmarkedBack && name == "back";
                return Err(Failed {
                    retried_below: (!unmarked).then_some(name),
                });
            }
            // The backoff is not waited: only the count of requests matters.
            attempt += 1;
        }
    })
}

/// Requests reaching the upstream for one request at the edge, and
/// whether the edge's request succeeded.
async fn one_request(server: &Server, chain: Chain, db: &str, failures: u32) -> (u32, bool) {
    let mut retryd = server.decider().await;
    let upstream = Upstream::failing(failures);
    let succeeded = serve(&mut retryd, &upstream, db, chain, 0, String::new())
        .await
        .is_ok();
    (upstream.received.load(Ordering::Relaxed), succeeded)
}

#[tokio::test]
async fn a_deep_failure_is_retried_by_one_layer() {
    let server = Server::start(CONFIG);
    // Without lineage: 3 attempts at each of 3 layers, 3³ at the bottom.
    let (every_hop, _) = one_request(&server, Chain::EveryHop, "db", u32::MAX).await;
    assert_eq!(every_hop, 27, "retries multiply down the chain");
    // With it: the back layer, nearest the failure, retries; the middle
    // and the edge see its mark and do not.
    let (lineage, succeeded) = one_request(&server, Chain::Lineage, "db", u32::MAX).await;
    assert_eq!(lineage, 3, "one hop's attempts");
    assert!(!succeeded);
}

#[tokio::test]
async fn the_nearest_layer_still_rides_out_a_transient_failure() {
    let server = Server::start(CONFIG);
    // Two failures, then the upstream answers: the back layer's own retries
    // get the request through, with no layer above retrying.
    let (received, succeeded) = one_request(&server, Chain::Lineage, "db", 2).await;
    assert!(succeeded, "the back layer's third attempt succeeds");
    assert_eq!(received, 3);
}

#[tokio::test]
async fn denials_name_the_layer_and_cost_no_token() {
    let server = Server::start(CONFIG);
    let mut retryd = server.decider().await;
    let ask = |lineage: &str, retried_below: &str| pb::DecideRequest {
        upstream: "middle-dep".into(),
        operation: "GET /v1/things".into(),
        idempotency: pb::Idempotency::Safe as i32,
        attempt: 1,
        http_status: 503,
        lineage: lineage.into(),
        retried_below: retried_below.into(),
        ..Default::default()
    };
    let below = retryd
        .decide(ask("edge:1", "back"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(below.deny_reason(), pb::DenyReason::RetriedBelow);
    assert_eq!(below.rule, 5);
    assert!(
        below.explanation.contains("retried by layer back"),
        "{}",
        below.explanation
    );
    let inside = retryd
        .decide(ask("edge:2/middle:1", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(inside.deny_reason(), pb::DenyReason::InsideEnclosingRetry);
    assert!(
        inside
            .explanation
            .contains("inside attempt 2 of layer edge"),
        "{}",
        inside.explanation
    );
    // Neither spent: the next retry sees every token.
    let retry = retryd.decide(ask("edge:1", "")).await.unwrap().into_inner();
    assert_eq!(retry.verdict(), pb::Verdict::Retry);
    assert_eq!(retry.tokens_remaining, 999.0);
    // By depth on /metrics: two denials and a retry at depth 2.
    let page = server.scrape();
    for line in [
        r#"retryd_chain_decisions_total{depth="2",verdict="deny"} 1"#,
        r#"retryd_chain_decisions_total{depth="3",verdict="deny"} 1"#,
        r#"retryd_chain_decisions_total{depth="2",verdict="retry"} 1"#,
    ] {
        assert!(page.contains(line), "{line} missing from\n{page}");
    }
}

#[tokio::test]
async fn an_unmarked_failure_is_retried_above_but_not_inside() {
    let server = Server::start(CONFIG);
    // The back layer retries the upstream 3 times and fails without a
    // mark, so the middle retries it. Inside those retries (lineage
    // edge:1/middle:2, then :3) the back layer does not retry again: one
    // request each. The middle's final failure is marked, so the edge
    // does not retry: 3 + 1 + 1.
    let (received, _) = one_request(&server, Chain::LineageUnmarkedBack, "db", u32::MAX).await;
    assert_eq!(received, 5);
    // With `inside_enclosing_retry = "allow"` for that upstream, the back
    // layer retries inside the middle's retries too: 3 × 3.
    let (allowed, _) = one_request(&server, Chain::LineageUnmarkedBack, "allow-db", u32::MAX).await;
    assert_eq!(allowed, 9);
}

#[tokio::test]
async fn the_decision_log_keeps_the_chain_and_replay_decides_the_same() {
    let logged = retryd_testkit::LoggedConfig::new(CONFIG);
    let (config, log) = (&logged.config, &logged.log);
    let server = Server::start_file(config);
    let mut retryd = server.decider().await;
    for (lineage, retried_below) in [("", ""), ("edge:1", "back"), ("edge:2/middle:1", "")] {
        retryd
            .decide(pb::DecideRequest {
                upstream: "db".into(),
                operation: "GET /v1/things".into(),
                idempotency: pb::Idempotency::Safe as i32,
                attempt: 1,
                http_status: 503,
                lineage: lineage.into(),
                retried_below: retried_below.into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let lines = logged.decisions(3).await;
    drop(server);
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert!(lines[0].get("lineage").is_none(), "absent at the edge");
    assert_eq!(lines[1]["lineage"], "edge:1");
    assert_eq!(lines[1]["retried_below"], "back");
    assert_eq!(lines[1]["deny_reason"], "retried_below");
    assert_eq!(lines[2]["deny_reason"], "inside_enclosing_retry");
    let replayed = retryd_testkit::replay_json(config, log);
    assert_eq!(replayed["upstreams"]["db"]["changed"], 0, "{replayed:#}");
    assert_eq!(replayed["upstreams"]["db"]["decisions"], 3, "{replayed:#}");
}
