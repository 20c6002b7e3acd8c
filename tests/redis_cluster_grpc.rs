//! A Redis Cluster master lost under gRPC load: the real retryd binary on
//! 3 masters with a replica each (`on_unavailable = "local"`), Decide
//! calls on a task per upstream for two upstreams on every master, one
//! master SIGKILLed. No call gets a gRPC error; the upstreams on the other
//! masters stay shared for the whole failure (every RETRY withdrew in
//! Redis: their buckets hold exactly `initial - RETRYs`); the affected
//! ones fall back (their local bucket is empty: DENY) and are shared again
//! after the promotion. The health entries read the store's reach
//! throughout: `retryd.v1.BudgetStore` (all of it) NOT_SERVING and
//! `retryd.v1.BudgetStore.Any` (any of it) SERVING during the failure,
//! both SERVING after; then, with a master and its replica both gone for
//! good, part of it (and `retryd health --service` says so), and with
//! every node gone, none of it.

use retryd_testkit as support;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use retryd_budget::redis::{Exact, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, ExactStore, OnUnavailable, RedisBudgetStore};
use retryd_proto as pb;
use support::redis::{RedisCluster, fresh_prefix};
use support::{HANG_GUARD, Server, ServingStatus, binary, retryable};

const INITIAL: f64 = 1.0e6;
const ALL: &str = "retryd.v1.BudgetStore";
const ANY: &str = "retryd.v1.BudgetStore.Any";

fn bucket_key(prefix: &str, upstream: &str) -> String {
    format!("{prefix}:{{u:{upstream}}}:bucket")
}

/// The bucket retryd's `[defaults]` give every upstream here.
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

/// What one load task saw.
#[derive(Default)]
struct Seen {
    retries: u64,
    denies: u64,
    /// gRPC errors (there must be none), the first few kept.
    errors: Vec<String>,
    n_errors: u64,
    last_deny: Option<Instant>,
    /// The last answer was a RETRY.
    last_was_retry: bool,
}

