//! Several real retryd processes sharing one Redis (and one Redis Cluster):
//! the fleet behaves as one budget, the kill switch crosses replicas, and a
//! Redis outage under load is answered from the fallback and recovered
//! from. What only processes show is checked here; how fast, to the
//! millisecond, is checked in process on a paused clock.

use retryd_testkit as support;

use std::time::{Duration, Instant};

use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use support::redis::{RedisCluster, RedisServer};
use support::{HANG_GUARD, Server, ServingStatus, retryable};
use tonic::transport::Channel;

/// At the default store timeout (20 ms). A loaded machine used to turn a
/// withdrawal, or a lease handed back, into a timed-out one, which counts
/// as spent (seen at 50 ms with the load average at 8 on 2 cores: 295 of
/// 300 granted, and stranded tokens forfeited); a store call now waits
/// once more when the process, not Redis, was slow (issue 37). Answers
/// within the timeout are tests/redis_outage.rs's, on a paused clock.
fn replica_config(urls: &[String], mode: &str, extra: &str) -> String {
    let urls: Vec<String> = urls.iter().map(|url| format!("\"{url}\"")).collect();
    format!(
        r#"
        [store]
        kind = "redis"
        url = [{}]
        mode = "{mode}"
        lease_tokens = 5.0
        lease_ttl = "500ms"
        key_prefix = "replicas"

        [upstreams.shared]
        budget = {{ capacity = 300.0, initial = 300.0, ratio = 0.0, min_per_second = 0.0 }}
        {extra}
        "#,
        urls.join(", ")
    )
}

/// `per_replica` concurrent callers on each replica, each asking `calls`
/// times; returns the RETRY count.
async fn hammer(replicas: &[Server], per_replica: usize, calls: usize) -> usize {
    let mut tasks = Vec::new();
    for replica in replicas {
        for _ in 0..per_replica {
            let mut client = replica.decider().await;
            tasks.push(tokio::spawn(async move {
                let mut retries = 0;
                for _ in 0..calls {
                    let response = client
                        .decide(retryable("shared"))
                        .await
                        .unwrap()
                        .into_inner();
                    match response.verdict() {
                        pb::Verdict::Retry => retries += 1,
                        pb::Verdict::Deny => {
                            assert_eq!(response.deny_reason(), pb::DenyReason::BudgetExhausted)
                        }
                        other => panic!("{other:?}"),
                    }
                }
                retries
            }));
        }
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total
}

#[tokio::test]
async fn exact_mode_grants_exactly_the_budget_across_three_replicas() {
    let redis = RedisServer::start();
    let config = replica_config(&[redis.url()], "exact", "");
    let replicas: Vec<Server> = (0..3).map(|_| Server::start(&config)).collect();
    // 3 replicas × 4 callers × 50 calls = 600 attempts for 300 tokens.
    let retries = hammer(&replicas, 4, 50).await;
    assert_exactly_the_budget(&replicas, retries, 300);
}

#[tokio::test]
async fn exact_mode_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let config = replica_config(&cluster.urls(), "exact", "");
    let replicas: Vec<Server> = (0..2).map(|_| Server::start(&config)).collect();
    let retries = hammer(&replicas, 4, 60).await;
    assert_exactly_the_budget(&replicas, retries, 300);
}

/// A fleet short of budget is granted the whole budget and never more,
/// except for one token per withdrawal whose answer this replica never
/// heard: Redis applied it (the script was sent), the replica answered
/// from its fallback, whose local bucket starts empty, and counted that
/// in `retryd_store_fallbacks_total`. With no fallback the count is exact.
/// A CI run on a starved machine saw 297 of 300 with three such answers;
/// a token is never lost without one.
fn assert_exactly_the_budget(replicas: &[Server], retries: usize, budget: usize) {
    assert!(
        retries <= budget,
        "{retries} granted of {budget}: over-allowed"
    );
    let fallbacks: f64 = replicas
        .iter()
        .map(|replica| store_counter(&replica.scrape(), "retryd_store_fallbacks_total"))
        .sum();
    let lost = (budget - retries) as f64;
    assert!(
        lost <= fallbacks,
        "{retries} granted of {budget}, and only {fallbacks} answers from the fallback"
    );
    if fallbacks > 0.0 {
        eprintln!("{retries} granted of {budget}; {fallbacks} answers from the fallback");
    }
}

fn store_counter(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{series} is not on the metrics page"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn leased_mode_never_over_allows_and_frees_stranded_tokens() {
    let redis = RedisServer::start();
    let config = replica_config(&[redis.url()], "leased", "");
    let replicas: Vec<Server> = (0..3).map(|_| Server::start(&config)).collect();
    let retries = hammer(&replicas, 4, 50).await;
    assert!(retries <= 300, "leased mode granted {retries} > 300");
    assert!(
        retries >= 250,
        "leased mode should use most of the budget, got {retries}"
    );

    // Tokens stranded in the leases of two idle replicas become usable
    // through the third once the leases expire (lease_ttl = 500 ms, on
    // Redis's clock): polled for, by asking the third until the whole
    // budget has been granted, never more.
    let started = Instant::now();
    let mut more = 0;
    while retries + more < 300 {
        assert!(
            started.elapsed() < HANG_GUARD,
            "the stranded tokens were not usable within {HANG_GUARD:?}: {retries} + {more}"
        );
        more += hammer(&replicas[2..], 1, 10).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "stranded tokens usable through the third replica after {:?}",
        started.elapsed()
    );
    // And nothing beyond the budget, however long one asks.
    more += hammer(&replicas[2..], 1, 20).await;
    assert_eq!(
        retries + more,
        300,
        "after the leases expired: {retries} + {more}"
    );
}

