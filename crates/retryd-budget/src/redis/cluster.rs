//! A Redis Cluster over connections retryd owns, one per node, so that a
//! lost master holds up only the requests for its own slots.
//!
//! redis-rs 1.2.2's async Cluster client runs every request through one
//! driver task (`ClusterConnInner`); while that task recovers, reconnecting
//! a node whose request failed (`refresh_connections`) or re-reading the
//! slots after a MOVED (`refresh_slots`, which holds the connection map's
//! write lock while it pings every node and reconnects the lost one),
//! `poll_flush` polls no request at all, to any node. With a master
//! SIGKILLed, each request for its slots set off another recovery, and the
//! requests to the live masters waited past the 20 ms store timeout.
//!
//! Here each node has its own multiplexed connection, opened by the first
//! request that needs it (its callers alone wait) and dropped when it fails.
//! A request goes to the master of its key's slot (from `CLUSTER SLOTS`,
//! re-read by the core's background task, and corrected at once by a
//! MOVED), follows MOVED and ASK (sending `ASKING` in the same write) to the
//! node they name, and waits on nothing of any other node. A node is used
//! only once every script is loaded on it. It neither times requests out
//! nor retries them beyond redirects: the core does. It knows nothing of
//! the core.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use ::redis::aio::{ConnectionLike, MultiplexedConnection};
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline,
    RedisError, RedisFuture, RedisResult, Script, Value,
};

use super::config::RedisTls;
use super::slots::{SLOTS, parse_slots, slot};
use super::socket::certificates;

/// Redirects (MOVED, ASK) and TRYAGAIN answers one request follows before
/// it gives up: a slot moves once at a time.
const REDIRECTS: usize = 4;
/// How long a TRYAGAIN (a slot half migrated) waits before the next try;
/// the core's deadline bounds the whole.
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(2);

/// The Cluster, shared by every clone.
#[derive(Clone)]
pub(super) struct ClusterNodes {
    inner: Arc<Inner>,
}

struct Inner {
    /// The configured nodes (`host:port`), asked for the slots when no
    /// known node answers.
    seeds: Vec<Arc<str>>,
    /// What every node shares (user, password, TLS mode, TCP settings);
    /// only the address changes.
    template: ConnectionInfo,
    /// The TLS material, for `rediss://`.
    tls: Option<RedisTls>,
    connect: AsyncConnectionConfig,
    /// Loaded on each node before its first request.
    scripts: Vec<Script>,
    nodes: RwLock<HashMap<Arc<str>, Arc<Node>>>,
    /// Per slot, the address of the master serving it (`None`: unknown).
    owners: RwLock<Vec<Option<Arc<str>>>>,
}

/// One node and its connection.
struct Node {
    client: Client,
    /// The connection and its generation, `None` until connected and after
    /// a failure.
    current: RwLock<Option<(u64, MultiplexedConnection)>>,
    /// One connection attempt at a time; only this node's callers wait.
    connecting: tokio::sync::Mutex<()>,
    generation: AtomicU64,
}

impl ClusterNodes {
    /// The Cluster reached through `seeds` (`host:port`), every node as
    /// `template` says but at its own address. Connects nothing yet.
    pub(super) fn new(
        seeds: Vec<String>,
        template: ConnectionInfo,
        tls: Option<RedisTls>,
        connect: AsyncConnectionConfig,
        scripts: Vec<Script>,
    ) -> ClusterNodes {
        ClusterNodes {
            inner: Arc::new(Inner {
                seeds: seeds.into_iter().map(Into::into).collect(),
                template,
                tls,
                connect,
                scripts,
                nodes: RwLock::new(HashMap::new()),
                owners: RwLock::new(vec![None; SLOTS]),
            }),
        }
    }

    /// Reads the slots and connects to every master (each with its scripts
    /// loaded); returns each master's `INFO`, for the version check. Fails
    /// with the first master's own error (a refused connection, a wrong
    /// password, a certificate that lacks the announced address).
    pub(super) async fn discover(&self) -> RedisResult<Vec<Value>> {
        let reply: Value = self.query_any(&slots_command()).await?;
        self.learn(&reply).map_err(reply_error)?;
        let mut masters: Vec<Arc<str>> =
            read(&self.inner.owners).iter().flatten().cloned().collect();
        masters.sort();
        masters.dedup();
        let mut infos = Vec::new();
        for master in masters {
            let node = self.node(&master)?;
            let (_, mut connection) = node.connection(&self.inner).await?;
            infos.push(::redis::cmd("INFO").query_async(&mut connection).await?);
        }
        Ok(infos)
    }

