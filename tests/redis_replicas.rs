//! Several replicas (store instances, each with its own connection) on one
//! Redis, as several retryd processes would be: the budget is shared and
//! never over-granted, also while Redis stalls; leased tokens stranded in
//! an idle replica come back; the kill switch crosses replicas; scripts
//! survive SCRIPT FLUSH and a restart, on one node and in a Cluster.

use retryd_testkit::redis as redis_harness;
use retryd_testkit::{HANG_GUARD, clock};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use redis_harness::{RedisCluster, RedisServer};
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};

/// How long leased mode trusts its reading of the shared bucket.
const VIEW_CACHE: Duration = Duration::from_millis(100);

fn bucket(capacity: f64, initial: f64, ratio: f64, min_per_second: f64) -> BucketConfig {
    BucketConfig {
        capacity,
        initial,
        ratio,
        min_per_second,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

struct Setup {
    urls: Vec<String>,
    prefix: String,
    timeout: Duration,
    lease_tokens: f64,
    max_lease_tokens: f64,
    lease_ttl: Duration,
}

impl Setup {
    fn new(urls: Vec<String>) -> Setup {
        Setup {
            urls,
            prefix: redis_harness::fresh_prefix("replicas"),
            timeout: Duration::from_millis(20), // the server's default
            lease_tokens: 5.0,
            max_lease_tokens: 1000.0,
            lease_ttl: Duration::from_secs(2),
        }
    }

    async fn replica<M: Mode>(&self) -> RedisBudgetStore<M> {
        let config = RedisConfig {
            urls: self.urls.iter().map(|url| url.as_str().into()).collect(),
            mode: M::MODE,
            timeout: self.timeout,
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

    async fn replicas<M: Mode>(&self, count: usize) -> Vec<Arc<RedisBudgetStore<M>>> {
        let mut replicas = Vec::with_capacity(count);
        for _ in 0..count {
            replicas.push(Arc::new(self.replica().await));
        }
        replicas
    }
}

/// Many tasks on every replica withdraw until `attempts` have been made.
async fn withdraw_concurrently<M: Mode>(
    replicas: &[Arc<RedisBudgetStore<M>>],
    upstream: &'static str,
    config: BucketConfig,
    tasks_per_replica: usize,
    attempts: usize,
) -> usize {
    let made = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for replica in replicas {
        for _ in 0..tasks_per_replica {
            let (replica, made, granted) =
                (Arc::clone(replica), Arc::clone(&made), Arc::clone(&granted));
            handles.push(tokio::spawn(async move {
                while made.fetch_add(1, Ordering::Relaxed) < attempts {
                    if replica
                        .try_withdraw(upstream, &config)
                        .await
                        .unwrap()
                        .is_some()
                    {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for handle in handles {
        handle.await.unwrap();
    }
    granted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_replicas_grant_exactly_the_budget() {
    let server = RedisServer::start();
    let setup = Setup::new(vec![server.url()]);
    let replicas = setup.replicas::<Exact>(3).await;
    let config = bucket(300.0, 300.0, 0.0, 0.0);
    let granted = withdraw_concurrently(&replicas, "shared", config, 8, 1200).await;
    for replica in &replicas {
        assert_eq!(replica.stats().fallbacks, 0, "{:?}", replica.stats());
    }
    assert_eq!(granted, 300, "demand 1200 > supply 300: exactly the budget");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_replicas_never_exceed_and_account_for_every_token() {
    let server = RedisServer::start();
    let mut setup = Setup::new(vec![server.url()]);
    setup.lease_tokens = 7.0;
    let replicas = setup.replicas::<Leased>(3).await;
    let config = bucket(300.0, 300.0, 0.0, 0.0);
    let granted = withdraw_concurrently(&replicas, "shared", config, 8, 1200).await;
    assert!(granted <= 300, "granted {granted} > 300");
    assert!(
        granted >= 300 - 3 * 7,
        "under-use is bounded by the leases held: {granted}"
    );
    // Hand every lease back; then granted + shared + forfeited = budget.
    for replica in &replicas {
        replica.shutdown().await;
    }
    let forfeited: f64 = replicas
        .iter()
        .map(|replica| replica.stats().forfeited_tokens)
        .sum();
    let observer = setup.replica::<Exact>().await;
    let shared = observer.view("shared", &config).await.unwrap().tokens;
    assert_eq!(
        granted as f64 + shared + forfeited,
        300.0,
        "granted {granted}, shared {shared}, forfeited {forfeited}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stranded_lease_tokens_are_usable_elsewhere_within_lease_ttl() {
    let server = RedisServer::start();
    let mut setup = Setup::new(vec![server.url()]);
    setup.lease_ttl = Duration::from_millis(400);
    let (busy, idle) = (
        setup.replica::<Leased>().await,
        setup.replica::<Leased>().await,
    );
    let config = bucket(5.0, 5.0, 0.0, 0.0);
    // `idle` leases all 5 tokens, spends one and goes quiet.
    assert_eq!(
        idle.try_withdraw("stranded", &config).await.unwrap(),
        Some(4.0)
    );
    // Redis's clock expires leases, so Redis's clock states the bound: the
    // lease ends within lease_ttl of now. (The test's own wall clock would
    // add however long a loaded machine takes to poll.)
    let redis_now_ms = {
        let time = server.cli(&["TIME"]);
        let mut fields = time
            .split_whitespace()
            .map(|field| field.parse::<u64>().unwrap());
        let (seconds, micros) = (fields.next().unwrap(), fields.next().unwrap());
        seconds * 1000 + micros / 1000
    };
    let leases = server.cli(&[
        "ZRANGE",
        &format!("{}:{{u:stranded}}:leases", setup.prefix),
        "0",
        "-1",
        "WITHSCORES",
    ]);
    let ends: Vec<u64> = leases
        .split_whitespace()
        .skip(1)
        .step_by(2)
        .map(|score| score.parse().unwrap())
        .collect();
    assert_eq!(ends.len(), 1, "one lease: {leases:?}");
    assert!(
        ends[0] <= redis_now_ms + setup.lease_ttl.as_millis() as u64,
        "the lease ends at {} ms, {} ms from Redis's now",
        ends[0],
        ends[0].saturating_sub(redis_now_ms)
    );
    assert_eq!(busy.try_withdraw("stranded", &config).await.unwrap(), None);
    // Once it has ended, the four stranded tokens are the other replica's
    // (HANG_GUARD only so that a stuck test fails instead of hanging).
    let started = Instant::now();
    let mut granted = 0;
    while granted < 4 {
        assert!(
            started.elapsed() < HANG_GUARD,
            "stranded tokens not usable after {:?}",
            started.elapsed()
        );
        if busy
            .try_withdraw("stranded", &config)
            .await
            .unwrap()
            .is_some()
        {
            granted += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!("stranded tokens usable after {:?}", started.elapsed());
    assert_eq!(busy.try_withdraw("stranded", &config).await.unwrap(), None);
    assert_eq!(idle.stats().forfeited_tokens, 0.0);
}

// On the current-thread runtime, whose clock a test can pause.
#[tokio::test]
async fn the_kill_switch_crosses_replicas() {
    let server = RedisServer::start();
    let config = bucket(10.0, 10.0, 0.0, 0.0);

    let exact = Setup::new(vec![server.url()]);
    let (one, other) = (
        exact.replica::<Exact>().await,
        exact.replica::<Exact>().await,
    );
    assert!(
        other
            .view("switched", &config)
            .await
            .unwrap()
            .retries_enabled
    );
    one.set_retries_enabled("switched", &config, false)
        .await
        .unwrap();
    assert!(
        !other
            .view("switched", &config)
            .await
            .unwrap()
            .retries_enabled,
        "exact mode: obeyed on the next view"
    );
    other
        .set_retries_enabled("switched", &config, true)
        .await
        .unwrap();
    assert!(one.view("switched", &config).await.unwrap().retries_enabled);

    // Leased mode trusts its reading of the shared bucket for 100 ms: on a
    // paused clock held still (every Redis reply comes back at the same
    // instant), the first view once that time has passed obeys.
    let leased = Setup::new(vec![server.url()]);
    let (one, other) = (
        leased.replica::<Leased>().await,
        leased.replica::<Leased>().await,
    );
    tokio::time::pause();
    let _frozen = clock::freeze();
    other.try_withdraw("switched", &config).await.unwrap();
    assert!(
        other
            .view("switched", &config)
            .await
            .unwrap()
            .retries_enabled
    );
    one.set_retries_enabled("switched", &config, false)
        .await
        .unwrap();
    tokio::time::advance(VIEW_CACHE).await;
    clock::settle().await;
    assert!(
        !other
            .view("switched", &config)
            .await
            .unwrap()
            .retries_enabled,
        "leased mode: obeyed once its reading is {VIEW_CACHE:?} old"
    );
}

/// Replicas withdraw and report traffic, optionally while Redis is paused
/// and then put to sleep: whatever answers they fall back to, the fleet
/// never grants more than initial + ratio × reported + floor × elapsed.
/// Returns (granted, bound).
async fn fleet_under_load<M: Mode>(stall: bool) -> (f64, f64) {
    let mode = M::MODE;
    let server = RedisServer::start();
    let mut setup = Setup::new(vec![server.url()]);
    // Short enough that the stalls are outages; when healthy, the server's
    // default.
    setup.timeout = Duration::from_millis(if stall { 40 } else { 20 });
    let replicas = setup.replicas::<M>(3).await;
    let config = bucket(30.0, 10.0, 0.5, 5.0);
    let run_for = Duration::from_millis(1500);
    let granted = Arc::new(AtomicU64::new(0));
    let reported = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut handles = Vec::new();
    for (index, replica) in replicas.iter().enumerate() {
        for _ in 0..4 {
            let (replica, granted) = (Arc::clone(replica), Arc::clone(&granted));
            handles.push(tokio::spawn(async move {
                while started.elapsed() < run_for {
                    if let Ok(Some(_)) = replica.try_withdraw("loaded", &config).await {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }));
        }
        let (replica, reported) = (Arc::clone(replica), Arc::clone(&reported));
        handles.push(tokio::spawn(async move {
            let mut requests = 1 + index as u64;
            while started.elapsed() < run_for {
                // Counted whatever the store answers: the bound is on what
                // callers reported.
                reported.fetch_add(requests, Ordering::Relaxed);
                let _ = replica.deposit("loaded", &config, requests).await;
                requests = requests % 3 + 1;
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }));
    }
    let mut sleeper = None;
    if stall {
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.pause(Duration::from_millis(300));
        tokio::time::sleep(Duration::from_millis(600)).await;
        sleeper = Some(server.sleep_in_background(Duration::from_millis(300)));
    }
    for handle in handles {
        handle.await.unwrap();
    }
    if let Some(sleeper) = sleeper {
        let _ = tokio::task::spawn_blocking(move || sleeper.join()).await;
    }
    for replica in &replicas {
        replica.shutdown().await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let granted = granted.load(Ordering::Relaxed) as f64;
    let reported = reported.load(Ordering::Relaxed) as f64;
    let bound = config.initial + config.ratio * reported + config.min_per_second * elapsed;
    let stats: Vec<_> = replicas.iter().map(|replica| replica.stats()).collect();
    eprintln!(
        "{mode:?}, stall {stall}: granted {granted} ≤ {bound:.2} (reported {reported}, {elapsed:.2} s); {stats:?}"
    );
    assert!(
        granted <= bound,
        "{mode:?}: granted {granted} > bound {bound}; {stats:?}"
    );
    if stall {
        assert!(
            stats.iter().any(|stats| stats.outages > 0),
            "the stalls were noticed: {stats:?}"
        );
    }
    for replica in &replicas {
        assert_eq!(replica.background_restarts(), 0);
    }
    (granted, bound)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_invariant_holds_while_redis_stalls() {
    let (granted, _) = fleet_under_load::<Exact>(true).await;
    assert!(granted > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_invariant_holds_while_redis_stalls() {
    let (granted, _) = fleet_under_load::<Leased>(true).await;
    assert!(granted > 0.0);
}

/// With demand above supply and Redis healthy, both modes spend nearly the
/// whole budget: exact loses only what arrived after the last attempt;
/// leased also what the three replicas' last leases held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_modes_spend_the_budget_when_redis_is_healthy() {
    let spends = |mode: RedisMode, held: f64, (granted, bound): (f64, f64)| {
        let slack = held + 5.0 + 0.02 * bound;
        assert!(
            granted >= bound - slack,
            "{mode:?}: granted {granted}, bound {bound}: under-used"
        );
    };
    spends(
        RedisMode::Exact,
        0.0,
        fleet_under_load::<Exact>(false).await,
    );
    spends(
        RedisMode::Leased,
        3.0 * 5.0,
        fleet_under_load::<Leased>(false).await,
    );
}

async fn survives_lost_scripts<M: Mode>(
    store: &RedisBudgetStore<M>,
    upstreams: &[String],
    flush: impl Fn(),
) {
    let config = bucket(10.0, 10.0, 0.0, 0.0);
    for upstream in upstreams {
        assert!(
            store
                .try_withdraw(upstream, &config)
                .await
                .unwrap()
                .is_some()
        );
    }
    flush();
    for upstream in upstreams {
        assert!(
            store
                .try_withdraw(upstream, &config)
                .await
                .unwrap()
                .is_some()
        );
        store.deposit(upstream, &config, 1).await.unwrap();
        store.view(upstream, &config).await.unwrap();
    }
    assert_eq!(store.stats().fallbacks, 0, "{:?}", store.stats());
    assert_eq!(store.stats().backend_errors, 0, "{:?}", store.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_survive_script_flush_and_restart() {
    let server = RedisServer::start();
    let upstreams: Vec<String> = (0..5).map(|index| format!("flushed-{index}")).collect();
    let exact = Setup::new(vec![server.url()]).replica::<Exact>().await;
    survives_lost_scripts(&exact, &upstreams, || server.flush_scripts()).await;
    let leased = Setup::new(vec![server.url()]).replica::<Leased>().await;
    survives_lost_scripts(&leased, &upstreams, || server.flush_scripts()).await;

    let store = Setup::new(vec![server.url()]).replica::<Exact>().await;
    let config = bucket(10.0, 10.0, 0.0, 0.0);
    assert_eq!(
        store.try_withdraw("restarted", &config).await.unwrap(),
        Some(9.0)
    );
    // Coming back takes a reconnection, real I/O at the machine's pace: a
    // liveness check, with a guard against a hang, not a latency.
    let _server = server.restarted().await;
    let started = Instant::now();
    // Without persistence the bucket starts afresh: 9 left means Redis
    // answered (the fallback bucket holds nothing).
    loop {
        if store.try_withdraw("restarted", &config).await.unwrap() == Some(9.0) {
            break;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "not back within {HANG_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("shared again {:?} after the restart", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scripts_survive_script_flush() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    // Enough names that every node holds some.
    let upstreams: Vec<String> = (0..12).map(|index| format!("slot-{index}")).collect();
    let exact = Setup::new(cluster.urls()).replica::<Exact>().await;
    survives_lost_scripts(&exact, &upstreams, || cluster.flush_scripts()).await;
    let leased = Setup::new(cluster.urls()).replica::<Leased>().await;
    survives_lost_scripts(&leased, &upstreams, || cluster.flush_scripts()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_replicas_grant_exactly_the_budget() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    let setup = Setup::new(cluster.urls());
    let replicas = setup.replicas::<Exact>(3).await;
    let config = bucket(200.0, 200.0, 0.0, 0.0);
    let granted = withdraw_concurrently(&replicas, "clustered", config, 8, 800).await;
    assert_eq!(granted, 200);
}
