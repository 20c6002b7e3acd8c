//! The service in the test's own process: `retryd`'s public API serving on
//! `127.0.0.1:0`, over a store whose readiness (when each answer comes) and
//! clock the test controls. For behaviours that depend on timing, this
//! replaces sleeping and hoping: the test decides the order of events.
//!
//! The black-box suites run the real binary for what only a process shows
//! (startup, signals, ports, TLS).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryd::config::Config;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::memory::{Clock, ManualClock};
use retryd_budget::{
    BucketConfig, BudgetCheck, BudgetSnapshot, BudgetStore, FleetCall, MemoryBudgetStore,
    ReportClaim, StoreError,
};
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use retryd_testkit::{HANG_GUARD, retryable};
use tokio::sync::Semaphore;
use tonic::transport::Channel;

/// retryd serving `store` with the configuration `toml`, in this process.
struct InProcess {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl InProcess {
    async fn start<S: BudgetStore>(toml: &str, store: S) -> InProcess {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("retryd.toml");
        std::fs::write(&path, toml).unwrap();
        let config = Config::load(Some(&path)).unwrap();
        let acceptor = Acceptor::try_new(config.tls.as_ref(), &config.server_limits).unwrap();
        let metrics = Arc::new(Metrics::new(config.policies.named().map(|(name, _)| name)));
        let tracer = Tracer::disabled();
        let service = Service::new(
            store,
            "in-process",
            Reload {
                path: Some(path),
                startup: config,
            },
            metrics,
            tracer,
        );
        let listener = grpc::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(grpc::serve(
            listener,
            acceptor,
            service,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        InProcess {
            addr,
            stop: Some(stop),
            _dir: dir,
        }
    }

    async fn decider(&self) -> RetryDeciderClient<Channel> {
        RetryDeciderClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A store that answers a decision's call for an upstream only when the
/// test opens that upstream's gate, once per opening: the asynchronous
/// path production Redis takes (`ANSWERS_AT_ONCE` is false), with the
/// order of answers in the test's hands.
#[derive(Clone)]
struct GatedStore {
    inner: Arc<MemoryBudgetStore>,
    gates: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
    answered: Arc<AtomicUsize>,
    /// The next deposit to this upstream fails, as a Redis timeout would
    /// (without depositing).
    failing_deposit: Arc<Mutex<Option<String>>>,
}

impl GatedStore {
    fn new() -> GatedStore {
        GatedStore {
            inner: Arc::new(MemoryBudgetStore::new(100)),
            gates: Arc::default(),
            answered: Arc::default(),
            failing_deposit: Arc::default(),
        }
    }

    fn fail_next_deposit(&self, upstream: &str) {
        *self.failing_deposit.lock().unwrap() = Some(upstream.to_owned());
    }

    fn gate(&self, upstream: &str) -> Arc<Semaphore> {
        let mut gates = self.gates.lock().unwrap();
        Arc::clone(
            gates
                .entry(upstream.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(0))),
        )
    }

    /// Lets one call for `upstream` through.
    fn open(&self, upstream: &str) {
        self.gate(upstream).add_permits(1);
    }

    /// Waits until `count` calls have been answered (bounded by the
    /// testkit's hang guard, since nothing here races the clock).
    async fn wait_answered(&self, count: usize) {
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        while self.answered.load(Ordering::SeqCst) < count {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} of {count} answered",
                self.answered.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

impl BudgetStore for GatedStore {
    async fn view(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> Result<BudgetSnapshot, StoreError> {
        self.inner.view(upstream, config).await
    }

    async fn check_in_fleet(
        &self,
        upstream: &str,
        config: &BucketConfig,
        withdraw: bool,
        fleet: FleetCall,
    ) -> Result<BudgetCheck, StoreError> {
        let gate = self.gate(upstream);
        gate.acquire()
            .await
            .expect("gates are never closed")
            .forget();
        let checked = self
            .inner
            .check_in_fleet(upstream, config, withdraw, fleet)
            .await;
        self.answered.fetch_add(1, Ordering::SeqCst);
        checked
    }

    async fn try_withdraw(
        &self,
        upstream: &str,
        config: &BucketConfig,
    ) -> Result<Option<f64>, StoreError> {
        self.inner.try_withdraw(upstream, config).await
    }

    async fn note_level(
        &self,
        upstream: &str,
        config: &BucketConfig,
        level: f64,
    ) -> Result<(), StoreError> {
        self.inner.note_level(upstream, config, level).await
    }

    async fn admit(&self, upstreams: &[(&str, &BucketConfig)]) -> Result<(), StoreError> {
        self.inner.admit(upstreams).await
    }

    async fn deposit(
        &self,
        upstream: &str,
        config: &BucketConfig,
        requests: u64,
    ) -> Result<(), StoreError> {
        let fail = {
            let mut failing = self.failing_deposit.lock().unwrap();
            let fail = failing.as_deref() == Some(upstream);
            if fail {
                *failing = None;
            }
            fail
        };
        if fail {
            return Err(StoreError::Unavailable(
                "the test failed this deposit".into(),
            ));
        }
        self.inner.deposit(upstream, config, requests).await
    }

    async fn claim_report(
        &self,
        id: &str,
        digest: u64,
        entries: u32,
        window: Duration,
    ) -> Result<ReportClaim, StoreError> {
        self.inner.claim_report(id, digest, entries, window).await
    }

    async fn settle_report(&self, id: &str, digest: u64, applied: u32) -> Result<(), StoreError> {
        self.inner.settle_report(id, digest, applied).await
    }

    async fn set_retries_enabled(
        &self,
        upstream: &str,
        config: &BucketConfig,
        enabled: bool,
    ) -> Result<bool, StoreError> {
        self.inner
            .set_retries_enabled(upstream, config, enabled)
            .await
    }

    async fn list<F>(&self, config_of: F) -> Result<Vec<BudgetSnapshot>, StoreError>
    where
        F: Fn(&str) -> BucketConfig + Send,
    {
        self.inner.list(config_of).await
    }
}

const CONFIG: &str = "[defaults]\nmax_attempts = 3\n";

/// DecideStream answers in request order on the asynchronous path, even
/// when the store answers in the opposite order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_answers_in_request_order_whatever_order_the_store_answers_in() {
    let store = GatedStore::new();
    let server = InProcess::start(CONFIG, store.clone()).await;
    let mut client = server.decider().await;
    // Even items would RETRY, odd ones are past max_attempts (DENY): every
    // item still makes its one store call, each for its own upstream.
    let items: Vec<pb::DecideRequest> = (0..8)
        .map(|i| pb::DecideRequest {
            attempt: if i % 2 == 0 { 1 } else { 5 },
            ..retryable(&format!("u{i}"))
        })
        .collect();
    let (sender, receiver) = tokio::sync::mpsc::channel(16);
    for item in &items {
        sender.send(item.clone()).await.unwrap();
    }
    let mut responses = client
        .decide_stream(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    // The store answers the last item first, and so on back to the first.
    for (answered, i) in (0..8).rev().enumerate() {
        store.open(&format!("u{i}"));
        store.wait_answered(answered + 1).await;
    }
    let mut verdicts = Vec::new();
    for _ in 0..8 {
        let response = responses.message().await.unwrap().unwrap();
        assert!(response.error.is_none(), "{response:?}");
        verdicts.push(response.verdict());
    }
    use pb::Verdict::{Deny, Retry};
    assert_eq!(
        verdicts,
        [Retry, Deny, Retry, Deny, Retry, Deny, Retry, Deny]
    );
    drop(sender);
}

/// The memory store on a clock the test moves: the floor refills exactly
/// what the elapsed time allows, with no sleep.
#[tokio::test]
async fn the_floor_refills_as_the_clock_moves_and_no_faster() {
    let clock = ManualClock::default();
    let store = MemoryBudgetStore::with_clock(100, clock.clone());
    let server = InProcess::start(
        "[defaults]\nbudget = { capacity = 10.0, initial = 2.0, ratio = 0.0, min_per_second = 2.0 }\n",
        store,
    )
    .await;
    let mut client = server.decider().await;
    let retries = |n: usize| {
        let mut client = client.clone();
        async move {
            let mut granted = 0;
            for _ in 0..n {
                let response = client
                    .decide(retryable("ledger"))
                    .await
                    .unwrap()
                    .into_inner();
                if response.verdict() == pb::Verdict::Retry {
                    granted += 1;
                }
            }
            granted
        }
    };
    // The initial two tokens, then nothing while the clock stands still.
    assert_eq!(retries(5).await, 2);
    assert_eq!(retries(5).await, 0);
    // 1.5 s at two a second: three tokens.
    clock.advance(1_500_000_000);
    assert_eq!(retries(5).await, 3);
    // Capped at capacity however long it stood.
    clock.advance(3_600 * 1_000_000_000);
    assert_eq!(retries(20).await, 10);
    let _ = client.decide(retryable("ledger")).await.unwrap();
    assert_eq!(clock.now_nanos(), 3_601_500_000_000);
}

/// A report with an id whose deposit failed at entry 1 says so; its
/// re-send applies only what follows entry 1: entry 0 is not counted twice
/// and entry 1, of unknown outcome in general, is skipped.
#[tokio::test]
async fn a_resent_report_resumes_after_a_partial_failure() {
    let store = GatedStore::new();
    let server = InProcess::start(
        "[defaults]\nbudget = { capacity = 100.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }\n",
        store.clone(),
    )
    .await;
    let mut client = server.decider().await;
    let batch = pb::ReportTrafficRequest {
        traffic: [("a", 5), ("b", 3), ("c", 2)]
            .into_iter()
            .map(|(upstream, requests)| pb::UpstreamTraffic {
                upstream: upstream.into(),
                requests,
                ..Default::default()
            })
            .collect(),
        report_id: "9d2b6e1f-partial".into(),
    };
    store.fail_next_deposit("b");
    let status = client.report_traffic(batch.clone()).await.unwrap_err();
    assert!(status.message().starts_with("traffic[1]: "), "{status:?}");
    let resent = client
        .report_traffic(batch.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (resent.accepted, resent.already_applied),
        (1, 2),
        "{resent:?}"
    );
    let again = client.report_traffic(batch).await.unwrap().into_inner();
    assert_eq!((again.accepted, again.already_applied), (0, 3), "{again:?}");
    let config = BucketConfig {
        capacity: 100.0,
        initial: 0.0,
        ratio: 1.0,
        min_per_second: 0.0,
        ..BucketConfig::default()
    };
    for (upstream, expected) in [("a", 5.0), ("b", 0.0), ("c", 2.0)] {
        let seen = store.inner.view(upstream, &config).await.unwrap().tokens;
        assert_eq!(seen, expected, "{upstream}");
    }
}

/// One step of a scripted sequence: a decision of some kind, or a report.
#[derive(Clone, Debug)]
enum Step {
    Retryable,
    NotFound,
    Payment,
    Report(u64),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => Just(Step::Retryable),
        1 => Just(Step::NotFound),
        1 => Just(Step::Payment),
        2 => (0u64..20).prop_map(Step::Report),
    ]
}

/// Runs `steps` against a server with `toml` and returns each live answer
/// (verdict, reason, rule, tokens): the jittered backoff aside, all of it.
async fn live_answers(toml: &str, steps: &[Step]) -> Vec<(i32, i32, u32, f64)> {
    let server = InProcess::start(toml, MemoryBudgetStore::new(100)).await;
    let mut client = server.decider().await;
    let mut answers = Vec::new();
    for step in steps {
        let request = match step {
            Step::Retryable => retryable("pay"),
            Step::NotFound => pb::DecideRequest {
                failure: 0,
                http_status: 404,
                ..retryable("pay")
            },
            Step::Payment => pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                failure: pb::FailureKind::ConnectionReset as i32,
                ..retryable("pay")
            },
            Step::Report(requests) => {
                client
                    .report_traffic(pb::ReportTrafficRequest {
                        traffic: vec![pb::UpstreamTraffic {
                            upstream: "pay".into(),
                            requests: *requests,
                            ..Default::default()
                        }],
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                continue;
            }
        };
        let answer = client.decide(request).await.unwrap().into_inner();
        answers.push((
            answer.verdict,
            answer.deny_reason,
            answer.rule,
            answer.tokens_remaining,
        ));
    }
    answers
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// A candidate policy never changes a live answer: the same sequence
    /// of decisions and reports gets the same answers with and without it
    /// (no floor, so that the two runs' timing cannot differ).
    #[test]
    fn a_candidate_never_changes_a_live_answer(steps in proptest::collection::vec(step(), 1..40)) {
        let live = "[upstreams.pay]\nbudget = { capacity = 10.0, initial = 3.0, ratio = 0.2, min_per_second = 0.0 }\n";
        let with_candidate = format!(
            "{live}candidate = {{ max_attempts = 2, budget = {{ initial = 0.0, ratio = 1.0 }}, transient_500 = true }}\n"
        );
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (without, with) = runtime.block_on(async {
            (live_answers(live, &steps).await, live_answers(&with_candidate, &steps).await)
        });
        proptest::prop_assert_eq!(without, with);
    }
}
