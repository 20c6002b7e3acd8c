//! Hedging on the Redis store, exact and leased, on a redis-server the test
//! starts: two replicas in this process share one key prefix, and each
//! answers from the fleet's window. Latencies reported to one replica make
//! the delay appear in the other's GetBudget after a background refresh;
//! hedges granted by either count against one cap.

mod hedging_common;
mod in_process_server;

use std::time::{Duration, Instant};

use hedging_common::{InProcess, budget, entry, hedge, millis, report, turns_slow};
use in_process_server::redis_store;
use retryd_budget::redis::{Exact, Leased, Mode};
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use retryd_testkit::HANG_GUARD;
use retryd_testkit::redis::{RedisCluster, RedisServer, fresh_prefix};
use tonic::transport::Channel;

const CONFIG: &str = r#"
[defaults]
budget = { capacity = 1000.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }

[upstreams.fast.hedging]

[upstreams.turning.hedging]
window = "6s"
"#;

/// Polls `probe` every 20 ms until it answers, within the hang guard (the
/// refresh runs every second: a bound of the product, waited for with a
/// margin a busy machine keeps).
/// The default store.timeout.
const STORE_TIMEOUT: Duration = Duration::from_millis(20);

async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut probe: impl FnMut() -> F,
) -> T {
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "{what}: not within {HANG_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until a replica's hedge explanation (of a hedge it denies at
/// once, spending nothing) shows `numbers`.
async fn sees(client: &RetryDeciderClient<Channel>, numbers: &str) {
    until(numbers, || {
        let mut client = client.clone();
        async move {
            let probe = pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                ..hedge("fast", 1)
            };
            let answer = client.decide(probe).await.unwrap().into_inner();
            answer.explanation.contains(numbers).then_some(())
        }
    })
    .await;
}

async fn two_replicas_share_one_window<M: Mode>(urls: &[String]) {
    let prefix = fresh_prefix("hedging");
    let a = InProcess::start(CONFIG, redis_store::<M>(urls, &prefix, STORE_TIMEOUT).await).await;
    let b = InProcess::start(CONFIG, redis_store::<M>(urls, &prefix, STORE_TIMEOUT).await).await;
    let mut to_a = a.decider().await;
    let mut to_b = b.decider().await;

    // 200 first attempts to A: its answer already carries the fleet's
    // delay (the report is read back).
    let answer = report(&mut to_a, vec![entry("fast", 200, &[(10, 180), (100, 20)])])
        .await
        .unwrap();
    assert!(answer.hedging[0].enabled, "{:?}", answer.hedging);
    let delay = millis(&answer.hedging[0].delay);
    assert!((87.5..=112.5).contains(&delay), "{delay} ms");
    // B learns it from its refresh, never having had a report.
    let served = until("B serves the fleet's delay", || async {
        budget(&b, "fast")
            .await
            .hedging
            .filter(|hedging| hedging.enabled)
    })
    .await;
    assert_eq!(served.delay, answer.hedging[0].delay);

    // Another 200 first attempts reported to B, with a heavier tail: both replicas'
    // views merge 400 samples.
    report(&mut to_b, vec![entry("fast", 200, &[(10, 160), (100, 40)])])
        .await
        .unwrap();

    // The cap is 5% of 400 first attempts: 20 hedges, fleet-wide. A grants
    // 12; once B has read them back, B grants 8 and is capped.
    // Each replica's view lags the fleet by at most its refresh.
    sees(&to_a, "0 hedges of 400 first attempts").await;
    sees(&to_b, "0 hedges of 400 first attempts").await;
    for _ in 0..12 {
        let answer = to_a.decide(hedge("fast", 1)).await.unwrap().into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry, "{answer:?}");
    }
    sees(&to_b, "12 hedges of 400 first attempts").await;
    let mut granted = 0;
    loop {
        let answer = to_b.decide(hedge("fast", 1)).await.unwrap().into_inner();
        if answer.verdict() != pb::Verdict::Retry {
            assert_eq!(answer.deny_reason(), pb::DenyReason::HedgeCap, "{answer:?}");
            break;
        }
        granted += 1;
        assert!(granted <= 20, "B granted past the fleet's cap");
    }
    assert_eq!(granted, 8);
}

#[tokio::test]
async fn exact_replicas_share_one_window() {
    let redis = RedisServer::start();
    two_replicas_share_one_window::<Exact>(&[redis.url().as_str().into()]).await;
}

#[tokio::test]
async fn leased_replicas_share_one_window() {
    let redis = RedisServer::start();
    two_replicas_share_one_window::<Leased>(&[redis.url().as_str().into()]).await;
}

/// A window's 30 keys share the upstream's hash tag: one script on the
/// node serving its slot.
#[tokio::test]
async fn cluster_replicas_share_one_window() {
    let cluster = RedisCluster::start(3);
    two_replicas_share_one_window::<Exact>(&cluster.urls()).await;
}

/// The recent part of the window (its last sixth: 1 s of 6 s) is the
/// fleet's too: A reports fast calls with a tail, B slow ones 1.3 s later,
/// and B's answer, read back from Redis, has the whole window's p50 fast
/// (A's calls) and its recent part slow (B's), so the upstream is not
/// hedged (`hedging_common::turns_slow`).
#[tokio::test]
async fn the_recent_part_of_the_window_is_the_fleets() {
    let redis = RedisServer::start();
    let urls = [redis.url()];
    let prefix = fresh_prefix("hedging-recent");
    let a = InProcess::start(
        CONFIG,
        redis_store::<Exact>(&urls, &prefix, STORE_TIMEOUT).await,
    )
    .await;
    let b = InProcess::start(
        CONFIG,
        redis_store::<Exact>(&urls, &prefix, STORE_TIMEOUT).await,
    )
    .await;
    turns_slow("turning", &mut a.decider().await, &mut b.decider().await).await;
}
