//! `retryd-otlp-sink`: a minimal OTLP trace receiver that accepts and
//! counts spans, for benchmarking retryd with tracing to a live receiver
//! (the real export path, without a collector's own cost in the figures).
//!
//! - OTLP/gRPC on `--listen` (`TraceService/Export`);
//! - OTLP/HTTP on `--http-listen` (`POST /v1/traces`, protobuf), which also
//!   answers `GET /spans` with `{"spans":N,"exports":M,"bytes":B}`, the
//!   counts so far (`bytes`: the spans as encoded, each with its key and
//!   length; a request's resource and scope, not kept, are left out).
//!
//! A request is read only as far as counting needs: the spans are kept as
//! undecoded bytes (prost skips every other field), so that the receiver
//! costs the shared cores little beside retryd. Prints
//! `{"otlp":"ADDR","http":"ADDR"}` once listening, and the counts on exit
//! (SIGTERM or Ctrl-C).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt as _, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use prost::Message as _;
use tonic::codegen::{BoxFuture, Service, http};

#[derive(Parser)]
#[command(about = "Accept OTLP/gRPC and OTLP/HTTP trace exports and count the spans.")]
struct Args {
    /// OTLP/gRPC address to listen on (loopback).
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
    /// OTLP/HTTP address to listen on (loopback): `POST /v1/traces`, and
    /// `GET /spans` for the counts. Port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    http_listen: SocketAddr,
}

/// `ExportTraceServiceRequest`, read only as far as its spans.
#[derive(Clone, PartialEq, prost::Message)]
struct CountedRequest {
    #[prost(message, repeated, tag = "1")]
    resource_spans: Vec<CountedResourceSpans>,
}

/// `ResourceSpans`, read only as far as its scopes' spans.
#[derive(Clone, PartialEq, prost::Message)]
struct CountedResourceSpans {
    #[prost(message, repeated, tag = "2")]
    scope_spans: Vec<CountedScopeSpans>,
}

/// `ScopeSpans`: its spans left undecoded.
#[derive(Clone, PartialEq, prost::Message)]
struct CountedScopeSpans {
    #[prost(bytes = "bytes", repeated, tag = "2")]
    spans: Vec<Bytes>,
}

impl CountedRequest {
    fn spans(&self) -> u64 {
        self.resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len() as u64)
            .sum()
    }
}

/// What was received.
#[derive(Debug, Default)]
struct Counts {
    spans: AtomicU64,
    exports: AtomicU64,
    bytes: AtomicU64,
}

impl Counts {
    fn add(&self, request: &CountedRequest) {
        self.spans.fetch_add(request.spans(), Ordering::Relaxed);
        self.exports.fetch_add(1, Ordering::Relaxed);
        // The parts kept, a sum over the spans: what the sender encoded,
        // less the resource and scope that prost skipped.
        self.bytes
            .fetch_add(request.encoded_len() as u64, Ordering::Relaxed);
    }

    fn json(&self) -> String {
        format!(
            "{{\"spans\":{},\"exports\":{},\"bytes\":{}}}",
            self.spans.load(Ordering::Relaxed),
            self.exports.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed)
        )
    }
}

/// The gRPC service, by hand: the generated server would decode every span.
#[derive(Clone)]
struct GrpcSink(Arc<Counts>);

impl tonic::server::NamedService for GrpcSink {
    const NAME: &'static str = "opentelemetry.proto.collector.trace.v1.TraceService";
}

struct Export(Arc<Counts>);

impl tonic::server::UnaryService<CountedRequest> for Export {
    type Response = ExportTraceServiceResponse;
    type Future = std::future::Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<CountedRequest>) -> Self::Future {
        self.0.add(request.get_ref());
        std::future::ready(Ok(tonic::Response::new(
            ExportTraceServiceResponse::default(),
        )))
    }
}

impl Service<http::Request<tonic::body::Body>> for GrpcSink {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let counts = Arc::clone(&self.0);
        Box::pin(async move {
            if request.uri().path() != "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
            {
                return Ok(tonic::Status::unimplemented("only Export").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<
                ExportTraceServiceResponse,
                CountedRequest,
            >::default())
            .apply_max_message_size_config(Some(64 * 1024 * 1024), None);
            Ok(grpc.unary(Export(counts), request).await)
        })
    }
}

/// OTLP/HTTP and the counts.
async fn http(
    counts: Arc<Counts>,
    request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let respond = |status: u16, body: String| {
        let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
        Ok(response)
    };
    match (request.method().as_str(), request.uri().path()) {
        ("GET", "/spans") => respond(200, counts.json()),
        ("POST", "/v1/traces") => {
            let Ok(body) = request.into_body().collect().await else {
                return respond(400, "unreadable body".into());
            };
            match CountedRequest::decode(body.to_bytes()) {
                Ok(decoded) => {
                    counts.add(&decoded);
                    let mut response = hyper::Response::new(Full::new(Bytes::from(
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )));
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/x-protobuf"),
                    );
                    Ok(response)
                }
                Err(error) => respond(400, format!("not an ExportTraceServiceRequest: {error}")),
            }
        }
        _ => respond(404, "POST /v1/traces or GET /spans".into()),
    }
}

async fn serve_http(listener: tokio::net::TcpListener, counts: Arc<Counts>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let counts = Arc::clone(&counts);
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request| http(Arc::clone(&counts), request));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let http_listener = tokio::net::TcpListener::bind(args.http_listen).await?;
    println!(
        "{{\"otlp\":\"{}\",\"http\":\"{}\"}}",
        listener.local_addr()?,
        http_listener.local_addr()?
    );
    let counts = Arc::new(Counts::default());
    tokio::spawn(serve_http(http_listener, Arc::clone(&counts)));
    let shutdown = async {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    };
    tonic::transport::Server::builder()
        .add_service(GrpcSink(Arc::clone(&counts)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    eprintln!("{}", counts.json());
    Ok(())
}
