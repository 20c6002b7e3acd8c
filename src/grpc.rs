//! The gRPC edge: validates requests, asks the budget store and the engine,
//! and maps the answers back to protobuf. It holds no decision logic.
//!
//! Only this module (and `pb`) sees generated types. Errors become
//! `tonic::Status` in one place, `grpc/status.rs`.

mod admin;
mod decider;
mod status;
pub mod validate;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;

use crate::budget::BudgetStore;
use crate::pb;
use crate::policy::Policies;
use crate::telemetry::{Attribute, Metrics, SpanStart, TraceContext, Tracer, attr};

/// The encoded descriptor set of `proto/`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("retryd_descriptor");

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
    policies: Policies,
    metrics: Arc<Metrics>,
    tracer: Tracer,
}

impl<S> Clone for Service<S> {
    fn clone(&self) -> Self {
        Service {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: BudgetStore> Service<S> {
    /// A service deciding with `policies` over `store`, labelled
    /// `store_label` on spans, recording to `metrics` and `tracer`.
    pub fn new(
        store: S,
        store_label: &'static str,
        policies: Policies,
        metrics: Arc<Metrics>,
        tracer: Tracer,
    ) -> Self {
        Service {
            inner: Arc::new(Inner {
                store,
                store_label,
                policies,
                metrics,
                tracer,
            }),
        }
    }

    /// The budget store, for health checks and metrics.
    pub fn store(&self) -> &S {
        &self.inner.store
    }
}

/// Serves `service` on `listener` (with gRPC health and reflection) until
/// `shutdown` completes; then stops accepting, gives in-flight calls up to
/// `grace` to finish, and returns.
pub async fn serve<S: BudgetStore>(
    listener: TcpListener,
    service: Service<S>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<(), tonic::transport::Error> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::retry_decider_server::RetryDeciderServer<Service<S>>>()
        .await;
    health_reporter
        .set_serving::<pb::retry_admin_server::RetryAdminServer<Service<S>>>()
        .await;
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
    let router = Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(pb::retry_decider_server::RetryDeciderServer::new(
            service.clone(),
        ))
        .add_service(pb::retry_admin_server::RetryAdminServer::new(service));
    let mut server = tokio::spawn(router.serve_with_incoming_shutdown(
        TcpListenerStream::new(listener),
        async {
            let _ = stop_rx.await;
        },
    ));

    tokio::select! {
        result = &mut server => return flatten(result),
        () = shutdown => {}
    }
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

fn flatten(
    joined: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<(), tonic::transport::Error> {
    match joined {
        Ok(result) => result,
        Err(join_error) => {
            tracing::error!(error = %join_error, "the gRPC server task failed");
            Ok(())
        }
    }
}

/// The caller's W3C trace context from gRPC metadata, if it sent a valid one.
fn trace_context(metadata: &tonic::metadata::MetadataMap) -> Option<TraceContext> {
    let traceparent = metadata.get("traceparent")?.to_str().ok()?;
    let tracestate = metadata
        .get("tracestate")
        .and_then(|value| value.to_str().ok());
    TraceContext::parse(traceparent, tracestate)
}

impl<S> Service<S> {
    /// Finishes the span of a call that failed with `status`.
    fn finish_failed(&self, span: Option<SpanStart>, name: &'static str, status: &tonic::Status) {
        if let Some(span) = span {
            self.inner.tracer.finish(
                span,
                name,
                vec![(attr::GRPC_STATUS, Attribute::Int(status.code() as i64))],
                Some(status.message().to_owned()),
            );
        }
    }
}

/// Binds a listener, for `main` and tests.
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}
