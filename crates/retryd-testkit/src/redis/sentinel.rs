//! Redis Sentinel for tests: a primary, a replica and three
//! `redis-server FILE --sentinel` processes on free loopback ports, killed
//! when dropped; plain, or with TLS only (data nodes and sentinels), and
//! with or without a password on the sentinels themselves.

use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::{RedisServer, STARTUP, TlsCli, TlsFiles, free_port, ping};

/// A primary, one replica and three sentinels watching it as
/// [`RedisSentinels::MASTER_NAME`], each on free loopback ports; returns
/// once the replica has synced and every sentinel knows the replica and
/// the other two sentinels, so that a failover can happen.
pub struct RedisSentinels {
    /// The primary at start (after a failover, a dead or demoted node).
    pub primary: RedisServer,
    /// The replica at start (promoted by a failover).
    pub replica: RedisServer,
    /// The sentinels.
    pub sentinels: Vec<SentinelProcess>,
    /// TLS only, everywhere.
    tls: bool,
}

/// How the sentinels are run ([`RedisSentinels::start_with`]).
#[derive(Default)]
pub struct SentinelOptions<'a> {
    /// TLS only, for the data nodes and the sentinels alike (no plain
    /// port anywhere; replication and the sentinels' own links over TLS).
    pub tls: Option<&'a TlsFiles>,
    /// The sentinels' own password (`requirepass`, and `sentinel
    /// sentinel-pass` so that they still talk to each other).
    pub sentinel_password: Option<&'a str>,
}

impl RedisSentinels {
    /// The name the sentinels monitor the primary under.
    pub const MASTER_NAME: &'static str = "retryd-primary";

    /// Starts them all (failover after 1 s without an answer).
    pub fn start() -> RedisSentinels {
        RedisSentinels::start_with(&SentinelOptions::default())
    }

    /// Starts them all as `options` say (failover after 1 s without an
    /// answer).
    pub fn start_with(options: &SentinelOptions<'_>) -> RedisSentinels {
        let primary = match options.tls {
            Some(files) => RedisServer::start_tls_only(files, &[]),
            None => RedisServer::start(),
        };
        let primary_port = primary.port().to_string();
        let replica_of = ["--replicaof", "127.0.0.1", &primary_port];
        let replica = match options.tls {
            Some(files) => RedisServer::start_tls_only(files, &replica_of),
            None => RedisServer::start_with_arguments(&replica_of),
        };
        wait_for("the replica to sync", Duration::from_secs(20), || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let sentinels: Vec<SentinelProcess> = (0..3)
            .map(|_| SentinelProcess::start(primary.port(), options))
            .collect();
        wait_for(
            "the sentinels to know the replica and each other",
            Duration::from_secs(30),
            || {
                sentinels.iter().all(|sentinel| {
                    let replicas = sentinel.cli(&["SENTINEL", "REPLICAS", Self::MASTER_NAME]);
                    let others = sentinel.cli(&["SENTINEL", "SENTINELS", Self::MASTER_NAME]);
                    replicas.contains(&replica.port().to_string())
                        && others.matches("127.0.0.1").count() >= 2
                })
            },
        );
        RedisSentinels {
            primary,
            replica,
            sentinels,
            tls: options.tls.is_some(),
        }
    }

    /// The sentinels' URLs (`rediss://localhost` with TLS, so that their
    /// certificates' names are checked), without credentials.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|sentinel| match self.tls {
                true => format!("rediss://localhost:{}", sentinel.port),
                false => format!("redis://127.0.0.1:{}", sentinel.port),
            })
            .collect()
    }

    /// The port of the primary the first sentinel names now.
    pub fn primary_port(&self) -> Option<u16> {
        let answer =
            self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", Self::MASTER_NAME]);
        answer.lines().nth(1)?.trim().parse().ok()
    }
}

/// One `redis-server FILE --sentinel`.
pub struct SentinelProcess {
    port: u16,
    /// With TLS only: how the harness's `redis-cli` reaches it.
    tls: Option<TlsCli>,
    /// Its `requirepass`, for the harness's `redis-cli`.
    password: Option<String>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    fn start(primary_port: u16, options: &SentinelOptions<'_>) -> SentinelProcess {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temporary directory");
            let port = free_port();
            let config = dir.path().join("sentinel.conf");
            let listen = match options.tls {
                // `tls-replication yes`: the sentinel reaches the data
                // nodes and the other sentinels over TLS too.
                Some(files) => format!(
                    "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                    files.cert.display(),
                    files.key.display(),
                    files.client_ca.display()
                ),
                None => format!("port {port}\n"),
            };
            let auth = match options.sentinel_password {
                Some(password) => {
                    format!("requirepass {password}\nsentinel sentinel-pass {password}\n")
                }
                None => String::new(),
            };
            // The file is the sentinel's own: it rewrites it as it learns.
            std::fs::write(
                &config,
                format!(
                    "{listen}{auth}bind 127.0.0.1\nprotected-mode no\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                     sentinel monitor {name} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 10000\n\
                     sentinel parallel-syncs {name} 1\n",
                    dir = dir.path().display(),
                    name = RedisSentinels::MASTER_NAME,
                ),
            )
            .expect("write sentinel.conf");
            let child = Command::new("redis-server")
                .arg(&config)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|error| panic!("cannot run redis-server --sentinel ({error})"));
            let mut sentinel = SentinelProcess {
                port,
                tls: options.tls.map(TlsCli::new),
                password: options.sentinel_password.map(str::to_owned),
                child: Some(child),
                dir,
            };
            let deadline = Instant::now() + STARTUP;
            while Instant::now() < deadline {
                if sentinel.answers_ping() {
                    return sentinel;
                }
                if let Some(child) = sentinel.child.as_mut() {
                    if !matches!(child.try_wait(), Ok(None)) {
                        break;
                    }
                }
                thread::sleep(Duration::from_millis(10));
            }
            sentinel.kill();
        }
        panic!("redis-server --sentinel would not start");
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    /// True once it answers (a password-protected sentinel answers PING
    /// only after AUTH, which `cli` sends).
    fn answers_ping(&self) -> bool {
        if self.tls.is_none() && self.password.is_none() {
            return ping(self.port);
        }
        self.cli(&["PING"]).contains("PONG")
    }

    /// Runs `redis-cli` against this sentinel.
    pub fn cli(&self, arguments: &[&str]) -> String {
        let password = self.password.iter().flat_map(|password| {
            [
                "--no-auth-warning".to_owned(),
                "-a".to_owned(),
                password.clone(),
            ]
        });
        let output = Command::new("redis-cli")
            .args(self.tls.iter().flat_map(TlsCli::arguments))
            .args(password)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(arguments)
            .output()
            .unwrap_or_else(|error| panic!("cannot run redis-cli: {error}"));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `ready`, polling; panics naming `what` after `limit`.
fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(50));
    }
}
