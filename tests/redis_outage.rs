//! Redis outages: killed, paused, slow, or a Cluster node killed. Every
//! call answers within the store timeout with the upstream's configured
//! fallback (`local`: a local bucket with no initial tokens and no floor;
//! `deny`: `StoreError::Unavailable`); when Redis returns, shared decisions
//! resume. No panic, no hang.
//!
//! The outages run on tokio's paused clock (`retryd_testkit::clock`): with
//! Redis dead or stalled nothing is in flight, so the clock jumps to the
//! next deadline and a call's measured time is what the store's timers
//! allow, to the millisecond, however loaded the machine. The recoveries
//! run on the running clock again: a reconnection is real I/O, at the
//! machine's pace, so they are checked for liveness only. The slow Redis
//! is a proxy on the paused clock (below).

use retryd_testkit::HANG_GUARD;
use retryd_testkit::redis as redis_harness;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use redis_harness::{RedisCluster, RedisServer};
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, RedisMode};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore, StoreError};
use tokio::time::Instant;

const TIMEOUT: Duration = Duration::from_millis(50);
/// The timer wheel's unit: a deadline fires at most this late.
const TICK: Duration = Duration::from_millis(1);
/// What the promise allows a call, on the paused clock.
const ANSWER_WITHIN: Duration = TIMEOUT.saturating_add(TICK);
/// How long leased mode trusts its reading of the shared bucket.
const VIEW_CACHE: Duration = Duration::from_millis(100);

fn bucket(on_unavailable: OnUnavailable) -> BucketConfig {
    BucketConfig {
        capacity: 50.0,
        initial: 50.0,
        ratio: 0.5,
        min_per_second: 0.0,
        on_unavailable,
        configured: false,
    }
}

