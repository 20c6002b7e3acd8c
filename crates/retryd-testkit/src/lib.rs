//! Shared helpers for black-box tests of every crate: start the real
//! `retryd` binary on a loopback port with a given configuration, and talk
//! gRPC to it; start real `redis-server` processes ([`redis`]).
//!
//! The binary is `RETRYD_BIN` when set (`scripts/test` sets it), else the
//! `retryd` beside the running test in cargo's target directory, which
//! `cargo test` builds for the server's own tests.

pub mod clock;
pub mod redis;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tonic::transport::Channel;
pub use tonic_health::pb::health_check_response::ServingStatus;

/// How long a test waits for a state it expects to reach before failing:
/// a guard against a hang, never a latency claim (those are made on a
/// paused clock, see [`clock`]), so long that a loaded machine never hits it.
pub const HANG_GUARD: Duration = Duration::from_secs(30);

/// Polls `probe` every 20 ms until it returns `Some`, for up to
/// [`HANG_GUARD`]; then fails naming `what`. The one way a test waits for
/// a state instead of sleeping and hoping it was reached.
pub async fn eventually<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "{what}: not reached within {HANG_GUARD:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running `retryd serve`, killed when dropped.
pub struct Server {
    child: Option<Child>,
    /// The gRPC address it bound.
    pub grpc: SocketAddr,
    /// The metrics address it bound.
    pub metrics: SocketAddr,
    stderr_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The path of the binary under test.
pub fn binary() -> &'static str {
    static BINARY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BINARY.get_or_init(|| {
        if let Ok(path) = std::env::var("RETRYD_BIN") {
            return path;
        }
        // target/debug/deps/<test>-<hash> → target/debug/retryd
        let test = std::env::current_exe().expect("the test's own path");
        let beside = test
            .parent()
            .and_then(|deps| deps.parent())
            .map(|profile| profile.join("retryd"))
            .filter(|path| path.exists())
            .unwrap_or_else(|| {
                panic!(
                    "no retryd binary beside {}: build it (cargo build --bin retryd) or set RETRYD_BIN",
                    test.display()
                )
            });
        beside.display().to_string()
    })
}

/// What `retryd --version` says of the binary under test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildIdentity {
    /// The package version.
    pub version: String,
    /// The git revision (12 hex digits) or `unknown`.
    pub revision: String,
    /// The Cargo profile.
    pub profile: String,
}

/// Runs `retryd --version` and reads `retryd 0.1.0 (revision R, PROFILE)`.
pub fn build_identity() -> BuildIdentity {
    let output = Command::new(binary())
        .arg("--version")
        .output()
        .expect("retryd --version runs");
    assert!(output.status.success(), "retryd --version failed");
    let text = String::from_utf8(output.stdout).expect("UTF-8");
    let parse = || -> Option<BuildIdentity> {
        let rest = text.trim().strip_prefix("retryd ")?;
        let (version, rest) = rest.split_once(" (revision ")?;
        let (revision, rest) = rest.split_once(", ")?;
        let profile = rest.strip_suffix(')')?;
        Some(BuildIdentity {
            version: version.to_owned(),
            revision: revision.to_owned(),
            profile: profile.to_owned(),
        })
    };
    parse().unwrap_or_else(|| panic!("retryd --version printed {text:?}"))
}

/// `retryd replay --json --config CONFIG LOG`, parsed; panics with its
/// stderr if it fails.
pub fn replay_json(config: &std::path::Path, log: &std::path::Path) -> serde_json::Value {
    let output = Command::new(binary())
        .args(["replay", "--json", "--config"])
        .arg(config)
        .arg(log)
        .output()
        .expect("retryd replay runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("replay prints JSON")
}

/// A configuration file with the decision log on, in a directory of its
/// own that outlives the server: a test reads the log, and replays it,
/// after the server has stopped and flushed it.
pub struct LoggedConfig {
    /// Holds the files; removed when this is dropped.
    pub dir: tempfile::TempDir,
    /// The configuration: loopback ports, `[decision_log]`, then `extra`.
    pub config: std::path::PathBuf,
    /// The decision log it writes.
    pub log: std::path::PathBuf,
}

impl LoggedConfig {
    /// Writes the configuration, `extra` (policies, store) after the
    /// server and decision-log sections.
    pub fn new(extra: &str) -> LoggedConfig {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("decisions.jsonl");
        let config = dir.path().join("retryd.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n\
                 [decision_log]\npath = {:?}\n{extra}",
                log.display().to_string()
            ),
        )
        .expect("write config");
        LoggedConfig { dir, config, log }
    }

    /// The log's decision lines, once there are `count` of them: the writer
    /// thread appends them a moment after each answer (it naps between
    /// batches), so a test that reads right after its last call waits.
    pub async fn decisions(&self, count: usize) -> Vec<serde_json::Value> {
        eventually(&format!("{count} decision lines in the log"), || {
            let lines: Vec<serde_json::Value> = std::fs::read_to_string(&self.log)
                .ok()?
                .lines()
                .filter_map(|line| serde_json::from_str(line).ok())
                .filter(|line: &serde_json::Value| line["kind"] == "decision")
                .collect();
            (lines.len() >= count).then_some(lines)
        })
        .await
    }
}

