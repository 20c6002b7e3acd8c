//! A single Redis node honours a `store.timeout` longer than redis-rs's
//! own 500 ms response timeout (issue 37): at 800 ms, a Redis that answers
//! after about 600 ms still decides from the shared bucket (no fallback,
//! no timeout counted), and one that answers after more than 800 ms does
//! not.

use retryd_testkit::redis::{RedisServer, fresh_prefix};

use std::time::{Duration, Instant};

use retryd_budget::redis::{Exact, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 10.0,
        initial: 10.0,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_waits_for_the_whole_store_timeout() {
    let redis = RedisServer::start();
    let config = RedisConfig {
        urls: vec![redis.url().into()],
        mode: RedisMode::Exact,
        timeout: Duration::from_millis(800),
        lease_tokens: 2.0,
        max_lease_tokens: 8.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: fresh_prefix("timeout-800"),
        access: RedisAccess::default(),
    };
    let store = RedisBudgetStore::<Exact>::connect(&config, 100)
        .await
        .expect("connect");
    assert!(store.check("pay", &bucket(), true).await.unwrap().withdrew);

    // Slower than redis-rs's default 500 ms, within the store's 800 ms.
    let asleep = redis.sleep_in_background(Duration::from_millis(600));
    let started = Instant::now();
    let check = store.check("pay", &bucket(), true).await.unwrap();
    let took = started.elapsed();
    asleep.join().unwrap();
    assert!(check.withdrew, "fell back after {took:?}: {check:?}");
    assert_eq!(check.tokens, 8.0, "not the shared bucket: {check:?}");
    assert!(
        took >= Duration::from_millis(450),
        "Redis was not slow: {took:?}"
    );
    let stats = store.stats();
    assert_eq!(
        (stats.backend_timeouts, stats.fallbacks),
        (0, 0),
        "{stats:?}"
    );

    // Slower than the store timeout: the fallback answers at 800 ms.
    let asleep = redis.sleep_in_background(Duration::from_millis(1500));
    let started = Instant::now();
    let check = store.check("pay", &bucket(), true).await.unwrap();
    let took = started.elapsed();
    asleep.join().unwrap();
    assert!(!check.withdrew, "{check:?}");
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_millis(1400),
        "answered after {took:?}"
    );
    // Whichever timer fired first (the store's, or redis-rs's response timeout,
    // which is the same 800 ms), the request failed.
    assert!(store.stats().backend_errors >= 1, "{:?}", store.stats());
    store.shutdown().await;
}
