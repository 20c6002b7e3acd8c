//! A flood of made-up upstream names (a caller putting ids or whole URLs in
//! `upstream`) fills the tracked-upstream limit, but never makes an
//! upstream the configuration names undecidable: configured upstreams are
//! outside the limit, on the memory store and on Redis (issue 23, first
//! part). Black-box: the real binary on loopback; Redis is the test's own.

use retryd_testkit as support;

use retryd_proto as pb;
use support::redis::RedisServer;
use support::{Server, retryable};
use tonic::Code;

const LIMIT: usize = 50;

// The Redis cases give the store 500 ms per call: with the default 20 ms a
// loaded machine timed admissions out, and the local fallback, a table of
// its own, admitted what Redis would have refused.

fn config(store: &str) -> String {
    format!(
        "[limits]\nmax_upstreams = {LIMIT}\n{store}\n[upstreams.\"payments-api\"]\nmax_attempts = 3\n"
    )
}

/// Floods `server` with 60 made-up names, then checks that the configured
/// upstream is decided as usual, by Decide and by ReportTraffic, while a
/// new unconfigured one is refused for the limit.
async fn flood_then_decide(server: &Server) {
    let mut decider = server.decider().await;
    let mut refused = 0;
    for i in 0..LIMIT + 10 {
        match decider.decide(retryable(&format!("made-up-{i:03}"))).await {
            Ok(_) => {}
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 10, "the limit holds for unconfigured names");
    for _ in 0..3 {
        let answer = decider
            .decide(retryable("payments-api"))
            .await
            .expect("a configured upstream is always decidable")
            .into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry);
    }
    decider
        .report_traffic(pb::ReportTrafficRequest {
            traffic: vec![pb::UpstreamTraffic {
                upstream: "payments-api".into(),
                requests: 100,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .expect("a configured upstream's traffic is always accepted");
    let status = decider
        .decide(retryable("another-new-one"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn memory_store_a_flood_never_locks_out_a_configured_upstream() {
    let server = Server::start(&config(""));
    flood_then_decide(&server).await;
}

#[tokio::test]
async fn redis_exact_a_flood_never_locks_out_a_configured_upstream() {
    let redis = RedisServer::start();
    let server = Server::start(&config(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"exact\"\n",
        redis.url()
    )));
    flood_then_decide(&server).await;
}

#[tokio::test]
async fn redis_leased_a_flood_never_locks_out_a_configured_upstream() {
    let redis = RedisServer::start();
    let server = Server::start(&config(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"leased\"\n",
        redis.url()
    )));
    flood_then_decide(&server).await;
}

const FLOOD_KEY: &str = "flooding-team-key-0123456789";
const OTHER_KEY: &str = "careful-team-key-0123456789";
const SHARE: usize = 20;

fn sha(key: &str) -> String {
    retryd::auth::hash_key(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn shared_config(store: &str) -> String {
    format!(
        r#"
[limits]
max_upstreams = {LIMIT}
max_upstreams_per_principal = {SHARE}
{store}
[[auth.principals]]
name = "flooder"
api_keys_sha256 = ["{}"]
upstreams = ["*"]

[[auth.principals]]
name = "careful"
api_keys_sha256 = ["{}"]
upstreams = ["*"]
"#,
        sha(FLOOD_KEY),
        sha(OTHER_KEY)
    )
}

fn as_caller<T>(message: T, key: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {key}").parse().expect("an ASCII header"),
    );
    request
}

/// One principal floods 60 names; it holds its share of 20 and is refused
/// the rest, naming the limit, by Decide and ReportTraffic alike; the other
/// principal's new upstreams are still tracked; the refusals are counted
/// by reason, and the warning names the principal.
async fn one_principal_floods(server: &Server) {
    let mut decider = server.decider().await;
    let mut refusals = Vec::new();
    for i in 0..60 {
        let name = format!("made-up-{i:03}");
        if let Err(status) = decider.decide(as_caller(retryable(&name), FLOOD_KEY)).await {
            refusals.push(status);
        }
    }
    assert_eq!(refusals.len(), 60 - SHARE);
    for status in &refusals {
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status
                .message()
                .contains("limits.max_upstreams_per_principal (20)")
                && status.message().contains("\"flooder\""),
            "{status:?}"
        );
    }
    let report = decider
        .report_traffic(as_caller(
            pb::ReportTrafficRequest {
                traffic: vec![pb::UpstreamTraffic {
                    upstream: "made-up-999".into(),
                    requests: 10,
                    ..Default::default()
                }],
                ..Default::default()
            },
            FLOOD_KEY,
        ))
        .await
        .unwrap_err();
    assert_eq!(report.code(), Code::ResourceExhausted, "{report:?}");
    // Its own upstreams keep working.
    decider
        .decide(as_caller(retryable("made-up-000"), FLOOD_KEY))
        .await
        .expect("a held upstream stays decidable");
    // The other principal's new upstreams are tracked, by both RPCs, up to
    // its whole share.
    for i in 0..SHARE - 1 {
        let answer = decider
            .decide(as_caller(retryable(&format!("careful-{i:02}")), OTHER_KEY))
            .await
            .expect("another principal's share is its own")
            .into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry);
    }
    decider
        .report_traffic(as_caller(
            pb::ReportTrafficRequest {
                traffic: vec![pb::UpstreamTraffic {
                    upstream: "careful-report".into(),
                    requests: 10,
                    ..Default::default()
                }],
                ..Default::default()
            },
            OTHER_KEY,
        ))
        .await
        .expect("another principal's report is admitted");
    let metrics = server.scrape();
    assert!(
        metrics
            .contains("retryd_upstream_refusals_total{reason=\"max_upstreams_per_principal\"} 41")
            && metrics.contains("retryd_upstream_refusals_total{reason=\"max_upstreams\"} 0"),
        "{metrics}"
    );
    // One warning for 41 refusals (one per 10 s at most), naming the principal.
    let logs = server.logs();
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("limits.max_upstreams_per_principal"))
        .collect();
    assert_eq!(warnings.len(), 1, "{logs}");
    assert!(warnings[0].contains("flooder"), "{logs}");
}

#[tokio::test]
async fn memory_store_one_principals_flood_leaves_the_others_share() {
    let server = Server::start(&shared_config(""));
    one_principal_floods(&server).await;
}

#[tokio::test]
async fn redis_exact_one_principals_flood_leaves_the_others_share() {
    let redis = RedisServer::start();
    let server = Server::start(&shared_config(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"exact\"\n",
        redis.url()
    )));
    one_principal_floods(&server).await;
}

/// "Do not retry" from the upstream (gRFC A6's negative pushback): a DENY
/// that stops the upstream's retries fleet-wide, which the store must keep.
fn stop(upstream: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "/things.Things/Get".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: 1,
        evidence: pb::Evidence::ResponseReceived as i32,
        grpc_status_code: 8,
        grpc_retry_pushback_ms: Some("-1".into()),
        ..Default::default()
    }
}

/// A DENY that announces a pushback spends nothing, yet makes the store keep
/// state for the name: it takes a place in the principal's share as a
/// withdrawal does. One principal announcing for 60 made-up names keeps 20
/// (each stops that upstream's retries fleet-wide); the rest are answered
/// (the caller's own DENY is unchanged) but not kept; and the other
/// principal's new upstreams are still tracked, up to its whole share.
async fn one_principal_floods_announcements(server: &Server) {
    let mut decider = server.decider().await;
    for i in 0..60 {
        let answer = decider
            .decide(as_caller(stop(&format!("made-up-{i:03}")), FLOOD_KEY))
            .await
            .expect("a decision that spends nothing is answered")
            .into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Deny, "{answer:?}");
    }
    // Within the flooder's share: kept, so every caller's retry is stopped.
    let held = decider
        .decide(as_caller(retryable("made-up-000"), OTHER_KEY))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        held.deny_reason(),
        pb::DenyReason::ServerPushback,
        "{held:?}"
    );
    // Past it: not kept, so nothing stops this one.
    let dropped = decider
        .decide(as_caller(retryable("made-up-059"), OTHER_KEY))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dropped.verdict(), pb::Verdict::Retry, "{dropped:?}");
    // The other principal: the rest of its share, all tracked.
    for i in 0..SHARE - 2 {
        let answer = decider
            .decide(as_caller(retryable(&format!("careful-{i:02}")), OTHER_KEY))
            .await
            .expect("another principal's share is its own")
            .into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry);
    }
}

#[tokio::test]
async fn memory_store_announcements_take_a_place_in_the_share() {
    let server = Server::start(&shared_config(""));
    one_principal_floods_announcements(&server).await;
}

#[tokio::test]
async fn redis_exact_announcements_take_a_place_in_the_share() {
    let redis = RedisServer::start();
    let server = Server::start(&shared_config(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"exact\"\n",
        redis.url()
    )));
    one_principal_floods_announcements(&server).await;
}
