//! Redis Sentinel for tests: a primary, a replica and three
//! `redis-server FILE --sentinel` processes on free loopback ports, killed
//! when dropped.

use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::{RedisServer, STARTUP, free_port, ping};

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
}

impl RedisSentinels {
    /// The name the sentinels monitor the primary under.
    pub const MASTER_NAME: &'static str = "retryd-primary";

    /// Starts them all (failover after 1 s without an answer).
    pub fn start() -> RedisSentinels {
        let primary = RedisServer::start();
        let primary_port = primary.port().to_string();
        let replica =
            RedisServer::start_with_arguments(&["--replicaof", "127.0.0.1", &primary_port]);
        wait_for("the replica to sync", Duration::from_secs(20), || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let sentinels: Vec<SentinelProcess> = (0..3)
            .map(|_| SentinelProcess::start(primary.port()))
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
        }
    }

    /// The sentinels' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|sentinel| format!("redis://127.0.0.1:{}", sentinel.port))
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
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    fn start(primary_port: u16) -> SentinelProcess {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temporary directory");
            let port = free_port();
            let config = dir.path().join("sentinel.conf");
            // The file is the sentinel's own: it rewrites it as it learns.
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {dir}\nlogfile {dir}/sentinel.log\n\
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
                child: Some(child),
                dir,
            };
            let deadline = Instant::now() + STARTUP;
            while Instant::now() < deadline {
                if ping(port) {
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

    /// Runs `redis-cli` against this sentinel.
    pub fn cli(&self, arguments: &[&str]) -> String {
        let output = Command::new("redis-cli")
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
