//! Span export as operators configure it, against real receivers in the
//! test: OTLP/HTTP over TLS (a CA the test generates) that refuses calls
//! without its API-key header, configured by the standard `OTEL_*`
//! variables alone; OTLP/gRPC over TLS with the header from `[telemetry]`;
//! the resource (`service.name`, `service.instance.id`, per process); and
//! `check-config` showing where each setting came from.

use retryd_testkit as support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use support::{Server, retryable};
use tonic::metadata::MetadataValue;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";
const API_KEY: &str = "s3cret-key-value";

/// What a receiver got: per export, the resource attributes and spans;
/// and how many calls it refused for a missing or wrong key.
/// One resource's attributes and its spans.
type Export = (Vec<KeyValue>, Vec<Span>);

#[derive(Clone, Default)]
struct Received {
    exports: Arc<Mutex<Vec<Export>>>,
    refused: Arc<Mutex<usize>>,
}

impl Received {
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut exports = self.exports.lock().unwrap();
        for resource in request.resource_spans {
            let attributes = resource.resource.map(|r| r.attributes).unwrap_or_default();
            let spans = resource
                .scope_spans
                .into_iter()
                .flat_map(|s| s.spans)
                .collect();
            exports.push((attributes, spans));
        }
    }

    /// Waits (up to the testkit's hang guard) for a span of `TRACE`.
    async fn span_of_trace(&self) -> (Vec<KeyValue>, Span) {
        let deadline = Instant::now() + support::HANG_GUARD;
        loop {
            let found = self
                .exports
                .lock()
                .unwrap()
                .iter()
                .find_map(|(resource, spans)| {
                    spans
                        .iter()
                        .find(|span| hex(&span.trace_id) == TRACE)
                        .map(|span| (resource.clone(), span.clone()))
                });
            if let Some(found) = found {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no span of the caller's trace arrived"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(text) => Some(text.clone()),
            _ => None,
        }
    })
}

/// A CA and a certificate for `localhost` and 127.0.0.1 signed by it.
struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::default();
    server.subject_alt_names = vec![
        SanType::DnsName("localhost".try_into().unwrap()),
        SanType::IpAddress("127.0.0.1".parse().unwrap()),
    ];
    let key = KeyPair::generate().unwrap();
    let cert_pem = server.signed_by(&key, &issuer).unwrap().pem();
    Pki {
        ca_pem,
        cert_pem,
        key_pem: key.serialize_pem(),
    }
}

fn tls_acceptor(pki: &Pki, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).unwrap();
    let mut config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// An OTLP/HTTP receiver over TLS: POST /v1/traces with a protobuf body,
/// 401 without `x-api-key: API_KEY`.
async fn http_receiver(pki: &Pki, received: Received) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tls_acceptor(pki, &[b"http/1.1"]);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let received = received.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let received = received.clone();
                        async move {
                            let authorized = request
                                .headers()
                                .get("x-api-key")
                                .is_some_and(|key| key == API_KEY);
                            let path_ok = request.uri().path() == "/v1/traces";
                            let body = request.into_body().collect().await.unwrap().to_bytes();
                            let status = if !authorized {
                                *received.refused.lock().unwrap() += 1;
                                401
                            } else if !path_ok {
                                404
                            } else {
                                received.keep(ExportTraceServiceRequest::decode(body).unwrap());
                                200
                            };
                            let mut response = hyper::Response::new(Full::new(Bytes::new()));
                            *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                            Ok::<_, std::convert::Infallible>(response)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// An OTLP/gRPC receiver (tonic, TLS) refusing calls without the key.
#[derive(Clone)]
struct GrpcReceiver(Received);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let authorized = request
            .metadata()
            .get("x-api-key")
            .is_some_and(|key| key == API_KEY);
        if !authorized {
            *self.0.refused.lock().unwrap() += 1;
            return Err(tonic::Status::unauthenticated("x-api-key"));
        }
        self.0.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn grpc_receiver(pki: &Pki, received: Received) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let identity = tonic::transport::Identity::from_pem(&pki.cert_pem, &pki.key_pem);
    tokio::spawn(
        tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .unwrap()
            .add_service(TraceServiceServer::new(GrpcReceiver(received)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr
}

/// One decision in the caller's trace, with a `tracestate`.
async fn decide_in_trace(server: &Server) {
    let mut client = server.decider().await;
    let mut request = tonic::Request::new(retryable("ledger"));
    let header = format!("00-{TRACE}-{PARENT}-01");
    request.metadata_mut().insert(
        "traceparent",
        MetadataValue::try_from(header.as_str()).unwrap(),
    );
    request
        .metadata_mut()
        .insert("tracestate", MetadataValue::from_static("vendor=abc"));
    client.decide(request).await.unwrap();
}

fn check_decision_span(resource: &[KeyValue], span: &Span, service_name: &str) {
    assert_eq!(
        hex(&span.parent_span_id),
        PARENT,
        "the caller's span is the parent"
    );
    assert_eq!(span.trace_state, "vendor=abc");
    assert_eq!(span.name, "retry.decide");
    assert_eq!(
        text(&span.attributes, "retry.upstream").as_deref(),
        Some("ledger")
    );
    assert_eq!(
        text(&span.attributes, "retry.verdict").as_deref(),
        Some("retry")
    );
    assert_eq!(
        text(&span.attributes, "rpc.system").as_deref(),
        Some("grpc")
    );
    assert_eq!(
        text(&span.attributes, "rpc.service").as_deref(),
        Some("retryd.v1.RetryDecider")
    );
    assert_eq!(
        text(&span.attributes, "rpc.method").as_deref(),
        Some("Decide")
    );
    assert_eq!(
        text(resource, "service.name").as_deref(),
        Some(service_name)
    );
    let instance = text(resource, "service.instance.id").expect("service.instance.id");
    assert_eq!(instance.len(), 36, "a UUID: {instance}");
    // The build's identity, the same that `retryd --version` prints.
    let version = text(resource, "service.version").expect("service.version");
    let (semver, revision) = version.split_once('+').expect("version+revision");
    assert_eq!(semver, env!("CARGO_PKG_VERSION"), "{version}");
    assert_eq!(revision, support::build_identity().revision, "{version}");
}

#[tokio::test]
async fn otel_variables_alone_send_spans_over_http_with_tls_and_a_header() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).unwrap();
    let received = Received::default();
    let addr = http_receiver(&pki, received.clone()).await;
    let endpoint = format!("https://localhost:{}", addr.port());
    let ca_file = ca_file.to_str().unwrap();
    let headers = format!("x-api-key={API_KEY}");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_HEADERS", headers.as_str()),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca_file),
        ("OTEL_SERVICE_NAME", "retryd-edge"),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test"),
    ];
    // No [telemetry] at all: the variables alone.
    let server = Server::start_with_env("", &env);
    decide_in_trace(&server).await;
    let (resource, span) = received.span_of_trace().await;
    check_decision_span(&resource, &span, "retryd-edge");
    assert_eq!(
        text(&resource, "deployment.environment").as_deref(),
        Some("test")
    );
    assert_eq!(*received.refused.lock().unwrap(), 0);

    // Without the header the receiver refuses, and retryd counts the loss.
    let refusing = Server::start_with_env(
        "",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca_file),
        ],
    );
    decide_in_trace(&refusing).await;
    let deadline = Instant::now() + support::HANG_GUARD;
    while support_metric(&refusing.scrape(), "retryd_spans_export_failed_total") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the failed export was not counted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(*received.refused.lock().unwrap() >= 1);
}

