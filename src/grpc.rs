//! The gRPC edge: validates requests, asks the budget store and the engine,
//! and maps the answers back to protobuf. It holds no decision logic.
//!
//! Only this module (and `pb`) sees generated types. Errors become
//! `tonic::Status` in one place, `grpc/status.rs`.

mod admin;
mod candidate;
mod deadline;
mod decider;
mod gate;
mod report;
mod serve;
mod shares;
mod status;
pub mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::auth::{Auth, Principal};
use crate::budget::{BudgetStore, MemoryBudgetStore, StoreError};
use crate::config::{Config, InvalidConfig};
use crate::decision_log::DecisionLog;
use crate::policy::Policies;
use crate::telemetry::{
    Attribute, Metrics, Refusal, SpanStart, Throttle, TraceContext, Tracer, UpstreamLimit, attr,
};
use crate::transport::Peer;
pub use serve::{ServeError, bind, serve};

/// The health-service name that reports the budget store's reachability:
/// SERVING while all of it is reachable.
pub const STORE_HEALTH_SERVICE: &str = "retryd.v1.BudgetStore";

/// The health-service name that is SERVING while any part of the budget
/// store is reachable (a Redis Cluster with a master down, say). With
/// [`STORE_HEALTH_SERVICE`] it reads all (both SERVING), part (this one
/// alone) or none (neither). "Any", not "Partial": its SERVING holds in
/// the all case too, which "Partial" would seem to exclude.
pub const STORE_ANY_HEALTH_SERVICE: &str = "retryd.v1.BudgetStore.Any";

/// The encoded descriptor set of `proto/`, for server reflection.
pub use retryd_proto::FILE_DESCRIPTOR_SET;

/// The state every handler shares. Generic over the store so that the
/// store is chosen once, in `main`, with no dynamic dispatch on the hot
/// path.
#[derive(Debug)]
pub struct Service<S> {
    inner: Arc<Inner<S>>,
}

#[derive(Debug)]
struct Inner<S> {
    store: S,
    /// How the store is labelled on spans: memory, redis-exact, …
    store_label: &'static str,
    /// What a reload may replace, swapped as one value so that every call
    /// sees wholly the old or wholly the new configuration.
    live: ArcSwap<Live>,
    metrics: Arc<Metrics>,
    tracer: Tracer,
    /// Where the configuration came from, for reloads.
    reload: Reload,
    /// Refused calls are logged ten at once, then one a second, with a
    /// count of the others: a caller probing keys must not flood the log.
    refusals: Throttle,
    /// The candidate policies' budgets, in memory (a candidate needs the
    /// memory store; `config` refuses one on Redis). Empty without one.
    candidates: MemoryBudgetStore,
    /// Every decision and report as a JSON line, if configured.
    decision_log: Option<DecisionLog>,
    /// Each principal's share of the unconfigured upstreams.
    shares: shares::Shares,
    /// A principal at its share is logged at most once per interval.
    full_shares: Throttle,
    /// Held by the reload in progress: when the last one ended.
    reloads: tokio::sync::Mutex<Option<tokio::time::Instant>>,
    /// Reloads running or waiting for `reloads`.
    reloads_queued: AtomicUsize,
}

/// The reloadable part of the configuration.
#[derive(Debug)]
pub struct Live {
    /// Per-upstream policies.
    pub policies: Policies,
    /// Who may call.
    pub auth: Auth,
}

/// How to reload: the file the server started with and what it said at
/// startup, to tell the operator which changes need a restart.
#[derive(Debug)]
pub struct Reload {
    /// The configuration file, if any.
    pub path: Option<PathBuf>,
    /// The configuration at startup.
    pub startup: Config,
}

