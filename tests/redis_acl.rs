//! Redis ACL users: retryd works as a user with a password and only the
//! commands it needs (the ACL below is the one README.md states) on one
//! node, on every node of a Cluster, and on the data nodes under Sentinel
//! (whose sentinels have a password of their own, carried by their URLs);
//! a wrong password fails clearly; neither password ever appears in any
//! log line, whether given in the TOML, a URL, a file or an environment
//! variable.

use retryd_testkit as support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use retryd_budget::redis::{
    Exact, Leased, Mode, RedisAccess, RedisConfig, RedisPassword, SentinelConfig,
};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore, ReportClaim};
use retryd_proto as pb;
use support::redis::{RedisCluster, RedisSentinels, RedisServer, SentinelOptions};
use support::{Server, binary, retryable};

const PASSWORD: &str = "acl-secret-7c1e9d";
/// The sentinels' own password (`requirepass`), in their URLs.
const SENTINEL_PASSWORD: &str = "sentinel-secret-4a0b2f";
const PREFIX: &str = "aclretryd";

/// The least privileges retryd needs, as README.md states them: its own
/// keys, the scripts, and the commands those scripts and the store run
/// (`+cluster|slots` for a Cluster's slot map, `+asking` to follow an ASK
/// redirect while a slot moves, `+role` for Sentinel's check that the node
/// it names is the primary).
const RULES: &str = "-@all +evalsha +script|load +info \
                     +zadd +zrangebyscore +set +time +hmget +hset +exists \
                     +pexpire +persist +pttl +del +get +zcard +zrange +zrem +zremrangebyscore \
                     +zscore +role +cluster|slots +asking";

/// `ACL SETUSER retryd` with `rules` on keys `prefix:*`.
fn acl(prefix: &str, password: &str, rules: &str) -> Vec<String> {
    let mut arguments = vec![
        "ACL".to_owned(),
        "SETUSER".to_owned(),
        "retryd".to_owned(),
        "reset".to_owned(),
        "resetchannels".to_owned(),
        "on".to_owned(),
        format!(">{password}"),
        format!("~{prefix}:*"),
    ];
    arguments.extend(rules.split_whitespace().map(str::to_owned));
    arguments
}

fn redis_with_user() -> RedisServer {
    let redis = RedisServer::start();
    add_user(&redis, RULES);
    redis
}

/// The user `retryd` on `node` with `rules` (ACLs are per node: neither
/// a Cluster nor replication shares them).
fn add_user(node: &RedisServer, rules: &str) {
    let arguments = acl(PREFIX, PASSWORD, rules);
    let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
    let answer = node.cli(&arguments);
    assert!(answer.contains("OK"), "ACL SETUSER answered {answer:?}");
}

fn cluster_with_user(rules: &str) -> RedisCluster {
    let cluster = RedisCluster::start(3);
    cluster.nodes.iter().for_each(|node| add_user(node, rules));
    cluster
}

/// A primary, a replica (both with the user) and sentinels that want
/// `SENTINEL_PASSWORD`.
fn sentinels_with_user() -> RedisSentinels {
    let sentinels = RedisSentinels::start_with(&SentinelOptions {
        sentinel_password: Some(SENTINEL_PASSWORD),
        ..SentinelOptions::default()
    });
    add_user(&sentinels.primary, RULES);
    add_user(&sentinels.replica, RULES);
    sentinels
}

/// The sentinels' URLs with their password (no user: `requirepass`).
fn sentinel_urls(sentinels: &RedisSentinels, password: &str) -> Vec<String> {
    sentinels
        .sentinels
        .iter()
        .map(|sentinel| format!("redis://:{password}@127.0.0.1:{}", sentinel.port()))
        .collect()
}

fn bucket() -> BucketConfig {
    BucketConfig {
        capacity: 10.0,
        initial: 10.0,
        ratio: 0.5,
        min_per_second: 1.0,
        on_unavailable: OnUnavailable::Deny,
        configured: false,
    }
}

