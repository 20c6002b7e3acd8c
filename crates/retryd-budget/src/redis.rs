//! The shared budget store: token buckets in Redis (one node or a Redis
//! Cluster), so that every retryd replica spends from the same budgets.
//!
//! Its design, what each mode promises and what happens when Redis is
//! down, is the module's doc page, `redis/README.md`.
#![doc = include_str!("redis/README.md")]

mod circuit;
mod config;
mod keys;
mod scripts;
mod url;

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, FromRedisValue, RedisError, RedisResult, Script, ScriptInvocation, Value};
use dashmap::DashMap;
use futures::StreamExt;
use tokio::time::{Instant, MissedTickBehavior};

use self::circuit::{Circuit, Transition};
pub use self::config::{RedisConfig, RedisMode};
use self::keys::KeySpace;
pub use self::scripts::CHECK_SOURCE;
use self::scripts::Scripts;
pub use self::url::{RedisUrl, redact_url};
use super::{
    BucketConfig, BudgetCheck, BudgetSnapshot, BudgetStore, MemoryBudgetStore, OnUnavailable,
    StoreError, StoreStats, UNITS_PER_TOKEN, units_to_tokens,
};

/// A bucket lives at least this long after its last write.
const IDLE_TTL_MS: u64 = 60_000;
/// An index entry outlives the bucket it stands for by this much, so that
/// a replica refreshes it about once per this period, not on every write.
const INDEX_SLACK_MS: u64 = 60_000;
/// A traffic report's admission asks Redis again about an upstream whose
/// index entry this replica knows to be live for less than this, so that
/// no entry lapses while the report's deposits are made.
const ADMISSION_MARGIN_MS: u64 = 10_000;
/// Index score of a bucket that never expires (no floor, below initial):
/// far in the future, yet distinct from the `+inf` of a kill switch.
const FAR_SCORE: u64 = 1_000_000_000_000_000;
/// Local marker for the `+inf` score of an upstream whose retries are off.
const INF_SCORE: u64 = u64::MAX;
/// How long `connect` may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Leased mode flushes batched deposits and sweeps leases this often.
const LEASED_TICK: Duration = Duration::from_millis(5);
/// Exact mode's background task only probes and tidies.
const EXACT_TICK: Duration = Duration::from_millis(25);
/// The kill-switch cache and the local map are tidied this often.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(1);
/// Longest a leased-mode view trusts a reading of the shared bucket.
const VIEW_CACHE: Duration = Duration::from_millis(100);
/// Concurrent calls of one background sweep or of `list`.
const FAN_OUT: usize = 32;
/// The oldest Redis whose scripts may call `TIME` before writing (effects
/// replication by default).
const MIN_VERSION: (u32, u32) = (5, 0);

/// Redis-specific failures, boxed into [`StoreError::Unavailable`].
#[derive(Debug, thiserror::Error)]
enum RedisStoreError {
    #[error("Redis did not answer in time")]
    Timeout,
    #[error(
        "Redis is believed down (re-probed every {:?})",
        circuit::PROBE_INTERVAL
    )]
    CircuitOpen,
    #[error("Redis: {0}")]
    Redis(#[source] RedisError),
    #[error("Redis {found} is too old: retryd needs {}.{} or later", MIN_VERSION.0, MIN_VERSION.1)]
    Version { found: String },
    #[error("unexpected reply from Redis: {0}")]
    Reply(String),
}

impl From<RedisError> for RedisStoreError {
    fn from(error: RedisError) -> Self {
        RedisStoreError::Redis(error)
    }
}

fn unavailable(error: RedisStoreError) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

/// Why a call to Redis gave no answer.
#[derive(Debug)]
enum Failure {
    /// Not sent (the circuit is open or no time was left): nothing happened
    /// in Redis.
    NotSent,
    /// Sent without an answer: it may or may not have happened.
    Unknown(RedisStoreError),
}

impl Failure {
    fn into_error(self) -> StoreError {
        match self {
            Failure::NotSent => unavailable(RedisStoreError::CircuitOpen),
            Failure::Unknown(error) => unavailable(error),
        }
    }
}

/// One node or a Cluster, behind one type (no `dyn`).
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    async fn invoke<T: FromRedisValue>(&self, invocation: &ScriptInvocation<'_>) -> RedisResult<T> {
        // Script::invoke_async sends EVALSHA and, on NOSCRIPT, SCRIPT LOAD
        // (routed to every master in a Cluster) then EVALSHA again.
        match self {
            Connection::Single(connection) => {
                invocation.invoke_async(&mut connection.clone()).await
            }
            Connection::Cluster(connection) => {
                invocation.invoke_async(&mut connection.clone()).await
            }
        }
    }

    async fn query<T: FromRedisValue>(&self, command: &Cmd) -> RedisResult<T> {
        match self {
            Connection::Single(connection) => command.query_async(&mut connection.clone()).await,
            Connection::Cluster(connection) => command.query_async(&mut connection.clone()).await,
        }
    }

    async fn load(&self, script: &Script) -> RedisResult<String> {
        match self {
            Connection::Single(connection) => script.load_async(&mut connection.clone()).await,
            Connection::Cluster(connection) => script.load_async(&mut connection.clone()).await,
        }
    }
}

/// What every bucket script answers.
#[derive(Clone, Copy, Debug)]
struct Reply {
    /// Granted (1/0), units leased or returned, or the previous switch.
    result: i64,
    /// Units in the shared bucket afterwards.
    tokens: u64,
    enabled: bool,
    tracked: bool,
    /// -1 retries off, -2 nothing saved, -3 saved without expiry, else the
    /// bucket's expiry in server milliseconds.
    index: i64,
    now_ms: i64,
}

impl Reply {
    fn parse(values: &[i64]) -> Result<Reply, RedisStoreError> {
        match *values {
            [result, tokens, enabled, tracked, index, now_ms] => Ok(Reply {
                result,
                tokens: tokens.max(0) as u64,
                enabled: enabled == 1,
                tracked: tracked == 1,
                index,
                now_ms,
            }),
            _ => Err(RedisStoreError::Reply(format!(
                "a bucket script answered {values:?}"
            ))),
        }
    }
}

/// Counters behind [`StoreStats`].
#[derive(Debug, Default)]
struct Counters {
    errors: AtomicU64,
    timeouts: AtomicU64,
    fallbacks: AtomicU64,
    unavailable: AtomicU64,
    forfeited_units: AtomicU64,
    lost_deposits: AtomicU64,
    task_restarts: AtomicU64,
    lease_acquisitions: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; if something did, the data
    // is still a valid value of its type.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whole tokens taken from the shared bucket, spent by this replica alone.
#[derive(Debug)]
struct Lease {
    /// `<lease id>:<units>`, the member of the upstream's lease set.
    member: String,
    remaining: AtomicU64,
    /// When it was asked for, to tell a lease that ran dry quickly (the
    /// next should be bigger) from one that merely ran dry.
    taken_at: Instant,
    /// Local spending ends here, half a `lease_ttl` before Redis forgets
    /// the lease, so that the return arrives while it is still live.
    spend_until: Instant,
}

impl Lease {
    /// Spends one token: a compare-and-swap, never check-then-decrement.
    /// Returns the units left.
    fn try_spend(&self, now: Instant) -> Option<u64> {
        if now >= self.spend_until {
            return None;
        }
        self.remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_sub(UNITS_PER_TOKEN)
            })
            .ok()
            .map(|before| before - UNITS_PER_TOKEN)
    }

    fn available(&self, now: Instant) -> u64 {
        if now >= self.spend_until {
            0
        } else {
            self.remaining.load(Ordering::Acquire)
        }
    }
}

