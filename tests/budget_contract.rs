//! The `BudgetStore` contract: one suite, generic over the store, run
//! against the memory store, Redis in exact and leased mode, and a 3-node
//! Redis Cluster in both modes, all started by the test itself. Every store
//! must give the same answers.

use retryd_testkit::HANG_GUARD;
use retryd_testkit::redis as redis_harness;

use std::future::Future;
use std::time::{Duration, Instant};

use redis_harness::{RedisCluster, RedisServer};
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig};
use retryd_budget::{BucketConfig, BudgetStore, MemoryBudgetStore, RedisBudgetStore, StoreError};

fn bucket(capacity: f64, initial: f64, ratio: f64, min_per_second: f64) -> BucketConfig {
    BucketConfig {
        capacity,
        initial,
        ratio,
        min_per_second,
        ..BucketConfig::default()
    }
}

/// A key prefix no other test or store uses.
async fn redis_store<M: Mode>(urls: &[String], max_upstreams: usize) -> RedisBudgetStore<M> {
    let config = RedisConfig {
        urls: urls.iter().map(|url| url.as_str().into()).collect(),
        mode: M::MODE,
        // Generous: these tests check answers, not latency, on a busy machine.
        timeout: Duration::from_millis(500),
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: redis_harness::fresh_prefix("contract"),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, max_upstreams)
        .await
        .expect("connect to the test Redis")
}