async fn store<M: Mode>(
    redis: &RedisServer,
    password: &str,
) -> Result<RedisBudgetStore<M>, String> {
    store_at::<M>(vec![redis.url()], None, password).await
}

/// A store on `urls` (the sentinels' if `sentinel`) as `retryd` with
/// `password`; the error with its cause.
async fn store_at<M: Mode>(
    urls: Vec<String>,
    sentinel: Option<&str>,
    password: &str,
) -> Result<RedisBudgetStore<M>, String> {
    let config = RedisConfig {
        urls: urls.into_iter().map(Into::into).collect(),
        mode: M::MODE,
        timeout: Duration::from_millis(20), // the server's default
        lease_tokens: 2.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: PREFIX.into(),
        access: RedisAccess {
            username: Some("retryd".into()),
            password: Some(RedisPassword::new(password)),
            sentinel: sentinel.map(|master_name| SentinelConfig {
                master_name: master_name.into(),
            }),
            ..RedisAccess::default()
        },
    };
    RedisBudgetStore::connect(&config, 100)
        .await
        .map_err(|error| format!("{error}: {:?}", std::error::Error::source(&error)))
}

/// Every store operation, as the least-privileged user: none is refused
/// (a refusal would show as an error or a fallback).
async fn every_operation_works<M: Mode>(store: &RedisBudgetStore<M>) {
    let config = bucket();
    let name = format!("acl-{:?}", M::MODE);
    // Upstreams in many slots, so that on a Cluster every master runs the
    // scripts as this user.
    for n in 0..12 {
        let upstream = format!("acl-spread-{n}-{:?}", M::MODE);
        assert!(
            store
                .check(&upstream, &config, true)
                .await
                .unwrap()
                .withdrew
        );
    }
    store.admit(&[(&name, &config)]).await.unwrap();
    assert!(store.check(&name, &config, true).await.unwrap().withdrew);
    store.try_withdraw(&name, &config).await.unwrap();
    store.view(&name, &config).await.unwrap();
    store.deposit(&name, &config, 4).await.unwrap();
    assert!(
        store
            .set_retries_enabled(&name, &config, false)
            .await
            .unwrap()
    );
    assert!(
        !store
            .check(&name, &config, true)
            .await
            .unwrap()
            .retries_enabled
    );
    store
        .set_retries_enabled(&name, &config, true)
        .await
        .unwrap();
    let listed = store.list(|_| bucket()).await.unwrap();
    assert!(listed.iter().any(|snapshot| snapshot.upstream == name));
    let claim = store
        .claim_report(&format!("report-{name}"), 7, 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claim, ReportClaim::Fresh);
    store
        .settle_report(&format!("report-{name}"), 7, 1)
        .await
        .unwrap();
    store.shutdown().await;
    let stats = store.stats();
    assert_eq!(
        (stats.backend_errors, stats.fallbacks),
        (0, 0),
        "a command was refused: {stats:?}"
    );
}

#[tokio::test]
async fn a_least_privileged_user_runs_every_operation_and_a_wrong_password_fails_clearly() {
    let redis = redis_with_user();
    let exact = store::<Exact>(&redis, PASSWORD).await.unwrap();
    every_operation_works(&exact).await;
    let leased = store::<Leased>(&redis, PASSWORD).await.unwrap();
    every_operation_works(&leased).await;

    let wrong = "not-the-password-31f";
    let error = match store::<Exact>(&redis, wrong).await {
        Ok(_) => panic!("a wrong password connected"),
        Err(error) => error,
    };
    assert!(
        error.to_lowercase().contains("authentication failed"),
        "the error does not say the credentials are wrong: {error}"
    );
    assert!(
        !error.contains(wrong),
        "the error shows the password: {error}"
    );
}

