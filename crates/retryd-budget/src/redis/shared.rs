//! The core both store types share: the connection, the circuit, the
//! scripts, the key space, the local fallback store, this replica's map of
//! the upstreams it knows, the counters; and the one way a request goes to
//! Redis (`call`: guarded by the circuit, bounded by its store call's
//! deadline). It also declares what a mode supplies (`Operations`), which
//! is all that differs between the two stores. It must not hold anything
//! that only one mode needs: that lives in the mode (`M`, and `M::Upstream`
//! per upstream).
//!
//! Its impls are here and in the modules it declares (`shared/`), one per
//! concern; those import this file and the leaf modules below it, never a
//! mode (`exact.rs`, `leased.rs`) nor `redis.rs`, which import this. Among
//! themselves they call one way: `admin` and `direct` use `index` and
//! `fallback`, `index` uses `fallback`; what all of them need of each other
//! (the memory of switched-off upstreams) is here.

mod admin;
mod direct;
mod fallback;
mod hedging;
mod index;
mod reports;
mod rounds;

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use ::redis::{RedisResult, Script};
use dashmap::DashMap;
use tokio::time::Instant;

use super::circuit::Transition;
use super::config::{RedisConfig, RedisMode};
use super::connection::Connection;
use super::error::{Failure, RedisStoreError};
use super::keys::KeySpace;
use super::reachability::{Reachability, Route};
use super::replies::Reply;
use super::scripts::Scripts;
use crate::{
    BucketConfig, BudgetCheck, FleetCall, MemoryBudgetStore, StoreError, StoreStats,
    units_to_tokens,
};

/// A bucket lives at least this long after its last write.
pub(super) const IDLE_TTL_MS: u64 = 60_000;
/// Concurrent calls of one background sweep or of `list`.
pub(super) const FAN_OUT: usize = 32;

/// What a mode supplies to the core, and so the whole of what differs
/// between an exact and a leased store: its own state (`Self`, and
/// `Self::Upstream` beside each upstream's index bookkeeping), the four
/// operations whose answers depend on it, its background round and its
/// shutdown. Called statically, never asked at run time which mode it is.
///
/// Public only in name, so that [`Mode`] can require it: this module
/// is private, so nothing outside the crate can implement or call it.
pub trait Operations: Sized + Send + Sync + 'static {
    /// What this mode keeps per upstream.
    type Upstream: UpstreamState;

    /// How often the background task runs a round.
    const TICK: Duration;

    /// The mode's own state, from the validated configuration.
    fn new(config: &RedisConfig) -> Self;

    /// The per-upstream state of an upstream this replica just learnt of.
    fn upstream(&self) -> Self::Upstream;

    /// [`crate::BudgetStore::view`], with where the reading came from.
    fn view(
        core: &Arc<Core<Self>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<(BudgetCheck, Source), StoreError>> + Send;

    /// [`crate::BudgetStore::check_in_fleet`].
    fn check(
        core: &Arc<Core<Self>>,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
        deadline: Instant,
    ) -> impl Future<Output = Result<BudgetCheck, StoreError>> + Send;

    /// [`crate::BudgetStore::try_withdraw`].
    fn try_withdraw(
        core: &Arc<Core<Self>>,
        upstream: &str,
        config: &BucketConfig,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<f64>, StoreError>> + Send;

    /// [`crate::BudgetStore::deposit`].
    fn deposit(
        core: &Arc<Core<Self>>,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The mode's part of one background round (after the probe).
    fn round(core: &Arc<Core<Self>>) -> impl Future<Output = ()> + Send;

    /// [`crate::BudgetStore::shutdown`]: at least stops the background task.
    fn shutdown(core: &Arc<Core<Self>>) -> impl Future<Output = ()> + Send;
}

/// Where a view's reading came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The shared bucket (with this replica's lease, in leased mode);
    /// `tracked` is false if Redis holds no state for the upstream yet.
    Shared { tracked: bool },
    /// This replica's local fallback bucket: Redis was believed down, or
    /// did not answer.
    Local,
}

/// What the core asks of a mode's per-upstream state, so that the shared
/// code (writes, the kill switch, `list`, housekeeping) need not know it.
pub trait UpstreamState: Send + Sync + 'static {
    /// Learns from a bucket script's reply (a mode that caches readings).
    fn remember(&self, reply: &Reply);

    /// Units this replica holds or owes the shared bucket, to add to a
    /// reading of it.
    fn local_units(&self, now: Instant, config: &BucketConfig) -> u64;

    /// True while forgetting the upstream would lose budget.
    fn holds_anything(&self) -> bool;
}