impl<S> Clone for Service<S> {
    fn clone(&self) -> Self {
        Service {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: BudgetStore> Service<S> {
    /// A service deciding with the policies and principals of
    /// `reload.startup` over `store`, labelled `store_label` on spans,
    /// recording to `metrics` and `tracer`.
    pub fn new(
        store: S,
        store_label: &'static str,
        reload: Reload,
        metrics: Arc<Metrics>,
        tracer: Tracer,
    ) -> Self {
        let live = Live {
            policies: reload.startup.policies.clone(),
            auth: reload.startup.auth.clone(),
        };
        Service {
            inner: Arc::new(Inner {
                store,
                store_label,
                live: ArcSwap::from_pointee(live),
                metrics,
                tracer,
                refusals: Throttle::new(Duration::from_secs(1), 10),
                candidates: MemoryBudgetStore::new(usize::MAX),
                decision_log: None,
                shares: shares::Shares::new(
                    reload.startup.max_upstreams_per_principal,
                    reload.startup.evict_idle_after,
                ),
                full_shares: Throttle::new(SHARE_WARNING_INTERVAL, 1),
                reloads: tokio::sync::Mutex::new(None),
                reloads_queued: AtomicUsize::new(0),
                reload,
            }),
        }
    }

    /// The same service, writing its decisions to `log`. Call before the
    /// service is cloned or served.
    pub fn with_decision_log(mut self, mut log: DecisionLog) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => {
                log.count_drops_in(Arc::clone(&inner.metrics));
                inner.decision_log = Some(log);
            }
            None => tracing::error!("the decision log was attached to a service already shared"),
        }
        self
    }

    /// Has the decision log, if any, reopen its file (log rotation).
    pub fn reopen_decision_log(&self) {
        if let Some(log) = &self.inner.decision_log {
            log.reopen();
        }
    }

    /// The policies in force now.
    pub fn policies(&self) -> Arc<Live> {
        self.inner.live.load_full()
    }

    /// The policies in force now, for one call: a guard that takes no
    /// reference count. Every call cloning and dropping the one shared
    /// `Arc` was two atomic writes to a line every core touches.
    fn live(&self) -> arc_swap::Guard<Arc<Live>> {
        self.inner.live.load()
    }

    /// Re-reads the configuration file and swaps in its policies and
    /// principals, after any reload already running (what SIGHUP does). An
    /// invalid file changes nothing. Returns the number of named upstreams
    /// and the changed keys that need a restart.
    pub async fn reload(&self) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let _slot = ReloadSlot::take(&self.inner.reloads_queued);
        let last = self.inner.reloads.lock().await;
        // Not paced: a signal comes from the host, which the pace is not
        // about, and its reload must read the file as it is now.
        self.reload_after(last, Duration::ZERO).await
    }

