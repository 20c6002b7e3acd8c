//! One layer retries (docs/lineage.md), with real servers on loopback and a
//! real retryd: an edge calls a "middle" hyper server wearing
//! [`LineageLayer`], whose handler calls a failing back end through the
//! reqwest middleware. The back end sees the middle's attempts and their
//! baggage; the middle's 503 says `retryd-retried: middle`; the edge, which
//! reports that mark, does not retry.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retryd_client::engine::{DenyReason, Idempotency};
use retryd_client::{Client, Decisions, LineageLayer, RetryMiddleware, pb};
use tokio::net::TcpListener;
use tower::ServiceBuilder;

/// The `baggage` header of each request a server received.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Serves `service` (a tower service of hyper requests) on loopback.
async fn serve<S, B>(service: S) -> SocketAddr
where
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = hyper::Response<B>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let service = hyper_util::service::TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn answer(status: u16) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .status(status)
        .body(Full::new(Bytes::from_static(b"answer")))
        .unwrap()
}

/// A back end that always answers 503, recording each request's baggage.
async fn failing_back_end() -> (SocketAddr, Seen) {
    let seen = Seen::default();
    let recorded = seen.clone();
    let addr = serve(tower::service_fn(
        move |request: hyper::Request<hyper::body::Incoming>| {
            let recorded = recorded.clone();
            async move {
                let baggage = request
                    .headers()
                    .get("baggage")
                    .map(|value| value.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                let _ = request.into_body().collect().await;
                recorded.0.lock().unwrap().push(baggage);
                Ok::<_, Infallible>(answer(503))
            }
        },
    ))
    .await;
    (addr, seen)
}

fn http(client: &Client, upstream: &str) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()).upstream(upstream))
        .build()
}

fn safe() -> retryd_client::Call {
    retryd_client::Call::new(Idempotency::Safe).deadline_in(Duration::from_secs(20))
}

/// A middle service: LineageLayer around a handler that GETs `back` and
/// answers 503 if that failed, 200 if not.
async fn middle(client: Client, back: SocketAddr) -> SocketAddr {
    let outbound = http(&client, "lineage-back");
    let handler = tower::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let outbound = outbound.clone();
        async move {
            let _ = request.into_body().collect().await;
            let result = outbound
                .get(format!("http://{back}/v1/things"))
                .with_extension(safe())
                .send()
                .await;
            let status = match result {
                Ok(response) if response.status().is_success() => 200,
                _ => 503,
            };
            Ok::<_, Infallible>(answer(status))
        }
    });
    serve(
        ServiceBuilder::new()
            .layer(LineageLayer::new("middle"))
            .service(handler),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_nearest_the_failure_retries_and_the_edge_does_not() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (back, seen) = failing_back_end().await;
    let middle = middle(client.clone(), back).await;

    let edge = http(&client, "lineage-middle");
    let response = edge
        .get(format!("http://{middle}/v1/orders"))
        .header("baggage", "tenant=acme")
        .with_extension(safe())
        .send()
        .await
        .expect("the middle's 503 is returned as a response");
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retryd-retried"], "middle");
    // The edge asked once and was denied: the layer below had retried.
    let decisions = response.extensions().get::<Decisions>().expect("decided");
    assert_eq!(decisions.0.len(), 1, "{decisions:?}");
    assert_eq!(
        decisions.0[0].deny_reason(),
        Some(DenyReason::RetriedBelow),
        "{decisions:?}"
    );
    // The middle retried the back end to retryd's limit, each attempt
    // inside the edge's first attempt.
    let baggage = seen.all();
    let edge_layer = retryd_client::default_layer();
    assert_eq!(
        baggage,
        (1..=3)
            .map(|n| format!("retryd.lineage={edge_layer}:1/middle:{n}"))
            .collect::<Vec<_>>(),
        "one request at the edge, 3 at the back end (not 9)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_an_enclosing_retry_a_layer_does_not_retry() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (back, seen) = failing_back_end().await;
    let middle = middle(client.clone(), back).await;
    // A request that is itself the edge's second attempt, other members kept.
    let response = reqwest::Client::new()
        .get(format!("http://{middle}/v1/orders"))
        .header("baggage", "tenant=acme,retryd.lineage=edge:2")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    // Denied at once (INSIDE_ENCLOSING_RETRY), and said so upward.
    assert_eq!(response.headers()["retryd-retried"], "middle");
    assert_eq!(
        seen.all(),
        vec!["retryd.lineage=edge:2/middle:1".to_owned()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_without_lineage_still_sends_its_own_entry_and_keeps_other_baggage() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (back, seen) = failing_back_end().await;
    let error_or_response = http(&client, "lineage-direct")
        .get(format!("http://{back}/v1/things"))
        .header("baggage", "tenant=acme")
        .with_extension(safe())
        .send()
        .await;
    let response = match error_or_response {
        Ok(response) => response,
        Err(error) => panic!("a 503 comes back as a response: {error:?}"),
    };
    assert_eq!(response.status(), 503);
    let layer = retryd_client::default_layer();
    assert_eq!(
        seen.all(),
        (1..=3)
            .map(|n| format!("tenant=acme,retryd.lineage={layer}:{n}"))
            .collect::<Vec<_>>()
    );
}

/// A gRPC middle wearing LineageLayer: its DecideStream handler GETs a
/// failing back end (retried to the end), then streams one message and
/// fails in the trailers, as a streaming handler's late error does.
#[derive(Clone)]
struct StreamingMiddle {
    outbound: ClientWithMiddleware,
    back: SocketAddr,
}

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for StreamingMiddle {
    async fn decide(
        &self,
        _request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }

    type DecideStreamStream =
        futures::stream::BoxStream<'static, Result<pb::DecideResponse, tonic::Status>>;

    async fn decide_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::DecideRequest>>,
    ) -> Result<tonic::Response<Self::DecideStreamStream>, tonic::Status> {
        let failed = self
            .outbound
            .get(format!("http://{}/v1/things", self.back))
            .with_extension(safe())
            .send()
            .await
            .map_or(true, |response| !response.status().is_success());
        assert!(failed, "the back end always fails");
        let items = vec![
            Ok(pb::DecideResponse {
                decision_id: "first".into(),
                ..Default::default()
            }),
            Err(tonic::Status::unavailable("the back end failed")),
        ];
        Ok(tonic::Response::new(Box::pin(futures::stream::iter(items))))
    }

    async fn report_traffic(
        &self,
        _request: tonic::Request<pb::ReportTrafficRequest>,
    ) -> Result<tonic::Response<pb::ReportTrafficResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_failure_in_trailers_after_messages_is_marked() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let (back, seen) = failing_back_end().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let middle = StreamingMiddle {
        outbound: http(&client, "lineage-back"),
        back,
    };
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .layer(LineageLayer::new("middle"))
            .add_service(pb::retry_decider_server::RetryDeciderServer::new(middle))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    let mut edge = pb::retry_decider_client::RetryDeciderClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let mut responses = edge
        .decide_stream(futures::stream::iter([pb::DecideRequest::default()]))
        .await
        .expect("the stream opens")
        .into_inner();
    let first = responses.message().await.expect("a message");
    assert_eq!(first.expect("one message").decision_id, "first");
    let status = responses.message().await.expect_err("the late failure");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(
        status
            .metadata()
            .get("retryd-retried")
            .map(|v| v.to_str().unwrap()),
        Some("middle"),
        "{status:?}"
    );
    assert_eq!(
        status
            .metadata()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("-1")
    );
    // The middle's outbound attempts carried its lineage (edge-less: its own).
    assert_eq!(seen.all().len(), 3, "retried to the end by the middle");
}