/// How a lease ended, as far as the size of the next one is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeaseEnd {
    /// Spent within a quarter of `lease_ttl`: demand outruns the lease, and
    /// every refill is a round trip others wait for.
    DrainedQuickly,
    /// Spent, but not quickly, or nothing to judge by: the size fits.
    Drained,
    /// Expired or handed back with tokens left: the lease was bigger than
    /// the demand, and the surplus sat idle in this replica.
    LeftOver,
}

/// The largest lease for a bucket, in units: `max_units`, and a quarter of
/// the capacity so that one replica never holds most of a small bucket,
/// both in whole tokens; never below `min_units` (`lease_tokens`), the size
/// a lease always had.
fn lease_cap(min_units: u64, max_units: u64, capacity_units: u64) -> u64 {
    let whole = |units: u64| units / UNITS_PER_TOKEN * UNITS_PER_TOKEN;
    whole(max_units.min(capacity_units / 4)).max(min_units)
}

/// The size of the next lease, in units: double after one that ran dry
/// quickly (fewer round trips for a busy upstream), half after one that
/// had tokens left (fewer tokens idle for a quiet one), within
/// `min_units..=cap`. Sizes stay whole tokens: the acquire script leases
/// only whole tokens, and a fraction would be returned unspent.
fn next_lease_units(current: u64, end: LeaseEnd, min_units: u64, cap: u64) -> u64 {
    let next = match end {
        LeaseEnd::DrainedQuickly => current.saturating_mul(2),
        LeaseEnd::Drained => current,
        LeaseEnd::LeftOver => current / 2 / UNITS_PER_TOKEN * UNITS_PER_TOKEN,
    };
    next.min(cap).max(min_units)
}

/// A reading of the shared bucket, for leased-mode views.
#[derive(Clone, Copy, Debug)]
struct Shared {
    units: u64,
    enabled: bool,
    read_at: Instant,
}

const ACQUIRED: u8 = 0;
const EMPTY: u8 = 1;
const FAILED: u8 = 2;

/// What this replica knows of one admitted upstream.
#[derive(Debug)]
struct Upstream {
    /// Milliseconds since the store's origin until which the index entry is
    /// known live; 0 before admission.
    index_until: AtomicU64,
    /// The index score last written or read (server ms, `FAR_SCORE`,
    /// `INF_SCORE`); 0 if unknown.
    index_score: AtomicU64,
    /// The bucket parameters last used, for background work.
    config: Mutex<BucketConfig>,
    lease: Mutex<Option<Arc<Lease>>>,
    /// Units the next lease asks for (see [`next_lease_units`]).
    lease_size: AtomicU64,
    /// One lease acquisition at a time; the others wait for its outcome.
    acquiring: tokio::sync::Mutex<()>,
    acquisitions: AtomicU64,
    last_acquisition: AtomicU8,
    shared: Mutex<Option<Shared>>,
    pending_requests: AtomicU64,
    in_flight_units: AtomicU64,
}

impl Upstream {
    fn new(config: &BucketConfig, lease_units: u64) -> Upstream {
        Upstream {
            index_until: AtomicU64::new(0),
            index_score: AtomicU64::new(0),
            config: Mutex::new(*config),
            lease: Mutex::new(None),
            lease_size: AtomicU64::new(lease_units),
            acquiring: tokio::sync::Mutex::new(()),
            acquisitions: AtomicU64::new(0),
            last_acquisition: AtomicU8::new(ACQUIRED),
            shared: Mutex::new(None),
            pending_requests: AtomicU64::new(0),
            in_flight_units: AtomicU64::new(0),
        }
    }

    fn config(&self) -> BucketConfig {
        *lock(&self.config)
    }

    fn spend(&self, now: Instant) -> Option<u64> {
        let lease = lock(&self.lease).clone()?;
        lease.try_spend(now)
    }

    fn lease_units(&self, now: Instant) -> u64 {
        lock(&self.lease)
            .as_ref()
            .map_or(0, |lease| lease.available(now))
    }

    fn has_lease(&self) -> bool {
        lock(&self.lease).is_some()
    }

    /// Resizes the next lease after one ended; returns the new size.
    fn resize_lease(&self, end: LeaseEnd, min_units: u64, cap: u64) -> u64 {
        let resize = |size| next_lease_units(size, end, min_units, cap);
        // The closure always answers Some, so this never fails.
        let before = self
            .lease_size
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |size| {
                Some(resize(size))
            })
            .unwrap_or_else(|size| size);
        resize(before)
    }

    /// Units this replica holds or owes the shared bucket: its lease and
    /// the deposits not yet flushed.
    fn local_units(&self, now: Instant, config: &BucketConfig) -> u64 {
        let pending = config.deposit_units(self.pending_requests.load(Ordering::Acquire));
        self.lease_units(now)
            .saturating_add(pending)
            .saturating_add(self.in_flight_units.load(Ordering::Acquire))
    }

    fn remember(&self, reply: &Reply) {
        *lock(&self.shared) = Some(Shared {
            units: reply.tokens,
            enabled: reply.enabled,
            read_at: Instant::now(),
        });
    }

    fn cached(&self, now: Instant, fresh_for: Duration) -> Option<Shared> {
        lock(&self.shared).filter(|shared| now.duration_since(shared.read_at) < fresh_for)
    }
}

/// A lease to hand back to Redis.
#[derive(Debug)]
struct Return {
    upstream: Box<str>,
    member: String,
    units: u64,
    config: BucketConfig,
}

struct Inner {
    connection: Connection,
    scripts: Scripts,
    keys: KeySpace,
    mode: RedisMode,
    timeout: Duration,
    /// The first and smallest lease (`lease_tokens`).
    lease_units: u64,
    /// The largest lease (`max_lease_tokens`), before the capacity cap.
    max_lease_units: u64,
    lease_ttl: Duration,
    view_cache: Duration,
    max_upstreams: usize,
    circuit: Circuit,
    fallback: MemoryBudgetStore,
    upstreams: DashMap<Box<str>, Arc<Upstream>>,
    /// Upstreams whose retries are known to be off, for outages.
    disabled: RwLock<HashSet<Box<str>>>,
    returns: Mutex<Vec<Return>>,
    counters: Counters,
    origin: Instant,
    replica: String,
    lease_sequence: AtomicU64,
    closed: AtomicBool,
}

/// Budgets in Redis, shared by every replica that uses the same Redis and
/// key prefix. Cheap to clone: clones share one connection and state.
#[derive(Clone)]
pub struct RedisBudgetStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisBudgetStore {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RedisBudgetStore")
            .field("mode", &self.inner.mode)
            .field("available", &self.inner.circuit.is_up())
            .field("upstreams", &self.inner.upstreams.len())
            .finish()
    }
}

/// The parameters of the fallback bucket: same capacity and ratio, no
/// initial tokens, no floor (see the module docs for why).
fn local_config(config: &BucketConfig) -> BucketConfig {
    BucketConfig {
        initial: 0.0,
        min_per_second: 0.0,
        ..*config
    }
}