    /// [`Service::reload`] for `ReloadConfig`: refused with
    /// [`ReloadError::Busy`] when one reload is running and another already
    /// waits its turn, so that a flood of calls costs one reload at a time,
    /// at most one per [`RELOAD_INTERVAL`], and its refusals cost nothing.
    pub async fn try_reload(&self) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let slot = ReloadSlot::take(&self.inner.reloads_queued);
        if slot.ahead >= 2 {
            return Err(ReloadError::Busy);
        }
        let last = self.inner.reloads.lock().await;
        self.reload_after(last, RELOAD_INTERVAL).await
    }

    /// Reloads, holding the reload lock, once `pace` has passed since the
    /// last reload ended.
    async fn reload_after(
        &self,
        mut last: tokio::sync::MutexGuard<'_, Option<tokio::time::Instant>>,
        pace: Duration,
    ) -> Result<(usize, Vec<&'static str>), ReloadError> {
        if let Some(last) = *last {
            tokio::time::sleep_until(last + pace).await;
        }
        // Reading the file (and the TLS files it names) and validating it
        // block: on a thread of their own, never on a runtime worker that
        // decisions run on.
        let path = self.inner.reload.path.clone();
        let loaded = tokio::task::spawn_blocking(move || Config::load_for_reload(path.as_deref()))
            .await
            .unwrap_or_else(|_| {
                Err(InvalidConfig::Load(
                    "the reload's reading thread failed".into(),
                ))
            });
        let applied = self.apply_reload(loaded);
        *last = Some(tokio::time::Instant::now());
        Ok(applied?)
    }

    /// Swaps in a loaded configuration's policies and principals, unless
    /// it failed to load or would weaken authentication.
    fn apply_reload(
        &self,
        loaded: Result<Config, InvalidConfig>,
    ) -> Result<(usize, Vec<&'static str>), InvalidConfig> {
        let live = self.live();
        let result = loaded.and_then(|config| self.refuse_weaker_auth(&live.auth, config));
        self.inner.metrics.record_reload(result.is_ok());
        let config = match result {
            Ok(config) => config,
            Err(error) => {
                tracing::error!(%error, "configuration reload refused; keeping the running configuration");
                return Err(error);
            }
        };
        let changes = live.auth.changes_to(&config.auth);
        if !changes.is_empty() {
            // Who may call is the most sensitive thing a reload changes:
            // loud, on the audit target, naming every principal concerned.
            tracing::warn!(
                target: "retryd::audit",
                added = ?changes.added,
                removed = ?changes.removed,
                changed = ?changes.changed,
                "principals changed by a configuration reload"
            );
        }
        let startup = &self.inner.reload.startup;
        let restart_required: Vec<&'static str> = [
            ("server.listen", config.listen != startup.listen),
            (
                "server.metrics_listen",
                config.metrics_listen != startup.metrics_listen,
            ),
            ("server.tls", config.tls != startup.tls),
            (
                "server limits",
                config.server_limits != startup.server_limits,
            ),
            ("store", config.store != startup.store),
            ("telemetry", config.telemetry != startup.telemetry),
            (
                "limits.max_upstreams",
                config.max_upstreams != startup.max_upstreams,
            ),
            (
                "limits.report_id_window, limits.max_report_ids",
                config.report_ids != startup.report_ids,
            ),
            (
                "limits.max_upstreams_per_principal",
                config.max_upstreams_per_principal != startup.max_upstreams_per_principal,
            ),
            (
                "limits.evict_idle_after",
                config.evict_idle_after != startup.evict_idle_after,
            ),
        ]
        .into_iter()
        .filter_map(|(key, changed)| changed.then_some(key))
        .collect();
        if !restart_required.is_empty() {
            tracing::warn!(
                ?restart_required,
                "these settings changed but take effect only after a restart"
            );
        }
        let named = config.policies.named().count();
        self.inner.live.store(Arc::new(Live {
            policies: config.policies,
            auth: config.auth,
        }));
        tracing::info!(named_upstreams = named, "configuration reloaded");
        Ok((named, restart_required))
    }

    /// Refuses a reloaded configuration that would weaken authentication:
    /// one naming no principal while the running one authenticates (a
    /// truncated file, or one cut before its `[auth]`), since every caller
    /// of the port, still bound, would become the all-powerful anonymous
    /// principal; and one without `[auth]` whose non-loopback rule holds
    /// only for its own `server.listen`, not for the address actually bound
    /// (a reload binds nothing). Switching authentication off needs a
    /// restart, which binds and checks afresh.
    fn refuse_weaker_auth(&self, running: &Auth, config: Config) -> Result<Config, InvalidConfig> {
        if config.auth.is_enabled() {
            return Ok(config);
        }
        if running.is_enabled() {
            return Err(InvalidConfig::Value {
                key: "auth.principals".into(),
                reason: "the running configuration authenticates callers and this file names no principal; a reload never switches authentication off (restart to do so)".into(),
            });
        }
        let bound = self.inner.reload.startup.listen;
        if !bound.ip().is_loopback() && !config.allow_unauthenticated {
            return Err(InvalidConfig::Value {
                key: "server.listen".into(),
                reason: format!(
                    "the server is bound to {bound}, which is not a loopback address, and [auth] names no principal; configure [auth] or set server.allow_unauthenticated = true"
                ),
            });
        }
        Ok(config)
    }

    /// Who is calling `rpc`: the principal behind the request's API key or
    /// client certificate (anonymous when authentication is off), borrowed
    /// from the configuration (cloned only by a caller that keeps it). A
    /// refusal is logged for audit. The gate (`gate.rs`) has already
    /// refused, on the headers, a call that would fail here; the handler
    /// asks again so that it authorizes on the configuration it decides on.
    fn authenticate<'l, T>(
        &self,
        live: &'l Live,
        request: &tonic::Request<T>,
        rpc: &str,
    ) -> Result<&'l Arc<Principal>, tonic::Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|value| value.as_encoded_bytes());
        self.authenticate_caller(live, authorization, peer(request), rpc)
    }

    /// [`Service::authenticate`] on what a request's headers say: its
    /// `authorization` value, and the connection it came on.
    fn authenticate_caller<'l>(
        &self,
        live: &'l Live,
        authorization: Option<&[u8]>,
        peer: Option<&Peer>,
        rpc: &str,
    ) -> Result<&'l Arc<Principal>, tonic::Status> {
        if !live.auth.is_enabled() {
            return Ok(live.auth.authenticate(None, [])?);
        }
        let authenticated = match authorization {
            // What an HTTP header value may read as text: visible ASCII
            // and tabs (`HeaderValue::to_str`).
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(text)
                    if text
                        .bytes()
                        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) =>
                {
                    Ok(Some(text))
                }
                _ => Err(tonic::Status::unauthenticated(
                    "authorization: not valid ASCII",
                )),
            },
            None => Ok(None),
        }
        .and_then(|authorization| {
            // Read from the leaf certificate once, when the connection was made.
            let identities = peer.map(Peer::identities).unwrap_or_default();
            Ok(live
                .auth
                .authenticate(authorization, identities.iter().map(String::as_str))?)
        });
        if let Err(status) = &authenticated {
            self.audit_refusal(rpc, peer.map(|peer| peer.remote_addr), None, status);
        }
        authenticated
    }

    /// Logs a call refused for want of a credential or a permission, on the
    /// audit target, throttled. Other failures are not refusals and are
    /// not logged here.
    fn audit_refusal(
        &self,
        rpc: &str,
        peer: Option<SocketAddr>,
        principal: Option<&str>,
        status: &tonic::Status,
    ) {
        let refusal = match status.code() {
            tonic::Code::Unauthenticated => Refusal::Unauthenticated,
            tonic::Code::PermissionDenied => Refusal::PermissionDenied,
            _ => return,
        };
        // Counted always: the log below is throttled, and global, so one
        // peer's flood would otherwise hide another's refusals.
        self.inner.metrics.record_call_refused(refusal);
        self.inner.refusals.log(|suppressed| {
            tracing::warn!(
                target: "retryd::audit",
                rpc,
                peer = peer.map(|peer| peer.to_string()),
                principal,
                code = ?status.code(),
                reason = status.message(),
                suppressed,
                "call refused"
            );
        });
    }

    /// Logs how many refused calls the audit throttle held back since its
    /// last line, if any: `main` runs it every second, so that the end of
    /// a burst is logged when it ends.
    pub fn flush_refusals(&self) {
        self.inner.refusals.flush(|suppressed| {
            tracing::warn!(
                target: "retryd::audit",
                suppressed,
                "calls refused and not logged one by one (see retryd_calls_refused_total)"
            );
        });
    }

    /// The budget store, for health checks and metrics.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// One eviction sweep: the store forgets idle unconfigured upstreams
    /// (the memory store; see `BudgetStore::evict_idle`) and each
    /// principal's share what it has not used for `limits.evict_idle_after`.
    /// Returns the upstreams evicted. `serve` runs it periodically, off the
    /// decision path; tests on a controlled clock call it directly.
    pub fn sweep(&self) -> usize {
        let live = self.live();
        let idle = self.inner.reload.startup.evict_idle_after;
        let evicted = self
            .inner
            .store
            .evict_idle(idle, |upstream| live.policies.get(upstream).bucket);
        self.inner.shares.forget_idle();
        evicted
    }

    /// Takes the unconfigured `upstreams` into the principal's share, or
    /// refuses the call (RESOURCE_EXHAUSTED naming the limit, counted, and
    /// a warning naming the principal at most once per interval).
    fn claim_share<'u>(
        &self,
        principal: &Principal,
        upstreams: impl IntoIterator<Item = &'u str> + Clone,
    ) -> Result<(), tonic::Status> {
        self.inner
            .shares
            .claim(&principal.name, upstreams)
            .map_err(|full| self.share_refusal(full))
    }

    /// [`Service::claim_share`] for an upstream switched off: held in the
    /// principal's share until switched on again.
    fn pin_share(&self, principal: &Principal, upstream: &str) -> Result<(), tonic::Status> {
        self.inner
            .shares
            .pin(&principal.name, upstream)
            .map_err(|full| self.share_refusal(full))
    }

    /// A full share as a status: counted, and warned about (naming the
    /// principal) at most once per interval.
    fn share_refusal(&self, full: shares::ShareFull) -> tonic::Status {
        self.inner
            .metrics
            .record_upstream_refusal(UpstreamLimit::Principal);
        self.inner.full_shares.log(|suppressed| {
            tracing::warn!(
                principal = full.principal,
                limit = full.limit,
                suppressed,
                "a principal holds its whole share of unconfigured upstreams (limits.max_upstreams_per_principal); its new upstreams are refused"
            );
        });
        tonic::Status::resource_exhausted(full.to_string())
    }

    /// A store error as a status, counting a refusal for the upstream limit.
    fn store_refusal(&self, error: StoreError) -> tonic::Status {
        if matches!(error, StoreError::TooManyUpstreams { .. }) {
            self.inner
                .metrics
                .record_upstream_refusal(UpstreamLimit::Store);
        }
        status::store_status(error)
    }
}