/// Leased mode flushes deposits in the background: views may take a few
/// milliseconds to show them.
async fn settles_to<S: BudgetStore>(
    store: &S,
    upstream: &str,
    config: &BucketConfig,
    expected: f64,
) {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let tokens = store.view(upstream, config).await.unwrap().tokens;
        if (tokens - expected).abs() < 1e-9 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{upstream:?} holds {tokens}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs every case, each on a fresh store (`make(max_upstreams)`).
async fn contract<S, F, Fut>(make: F)
where
    S: BudgetStore,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = S>,
{
    fresh_bucket_reads_initial(&make(100).await).await;
    withdrawals_grant_exactly_the_whole_initial_tokens(&make(100).await).await;
    deposits_add_ratio_times_requests_capped_at_capacity(&make(100).await).await;
    looking_never_spends(&make(100).await).await;
    a_check_withdraws_only_when_asked_and_allowed(&make(100).await).await;
    kill_switch_round_trip(&make(100).await).await;
    list_is_ordered_by_name(&make(100).await).await;
    odd_upstream_names_are_kept_apart(&make(100).await).await;
    the_floor_refills_within_its_rate(&make(100).await).await;
    a_lowered_capacity_caps_what_is_held(&make(100).await).await;
    the_upstream_limit_holds(&make(2).await).await;
}

async fn fresh_bucket_reads_initial<S: BudgetStore>(store: &S) {
    let config = bucket(10.0, 7.5, 0.1, 0.0);
    let view = store.view("fresh", &config).await.unwrap();
    assert_eq!(view.tokens, 7.5);
    assert!(view.retries_enabled);
    assert!(!view.tracked);
    let again = store.view("fresh", &config).await.unwrap();
    assert!(!again.tracked, "looking does not create");
    assert!(store.list(|_| config).await.unwrap().is_empty());
}

async fn withdrawals_grant_exactly_the_whole_initial_tokens<S: BudgetStore>(store: &S) {
    let config = bucket(10.0, 7.5, 0.0, 0.0);
    let mut lefts = Vec::new();
    for _ in 0..12 {
        if let Some(left) = store.try_withdraw("spend", &config).await.unwrap() {
            lefts.push(left);
        }
    }
    assert_eq!(
        lefts,
        [6.5, 5.5, 4.5, 3.5, 2.5, 1.5, 0.5],
        "floor(7.5) grants"
    );
    let view = store.view("spend", &config).await.unwrap();
    assert_eq!(view.tokens, 0.5);
    assert!(view.tracked);
}

async fn deposits_add_ratio_times_requests_capped_at_capacity<S: BudgetStore>(store: &S) {
    let config = bucket(10.0, 2.0, 0.5, 0.0);
    store.deposit("traffic", &config, 4).await.unwrap();
    settles_to(store, "traffic", &config, 4.0).await;
    store.deposit("traffic", &config, 3).await.unwrap();
    settles_to(store, "traffic", &config, 5.5).await;
    store.deposit("traffic", &config, 1000).await.unwrap();
    settles_to(store, "traffic", &config, 10.0).await;
    // Leased mode flushes deposits in the background, so a withdrawal may
    // be refused until the flush lands. On a bucket that starts empty such
    // a refusal spends nothing, so refusals are waited out, and what is
    // checked is that exactly the capacity is granted, never more.
    let config = bucket(10.0, 0.0, 0.5, 0.0);
    store.deposit("funded", &config, 1000).await.unwrap();
    settles_to(store, "funded", &config, 10.0).await;
    let deadline = Instant::now() + HANG_GUARD;
    let mut granted = 0;
    while granted < 10 {
        if store
            .try_withdraw("funded", &config)
            .await
            .unwrap()
            .is_some()
        {
            granted += 1;
        } else {
            assert!(Instant::now() < deadline, "{granted} of 10 granted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert_eq!(
        store.try_withdraw("funded", &config).await.unwrap(),
        None,
        "never more than capacity"
    );
}

async fn looking_never_spends<S: BudgetStore>(store: &S) {
    let config = bucket(5.0, 3.0, 0.0, 0.0);
    store.deposit("look", &config, 0).await.unwrap();
    for _ in 0..50 {
        assert_eq!(store.view("look", &config).await.unwrap().tokens, 3.0);
    }
    let mut granted = 0;
    while store.try_withdraw("look", &config).await.unwrap().is_some() {
        granted += 1;
    }
    assert_eq!(granted, 3);
}

/// `check` is what a decision calls: a view, or a withdrawal guarded by
/// the kill switch, in one step.
async fn a_check_withdraws_only_when_asked_and_allowed<S: BudgetStore>(store: &S) {
    let config = bucket(10.0, 2.5, 0.0, 0.0);
    let looked = store.check("check", &config, false).await.unwrap();
    assert_eq!(
        (looked.tokens, looked.retries_enabled, looked.withdrew),
        (2.5, true, false)
    );
    assert!(
        !store.view("check", &config).await.unwrap().tracked,
        "a check without withdrawal creates nothing"
    );
    let mut seen = Vec::new();
    for _ in 0..4 {
        let check = store.check("check", &config, true).await.unwrap();
        assert!(check.retries_enabled);
        seen.push((check.withdrew, check.tokens));
    }
    assert_eq!(
        seen,
        [(true, 1.5), (true, 0.5), (false, 0.5), (false, 0.5)],
        "whole tokens only, and what is left"
    );

    let guarded = bucket(10.0, 5.0, 0.0, 0.0);
    store
        .set_retries_enabled("guarded", &guarded, false)
        .await
        .unwrap();
    let refused = store.check("guarded", &guarded, true).await.unwrap();
    assert!(!refused.withdrew, "the kill switch guards the withdrawal");
    assert!(!refused.retries_enabled);
    assert_eq!(store.view("guarded", &guarded).await.unwrap().tokens, 5.0);
}

async fn kill_switch_round_trip<S: BudgetStore>(store: &S) {
    let config = bucket(5.0, 5.0, 0.0, 0.0);
    assert!(
        store
            .set_retries_enabled("switch", &config, false)
            .await
            .unwrap()
    );
    let view = store.view("switch", &config).await.unwrap();
    assert!(!view.retries_enabled);
    assert!(view.tracked);
    assert_eq!(view.tokens, 5.0, "switching does not spend");
    let listed = store.list(|_| config).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].retries_enabled);
    assert!(
        !store
            .set_retries_enabled("switch", &config, true)
            .await
            .unwrap()
    );
    assert!(store.view("switch", &config).await.unwrap().retries_enabled);
    assert!(
        store
            .set_retries_enabled("switch", &config, true)
            .await
            .unwrap()
    );
}

async fn list_is_ordered_by_name<S: BudgetStore>(store: &S) {
    let config_of = |name: &str| match name {
        "alpha" => bucket(4.0, 4.0, 0.0, 0.0),
        _ => bucket(9.0, 9.0, 0.0, 0.0),
    };
    for name in ["charlie", "alpha", "bravo"] {
        store.try_withdraw(name, &config_of(name)).await.unwrap();
    }
    let listed = store.list(config_of).await.unwrap();
    let names: Vec<&str> = listed
        .iter()
        .map(|snapshot| snapshot.upstream.as_str())
        .collect();
    assert_eq!(names, ["alpha", "bravo", "charlie"]);
    let tokens: Vec<f64> = listed.iter().map(|snapshot| snapshot.tokens).collect();
    assert_eq!(tokens, [3.0, 8.0, 8.0]);
    assert!(
        listed
            .iter()
            .all(|snapshot| snapshot.tracked && snapshot.retries_enabled)
    );
}

async fn odd_upstream_names_are_kept_apart<S: BudgetStore>(store: &S) {
    let names = [
        "{",
        "}",
        "{}",
        "a{b}c",
        "%7B",
        "ünïcødé",
        "x:y:z",
        "with space",
        "",
        "🦀",
    ];
    for (index, name) in names.iter().enumerate() {
        // Each name spends a different amount, so a shared bucket would show.
        let config = bucket(20.0, 20.0, 0.0, 0.0);
        for _ in 0..=index {
            assert!(
                store.try_withdraw(name, &config).await.unwrap().is_some(),
                "{name:?}"
            );
        }
    }
    for (index, name) in names.iter().enumerate() {
        let config = bucket(20.0, 20.0, 0.0, 0.0);
        let view = store.view(name, &config).await.unwrap();
        assert_eq!(view.tokens, 19.0 - index as f64, "{name:?}");
    }
    let listed = store.list(|_| bucket(20.0, 20.0, 0.0, 0.0)).await.unwrap();
    let mut expected: Vec<&str> = names.to_vec();
    expected.sort();
    let listed: Vec<&str> = listed
        .iter()
        .map(|snapshot| snapshot.upstream.as_str())
        .collect();
    assert_eq!(listed, expected);
}

async fn the_floor_refills_within_its_rate<S: BudgetStore>(store: &S) {
    let config = bucket(5.0, 0.0, 0.0, 20.0);
    let started = Instant::now();
    assert_eq!(store.try_withdraw("floor", &config).await.unwrap(), None);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut granted = 0u32;
    while store
        .try_withdraw("floor", &config)
        .await
        .unwrap()
        .is_some()
    {
        granted += 1;
        assert!(granted < 100);
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert!(
        f64::from(granted) <= 20.0 * elapsed + 1e-9,
        "{granted} granted in {elapsed} s at 20/s"
    );
    assert!(granted >= 2, "150 ms at 20/s is 3 tokens, got {granted}");
}

async fn a_lowered_capacity_caps_what_is_held<S: BudgetStore>(store: &S) {
    let wide = bucket(100.0, 100.0, 0.0, 0.0);
    store.deposit("narrow", &wide, 0).await.unwrap();
    let narrow = bucket(5.0, 5.0, 0.0, 0.0);
    assert_eq!(store.view("narrow", &narrow).await.unwrap().tokens, 5.0);
    assert!(
        store
            .try_withdraw("narrow", &narrow)
            .await
            .unwrap()
            .is_some()
    );
    settles_to(store, "narrow", &narrow, 4.0).await;
}

async fn the_upstream_limit_holds<S: BudgetStore>(store: &S) {
    let config = bucket(10.0, 10.0, 0.0, 0.0);
    store.deposit("first", &config, 1).await.unwrap();
    store.try_withdraw("second", &config).await.unwrap();
    let third = store.try_withdraw("third", &config).await;
    assert!(
        matches!(third, Err(StoreError::TooManyUpstreams { limit: 2 })),
        "{third:?}"
    );
    assert!(
        store.view("third", &config).await.is_ok(),
        "looking is free"
    );
    assert!(
        store
            .try_withdraw("first", &config)
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn memory_store_keeps_the_contract() {
    contract(|limit| async move { MemoryBudgetStore::new(limit) }).await;
}

#[tokio::test]
async fn redis_exact_keeps_the_contract() {
    let server = RedisServer::start();
    let urls = [server.url()];
    contract(|limit| redis_store::<Exact>(&urls, limit)).await;
}

#[tokio::test]
async fn redis_leased_keeps_the_contract() {
    let server = RedisServer::start();
    let urls = [server.url()];
    contract(|limit| redis_store::<Leased>(&urls, limit)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_keeps_the_contract_in_both_modes() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    let urls = cluster.urls();
    contract(|limit| redis_store::<Exact>(&urls, limit)).await;
    contract(|limit| redis_store::<Leased>(&urls, limit)).await;
    // One node's URL is enough: the store sees cluster mode and follows it.
    let one = [urls[1].clone()];
    contract(|limit| redis_store::<Exact>(&one, limit)).await;
}