    /// Takes a `CLUSTER SLOTS` reply as the slots' owners, and connects in
    /// the background to any master it names that has no connection yet (a
    /// promoted replica, a resharding target), so that the first decision
    /// routed there finds one ready rather than spending its deadline on
    /// the connect and the script loads.
    pub(super) fn learn(&self, reply: &Value) -> Result<(), String> {
        let ranges = parse_slots(reply)?;
        let mut owners = vec![None; SLOTS];
        let mut names: HashMap<String, Arc<str>> = HashMap::new();
        for (start, end, address) in ranges {
            let name = names
                .entry(address.clone())
                .or_insert_with(|| address.into())
                .clone();
            for owner in &mut owners[start..=end] {
                *owner = Some(name.clone());
            }
        }
        *write(&self.inner.owners) = owners;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Ok(());
        };
        for address in names.into_values() {
            let Ok(node) = self.node(&address) else {
                continue;
            };
            if node.current().is_some() || node.connecting.try_lock().is_err() {
                continue;
            }
            let inner = Arc::clone(&self.inner);
            runtime.spawn(async move {
                // A failure is the first request's to report.
                let _ = node.connection(&inner).await;
            });
        }
        Ok(())
    }

    /// A connection-like handle that sends each command for `key` (or, with
    /// none, to any node that answers).
    pub(super) fn routed(&self, key: Option<&str>) -> Routed<'_> {
        Routed {
            nodes: self,
            slot: key.map(slot),
        }
    }

    fn owner(&self, slot: usize) -> Option<Arc<str>> {
        read(&self.inner.owners)[slot].clone()
    }

    fn node(&self, address: &str) -> RedisResult<Arc<Node>> {
        if let Some(node) = read(&self.inner.nodes).get(address) {
            return Ok(Arc::clone(node));
        }
        let client = self.client_for(address)?;
        let mut nodes = write(&self.inner.nodes);
        Ok(Arc::clone(nodes.entry(address.into()).or_insert_with(
            || {
                Arc::new(Node {
                    client,
                    current: RwLock::new(None),
                    connecting: tokio::sync::Mutex::new(()),
                    generation: AtomicU64::new(0),
                })
            },
        )))
    }

    /// The template at `address` (`host:port`, as the Cluster announces
    /// it, and as the certificate must name it).
    fn client_for(&self, address: &str) -> RedisResult<Client> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_owned(), port.parse::<u16>().ok()?)))
            .ok_or_else(|| reply_error(format!("a Cluster node at {address:?}")))?;
        let template = &self.inner.template;
        let addr = match template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        let info = template.clone().set_addr(addr);
        match &self.inner.tls {
            Some(tls) => Client::build_with_tls(info, certificates(tls)),
            None => Client::open(info),
        }
    }

    /// Where a request naming no key may go: the nodes connected now
    /// first (they answered last), then the others known, then the seeds.
    fn candidates(&self) -> Vec<Arc<str>> {
        let nodes = read(&self.inner.nodes);
        let mut connected: Vec<Arc<str>> = Vec::new();
        let mut others: Vec<Arc<str>> = Vec::new();
        for (address, node) in nodes.iter() {
            if node.current().is_some() {
                connected.push(address.clone());
            } else {
                others.push(address.clone());
            }
        }
        connected.sort();
        others.sort();
        for seed in &self.inner.seeds {
            if !nodes.contains_key(seed) {
                others.push(seed.clone());
            }
        }
        connected.extend(others);
        connected
    }

    async fn query_any(&self, command: &Cmd) -> RedisResult<Value> {
        let mut last = None;
        for address in self.candidates() {
            match self.exchange(&address, command, false).await {
                Ok(value) => return Ok(value),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| reply_error("no Cluster node configured")))
    }

    /// One command for `slot`, following redirects.
    async fn send(&self, slot: Option<usize>, command: &Cmd) -> RedisResult<Value> {
        let Some(slot) = slot else {
            return self.query_any(command).await;
        };
        let mut target = self.owner(slot);
        let mut asking = false;
        let mut last = None;
        for _ in 0..REDIRECTS {
            let answer = match &target {
                Some(address) => self.exchange(address, command, asking).await,
                None => self.query_any(command).await,
            };
            let error = match answer {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            match error.code() {
                Some("MOVED") => {
                    let Some((address, moved)) = error.redirect_node() else {
                        return Err(error);
                    };
                    let address: Arc<str> = address.into();
                    if usize::from(moved) < SLOTS {
                        write(&self.inner.owners)[usize::from(moved)] = Some(address.clone());
                    }
                    target = Some(address);
                    asking = false;
                }
                Some("ASK") => {
                    let Some((address, _)) = error.redirect_node() else {
                        return Err(error);
                    };
                    target = Some(address.into());
                    asking = true;
                }
                Some("TRYAGAIN") => tokio::time::sleep(TRY_AGAIN_AFTER).await,
                _ => return Err(error),
            }
            last = Some(error);
        }
        Err(last.unwrap_or_else(|| reply_error("too many redirects")))
    }

    /// One command on `address`'s connection (after `ASKING`, in the same
    /// write, if `asking`). A connection that failed is dropped.
    async fn exchange(&self, address: &str, command: &Cmd, asking: bool) -> RedisResult<Value> {
        let node = self.node(address)?;
        let (generation, mut connection) = node.connection(&self.inner).await?;
        let answer = if asking {
            let mut pipeline = ::redis::pipe();
            pipeline.cmd("ASKING").ignore().add_command(command.clone());
            connection
                .req_packed_commands(&pipeline, 1, 1)
                .await
                .and_then(|mut values| {
                    values
                        .pop()
                        .ok_or_else(|| reply_error("no answer after ASKING"))
                })
        } else {
            connection.req_packed_command(command).await
        };
        let answer = answer.and_then(Value::extract_error);
        if let Err(error) = &answer {
            node.failed(generation, error);
        }
        answer
    }
}

