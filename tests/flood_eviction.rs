//! After a flood of made-up upstream names goes idle, the memory store's
//! table shrinks and new legitimate upstreams are tracked again; a bucket
//! made again starts from its initial tokens (issue 23). In process, on a
//! clock the test moves, with the eviction sweep called by the test, so
//! nothing waits on real time; the calls go through gRPC as a caller's do.

use std::sync::Arc;
use std::time::Duration;

use retryd::config::Config;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::memory::ManualClock;
use retryd_budget::{BucketConfig, BudgetStore, MemoryBudgetStore};
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use retryd_testkit::retryable;
use tonic::Code;

const LIMIT: usize = 50;
const SECOND: u64 = 1_000_000_000;

const CONFIG: &str = r#"
[limits]
max_upstreams = 50
evict_idle_after = "60s"

[defaults]
budget = { capacity = 10.0, initial = 10.0, ratio = 0.1, min_per_second = 1.0 }

[upstreams."payments-api"]
max_attempts = 3
"#;

/// The service on `127.0.0.1:0` over a memory store on `clock`; the
/// returned handle is the same service, for sweeps and store reads.
async fn start(
    clock: &ManualClock,
) -> (
    Service<MemoryBudgetStore<ManualClock>>,
    RetryDeciderClient<tonic::transport::Channel>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    std::fs::write(&path, CONFIG).unwrap();
    let config = Config::load(Some(&path)).unwrap();
    let acceptor = Acceptor::try_new(config.tls.as_ref(), &config.server_limits).unwrap();
    let metrics = Arc::new(Metrics::new(config.policies.named().map(|(name, _)| name)));
    let store = MemoryBudgetStore::with_clock(config.max_upstreams, clock.clone());
    let service = Service::new(
        store,
        "memory",
        Reload {
            path: Some(path),
            startup: config,
        },
        Arc::clone(&metrics),
        Tracer::disabled(),
    );
    let listener = grpc::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(grpc::serve(
        listener,
        acceptor,
        service.clone(),
        std::future::pending(),
        Duration::from_secs(1),
    ));
    let client = RetryDeciderClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (service, client, dir)
}

fn tracked<S: BudgetStore>(service: &Service<S>) -> usize {
    let live = service.policies();
    futures::executor::block_on(
        service
            .store()
            .list(|upstream| live.policies.get(upstream).bucket),
    )
    .unwrap()
    .len()
}

#[tokio::test]
async fn after_an_idle_flood_the_table_shrinks_and_new_upstreams_are_tracked() {
    let clock = ManualClock::default();
    let (service, mut decider, _dir) = start(&clock).await;
    for i in 0..LIMIT {
        decider
            .decide(retryable(&format!("made-up-{i:03}")))
            .await
            .unwrap();
    }
    // Used more: "made-up-000" is down to 7 of its 10 tokens.
    for _ in 0..2 {
        decider.decide(retryable("made-up-000")).await.unwrap();
    }
    decider.decide(retryable("payments-api")).await.unwrap();
    let refused = decider.decide(retryable("legit-new")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(tracked(&service), LIMIT + 1);

    // Idle, but not for the whole period: nothing goes.
    clock.advance(59 * SECOND);
    assert_eq!(service.sweep(), 0);
    // Idle a minute and refilled: every made-up name goes; the configured
    // upstream stays.
    clock.advance(2 * SECOND);
    assert_eq!(service.sweep(), LIMIT);
    assert_eq!(tracked(&service), 1);
    let metrics = service.store().stats();
    assert_eq!(metrics.evicted_upstreams, LIMIT as u64);

    // New legitimate upstreams are tracked again, from their initial tokens,
    // and so is a flooded name made again.
    let answer = decider
        .decide(retryable("legit-new"))
        .await
        .expect("room again after the flood went idle")
        .into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Retry);
    assert_eq!(answer.tokens_remaining, 9.0);
    let again = decider
        .decide(retryable("made-up-000"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.tokens_remaining, 9.0,
        "a re-created bucket starts at initial"
    );
    assert_eq!(tracked(&service), 3);
}

#[tokio::test]
async fn a_bucket_below_its_initial_tokens_stays_until_refilled() {
    let config = BucketConfig {
        capacity: 10.0,
        initial: 10.0,
        ratio: 0.1,
        min_per_second: 1.0,
        ..BucketConfig::default()
    };
    let clock = ManualClock::default();
    let (service, mut decider, _dir) = start(&clock).await;
    for _ in 0..10 {
        decider.decide(retryable("drained")).await.unwrap();
    }
    assert_eq!(
        futures::executor::block_on(service.store().view("drained", &config))
            .unwrap()
            .tokens,
        0.0
    );
    // At 1 token a second the drained bucket is full again after 10 s, so
    // after a minute idle it goes.
    clock.advance(61 * SECOND);
    assert_eq!(service.sweep(), 1);
    let slow = BucketConfig {
        min_per_second: 0.1,
        ..config
    };
    // Drained again, at a tenth of the floor: a minute refills 6 of 10
    // tokens, and the bucket stays until it has all 10.
    for _ in 0..10 {
        futures::executor::block_on(service.store().try_withdraw("drained", &slow)).unwrap();
    }
    clock.advance(61 * SECOND);
    assert_eq!(
        service
            .store()
            .evict_idle(Duration::from_secs(60), |_| slow),
        0,
        "6.1 of 10 tokens refilled: not yet"
    );
    clock.advance(40 * SECOND);
    assert_eq!(
        service
            .store()
            .evict_idle(Duration::from_secs(60), |_| slow),
        1
    );
}
