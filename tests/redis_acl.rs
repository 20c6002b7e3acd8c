//! Redis ACL users: retryd works as a user with a password and only the
//! commands it needs (the ACL below is the one README.md states); a wrong
//! password fails startup clearly; the password never appears in any log
//! line, whether given in the TOML, a file or an environment variable.

use retryd_testkit as support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use retryd_budget::redis::{Exact, Leased, Mode, RedisAccess, RedisConfig, RedisPassword};
use retryd_budget::{BucketConfig, BudgetStore, OnUnavailable, RedisBudgetStore, ReportClaim};
use retryd_proto as pb;
use support::redis::RedisServer;
use support::{Server, binary, retryable};

const PASSWORD: &str = "acl-secret-7c1e9d";
const PREFIX: &str = "aclretryd";

/// The least privileges retryd needs, as README.md states them: its own
/// keys, the scripts, and the commands those scripts and the store run.
fn acl(prefix: &str, password: &str) -> Vec<String> {
    let rules = "-@all +evalsha +script|load +info \
                 +zadd +zrangebyscore +set +time +hmget +hset +exists \
                 +pexpire +persist +pttl +del +get +zcard +zrange +zrem +zremrangebyscore \
                 +zscore +role";
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
    let arguments = acl(PREFIX, PASSWORD);
    let arguments: Vec<&str> = arguments.iter().map(String::as_str).collect();
    let answer = redis.cli(&arguments);
    assert!(answer.contains("OK"), "ACL SETUSER answered {answer:?}");
    redis
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
    let config = RedisConfig {
        urls: vec![redis.url().into()],
        mode: M::MODE,
        timeout: Duration::from_millis(500),
        lease_tokens: 2.0,
        max_lease_tokens: 1000.0,
        lease_ttl: Duration::from_secs(2),
        key_prefix: PREFIX.into(),
        access: RedisAccess {
            username: Some("retryd".into()),
            password: Some(RedisPassword::new(password)),
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
    let deadline = Instant::now() + Duration::from_secs(30);
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
            "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"{mode}\"\ntimeout = \"500ms\"\nkey_prefix = \"{PREFIX}\"\nusername = \"retryd\"\n{password}\n",
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
