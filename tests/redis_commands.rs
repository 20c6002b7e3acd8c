//! Redis work per decision, read from the server's own `INFO commandstats`
//! around N decisions, so that it cannot silently grow back: an exact
//! decision costs at most 4 commands (EVALSHA, and TIME, HMGET, HSET inside
//! the script) once its bucket exists. It also prints Redis CPU per
//! decision (commandstats usec, and the server's own CPU counters) for
//! exact and leased mode, which BENCHMARKS.md quotes.

use retryd_testkit::redis as redis_harness;

use std::collections::BTreeMap;
use std::time::Duration;

use redis_harness::RedisServer;
use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore};

/// Decisions measured per mode: enough that the rare commands (a PEXPIRE
/// about once a third of a bucket's TTL, the index refresh about once a
/// minute, the housekeeping read once a second) show as what they are.
const DECISIONS: u64 = 4_000;
const UPSTREAMS: u64 = 8;

fn bucket() -> BucketConfig {
    BucketConfig {
        // Never short of tokens: every decision withdraws, the path that
        // writes.
        capacity: 1.0e6,
        initial: 1.0e6,
        ratio: 0.5,
        min_per_second: 10.0,
        on_unavailable: OnUnavailable::Local,
        configured: false,
    }
}

async fn store<M: Mode>(server: &RedisServer) -> RedisBudgetStore<M> {
    let config = RedisConfig {
        urls: vec![server.url().into()],
        mode: M::MODE,
        // The server's default: this counts commands, and none may time
        // out.
        timeout: Duration::from_millis(20),
        lease_tokens: 5.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: redis_harness::fresh_prefix("commands"),
        access: RedisAccess::default(),
    };
    RedisBudgetStore::connect(&config, 1000)
        .await
        .expect("connect to the test Redis")
}

/// `cmdstat_<name>` → (calls, usec), from `INFO commandstats`.
fn commandstats(server: &RedisServer) -> BTreeMap<String, (u64, u64)> {
    let mut stats = BTreeMap::new();
    for line in server.cli(&["INFO", "commandstats"]).lines() {
        let Some((name, fields)) = line.trim().split_once(':') else {
            continue;
        };
        let Some(name) = name.strip_prefix("cmdstat_") else {
            continue;
        };
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|pair| pair.strip_prefix(key)?.strip_prefix('='))
                .and_then(|value| value.parse::<f64>().ok())
                .unwrap_or(0.0) as u64
        };
        stats.insert(name.to_owned(), (field("calls"), field("usec")));
    }
    stats
}

/// The server's CPU (user + system) in microseconds, from `INFO cpu`.
fn server_cpu_us(server: &RedisServer) -> u64 {
    let info = server.cli(&["INFO", "cpu"]);
    let field = |key: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(key)?.strip_prefix(':'))
            .and_then(|value| value.parse::<f64>().ok())
            .expect("INFO cpu names the field")
    };
    ((field("used_cpu_user") + field("used_cpu_sys")) * 1e6) as u64
}

/// What N decisions cost Redis.
struct Work {
    commands: BTreeMap<String, u64>,
    calls: u64,
    script_usec: u64,
    cpu_us: u64,
}

async fn measure<M: Mode>(server: &RedisServer) -> Work {
    let store = store::<M>(server).await;
    let config = bucket();
    let upstream = |n: u64| format!("upstream-{}", n % UPSTREAMS);
    // Warm-up: every bucket created and admitted, its expiry set.
    for n in 0..UPSTREAMS * 4 {
        let check = store.check(&upstream(n), &config, true).await.unwrap();
        assert!(check.withdrew);
    }
    // The redis-cli calls themselves are counted; only the difference of
    // the two readings is used, and CONFIG/INFO are left out.
    let before = commandstats(server);
    let cpu_before = server_cpu_us(server);
    for n in 0..DECISIONS {
        let check = store.check(&upstream(n), &config, true).await.unwrap();
        assert!(check.withdrew, "a funded decision withdraws");
    }
    let cpu_after = server_cpu_us(server);
    let after = commandstats(server);
    store.shutdown().await;
    let mut commands = BTreeMap::new();
    let mut script_usec = 0;
    for (name, (calls, usec)) in &after {
        if name == "info" || name.starts_with("config") {
            continue;
        }
        let (calls_before, usec_before) = before.get(name).copied().unwrap_or((0, 0));
        if calls > &calls_before {
            commands.insert(name.clone(), calls - calls_before);
        }
        // EVALSHA's time includes the commands the script runs.
        if name == "evalsha" {
            script_usec = usec - usec_before;
        }
    }
    Work {
        calls: commands.values().sum(),
        commands,
        script_usec,
        cpu_us: cpu_after.saturating_sub(cpu_before),
    }
}

fn report(mode: &str, work: &Work) {
    let per_decision = |value: u64| value as f64 / DECISIONS as f64;
    println!(
        "{mode}: {:.3} commands/decision {:?}; script {:.2} µs/decision; \
         redis-server CPU {:.2} µs/decision (≈{:.0} decisions/s per Redis core)",
        per_decision(work.calls),
        work.commands,
        per_decision(work.script_usec),
        per_decision(work.cpu_us),
        1e6 / per_decision(work.cpu_us).max(0.001),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_decision_costs_at_most_four_redis_commands() {
    let server = RedisServer::start();
    let work = measure::<Exact>(&server).await;
    report("exact", &work);
    // One script per decision, and inside it TIME, HMGET and HSET only:
    // the lease set, the kill switch and the key's expiry are read from
    // the bucket's own fields.
    assert_eq!(work.commands.get("evalsha"), Some(&DECISIONS));
    assert_eq!(work.commands.get("time"), Some(&DECISIONS));
    assert_eq!(work.commands.get("hmget"), Some(&DECISIONS));
    assert_eq!(work.commands.get("hset"), Some(&DECISIONS));
    for per_call in ["zremrangebyscore", "zrange", "exists", "persist"] {
        assert_eq!(work.commands.get(per_call), None, "{per_call} ran");
    }
    // The rest is rare: a PEXPIRE per bucket about once a third of its TTL
    // (at most once per bucket here), the once-a-second housekeeping read
    // and an index refresh. A margin of one such command per 100 decisions.
    assert!(
        work.calls <= 4 * DECISIONS + DECISIONS / 100,
        "{} commands for {DECISIONS} decisions: {:?}",
        work.calls,
        work.commands
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_decision_costs_less_redis_work_than_an_exact_one() {
    let server = RedisServer::start();
    let work = measure::<Leased>(&server).await;
    report("leased", &work);
    // Leases grow while they run dry fast, so most decisions spend a
    // leased token without a round trip.
    assert!(
        work.calls < DECISIONS,
        "{} commands for {DECISIONS} leased decisions: {:?}",
        work.calls,
        work.commands
    );
}