/// An exact store keeps nothing per upstream beyond the index bookkeeping.
impl UpstreamState for () {
    fn remember(&self, _reply: &Reply) {}

    fn local_units(&self, _now: Instant, _config: &BucketConfig) -> u64 {
        0
    }

    fn holds_anything(&self) -> bool {
        false
    }
}

/// What this replica knows of one admitted upstream.
pub(super) struct Upstream<U> {
    /// Milliseconds since the store's origin until which the index entry is
    /// known live; 0 before admission.
    pub(super) index_until: AtomicU64,
    /// The index score last written or read (server ms, `FAR_SCORE`,
    /// `INF_SCORE`); 0 if unknown.
    pub(super) index_score: AtomicU64,
    /// The bucket parameters last used, for background work.
    pub(super) config: Mutex<BucketConfig>,
    /// The mode's own state for this upstream.
    pub(super) mode: U,
}

impl<U> Upstream<U> {
    pub(super) fn new(config: &BucketConfig, mode: U) -> Upstream<U> {
        Upstream {
            index_until: AtomicU64::new(0),
            index_score: AtomicU64::new(0),
            config: Mutex::new(*config),
            mode,
        }
    }

    pub(super) fn config(&self) -> BucketConfig {
        *lock(&self.config)
    }
}

/// Counters behind [`StoreStats`], both modes'.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) errors: AtomicU64,
    pub(super) timeouts: AtomicU64,
    pub(super) fallbacks: AtomicU64,
    pub(super) unavailable: AtomicU64,
    /// Only a leased store forfeits; an exact one reports 0.
    pub(super) forfeited_units: AtomicU64,
    pub(super) lost_deposits: AtomicU64,
    pub(super) task_restarts: AtomicU64,
}

impl Counters {
    pub(super) fn restarts(&self) -> u64 {
        self.task_restarts.load(Ordering::Relaxed)
    }
}

pub(super) fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; if something did, the data
    // is still a valid value of its type.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How a Redis store keeps its budgets: [`Exact`](super::Exact) or
/// [`Leased`](super::Leased), and no
/// other (the trait is sealed: what a mode must supply is the store's
/// business).
pub trait Mode: Operations {
    /// The `store.mode` this is, for logs and labels.
    const MODE: RedisMode;
}

/// The state of one store, generic over its mode. Public only in name, as
/// [`Operations`] names it; its fields are the `redis` module's.
pub struct Core<M: Operations> {
    pub(super) connection: Connection,
    pub(super) scripts: Scripts,
    pub(super) keys: KeySpace,
    pub(super) timeout: Duration,
    pub(super) max_upstreams: usize,
    /// Which part of Redis is believed reachable (per Cluster master).
    pub(super) reach: Reachability,
    pub(super) fallback: MemoryBudgetStore,
    pub(super) upstreams: DashMap<Box<str>, Arc<Upstream<M::Upstream>>>,
    /// Upstreams whose retries are known to be off, for outages.
    pub(super) disabled: RwLock<HashSet<Box<str>>>,
    pub(super) counters: Counters,
    pub(super) origin: Instant,
    /// Set by `shutdown`: the background task ends, and a leased store
    /// answers as an exact one.
    pub(super) closed: AtomicBool,
    pub(super) mode: M,
}