impl RedisBudgetStore {
    /// Connects to Redis (one URL) or a Redis Cluster (several URLs, or one
    /// URL of a node with cluster mode on), checks the server version, loads
    /// the scripts and starts the background task. Must run inside a tokio
    /// runtime. Fails, rather than starting blind, if Redis cannot be
    /// reached within 5 s.
    pub async fn connect(
        config: &RedisConfig,
        max_upstreams: usize,
    ) -> Result<RedisBudgetStore, StoreError> {
        let setup = async {
            let connection = open(config).await?;
            let scripts = Scripts::new();
            for script in scripts.all() {
                connection.load(script).await?;
            }
            Ok::<_, RedisStoreError>((connection, scripts))
        };
        let (connection, scripts) = tokio::time::timeout(CONNECT_TIMEOUT, setup)
            .await
            .map_err(|_| unavailable(RedisStoreError::Timeout))?
            .map_err(unavailable)?;

        let lease_tokens = config.lease_tokens.floor().max(1.0);
        let lease_units = lease_tokens as u64 * UNITS_PER_TOKEN;
        // `as` saturates: a huge maximum is the capacity cap's business.
        let max_lease_units = (config.max_lease_tokens.floor() as u64)
            .saturating_mul(UNITS_PER_TOKEN)
            .max(lease_units);
        let inner = Arc::new(Inner {
            connection,
            scripts,
            keys: KeySpace::new(&config.key_prefix),
            mode: config.mode,
            timeout: config.timeout,
            lease_units,
            max_lease_units,
            lease_ttl: config.lease_ttl,
            view_cache: VIEW_CACHE.min(config.lease_ttl / 2),
            max_upstreams,
            circuit: Circuit::new(),
            fallback: MemoryBudgetStore::new(max_upstreams),
            upstreams: DashMap::new(),
            disabled: RwLock::new(HashSet::new()),
            returns: Mutex::new(Vec::new()),
            counters: Counters::default(),
            origin: Instant::now(),
            replica: format!("{:016x}", rand::random::<u64>()),
            lease_sequence: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        });
        let tick = match config.mode {
            RedisMode::Exact => EXACT_TICK,
            RedisMode::Leased => LEASED_TICK,
        };
        spawn_supervised(Arc::downgrade(&inner), tick);
        tracing::info!(
            mode = ?config.mode,
            cluster = matches!(inner.connection, Connection::Cluster(_)),
            "connected to the Redis budget store"
        );
        Ok(RedisBudgetStore { inner })
    }

    /// False while Redis is believed unreachable.
    pub fn is_available(&self) -> bool {
        self.inner.circuit.is_up()
    }

    /// Counters since start.
    pub fn stats(&self) -> StoreStats {
        let counters = &self.inner.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StoreStats {
            backend_errors: load(&counters.errors),
            backend_timeouts: load(&counters.timeouts),
            outages: self.inner.circuit.times_opened(),
            fallbacks: load(&counters.fallbacks),
            unavailable_answers: load(&counters.unavailable),
            forfeited_tokens: units_to_tokens(load(&counters.forfeited_units)),
            lost_deposits: load(&counters.lost_deposits),
        }
    }

    /// Times the background task panicked and was restarted (should stay 0).
    pub fn background_restarts(&self) -> u64 {
        self.inner.counters.task_restarts.load(Ordering::Relaxed)
    }

    /// Leased mode: lease acquisitions Redis answered since start (whether
    /// or not the bucket had a token to lease), over every upstream.
    pub fn lease_acquisitions(&self) -> u64 {
        self.inner
            .counters
            .lease_acquisitions
            .load(Ordering::Relaxed)
    }

    /// Flushes batched deposits and returns every lease. Afterwards leased
    /// mode withdraws one token at a time, like exact mode, so nothing is
    /// left stranded in this replica.
    pub async fn shutdown(&self) {
        self.inner.shutdown().await;
    }
}

async fn open(config: &RedisConfig) -> Result<Connection, RedisStoreError> {
    let Some(first) = config.urls.first() else {
        return Err(RedisStoreError::Reply("no Redis URL configured".into()));
    };
    // One URL may still name a Cluster node: INFO says so.
    if config.urls.len() == 1 {
        // The one place the password leaves its `RedisUrl`: to connect.
        let client = ::redis::Client::open(first.expose_credentials())?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200))
            .set_number_of_retries(6);
        let manager = ConnectionManager::new_with_config(client, manager_config).await?;
        let connection = Connection::Single(manager);
        let info = text_of(&connection.query::<Value>(&::redis::cmd("INFO")).await?);
        check_version(&info)?;
        if !info.contains("cluster_enabled:1") {
            return Ok(connection);
        }
    }
    let client = ClusterClientBuilder::new(config.urls.iter().map(RedisUrl::expose_credentials))
        .connection_timeout(Duration::from_secs(1))
        .response_timeout(config.timeout.max(Duration::from_millis(100)))
        .retries(3)
        .min_retry_wait(10)
        .max_retry_wait(100)
        .build()?;
    let connection = Connection::Cluster(client.get_async_connection().await?);
    let info = text_of(&connection.query::<Value>(&::redis::cmd("INFO")).await?);
    check_version(&info)?;
    Ok(connection)
}

/// Every string inside a reply (a Cluster answers INFO per node).
fn text_of(value: &Value) -> String {
    fn walk(value: &Value, out: &mut String) {
        match value {
            Value::BulkString(bytes) => out.push_str(&String::from_utf8_lossy(bytes)),
            Value::SimpleString(text) | Value::VerbatimString { text, .. } => out.push_str(text),
            Value::Array(values) | Value::Set(values) => {
                values.iter().for_each(|value| walk(value, out));
            }
            Value::Map(pairs) => pairs.iter().for_each(|(key, value)| {
                walk(key, out);
                out.push('\n');
                walk(value, out);
            }),
            _ => {}
        }
        out.push('\n');
    }
    let mut out = String::new();
    walk(value, &mut out);
    out
}

/// Every node must be recent enough.
fn check_version(info: &str) -> Result<(), RedisStoreError> {
    let mut found = false;
    for line in info.lines() {
        let Some(version) = line.trim().strip_prefix("redis_version:") else {
            continue;
        };
        found = true;
        let mut parts = version
            .split('.')
            .map(|part| part.parse::<u32>().unwrap_or(0));
        let major = parts.next().unwrap_or(0);
        let minor = parts.next().unwrap_or(0);
        if (major, minor) < MIN_VERSION {
            return Err(RedisStoreError::Version {
                found: version.to_owned(),
            });
        }
    }
    if found {
        Ok(())
    } else {
        Err(RedisStoreError::Reply("INFO names no redis_version".into()))
    }
}

