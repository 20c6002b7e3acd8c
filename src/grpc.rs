//! The gRPC edge: translates only. Protobuf requests become the pipeline's
//! values (`validate.rs`), the pipeline (`crate::decide`) decides, the
//! recorder (`crate::record`) records, and the answers become protobuf
//! again; every `tonic::Status` is built in `status.rs`.
//!
//! Invariant: no decision logic here, and only this module (and `pb`) sees
//! generated types. `Service = { decider, recorder }`, plus how to reload.

mod admin;
mod answer;
mod deadline;
mod decider;
mod gate;
mod report;
mod serve;
mod status;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::auth::Principal;
use crate::budget::BudgetStore;
use crate::config::Config;
pub use crate::decide::Live;
use crate::decide::{Decider, Refused};
use crate::decision_log::DecisionLog;
use crate::record::Recorder;
pub use crate::reload::{RELOAD_INTERVAL, Reload, ReloadError, Reloader};
use crate::telemetry::{Metrics, TraceContext, Tracer};
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
    /// The pipeline: store, candidates, shares, live configuration.
    decider: Decider<S>,
    /// What calls leave behind.
    recorder: Recorder,
    /// Where the configuration came from, and how to read it again.
    reloader: Reloader,
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
        let startup = &reload.startup;
        let live = Live {
            policies: startup.policies.clone(),
            auth: startup.auth.clone(),
        };
        let decider = Decider::new(
            store,
            live,
            startup.max_upstreams_per_principal,
            startup.evict_idle_after,
            startup.report_ids.window,
        );
        Service {
            inner: Arc::new(Inner {
                decider,
                recorder: Recorder::new(metrics, tracer, store_label),
                reloader: Reloader::new(reload),
            }),
        }
    }

    /// The same service, writing its decisions to `log`. Call before the
    /// service is cloned or served.
    pub fn with_decision_log(mut self, log: DecisionLog) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => inner.recorder.with_decision_log(log),
            None => tracing::error!("the decision log was attached to a service already shared"),
        }
        self
    }

    /// Has the decision log, if any, write out every line it holds.
    pub fn flush_decision_log(&self, within: std::time::Duration) -> bool {
        self.inner.recorder.flush_decision_log(within)
    }

    /// Has the decision log, if any, reopen its file (log rotation).
    pub fn reopen_decision_log(&self) {
        self.inner.recorder.reopen_decision_log();
    }

    /// The policies in force now.
    pub fn policies(&self) -> Arc<Live> {
        self.inner.decider.live_full()
    }

    /// The policies in force now, for one call (see [`Decider::live`]).
    fn live(&self) -> arc_swap::Guard<Arc<Live>> {
        self.inner.decider.live()
    }

    /// A refusal as a status, counted for the upstream limits it names.
    fn refusal(&self, refused: Refused) -> tonic::Status {
        self.recorder().note(&refused);
        refused.into()
    }

    /// Re-reads the configuration file and swaps in its policies and
    /// principals, after any reload already running (what SIGHUP does). An
    /// invalid file changes nothing. Returns the number of named upstreams
    /// and the changed keys that need a restart.
    pub async fn reload(&self) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let metrics = self.recorder().metrics();
        self.inner.reloader.reload(self.decider(), metrics).await
    }

    /// [`Service::reload`] for `ReloadConfig`: refused with
    /// [`ReloadError::Busy`] when one reload is running and another already
    /// waits its turn (see [`Reloader::try_reload`]).
    pub async fn try_reload(&self) -> Result<(usize, Vec<&'static str>), ReloadError> {
        let metrics = self.recorder().metrics();
        self.inner
            .reloader
            .try_reload(self.decider(), metrics)
            .await
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
                _ => Err(status::unreadable_authorization()),
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
            self.recorder()
                .audit_refusal(rpc, peer.map(|peer| peer.remote_addr), None, status);
        }
        authenticated
    }

    /// Logs how many refused calls the audit throttle held back since its
    /// last line, if any: `main` runs it every second, so that the end of
    /// a burst is logged when it ends.
    pub fn flush_refusals(&self) {
        self.recorder().flush_refusals();
    }

    /// The budget store, for health checks and metrics.
    pub fn store(&self) -> &S {
        self.decider().store()
    }

    /// One eviction sweep: the store forgets idle unconfigured upstreams
    /// (the memory store; see `BudgetStore::evict_idle`) and each
    /// principal's share what it has not used for `limits.evict_idle_after`.
    /// Returns the upstreams evicted. `serve` runs it periodically, off the
    /// decision path; tests on a controlled clock call it directly.
    pub fn sweep(&self) -> usize {
        self.decider().sweep(self.startup().evict_idle_after)
    }

    /// One refresh of the shared hedging windows (a shared store only).
    pub async fn refresh_hedging(&self) {
        self.decider().refresh_hedging().await;
    }
}

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
    fn decider(&self) -> &Decider<S> {
        &self.inner.decider
    }

    fn recorder(&self) -> &Recorder {
        &self.inner.recorder
    }
}

impl<S> Service<S> {
    /// The configuration the server started with.
    fn startup(&self) -> &Config {
        &self.inner.reloader.reload.startup
    }
}