impl<M: Operations> Core<M> {
    /// Connects (see [`super::RedisBudgetStore::connect`]) and starts the
    /// background task.
    pub(super) async fn connect(
        config: &RedisConfig,
        max_upstreams: usize,
    ) -> Result<Arc<Core<M>>, StoreError> {
        let (connection, scripts) = Connection::open_with_scripts(config).await?;
        let reach = Reachability::new(connection.is_cluster());
        let core = Arc::new(Core {
            connection,
            scripts,
            keys: KeySpace::new(&config.key_prefix),
            timeout: config.timeout,
            max_upstreams,
            reach,
            fallback: MemoryBudgetStore::new(max_upstreams),
            upstreams: DashMap::new(),
            disabled: RwLock::new(HashSet::new()),
            counters: Counters::default(),
            origin: Instant::now(),
            closed: AtomicBool::new(false),
            mode: M::new(config),
        });
        // A Cluster's per-node circuits need its slot map from the start.
        if core.reach.is_cluster() {
            core.refresh_slots().await;
        }
        rounds::spawn_supervised(Arc::downgrade(&core));
        Ok(core)
    }

    pub(super) fn stats(&self) -> StoreStats {
        let counters = &self.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StoreStats {
            backend_errors: load(&counters.errors),
            backend_timeouts: load(&counters.timeouts),
            outages: self.reach.times_opened(),
            fallbacks: load(&counters.fallbacks),
            unavailable_answers: load(&counters.unavailable),
            forfeited_tokens: units_to_tokens(load(&counters.forfeited_units)),
            lost_deposits: load(&counters.lost_deposits),
            evicted_upstreams: 0,
        }
    }

    /// Marks the store shut down, which ends the background task; true
    /// for the one call that did.
    pub(super) fn close(&self) -> bool {
        !self.closed.swap(true, Ordering::AcqRel)
    }

