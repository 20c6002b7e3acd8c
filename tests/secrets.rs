//! Secrets stay out of what retryd prints, against the real binary.
//!
//! The Redis password in `store.url` must never reach stdout, stderr or a
//! gRPC status message, on every path that shows a URL or the configuration
//! line it is written on: the startup log, a failed connection at startup,
//! `check-config`, a TOML syntax error (at startup and on a reload, by SIGHUP
//! or `RetryAdmin/ReloadConfig`) and `RETRYD__` overrides. Each output must
//! still say where the problem is (the key, the line, the host).
//!
//! And `retryd hash-key` must hash a key exactly as the server does when a
//! caller presents it, and refuse a key no `authorization` header can carry.
//!
//! The Redis cases start their own `redis-server` and fail, never skip, when
//! it cannot be started.

use retryd_testkit as support;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use retryd_proto as pb;
use support::redis::RedisServer;
use support::{Server, binary, retryable};
use tonic::Code;

/// What the tests put in every URL and look for in every output.
const PASSWORD: &str = "hunter2-secret-9f3a";

/// Ephemeral loopback ports, so that `serve` can run anywhere.
const HEAD: &str = "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nshutdown_grace = \"2s\"\n";

fn assert_hidden(what: &str, text: &str) {
    assert!(
        !text.contains(PASSWORD),
        "{what} shows the password:\n{text}"
    );
}

fn assert_mentions(what: &str, text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            text.contains(needle),
            "{what} does not say {needle:?}:\n{text}"
        );
    }
}

/// A standalone Redis that requires [`PASSWORD`].
fn redis_with_password(password: &str) -> RedisServer {
    let redis = RedisServer::start();
    let answer = redis.cli(&["CONFIG", "SET", "requirepass", password]);
    assert!(
        answer.contains("OK"),
        "CONFIG SET requirepass answered {answer:?}"
    );
    redis
}

fn redis_url(port: u16) -> String {
    format!("redis://:{PASSWORD}@127.0.0.1:{port}")
}

/// What a finished `retryd` run printed.
struct Run {
    success: bool,
    stdout: String,
    stderr: String,
}

impl Run {
    fn assert_hidden(&self, what: &str) {
        assert_hidden(&format!("{what} (stdout)"), &self.stdout);
        assert_hidden(&format!("{what} (stderr)"), &self.stderr);
    }
}