impl Server {
    /// Starts retryd with `extra` appended to a configuration that listens
    /// on ephemeral loopback ports.
    pub fn start(extra: &str) -> Server {
        Server::start_with_env(extra, &[])
    }

    /// Like [`Server::start`], with extra environment variables.
    pub fn start_with_env(extra: &str, env: &[(&str, &str)]) -> Server {
        Server::start_config(&[], extra, env)
    }

    /// Like [`Server::start`], with retryd run by `wrapper` (a program and
    /// its arguments, e.g. `valgrind --tool=none`).
    pub fn start_under(wrapper: &[&str], extra: &str) -> Server {
        Server::start_config(wrapper, extra, &[])
    }

    fn start_config(wrapper: &[&str], extra: &str, env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("retryd.toml");
        let has_server = extra.contains("[server]");
        let config = if has_server {
            extra.to_owned()
        } else {
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\nshutdown_grace = \"2s\"\n{extra}"
            )
        };
        std::fs::write(&config_path, config).expect("write config");
        Server::spawn(wrapper, &config_path, env, dir)
    }

    /// Starts retryd on an existing configuration file (which must listen
    /// on loopback ports), e.g. one the test rewrites to reload.
    pub fn start_file(config_path: &std::path::Path) -> Server {
        Server::spawn(
            &[],
            config_path,
            &[],
            tempfile::tempdir().expect("temp dir"),
        )
    }

    fn spawn(
        wrapper: &[&str],
        config_path: &std::path::Path,
        env: &[(&str, &str)],
        dir: tempfile::TempDir,
    ) -> Server {
        let stderr_path = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let mut command = match wrapper {
            [] => Command::new(binary()),
            [program, arguments @ ..] => {
                let mut command = Command::new(program);
                command.args(arguments).arg(binary());
                command
            }
        };
        command
            .args(["serve", "--config"])
            .arg(config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", command.get_program()));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(HANG_GUARD).unwrap_or_default();
        if line.is_empty() {
            let _ = child.kill();
            let mut log = String::new();
            let _ = std::fs::File::open(&stderr_path).and_then(|mut f| f.read_to_string(&mut log));
            panic!("retryd did not start: {log}");
        }
        let ready: serde_json::Value = serde_json::from_str(&line).expect("ready line is JSON");
        let addr = |key: &str| {
            ready[key]
                .as_str()
                .expect("address")
                .parse()
                .expect("socket address")
        };
        Server {
            grpc: addr("grpc"),
            metrics: addr("metrics"),
            child: Some(child),
            stderr_path,
            _dir: dir,
        }
    }

    /// A channel to the gRPC port.
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to retryd")
    }

    /// What the gRPC health service says of `service` ("" for the server).
    pub async fn health(&self, service: &str) -> Result<ServingStatus, tonic::Status> {
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
        let answer = HealthClient::new(self.channel().await)
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await?;
        Ok(answer.into_inner().status())
    }

    /// Waits (up to [`HANG_GUARD`]) until the health service says `status`
    /// of `service`: the store's entries follow its reachability on a poll.
    pub async fn health_becomes(&self, service: &str, status: ServingStatus) {
        let started = Instant::now();
        loop {
            let now = self.health(service).await;
            if now.as_ref().is_ok_and(|now| *now == status) {
                return;
            }
            assert!(
                started.elapsed() < HANG_GUARD,
                "{service} is {now:?}, not {status:?}, after {HANG_GUARD:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A RetryDecider client.
    pub async fn decider(&self) -> RetryDeciderClient<Channel> {
        RetryDeciderClient::new(self.channel().await)
    }

    /// A RetryAdmin client.
    pub async fn admin(&self) -> RetryAdminClient<Channel> {
        RetryAdminClient::new(self.channel().await)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// CPU seconds the server has used so far (user + system), from
    /// `/proc`: unlike wall time, not inflated by the machine's other work.
    pub fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("proc stat");
        // The fields after the command name, which is in parentheses.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .expect("stat has a command name")
            .1
            .split_whitespace()
            .collect();
        let ticks = |i: usize| fields[i].parse::<f64>().expect("clock ticks");
        // utime and stime, in USER_HZ (100 on Linux).
        (ticks(11) + ticks(12)) / 100.0
    }

    /// Sends a signal (`HUP`, `TERM`, …) to the server.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// What the server logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends SIGTERM and waits up to `limit` for the process to exit.
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Fetches `/metrics`.
    pub fn scrape(&self) -> String {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(self.metrics).expect("connect metrics");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .expect("send scrape");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read scrape");
        response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- retryd stderr ---\n{}", self.logs());
        }
    }
}

/// A request that the default policy answers RETRY: an idempotent call whose
/// connection could not be established.
pub fn retryable(upstream: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "PUT /things/1".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: 1,
        failure: pb::FailureKind::Connect as i32,
        ..Default::default()
    }
}

/// Milliseconds of a protobuf duration.
pub fn millis(duration: Option<prost_types::Duration>) -> i64 {
    let duration = duration.unwrap_or_default();
    duration.seconds * 1000 + i64::from(duration.nanos) / 1_000_000
}
