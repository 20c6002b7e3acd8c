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
use retryd_client::{Client, Decisions, LineageLayer, RetryMiddleware};
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
async fn serve<S>(service: S) -> SocketAddr
where
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = hyper::Response<Full<Bytes>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
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
