//! Resharding under load (issue 37): an upstream's slot moves from one
//! master to another by hand (`CLUSTER SETSLOT ... IMPORTING/MIGRATING`,
//! `MIGRATE`, `SETSLOT ... NODE`), with pauses so that decisions land in
//! every stage, while four tasks decide on it. Every call is answered (no
//! error: during the move a script is redirected by ASK or answered
//! TRYAGAIN, and then answered from the fallback, which spends nothing);
//! the exact budget grants exactly its tokens across the move (less only a withdrawal that timed out, of unknown outcome), and the
//! store followed MOVED and ASK (the target ran `ASKING`). A second
//! upstream on the source master, never moved, is never answered from the
//! fallback.

use retryd_testkit::HANG_GUARD;
use retryd_testkit::redis::{RedisCluster, fresh_prefix};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use retryd_budget::redis::{Exact, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, ExactStore, OnUnavailable, RedisBudgetStore};

const TOKENS: f64 = 600.0;
/// The server's default `store.timeout`. The move's redirects and
/// TRYAGAINs are answered within it; a request that times out now and then
/// (one in a CI run) is a withdrawal of unknown outcome, which may have
/// spent a token without a RETRY: "exact" is then checked as never more
/// than the tokens, and never fewer but by the timeouts.
const TIMEOUT: Duration = Duration::from_millis(20);
/// Waiting for decisions and the move: a guard against a hang.
const WITHIN: Duration = HANG_GUARD;

fn bucket(tokens: f64) -> BucketConfig {
    BucketConfig {
        capacity: tokens,
        initial: tokens,
        ratio: 0.0,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

fn bucket_key(prefix: &str, upstream: &str) -> String {
    format!("{prefix}:{{u:{upstream}}}:bucket")
}

fn field(reply: &str) -> String {
    reply.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_budget_stays_exact_while_its_slot_moves() {
    let mut cluster = RedisCluster::start(3);
    let prefix = fresh_prefix("reshard");
    let moving = "reshard-moving".to_owned();
    let key = bucket_key(&prefix, &moving);
    let source = cluster.master_of(&key).expect("a master serves the slot");
    let target = (source + 1) % cluster.nodes.len();
    // A second upstream on the source master, in another slot.
    let slot = field(&cluster.nodes[source].cli(&["CLUSTER", "KEYSLOT", &key]));
    let steady = (0..)
        .map(|n| format!("reshard-steady-{n}"))
        .find(|upstream| {
            let key = bucket_key(&prefix, upstream);
            cluster.master_of(&key) == Some(source)
                && field(&cluster.nodes[source].cli(&["CLUSTER", "KEYSLOT", &key])) != slot
        })
        .unwrap();

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

    let stop = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (store, stop, granted, answered) = (
            store.clone(),
            Arc::clone(&stop),
            Arc::clone(&granted),
            Arc::clone(&answered),
        );
        let moving = moving.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let check = store.check(&moving, &bucket(TOKENS), true).await;
                let check = check.unwrap_or_else(|error| panic!("a decision failed: {error}"));
                answered.fetch_add(1, Ordering::Relaxed);
                if check.withdrew {
                    granted.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    let steady_task = {
        let (store, stop, steady) = (store.clone(), Arc::clone(&stop), steady.clone());
        tokio::spawn(async move {
            let (mut shared, mut fallback) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let check = store.check(&steady, &bucket(1.0e6), true).await.unwrap();
                if check.withdrew {
                    shared += 1;
                } else {
                    fallback += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (shared, fallback)
        })
    };
    let started = Instant::now();
    while granted.load(Ordering::Relaxed) < 100 {
        assert!(started.elapsed() < WITHIN, "no decisions before the move");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The move, by hand, each stage held a while under load.
    let id = |node: usize| field(&cluster.nodes[node].cli(&["CLUSTER", "MYID"]));
    let (source_id, target_id) = (id(source), id(target));
    let ok = |node: usize, arguments: &[&str]| {
        let answer = cluster.nodes[node].cli(arguments);
        assert!(answer.contains("OK"), "{arguments:?} answered {answer:?}");
    };
    ok(
        target,
        &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source_id],
    );
    ok(
        source,
        &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target_id],
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    let keys = cluster.nodes[source].cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
    let keys: Vec<&str> = keys.split_whitespace().collect();
    assert!(
        keys.contains(&key.as_str()),
        "the bucket is not in its slot: {keys:?}"
    );
    let target_port = cluster.nodes[target].port().to_string();
    let mut migrate = vec![
        "MIGRATE",
        "127.0.0.1",
        &target_port,
        "",
        "0",
        "5000",
        "KEYS",
    ];
    migrate.extend(keys.iter().copied());
    ok(source, &migrate);
    tokio::time::sleep(Duration::from_millis(150)).await;
    for node in 0..cluster.nodes.len() {
        ok(node, &["CLUSTER", "SETSLOT", &slot, "NODE", &target_id]);
    }
    let moved = granted.load(Ordering::Relaxed);
    assert_eq!(
        cluster.master_of(&key),
        Some(target),
        "the slot did not move"
    );

    // Until the bucket is dry (every token granted, or spent by a timed-out
    // withdrawal), and a while after.
    while granted.load(Ordering::Relaxed) + store.stats().backend_timeouts < TOKENS as u64 {
        assert!(
            started.elapsed() < WITHIN,
            "only {} of {TOKENS} tokens granted",
            granted.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a load task panicked");
    }
    let (steady_shared, steady_fallback) = steady_task.await.unwrap();
    let stats = store.stats();
    let granted = granted.load(Ordering::Relaxed);
    let answered = answered.load(Ordering::Relaxed);
    println!(
        "slot {slot} moved with {moved} of {TOKENS} tokens granted: {granted} granted of {answered} decisions; \
         {steady} on the source: {steady_shared} shared, {steady_fallback} fallback; {stats:?}"
    );
    assert!(
        granted <= TOKENS as u64 && granted + stats.backend_timeouts >= TOKENS as u64,
        "the budget was not exact across the move: {granted} of {TOKENS} granted, {} timeouts",
        stats.backend_timeouts
    );
    assert_eq!(
        store.view(&moving, &bucket(TOKENS)).await.unwrap().tokens,
        0.0
    );
    assert_eq!(
        steady_fallback, 0,
        "{steady} fell back ({steady_shared} shared)"
    );
    let asking = cluster.nodes[target].cli(&["INFO", "commandstats"]);
    assert!(
        asking.contains("cmdstat_asking"),
        "no request was redirected by ASK to the target"
    );
    store.shutdown().await;
}
