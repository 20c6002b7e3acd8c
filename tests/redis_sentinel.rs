//! Redis Sentinel: a primary, a replica and three sentinels started here;
//! decisions run on several tasks while the primary is SIGKILLed; the
//! sentinels promote the replica and the store follows it. Every call is
//! answered (from the local fallback while no primary answers), within the
//! store timeout, and shared decisions resume within a bound this test
//! measures and prints (and asserts with a wide margin).

use retryd_testkit::redis as redis_harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis_harness::RedisSentinels;
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, SentinelConfig};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};

const TIMEOUT: Duration = Duration::from_millis(100);
/// What a call may take: the timeout, twice over for a reconnect to the
/// sentinels inside it, and a busy 2-core machine's margin.
const ANSWER_WITHIN: Duration = Duration::from_millis(2 * 100 + 50);
/// Failure detection (`down-after-milliseconds 1000`), the election and
/// the promotion took about 2–4 s here; the assertion allows 15 s so that
/// a loaded machine cannot break it, and prints what it measured.
const RESUME_WITHIN: Duration = Duration::from_secs(15);
const TASKS: usize = 4;

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 1.0e6,
        initial: 1.0e6,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

async fn store<M: Mode>(sentinels: &RedisSentinels) -> RedisBudgetStore<M> {
    let config = RedisConfig {
        urls: sentinels.urls().into_iter().map(Into::into).collect(),
        mode: M::MODE,
        timeout: TIMEOUT,
        lease_tokens: 2.0,
        max_lease_tokens: 8.0,
        lease_ttl: Duration::from_secs(1),
        key_prefix: redis_harness::fresh_prefix("sentinel"),
        access: RedisAccess {
            sentinel: Some(SentinelConfig {
                master_name: RedisSentinels::MASTER_NAME.into(),
            }),
            ..RedisAccess::default()
        },
    };
    RedisBudgetStore::connect(&config, 1000)
        .await
        .expect("connect through the sentinels")
}

/// Decisions on `TASKS` tasks until `stop`; returns how many were made.
fn load<M: Mode>(
    store: &RedisBudgetStore<M>,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..TASKS)
        .map(|task| {
            let store = store.clone();
            let stop = Arc::clone(stop);
            tokio::spawn(async move {
                let config = bucket();
                let upstream = format!("sentinel-up-{task}");
                let mut calls = 0;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let answer = store.check(&upstream, &config, true).await;
                    let took = started.elapsed();
                    assert!(answer.is_ok(), "a call was not answered: {answer:?}");
                    assert!(took <= ANSWER_WITHIN, "a call took {took:?}");
                    calls += 1;
                    // Bounded load: about 1 k decisions/s per task.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                calls
            })
        })
        .collect()
}

async fn follows_the_primary_across_a_failover<M: Mode>() {
    let mut sentinels = RedisSentinels::start();
    let old_primary = sentinels.primary.port();
    let store = store::<M>(&sentinels).await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = load(&store, &stop);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.stats().fallbacks, 0, "fell back before the failure");

    sentinels.primary.kill();
    let killed = Instant::now();
    // Resumed: the store is available again and no decision has fallen
    // back for a while (the fallback counter stood still for 500 ms).
    let last_fallback_at = Arc::new(AtomicU64::new(0));
    let mut last_fallbacks = store.stats().fallbacks;
    let resumed = loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let fallbacks = store.stats().fallbacks;
        let now = killed.elapsed();
        if fallbacks != last_fallbacks {
            last_fallbacks = fallbacks;
            last_fallback_at.store(now.as_millis() as u64, Ordering::Relaxed);
        }
        let quiet_since = Duration::from_millis(last_fallback_at.load(Ordering::Relaxed));
        if fallbacks > 0 && store.is_available() && now - quiet_since >= Duration::from_millis(500)
        {
            break quiet_since;
        }
        assert!(
            now <= RESUME_WITHIN + Duration::from_millis(500),
            "shared decisions did not resume within {RESUME_WITHIN:?} (fallbacks {fallbacks}); sentinel log:\n{}",
            sentinels.sentinels[0].log()
        );
    };
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for task in tasks {
        calls += task.await.expect("a load task panicked");
    }
    let new_primary = sentinels.primary_port();
    println!(
        "{:?}: primary SIGKILLed; shared decisions resumed {resumed:?} after ({calls} calls, {} from the fallback); new primary {new_primary:?}",
        M::MODE,
        store.stats().fallbacks
    );
    assert_ne!(
        new_primary,
        Some(old_primary),
        "the sentinels never failed over"
    );
    assert_eq!(new_primary, Some(sentinels.replica.port()));
    assert!(resumed <= RESUME_WITHIN, "resumed after {resumed:?}");
    // What is decided now is shared: it lands on the promoted replica.
    let config = bucket();
    let before = store.stats().fallbacks;
    assert!(
        store
            .check("after-failover", &config, true)
            .await
            .unwrap()
            .withdrew
    );
    assert_eq!(store.stats().fallbacks, before);
    let keys = sentinels.replica.cli(&["KEYS", "*after-failover*"]);
    assert!(
        keys.contains("bucket"),
        "the bucket is not on the new primary: {keys:?}"
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_store_follows_the_primary_across_a_failover() {
    follows_the_primary_across_a_failover::<Exact>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_store_follows_the_primary_across_a_failover() {
    follows_the_primary_across_a_failover::<Leased>().await;
}