/// `retryd serve` with this `[store]` and debug logs: its outcome.
fn serve_and_fail(store: &str, env: &[(&str, &str)]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n[telemetry]\nlog_level = \"debug\"\n{store}"
        ),
    )
    .unwrap();
    let mut child = Command::new(binary())
        .args(["serve", "--config", path.to_str().unwrap()])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run retryd");
    let deadline = Instant::now() + support::HANG_GUARD;
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "retryd neither failed nor served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_password_never_appears_in_a_log_line() {
    let redis = redis_with_user();
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("redis-password");
    // As a Kubernetes Secret mounted from `echo`: a trailing newline.
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let store = |mode: &str, password: &str| {
        format!(
            "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"{mode}\"\nkey_prefix = \"{PREFIX}\"\nusername = \"retryd\"\n{password}\n",
            redis.url()
        )
    };
    let from_file = format!("password_file = \"{}\"", password_file.display());
    let from_env = "password_env = \"RETRYD_TEST_REDIS_PASSWORD\"".to_owned();
    for (mode, password, env) in [
        ("exact", from_file.clone(), vec![]),
        (
            "leased",
            from_env.clone(),
            vec![("RETRYD_TEST_REDIS_PASSWORD", PASSWORD)],
        ),
    ] {
        let mut server = Server::start_with_env(
            &format!(
                "[telemetry]\nlog_level = \"debug\"\n[defaults]\nbudget = {{ capacity = 100.0, initial = 10.0, ratio = 1.0, min_per_second = 0.0 }}\n{}",
                store(mode, &password)
            ),
            &env,
        );
        let mut decider = server.decider().await;
        for _ in 0..5 {
            let answer = decider
                .decide(retryable("acl-upstream"))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(answer.verdict, pb::Verdict::Retry as i32, "{answer:?}");
        }
        server.terminate(Duration::from_secs(5));
        let logs = server.logs();
        assert!(logs.contains("Redis"), "no Redis log line at all:\n{logs}");
        assert!(
            !logs.contains(PASSWORD),
            "{mode}: a log line shows the password:\n{logs}"
        );
    }
    // A wrong password: startup fails, saying so, without the password.
    let wrong = "wrong-password-5e2b";
    std::fs::write(&password_file, wrong).unwrap();
    let (served, stderr) = serve_and_fail(&store("exact", &from_file), &[]);
    assert!(!served, "served with a wrong password");
    assert!(
        stderr.to_lowercase().contains("authentication failed"),
        "the failure does not say the credentials are wrong:\n{stderr}"
    );
    assert!(stderr.contains("store.url"), "{stderr}");
    assert!(
        !stderr.contains(wrong),
        "the failure shows the password:\n{stderr}"
    );
    assert!(!stderr.contains(PASSWORD), "{stderr}");
}

/// A wrong password's error: it says the credentials are wrong, and shows
/// no password.
fn assert_refused_clearly(error: &str, wrong: &str) {
    assert!(
        error.to_lowercase().contains("authentication failed"),
        "the error does not say the credentials are wrong: {error}"
    );
    assert!(
        !error.contains(wrong) && !error.contains(PASSWORD) && !error.contains(SENTINEL_PASSWORD),
        "the error shows a password: {error}"
    );
}

#[tokio::test]
async fn on_a_cluster_the_least_privileged_user_runs_every_operation_on_every_master() {
    let cluster = cluster_with_user(RULES);
    let exact = store_at::<Exact>(cluster.urls(), None, PASSWORD)
        .await
        .unwrap();
    every_operation_works(&exact).await;
    let leased = store_at::<Leased>(cluster.urls(), None, PASSWORD)
        .await
        .unwrap();
    every_operation_works(&leased).await;
    // Every master ran the scripts as `retryd`, not only the first node.
    for node in &cluster.nodes {
        let stats = node.cli(&["INFO", "commandstats"]);
        assert!(stats.contains("cmdstat_evalsha"), "a master ran no script");
    }

    let wrong = "not-the-password-9d1";
    let error = match store_at::<Exact>(cluster.urls(), None, wrong).await {
        Ok(_) => panic!("a wrong password connected to the Cluster"),
        Err(error) => error,
    };
    println!("Cluster, wrong password: {error}");
    assert_refused_clearly(&error, wrong);
}