/// Runs `retryd arguments…` with `env` and `stdin` to completion (at most
/// 30 s), capturing both outputs.
fn run(arguments: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let mut command = Command::new(binary());
    command
        .args(arguments)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("run retryd");
    let mut input = child.stdin.take().expect("piped stdin");
    input.write_all(stdin).expect("write stdin");
    drop(input);
    let reader = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = reader(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = reader(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + support::HANG_GUARD;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for retryd") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "retryd {arguments:?} did not exit within {:?}",
                support::HANG_GUARD
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        success: status.success(),
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

/// `retryd check-config` of `toml`, with `env`.
fn check_config(toml: &str, env: &[(&str, &str)]) -> Run {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("retryd.toml");
    std::fs::write(&path, toml).expect("write config");
    run(
        &["check-config", path.to_str().expect("UTF-8 path")],
        env,
        b"",
    )
}

/// Replaces a file atomically, so that a reload never reads half of it.
fn replace(path: &Path, text: &str) {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).expect("write config");
    std::fs::rename(&temporary, path).expect("rename config");
}

/// Waits until `server` has logged `needle` at least `count` times.
fn wait_for_log(server: &Server, needle: &str, count: usize) -> String {
    let deadline = Instant::now() + support::HANG_GUARD;
    loop {
        let logs = server.logs();
        if logs.matches(needle).count() >= count {
            return logs;
        }
        assert!(
            Instant::now() < deadline,
            "retryd never logged {needle:?} {count} times:\n{logs}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn serving_and_reloading_never_show_the_redis_password() {
    let redis = redis_with_password(PASSWORD);
    let host = format!("127.0.0.1:{}", redis.port());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    let good = format!(
        "{HEAD}[store]\nkind = \"redis\"\nurl = \"{}\"\n",
        redis_url(redis.port())
    );
    std::fs::write(&path, &good).unwrap();
    let server = Server::start_file(&path);

    // The password was used: the store answers with a shared budget.
    let answer = server
        .decider()
        .await
        .decide(retryable("orders"))
        .await
        .expect("a decision through the password-protected Redis")
        .into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Retry, "{answer:?}");

    // The startup info line names the store, without the password.
    let logs = wait_for_log(&server, "budgets shared through Redis", 1);
    assert_mentions("the startup log", &logs, &[&host]);
    assert_hidden("the startup log", &logs);

    // Reloads of broken files: each refusal is logged (SIGHUP) and returned
    // (ReloadConfig), and must say where without quoting the secret.
    let broken = [
        (
            "a TOML syntax error on the URL's line",
            format!(
                "{HEAD}[store]\nkind = \"redis\"\nurl = \"{}\n",
                redis_url(redis.port())
            ),
            vec!["store.url", "line 7"],
        ),
        (
            "a TOML syntax error on a password-like line",
            format!("{HEAD}[store]\nkind = \"redis\"\npassword = \"{PASSWORD}\n"),
            vec!["line 7"],
        ),
        (
            "a URL that is not redis://",
            format!("{HEAD}[store]\nkind = \"redis\"\nurl = \"http://:{PASSWORD}@{host}\"\n"),
            vec!["store.url", &host],
        ),
    ];
    let mut admin = server.admin().await;
    for (refusals, (what, text, needles)) in broken.iter().enumerate() {
        replace(&path, text);
        server.signal("HUP");
        // Each SIGHUP refusal is one line.
        let logs = wait_for_log(&server, "configuration reload refused", 2 * refusals + 1);
        assert_hidden(&format!("the log of a SIGHUP reload with {what}"), &logs);
        let status = admin
            .reload_config(pb::ReloadConfigRequest {})
            .await
            .expect_err("a broken file is refused");
        assert_eq!(
            status.code(),
            Code::FailedPrecondition,
            "{what}: {status:?}"
        );
        let message = status.message();
        assert_hidden(&format!("ReloadConfig's status with {what}"), message);
        assert_mentions(
            &format!("ReloadConfig's status with {what}"),
            message,
            needles,
        );
        let logs = wait_for_log(&server, "configuration reload refused", 2 * refusals + 2);
        assert_hidden(&format!("the log of ReloadConfig with {what}"), &logs);
    }

    // The running configuration stayed, and a good file reloads again.
    replace(&path, &good);
    admin
        .reload_config(pb::ReloadConfigRequest {})
        .await
        .expect("the good file reloads");
    assert_hidden("the whole log", &server.logs());
}

#[tokio::test]
async fn an_environment_override_url_is_logged_without_the_password() {
    let redis = redis_with_password(PASSWORD);
    let url = redis_url(redis.port());
    let server = Server::start_with_env(
        "[store]\nkind = \"redis\"\n",
        &[("RETRYD__STORE__URL", &url)],
    );
    server
        .decider()
        .await
        .decide(retryable("orders"))
        .await
        .expect("a decision through the password-protected Redis");
    let logs = wait_for_log(&server, "budgets shared through Redis", 1);
    assert_mentions(
        "the startup log",
        &logs,
        &[&format!("127.0.0.1:{}", redis.port())],
    );
    assert_hidden("the startup log", &logs);
}

#[test]
fn an_otlp_endpoint_is_logged_without_its_credentials() {
    // Not the Redis password, but the same kind of line: a URL at startup.
    let server = Server::start(&format!(
        "[telemetry]\notlp_endpoint = \"http://otel:{PASSWORD}@127.0.0.1:9\"\n"
    ));
    let logs = wait_for_log(&server, "exporting decision spans", 1);
    assert_mentions("the startup log", &logs, &["127.0.0.1:9"]);
    assert_hidden("the startup log", &logs);
}

#[test]
fn failed_connections_at_startup_never_show_the_redis_password() {
    // Redis down: a port that was just freed.
    let mut down = RedisServer::start();
    let down_port = down.port();
    down.kill();
    // Redis up, refusing this password.
    let refusing = redis_with_password("not-the-password-we-send");
    let cases = [
        ("Redis down", down_port),
        ("Redis refusing the password", refusing.port()),
    ];
    for (what, port) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("retryd.toml");
        std::fs::write(
            &path,
            format!(
                "{HEAD}[store]\nkind = \"redis\"\nurl = \"{}\"\n",
                redis_url(port)
            ),
        )
        .unwrap();
        let serve = run(&["serve", "--config", path.to_str().unwrap()], &[], b"");
        assert!(!serve.success, "{what}: retryd started:\n{}", serve.stderr);
        serve.assert_hidden(what);
        assert_mentions(
            what,
            &serve.stderr,
            &["store.url", &format!("127.0.0.1:{port}")],
        );
    }
    // A URL without a host (the password where the port would be).
    let no_host = format!("{HEAD}[store]\nkind = \"redis\"\nurl = \"redis://:{PASSWORD}\"\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    std::fs::write(&path, no_host).unwrap();
    let serve = run(&["serve", "--config", path.to_str().unwrap()], &[], b"");
    assert!(!serve.success, "a URL without a host was served");
    serve.assert_hidden("a URL without a host");
    assert_mentions("a URL without a host", &serve.stderr, &["store.url"]);
}

/// What is wrong, the TOML, the `RETRYD__` variables, and what the error
/// must still say.
type Case = (
    &'static str,
    String,
    Vec<(&'static str, String)>,
    Vec<String>,
);

#[test]
fn configuration_errors_never_show_the_redis_password() {
    let url_of = |url: &str| format!("[store]\nkind = \"redis\"\nurl = {url}\n");
    let cases: Vec<Case> = vec![
        (
            "a URL that is not redis://",
            url_of(&format!("\"http://:{PASSWORD}@cache.internal:6379\"")),
            vec![],
            vec!["store.url".into(), "cache.internal:6379".into()],
        ),
        (
            "a rediss:// URL whose CA file cannot be read",
            format!(
                "[store]\nkind = \"redis\"\nurl = \"rediss://user:{PASSWORD}@cache.internal:6380\"\n[store.tls]\nca_file = \"/nonexistent-ca.pem\"\n"
            ),
            vec![],
            vec!["store.tls.ca_file".into(), "/nonexistent-ca.pem".into()],
        ),
        (
            "a password given twice (store.password and store.password_file)",
            format!(
                "[store]\nkind = \"redis\"\nurl = \"redis://cache.internal:6379\"\npassword = \"{PASSWORD}\"\npassword_file = \"/run/secrets/redis\"\n"
            ),
            vec![],
            vec!["store.password".into(), "at most one".into()],
        ),
        (
            "store.tls with redis:// URLs",
            format!(
                "[store]\nkind = \"redis\"\nurl = \"redis://:{PASSWORD}@cache.internal:6379\"\n[store.tls]\ninsecure_skip_verify = true\n"
            ),
            vec![],
            vec!["store.tls".into(), "rediss://".into()],
        ),
        (
            "a cluster list with one bad URL",
            url_of(&format!(
                "[\"redis://:{PASSWORD}@a.internal:7000\", \"http://:{PASSWORD}@b.internal:7000\"]"
            )),
            vec![],
            vec!["store.url".into(), "b.internal:7000".into()],
        ),
        (
            "a URL without a host",
            url_of(&format!("\"redis://:{PASSWORD}\"")),
            vec![],
            vec!["store.url".into()],
        ),
        (
            "a TOML syntax error on the URL's line",
            url_of(&format!("\"redis://:{PASSWORD}@cache.internal:6379")),
            vec![],
            vec!["store.url".into(), "line 3".into()],
        ),
        (
            "a TOML syntax error in a cluster list",
            format!(
                "[store]\nkind = \"redis\"\nurl = [\n  \"redis://:{PASSWORD}@a.internal:7000\",\n  \"redis://:{PASSWORD}@b.internal:7000\n]\n"
            ),
            vec![],
            vec!["store".into(), "line 5".into()],
        ),
        (
            "a TOML syntax error on a password-like key",
            format!("[store]\nkind = \"redis\"\npassword = '{PASSWORD}\n"),
            vec![],
            vec!["line 3".into()],
        ),
        (
            "the password alone on a line",
            format!("[store]\nkind = \"redis\"\n{PASSWORD}\n"),
            vec![],
            vec!["line 3".into()],
        ),
        (
            "a URL under a key of another type",
            format!(
                "[server]\nallow_unauthenticated = \"redis://:{PASSWORD}@cache.internal:6379\"\n"
            ),
            vec![],
            vec!["server.allow_unauthenticated".into()],
        ),
        (
            "RETRYD__STORE__URL with rediss:// and a missing password variable",
            String::new(),
            vec![
                ("RETRYD__STORE__KIND", "redis".into()),
                (
                    "RETRYD__STORE__URL",
                    format!("rediss://:{PASSWORD}@cache.internal:6380"),
                ),
                (
                    "RETRYD__STORE__PASSWORD_ENV",
                    "RETRYD_TEST_NO_SUCH_VARIABLE".into(),
                ),
            ],
            vec![
                "store.password_env".into(),
                "RETRYD_TEST_NO_SUCH_VARIABLE".into(),
            ],
        ),
        (
            "RETRYD__STORE__URL that is not redis://",
            String::new(),
            vec![
                ("RETRYD__STORE__KIND", "redis".into()),
                (
                    "RETRYD__STORE__URL",
                    format!("https://:{PASSWORD}@cache.internal:6379"),
                ),
            ],
            vec!["store.url".into(), "cache.internal:6379".into()],
        ),
        (
            "a URL in a RETRYD__ variable of another type",
            String::new(),
            vec![(
                "RETRYD__SERVER__ALLOW_UNAUTHENTICATED",
                format!("redis://:{PASSWORD}@cache.internal:6379"),
            )],
            vec!["server.allow_unauthenticated".into()],
        ),
    ];
    for (what, toml, env, needles) in &cases {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        let checked = check_config(toml, &env);
        assert!(!checked.success, "check-config accepted {what}");
        checked.assert_hidden(&format!("check-config with {what}"));
        assert_mentions(
            &format!("check-config with {what}"),
            &checked.stderr,
            &needles,
        );

        // `serve` loads the same way and must print the same redacted error.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("retryd.toml");
        std::fs::write(&path, format!("{HEAD}{toml}")).unwrap();
        let serve = run(&["serve", "--config", path.to_str().unwrap()], &env, b"");
        assert!(!serve.success, "serve accepted {what}");
        serve.assert_hidden(&format!("serve with {what}"));
    }

    // A good configuration with a password checks quietly.
    let checked = check_config(
        &url_of(&format!("\"redis://:{PASSWORD}@cache.internal:6379\"")),
        &[],
    );
    assert!(checked.success, "{}", checked.stderr);
    checked.assert_hidden("check-config of a good file");
}

/// The hex SHA-256 `retryd hash-key` prints for `stdin`.
fn hash_key(stdin: &str) -> Run {
    run(&["hash-key"], &[], stdin.as_bytes())
}

#[tokio::test]
async fn hash_key_and_the_server_agree_on_surrounding_whitespace() {
    const KEY: &str = "checkout-key-0123456789";
    let hashed = hash_key(&format!("{KEY} \n"));
    assert!(hashed.success, "{}", hashed.stderr);
    let hex = hashed.stdout.trim();
    assert_eq!(hex.len(), 64, "{hex:?}");
    for padded in [format!("{KEY}\t\r\n"), format!("  {KEY}"), KEY.to_owned()] {
        let again = hash_key(&padded);
        assert!(again.success, "{}", again.stderr);
        assert_eq!(again.stdout.trim(), hex, "hash-key of {padded:?}");
    }

    let server = Server::start(&format!(
        "[[auth.principals]]\nname = \"checkout\"\napi_keys_sha256 = [\"{hex}\"]\nupstreams = [\"*\"]\n"
    ));
    let mut request = tonic::Request::new(retryable("orders"));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {KEY}").parse().expect("header value"),
    );
    let answer = server
        .decider()
        .await
        .decide(request)
        .await
        .expect("the key hash-key hashed is accepted");
    assert_eq!(answer.into_inner().verdict(), pb::Verdict::Retry);
}

#[test]
fn hash_key_refuses_keys_a_header_cannot_carry_as_typed() {
    let cases = [
        (
            "interior whitespace",
            "checkout key 0123456789\n",
            "printable ASCII",
        ),
        (
            "a tab inside",
            "checkout\tkey-0123456789\n",
            "printable ASCII",
        ),
        (
            "a control character",
            "checkout\u{1b}key-0123456789\n",
            "printable ASCII",
        ),
        (
            "non-ASCII",
            "checkout-schlüssel-0123456789\n",
            "printable ASCII",
        ),
        ("too short", "short-key\n", "16"),
        ("nothing", "\n", "16"),
    ];
    for (what, stdin, needle) in cases {
        let hashed = hash_key(stdin);
        assert!(!hashed.success, "hash-key accepted a key with {what}");
        assert!(hashed.stdout.is_empty(), "{what}: {}", hashed.stdout);
        assert_mentions(&format!("hash-key with {what}"), &hashed.stderr, &[needle]);
    }
    let help = run(&["hash-key", "--help"], &[], b"");
    assert!(help.success);
    assert_mentions(
        "hash-key --help",
        &help.stdout,
        &["printable ASCII", "SHA-256", "trimmed", "lower-case hex"],
    );
}
