//! Hedged calls end to end, against a real retryd and real upstreams on
//! loopback (hyper for HTTP, tonic for gRPC) whose latency tail the test
//! controls: the next request to arrive is held, every other answers at
//! once. The servers record when each request arrived and count the
//! requests whose handler was dropped before answering (the client reset
//! the stream or closed the connection): a loser cancelled.
//!
//! retryd learns the delay from latencies the test reports through the
//! client's own reporter (180 at 5 ms, 20 at 50 ms: p95 about 50 ms, p50
//! 5 ms, not uniformly slow), at the default hedging policy.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use reqwest_middleware::ClientBuilder;
use retryd_client::engine::{DenyReason, Idempotency};
use retryd_client::{
    Call, Client, Decisions, FallbackPolicy, ReporterOptions, RetryMiddleware, RetrydLayer, Source,
    pb,
};
use tokio::net::TcpListener;
use tokio::time::Instant;

const CONFIG: &str = r#"
[defaults]
budget = { capacity = 10000.0, initial = 10000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "5ms", max = "20ms", jitter = "full" }

[upstreams.tail.hedging]
"#;

/// The tail of the latencies reported: a hedge delay of about 50 ms.
const FIFTY_MS: Duration = Duration::from_millis(50);

/// Longer than any test: a held request that is never cancelled fails it.
const HELD: Duration = Duration::from_secs(30);

/// What a tail server saw.
#[derive(Clone, Default)]
struct Tail {
    /// How the next requests to arrive are answered, in order: held for
    /// this long, then this status. Empty: 200 at once.
    script: Arc<Mutex<std::collections::VecDeque<(Duration, u16)>>>,
    arrivals: Arc<Mutex<Vec<Instant>>>,
    /// Handlers dropped before they answered.
    cancelled: Arc<AtomicU32>,
}

/// Counts a handler dropped before it answered.
struct Unanswered(Option<Arc<AtomicU32>>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(cancelled) = self.0.take() {
            cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Tail {
    fn hold_next(&self, hold: Duration) {
        self.then(hold, 200);
    }

    /// The next unscripted request is held for `hold`, then answered `status`.
    fn then(&self, hold: Duration, status: u16) {
        self.script.lock().unwrap().push_back((hold, status));
    }

    fn arrivals(&self) -> Vec<Instant> {
        self.arrivals.lock().unwrap().clone()
    }

    fn cancelled(&self) -> u32 {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// One request, as scripted; counted if dropped before answering.
    async fn handle(&self) -> u16 {
        self.arrivals.lock().unwrap().push(Instant::now());
        let (hold, status) = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((Duration::ZERO, 200));
        let mut guard = Unanswered(Some(self.cancelled.clone()));
        tokio::time::sleep(hold).await;
        guard.0 = None;
        status
    }
}

async fn http_tail() -> (SocketAddr, Tail) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let tail = Tail::default();
    let server = tail.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let tail = server.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let tail = tail.clone();
                    async move {
                        let _ = request.into_body().collect().await;
                        let status = tail.handle().await;
                        Ok::<_, Infallible>(
                            hyper::Response::builder()
                                .status(status)
                                .body(Full::new(Bytes::from_static(b"answer")))
                                .expect("response"),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, tail)
}

/// Reports `first_attempts` first attempts and latencies for `upstream`
/// (180 at 5 ms, 20 at `tail`: the p95, and so the delay, is about
/// `tail`), and returns the hedge delay retryd served back.
async fn learn(client: &Client, upstream: &str, first_attempts: u64, tail: Duration) -> Duration {
    let reporter = client.reporter();
    reporter.record(upstream, first_attempts);
    for _ in 0..180 {
        reporter.record_latency(upstream, true, Duration::from_millis(5));
    }
    for _ in 0..20 {
        reporter.record_latency(upstream, true, tail);
    }
    reporter.flush().await.expect("retryd takes the report");
    let served = reporter.hedging(upstream).expect("hedging served");
    assert!(served.enabled, "{served:?}");
    let delay = served.delay.expect("a delay");
    Duration::new(delay.seconds as u64, delay.nanos as u32)
}

/// A client whose reporter sends only when the test flushes it (the
/// interval is an hour), so that what is pending can be looked at.
async fn client(retryd: &support::Retryd) -> Client {
    Client::builder(format!("http://{}", retryd.grpc))
        .timeout(Duration::from_secs(5))
        .reporter(ReporterOptions {
            interval: Duration::from_secs(3600),
            ..ReporterOptions::default()
        })
        .connect()
        .await
        .expect("client")
}

fn http(client: &Client) -> reqwest_middleware::ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()))
        .build()
}

