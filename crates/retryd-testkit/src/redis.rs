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

mod sentinel;

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
                dir: tempfile::tempdir().expect("temporary directory"),
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

/// A Redis Cluster, every slot assigned: masters only, or a replica each.
pub struct RedisCluster {
    /// The nodes, in creation order.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` (at least 3) nodes and joins them into a cluster;
    /// returns once every node reports `cluster_state:ok`.
    pub fn start(masters: usize) -> RedisCluster {
        assert!(masters >= 3, "Redis Cluster needs at least 3 masters");
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| RedisServer::start_node(true))
            .collect();
        RedisCluster::create(nodes, 0, None)
    }

    /// Starts `masters` (at least 3) nodes with TLS only (`--port 0`,
    /// `--tls-cluster yes`, `--tls-replication yes`: clients, the bus and
    /// replication all over TLS) and joins them into a cluster. The nodes
    /// announce `127.0.0.1`, so a client that follows `CLUSTER SLOTS`
    /// checks `files.cert` for that address: issue it for `127.0.0.1` as
    /// well as `localhost`.
    pub fn start_tls_only(masters: usize, files: &TlsFiles) -> RedisCluster {
        assert!(masters >= 3, "Redis Cluster needs at least 3 masters");
        let tls = TlsCli::new(files);
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                RedisServer::start_configured(
                    true,
                    false,
                    Some(tls.clone()),
                    files.tls_only_arguments(true),
                    2000,
                )
            })
            .collect();
        RedisCluster::create(nodes, 0, Some(&tls))
    }

    /// `redis-cli --cluster create` over `nodes`, `replicas` per master;
    /// returns once every node reports `cluster_state:ok`.
    fn create(nodes: Vec<RedisServer>, replicas: usize, tls: Option<&TlsCli>) -> RedisCluster {
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port()))
            .collect();
        let output = Command::new("redis-cli")
            .args(tls.iter().flat_map(|tls| tls.arguments()))
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|error| panic!("cannot run redis-cli --cluster create: {error}"));
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_until_ok();
        cluster
    }

    /// Starts `masters` (at least 3) masters and a replica of each, with
    /// `--cluster-node-timeout 1000` (a killed master's replica takes over
    /// about 2–3 s later) and `--cluster-require-full-coverage no`; returns once every replica has synced, so that a
    /// failover can happen.
    pub fn start_with_replicas(masters: usize) -> RedisCluster {
        assert!(masters >= 3, "Redis Cluster needs at least 3 masters");
        let nodes: Vec<RedisServer> = (0..masters * 2)
            .map(|_| {
                // Without this, every master answers CLUSTERDOWN while any
                // slot is unserved (between a master's failure and its
                // replica's promotion): as operators should run it for
                // retryd (README.md), so that a lost master stays local.
                let partial = ["--cluster-require-full-coverage", "no"];
                let extra = partial
                    .iter()
                    .map(|argument| argument.to_string())
                    .collect();
                RedisServer::start_with(true, false, extra, 1000)
            })
            .collect();
        let cluster = RedisCluster::create(nodes, 1, None);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = cluster
                .nodes
                .iter()
                .map(|node| node.cli(&["INFO", "replication"]))
                .filter(|info| info.contains("role:slave"))
                .filter(|info| info.contains("master_link_status:up"))
                .count();
            if synced == masters {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "only {synced} of {masters} replicas synced"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The index of the live node serving `key`'s slot as a master, as the
    /// first live node's `CLUSTER SLOTS` says.
    pub fn master_of(&mut self, key: &str) -> Option<usize> {
        let live = (0..self.nodes.len()).find(|&index| self.nodes[index].is_running())?;
        let slot: u16 = self.nodes[live]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .ok()?;
        // redis-cli prints each range as start, end, host, port, id, ...
        let nodes_text = self.nodes[live].cli(&["CLUSTER", "NODES"]);
        let port = nodes_text.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let is_master = fields.get(2)?.contains("master") && !fields[2].contains("fail");
            let serves = fields.iter().skip(8).any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                matches!(
                    (low.parse::<u16>(), high.parse::<u16>()),
                    (Ok(low), Ok(high)) if (low..=high).contains(&slot)
                )
            });
            let address = fields.get(1)?.split('@').next()?;
            (is_master && serves).then(|| address.rsplit(':').next()?.parse::<u16>().ok())?
        })?;
        self.nodes.iter().position(|node| node.port() == port)
    }

    /// Waits until every node sees every slot served.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = self.nodes.iter().all(|node| {
                let info = node.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never reached cluster_state:ok"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every node's URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `SCRIPT FLUSH` on every node.
    pub fn flush_scripts(&self) {
        self.nodes.iter().for_each(RedisServer::flush_scripts);
    }
}
