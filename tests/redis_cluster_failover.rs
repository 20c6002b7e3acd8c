//! A Redis Cluster master lost under load stays local: 3 masters with a
//! replica each, one master SIGKILLed while decisions run for upstreams on
//! every master. The upstreams on the other masters stay shared for the
//! whole failure (every one of their decisions withdrew in Redis: their
//! buckets hold exactly `initial - decisions`); the affected ones answer
//! from their fallback and are shared again after the promotion; every
//! call is answered (`on_unavailable = local`: no error a gRPC caller
//! could see), and the store says how much of it is reachable.

use retryd_testkit::redis as redis_harness;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use redis_harness::RedisCluster;
use retryd_budget::redis::{Exact, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, ExactStore, OnUnavailable, RedisBudgetStore};

/// The server's default `store.timeout`. (At 100 ms, before issue 37, a
/// live master's upstream fell back 45 and 232 times under `stress-ng
/// --cpu 2`: one late answer opened its circuit.)
const TIMEOUT: Duration = Duration::from_millis(20);
const INITIAL: f64 = 1.0e6;
/// The promotion took about 2–3 s here (`cluster-node-timeout 1000`); 20 s
/// so that a loaded machine cannot break the test.
const RETURN_WITHIN: Duration = Duration::from_secs(20);

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: INITIAL,
        initial: INITIAL,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

fn bucket_key(prefix: &str, upstream: &str) -> String {
    format!("{prefix}:{{u:{upstream}}}:bucket")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_master_affects_only_the_upstreams_it_served() {
    // The store's node transitions, in the test's output: each once.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RETRYD_TEST_LOG").unwrap_or_else(|_| "retryd_budget=info".into()),
        )
        .try_init();
    let mut cluster = RedisCluster::start_with_replicas(3);
    let prefix = redis_harness::fresh_prefix("failover");
    // Two upstreams on each master.
    let mut by_master: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for n in 0.. {
        let upstream = format!("up-{n}");
        let master = cluster
            .master_of(&bucket_key(&prefix, &upstream))
            .expect("a master serves every slot");
        let names = by_master.entry(master).or_default();
        if names.len() < 2 {
            names.push(upstream);
        }
        if by_master.len() == 3 && by_master.values().all(|names| names.len() == 2) {
            break;
        }
    }
    let victim = *by_master.keys().next().unwrap();
    let affected = by_master[&victim].clone();
    let healthy: Vec<String> = by_master
        .iter()
        .filter(|(master, _)| **master != victim)
        .flat_map(|(_, names)| names.clone())
        .collect();

    let config = RedisConfig {
        urls: cluster.urls().into_iter().map(Into::into).collect(),
        mode: RedisMode::Exact,
        timeout: TIMEOUT,
        lease_tokens: 2.0,
        max_lease_tokens: 8.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: prefix.clone(),
        access: RedisAccess::default(),
    };
    let store: ExactStore = RedisBudgetStore::<Exact>::connect(&config, 1000)
        .await
        .expect("connect to the cluster");

    // One task per healthy upstream, counting its decisions; every answer
    // must be Ok and a withdrawal (the bucket never runs dry).
    let stop = Arc::new(AtomicBool::new(false));
    let load = |upstream: String| {
        let store = store.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let config = bucket();
            // Granted decisions (every one withdrew in Redis, or from the
            // fallback, which has no initial tokens and so denies), and
            // denied ones, with the time since the test began of the last.
            let (mut granted, mut denied) = (0u64, 0u64);
            let mut last_denied = None;
            while !stop.load(Ordering::Relaxed) {
                let check = store.check(&upstream, &config, true).await;
                let check = check.unwrap_or_else(|error| panic!("{upstream}: {error}"));
                if check.withdrew {
                    granted += 1;
                } else {
                    denied += 1;
                    last_denied = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (upstream, granted, denied, last_denied)
        })
    };
    let healthy_tasks: Vec<_> = healthy.iter().cloned().map(load).collect();
    let affected_tasks: Vec<_> = affected.iter().cloned().map(load).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.stats().fallbacks, 0, "fell back before the failure");
    assert_eq!(store.availability(), 1.0);

    cluster.nodes[victim].kill();
    let killed = Instant::now();
    // The victim's share of the slots becomes unreachable...
    let mut lowest = 1.0f64;
    while killed.elapsed() < RETURN_WITHIN {
        lowest = lowest.min(store.availability());
        if lowest < 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        (0.5..0.9).contains(&lowest),
        "availability during the failure: {lowest}"
    );
    // ... and comes back once its replica is promoted: every affected
    // upstream decides through Redis again (no new fallback for a while).
    let returned = loop {
        let before = store.stats().fallbacks;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if store.stats().fallbacks == before && store.availability() == 1.0 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < RETURN_WITHIN,
            "the affected upstreams never returned to shared (availability {})",
            store.availability()
        );
    };
    stop.store(true, Ordering::Relaxed);
    let fallbacks = store.stats().fallbacks;
    println!("stats after the failure: {:?}", store.stats());
    assert!(fallbacks > 0, "no affected decision fell back");
    let mut healthy_decisions = 0;
    for task in healthy_tasks {
        let (upstream, decisions, denied, _) = task.await.expect("a load task panicked");
        assert_eq!(
            denied, 0,
            "{upstream}, on a live master, fell back {denied} times"
        );
        // Every decision of a healthy upstream withdrew in Redis.
        let snapshot = store.view(&upstream, &bucket()).await.unwrap();
        assert_eq!(
            snapshot.tokens,
            INITIAL - decisions as f64,
            "{upstream}: {decisions} decisions, but Redis holds {}",
            snapshot.tokens
        );
        healthy_decisions += decisions;
    }
    for task in affected_tasks {
        let (upstream, granted, denied, last_denied) = task.await.expect("a load task panicked");
        println!(
            "{upstream} (lost master): {granted} granted, {denied} denied by the fallback, the last {:?} after the kill",
            last_denied.map(|at| at.duration_since(killed))
        );
    }
    // Shared again: a decision on an affected upstream lands in Redis.
    for upstream in &affected {
        let before = store.view(upstream, &bucket()).await.unwrap().tokens;
        assert!(
            store
                .check(upstream, &bucket(), true)
                .await
                .unwrap()
                .withdrew
        );
        let after = store.view(upstream, &bucket()).await.unwrap().tokens;
        assert_eq!(after, before - 1.0, "{upstream} is not shared again");
    }
    println!(
        "master SIGKILLed: availability fell to {lowest:.3}; affected upstreams shared again after {returned:?}; \
         {healthy_decisions} decisions of healthy upstreams all in Redis; {fallbacks} affected decisions from the fallback"
    );
    store.shutdown().await;
}
