//! Serving: the gRPC server with its limits, health entries (the store's
//! own among them) and reflection, the idle sweep beside it, graceful
//! drain, and a crashed server task told apart from a clean stop.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::Server;

use super::{FILE_DESCRIPTOR_SET, STORE_ANY_HEALTH_SERVICE, STORE_HEALTH_SERVICE, Service};
use crate::budget::BudgetStore;
use crate::config::ServerLimits;
use crate::pb;
use crate::transport::Acceptor;

/// How often `serve` reads the shared hedging windows back.
const HEDGING_REFRESH: Duration = Duration::from_secs(1);

/// How often `serve` sweeps for idle upstreams: a few times per idle
/// period, within 1–15 s, so an idle upstream goes within about a quarter
/// more than the period and a sweep's locks are rare.
fn sweep_interval(idle: Duration) -> Duration {
    (idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(15))
}

/// Serves `service` on `listener` (with gRPC health and reflection),
/// accepting connections through `acceptor`, until `shutdown` completes;
/// then stops accepting, gives in-flight calls up to `grace` to finish,
/// and returns.
pub async fn serve<S: BudgetStore>(
    listener: TcpListener,
    acceptor: Acceptor,
    service: Service<S>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), ServeError> {
    let limits = service.startup().server_limits.clone();
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::retry_decider_server::RetryDeciderServer<Service<S>>>()
        .await;
    health_reporter
        .set_serving::<pb::retry_admin_server::RetryAdminServer<Service<S>>>()
        .await;
    // The store's reachability has its own health entries: retryd keeps
    // answering while Redis is down (with the configured fallback), so the
    // decider stays SERVING, but operators and probes can see the outage,
    // and whether it is whole or partial: health has only SERVING and
    // NOT_SERVING, so "all of it" and "any of it" are two entries.
    let store_health = tokio::spawn({
        let reporter = health_reporter.clone();
        let service = service.clone();
        async move {
            let mut last = None;
            loop {
                let store = service.store();
                let reachable = (store.is_available(), store.availability() > 0.0);
                if last != Some(reachable) {
                    let (all, any) = reachable;
                    for (name, serving) in
                        [(STORE_HEALTH_SERVICE, all), (STORE_ANY_HEALTH_SERVICE, any)]
                    {
                        let status = if serving {
                            tonic_health::ServingStatus::Serving
                        } else {
                            tonic_health::ServingStatus::NotServing
                        };
                        reporter.set_service_status(name, status).await;
                    }
                    last = Some(reachable);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    // Idle eviction, beside the decisions: each sweep takes the store's
    // shard locks for a moment, never a decision's fast path.
    let sweeper = tokio::spawn({
        let service = service.clone();
        let every = sweep_interval(service.startup().evict_idle_after);
        async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let evicted = service.sweep();
                if evicted > 0 {
                    tracing::debug!(evicted, "idle upstreams evicted");
                }
            }
        }
    });
    // The fleet's hedging windows, read every second from a shared store
    // (and this replica's granted hedges flushed to it): never on the
    // decision path. Nothing to do on the memory store.
    let hedging = tokio::spawn({
        let service = service.clone();
        async move {
            if !S::SHARES_HEDGING {
                return;
            }
            let mut ticks = tokio::time::interval(HEDGING_REFRESH);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                service.refresh_hedging().await;
            }
        }
    });
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptor sets are compiled in and valid");
    // Common grpcurl builds speak only v1alpha.
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("the descriptor sets are compiled in and valid");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder = server_builder(&limits).layer(super::gate::GateLayer::new(
        service.clone(),
        limits.receive_timeout,
    ));
    let decider = pb::retry_decider_server::RetryDeciderServer::new(service.clone())
        .max_decoding_message_size(limits.max_message_bytes);
    let admin = pb::retry_admin_server::RetryAdminServer::new(service.clone())
        .max_decoding_message_size(limits.max_message_bytes);
    let router = builder
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(decider)
        .add_service(admin);
    // Whether calls need a credential, asked as each connection is made, so
    // that a reload adding `[auth]` applies to the connections after it.
    let calls_authenticate = {
        let service = service.clone();
        move || service.live().auth.is_enabled()
    };
    let incoming = acceptor.incoming(listener, calls_authenticate);
    let mut server = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        let _ = stop_rx.await;
    }));

    tokio::select! {
        result = &mut server => {
            store_health.abort();
            sweeper.abort();
            hedging.abort();
            return flatten(result);
        }
        () = shutdown => {}
    }
    store_health.abort();
    sweeper.abort();
    hedging.abort();
    tracing::info!(grace = ?grace, "shutting down: draining in-flight calls");
    health_reporter
        .set_not_serving::<pb::retry_decider_server::RetryDeciderServer<Service<S>>>()
        .await;
    let _ = stop_tx.send(());
    match tokio::time::timeout(grace, &mut server).await {
        Ok(result) => flatten(result),
        Err(_) => {
            // Long-lived DecideStreams may never end by themselves.
            tracing::warn!("shutdown grace elapsed; closing remaining calls");
            server.abort();
            Ok(())
        }
    }
}

