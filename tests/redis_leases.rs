//! Leased mode sizes each upstream's lease to its demand: a busy upstream's
//! leases double up to `max_lease_tokens` and a quarter of the bucket's
//! capacity, so it needs far fewer round trips than withdrawals; a lease
//! that goes back with tokens left halves the next. The sizes are read from
//! the lease set in a real Redis, started by the test itself.

use retryd_testkit::redis as redis_harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use redis_harness::RedisServer;
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig};
use retryd_budget::{
    BucketConfig, BudgetStore, LeasedStore, OnUnavailable, RedisBudgetStore, UNITS_PER_TOKEN,
};

fn bucket(capacity: f64) -> BucketConfig {
    BucketConfig {
        capacity,
        initial: capacity,
        ratio: 0.0,
        min_per_second: 0.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

#[derive(Clone)]
struct Setup {
    url: String,
    prefix: String,
    lease_tokens: f64,
    max_lease_tokens: f64,
    lease_ttl: Duration,
}

impl Setup {
    fn new(server: &RedisServer, lease_tokens: f64) -> Setup {
        Setup {
            url: server.url(),
            prefix: redis_harness::fresh_prefix("leases"),
            lease_tokens,
            max_lease_tokens: 1000.0,
            lease_ttl: Duration::from_secs(2),
        }
    }

    async fn store<M: Mode>(&self) -> RedisBudgetStore<M> {
        let config = RedisConfig {
            urls: vec![self.url.as_str().into()],
            mode: M::MODE,
            // The server's default: these tests count round trips, and
            // none may time out.
            timeout: Duration::from_millis(20),
            lease_tokens: self.lease_tokens,
            max_lease_tokens: self.max_lease_tokens,
            lease_ttl: self.lease_ttl,
            key_prefix: self.prefix.clone(),
            access: RedisAccess::default(),
        };
        RedisBudgetStore::connect(&config, 1000)
            .await
            .expect("connect to the test Redis")
    }

    /// A plain connection, to read the lease set as Redis holds it.
    async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test Redis")
    }

    /// The live leases of `upstream` in Redis, in whole tokens. Members are
    /// `<lease id>:<units>` (see `crates/retryd-budget/src/redis/acquire.lua`).
    async fn leases(
        &self,
        redis: &mut redis::aio::MultiplexedConnection,
        upstream: &str,
    ) -> Vec<u64> {
        let key = format!("{}:{{u:{upstream}}}:leases", self.prefix);
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query_async(redis)
            .await
            .unwrap();
        members
            .iter()
            .map(|member| {
                let units: u64 = member.rsplit(':').next().unwrap().parse().unwrap();
                assert_eq!(units % UNITS_PER_TOKEN, 0, "a lease of whole tokens");
                units / UNITS_PER_TOKEN
            })
            .collect()
    }
}

/// One task withdraws `count` times; after each withdrawal that took a new
/// lease, the lease Redis holds is recorded. Returns the sizes in order.
async fn sizes_while_withdrawing(
    setup: &Setup,
    store: &LeasedStore,
    upstream: &str,
    config: &BucketConfig,
    count: usize,
) -> Vec<u64> {
    let mut redis = setup.redis().await;
    let mut sizes = Vec::new();
    let mut acquisitions = store.lease_acquisitions();
    for index in 0..count {
        let left = store.try_withdraw(upstream, config).await.unwrap();
        assert!(left.is_some(), "withdrawal {index} of {count} refused");
        if store.lease_acquisitions() != acquisitions {
            acquisitions = store.lease_acquisitions();
            let leases = setup.leases(&mut redis, upstream).await;
            assert_eq!(leases.len(), 1, "one replica, one live lease: {leases:?}");
            sizes.push(leases[0]);
        }
    }
    sizes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_upstream_needs_far_fewer_acquisitions_than_withdrawals() {
    let server = RedisServer::start();
    let setup = Setup::new(&server, 1.0);
    let store = Arc::new(setup.store::<Leased>().await);
    let config = bucket(1e9);
    let withdrawals: u64 = 20_000;
    let made = Arc::new(AtomicU64::new(0));
    let granted = Arc::new(AtomicU64::new(0));
    let running = Arc::new(AtomicBool::new(true));
    // Meanwhile, every lease Redis holds is sampled: none may exceed the cap.
    let sampler = {
        let mut redis = setup.redis().await;
        let running = Arc::clone(&running);
        let setup = setup.clone();
        tokio::spawn(async move {
            let mut largest = 0;
            while running.load(Ordering::Acquire) {
                let leases = setup.leases(&mut redis, "busy").await;
                largest = leases.into_iter().fold(largest, u64::max);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            largest
        })
    };
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (store, made, granted) = (Arc::clone(&store), Arc::clone(&made), Arc::clone(&granted));
        tasks.push(tokio::spawn(async move {
            while made.fetch_add(1, Ordering::Relaxed) < withdrawals {
                if store.try_withdraw("busy", &config).await.unwrap().is_some() {
                    granted.fetch_add(1, Ordering::Relaxed);
                }
                // As a decision's task does between two decisions (each
                // arrives on a socket): a withdrawal from the lease never
                // waits, so without this, eight tasks on two workers would
                // run without a pause, and a task queued for the next
                // lease could wait past the default 20 ms timeout behind
                // them, which is this loop's doing, not the store's.
                tokio::task::yield_now().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    running.store(false, Ordering::Release);
    let largest = sampler.await.unwrap();
    let acquisitions = store.lease_acquisitions();
    eprintln!(
        "{withdrawals} withdrawals, {acquisitions} acquisitions, largest lease seen {largest}"
    );
    assert_eq!(granted.load(Ordering::Relaxed), withdrawals);
    // With lease_tokens = 1 and a fixed size, that would be one each;
    // doubling to 1000 needs about 10 to grow, then one per 1000.
    assert!(
        acquisitions * 100 <= withdrawals,
        "{acquisitions} acquisitions for {withdrawals} withdrawals: the lease did not grow"
    );
    assert!(largest <= 1000, "a lease of {largest} > max_lease_tokens");
    assert_eq!(store.stats().fallbacks, 0, "{:?}", store.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_double_up_to_max_lease_tokens() {
    let server = RedisServer::start();
    let mut setup = Setup::new(&server, 3.0);
    setup.max_lease_tokens = 50.0;
    let store = setup.store::<Leased>().await;
    let sizes = sizes_while_withdrawing(&setup, &store, "doubling", &bucket(1e6), 400).await;
    // 3 + 6 + 12 + 24 + 48 = 93, then 50 at a time: 400 needs 12 leases.
    assert_eq!(sizes, [3, 6, 12, 24, 48, 50, 50, 50, 50, 50, 50, 50]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_never_hold_more_than_a_quarter_of_a_small_bucket() {
    let server = RedisServer::start();
    let setup = Setup::new(&server, 1.0);
    let store = setup.store::<Leased>().await;
    let config = bucket(400.0);
    let sizes = sizes_while_withdrawing(&setup, &store, "small", &config, 400).await;
    // Capped at 400 / 4 = 100; the last lease is what the bucket had left.
    assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64, 100, 100, 73]);
    assert_eq!(store.try_withdraw("small", &config).await.unwrap(), None);
    // The cap never goes below lease_tokens, what a lease always was.
    let setup = Setup::new(&server, 5.0);
    let store = setup.store::<Leased>().await;
    let sizes = sizes_while_withdrawing(&setup, &store, "tiny", &bucket(8.0), 8).await;
    assert_eq!(sizes, [5, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_returned_with_tokens_left_halves_the_next() {
    let server = RedisServer::start();
    let mut setup = Setup::new(&server, 1.0);
    setup.lease_ttl = Duration::from_millis(200);
    let store = setup.store::<Leased>().await;
    let config = bucket(1e6);
    // 1 + 2 + 4 + 8 + 16 + 32 = 63: the 64th withdrawal takes a lease of 64
    // and leaves 63 of it.
    let sizes = sizes_while_withdrawing(&setup, &store, "quiet", &config, 64).await;
    assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64]);
    // Spendable for lease_ttl / 2; then the sweep hands 63 back: polled
    // for (the sweep is a background task), within the hang guard.
    let mut redis = setup.redis().await;
    let started = std::time::Instant::now();
    while !setup.leases(&mut redis, "quiet").await.is_empty() {
        assert!(
            started.elapsed() < retryd_testkit::HANG_GUARD,
            "the sweep never handed the lease back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sizes = sizes_while_withdrawing(&setup, &store, "quiet", &config, 1).await;
    assert_eq!(sizes, [32]);
    // Nothing was lost on the way: granted + shared = the budget.
    store.shutdown().await;
    assert_eq!(store.stats().forfeited_tokens, 0.0);
    let observer = setup.store::<Exact>().await;
    let shared = observer.view("quiet", &config).await.unwrap().tokens;
    assert_eq!(shared + 65.0, 1e6);
}