fn spawn_supervised(store: Weak<Inner>, tick: Duration) {
    // The background task must not die silently: if it ever panics, it is
    // counted, logged and restarted. It holds only a weak reference, so
    // dropping the store ends it.
    tokio::spawn(async move {
        loop {
            let worker = tokio::spawn(run_background(store.clone(), tick));
            match worker.await {
                Err(error) if error.is_panic() => {
                    let Some(inner) = store.upgrade() else { return };
                    bump(&inner.counters.task_restarts, 1);
                    drop(inner);
                    tracing::error!(
                        "the Redis budget store's background task panicked; restarting it"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => return,
            }
        }
    });
}

async fn run_background(store: Weak<Inner>, tick: Duration) {
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_housekeeping = Instant::now();
    loop {
        interval.tick().await;
        let Some(inner) = store.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        inner.background_round(&mut last_housekeeping).await;
    }
}

impl Inner {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// The one deadline of a store call: every Redis request the call
    /// makes (admission, the bucket script, a view before a lease, waiting
    /// for another task's lease) shares it, so the call answers within the
    /// timeout however many requests it needs.
    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn leasing(&self) -> bool {
        self.mode == RedisMode::Leased && !self.closed.load(Ordering::Acquire)
    }

    fn note(&self, transition: Transition) {
        match transition {
            Transition::Opened => tracing::warn!(
                "Redis budget store unreachable; answering from each upstream's on_unavailable policy"
            ),
            Transition::Closed => tracing::info!("Redis budget store reachable again"),
            Transition::None => {}
        }
    }

    /// Sends one request, bounded by the timeout and by `deadline`.
    async fn call<T>(
        &self,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, Failure> {
        if !self.circuit.allow() {
            return Err(Failure::NotSent);
        }
        self.send(deadline, request).await
    }

    async fn send<T>(
        &self,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, Failure> {
        let started = Instant::now();
        let full = started + self.timeout;
        let limit = full.min(deadline);
        if limit <= started {
            return Err(Failure::NotSent);
        }
        match tokio::time::timeout_at(limit, request).await {
            Ok(Ok(value)) => {
                self.note(self.circuit.success());
                Ok(value)
            }
            Ok(Err(error)) => {
                bump(&self.counters.errors, 1);
                tracing::debug!(%error, "Redis budget store call failed");
                self.note(self.circuit.failure());
                Err(Failure::Unknown(RedisStoreError::Redis(error)))
            }
            Err(_) => {
                bump(&self.counters.errors, 1);
                bump(&self.counters.timeouts, 1);
                // A request that had at least half the timeout to answer
                // says Redis is slow; one sent with only the end of its
                // call's deadline left (after a slow admission, or a wait
                // for another task's lease) says little about it.
                if limit.duration_since(started) >= self.timeout / 2 {
                    self.note(self.circuit.failure());
                }
                Err(Failure::Unknown(RedisStoreError::Timeout))
            }
        }
    }

    /// Runs a bucket script on one upstream's keys.
    async fn run_bucket(
        &self,
        script: &Script,
        upstream: &str,
        config: &BucketConfig,
        extra: &[&str],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        let keys = self.keys.upstream(upstream);
        let mut invocation = script.prepare_invoke();
        invocation
            .key(&keys.bucket)
            .key(&keys.switch)
            .key(&keys.leases)
            .arg(config.capacity_units())
            .arg(config.initial_units())
            // The shortest text that reads back as the same double, so the
            // script's arithmetic is BucketConfig::refill's.
            .arg(format!("{:?}", config.floor_units_per_nano()))
            .arg(IDLE_TTL_MS);
        for argument in extra {
            invocation.arg(*argument);
        }
        let values: Vec<i64> = self
            .call(deadline, self.connection.invoke(&invocation))
            .await?;
        Reply::parse(&values).map_err(Failure::Unknown)
    }

    // ----- the index of upstreams -----

    /// The upstream's local state, admitting it to the fleet-wide index
    /// first if this replica does not know it to be there.
    async fn admitted(
        &self,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<Arc<Upstream>, Result<Failure, StoreError>> {
        if let Some(known) = self.upstreams.get(upstream) {
            if known.index_until.load(Ordering::Acquire) > self.now_ms() {
                *lock(&known.config) = *config;
                return Ok(Arc::clone(known.value()));
            }
        }
        let mut invocation = self.scripts.admit.prepare_invoke();
        invocation
            .key(self.keys.index())
            .arg(upstream)
            .arg(self.max_upstreams)
            .arg(INDEX_SLACK_MS);
        let values: Vec<i64> = self
            .call(deadline, self.connection.invoke(&invocation))
            .await
            .map_err(Ok)?;
        let [admitted, score, now_ms] = values[..] else {
            return Err(Ok(Failure::Unknown(RedisStoreError::Reply(format!(
                "admission answered {values:?}"
            )))));
        };
        if admitted != 1 {
            return Err(Err(StoreError::TooManyUpstreams {
                limit: self.max_upstreams,
            }));
        }
        let state = Arc::clone(
            self.upstreams
                .entry(upstream.into())
                .or_insert_with(|| Arc::new(Upstream::new(config, self.lease_units)))
                .value(),
        );
        *lock(&state.config) = *config;
        let score = if score < 0 { INF_SCORE } else { score as u64 };
        self.set_index(&state, score, now_ms);
        Ok(state)
    }

    /// [`BudgetStore::admit`]: one script on the index admits every
    /// upstream the replica does not know to be there for a while yet, all
    /// or none; with Redis unreachable, [`Inner::admit_locally`].
    async fn admit(&self, upstreams: &[(&str, &BucketConfig)]) -> Result<(), StoreError> {
        if !self.circuit.is_up() {
            return self.admit_locally(upstreams, Failure::NotSent).await;
        }
        let soon = self.now_ms().saturating_add(ADMISSION_MARGIN_MS);
        let mut asked: Vec<(&str, &BucketConfig)> = upstreams
            .iter()
            .filter(|(upstream, _)| {
                self.upstreams
                    .get(*upstream)
                    .is_none_or(|known| known.index_until.load(Ordering::Acquire) <= soon)
            })
            .copied()
            .collect();
        if asked.is_empty() {
            return Ok(());
        }
        asked.sort_unstable_by(|a, b| a.0.cmp(b.0));
        asked.dedup_by(|a, b| a.0 == b.0);
        let mut invocation = self.scripts.admit_all.prepare_invoke();
        invocation
            .key(self.keys.index())
            .arg(self.max_upstreams)
            .arg(INDEX_SLACK_MS);
        for (upstream, _) in &asked {
            invocation.arg(*upstream);
        }
        let values: Vec<i64> = match self
            .call(self.deadline(), self.connection.invoke(&invocation))
            .await
        {
            Ok(values) => values,
            Err(failure) => return self.admit_locally(upstreams, failure).await,
        };
        let (now_ms, scores) = match values[..] {
            [0, _] => {
                return Err(StoreError::TooManyUpstreams {
                    limit: self.max_upstreams,
                });
            }
            [1, now_ms, ref scores @ ..] if scores.len() == asked.len() => (now_ms, scores),
            _ => {
                let failure = Failure::Unknown(RedisStoreError::Reply(format!(
                    "admission answered {values:?}"
                )));
                return self.admit_locally(upstreams, failure).await;
            }
        };
        for ((upstream, config), score) in asked.iter().zip(scores) {
            let state = Arc::clone(
                self.upstreams
                    .entry((*upstream).into())
                    .or_insert_with(|| Arc::new(Upstream::new(config, self.lease_units)))
                    .value(),
            );
            *lock(&state.config) = **config;
            let score = if *score < 0 { INF_SCORE } else { *score as u64 };
            self.set_index(&state, score, now_ms);
        }
        Ok(())
    }

    /// Admission while Redis is unreachable: the deposits that follow will
    /// go where each upstream's `on_unavailable` sends them. If one of them
    /// denies, its deposit would fail, so the report is refused whole;
    /// otherwise every upstream is admitted to the local fallback (all or
    /// none), where deposits Redis never saw go.
    async fn admit_locally(
        &self,
        upstreams: &[(&str, &BucketConfig)],
        failure: Failure,
    ) -> Result<(), StoreError> {
        if upstreams
            .iter()
            .any(|(_, config)| config.on_unavailable == OnUnavailable::Deny)
        {
            bump(&self.counters.unavailable, 1);
            return Err(failure.into_error());
        }
        let local: Vec<(&str, BucketConfig)> = upstreams
            .iter()
            .map(|(upstream, config)| (*upstream, local_config(config)))
            .collect();
        let local: Vec<(&str, &BucketConfig)> = local
            .iter()
            .map(|(upstream, config)| (*upstream, config))
            .collect();
        self.fallback.admit(&local).await
    }

    fn set_index(&self, state: &Upstream, score: u64, server_now_ms: i64) {
        state.index_score.store(score, Ordering::Release);
        let until = if score >= FAR_SCORE {
            u64::MAX
        } else {
            self.now_ms()
                .saturating_add(score.saturating_sub(server_now_ms.max(0) as u64))
        };
        state.index_until.store(until, Ordering::Release);
    }

    /// After a write: the index entry must outlive the bucket, and read
    /// `+inf` exactly while retries are off. Returns the score to write, if
    /// this caller is the one to write it.
    fn index_update(&self, state: &Upstream, reply: &Reply) -> Option<u64> {
        let desired = match reply.index {
            -1 => INF_SCORE,
            -3 => FAR_SCORE,
            expiry if expiry >= 0 => expiry as u64 + INDEX_SLACK_MS,
            _ => return None,
        };
        let known = state.index_score.load(Ordering::Acquire);
        let stale = if known == 0 || desired >= FAR_SCORE || known >= FAR_SCORE {
            desired != known
        } else {
            reply.index as u64 > known
        };
        (stale
            && state
                .index_score
                .compare_exchange(known, desired, Ordering::AcqRel, Ordering::Acquire)
                .is_ok())
        .then(|| {
            self.set_index(state, desired, reply.now_ms);
            desired
        })
    }

    async fn write_index(&self, upstream: &str, state: &Upstream, score: u64, deadline: Instant) {
        let score_text = if score == INF_SCORE {
            "+inf".to_owned()
        } else {
            score.to_string()
        };
        let mut command = ::redis::cmd("ZADD");
        command.arg(self.keys.index()).arg(score_text).arg(upstream);
        if self
            .call(deadline, self.connection.query::<i64>(&command))
            .await
            .is_err()
        {
            // Try again on the next write.
            state.index_score.store(0, Ordering::Release);
        }
    }

    /// Everything a bucket reply teaches this replica.
    fn after_write(self: &Arc<Self>, upstream: &str, state: &Arc<Upstream>, reply: &Reply) {
        self.note_switch(upstream, reply.enabled);
        if self.mode == RedisMode::Leased {
            state.remember(reply);
        }
        if let Some(score) = self.index_update(state, reply) {
            // Off the request path: an index refresh is bookkeeping.
            let inner = Arc::clone(self);
            let state = Arc::clone(state);
            let upstream = upstream.to_owned();
            tokio::spawn(async move {
                let deadline = Instant::now() + inner.timeout;
                inner.write_index(&upstream, &state, score, deadline).await;
            });
        }
    }

    fn note_switch(&self, upstream: &str, enabled: bool) {
        let known_off = self
            .disabled
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(upstream);
        if known_off == enabled {
            let mut disabled = self
                .disabled
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if enabled {
                disabled.remove(upstream);
            } else if disabled.len() < self.max_upstreams {
                disabled.insert(upstream.into());
            }
        }
    }

    fn is_known_off(&self, upstream: &str) -> bool {
        self.disabled
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(upstream)
    }

    // ----- answers while Redis is unreachable -----

    /// A view while Redis is unreachable: the local bucket plus this
    /// replica's lease, under the last known kill switch.
    async fn fallback_view(
        &self,
        upstream: &str,
        config: &BucketConfig,
        leased_units: u64,
    ) -> Result<(BudgetCheck, bool), StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                let mut check = self
                    .fallback
                    .check(upstream, &local_config(config), false)
                    .await?;
                check.tokens += units_to_tokens(leased_units);
                check.retries_enabled &= !self.is_known_off(upstream);
                Ok((check, true))
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(unavailable(RedisStoreError::CircuitOpen))
            }
        }
    }

    /// A decision's check while Redis is unreachable (exact mode): the local
    /// bucket, under the last known kill switch.
    async fn fallback_check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        failure: Failure,
    ) -> Result<BudgetCheck, StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                let off = self.is_known_off(upstream);
                let mut check = self
                    .fallback
                    .check(upstream, &local_config(config), !off)
                    .await?;
                check.retries_enabled &= !off;
                Ok(check)
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }

    async fn fallback_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
        failure: Failure,
    ) -> Result<Option<f64>, StoreError> {
        match config.on_unavailable {
            OnUnavailable::Local => {
                bump(&self.counters.fallbacks, 1);
                self.fallback
                    .try_withdraw(upstream, &local_config(config))
                    .await
            }
            OnUnavailable::Deny => {
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }

    async fn fallback_deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        failure: Failure,
    ) -> Result<(), StoreError> {
        match (config.on_unavailable, failure) {
            // Redis never saw these requests: the local bucket may have them.
            (OnUnavailable::Local, Failure::NotSent) => {
                bump(&self.counters.fallbacks, 1);
                self.fallback
                    .deposit(upstream, &local_config(config), requests)
                    .await
            }
            // Redis may have counted them: counting them again could grant
            // twice, so they are lost.
            (OnUnavailable::Local, Failure::Unknown(_)) => {
                bump(&self.counters.lost_deposits, requests);
                Ok(())
            }
            (OnUnavailable::Deny, failure) => {
                bump(&self.counters.lost_deposits, requests);
                bump(&self.counters.unavailable, 1);
                Err(failure.into_error())
            }
        }
    }

    // ----- the operations -----

    /// The budget without spending, and whether it is tracked.
    async fn view(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<(BudgetCheck, bool), StoreError> {
        let now = Instant::now();
        let state = if self.leasing() {
            self.upstreams
                .get(upstream)
                .map(|entry| Arc::clone(entry.value()))
        } else {
            None
        };
        // While Redis is believed down a cached reading is not trusted: the
        // upstream's on_unavailable policy answers.
        let (local, cached) = match &state {
            Some(state) => (
                state.local_units(now, config),
                state
                    .cached(now, self.view_cache)
                    .filter(|_| self.circuit.is_up()),
            ),
            None => (0, None),
        };
        let shared = match cached {
            Some(shared) => shared,
            None => {
                let reply = match self
                    .run_bucket(&self.scripts.view, upstream, config, &[], deadline)
                    .await
                {
                    Ok(reply) => reply,
                    Err(_) => {
                        let leased = state.as_ref().map_or(0, |state| state.lease_units(now));
                        return self.fallback_view(upstream, config, leased).await;
                    }
                };
                self.note_switch(upstream, reply.enabled);
                if let Some(state) = &state {
                    state.remember(&reply);
                }
                if !reply.tracked && state.is_none() {
                    return Ok((
                        BudgetCheck {
                            tokens: units_to_tokens(reply.tokens),
                            retries_enabled: reply.enabled,
                            withdrew: false,
                        },
                        false,
                    ));
                }
                Shared {
                    units: reply.tokens,
                    enabled: reply.enabled,
                    read_at: now,
                }
            }
        };
        Ok((
            BudgetCheck {
                tokens: units_to_tokens(
                    shared
                        .units
                        .saturating_add(local)
                        .min(config.capacity_units()),
                ),
                retries_enabled: shared.enabled,
                withdrew: false,
            },
            true,
        ))
    }

    /// A decision's business with the budget (see [`BudgetStore::check`]).
    /// Exact mode: one script that reads and, if asked, withdraws. Leased
    /// mode: the view (this replica's lease and a cached reading of the
    /// shared bucket, so usually no round trip), then the lease.
    async fn check(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
    ) -> Result<BudgetCheck, StoreError> {
        let deadline = self.deadline();
        if !withdraw {
            return Ok(self.view(upstream, config, deadline).await?.0);
        }
        if self.leasing() {
            let (view, _) = self.view(upstream, config, deadline).await?;
            if !view.retries_enabled || view.tokens < 1.0 {
                return Ok(view);
            }
            return Ok(match self.try_withdraw(upstream, config, deadline).await? {
                Some(left) => BudgetCheck {
                    tokens: left,
                    retries_enabled: true,
                    withdrew: true,
                },
                // Less than a whole token, however much the view promised.
                None => BudgetCheck {
                    tokens: 0.0,
                    retries_enabled: true,
                    withdrew: false,
                },
            });
        }
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return self.fallback_check(upstream, config, failure).await,
            Err(Err(refused)) => return Err(refused),
        };
        match self
            .run_bucket(&self.scripts.check, upstream, config, &["1"], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(BudgetCheck {
                    tokens: units_to_tokens(reply.tokens),
                    retries_enabled: reply.enabled,
                    withdrew: reply.result == 1,
                })
            }
            Err(failure) => self.fallback_check(upstream, config, failure).await,
        }
    }

    async fn try_withdraw(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return self.fallback_withdraw(upstream, config, failure).await,
            Err(Err(refused)) => return Err(refused),
        };
        if self.leasing() {
            return self
                .leased_withdraw(upstream, config, &state, deadline)
                .await;
        }
        match self
            .run_bucket(&self.scripts.withdraw, upstream, config, &[], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok((reply.result == 1).then(|| units_to_tokens(reply.tokens)))
            }
            Err(failure) => self.fallback_withdraw(upstream, config, failure).await,
        }
    }

    fn leased_left(&self, state: &Upstream, left: u64, config: &BucketConfig) -> f64 {
        let shared = lock(&state.shared).map_or(0, |shared| shared.units);
        units_to_tokens(left.saturating_add(shared).min(config.capacity_units()))
    }

    async fn leased_withdraw(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        state: &Arc<Upstream>,
        deadline: Instant,
    ) -> Result<Option<f64>, StoreError> {
        // `deny` means no retry while Redis is down, lease or not; `local`
        // spends what its lease already reserved before its local bucket.
        if !self.circuit.is_up() && config.on_unavailable == OnUnavailable::Deny {
            return self
                .fallback_withdraw(upstream, config, Failure::NotSent)
                .await;
        }
        if let Some(left) = state.spend(Instant::now()) {
            return Ok(Some(self.leased_left(state, left, config)));
        }
        // The lease is dry or expired: one task asks Redis for another while
        // the others wait for its answer rather than each asking in turn.
        let generation = state.acquisitions.load(Ordering::Acquire);
        let Ok(_guard) = tokio::time::timeout_at(deadline, state.acquiring.lock()).await else {
            return self
                .fallback_withdraw(upstream, config, Failure::Unknown(RedisStoreError::Timeout))
                .await;
        };
        if state.acquisitions.load(Ordering::Acquire) != generation {
            if let Some(left) = state.spend(Instant::now()) {
                return Ok(Some(self.leased_left(state, left, config)));
            }
            match state.last_acquisition.load(Ordering::Acquire) {
                EMPTY => return Ok(None),
                FAILED => {
                    return self
                        .fallback_withdraw(upstream, config, Failure::NotSent)
                        .await;
                }
                // Others spent that lease already: take a new one.
                _ => {}
            }
        }
        let outcome = self.acquire(upstream, config, state, deadline).await;
        let (code, answer) = match outcome {
            Ok(Some(left)) => (ACQUIRED, Ok(Some(self.leased_left(state, left, config)))),
            Ok(None) => (EMPTY, Ok(None)),
            Err(failure) => (
                FAILED,
                self.fallback_withdraw(upstream, config, failure).await,
            ),
        };
        state.last_acquisition.store(code, Ordering::Release);
        state.acquisitions.fetch_add(1, Ordering::AcqRel);
        answer
    }

    /// Takes a new lease and spends one token of it. `Ok(Some(left))`: a
    /// token was granted; `Ok(None)`: the bucket had no whole token.
    async fn acquire(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        state: &Arc<Upstream>,
        deadline: Instant,
    ) -> Result<Option<u64>, Failure> {
        // The previous lease (dry, or expired with tokens left) goes back in
        // the same script: until then it occupies room in the bucket.
        let previous = lock(&state.lease).take();
        let (previous_member, previous_unused) = match &previous {
            Some(lease) => (
                lease.member.as_str(),
                lease.remaining.swap(0, Ordering::AcqRel),
            ),
            None => ("", 0),
        };
        let taken_at = Instant::now();
        let end = match &previous {
            Some(_) if previous_unused > 0 => LeaseEnd::LeftOver,
            Some(lease) if taken_at.duration_since(lease.taken_at) <= self.lease_ttl / 4 => {
                LeaseEnd::DrainedQuickly
            }
            _ => LeaseEnd::Drained,
        };
        // Resized even without a previous lease: the capacity may have
        // been lowered since.
        let requested = state.resize_lease(end, self.lease_units, self.lease_cap(config));
        let sequence = self.lease_sequence.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{sequence}", self.replica);
        let spend_until = taken_at + self.lease_ttl / 2;
        let lease_units = requested.to_string();
        let ttl_ms = (self.lease_ttl.as_millis() as u64).max(1).to_string();
        let unused = previous_unused.to_string();
        let result = self
            .run_bucket(
                &self.scripts.acquire,
                upstream,
                config,
                &[&id, &lease_units, &ttl_ms, previous_member, &unused],
                deadline,
            )
            .await;
        let reply = match result {
            Ok(reply) => reply,
            Err(failure) => {
                if let Some(lease) = previous {
                    match failure {
                        // Redis saw nothing: return the old lease later.
                        Failure::NotSent => {
                            self.queue_return(upstream, state, &lease, previous_unused)
                        }
                        // It may have been credited back, or not: forfeit.
                        Failure::Unknown(_) => {
                            bump(&self.counters.forfeited_units, previous_unused);
                        }
                    }
                }
                return Err(failure);
            }
        };
        bump(&self.counters.lease_acquisitions, 1);
        self.after_write(upstream, state, &reply);
        let taken = reply.result.max(0) as u64;
        if taken < UNITS_PER_TOKEN {
            return Ok(None);
        }
        let left = taken - UNITS_PER_TOKEN;
        *lock(&state.lease) = Some(Arc::new(Lease {
            member: format!("{id}:{taken}"),
            remaining: AtomicU64::new(left),
            taken_at,
            spend_until,
        }));
        Ok(Some(left))
    }

    /// Takes the upstream's lease out of use if it has expired (or always,
    /// with `all`), queueing what it has left for return.
    fn retire_lease(&self, upstream: &str, state: &Upstream, now: Instant, all: bool) {
        let lease = {
            let mut slot = lock(&state.lease);
            match slot.as_ref() {
                Some(lease) if all || now >= lease.spend_until => slot.take(),
                _ => None,
            }
        };
        let Some(lease) = lease else { return };
        // A spender racing with this swap either took its token first or
        // finds nothing: the same unit is never both spent and returned.
        let units = lease.remaining.swap(0, Ordering::AcqRel);
        if units > 0 {
            state.resize_lease(
                LeaseEnd::LeftOver,
                self.lease_units,
                self.lease_cap(&state.config()),
            );
        }
        // Returned even when dry: a live lease occupies room in the bucket.
        self.queue_return(upstream, state, &lease, units);
    }

    /// The largest lease of a bucket (see [`lease_cap`]).
    fn lease_cap(&self, config: &BucketConfig) -> u64 {
        lease_cap(
            self.lease_units,
            self.max_lease_units,
            config.capacity_units(),
        )
    }

    fn queue_return(&self, upstream: &str, state: &Upstream, lease: &Lease, units: u64) {
        let mut returns = lock(&self.returns);
        if returns.len() >= self.max_upstreams.max(64) {
            bump(&self.counters.forfeited_units, units);
            return;
        }
        returns.push(Return {
            upstream: upstream.into(),
            member: lease.member.clone(),
            units,
            config: state.config(),
        });
    }

    async fn deposit(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> Result<(), StoreError> {
        let deadline = self.deadline();
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => {
                return self
                    .fallback_deposit(upstream, config, requests, failure)
                    .await;
            }
            Err(Err(refused)) => return Err(refused),
        };
        if self.leasing() {
            if !self.circuit.is_up() {
                // Not batched for a Redis that is down: the policy answers.
                return self
                    .fallback_deposit(upstream, config, requests, Failure::NotSent)
                    .await;
            }
            // Counted under the map's lock, so housekeeping cannot drop the
            // entry between the lookup and the count.
            let entry = self
                .upstreams
                .entry(upstream.into())
                .or_insert_with(|| Arc::clone(&state));
            entry.pending_requests.fetch_add(requests, Ordering::AcqRel);
            return Ok(());
        }
        let units = config.deposit_units(requests).to_string();
        match self
            .run_bucket(&self.scripts.deposit, upstream, config, &[&units], deadline)
            .await
        {
            Ok(reply) => {
                self.after_write(upstream, &state, &reply);
                Ok(())
            }
            Err(failure) => {
                self.fallback_deposit(upstream, config, requests, failure)
                    .await
            }
        }
    }

    async fn set_retries_enabled(
        self: &Arc<Self>,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> Result<bool, StoreError> {
        let deadline = self.deadline();
        let state = match self.admitted(upstream, config, deadline).await {
            Ok(state) => state,
            Err(Ok(failure)) => return Err(failure.into_error()),
            Err(Err(refused)) => return Err(refused),
        };
        if !enabled {
            // Mark the index first, so the entry of a switched-off upstream
            // never lapses while it is off.
            state.index_score.store(INF_SCORE, Ordering::Release);
            self.write_index(upstream, &state, INF_SCORE, deadline)
                .await;
        }
        let argument = if enabled { "1" } else { "0" };
        let reply = self
            .run_bucket(
                &self.scripts.set_enabled,
                upstream,
                config,
                &[argument],
                deadline,
            )
            .await
            .map_err(Failure::into_error)?;
        self.note_switch(upstream, reply.enabled);
        if self.mode == RedisMode::Leased {
            state.remember(&reply);
        }
        if let Some(score) = self.index_update(&state, &reply) {
            self.write_index(upstream, &state, score, deadline).await;
        }
        Ok(reply.result == 1)
    }

    async fn list<F>(self: &Arc<Self>, config_of: F) -> Result<Vec<BudgetSnapshot>, StoreError>
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        let mut invocation = self.scripts.list.prepare_invoke();
        invocation.key(self.keys.index());
        let names: Vec<String> = self
            .call(self.deadline(), self.connection.invoke(&invocation))
            .await
            .map_err(Failure::into_error)?;
        let wanted: Vec<(String, BucketConfig)> = names
            .into_iter()
            .map(|name| {
                let config = config_of(&name);
                (name, config)
            })
            .collect();
        let readings: Vec<_> = futures::stream::iter(wanted)
            .map(|(name, config)| async move {
                let reply = self
                    .run_bucket(
                        &self.scripts.view,
                        &name,
                        &config,
                        &[],
                        Instant::now() + self.timeout,
                    )
                    .await;
                (name, config, reply)
            })
            .buffer_unordered(FAN_OUT)
            .collect()
            .await;
        let now = Instant::now();
        let mut snapshots = Vec::with_capacity(readings.len());
        for (name, config, reply) in readings {
            let reply = reply.map_err(Failure::into_error)?;
            if !reply.tracked {
                continue;
            }
            let local = self
                .upstreams
                .get(name.as_str())
                .map_or(0, |state| state.local_units(now, &config));
            snapshots.push(BudgetSnapshot {
                tokens: units_to_tokens(
                    reply
                        .tokens
                        .saturating_add(local)
                        .min(config.capacity_units()),
                ),
                retries_enabled: reply.enabled,
                tracked: true,
                upstream: name,
            });
        }
        snapshots.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        Ok(snapshots)
    }

    // ----- background work -----

    async fn background_round(self: &Arc<Self>, last_housekeeping: &mut Instant) {
        if !self.circuit.is_up() && self.circuit.claim_probe() {
            let invocation = self.scripts.probe.prepare_invoke();
            let _ = self
                .send(
                    Instant::now() + self.timeout,
                    self.connection.invoke::<i64>(&invocation),
                )
                .await;
        }
        if self.mode == RedisMode::Leased {
            self.settle_leases(false).await;
        }
        if last_housekeeping.elapsed() >= HOUSEKEEPING_INTERVAL {
            *last_housekeeping = Instant::now();
            self.housekeeping().await;
        }
    }

    async fn flush_deposits(self: &Arc<Self>) {
        let due: Vec<(Box<str>, Arc<Upstream>)> = self
            .upstreams
            .iter()
            .filter(|entry| entry.pending_requests.load(Ordering::Acquire) > 0)
            .map(|entry| (entry.key().clone(), Arc::clone(entry.value())))
            .collect();
        futures::stream::iter(due)
            .for_each_concurrent(FAN_OUT, |(upstream, state)| async move {
                self.flush_one(&upstream, &state).await;
            })
            .await;
    }

    async fn flush_one(self: &Arc<Self>, upstream: &str, state: &Arc<Upstream>) {
        let requests = state.pending_requests.swap(0, Ordering::AcqRel);
        if requests == 0 {
            return;
        }
        let config = state.config();
        let units = config.deposit_units(requests);
        state.in_flight_units.fetch_add(units, Ordering::AcqRel);
        let text = units.to_string();
        let result = self
            .run_bucket(
                &self.scripts.deposit,
                upstream,
                &config,
                &[&text],
                Instant::now() + self.timeout,
            )
            .await;
        match result {
            Ok(reply) => self.after_write(upstream, state, &reply),
            Err(failure) => {
                // Counted inside; nobody waits for this answer.
                let _ = self
                    .fallback_deposit(upstream, &config, requests, failure)
                    .await;
            }
        }
        state.in_flight_units.fetch_sub(units, Ordering::AcqRel);
    }

    async fn return_leases(self: &Arc<Self>) {
        let due = std::mem::take(&mut *lock(&self.returns));
        if due.is_empty() {
            return;
        }
        futures::stream::iter(due)
            .for_each_concurrent(FAN_OUT, |lease| async move {
                let unused = lease.units.to_string();
                let result = self
                    .run_bucket(
                        &self.scripts.release,
                        &lease.upstream,
                        &lease.config,
                        &[&lease.member, &unused],
                        Instant::now() + self.timeout,
                    )
                    .await;
                let credited = match result {
                    Ok(reply) => {
                        if let Some(state) = self.upstreams.get(&*lease.upstream) {
                            state.remember(&reply);
                        }
                        (reply.result.max(0) as u64).min(lease.units)
                    }
                    Err(_) => 0,
                };
                // Whatever was not credited back (the lease had expired in
                // Redis, the return failed, or capacity capped it) is lost
                // to the budget: fewer retries, never more.
                bump(&self.counters.forfeited_units, lease.units - credited);
            })
            .await;
    }

    async fn housekeeping(self: &Arc<Self>) {
        if self.circuit.is_up() {
            let mut command = ::redis::cmd("ZRANGEBYSCORE");
            command.arg(self.keys.index()).arg("+inf").arg("+inf");
            if let Ok(names) = self
                .call(
                    Instant::now() + self.timeout,
                    self.connection.query::<Vec<String>>(&command),
                )
                .await
            {
                let fresh: HashSet<Box<str>> = names
                    .into_iter()
                    .take(self.max_upstreams)
                    .map(String::into_boxed_str)
                    .collect();
                *self
                    .disabled
                    .write()
                    .unwrap_or_else(PoisonError::into_inner) = fresh;
            }
        }
        // Forget upstreams whose index entry lapsed and that hold nothing.
        let now_ms = self.now_ms();
        self.upstreams.retain(|_, state| {
            state.index_until.load(Ordering::Acquire) > now_ms
                || Arc::strong_count(state) > 1
                || state.has_lease()
                || state.pending_requests.load(Ordering::Acquire) > 0
                || state.in_flight_units.load(Ordering::Acquire) > 0
        });
    }

    async fn shutdown(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.mode == RedisMode::Leased {
            self.settle_leases(true).await;
        }
    }

    /// Flushes batched deposits, retires leases (expired ones, or `all` of
    /// them at shutdown) and hands their unspent tokens back to Redis.
    async fn settle_leases(self: &Arc<Self>, all: bool) {
        self.flush_deposits().await;
        let now = Instant::now();
        let holding: Vec<(Box<str>, Arc<Upstream>)> = self
            .upstreams
            .iter()
            .map(|entry| (entry.key().clone(), Arc::clone(entry.value())))
            .collect();
        for (upstream, state) in holding {
            self.retire_lease(&upstream, &state, now, all);
        }
        self.return_leases().await;
    }
}