fn safe() -> Call {
    Call::new(Idempotency::Safe)
        .upstream("tail")
        .deadline_in(Duration::from_secs(20))
}

/// The sum of a metric's samples whose labels contain `label`.
fn metric(scrape: &str, name: &str, label: &str) -> f64 {
    scrape
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_http_call_is_hedged_after_the_served_delay_and_the_hedge_wins() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    let delay = learn(&client, "tail", 200, FIFTY_MS).await;
    let (addr, tail) = http_tail().await;
    tail.hold_next(HELD);
    let started = Instant::now();
    let response = http(&client)
        .get(format!("http://{addr}/items/7"))
        .with_extension(safe())
        .send()
        .await
        .expect("the hedge answers");
    let took = started.elapsed();
    assert_eq!(response.status(), 200);
    let decisions = response
        .extensions()
        .get::<Decisions>()
        .expect("the hedge decision")
        .0
        .clone();
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert!(decisions[0].should_retry(), "{decisions:?}");
    assert_eq!(decisions[0].source, Source::Retryd);
    assert_eq!(response.bytes().await.expect("body"), "answer");

    // Two requests: the first, and the hedge sent once the delay passed.
    let arrivals = tail.arrivals();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals[1] >= started + delay, "hedged before {delay:?}");
    assert!(
        took < HELD / 2,
        "the hedge answered, not the held first: {took:?}"
    );
    // The loser was cancelled: its connection closed, its handler dropped.
    support::retryd_testkit_eventually("the first attempt cancelled", || {
        (tail.cancelled() == 1).then_some(())
    })
    .await;

    // Reported: the cancelled first attempt as a success latency (no
    // outcome), the hedge as an attempt after the first, one hedge won.
    let traffic = client.reporter().pending_traffic().await;
    let tail_traffic = traffic["tail"];
    assert_eq!(
        tail_traffic.requests, 1,
        "one first attempt: {tail_traffic:?}"
    );
    assert_eq!(tail_traffic.successes + tail_traffic.failures, 0);
    assert_eq!(tail_traffic.retry_successes, 1);
    assert_eq!(tail_traffic.hedges_won, 1);
    client.reporter().flush().await.expect("reported");
    let scrape = retryd.scrape();
    assert_eq!(
        metric(&scrape, "retryd_hedges_won_total", "upstream=\"tail\""),
        1.0,
        "{scrape}"
    );
    // retryd counted the cancelled first attempt's latency (201 samples)
    // and no hedge as a first attempt (201 first attempts).
    let answer = retryd
        .decider()
        .await
        .decide(pb::DecideRequest {
            upstream: "tail".into(),
            idempotency: pb::Idempotency::Safe as i32,
            attempt: 1,
            hedge: 1,
            ..Default::default()
        })
        .await
        .expect("decided")
        .into_inner();
    assert!(
        answer.explanation.contains("201 samples")
            && answer.explanation.contains("of 201 first attempts"),
        "{}",
        answer.explanation
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_copy_fails_the_retry_path_decides_counting_every_copy() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    let delay = learn(&client, "tail", 200, FIFTY_MS).await;
    let (addr, tail) = http_tail().await;
    // The first attempt fails after the hedge went out; the hedge fails at
    // once; the retry (attempt 3 of the default 3) succeeds.
    tail.then(delay * 4, 503);
    tail.then(Duration::ZERO, 503);
    let response = http(&client)
        .get(format!("http://{addr}/"))
        .with_extension(safe())
        .send()
        .await
        .expect("the retry answers");
    assert_eq!(response.status(), 200);
    let decisions = &response.extensions().get::<Decisions>().expect("decided").0;
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert!(
        decisions[0].explanation.contains("hedge 1"),
        "{decisions:?}"
    );
    assert!(decisions[1].should_retry());
    assert!(!decisions[1].explanation.contains("hedge"), "{decisions:?}");
    assert_eq!(tail.arrivals().len(), 3);
    assert_eq!(tail.cancelled(), 0, "every copy ended on its own");
    let traffic = client.reporter().pending_traffic().await["tail"];
    assert_eq!((traffic.requests, traffic.failures), (1, 1), "{traffic:?}");
    assert_eq!((traffic.retry_failures, traffic.retry_successes), (1, 1));
    assert_eq!(traffic.hedges_won, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_call_never_asks_retryd() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    // A delay of about a second: no loaded machine makes a loopback call
    // that slow.
    learn(&client, "tail", 200, Duration::from_secs(1)).await;
    let (addr, tail) = http_tail().await;
    let http = http(&client);
    for _ in 0..20 {
        let response = http
            .get(format!("http://{addr}/"))
            .with_extension(safe())
            .send()
            .await
            .expect("answered");
        assert!(response.extensions().get::<Decisions>().is_none());
    }
    assert_eq!(tail.arrivals().len(), 20, "no copy sent");
    let scrape = retryd.scrape();
    assert_eq!(
        metric(&scrape, "retryd_hedges_total", "upstream=\"tail\""),
        0.0,
        "no hedge asked: {scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_denied_sends_no_copy_and_the_first_attempt_answers() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    // Ten first attempts: a cap of 5% of them is no hedge at all.
    let delay = learn(&client, "tail", 10, FIFTY_MS).await;
    let (addr, tail) = http_tail().await;
    // Held past the delay, then answered.
    let hold = delay * 4;
    tail.hold_next(hold);
    let started = Instant::now();
    let response = http(&client)
        .get(format!("http://{addr}/"))
        .with_extension(safe())
        .send()
        .await
        .expect("the first attempt answers");
    assert!(started.elapsed() >= hold);
    let decisions = &response.extensions().get::<Decisions>().expect("asked").0;
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].deny_reason(), Some(DenyReason::HedgeCap));
    assert_eq!(tail.arrivals().len(), 1, "no copy sent");
    assert_eq!(tail.cancelled(), 0);
    let scrape = retryd.scrape();
    assert_eq!(
        metric(&scrape, "retryd_hedges_total", "reason=\"hedge_cap\""),
        1.0,
        "{scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_or_streaming_call_is_never_hedged() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    let delay = learn(&client, "tail", 200, FIFTY_MS).await;
    let (addr, tail) = http_tail().await;
    let http = http(&client);
    // Undeclared: NON_IDEMPOTENT.
    tail.hold_next(delay * 3);
    let response = http
        .post(format!("http://{addr}/charges"))
        .with_extension(Call {
            upstream: Some("tail".into()),
            ..Call::default()
        })
        .body("charge")
        .send()
        .await
        .expect("answered");
    assert!(response.extensions().get::<Decisions>().is_none());
    // A streaming body is one-shot, however safe.
    tail.hold_next(delay * 3);
    let stream = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"part"))]);
    let response = http
        .put(format!("http://{addr}/things/1"))
        .with_extension(safe())
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .expect("answered");
    assert!(response.extensions().get::<Decisions>().is_none());
    assert_eq!(tail.arrivals().len(), 2, "no copy of either");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_retryd_unreachable_the_local_rule_hedges_at_its_fixed_delay() {
    let local_delay = Duration::from_millis(30);
    let client = Client::builder(format!("http://{}", support::refused_addr().await))
        .timeout(Duration::from_secs(2))
        .fallback(FallbackPolicy::default().local_hedge_delay(local_delay))
        .connect()
        .await
        .expect("client");
    let (addr, tail) = http_tail().await;
    let http = http(&client);
    // First attempts earn the local allowance: 5% of 30 is one hedge and a half.
    for _ in 0..30 {
        http.get(format!("http://{addr}/"))
            .with_extension(safe())
            .send()
            .await
            .expect("answered");
    }
    assert!(client.reporter().flush().await.is_err(), "retryd is away");
    assert!(client.outage().unreachable);
    tail.hold_next(HELD);
    let started = Instant::now();
    let response = http
        .get(format!("http://{addr}/"))
        .with_extension(safe())
        .send()
        .await
        .expect("the local hedge answers");
    let decisions = &response.extensions().get::<Decisions>().expect("hedged").0;
    assert_eq!(decisions.len(), 1);
    assert!(decisions[0].should_retry(), "{decisions:?}");
    assert_eq!(decisions[0].source, Source::Fallback);
    let arrivals = tail.arrivals();
    assert_eq!(arrivals.len(), 32);
    assert!(arrivals[31] >= started + local_delay);
    support::retryd_testkit_eventually("the first attempt cancelled", || {
        (tail.cancelled() == 1).then_some(())
    })
    .await;
    // The allowance is spent: the next slow call is denied HEDGE_CAP and
    // answered by its first attempt.
    tail.hold_next(local_delay * 4);
    let response = http
        .get(format!("http://{addr}/"))
        .with_extension(safe())
        .send()
        .await
        .expect("the first attempt answers");
    let decisions = &response.extensions().get::<Decisions>().expect("asked").0;
    assert_eq!(decisions[0].deny_reason(), Some(DenyReason::HedgeCap));
    assert_eq!(tail.arrivals().len(), 33);
}