async fn store<M: Mode>(urls: Vec<String>) -> RedisBudgetStore<M> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let config = RedisConfig {
        urls: urls.into_iter().map(Into::into).collect(),
        mode: M::MODE,
        timeout: TIMEOUT,
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: format!(
            "outage-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, 1000)
        .await
        .expect("connect to the test Redis")
}

/// Runs `call` and checks it answered in time, on the paused clock.
async fn timed<T>(what: &str, call: impl Future<Output = T>) -> T {
    timed_within(what, ANSWER_WITHIN, call).await
}

/// [`timed`], with the bound `within`.
async fn timed_within<T>(what: &str, within: Duration, call: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let answer = call.await;
    let took = started.elapsed();
    assert!(took <= within, "{what} took {took:?}");
    answer
}

/// While Redis is unreachable: `local` upstreams answer from the local
/// bucket, `deny` upstreams answer Unavailable, all in time. Returns how
/// many local withdrawals were granted and how many requests were reported.
async fn answers_while_down<M: Mode>(store: &RedisBudgetStore<M>, lasting: Duration) -> (u32, u64) {
    let local = bucket(OnUnavailable::Local);
    let deny = bucket(OnUnavailable::Deny);
    let (mut granted, mut reported) = (0, 0);
    let started = Instant::now();
    while started.elapsed() < lasting {
        let view = timed("local view", store.view("local-up", &local)).await;
        assert!(view.is_ok(), "{view:?}");
        if let Ok(Some(_)) = timed("local withdraw", store.try_withdraw("local-up", &local)).await {
            granted += 1;
        }
        timed("local deposit", store.deposit("local-up", &local, 2))
            .await
            .unwrap();
        reported += 2;

        let view = timed("deny view", store.view("deny-up", &deny)).await;
        assert!(matches!(view, Err(StoreError::Unavailable(_))), "{view:?}");
        let withdrawn = timed("deny withdraw", store.try_withdraw("deny-up", &deny)).await;
        assert!(
            matches!(withdrawn, Err(StoreError::Unavailable(_))),
            "{withdrawn:?}"
        );
        let deposited = timed("deny deposit", store.deposit("deny-up", &deny, 1)).await;
        assert!(
            matches!(deposited, Err(StoreError::Unavailable(_))),
            "{deposited:?}"
        );

        let switched = timed(
            "kill switch",
            store.set_retries_enabled("local-up", &local, false),
        )
        .await;
        assert!(
            matches!(switched, Err(StoreError::Unavailable(_))),
            "{switched:?}"
        );
        let listed = timed("list", store.list(|_| local)).await;
        assert!(
            matches!(listed, Err(StoreError::Unavailable(_))),
            "{listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (granted, reported)
}

/// With Redis back, on the running clock again: waits until a view of a
/// never-seen upstream comes from Redis (a fresh shared bucket holds
/// `initial`; the local fallback would hold nothing), and returns how long
/// that took. Coming back takes a reconnection, real I/O whose pace the
/// machine sets, so this is a liveness check with a hang guard; the
/// promise about time is the outage's, above.
async fn shared_again<M: Mode>(store: &RedisBudgetStore<M>) -> Duration {
    let local = bucket(OnUnavailable::Local);
    let started = Instant::now();
    let mut probe = 0;
    loop {
        probe += 1;
        let upstream = format!("fresh-{probe}");
        let view = store.view(&upstream, &local).await.unwrap();
        if view.tokens == local.initial && store.is_available() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "shared decisions not back after {HANG_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn killed_and_restarted<M: Mode>() {
    let mode = M::MODE;
    let mut server = RedisServer::start();
    let store = store::<M>(vec![server.url()]).await;
    let (local, deny) = (bucket(OnUnavailable::Local), bucket(OnUnavailable::Deny));
    assert!(
        store
            .try_withdraw("local-up", &local)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        store
            .try_withdraw("deny-up", &deny)
            .await
            .unwrap()
            .is_some()
    );
    assert!(store.is_available());

    tokio::time::pause();
    server.kill();
    // Nothing tells a store that Redis died until it talks to it: exact
    // mode does on every call; leased mode may first answer from its lease
    // and its reading of the shared bucket, for at most VIEW_CACHE.
    let killed = Instant::now();
    let mut reported_before = 0;
    while store.is_available() {
        reported_before += 1;
        timed("view", store.view("local-up", &local)).await.unwrap();
        timed("deposit", store.deposit("local-up", &local, 1))
            .await
            .unwrap();
        assert!(
            killed.elapsed() <= VIEW_CACHE + Duration::from_millis(2) + ANSWER_WITHIN,
            "the outage went unnoticed for {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    eprintln!(
        "{mode:?}: the outage was noticed after {:?}",
        killed.elapsed()
    );
    let (granted, reported) = answers_while_down(&store, Duration::from_millis(700)).await;
    let reported = reported + reported_before;
    assert!(!store.is_available());
    let stats = store.stats();
    assert!(
        stats.outages >= 1 && stats.fallbacks > 0 && stats.unavailable_answers > 0,
        "{stats:?}"
    );
    // The local bucket grants only what this replica's own reports funded
    // (plus, in leased mode, what its lease still held: 4 tokens).
    let lease_held = if mode == RedisMode::Leased { 4.0 } else { 0.0 };
    assert!(
        f64::from(granted) <= lease_held + local.ratio * reported as f64,
        "{granted} granted from {reported} reported"
    );

    tokio::time::resume();
    let _server = server.restarted().await;
    let took = shared_again(&store).await;
    eprintln!("{mode:?}: shared decisions back {took:?} after the restart");
    // Redis lost its data: the bucket starts afresh, from Redis.
    let after = store.try_withdraw("after-restart", &local).await.unwrap();
    assert_eq!(after, Some(49.0));
    assert_eq!(store.background_restarts(), 0);
}

#[tokio::test]
async fn exact_mode_survives_redis_killed_and_restarted() {
    killed_and_restarted::<Exact>().await;
}

#[tokio::test]
async fn leased_mode_survives_redis_killed_and_restarted() {
    killed_and_restarted::<Leased>().await;
}

#[tokio::test]
async fn a_paused_redis_is_an_outage_until_it_answers() {
    let server = RedisServer::start();
    let store = store::<Exact>(vec![server.url()]).await;
    let local = bucket(OnUnavailable::Local);
    assert_eq!(
        store.try_withdraw("paused", &local).await.unwrap(),
        Some(49.0)
    );
    tokio::time::pause();
    // Stalled for as long as the test needs: every reply waits.
    server.stop();
    answers_while_down(&store, Duration::from_millis(400)).await;
    assert!(!store.is_available());
    tokio::time::resume();
    server.cont();
    let took = shared_again(&store).await;
    eprintln!("paused: shared decisions back {took:?} after the pause ended");
    // Nothing was lost: the shared bucket kept its state.
    assert_eq!(
        store.try_withdraw("paused", &local).await.unwrap(),
        Some(48.0)
    );
}

#[tokio::test]
async fn a_killed_cluster_node_is_answered_in_time_and_recovers() {
    let mut cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    let store = store::<Exact>(cluster.urls()).await;
    let local = bucket(OnUnavailable::Local);
    let upstreams: Vec<String> = (0..12).map(|index| format!("node-{index}")).collect();
    for upstream in &upstreams {
        assert!(
            store
                .try_withdraw(upstream, &local)
                .await
                .unwrap()
                .is_some()
        );
    }
    tokio::time::pause();
    cluster.nodes[0].kill();
    // The other nodes are alive, and the paused clock may jump while one
    // of their replies is on its way: such a call then times out, early
    // in real time but never later than its deadline, which is what is
    // checked here (that the others stay shared is tests/redis_cluster_failover.rs).
    // While a master is lost, a live master's request is waited for once
    // more (`Patience::Failover`): twice the timeout, and never longer.
    let failover_bound = 2 * TIMEOUT + TICK;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(700) {
        for upstream in &upstreams {
            let answer = timed_within(
                "withdraw",
                failover_bound,
                store.try_withdraw(upstream, &local),
            )
            .await;
            assert!(answer.is_ok(), "{answer:?}");
        }
        // Answers from the fallback take no time at all: time moves here.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(store.stats().outages > 0);
    tokio::time::resume();
    let _cluster = tokio::task::spawn_blocking(move || {
        cluster.nodes[0].restart();
        cluster.wait_until_ok();
        cluster
    })
    .await
    .unwrap();
    // Every upstream is served by Redis again: a fresh one reads initial.
    let took = shared_again(&store).await;
    eprintln!("cluster: shared decisions back {took:?} after the node rejoined");
    for upstream in &upstreams {
        store.try_withdraw(upstream, &local).await.unwrap();
    }
}

/// A proxy in front of a Redis that holds every reply back by a delay the
/// test sets, on tokio's clock (none at first, so that connecting is
/// quick): a slow but answering Redis, the case where an operation of
/// several calls could add their timeouts up.
///
/// It runs on the test's paused runtime. Each round trip to Redis runs as
/// a blocking task, during which tokio does not move a paused clock, and
/// the hop between the store and the proxy is loopback, readable as soon
/// as it is written: so the only time that passes is the delay, and the
/// store's deadlines are measured against it exactly.
struct SlowProxy {
    port: u16,
    delay_ms: Arc<AtomicU64>,
}

impl SlowProxy {
    async fn start(redis_port: u16) -> SlowProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port for the proxy");
        let port = listener.local_addr().unwrap().port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = Arc::clone(&delay_ms);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let redis = std::net::TcpStream::connect(("127.0.0.1", redis_port))
                    .expect("the proxy connects to Redis");
                let _ = (client.set_nodelay(true), redis.set_nodelay(true));
                tokio::spawn(relay(client, redis, Arc::clone(&delay)));
            }
        });
        SlowProxy { port, delay_ms }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn delay_replies(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Release);
    }
}

/// One store connection through the proxy: each request goes to Redis at
/// once; its reply is handed back `delay` later, in order.
async fn relay(client: tokio::net::TcpStream, redis: std::net::TcpStream, delay: Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_client, mut to_client) = client.into_split();
    let (replies, mut queued) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        while let Some((due, reply)) = queued.recv().await {
            tokio::time::sleep_until(due).await;
            if to_client.write_all(&reply).await.is_err() {
                return;
            }
        }
    });
    let mut redis = Some(redis);
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from_client.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let request = buffer[..read].to_vec();
        let mut connection = redis.take().expect("one round trip at a time");
        let (connection, reply) = tokio::task::spawn_blocking(move || {
            let reply = round_trip(&mut connection, &request);
            (connection, reply)
        })
        .await
        .unwrap();
        redis = Some(connection);
        let Some(reply) = reply else { return };
        if reply.is_empty() {
            continue;
        }
        let due = Instant::now() + Duration::from_millis(delay.load(Ordering::Acquire));
        if replies.send((due, reply)).is_err() {
            return;
        }
    }
}