/// `retryd health --service SERVICE`: whether it exited 0, and what it
/// printed.
fn health_command(server: &Server, service: &str) -> (bool, String) {
    let output = Command::new(binary())
        .args([
            "health",
            "--addr",
            &server.grpc.to_string(),
            "--service",
            service,
        ])
        .output()
        .expect("run retryd health");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).trim().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_master_costs_no_grpc_call_and_the_health_entries_say_how_much_is_reachable() {
    let mut cluster = RedisCluster::start_with_replicas(3);
    let prefix = fresh_prefix("grpc-failover");
    // Two upstreams on each master.
    let mut by_master: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for n in 0.. {
        let upstream = format!("grpc-up-{n}");
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
    let masters: Vec<usize> = by_master.keys().copied().collect();
    let victim = masters[0];
    let affected = by_master[&victim].clone();
    let healthy: Vec<String> = masters[1..]
        .iter()
        .flat_map(|master| by_master[master].clone())
        .collect();

    let urls: Vec<String> = cluster
        .urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    // A 1 s store timeout: this test is about which upstreams fall back and
    // what the health entries say, not latency. At the default 20 ms it
    // passed on an idle machine, but in a CI run under a load average of
    // about 9 (three builds beside it) one live master's decision of 306
    // fell back. The latency promise at 20 ms is
    // tests/redis_cluster_isolation.rs's.
    let mut server = Server::start(&format!(
        r#"
        [store]
        kind = "redis"
        url = [{}]
        mode = "exact"
        timeout = "1s"
        on_unavailable = "local"
        key_prefix = "{prefix}"

        [defaults]
        budget = {{ capacity = {INITIAL:.1}, initial = {INITIAL:.1}, ratio = 0.5, min_per_second = 0.0 }}
        "#,
        urls.join(", ")
    ));

    // A task per upstream, deciding until `stop`.
    let stop = Arc::new(AtomicBool::new(false));
    let mut seen: BTreeMap<String, Arc<Mutex<Seen>>> = BTreeMap::new();
    let mut tasks = Vec::new();
    for upstream in affected.iter().chain(&healthy) {
        let state = Arc::new(Mutex::new(Seen::default()));
        seen.insert(upstream.clone(), Arc::clone(&state));
        let mut decider = server.decider().await;
        let stop = Arc::clone(&stop);
        let upstream = upstream.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let answer = decider.decide(retryable(&upstream)).await;
                {
                    let mut state = state.lock().unwrap();
                    match answer.map(tonic::Response::into_inner) {
                        Ok(answer) if answer.verdict() == pb::Verdict::Retry => {
                            state.retries += 1;
                            state.last_was_retry = true;
                        }
                        Ok(answer) => {
                            assert_eq!(answer.verdict(), pb::Verdict::Deny, "{answer:?}");
                            state.denies += 1;
                            state.last_deny = Some(Instant::now());
                            state.last_was_retry = false;
                        }
                        Err(status) => {
                            state.n_errors += 1;
                            if state.errors.len() < 5 {
                                state.errors.push(status.to_string());
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(4)).await;
            }
        }));
    }
    // Every upstream has been answered RETRY before the failure.
    support::eventually("every upstream decided before the failure", || {
        seen.values()
            .all(|state| state.lock().unwrap().retries > 0)
            .then_some(())
    })
    .await;
    assert_eq!(server.health(ALL).await.unwrap(), ServingStatus::Serving);
    assert_eq!(server.health(ANY).await.unwrap(), ServingStatus::Serving);
    for (upstream, state) in &seen {
        let state = state.lock().unwrap();
        assert!(
            state.retries > 0 && state.denies == 0,
            "{upstream} before the failure: {} RETRY, {} DENY",
            state.retries,
            state.denies
        );
    }

    cluster.nodes[victim].kill();
    let killed = Instant::now();
    // The promotion (`cluster-node-timeout 1000`) took 2–3 s here; the
    // waits below are liveness checks bounded by the testkit's hang guard,
    // not latency claims, and the times are printed.
    // During the failure: part of the store. Health is polled every
    // 250 ms, so the partial state is seen well inside the 2–3 s before
    // the promotion.
    let partial_seen = loop {
        let all = server.health(ALL).await.unwrap();
        let any = server.health(ANY).await.unwrap();
        if all == ServingStatus::NotServing {
            assert_eq!(any, ServingStatus::Serving, "part of the store is up");
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < HANG_GUARD,
            "{ALL} never turned NOT_SERVING"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // After the promotion: every affected upstream answers RETRY again,
    // both entries are SERVING, and no affected upstream is denied for a
    // while (500 ms).
    let returned = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            killed.elapsed() < HANG_GUARD,
            "the affected upstreams were not shared again within {HANG_GUARD:?}"
        );
        let last_deny = affected
            .iter()
            .map(|upstream| seen[upstream].lock().unwrap().last_deny)
            .max()
            .flatten();
        let all_retry = affected
            .iter()
            .all(|upstream| seen[upstream].lock().unwrap().last_was_retry);
        let (Some(last_deny), true) = (last_deny, all_retry) else {
            continue;
        };
        if last_deny.elapsed() < Duration::from_millis(500) {
            continue;
        }
        if server.health(ALL).await.unwrap() == ServingStatus::Serving {
            assert_eq!(server.health(ANY).await.unwrap(), ServingStatus::Serving);
            break last_deny.duration_since(killed);
        }
    };
    let healthy_after = killed.elapsed();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a load task panicked");
    }

    let store: ExactStore = RedisBudgetStore::<Exact>::connect(
        &RedisConfig {
            urls: cluster
                .nodes
                .iter_mut()
                .filter_map(|node| node.is_running().then(|| node.url().into()))
                .collect(),
            mode: RedisMode::Exact,
            timeout: Duration::from_millis(20), // the server's default
            lease_tokens: 2.0,
            max_lease_tokens: 8.0,
            lease_ttl: Duration::from_secs(2),
            key_prefix: prefix.clone(),
            access: RedisAccess::default(),
        },
        1000,
    )
    .await
    .expect("connect to the cluster after the failover");
    let mut total_calls = 0;
    for (upstream, state) in &seen {
        let state = state.lock().unwrap();
        total_calls += state.retries + state.denies + state.n_errors;
        assert_eq!(
            state.n_errors, 0,
            "{upstream}: {} gRPC errors, e.g. {:?}",
            state.n_errors, state.errors
        );
        println!(
            "{upstream} ({}): {} RETRY, {} DENY",
            if affected.contains(upstream) {
                "lost master"
            } else {
                "live master"
            },
            state.retries,
            state.denies
        );
    }
    for upstream in &healthy {
        let (retries, denies) = {
            let state = seen[upstream].lock().unwrap();
            (state.retries, state.denies)
        };
        assert_eq!(denies, 0, "{upstream}, on a live master, was denied");
        let tokens = store.view(upstream, &bucket()).await.unwrap().tokens;
        assert_eq!(
            tokens,
            INITIAL - retries as f64,
            "{upstream}: {retries} RETRYs over gRPC, but its bucket in Redis holds {tokens}"
        );
    }
    for upstream in &affected {
        assert!(
            seen[upstream].lock().unwrap().denies > 0,
            "{upstream} never fell back"
        );
        // Shared again: a RETRY over gRPC withdraws in Redis.
        let before = store.view(upstream, &bucket()).await.unwrap().tokens;
        let mut decider = server.decider().await;
        let answer = decider
            .decide(retryable(upstream))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.verdict(), pb::Verdict::Retry, "{answer:?}");
        let after = store.view(upstream, &bucket()).await.unwrap().tokens;
        assert_eq!(after, before - 1.0, "{upstream} is not shared again");
    }
    store.shutdown().await;
    println!(
        "master SIGKILLed under gRPC load: {total_calls} calls, none failed; \
         {ALL} NOT_SERVING with {ANY} SERVING seen {partial_seen:?} after the kill; \
         the affected upstreams' last fallback {returned:?} after it; both entries SERVING again {healthy_after:?} after it"
    );

    // A second master and its replica gone for good: part of the store,
    // for as long as it lasts, and `retryd health --service` says so.
    let master = masters[1];
    let master_port = cluster.nodes[master].port();
    let replica = (0..cluster.nodes.len())
        .find(|&index| {
            cluster.nodes[index].is_running()
                && cluster.nodes[index]
                    .cli(&["INFO", "replication"])
                    .contains(&format!("master_port:{master_port}"))
        })
        .expect("the second master's replica");
    cluster.nodes[replica].kill();
    cluster.nodes[master].kill();
    let mut decider = server.decider().await;
    // Decisions on every upstream, so that each master's circuit learns
    // its fate; each must be answered.
    let mut decide_all = async || {
        for upstream in affected.iter().chain(&healthy) {
            let answer = decider.decide(retryable(upstream)).await;
            assert!(answer.is_ok(), "{upstream}: {answer:?}");
        }
    };
    let gone = Instant::now();
    loop {
        decide_all().await;
        if server.health(ALL).await.unwrap() == ServingStatus::NotServing {
            assert_eq!(server.health(ANY).await.unwrap(), ServingStatus::Serving);
            break;
        }
        assert!(
            gone.elapsed() < HANG_GUARD,
            "{ALL} never turned NOT_SERVING"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (all_ok, all_said) = health_command(&server, ALL);
    let (any_ok, any_said) = health_command(&server, ANY);
    assert!(
        !all_ok,
        "retryd health --service {ALL} exited 0 ({all_said})"
    );
    assert_eq!(all_said, "NotServing");
    assert!(any_ok, "retryd health --service {ANY} failed ({any_said})");
    assert_eq!(any_said, "Serving");
    // The decider itself stays SERVING: it answers from the fallback.
    assert!(health_command(&server, "retryd.v1.RetryDecider").0);

    // Every node gone: none of the store.
    for node in &mut cluster.nodes {
        node.kill();
    }
    let gone = Instant::now();
    loop {
        decide_all().await;
        if server.health(ANY).await.unwrap() == ServingStatus::NotServing {
            assert_eq!(server.health(ALL).await.unwrap(), ServingStatus::NotServing);
            break;
        }
        assert!(
            gone.elapsed() < HANG_GUARD,
            "{ANY} never turned NOT_SERVING"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (any_ok, any_said) = health_command(&server, ANY);
    assert!(!any_ok && any_said == "NotServing", "{any_said}");
    assert!(health_command(&server, "retryd.v1.RetryDecider").0);
    server.terminate(Duration::from_secs(5));
}