#[tokio::test]
async fn on_a_cluster_the_user_needs_cluster_slots() {
    // The README's ACL without `+cluster|slots`: the Cluster client cannot
    // learn which node serves which slot, so retryd cannot connect.
    let without = RULES.replace(" +cluster|slots", "");
    let cluster = cluster_with_user(&without);
    let error = match store_at::<Exact>(cluster.urls(), None, PASSWORD).await {
        Ok(_) => panic!("connected to a Cluster without +cluster|slots"),
        Err(error) => error,
    };
    println!("Cluster without +cluster|slots: {error}");
    assert!(
        error.contains("cluster|slots"),
        "the error does not name the missing permission: {error}"
    );
}

#[tokio::test]
async fn under_sentinel_the_user_runs_every_operation_and_the_sentinels_password_comes_from_their_urls()
 {
    let sentinels = sentinels_with_user();
    let master = Some(RedisSentinels::MASTER_NAME);
    let urls = sentinel_urls(&sentinels, SENTINEL_PASSWORD);
    let exact = store_at::<Exact>(urls.clone(), master, PASSWORD)
        .await
        .unwrap();
    every_operation_works(&exact).await;
    let leased = store_at::<Leased>(urls.clone(), master, PASSWORD)
        .await
        .unwrap();
    every_operation_works(&leased).await;
    let scripts = sentinels.primary.cli(&["INFO", "commandstats"]);
    assert!(
        scripts.contains("cmdstat_evalsha"),
        "the primary ran no script"
    );

    // A wrong password for the data nodes, then for the sentinels.
    let wrong = "not-the-password-2c7";
    let error = match store_at::<Exact>(urls, master, wrong).await {
        Ok(_) => panic!("a wrong data-node password connected"),
        Err(error) => error,
    };
    println!("Sentinel, wrong data-node password: {error}");
    assert_refused_clearly(&error, wrong);
    assert!(
        error.contains("data nodes' credentials") && !error.contains("sentinels' URLs"),
        "the error does not say the data nodes refused: {error}"
    );
    let data_node_error = error;
    let error = match store_at::<Exact>(sentinel_urls(&sentinels, wrong), master, PASSWORD).await {
        Ok(_) => panic!("a wrong sentinel password connected"),
        Err(error) => error,
    };
    println!("Sentinel, wrong sentinel password: {error}");
    assert_refused_clearly(&error, wrong);
    assert!(
        error.contains("sentinels' URLs") && !error.contains("data nodes' credentials"),
        "the error does not say a sentinel refused: {error}"
    );
    assert_ne!(error, data_node_error);
}

