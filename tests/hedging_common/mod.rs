//! The harness the hedging suites share: retryd in this process on a
//! given store, and the requests they send.
#![allow(dead_code)]

use retryd_engine::latency;
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tonic::transport::Channel;

pub(crate) use crate::in_process_server::InProcess;

/// A histogram of `count` latencies of `millis` each, per pair.
pub(crate) fn histogram(latencies: &[(u64, u64)]) -> pb::LatencyHistogram {
    let mut counts = std::collections::HashMap::new();
    for &(millis, count) in latencies {
        *counts.entry(latency::bucket(millis * 1000)).or_insert(0u64) += count;
    }
    pb::LatencyHistogram { counts }
}

pub(crate) fn entry(
    upstream: &str,
    requests: u64,
    latencies: &[(u64, u64)],
) -> pb::UpstreamTraffic {
    pb::UpstreamTraffic {
        upstream: upstream.into(),
        requests,
        latency_successes: Some(histogram(latencies)),
        ..Default::default()
    }
}

pub(crate) async fn report(
    client: &mut RetryDeciderClient<Channel>,
    traffic: Vec<pb::UpstreamTraffic>,
) -> Result<pb::ReportTrafficResponse, tonic::Status> {
    client
        .report_traffic(pb::ReportTrafficRequest {
            traffic,
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

pub(crate) fn hedge(upstream: &str, k: u32) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: k,
        hedge: k,
        ..Default::default()
    }
}

pub(crate) async fn budget(server: &InProcess, upstream: &str) -> pb::Budget {
    server
        .admin()
        .await
        .get_budget(pb::GetBudgetRequest {
            upstream: upstream.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap()
}

pub(crate) fn millis(duration: &Option<prost_types::Duration>) -> f64 {
    let duration = duration.as_ref().expect("a delay");
    duration.seconds as f64 * 1e3 + f64::from(duration.nanos) / 1e6
}

/// An upstream with `window = "6s"` turns slow as a whole: fast calls with
/// a 2% tail reported through `first`, slow ones through `second` 1.3 s
/// later (out of the window's recent sixth, 1 s, and still in the window).
/// `second`'s answer and its hedge decision say uniformly slow, with the
/// whole window's p50 still fast and its recent part slow. Wall time on
/// purpose (the store's clock is the process's): the hedge is asked within
/// a second of the slow report.
pub(crate) async fn turns_slow(
    upstream: &str,
    first: &mut RetryDeciderClient<Channel>,
    second: &mut RetryDeciderClient<Channel>,
) {
    let fast = report(
        first,
        vec![entry(upstream, 1_000, &[(10, 980), (1_000, 20)])],
    )
    .await
    .unwrap();
    assert!(fast.hedging[0].enabled, "{:?}", fast.hedging);
    tokio::time::sleep(std::time::Duration::from_millis(1_300)).await;
    let slow = report(second, vec![entry(upstream, 200, &[(200, 180), (210, 20)])])
        .await
        .unwrap();
    assert!(!slow.hedging[0].enabled, "{:?}", slow.hedging);
    let denied = second
        .decide(hedge(upstream, 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        denied.deny_reason(),
        pb::DenyReason::UniformlySlow,
        "{denied:?}"
    );
    for part in [
        "p50 9ms, p99 1007ms over 1200 samples",
        "over its most recent sixth: p50 20",
        "over 200 samples)",
    ] {
        assert!(
            denied.explanation.contains(part),
            "{part:?} in {}",
            denied.explanation
        );
    }
}
