//! Issue 32: reports carry outcomes. Both adapters, against a real retryd
//! and real upstreams on loopback, count how every attempt ended; the counts
//! that reach the wire are captured by a tonic server of the test's own that
//! forwards decisions to the real retryd and records every ReportTraffic.
//!
//! The rule: an attempt is a failure when the adapter asked (or would ask)
//! retryd whether to retry it; every other ending is a success (a 404
//! included); an attempt the caller abandoned (a dropped future) is neither.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use retryd_client::engine::Idempotency;
use retryd_client::{Call, Client, RetryMiddleware, RetrydLayer, Traffic, pb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

type Decider = pb::retry_decider_client::RetryDeciderClient<tonic::transport::Channel>;

/// Forwards Decide to the real retryd; records every ReportTraffic, failing
/// the first `fail_first` of them with UNAVAILABLE.
#[derive(Clone)]
struct Capture {
    real: Decider,
    reports: Arc<Mutex<Vec<pb::ReportTrafficRequest>>>,
    fail_first: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for Capture {
    async fn decide(
        &self,
        request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        self.real.clone().decide(request.into_inner()).await
    }

    type DecideStreamStream =
        futures::stream::BoxStream<'static, Result<pb::DecideResponse, tonic::Status>>;

    async fn decide_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::DecideRequest>>,
    ) -> Result<tonic::Response<Self::DecideStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }

    async fn report_traffic(
        &self,
        request: tonic::Request<pb::ReportTrafficRequest>,
    ) -> Result<tonic::Response<pb::ReportTrafficResponse>, tonic::Status> {
        let request = request.into_inner();
        let accepted = request.traffic.len() as u32;
        self.reports.lock().unwrap().push(request);
        let failing = self
            .fail_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(tonic::Status::unavailable("injected"));
        }
        Ok(tonic::Response::new(pb::ReportTrafficResponse {
            accepted,
            ..Default::default()
        }))
    }
}

impl Capture {
    fn reports(&self) -> Vec<pb::ReportTrafficRequest> {
        self.reports.lock().unwrap().clone()
    }

    /// The entries of the reports delivered, summed per upstream (a re-sent
    /// report counted once).
    fn sent(&self) -> BTreeMap<String, Traffic> {
        let mut seen = HashSet::new();
        let mut total: BTreeMap<String, Traffic> = BTreeMap::new();
        for report in self.reports() {
            if !seen.insert(report.report_id.clone()) {
                continue;
            }
            for entry in &report.traffic {
                let t = Traffic::of(entry);
                let row = total.entry(entry.upstream.clone()).or_default();
                row.requests += t.requests;
                row.successes += t.successes;
                row.failures += t.failures;
                row.retry_successes += t.retry_successes;
                row.retry_failures += t.retry_failures;
            }
        }
        total
    }
}

