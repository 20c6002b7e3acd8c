//! `retryd-otlp-sink`: a minimal OTLP trace receiver that accepts and
//! counts spans, for benchmarking retryd with tracing to a live receiver
//! (the real export path, without a collector's own cost in the figures).
//!
//! - OTLP/gRPC on `--listen` (`TraceService/Export`);
//! - OTLP/HTTP on `--http-listen` (`POST /v1/traces`, protobuf), which also
//!   answers `GET /spans` with `{"spans":N,"exports":M,"bytes":B}`, the
//!   counts so far (`bytes`: the spans as encoded, each with its key and
//!   length; a request's resource and scope are left out).
//!
//! A request is read only as far as counting needs, as its bytes arrive
//! (`count.rs`: the keys and lengths down to each span, nothing buffered
//! or decoded), so that the receiver costs the shared cores little beside
//! retryd. A request that is not an `ExportTraceServiceRequest` is refused
//! (gRPC `INVALID_ARGUMENT`, HTTP 400) and not counted. Prints
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

mod count;

use count::{Malformed, SpanCounter};

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

/// What was received.
#[derive(Debug, Default)]
struct Counts {
    spans: AtomicU64,
    exports: AtomicU64,
    bytes: AtomicU64,
}

impl Counts {
    fn add(&self, (spans, bytes): (u64, u64)) {
        self.spans.fetch_add(spans, Ordering::Relaxed);
        self.exports.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
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

/// The largest request taken, as tonic's server allowed before.
const MAX_REQUEST: u64 = 64 * 1024 * 1024;

/// The gRPC service, by hand: a generated server (or tonic's codec) would
/// buffer every request whole and decode it.
#[derive(Clone)]
struct GrpcSink(Arc<Counts>);

impl tonic::server::NamedService for GrpcSink {
    const NAME: &'static str = "opentelemetry.proto.collector.trace.v1.TraceService";
}

/// A gRPC answer: OK with an empty `ExportTraceServiceResponse`, or a
/// status alone.
fn grpc_answer(status: Result<(), tonic::Status>) -> http::Response<tonic::body::Body> {
    if let Err(status) = status {
        return status.into_http();
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    // The response message: not compressed, zero bytes long.
    let frames = [
        Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(&[0; 5]))),
        Ok(http_body::Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    let mut response = http::Response::new(tonic::body::Body::new(body));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// Reads one unary gRPC request's message as its DATA frames arrive.
async fn grpc_export(body: tonic::body::Body) -> Result<(u64, u64), tonic::Status> {
    let mut body = std::pin::pin!(body);
    // The five-byte prefix (compressed?, length), then the message.
    let mut prefix = [0u8; 5];
    let mut prefix_len = 0;
    let mut counter: Option<SpanCounter> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| tonic::Status::internal(error.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let mut data = &data[..];
        while !data.is_empty() {
            let Some(counter) = counter.as_mut() else {
                let taken = (5 - prefix_len).min(data.len());
                prefix[prefix_len..prefix_len + taken].copy_from_slice(&data[..taken]);
                prefix_len += taken;
                data = &data[taken..];
                if prefix_len == 5 {
                    if prefix[0] != 0 {
                        return Err(tonic::Status::unimplemented(
                            "compressed messages are not read",
                        ));
                    }
                    let left = u64::from(u32::from_be_bytes([
                        prefix[1], prefix[2], prefix[3], prefix[4],
                    ]));
                    if left > MAX_REQUEST {
                        return Err(tonic::Status::resource_exhausted(format!(
                            "a request of {left} bytes is over {MAX_REQUEST}"
                        )));
                    }
                    counter = Some(SpanCounter::new(Some(left)));
                }
                continue;
            };
            // The counter was made with the message's length.
            let left = counter.left().unwrap_or_default();
            if left == 0 {
                return Err(tonic::Status::invalid_argument(
                    "more than one request message",
                ));
            }
            let taken = left.min(data.len() as u64) as usize;
            counter
                .feed(&data[..taken])
                .map_err(|error| not_a_request(&error))?;
            data = &data[taken..];
        }
    }
    let counter = counter.ok_or_else(|| tonic::Status::invalid_argument("no request message"))?;
    counter.finish().map_err(|error| not_a_request(&error))
}

fn not_a_request(error: &Malformed) -> tonic::Status {
    tonic::Status::invalid_argument(format!("not an ExportTraceServiceRequest: {error}"))
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
            let counted = grpc_export(request.into_body()).await;
            Ok(grpc_answer(counted.map(|counted| counts.add(counted))))
        })
    }
}

/// Reads an OTLP/HTTP request's body as it arrives.
async fn http_export(body: hyper::body::Incoming) -> Result<(u64, u64), String> {
    let malformed = |error: Malformed| format!("not an ExportTraceServiceRequest: {error}");
    let len = http_body::Body::size_hint(&body).exact();
    if len.is_some_and(|len| len > MAX_REQUEST) {
        return Err(format!("a request over {MAX_REQUEST} bytes"));
    }
    let mut body = std::pin::pin!(body);
    let mut counter = SpanCounter::new(len);
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| format!("unreadable body: {error}"))?;
        if let Ok(data) = frame.into_data() {
            read += data.len() as u64;
            if read > MAX_REQUEST {
                return Err(format!("a request over {MAX_REQUEST} bytes"));
            }
            counter.feed(&data).map_err(malformed)?;
        }
    }
    counter.finish().map_err(malformed)
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
        ("POST", "/v1/traces") => match http_export(request.into_body()).await {
            Ok(counted) => {
                counts.add(counted);
                let mut response = hyper::Response::new(Full::new(Bytes::from(
                    ExportTraceServiceResponse::default().encode_to_vec(),
                )));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/x-protobuf"),
                );
                Ok(response)
            }
            Err(error) => respond(400, error),
        },
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

// One thread: a sink of two worker threads on the benchmark's two cores
// spent ~20% more CPU a span (0.53 against 0.42 µs, from /proc under a
// traced DecideStream), moving its connections' wake-ups between them.
#[tokio::main(flavor = "current_thread")]
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