/// A gRPC upstream with the same tail (retryd's contract stands in for any
/// service: each Decide is one call).
#[derive(Clone)]
struct GrpcTail(Tail);

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for GrpcTail {
    async fn decide(
        &self,
        _request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        let _ = self.0.handle().await;
        Ok(tonic::Response::new(pb::DecideResponse {
            decision_id: "upstream-ok".into(),
            ..Default::default()
        }))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_unary_grpc_call_is_hedged_and_the_loser_cancelled() {
    let retryd = support::Retryd::start(CONFIG);
    let client = client(&retryd).await;
    // About a second: the fast call below (which sets up the connection)
    // never gets near it.
    let delay = learn(&client, "tail", 200, Duration::from_secs(1)).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let tail = Tail::default();
    let service = pb::retry_decider_server::RetryDeciderServer::new(GrpcTail(tail.clone()));
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy();
    let governed = tower::ServiceBuilder::new()
        .layer(RetrydLayer::new(client.clone(), "tail"))
        .service(channel);
    let mut upstream = pb::retry_decider_client::RetryDeciderClient::new(governed);
    let call = || {
        let mut request = tonic::Request::new(pb::DecideRequest::default());
        request.extensions_mut().insert(safe());
        request
    };
    // A fast call: no hedge asked.
    upstream.decide(call()).await.expect("answered");
    assert_eq!(tail.arrivals().len(), 1);

    tail.hold_next(HELD);
    let started = Instant::now();
    let response = upstream.decide(call()).await.expect("the hedge answers");
    assert_eq!(response.get_ref().decision_id, "upstream-ok");
    let arrivals = tail.arrivals();
    assert_eq!(arrivals.len(), 3);
    assert!(arrivals[2] >= started + delay, "hedged before {delay:?}");
    assert!(started.elapsed() < HELD / 2);
    // The held call's stream was reset: its handler dropped.
    support::retryd_testkit_eventually("the first attempt cancelled", || {
        (tail.cancelled() == 1).then_some(())
    })
    .await;
    let traffic = client.reporter().pending_traffic().await["tail"];
    assert_eq!(traffic.requests, 2);
    assert_eq!(traffic.successes, 1, "the fast call only: {traffic:?}");
    assert_eq!(traffic.retry_successes, 1, "the hedge");
    assert_eq!(traffic.hedges_won, 1);
    client.reporter().flush().await.expect("reported");
    let scrape = retryd.scrape();
    assert_eq!(
        metric(&scrape, "retryd_hedges_won_total", "upstream=\"tail\""),
        1.0
    );
    assert_eq!(
        metric(&scrape, "retryd_hedges_total", "outcome=\"granted\""),
        1.0
    );
}