/// A client whose decisions are the real retryd's and whose reports land in
/// the capture (sent on flush only).
async fn captured(retryd: &support::Retryd) -> (Client, Capture) {
    let real = Decider::connect(format!("http://{}", retryd.grpc))
        .await
        .expect("retryd");
    let capture = Capture {
        real,
        reports: Arc::default(),
        fail_first: Arc::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let service = capture.clone();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(pb::retry_decider_server::RetryDeciderServer::new(service))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    let client = Client::builder(format!("http://{addr}"))
        .timeout(Duration::from_secs(5))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    (client, capture)
}

/// An HTTP/1.1 server answering the n-th request with `statuses[n]` (the
/// last repeating), or holding it when the status is 0.
async fn scripted(statuses: &'static [u16]) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let served = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let served = served.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let n = served.fetch_add(1, Ordering::SeqCst);
                let status = statuses[n.min(statuses.len() - 1)];
                if status == 0 {
                    std::future::pending::<()>().await;
                }
                let _ = stream
                    .write_all(
                        format!(
                            "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    addr
}

fn traffic(
    requests: u64,
    successes: u64,
    failures: u64,
    retry_successes: u64,
    retry_failures: u64,
) -> Traffic {
    Traffic {
        requests,
        successes,
        failures,
        retry_successes,
        retry_failures,
        hedges_won: 0,
    }
}

fn call(idempotency: Idempotency, upstream: &str) -> Call {
    Call::new(idempotency)
        .upstream(upstream)
        .deadline_in(Duration::from_secs(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_outcomes_reach_the_report() {
    let retryd = support::retryd();
    let (client, capture) = captured(&retryd).await;
    let http = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()))
        .build();
    for (upstream, statuses, want) in [
        ("rs-out-ok", &[200][..], 200),
        ("rs-out-retried", &[503, 200][..], 200),
        ("rs-out-404", &[404][..], 404),
    ] {
        let statuses: &'static [u16] = Box::leak(statuses.to_vec().into_boxed_slice());
        let addr = scripted(statuses).await;
        let response = http
            .get(format!("http://{addr}/"))
            .with_extension(call(Idempotency::Safe, upstream))
            .send()
            .await
            .expect(upstream);
        assert_eq!(response.status().as_u16(), want, "{upstream}");
    }
    // A payment answered 503: asked about, AMBIGUOUS, not retried.
    let addr = scripted(&[503]).await;
    http.post(format!("http://{addr}/"))
        .body("{}")
        .with_extension(call(Idempotency::NonIdempotent, "rs-out-charge"))
        .send()
        .await
        .expect_err("ambiguous");
    // Not sent: retried up to max_attempts = 3, even for a payment.
    let refused = support::refused_addr().await;
    http.post(format!("http://{refused}/"))
        .body("{}")
        .with_extension(call(Idempotency::NonIdempotent, "rs-out-refused"))
        .send()
        .await
        .expect_err("refused");
    // Abandoned by the caller while the upstream holds it: neither.
    let held = scripted(&[0]).await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        http.get(format!("http://{held}/"))
            .with_extension(call(Idempotency::Safe, "rs-out-dropped"))
            .send(),
    )
    .await;
    assert!(abandoned.is_err(), "the upstream holds it");
    client.reporter().flush().await.expect("flush");
    let want: BTreeMap<String, Traffic> = [
        ("rs-out-ok", traffic(1, 1, 0, 0, 0)),
        ("rs-out-retried", traffic(1, 0, 1, 1, 0)),
        ("rs-out-404", traffic(1, 1, 0, 0, 0)),
        ("rs-out-charge", traffic(1, 0, 1, 0, 0)),
        ("rs-out-refused", traffic(1, 0, 1, 0, 2)),
        ("rs-out-dropped", traffic(1, 0, 0, 0, 0)),
    ]
    .into_iter()
    .map(|(upstream, t)| (upstream.to_owned(), t))
    .collect();
    assert_eq!(capture.sent(), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_500_not_retried_is_a_failure() {
    // The suites' retryd registers no transient_500: a 500 is asked about
    // (it is in the retry statuses) and denied.
    let retryd = support::retryd();
    let (client, capture) = captured(&retryd).await;
    let http = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()))
        .build();
    let addr = scripted(&[500]).await;
    let response = http
        .get(format!("http://{addr}/"))
        .with_extension(call(Idempotency::Safe, "rs-out-500"))
        .send()
        .await
        .expect("the 500 is returned");
    assert_eq!(response.status().as_u16(), 500);
    client.reporter().flush().await.expect("flush");
    assert_eq!(capture.sent()["rs-out-500"], traffic(1, 0, 1, 0, 0));
}

/// A gRPC upstream (retryd's contract stands in for any service) answering
/// the n-th Decide with `script[n]` (the last repeating; `None` holds it).
#[derive(Clone)]
struct Scripted {
    script: Arc<Vec<Option<tonic::Code>>>,
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for Scripted {
    async fn decide(
        &self,
        _request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        match self.script[n.min(self.script.len() - 1)] {
            None => std::future::pending().await,
            Some(tonic::Code::Ok) => Ok(tonic::Response::new(pb::DecideResponse::default())),
            Some(code) => Err(tonic::Status::new(code, "scripted")),
        }
    }

    type DecideStreamStream =
        futures::stream::BoxStream<'static, Result<pb::DecideResponse, tonic::Status>>;

    async fn decide_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::DecideRequest>>,
    ) -> Result<tonic::Response<Self::DecideStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }

    async fn report_traffic(
        &self,
        _request: tonic::Request<pb::ReportTrafficRequest>,
    ) -> Result<tonic::Response<pb::ReportTrafficResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }
}

async fn grpc_upstream(script: Vec<Option<tonic::Code>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let service = Scripted {
        script: Arc::new(script),
        calls: Arc::default(),
    };
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(pb::retry_decider_server::RetryDeciderServer::new(service))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    addr
}

async fn grpc_call(
    client: &Client,
    addr: SocketAddr,
    upstream: &str,
    idempotency: Idempotency,
) -> Result<(), tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy();
    let service = tower::ServiceBuilder::new()
        .layer(RetrydLayer::new(client.clone(), upstream))
        .service(channel);
    let mut stub = pb::retry_decider_client::RetryDeciderClient::new(service);
    let mut request = tonic::Request::new(pb::DecideRequest::default());
    request
        .extensions_mut()
        .insert(Call::new(idempotency).deadline_in(Duration::from_secs(20)));
    stub.decide(request).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_outcomes_reach_the_report() {
    use tonic::Code;
    let retryd = support::retryd();
    let (client, capture) = captured(&retryd).await;
    for (upstream, script, want) in [
        ("rs-out-grpc-ok", vec![Some(Code::Ok)], Code::Ok),
        (
            "rs-out-grpc-retried",
            vec![Some(Code::Unavailable), Some(Code::Ok)],
            Code::Ok,
        ),
        (
            "rs-out-grpc-404",
            vec![Some(Code::NotFound)],
            Code::NotFound,
        ),
        // Asked about, denied.
        (
            "rs-out-grpc-internal",
            vec![Some(Code::Internal)],
            Code::Internal,
        ),
    ] {
        let addr = grpc_upstream(script).await;
        let got = grpc_call(&client, addr, upstream, Idempotency::Safe).await;
        assert_eq!(
            got.err().map_or(Code::Ok, |status| status.code()),
            want,
            "{upstream}"
        );
    }
    let refused = support::refused_addr().await;
    let status = grpc_call(
        &client,
        refused,
        "rs-out-grpc-refused",
        Idempotency::NonIdempotent,
    )
    .await
    .expect_err("refused");
    assert_eq!(status.code(), Code::Unavailable);
    // Abandoned by the caller while the upstream holds it: neither.
    let held = grpc_upstream(vec![None]).await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        grpc_call(&client, held, "rs-out-grpc-dropped", Idempotency::Safe),
    )
    .await;
    assert!(abandoned.is_err(), "the upstream holds it");
    client.reporter().flush().await.expect("flush");
    let want: BTreeMap<String, Traffic> = [
        ("rs-out-grpc-ok", traffic(1, 1, 0, 0, 0)),
        ("rs-out-grpc-retried", traffic(1, 0, 1, 1, 0)),
        ("rs-out-grpc-404", traffic(1, 1, 0, 0, 0)),
        ("rs-out-grpc-internal", traffic(1, 0, 1, 0, 0)),
        ("rs-out-grpc-refused", traffic(1, 0, 1, 0, 2)),
        ("rs-out-grpc-dropped", traffic(1, 0, 0, 0, 0)),
    ]
    .into_iter()
    .map(|(upstream, t)| (upstream.to_owned(), t))
    .collect();
    assert_eq!(capture.sent(), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_report_carries_the_same_outcomes() {
    let retryd = support::retryd();
    let (client, capture) = captured(&retryd).await;
    capture.fail_first.store(1, Ordering::SeqCst);
    let http = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()))
        .build();
    let addr = scripted(&[503, 200]).await;
    http.get(format!("http://{addr}/"))
        .with_extension(call(Idempotency::Safe, "rs-out-resend"))
        .send()
        .await
        .expect("retried");
    client
        .reporter()
        .flush()
        .await
        .expect_err("UNAVAILABLE: kept");
    let addr = scripted(&[200]).await;
    http.get(format!("http://{addr}/"))
        .with_extension(call(Idempotency::Safe, "rs-out-resend"))
        .send()
        .await
        .expect("ok");
    assert_eq!(
        client.reporter().pending_traffic().await["rs-out-resend"],
        traffic(2, 1, 1, 1, 0)
    );
    client.reporter().flush().await.expect("flush");
    let reports = capture.reports();
    assert_eq!(reports.len(), 3);
    assert_eq!(reports[0], reports[1], "the re-send is the same report");
    assert_eq!(Traffic::of(&reports[0].traffic[0]), traffic(1, 0, 1, 1, 0));
    assert_ne!(reports[2].report_id, reports[0].report_id);
    assert_eq!(Traffic::of(&reports[2].traffic[0]), traffic(1, 1, 0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_outcome_without_the_adapters() {
    let retryd = support::retryd();
    let (client, capture) = captured(&retryd).await;
    let reporter = client.reporter();
    reporter.record("a", 3);
    reporter.record_outcome("a", true, false);
    reporter.record_outcome("a", false, false);
    reporter.record_outcome("a", false, false);
    reporter.record_outcome("a", true, true);
    reporter.record_outcome("a", false, true);
    // A retry whose first attempt was reported earlier.
    reporter.record_outcome("b", true, true);
    assert_eq!(
        reporter.pending().await,
        [("a".to_owned(), 3)].into_iter().collect()
    );
    reporter.flush().await.expect("flush");
    let reports = capture.reports();
    assert_eq!(
        reports[0].traffic,
        vec![
            traffic(3, 1, 2, 1, 1).entry("a".into()),
            traffic(0, 0, 0, 1, 0).entry("b".into()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_beyond_the_upstream_bound_are_dropped_with_their_requests() {
    let retryd = support::retryd();
    let client = Client::builder(format!("http://{}", retryd.grpc))
        .reporter(retryd_client::ReporterOptions {
            max_upstreams: 1,
            ..Default::default()
        })
        .connect()
        .await
        .expect("client");
    let reporter = client.reporter();
    reporter.record_outcome("a", true, false);
    reporter.record("b", 2);
    reporter.record_outcome("b", false, false);
    assert_eq!(
        reporter.pending_traffic().await,
        [("a".to_owned(), traffic(0, 1, 0, 0, 0))]
            .into_iter()
            .collect()
    );
    assert_eq!(reporter.dropped(), 2);
    // And the real retryd takes a report with outcomes.
    reporter.flush().await.expect("retryd accepts outcomes");
}