/// Sends `request` to Redis and reads what it answered: everything that
/// comes until it has been quiet for 5 ms (a pipelined request's replies
/// come together). Empty if nothing came within 200 ms (a request split
/// across reads is answered after its rest); `None` once Redis is gone.
fn round_trip(redis: &mut std::net::TcpStream, request: &[u8]) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    redis.write_all(request).ok()?;
    let mut reply = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut wait = Duration::from_millis(200);
    loop {
        redis.set_read_timeout(Some(wait)).ok()?;
        match redis.read(&mut chunk) {
            Ok(0) => return None,
            Ok(read) => reply.extend_from_slice(&chunk[..read]),
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Some(reply);
            }
            Err(_) => return None,
        }
        wait = Duration::from_millis(5);
    }
}

/// A Redis that answers every call in 0.8 × the timeout: a decision that
/// needs two calls (a new upstream's admission, then its check; in leased
/// mode a view, the admission and a lease) still answers within the one
/// timeout, from the upstream's fallback, instead of adding the calls up.
async fn a_slow_redis_is_answered_within_the_timeout<M: Mode>() {
    let mode = M::MODE;
    const SLOW_TIMEOUT: Duration = Duration::from_millis(500);
    // Below the connection's own 500 ms response timeout, so the first call
    // answers; two of them take 800 ms.
    const REPLY_DELAY: Duration = Duration::from_millis(400);
    let server = RedisServer::start();
    let proxy = SlowProxy::start(server.port()).await;
    let config = RedisConfig {
        urls: vec![proxy.url().into()],
        mode,
        timeout: SLOW_TIMEOUT,
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: redis_harness::fresh_prefix("slow"),
        access: RedisAccess::default(),
    };
    let store = RedisBudgetStore::<M>::connect(&config, 1000)
        .await
        .expect("connect to the test Redis through the proxy");
    tokio::time::pause();
    proxy.delay_replies(REPLY_DELAY);
    let (local, deny) = (bucket(OnUnavailable::Local), bucket(OnUnavailable::Deny));
    for round in 0..3 {
        let started = Instant::now();
        let check = store
            .check(&format!("slow-local-{round}"), &local, true)
            .await
            .unwrap();
        let took = started.elapsed();
        eprintln!("{mode:?}: a slow check answered in {took:?} (paused clock)");
        // It waited for Redis's first answer (the circuit stays closed: a
        // request cut short by its call's deadline says little about
        // Redis), and no longer than the one timeout.
        assert!(
            (REPLY_DELAY..=SLOW_TIMEOUT + TICK).contains(&took),
            "{mode:?}: a check took {took:?}"
        );
        assert!(!check.withdrew, "the local bucket starts empty: {check:?}");

        let started = Instant::now();
        let check = store
            .check(&format!("slow-deny-{round}"), &deny, true)
            .await;
        let took = started.elapsed();
        assert!(
            took <= SLOW_TIMEOUT + TICK,
            "{mode:?}: a check took {took:?}"
        );
        assert!(
            matches!(check, Err(StoreError::Unavailable(_))),
            "{check:?}"
        );
    }
    assert!(store.stats().backend_timeouts > 0, "{:?}", store.stats());
    assert!(store.is_available(), "{:?}", store.stats());
}

