//! Real `redis-server` processes for tests: one node (plain, TLS beside
//! plain, or TLS only), a Redis Cluster (plain or TLS only), or a primary
//! under Sentinel (`redis/sentinel.rs`), each on free loopback ports,
//! without persistence, killed when dropped, and able to be killed and
//! restarted mid-test. Never the shared 6379.
//!
//! If `redis-server` cannot be started the test fails (panics): a missing
//! Redis must never turn into a silently skipped test. Uses only `std`
//! (plus `tempfile`) and the `redis-cli` that ships with `redis-server`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod cluster;
mod sentinel;

pub use self::cluster::RedisCluster;
pub use self::sentinel::{RedisSentinels, SentinelOptions, SentinelProcess};

/// A key prefix no other store in this test process uses, so that stores
/// sharing one Redis never see each other's budgets.
pub fn fresh_prefix(tag: &str) -> String {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!(
        "{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// How long a server may take to accept connections.
const STARTUP: Duration = Duration::from_secs(10);

/// A free port; for a cluster node one at most 55535, so that its default
/// bus port (+10000) exists.
fn free_cluster_port(cluster: bool) -> u16 {
    loop {
        let port = free_port();
        if !cluster || port <= 55_535 {
            return port;
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("no free loopback port")
}

/// One `redis-server` child.
pub struct RedisServer {
    port: u16,
    /// The Cluster bus port, for a cluster node.
    cluster_port: Option<u16>,
    /// The TLS port, for a server started with [`RedisServer::start_tls`].
    tls_port: Option<u16>,
    /// Further arguments (TLS files, replication).
    extra: Vec<String>,
    /// `--cluster-node-timeout`, for a cluster node.
    cluster_node_timeout_ms: u32,
    /// For a server with TLS only (`--port 0`): how the harness's own
    /// `redis-cli` reaches it, since no plain port is open.
    tls_only: Option<TlsCli>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

/// The harness's TLS client side (`redis-cli --tls`) for TLS-only servers.
#[derive(Clone)]
pub(crate) struct TlsCli {
    /// The CA the servers' certificates are checked against.
    ca: PathBuf,
}

impl TlsCli {
    pub(crate) fn new(files: &TlsFiles) -> TlsCli {
        TlsCli {
            ca: files.client_ca.clone(),
        }
    }

    /// `redis-cli` arguments before the host and port.
    pub(crate) fn arguments(&self) -> Vec<String> {
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.ca.to_string_lossy().into_owned(),
        ]
    }
}

/// PEM files for a TLS server: its certificate and key, and the CA that
/// signs the client certificates it accepts.
pub struct TlsFiles {
    /// The server's certificate chain (its SAN should name `localhost`).
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
    /// The CA of client certificates (`--tls-ca-cert-file`). For a TLS-only
    /// server it must also have signed `cert`: the nodes check each other
    /// (replication, the Cluster bus) with it, and so does the harness's
    /// `redis-cli`.
    pub client_ca: PathBuf,
}

impl TlsFiles {
    /// `redis-server` arguments for a TLS-only server (`--port 0`), which
    /// also replicates (and, in a Cluster, talks on its bus) over TLS.
    /// Clients need no certificate (`--tls-auth-clients no`).
    fn tls_only_arguments(&self, cluster: bool) -> Vec<String> {
        let path = |path: &Path| path.to_string_lossy().into_owned();
        let mut arguments = vec![
            "--tls-cert-file".into(),
            path(&self.cert),
            "--tls-key-file".into(),
            path(&self.key),
            "--tls-ca-cert-file".into(),
            path(&self.client_ca),
            "--tls-auth-clients".into(),
            "no".into(),
            "--tls-replication".into(),
            "yes".into(),
        ];
        if cluster {
            arguments.extend(["--tls-cluster".into(), "yes".into()]);
        }
        arguments
    }
}

impl RedisServer {
    /// A standalone server on a free port.
    pub fn start() -> RedisServer {
        RedisServer::start_node(false)
    }

    /// A standalone server with TLS on a port of its own
    /// ([`RedisServer::tls_url`]), requiring client certificates if
    /// `require_client_certificates`. The plain port stays open on
    /// loopback for the harness's own `redis-cli` (ACLs, INFO); what a test
    /// proves over TLS it proves through the TLS port.
    pub fn start_tls(files: &TlsFiles, require_client_certificates: bool) -> RedisServer {
        let path = |path: &Path| path.to_string_lossy().into_owned();
        let extra = vec![
            "--tls-cert-file".into(),
            path(&files.cert),
            "--tls-key-file".into(),
            path(&files.key),
            "--tls-ca-cert-file".into(),
            path(&files.client_ca),
            "--tls-auth-clients".into(),
            if require_client_certificates {
                "yes"
            } else {
                "no"
            }
            .into(),
        ];
        RedisServer::start_with(false, true, extra, 2000)
    }

    /// A standalone server with TLS only: no plain port (`--port 0`),
    /// replication over TLS, and further `redis-server` arguments
    /// (`--replicaof`, ...). [`RedisServer::port`] is its TLS port,
    /// [`RedisServer::url`] a `rediss://localhost` URL, and
    /// [`RedisServer::cli`] speaks TLS.
    pub fn start_tls_only(files: &TlsFiles, arguments: &[&str]) -> RedisServer {
        let mut extra = files.tls_only_arguments(false);
        extra.extend(arguments.iter().map(|argument| argument.to_string()));
        RedisServer::start_configured(false, false, Some(TlsCli::new(files)), extra, 2000)
    }

    /// A standalone server run with further `redis-server` arguments
    /// (`--replicaof`, `--user`, ...).
    pub fn start_with_arguments(arguments: &[&str]) -> RedisServer {
        let extra = arguments
            .iter()
            .map(|argument| argument.to_string())
            .collect();
        RedisServer::start_with(false, false, extra, 2000)
    }

    fn start_node(cluster: bool) -> RedisServer {
        RedisServer::start_with(cluster, false, Vec::new(), 2000)
    }

    fn start_with(
        cluster: bool,
        tls: bool,
        extra: Vec<String>,
        cluster_node_timeout_ms: u32,
    ) -> RedisServer {
        RedisServer::start_configured(cluster, tls, None, extra, cluster_node_timeout_ms)
    }

    /// `tls`: a TLS port beside the plain one; `tls_only`: the TLS port
    /// alone, reached by the harness as `tls_only` says.
    fn start_configured(
        cluster: bool,
        tls: bool,
        tls_only: Option<TlsCli>,
        extra: Vec<String>,
        cluster_node_timeout_ms: u32,
    ) -> RedisServer {
        let mut last_log = String::new();
        // A free port may be taken between choosing and binding it: retry.
        for _ in 0..5 {
            let mut server = RedisServer {
                // The cluster bus listens on port + 10000 by default; the
                // harness names it, but keeps ports low enough anyway.
                port: free_cluster_port(cluster),
                cluster_port: cluster.then(free_port),
                tls_port: tls.then(free_port),
                extra: extra.clone(),
                cluster_node_timeout_ms,
                tls_only: tls_only.clone(),
                child: None,
                dir: server_dir(),
            };
            if server.spawn() {
                return server;
            }
            last_log = server.log();
        }
        panic!("redis-server would not start; its last log:\n{last_log}");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Starts the process; true once it answers PING.
    fn spawn(&mut self) -> bool {
        let port = self.port.to_string();
        let dir = self.dir.path().to_string_lossy().into_owned();
        let log = self.log_path().to_string_lossy().into_owned();
        // A TLS-only server listens on `port` with TLS and nowhere else.
        let (plain_port, tls_port) = match self.tls_only {
            Some(_) => ("0".to_owned(), Some(port.clone())),
            None => (port, self.tls_port.map(|port| port.to_string())),
        };
        let mut arguments: Vec<String> = [
            "--port",
            &plain_port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &dir,
            "--logfile",
            &log,
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--enable-debug-command",
            "local",
        ]
        .iter()
        .map(|argument| argument.to_string())
        .collect();
        if let Some(tls_port) = tls_port {
            arguments.extend(["--tls-port".to_owned(), tls_port]);
        }
        arguments.extend(self.extra.iter().cloned());
        if let Some(bus) = self.cluster_port {
            arguments.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    &bus.to_string(),
                    "--cluster-node-timeout",
                    &self.cluster_node_timeout_ms.to_string(),
                ]
                .iter()
                .map(|argument| argument.to_string()),
            );
        }
        let child = Command::new("redis-server")
            .args(&arguments)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run redis-server ({error}): install it (apt-get install redis-server)"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP;
        while Instant::now() < deadline {
            if !self.is_running() {
                self.child = None;
                return false;
            }
            if self.answers_ping() {
                return true;
            }
            thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    fn answers_ping(&self) -> bool {
        match self.tls_only {
            // No plain port to write PING to: redis-cli speaks TLS.
            Some(_) => self.cli(&["PING"]).contains("PONG"),
            None => ping(self.port),
        }
    }

    /// The port it listens on (127.0.0.1): with TLS if TLS only.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`; for a TLS-only server its
    /// [`RedisServer::tls_url`].
    pub fn url(&self) -> String {
        if self.tls_only.is_some() {
            return self.tls_url();
        }
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `rediss://localhost:<tls port>`, for a server started with
    /// [`RedisServer::start_tls`] or with TLS only: `localhost`, so that
    /// the certificate's name is checked.
    pub fn tls_url(&self) -> String {
        if self.tls_only.is_some() {
            return format!("rediss://localhost:{}", self.port);
        }
        let port = self.tls_port.expect("a server started with start_tls");
        format!("rediss://localhost:{port}")
    }

    /// True for a server with no plain port.
    pub fn is_tls_only(&self) -> bool {
        self.tls_only.is_some()
    }

    /// The working directory (cluster config, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// True while the process lives.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL: no goodbye to clients, like a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (and, for a cluster node, with the
    /// same node id and slots). Without persistence its data is gone.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + STARTUP;
        // The port is ours; a just-killed listener may linger briefly.
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server would not restart; its log:\n{}", self.log());
    }

    /// Runs `redis-cli` against this server and returns what it printed.
    pub fn cli(&self, arguments: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(self.tls_only.iter().flat_map(TlsCli::arguments))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(arguments)
            .output()
            .unwrap_or_else(|error| panic!("cannot run redis-cli: {error}"));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `CLIENT PAUSE <ms> ALL`: every client command waits, then runs.
    pub fn pause(&self, duration: Duration) {
        let answer = self.cli(&["CLIENT", "PAUSE", &duration.as_millis().to_string(), "ALL"]);
        assert!(answer.contains("OK"), "CLIENT PAUSE answered {answer:?}");
    }

    /// `DEBUG SLEEP`: the server blocks entirely. Returns once it is asleep;
    /// the sleep goes on in the background.
    pub fn sleep_in_background(&self, duration: Duration) -> thread::JoinHandle<()> {
        let port = self.port;
        let seconds = format!("{:.3}", duration.as_secs_f64());
        let handle = thread::spawn(move || {
            let _ = Command::new("redis-cli")
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "DEBUG",
                    "SLEEP",
                    &seconds,
                ])
                .output();
        });
        thread::sleep(Duration::from_millis(30));
        handle
    }

    /// `SCRIPT FLUSH`: as after a restart or failover, for NOSCRIPT tests.
    pub fn flush_scripts(&self) {
        let answer = self.cli(&["SCRIPT", "FLUSH"]);
        assert!(answer.contains("OK"), "SCRIPT FLUSH answered {answer:?}");
    }

    /// [`RedisServer::restart`] from async code: on a blocking thread, so
    /// the runtime goes on (and, as any blocking task, holds a paused
    /// clock still meanwhile: see [`crate::clock`]).
    pub async fn restarted(mut self) -> RedisServer {
        tokio::task::spawn_blocking(move || {
            self.restart();
            self
        })
        .await
        .expect("restarting redis-server")
    }

    /// SIGSTOP: the server stalls entirely (connections stay open, nothing
    /// is answered) for as long as the test needs, until [`RedisServer::cont`].
    /// (`CLIENT PAUSE` would also hold back the `CLIENT UNPAUSE` that ends it.)
    pub fn stop(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT: a stopped server runs again, answering what queued up.
    pub fn cont(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("the server is running")
            .id()
            .to_string();
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid}: {status}");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// True if something on `port` answers PING with PONG.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut answer = [0u8; 64];
    match stream.read(&mut answer) {
        Ok(read) => answer[..read].starts_with(b"+PONG"),
        Err(_) => false,
    }
}

/// A Redis node's directory: in memory (`/dev/shm`) where the machine has
/// it. The test nodes save nothing, but a Cluster node writes and fsyncs
/// `nodes.conf` on its main thread at every configuration change, and a
/// failover makes several: on a disk busy with a build (CI compiles beside
/// the tests), one such fsync was seen to hold a live master's replies
/// past 40 ms, which the isolation tests would blame on retryd. Production
/// Cluster nodes want the same (redis/README.md says so).
fn server_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(dir) = tempfile::Builder::new()
            .prefix("retryd-redis-")
            .tempdir_in(shm)
        {
            return dir;
        }
    }
    tempfile::tempdir().expect("temporary directory")
}