impl BudgetStore for RedisBudgetStore {
    fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<BudgetSnapshot, StoreError>> + Send {
        let inner = &self.inner;
        async move {
            let (check, tracked) = inner.view(upstream, config, inner.deadline()).await?;
            Ok(check.into_snapshot(upstream, tracked))
        }
    }

    fn check(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send {
        self.inner.check(upstream, config, withdraw)
    }

    fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send {
        let inner = &self.inner;
        async move { inner.try_withdraw(upstream, config, inner.deadline()).await }
    }

    fn admit(
        &self,
        upstreams: &[(&str, &BucketConfig)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.admit(upstreams)
    }

    fn deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.deposit(upstream, config, requests)
    }

    fn set_retries_enabled(
        &self,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.set_retries_enabled(upstream, config, enabled)
    }

    fn list<F>(
        &self,
        config_of: F,
    ) -> impl Future<Output = Result<Vec<BudgetSnapshot>, StoreError>> + Send
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        self.inner.list(config_of)
    }

    fn is_available(&self) -> bool {
        RedisBudgetStore::is_available(self)
    }

    fn stats(&self) -> StoreStats {
        RedisBudgetStore::stats(self)
    }

    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        self.inner.shutdown()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_checked_on_every_node() {
        assert!(check_version("# Server\r\nredis_version:7.0.15\r\n").is_ok());
        assert!(check_version("redis_version:5.0.0\nredis_version:7.2.4\n").is_ok());
        assert!(check_version("redis_version:7.0.0\nredis_version:4.0.9\n").is_err());
        assert!(check_version("nothing here").is_err());
    }