    /// Remembers the kill switch a reply showed, for answers during an
    /// outage (bounded by `max_upstreams`). Here beside `disabled`, not in
    /// `shared/admin.rs`: every script's reply carries the switch, so the
    /// direct, index, fallback and leased code all note or read it.
    pub(super) fn note_switch(&self, upstream: &str, enabled: bool) {
        let known_off = self.is_known_off(upstream);
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

    /// True if a reply last showed `upstream`'s retries switched off.
    pub(super) fn is_known_off(&self, upstream: &str) -> bool {
        self.disabled
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(upstream)
    }

    /// True if the node serving `upstream`'s keys is believed reachable.
    pub(super) fn is_up_for(&self, upstream: &str) -> bool {
        if !self.reach.is_cluster() {
            return self.reach.is_up();
        }
        self.reach.is_up_for(&self.keys.upstream(upstream).bucket)
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// The one deadline of a store call: every Redis request the call
    /// makes (admission, the bucket script, a view before a lease, waiting
    /// for another task's lease) shares it, so the call answers within the
    /// timeout however many requests it needs.
    pub(super) fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// Logs a circuit's state change, once per change: the whole store's,
    /// or one Cluster master's (with the slots whose upstreams it affects).
    fn note(&self, transition: Transition, route: &Route) {
        self.reach.count(transition);
        match (transition, &route.node) {
            (Transition::None, _) => {}
            (Transition::Opened, None) => tracing::warn!(
                "Redis budget store unreachable; answering from each upstream's on_unavailable policy"
            ),
            (Transition::Closed, None) => tracing::info!("Redis budget store reachable again"),
            (Transition::Opened, Some((node, slots))) => tracing::warn!(
                node = %node,
                slots = %slots,
                reachable = self.reach.fraction_up(),
                "Redis Cluster node unreachable; the upstreams in its slots answer from their on_unavailable policy, the others stay shared"
            ),
            (Transition::Closed, Some((node, slots))) => tracing::info!(
                node = %node,
                slots = %slots,
                reachable = self.reach.fraction_up(),
                "Redis Cluster node reachable again"
            ),
        }
    }

    /// Sends one request for `key` (routed to the Cluster node serving its
    /// slot; `None` for a request naming no key), bounded by the timeout
    /// and by `deadline`, unless that node's circuit is open and this
    /// caller does not hold its next probe.
    pub(super) async fn call<T>(
        &self,
        key: Option<&str>,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, Failure> {
        // Not through `call_continuing`: one more async layer around the
        // request doubles its future in a debug build, and a test's stack
        // overflowed.
        let route = self.reach.route(key);
        if !route.circuit.allow() {
            return Err(Failure::NotSent);
        }
        self.send_on(&route, deadline, request, Circuited::Yes)
            .await
            .map(|(value, _)| value)
    }

    /// [`Core::call`] for the first request of a store call that makes
    /// another (an admission before the bucket script): with the answer,
    /// the deadline the call goes on with. That is `deadline`, unless the
    /// answer came only because the wait went on while this process was
    /// starved (see [`within`]): then the next request is given until that
    /// wait's limit. A deadline this process overran says nothing of Redis;
    /// had it stood, the bucket request of a call whose admission was
    /// answered so would never be sent, and the upstream would answer from
    /// the fallback with its Redis master up.
    pub(super) async fn call_continuing<T>(
        &self,
        key: Option<&str>,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<(T, Instant), Failure> {
        let route = self.reach.route(key);
        if !route.circuit.allow() {
            return Err(Failure::NotSent);
        }
        let (value, starved_until) = self
            .send_on(&route, deadline, request, Circuited::Yes)
            .await?;
        Ok((
            value,
            starved_until.map_or(deadline, |until| until.max(deadline)),
        ))
    }

    /// Sends one request for `key` outside the circuit, for what is not on
    /// the decision path (`list`, which a `/metrics` scrape runs): nothing
    /// is sent while the node's circuit is open (nor is its probe taken),
    /// and a failure or timeout neither opens the circuit nor resets the
    /// connection, so that a scrape's many reads can never turn into an
    /// outage for the decisions.
    pub(super) async fn call_outside_circuit<T>(
        &self,
        key: Option<&str>,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, Failure> {
        let route = self.reach.route(key);
        if !route.circuit.is_up() {
            return Err(Failure::NotSent);
        }
        self.send_on(&route, deadline, request, Circuited::No)
            .await
            .map(|(value, _)| value)
    }

    /// Sends one request whatever the circuit says (a probe).
    pub(super) async fn send<T>(
        &self,
        key: Option<&str>,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, Failure> {
        let route = self.reach.route(key);
        self.send_on(&route, deadline, request, Circuited::Yes)
            .await
            .map(|(value, _)| value)
    }

    async fn send_on<T>(
        &self,
        route: &Route,
        deadline: Instant,
        request: impl Future<Output = RedisResult<T>>,
        circuited: Circuited,
    ) -> Result<(T, Option<Instant>), Failure> {
        let counted = circuited == Circuited::Yes;
        let started = Instant::now();
        // A live master may be slow for a moment while the Cluster fails
        // over (see `Patience::Failover`): its call gets one more timeout,
        // for its requests together. A node whose own circuit is not up,
        // and every request outside a Cluster, is not waited for longer.
        let (deadline, patience) =
            if counted && route.node.is_some() && route.circuit.is_up() && self.reach.in_failover()
            {
                let until = deadline + self.timeout;
                (until, Patience::Failover { until })
            } else {
                (deadline, Patience::Timeout)
            };
        let limit = (started + self.timeout).min(deadline);
        if limit <= started {
            tracing::debug!(node = ?route.node, "Redis budget store call not sent: its deadline has passed");
            return Err(Failure::NotSent);
        }
        match within(limit, self.timeout, patience, request)
            .await
            .map(|(answer, starved_until)| answer.map(|value| (value, starved_until)))
        {
            Ok(Ok(answered)) => {
                if counted {
                    self.note(route.circuit.success(), route);
                }
                Ok(answered)
            }
            // redis-rs's own response timeout (100 ms at least, for the
            // requests given longer than the store timeout: the background
            // rounds') is a slow answer, not a failed one: it is counted as
            // a timeout. As a failure, one slow reply to a round opened a
            // live Cluster master's circuit on a starved machine.
            Ok(Err(error)) if !error.is_timeout() => {
                bump(&self.counters.errors, 1);
                tracing::debug!(%error, "Redis budget store call failed");
                // A Cluster redirect is an answer from a live node whose
                // slot moved (a failover in progress): that call fails,
                // but the node's circuit, and its other upstreams, stay.
                if counted && !matches!(error.code(), Some("MOVED" | "ASK" | "TRYAGAIN")) {
                    self.note(route.circuit.failure(), route);
                }
                Err(Failure::Unknown(RedisStoreError::Redis(error)))
            }
            Ok(Err(_)) | Err(_) => {
                bump(&self.counters.errors, 1);
                bump(&self.counters.timeouts, 1);
                tracing::debug!(
                    node = ?route.node,
                    waited_ms = started.elapsed().as_millis() as u64,
                    allowed_ms = limit.duration_since(started).as_millis() as u64,
                    ?patience,
                    "Redis budget store call timed out"
                );
                if !counted {
                    return Err(Failure::Unknown(RedisStoreError::Timeout));
                }
                self.connection.timed_out();
                // A request that had at least half the timeout to answer
                // says Redis is slow; one sent with only the end of its
                // call's deadline left (after a slow admission, or a wait
                // for another task's lease) says little about it.
                if limit.duration_since(started) >= self.timeout / 2 {
                    self.note(route.circuit.timeout(started), route);
                }
                Err(Failure::Unknown(RedisStoreError::Timeout))
            }
        }
    }

    /// Runs a bucket script on one upstream's keys.
    pub(super) async fn run_bucket(
        &self,
        script: &Script,
        upstream: &str,
        config: &BucketConfig,
        extra: &[&str],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        self.run_bucket_with(script, upstream, config, extra, deadline, Circuited::Yes)
            .await
    }

    /// [`Core::run_bucket`], inside the circuit or outside it (see
    /// [`Core::call_outside_circuit`]).
    pub(super) async fn run_bucket_with(
        &self,
        script: &Script,
        upstream: &str,
        config: &BucketConfig,
        extra: &[&str],
        deadline: Instant,
        circuited: Circuited,
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
        let request = self.connection.invoke(Some(&keys.bucket), &invocation);
        let values: Vec<i64> = match circuited {
            Circuited::Yes => self.call(Some(&keys.bucket), deadline, request).await?,
            Circuited::No => {
                self.call_outside_circuit(Some(&keys.bucket), deadline, request)
                    .await?
            }
        };
        Reply::parse(&values).map_err(Failure::Unknown)
    }
}

/// Whether a request's outcome tells the circuit about Redis: yes on the
/// decision path, no for `list`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Circuited {
    /// Counted: failures open the circuit, timeouts reset the connection.
    Yes,
    /// Not counted, and not sent while the circuit is open.
    No,
}

/// How late a timer may fire, or a yield come back, before the process is
/// taken to have been starved of CPU rather than Redis to be slow. On an
/// idle machine both take well under a millisecond (tokio's timers have a
/// 1 ms resolution).
const STARVED: Duration = Duration::from_millis(2);

/// How long a request is waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Patience {
    /// Until its limit (once more if the process, not Redis, was slow).
    Timeout,
    /// A request to a live Cluster master while another is lost or its
    /// replica has just been promoted: once more after its limit, whatever
    /// the cause. Every surviving master then votes for the replica and
    /// saves each new configuration to `nodes.conf` with an `fsync` on its
    /// main thread; traced here (strace) at 0.3 to 13 ms per `fsync` with a
    /// disk busy writing, and a CI run saw one such late answer. A master
    /// that answers a moment late is not lost, and answering from the
    /// fallback would take its upstream out of the shared budget; a master
    /// that is lost times its requests out again and its circuit opens.
    /// The call's deadline is moved by one timeout, to `until`, which
    /// bounds a decision at twice the store timeout, only then.
    Failover { until: Instant },
}

/// `request`'s answer if it comes by `limit`, else `Err(Elapsed)`; with
/// the answer, the limit it was last waited for to when the wait went on
/// because the process was starved (the rest of the call is then given
/// until that limit too: see [`Core::call_continuing`]). The limit is meant
/// to measure Redis, or another task's call to it, and two things made it
/// measure this process instead:
///
/// - The timer and the answer can become ready in the same wake-up: a
///   process the machine did not run for a while finds its timer due and
///   Redis's reply in the socket, and this task can be polled before the
///   connection's reader task has handed the reply over. One yield lets
///   the tasks already woken run; a reply that is there then is an answer.
/// - A timer that fires late, or a yield that takes long, says the process
///   was not running: whatever Redis did, the wait proved nothing. Such a
///   wait goes on once more, `timeout` again, past the store call's
///   deadline. A request that was sent is applied by Redis whether or not
///   this process waits for the reply; a fallback answer would decide a
///   second time, from the local bucket, and take the upstream out of the
///   shared budget, for no latency saved to a caller who waited anyway.
///
/// With [`Patience::Failover`] the wait goes on once more in every case,
/// until the moved deadline at most.
///
/// Measured under `stress-ng --cpu 2` on 2 cores, with a Cluster master
/// lost (tests/redis_cluster_isolation.rs): timers fired up to 29 ms late
/// and a single yield took up to 47 ms, and each such request to a live
/// master had answered from the fallback.
pub(super) async fn within<T>(
    limit: Instant,
    timeout: Duration,
    patience: Patience,
    request: impl Future<Output = T>,
) -> Result<(T, Option<Instant>), tokio::time::error::Elapsed> {
    let mut request = std::pin::pin!(request);
    let mut limit = limit;
    let mut waited_again = false;
    let mut starved_until = None;
    loop {
        let elapsed = match tokio::time::timeout_at(limit, request.as_mut()).await {
            Ok(answer) => return Ok((answer, starved_until)),
            Err(elapsed) => elapsed,
        };
        tokio::task::yield_now().await;
        if let Some(answer) = futures::FutureExt::now_or_never(request.as_mut()) {
            return Ok((answer, starved_until));
        }
        let now = Instant::now();
        let starved = now.saturating_duration_since(limit) >= STARVED;
        if waited_again {
            return Err(elapsed);
        }
        limit = match patience {
            _ if starved => {
                starved_until = Some(now + timeout);
                now + timeout
            }
            Patience::Failover { until } if until > now => {
                tracing::debug!(
                    "a live Redis Cluster master answers late during a failover; waiting once more"
                );
                (now + timeout).min(until)
            }
            _ => return Err(elapsed),
        };
        waited_again = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(20);

    /// A reply that comes 30 ms after the request: late for the 20 ms timeout.
    async fn late_reply() -> &'static str {
        tokio::time::sleep(Duration::from_millis(30)).await;
        "reply"
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_reply_times_out_unless_a_failover_is_under_way() {
        let limit = Instant::now() + TIMEOUT;
        assert!(
            within(limit, TIMEOUT, Patience::Timeout, late_reply())
                .await
                .is_err(),
            "the process ran on time: the timeout holds"
        );
        let limit = Instant::now() + TIMEOUT;
        let until = limit + TIMEOUT;
        let (answer, starved_until) =
            within(limit, TIMEOUT, Patience::Failover { until }, late_reply())
                .await
                .expect("one more wait during a failover");
        assert_eq!(answer, "reply");
        // The caller bounds a failover's waits itself (`until`).
        assert_eq!(starved_until, None);
        // Once more, not twice: a master that stays silent is let go.
        let limit = Instant::now() + TIMEOUT;
        let silent = tokio::time::sleep(Duration::from_secs(1));
        let started = Instant::now();
        let until = limit + TIMEOUT;
        assert!(
            within(limit, TIMEOUT, Patience::Failover { until }, silent)
                .await
                .is_err()
        );
        assert_eq!(started.elapsed(), 2 * TIMEOUT);
    }

    /// A request during which the process did not run: the clock jumps
    /// 25 ms while the request is first polled, past its 20 ms limit, as
    /// when the machine gave the runtime no CPU. Redis answers 10 ms after
    /// that. The wait goes on, and the rest of the call is given until the
    /// new limit, so that a bucket request after an admission answered that
    /// way is still sent.
    #[tokio::test(start_paused = true)]
    async fn a_starved_wait_goes_on_and_moves_the_calls_deadline() {
        let started = Instant::now();
        let limit = started + TIMEOUT;
        let starved = async {
            tokio::time::advance(Duration::from_millis(25)).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
            "reply"
        };
        let (answer, starved_until) = within(limit, TIMEOUT, Patience::Timeout, starved)
            .await
            .expect("a starved wait is waited again");
        assert_eq!(answer, "reply");
        assert_eq!(
            starved_until,
            Some(started + Duration::from_millis(25) + TIMEOUT)
        );
        // On time, the same reply is let go at the limit, and nothing moves.
        let limit = Instant::now() + TIMEOUT;
        assert!(
            within(limit, TIMEOUT, Patience::Timeout, late_reply())
                .await
                .is_err()
        );
    }
}