impl Node {
    /// The node's connection: the current one, or a new one with every
    /// script loaded.
    async fn connection(&self, inner: &Inner) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let _connecting = self.connecting.lock().await;
        // Another task may have connected while this one waited.
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let connection = self
            .client
            .get_multiplexed_async_connection_with_config(&inner.connect)
            .await?;
        // All at once: a multiplexed connection pipelines them, one round
        // trip rather than one per script.
        futures::future::try_join_all(inner.scripts.iter().map(|script| {
            let mut connection = connection.clone();
            async move { script.load_async(&mut connection).await }
        }))
        .await?;
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        *write(&self.current) = Some((generation, connection.clone()));
        Ok((generation, connection))
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        read(&self.current).clone()
    }

    /// After `error` on the connection of `generation`: drops it if the
    /// error says the connection is no good (not for a reply, such as
    /// MOVED, that a live node sent on it, nor for a slow answer: a
    /// multiplexed connection outlives one request's timeout, and a new one
    /// would cost a connect and the script loads).
    fn failed(&self, generation: u64, error: &RedisError) {
        let broken = !error.is_timeout()
            && (error.is_io_error()
                || error.is_connection_dropped()
                || error.is_unrecoverable_error());
        if !broken {
            return;
        }
        let mut current = write(&self.current);
        if current
            .as_ref()
            .is_some_and(|(known, _)| *known == generation)
        {
            *current = None;
        }
    }
}

/// Commands for one slot (or for any node), as redis-rs's `Script` and
/// `Cmd` send them.
pub(super) struct Routed<'a> {
    nodes: &'a ClusterNodes,
    slot: Option<usize>,
}

impl ConnectionLike for Routed<'_> {
    fn req_packed_command<'a>(&'a mut self, command: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.nodes.send(self.slot, command))
    }

    // The store sends no pipelines; one is sent whole to the slot's
    // master, without redirects.
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let address = self
                .slot
                .and_then(|slot| self.nodes.owner(slot))
                .or_else(|| self.nodes.candidates().into_iter().next())
                .ok_or_else(|| reply_error("no Cluster node known"))?;
            let node = self.nodes.node(&address)?;
            let (_, mut connection) = node.connection(&self.nodes.inner).await?;
            connection
                .req_packed_commands(pipeline, offset, count)
                .await
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

fn slots_command() -> Cmd {
    let mut command = ::redis::cmd("CLUSTER");
    command.arg("SLOTS");
    command
}

fn reply_error(detail: impl Into<String>) -> RedisError {
    RedisError::from((
        ErrorKind::Client,
        "unexpected Redis Cluster state",
        detail.into(),
    ))
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Nothing panics while holding these locks.
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