#[tokio::test]
async fn the_kill_switch_crosses_replicas() {
    let redis = RedisServer::start();
    for mode in ["exact", "leased"] {
        let config = replica_config(&[redis.url()], mode, "");
        let (a, b) = (Server::start(&config), Server::start(&config));
        // One upstream per mode, on the one key prefix: switching the
        // previous mode's back on started its recovery ramp (README,
        // "Recovery"), which would deny this mode's first retry.
        let search = format!("search-{mode}");
        let mut on_b = b.decider().await;
        assert_eq!(
            on_b.decide(retryable(&search))
                .await
                .unwrap()
                .into_inner()
                .verdict(),
            pb::Verdict::Retry
        );
        let switched_at = Instant::now();
        a.admin()
            .await
            .set_retries_enabled(pb::SetRetriesEnabledRequest {
                upstream: search.clone(),
                enabled: false,
                reason: "cross-replica test".into(),
            })
            .await
            .unwrap();
        // Exact mode obeys on the next decision. Leased mode obeys once its
        // reading of the shared bucket is 100 ms old, which
        // tests/redis_replicas.rs shows on a paused clock; here, through
        // two processes on a machine that may be busy, only that it
        // crosses is checked (30 s guards against a hang, not a latency).
        loop {
            let response = on_b.decide(retryable(&search)).await.unwrap().into_inner();
            if response.deny_reason() == pb::DenyReason::RetriesDisabled {
                break;
            }
            assert!(mode == "leased", "exact mode must obey at once");
            assert!(
                switched_at.elapsed() < HANG_GUARD,
                "{mode}: not obeyed within {HANG_GUARD:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        eprintln!(
            "{mode}: obeyed by the other replica after {:?}",
            switched_at.elapsed()
        );
        a.admin()
            .await
            .set_retries_enabled(pb::SetRetriesEnabledRequest {
                upstream: search.clone(),
                enabled: true,
                reason: String::new(),
            })
            .await
            .unwrap();
    }
}

async fn timed_decide(
    client: &mut RetryDeciderClient<Channel>,
    upstream: &str,
) -> (pb::DecideResponse, Duration) {
    let started = Instant::now();
    let response = client
        .decide(retryable(upstream))
        .await
        .unwrap()
        .into_inner();
    (response, started.elapsed())
}

#[tokio::test]
async fn redis_killed_under_load_then_restarted() {
    let mut redis = RedisServer::start();
    let config = replica_config(
        &[redis.url()],
        "exact",
        r#"
        [upstreams.strict]
        on_unavailable = "deny"
        "#,
    );
    let replicas: Vec<Server> = (0..2).map(|_| Server::start(&config)).collect();
    let mut clients = Vec::new();
    for replica in &replicas {
        clients.push(replica.decider().await);
    }
    for client in &mut clients {
        let (response, _) = timed_decide(client, "strict").await;
        assert_eq!(response.verdict(), pb::Verdict::Retry);
    }

    redis.kill();
    // Every call is answered, from its upstream's fallback. That each is
    // answered within the store timeout is shown to the millisecond on a
    // paused clock in tests/redis_outage.rs; two processes on a busy
    // machine can only show wall times, so they are printed, not bounded.
    let mut slowest = Duration::ZERO;
    for round in 0..40 {
        for client in &mut clients {
            let (strict, took) = timed_decide(client, "strict").await;
            slowest = slowest.max(took);
            assert_eq!(
                strict.deny_reason(),
                pb::DenyReason::BudgetUnavailable,
                "round {round}"
            );
            let (local, took) = timed_decide(client, "fallback").await;
            slowest = slowest.max(took);
            // The local fallback bucket starts empty: no deposits, no retries.
            assert_eq!(local.verdict(), pb::Verdict::Deny, "round {round}");
        }
    }
    eprintln!("slowest answer while Redis was down: {slowest:?}");
    for replica in &replicas {
        assert!(replica.scrape().contains("retryd_store_available 0"));
    }
    // The health entries follow on their next poll (every 250 ms): one
    // node down is none of the store, so neither reads SERVING.
    for replica in &replicas {
        replica
            .health_becomes(STORE, ServingStatus::NotServing)
            .await;
        replica
            .health_becomes(STORE_ANY, ServingStatus::NotServing)
            .await;
    }

    redis.restart();
    let restarted = Instant::now();
    let mut client = clients.remove(0);
    loop {
        let (response, _) = timed_decide(&mut client, "strict").await;
        if response.verdict() == pb::Verdict::Retry {
            break;
        }
        // The circuit re-probes every 150 ms (tests/redis_outage.rs bounds
        // the return on a paused clock); here the time is printed.
        assert!(
            restarted.elapsed() < HANG_GUARD,
            "shared decisions did not resume within {HANG_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "shared decisions resumed {:?} after the restart",
        restarted.elapsed()
    );
    replicas[0]
        .health_becomes(STORE, ServingStatus::Serving)
        .await;
    replicas[0]
        .health_becomes(STORE_ANY, ServingStatus::Serving)
        .await;
}

/// The store's health entries: all of it reachable, and any of it.
const STORE: &str = "retryd.v1.BudgetStore";
const STORE_ANY: &str = "retryd.v1.BudgetStore.Any";
