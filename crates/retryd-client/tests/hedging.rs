//! The reporter's part of hedging, against a real retryd: first attempts'
//! latencies go out in the contract's buckets, and the hedge delay retryd
//! serves comes back in the report's answer. Both adapters record the
//! latencies of first attempts only.

mod support;

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use retryd_client::engine::Idempotency;
use retryd_client::{Call, RetryMiddleware, pb};
use support::{Answer, hyper_server};

const CONFIG: &str = r#"
[defaults]
budget = { capacity = 10000.0, initial = 10000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "5ms", max = "20ms", jitter = "full" }

[upstreams.fast.hedging]
"#;

#[tokio::test]
async fn a_reported_tail_comes_back_as_a_hedge_delay() {
    let retryd = support::Retryd::start(CONFIG);
    let client = support::client(&retryd).await;
    let reporter = client.reporter();
    // Nothing learned yet: no delay, no hedging.
    assert_eq!(reporter.hedging("fast"), None);
    reporter.record("fast", 200);
    for _ in 0..180 {
        reporter.record_latency("fast", true, Duration::from_millis(10));
    }
    for _ in 0..20 {
        reporter.record_latency("fast", true, Duration::from_millis(100));
    }
    // Failures are reported apart, and do not make the delay.
    reporter.record_latency("fast", false, Duration::from_millis(1));
    reporter.flush().await.expect("retryd takes the report");
    let hedging: pb::Hedging = reporter
        .hedging("fast")
        .expect("retryd served fast's hedging");
    assert!(hedging.enabled, "{hedging:?}");
    let delay = hedging.delay.expect("a delay");
    let millis = delay.seconds as f64 * 1e3 + f64::from(delay.nanos) / 1e6;
    assert!((87.5..=112.5).contains(&millis), "{millis} ms");
    assert_eq!(hedging.max_hedges, 1);
    // An upstream without a policy gets none.
    reporter.record("plain", 1);
    reporter.flush().await.unwrap();
    assert_eq!(reporter.hedging("plain"), None);
}

#[tokio::test]
async fn the_middleware_reports_first_attempt_latencies() {
    let retryd = support::Retryd::start(CONFIG);
    let client = support::client(&retryd).await;
    let http = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(client.clone()))
        .build();
    // Two calls answered at once (a 404 is a success), one failing three
    // times (a first attempt that failed, two retries).
    let (found, _) = hyper_server(Answer::Status(404, vec![])).await;
    let (failing, attempts) = hyper_server(Answer::Status(503, vec![])).await;
    for addr in [found, found, failing] {
        let _ = http
            .get(format!("http://{addr}/"))
            .with_extension(Call::new(Idempotency::Idempotent).upstream("fast"))
            .send()
            .await;
    }
    assert_eq!(attempts.count(), 3);
    client.reporter().flush().await.unwrap();
    // Two first-attempt successes reached retryd's window: too few to
    // hedge, and counted in the numbers a hedge decision gives.
    let hedging = client.reporter().hedging("fast").expect("served");
    assert!(!hedging.enabled);
    let mut decider =
        pb::retry_decider_client::RetryDeciderClient::connect(format!("http://{}", retryd.grpc))
            .await
            .unwrap();
    let answer = decider
        .decide(pb::DecideRequest {
            upstream: "fast".into(),
            idempotency: pb::Idempotency::Idempotent as i32,
            attempt: 1,
            hedge: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        answer
            .explanation
            .contains("over 2 samples, 0 hedges of 3 first attempts"),
        "{}",
        answer.explanation
    );
}
