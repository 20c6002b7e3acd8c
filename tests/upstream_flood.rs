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