    #[test]
    fn replies_are_parsed_strictly() {
        let reply = Reply::parse(&[1, 5_000_000, 1, 1, 42, 7]).unwrap();
        assert_eq!(reply.result, 1);
        assert_eq!(reply.tokens, 5_000_000);
        assert!(reply.enabled && reply.tracked);
        assert!(Reply::parse(&[1, 2, 3]).is_err());
    }

    const T: u64 = UNITS_PER_TOKEN;

    #[test]
    fn leases_double_when_drained_quickly_and_halve_when_left_over() {
        let (min, cap) = (5 * T, 1000 * T);
        let next = |size, end| next_lease_units(size, end, min, cap);
        assert_eq!(next(5 * T, LeaseEnd::DrainedQuickly), 10 * T);
        assert_eq!(next(10 * T, LeaseEnd::Drained), 10 * T);
        assert_eq!(next(40 * T, LeaseEnd::LeftOver), 20 * T);
        // Halving stays in whole tokens and never goes below the minimum.
        assert_eq!(next(25 * T, LeaseEnd::LeftOver), 12 * T);
        assert_eq!(next(8 * T, LeaseEnd::LeftOver), 5 * T);
        assert_eq!(next(5 * T, LeaseEnd::LeftOver), 5 * T);
        // Doubling stops at the cap, and never overflows.
        assert_eq!(next(640 * T, LeaseEnd::DrainedQuickly), 1000 * T);
        assert_eq!(next(1000 * T, LeaseEnd::DrainedQuickly), 1000 * T);
        assert_eq!(
            next_lease_units(u64::MAX, LeaseEnd::DrainedQuickly, 0, u64::MAX),
            u64::MAX
        );
        // A lowered cap applies at once, even to a lease that fitted.
        assert_eq!(
            next_lease_units(800 * T, LeaseEnd::Drained, min, 100 * T),
            100 * T
        );
        // From the minimum up to the cap and back, by steps of two.
        let mut size = min;
        let mut grown = vec![size];
        while size < cap {
            size = next(size, LeaseEnd::DrainedQuickly);
            grown.push(size / T);
        }
        assert_eq!(grown[1..], [10, 20, 40, 80, 160, 320, 640, 1000]);
        let mut steps = 0;
        while size > min {
            size = next(size, LeaseEnd::LeftOver);
            steps += 1;
        }
        assert_eq!((size, steps), (min, 8));
    }