fn support_metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

#[tokio::test]
async fn telemetry_keys_send_spans_over_grpc_with_tls_and_replicas_differ() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).unwrap();
    let received = Received::default();
    let addr = grpc_receiver(&pki, received.clone()).await;
    let config = format!(
        "[telemetry]\notlp_endpoint = \"https://localhost:{}\"\notlp_ca_file = {:?}\notlp_headers = {{ \"x-api-key\" = \"{API_KEY}\" }}\n",
        addr.port(),
        ca_file.to_str().unwrap()
    );
    // The file wins over a variable pointing elsewhere.
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")];
    let first = Server::start_with_env(&config, &env);
    let second = Server::start_with_env(&config, &env);
    decide_in_trace(&first).await;
    decide_in_trace(&second).await;
    let deadline = Instant::now() + support::HANG_GUARD;
    let instances = loop {
        let instances: std::collections::BTreeSet<String> = received
            .exports
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, spans)| spans.iter().any(|span| hex(&span.trace_id) == TRACE))
            .filter_map(|(resource, _)| text(resource, "service.instance.id"))
            .collect();
        if instances.len() >= 2 {
            break instances;
        }
        assert!(
            Instant::now() < deadline,
            "spans of both replicas: {instances:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        instances.len(),
        2,
        "each replica its own service.instance.id"
    );
    let (resource, span) = received.span_of_trace().await;
    check_decision_span(&resource, &span, "retryd");
    assert_eq!(*received.refused.lock().unwrap(), 0);
}

#[test]
fn check_config_shows_each_telemetry_setting_and_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("retryd.toml");
    std::fs::write(&file, "[telemetry]\notlp_timeout = \"2s\"\n").unwrap();
    let output = std::process::Command::new(support::binary())
        .arg("check-config")
        .arg(&file)
        .env(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://collector:4318/v1/traces",
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_EXPORTER_OTLP_HEADERS", "api-key=do-not-print-me")
        .env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
        .env("OTEL_TRACES_SAMPLER_ARG", "0.25")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: HashMap<&str, &str> = stdout
        .lines()
        .filter_map(|line| line.trim().split_once(": "))
        .collect();
    assert_eq!(
        lines["otlp endpoint"],
        "http://collector:4318/v1/traces (from OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)"
    );
    assert_eq!(
        lines["otlp protocol"],
        "http/protobuf (from OTEL_EXPORTER_OTLP_PROTOCOL)"
    );
    assert_eq!(lines["otlp timeout"], "2s (from telemetry.otlp_timeout)");
    assert_eq!(
        lines["sampler"],
        "parentbased_traceidratio 0.25 (from OTEL_TRACES_SAMPLER)"
    );
    assert!(stdout.contains("api-key (value hidden)"), "{stdout}");
    assert!(!stdout.contains("do-not-print-me"), "{stdout}");

    // OTEL_SDK_DISABLED turns export off whatever else says.
    let output = std::process::Command::new(support::binary())
        .arg("check-config")
        .arg(&file)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
        .env("OTEL_SDK_DISABLED", "true")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("exporter: none (disabled) (from OTEL_SDK_DISABLED)"),
        "{stdout}"
    );
}
