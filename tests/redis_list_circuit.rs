//! `list` stays outside the decisions' circuit (issue 29, finding 4): a
//! `/metrics` scrape or `ListBudgets` whose reads time out says nothing
//! to the circuit, so it can never turn a slow listing into an outage for
//! the decisions (`BUDGET_UNAVAILABLE`, local fallbacks). The store over a
//! real `redis-server` the test stops (SIGSTOP) and resumes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use retryd_budget::redis::{Exact, RedisAccess, RedisConfig};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};
use retryd_testkit::redis::RedisServer;

/// The store timeout of `tests/redis_outage.rs`.
const TIMEOUT: Duration = Duration::from_millis(50);

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 50.0,
        initial: 50.0,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

async fn store(url: String) -> RedisBudgetStore<Exact> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let config = RedisConfig {
        urls: vec![url.into()],
        mode: retryd_budget::redis::RedisMode::Exact,
        timeout: TIMEOUT,
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: format!(
            "list-circuit-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, 1000)
        .await
        .expect("connect to the test Redis")
}

#[tokio::test]
async fn a_listing_that_times_out_leaves_the_circuit_closed() {
    let redis = RedisServer::start();
    let store = store(redis.url()).await;
    for upstream in ["a", "b", "c"] {
        store.check(upstream, &bucket(), true).await.unwrap();
    }
    assert_eq!(store.list(|_| bucket()).await.unwrap().len(), 3);

    // Redis stops answering: the listing times out...
    redis.stop();
    let listed = store.list(|_| bucket()).await;
    let still_available = store.is_available();
    redis.cont();
    assert!(listed.is_err(), "a stopped Redis lists nothing: {listed:?}");
    // ...and the decisions' circuit never heard of it.
    assert!(
        still_available,
        "a listing's timeout opened the decisions' circuit"
    );
    let check = store.check("a", &bucket(), true).await.unwrap();
    assert!(check.withdrew, "decided on Redis once it answers again");
    assert!(store.is_available());
}