    #[test]
    fn leases_are_capped_at_a_quarter_of_the_capacity_in_whole_tokens() {
        // A large bucket: max_lease_tokens caps.
        assert_eq!(lease_cap(5 * T, 1000 * T, 1_000_000_000 * T), 1000 * T);
        // A small one: a quarter of its capacity, in whole tokens.
        assert_eq!(lease_cap(5 * T, 1000 * T, 100 * T), 25 * T);
        assert_eq!(lease_cap(T, 1000 * T, 30 * T), 7 * T);
        assert_eq!(lease_cap(T, 1000 * T, 30 * T + T / 2), 7 * T);
        // Never below lease_tokens, which is what a lease always was.
        assert_eq!(lease_cap(5 * T, 1000 * T, 8 * T), 5 * T);
        assert_eq!(lease_cap(5 * T, 5 * T, 1_000 * T), 5 * T);
    }

    #[test]
    fn an_upstream_starts_at_lease_tokens_and_resizes_atomically() {
        let state = Upstream::new(&BucketConfig::default(), 2 * T);
        assert_eq!(state.lease_size.load(Ordering::Acquire), 2 * T);
        assert_eq!(
            state.resize_lease(LeaseEnd::DrainedQuickly, 2 * T, 100 * T),
            4 * T
        );
        assert_eq!(
            state.resize_lease(LeaseEnd::LeftOver, 2 * T, 100 * T),
            2 * T
        );
        assert_eq!(state.lease_size.load(Ordering::Acquire), 2 * T);
    }

    #[test]
    fn the_fallback_bucket_has_no_initial_tokens_and_no_floor() {
        let config = BucketConfig::default();
        let local = local_config(&config);
        assert_eq!(local.initial, 0.0);
        assert_eq!(local.min_per_second, 0.0);
        assert_eq!(local.capacity, config.capacity);
        assert_eq!(local.ratio, config.ratio);
    }
}