/// `retryd serve` on `store`, 5 decisions that must be RETRY, and its log.
async fn serve_decide_and_log(store: &str, env: &[(&str, &str)]) -> String {
    let mut server = Server::start_with_env(
        &format!(
            "[telemetry]\nlog_level = \"debug\"\n[defaults]\nbudget = {{ capacity = 100.0, initial = 10.0, ratio = 1.0, min_per_second = 0.0 }}\n{store}"
        ),
        env,
    );
    let mut decider = server.decider().await;
    for _ in 0..5 {
        let answer = decider
            .decide(retryable("acl-upstream"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.verdict, pb::Verdict::Retry as i32, "{answer:?}");
    }
    server.terminate(Duration::from_secs(5));
    server.logs()
}

#[tokio::test]
async fn on_a_cluster_and_under_sentinel_no_password_appears_in_a_log_line() {
    let cluster = cluster_with_user(RULES);
    let sentinels = sentinels_with_user();
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("redis-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let toml_list = |urls: &[String]| {
        urls.iter()
            .map(|url| format!("\"{url}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let store = |urls: &[String], extra: &str| {
        format!(
            "[store]\nkind = \"redis\"\nurl = [{}]\nmode = \"exact\"\nkey_prefix = \"{PREFIX}\"\nusername = \"retryd\"\npassword_file = \"{}\"\n{extra}",
            toml_list(urls),
            password_file.display()
        )
    };
    let on_cluster = store(&cluster.urls(), "");
    let sentinel_table = format!(
        "sentinel = {{ master_name = \"{}\" }}\n",
        RedisSentinels::MASTER_NAME
    );
    let on_sentinels = store(
        &sentinel_urls(&sentinels, SENTINEL_PASSWORD),
        &sentinel_table,
    );
    for (topology, store) in [("Cluster", &on_cluster), ("Sentinel", &on_sentinels)] {
        let logs = serve_decide_and_log(store, &[]).await;
        assert!(logs.contains("Redis"), "no Redis log line at all:\n{logs}");
        assert!(
            !logs.contains(PASSWORD) && !logs.contains(SENTINEL_PASSWORD),
            "{topology}: a log line shows a password:\n{logs}"
        );
        if topology == "Sentinel" {
            // The sentinels' URLs, which carry their password, are logged
            // redacted.
            assert!(logs.contains("redis://***@127.0.0.1"), "{logs}");
        }
    }
    // A wrong data-node password: startup fails, saying so, without it.
    let wrong = "wrong-password-8f3a";
    std::fs::write(&password_file, wrong).unwrap();
    for (topology, store) in [("Cluster", &on_cluster), ("Sentinel", &on_sentinels)] {
        let (served, stderr) = serve_and_fail(store, &[]);
        assert!(!served, "{topology}: served with a wrong password");
        assert_refused_clearly(&stderr, wrong);
        assert!(stderr.contains("store.url"), "{topology}: {stderr}");
    }
}

/// Resharding needs `+asking`: with a report id's slot half moved (the
/// target importing it, the source migrating it), the source redirects a
/// new id's claim by ASK, and the target serves it only after `ASKING`.
/// With the README's ACL (which has `+asking`) the claim lands on the
/// target; without `+asking` the target refuses `ASKING`, answers MOVED
/// back to the source, and the claim fails (a report then is not
/// deduplicated, which its caller sees as an error, never as a double
/// count).
#[tokio::test]
async fn on_a_cluster_resharding_needs_asking() {
    for (rules, works) in [
        (RULES.to_owned(), true),
        (RULES.replace(" +asking", ""), false),
    ] {
        let mut cluster = cluster_with_user(&rules);
        let store = store_at::<Exact>(cluster.urls(), None, PASSWORD)
            .await
            .unwrap();
        let id = "reshard-report-1";
        let key = format!("{PREFIX}:{{r:{id}}}:report");
        let source = cluster.master_of(&key).expect("a master serves the slot");
        let target = (source + 1) % cluster.nodes.len();
        let slot = cluster.nodes[source].cli(&["CLUSTER", "KEYSLOT", &key]);
        let slot = slot.trim();
        let id_of = |node: usize| {
            cluster.nodes[node]
                .cli(&["CLUSTER", "MYID"])
                .trim()
                .to_owned()
        };
        let (source_id, target_id) = (id_of(source), id_of(target));
        for (node, arguments) in [
            (
                target,
                ["CLUSTER", "SETSLOT", slot, "IMPORTING", source_id.as_str()],
            ),
            (
                source,
                ["CLUSTER", "SETSLOT", slot, "MIGRATING", target_id.as_str()],
            ),
        ] {
            let answer = cluster.nodes[node].cli(&arguments);
            assert!(answer.contains("OK"), "{arguments:?}: {answer}");
        }
        let claim = store.claim_report(id, 7, 1, Duration::from_secs(60)).await;
        println!(
            "ACL {}: claim during the move: {claim:?}",
            if works {
                "with +asking"
            } else {
                "without +asking"
            }
        );
        if works {
            assert_eq!(claim.unwrap(), ReportClaim::Fresh);
            let asked = cluster.nodes[target].cli(&["INFO", "commandstats"]);
            assert!(
                asked.contains("cmdstat_asking"),
                "no ASKING reached the target"
            );
            let on = |node: usize| {
                let count = cluster.nodes[node].cli(&["CLUSTER", "COUNTKEYSINSLOT", slot]);
                count.trim().to_owned()
            };
            assert_eq!(
                (on(source), on(target)),
                ("0".into(), "1".into()),
                "the claim is not on the target"
            );
        } else {
            assert!(claim.is_err(), "claimed without +asking: {claim:?}");
        }
        store.shutdown().await;
    }
}
