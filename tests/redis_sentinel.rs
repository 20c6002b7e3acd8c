//! Redis Sentinel: a primary, a replica and three sentinels started here;
//! decisions run on several tasks while the primary is SIGKILLed; the
//! sentinels promote the replica and the store follows it. Every call is
//! answered (from the local fallback while no primary answers), and
//! shared decisions resume once the replica is promoted.
//!
//! From the kill until the sentinels name the promoted replica, the test
//! runs on tokio's paused clock (`retryd_testkit::clock`), so that "within
//! the store timeout" is measured against the store's own timers, to the
//! millisecond, however loaded the machine: the primary is dead, so the
//! only I/O in flight is a question to the sentinels, during which the
//! clock may jump and time the call out early, never late. The election
//! runs on the sentinels' real clock meanwhile (`down-after-milliseconds
//! 1000`; about 2–4 s here). Following the new primary is real I/O at the
//! machine's pace, so it runs on the running clock again and is checked
//! for liveness only, with the testkit's hang guard; the time it took is
//! printed.

use retryd_testkit::redis as redis_harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis_harness::RedisSentinels;
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, SentinelConfig};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};
use retryd_testkit::HANG_GUARD;
use tokio::time::Instant;

const TIMEOUT: Duration = Duration::from_millis(100);
/// The timer wheel's unit: a deadline fires at most this late.
const TICK: Duration = Duration::from_millis(1);
/// The product's promise, on the paused clock: every store call, a
/// question to the sentinels and a reconnection included, answers within
/// the one store timeout.
const ANSWER_WITHIN: Duration = TIMEOUT.saturating_add(TICK);
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

/// What the load tasks share with the test.
#[derive(Default)]
struct Load {
    stop: AtomicBool,
    /// Set while the clock is paused: calls made wholly inside that window
    /// are held to [`ANSWER_WITHIN`].
    paused: AtomicBool,
}

/// Decisions on `TASKS` tasks until `stop`; returns how many each made and
/// the slowest it saw on the running clock (printed, not bounded: wall
/// time on a busy machine says nothing about the store).
fn load<M: Mode>(
    store: &RedisBudgetStore<M>,
    shared: &Arc<Load>,
) -> Vec<tokio::task::JoinHandle<(u64, Duration)>> {
    (0..TASKS)
        .map(|task| {
            let store = store.clone();
            let shared = Arc::clone(shared);
            tokio::spawn(async move {
                let config = bucket();
                let upstream = format!("sentinel-up-{task}");
                let (mut calls, mut slowest_running) = (0, Duration::ZERO);
                while !shared.stop.load(Ordering::Relaxed) {
                    let paused_before = shared.paused.load(Ordering::Relaxed);
                    let started = Instant::now();
                    let answer = store.check(&upstream, &config, true).await;
                    let took = started.elapsed();
                    assert!(answer.is_ok(), "a call was not answered: {answer:?}");
                    if paused_before && shared.paused.load(Ordering::Relaxed) {
                        assert!(took <= ANSWER_WITHIN, "a call took {took:?}");
                    } else {
                        slowest_running = slowest_running.max(took);
                    }
                    calls += 1;
                    // Bounded load: about 1 k decisions/s per task.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                (calls, slowest_running)
            })
        })
        .collect()
}

async fn follows_the_primary_across_a_failover<M: Mode>() {
    let mut sentinels = RedisSentinels::start();
    let old_primary = sentinels.primary.port();
    let store = store::<M>(&sentinels).await;
    let shared = Arc::new(Load::default());
    let tasks = load(&store, &shared);
    // Shared before the failure: the first decisions of every task landed
    // on the primary, and none fell back.
    retryd_testkit::eventually("every task decided on the primary", || {
        let keys = sentinels.primary.cli(&["KEYS", "*sentinel-up-*bucket*"]);
        (keys.lines().filter(|line| !line.trim().is_empty()).count() == TASKS).then_some(())
    })
    .await;
    assert_eq!(store.stats().fallbacks, 0, "fell back before the failure");

    tokio::time::pause();
    shared.paused.store(true, Ordering::Relaxed);
    sentinels.primary.kill();
    // Until the sentinels name the replica: every call answered in time
    // (checked by the load tasks). Asking the sentinels is a blocking
    // `redis-cli` during which the paused clock stands still; between two
    // questions the load runs for 10 ms of paused time.
    let killed = std::time::Instant::now();
    let new_primary = loop {
        let named = sentinels.primary_port();
        if named.is_some_and(|port| port != old_primary) {
            break named;
        }
        assert!(
            killed.elapsed() < HANG_GUARD,
            "the sentinels named no new primary within {HANG_GUARD:?}; sentinel log:\n{}",
            sentinels.sentinels[0].log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let promoted = killed.elapsed();
    let fallbacks_during = store.stats().fallbacks;
    shared.paused.store(false, Ordering::Relaxed);
    tokio::time::resume();
    assert_eq!(new_primary, Some(sentinels.replica.port()));

    // Resumed: the store is available again and no decision has fallen
    // back for a while (the fallback counter stood still for 500 ms). A
    // reconnection at the machine's pace: a liveness check, with the hang
    // guard; the time it took is printed.
    let mut last_fallbacks = store.stats().fallbacks;
    let mut quiet_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let fallbacks = store.stats().fallbacks;
        if fallbacks != last_fallbacks {
            last_fallbacks = fallbacks;
            quiet_since = Instant::now();
        }
        if store.is_available() && quiet_since.elapsed() >= Duration::from_millis(500) {
            break;
        }
        assert!(
            killed.elapsed() < HANG_GUARD,
            "shared decisions did not resume within {HANG_GUARD:?} (fallbacks {fallbacks}); sentinel log:\n{}",
            sentinels.sentinels[0].log()
        );
    }
    let resumed = killed.elapsed().saturating_sub(quiet_since.elapsed());
    shared.stop.store(true, Ordering::Relaxed);
    let (mut calls, mut slowest_running) = (0, Duration::ZERO);
    for task in tasks {
        let (made, slowest) = task.await.expect("a load task panicked");
        calls += made;
        slowest_running = slowest_running.max(slowest);
    }
    println!(
        "{:?}: primary SIGKILLed; the sentinels named the replica {promoted:?} after ({fallbacks_during} fallbacks by then, every call within {ANSWER_WITHIN:?} on the paused clock); shared decisions resumed {resumed:?} after ({calls} calls, {} from the fallback, the slowest on the running clock {slowest_running:?})",
        M::MODE,
        store.stats().fallbacks
    );
    assert!(
        fallbacks_during > 0,
        "no call fell back while there was no primary"
    );
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

// On a current-thread runtime, the one on which tokio's clock can pause.
#[tokio::test]
async fn an_exact_store_follows_the_primary_across_a_failover() {
    follows_the_primary_across_a_failover::<Exact>().await;
}

#[tokio::test]
async fn a_leased_store_follows_the_primary_across_a_failover() {
    follows_the_primary_across_a_failover::<Leased>().await;
}