/// The most streams a client may make the server reset (by sending frames
/// the server must refuse) on one connection before it is closed with a
/// GOAWAY. hyper's own default; tonic's default (`None`) turns the bound
/// off, which leaves the server open to a reset flood (RUSTSEC-2024-0003).
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// HTTP/2 flow-control windows: how much a client may send that the server
/// has not yet read, on one stream and on a whole connection. hyper's
/// defaults (1 MiB each) let a connection park that much in the server's
/// memory; a call refused on its headers is never read, so the connection
/// window bounds what an anonymous connection can make the server hold
/// before the stream is reset. 64 KiB per stream is HTTP/2's own default
/// and holds a default-sized message (`server.max_message_bytes`) in one
/// go; larger messages still flow, a window at a time, as they are read.
/// 256 KiB per connection is four such streams in flight at once, far
/// more than decisions (a few hundred bytes each) need on a LAN.
const STREAM_WINDOW_BYTES: u32 = 64 * 1024;
const CONNECTION_WINDOW_BYTES: u32 = 256 * 1024;

/// A server with the configured limits (TLS is the [`Acceptor`]'s). HTTP/2
/// bounds the streams of a connection; an optional per-connection request
/// limit refuses overload with RESOURCE_EXHAUSTED (load shedding) rather
/// than queueing. Both optional layers cost time on every call (measured:
/// together with the timeout about 10% of a bare server's throughput),
/// hence opt-in.
fn server_builder(limits: &ServerLimits) -> Server {
    let mut builder = Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)));
    if let Some(limit) = limits.max_concurrent_requests {
        builder = builder
            .concurrency_limit_per_connection(limit)
            .load_shed(true);
    }
    if let Some(timeout) = limits.request_timeout {
        builder = builder.timeout(timeout);
    }
    builder
}

/// Why serving stopped other than by shutdown.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
    /// The server task panicked: a crash, which must not look like a clean
    /// stop (the process exits non-zero).
    #[error("the gRPC server task panicked: {0}")]
    Panicked(String),
}

fn flatten(
    joined: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<(), ServeError> {
    match joined {
        Ok(result) => Ok(result?),
        Err(join_error) => {
            let message = match join_error.try_into_panic() {
                Ok(panic) => panic
                    .downcast_ref::<&str>()
                    .map(|text| (*text).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned()),
                Err(cancelled) => cancelled.to_string(),
            };
            tracing::error!(panic = message, "the gRPC server task failed");
            Err(ServeError::Panicked(message))
        }
    }
}

/// Binds a listener, for `main` and tests.
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_server_task_is_an_error_not_a_clean_stop() {
        let joined = tokio::spawn(async {
            if true {
                panic!("boom");
            }
            Ok(())
        })
        .await;
        match flatten(joined) {
            Err(ServeError::Panicked(message)) => assert_eq!(message, "boom"),
            other => panic!("{other:?}"),
        }
        assert!(flatten(tokio::spawn(async { Ok(()) }).await).is_ok());
    }
}
