//! `retryd-otlp-sink`: a minimal OTLP/gRPC trace collector that accepts and
//! counts spans, for benchmarking retryd with tracing to a live receiver
//! (the real export path, without a collector's own cost in the figures).
//!
//! Prints `{"otlp":"ADDR"}` once listening, and the span count on exit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

#[derive(Parser)]
#[command(about = "Accept OTLP/gRPC trace exports and count the spans.")]
struct Args {
    /// Address to listen on (loopback).
    #[arg(long, default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
}

#[derive(Clone, Default)]
struct Sink {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("{{\"otlp\":\"{}\"}}", listener.local_addr()?);
    let sink = Sink::default();
    let spans = Arc::clone(&sink.spans);
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
        .add_service(TraceServiceServer::new(sink).max_decoding_message_size(64 * 1024 * 1024))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    eprintln!("{{\"spans\":{}}}", spans.load(Ordering::Relaxed));
    Ok(())
}