/// The least time between a reload and a `ReloadConfig` call's: a flood of
/// calls reloads ten times a second at most.
pub const RELOAD_INTERVAL: Duration = Duration::from_millis(100);

/// A place among the reloads running or waiting, given back when the
/// reload ends or its caller goes away.
struct ReloadSlot<'q> {
    queued: &'q AtomicUsize,
    /// Reloads that were running or waiting when this one came.
    ahead: usize,
}

impl<'q> ReloadSlot<'q> {
    fn take(queued: &'q AtomicUsize) -> ReloadSlot<'q> {
        let ahead = queued.fetch_add(1, Ordering::AcqRel);
        ReloadSlot { queued, ahead }
    }
}

impl Drop for ReloadSlot<'_> {
    fn drop(&mut self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is invalid, or would weaken authentication.
    #[error(transparent)]
    Invalid(#[from] InvalidConfig),
    /// Another reload is running or waiting: `ReloadConfig` does not queue.
    #[error("a configuration reload is already running; try again once it is done")]
    Busy,
}

/// How often at most a full share is logged.
const SHARE_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// The connection a request came on: its address and client certificate.
fn peer<T>(request: &tonic::Request<T>) -> Option<&Peer> {
    request.extensions().get::<Peer>()
}

/// The address a request came from.
fn peer_addr<T>(request: &tonic::Request<T>) -> Option<SocketAddr> {
    peer(request).map(|peer| peer.remote_addr)
}

/// The caller's W3C trace context from gRPC metadata, if it sent a valid one.
fn trace_context(metadata: &tonic::metadata::MetadataMap) -> Option<TraceContext> {
    trace_context_of_headers(metadata.as_ref())
}

/// [`trace_context`] from the request's HTTP headers, for the gate.
fn trace_context_of_headers(headers: &tonic::codegen::http::HeaderMap) -> Option<TraceContext> {
    let traceparent = headers.get("traceparent")?.to_str().ok()?;
    let tracestate = headers
        .get("tracestate")
        .and_then(|value| value.to_str().ok());
    TraceContext::parse(traceparent, tracestate)
}

impl<S> Service<S> {
    /// Finishes the span of a call that failed with `status`.
    fn finish_failed(&self, span: Option<SpanStart>, name: &'static str, status: &tonic::Status) {
        self.finish_failed_with(span, name, status, Vec::new());
    }

    /// Finishes the span of a call that failed with `status`, with
    /// `attributes` beside the status code.
    fn finish_failed_with(
        &self,
        span: Option<SpanStart>,
        name: &'static str,
        status: &tonic::Status,
        mut attributes: Vec<(&'static str, Attribute)>,
    ) {
        if let Some(span) = span {
            attributes.push((attr::GRPC_STATUS, Attribute::Int(status.code() as i64)));
            self.inner
                .tracer
                .finish(span, name, attributes, Some(status.message().to_owned()));
        }
    }
}