#[tokio::test]
async fn exact_mode_answers_a_slow_redis_within_the_timeout() {
    a_slow_redis_is_answered_within_the_timeout::<Exact>().await;
}

#[tokio::test]
async fn leased_mode_answers_a_slow_redis_within_the_timeout() {
    a_slow_redis_is_answered_within_the_timeout::<Leased>().await;
}

/// Leased mode, one-token leases behind a Redis that answers in 400 ms,
/// a 1 s timeout: tasks queue for the lease, each acquiring in turn. On
/// the paused clock: the first leases at 400 ms, the second at 800; the
/// third gets the lock at 800 with 240 ms of its deadline left and falls
/// back; that says nothing about Redis, so a fourth task that started at
/// 700 ms still takes a lease within its own deadline (lock at 1040, reply
/// at 1440, deadline 1700) instead of inheriting the third's failure.
#[tokio::test]
async fn a_lease_waiter_out_of_time_does_not_fail_the_next() {
    let server = RedisServer::start();
    let proxy = SlowProxy::start(server.port()).await;
    let config = RedisConfig {
        urls: vec![proxy.url().into()],
        mode: RedisMode::Leased,
        timeout: Duration::from_millis(1000),
        lease_tokens: 1.0,
        max_lease_tokens: 1.0,
        lease_ttl: Duration::from_secs(30),
        key_prefix: redis_harness::fresh_prefix("queue"),
        access: RedisAccess::default(),
    };
    let store = Arc::new(
        RedisBudgetStore::<Leased>::connect(&config, 1000)
            .await
            .expect("connect to the test Redis through the proxy"),
    );
    let local = bucket(OnUnavailable::Local);
    // Admitted, and its first lease spent, while Redis is still quick.
    assert_eq!(
        store.try_withdraw("queued", &local).await.unwrap(),
        Some(49.0)
    );
    tokio::time::pause();
    proxy.delay_replies(Duration::from_millis(400));
    let withdraw_after = |delay: Duration| {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            store.try_withdraw("queued", &local).await.unwrap()
        })
    };
    let first = withdraw_after(Duration::ZERO);
    let second = withdraw_after(Duration::from_millis(20));
    let third = withdraw_after(Duration::from_millis(40));
    let fourth = withdraw_after(Duration::from_millis(700));
    let answers = [
        first.await.unwrap(),
        second.await.unwrap(),
        third.await.unwrap(),
        fourth.await.unwrap(),
    ];
    assert_eq!(
        answers.map(|answer| answer.is_some()),
        [true, true, false, true],
        "the third ran out of time, the fourth took its own lease: {answers:?}"
    );
    assert!(store.is_available(), "{:?}", store.stats());
}
