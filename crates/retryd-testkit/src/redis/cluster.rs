//! A Redis Cluster of real `redis-server` nodes on loopback: created with
//! `redis-cli --cluster create`, masters only or a replica each, plain or
//! TLS only; its nodes can be killed and restarted like any
//! [`RedisServer`].

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use super::{RedisServer, TlsCli, TlsFiles};

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
