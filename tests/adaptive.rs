//! The adaptive budget end to end, through the real gRPC pipeline in this
//! process: traffic reports with outcomes fund retries only as far as the
//! upstream's attempts succeed, identically on the memory store (on a
//! manual clock), Redis exact and Redis leased (each on a redis-server the
//! test starts); `adaptive = false` funds every request; and the
//! fleet-wide bound (retries ≤ initial + ratio × reported + floor ×
//! elapsed) holds, a property test on a controlled clock.

use std::time::{Duration, Instant};

use retryd_budget::memory::ManualClock;
use retryd_budget::redis::{Exact, Leased};
use retryd_budget::{BudgetStore, MemoryBudgetStore};
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use retryd_testkit::redis::{RedisServer, fresh_prefix};
use retryd_testkit::{HANG_GUARD, retryable};
use tonic::transport::Channel;

mod in_process_server;
use in_process_server::{InProcess, redis_store};

/// The default store.timeout: these calls are few and the test waits for
/// the leased mode's flushes, not for latency.
const STORE_TIMEOUT: Duration = Duration::from_millis(20);

/// No initial tokens and no floor: every token comes from a report, so
/// what a report funded is exactly what can be withdrawn, whatever the
/// clock does.
///
/// No recovery ramp (`ramp_window = "0s"`): the outage's recovery below
/// would start one, admitting only part of what was funded for 5 s; what
/// is funded is this suite's, the ramp tests/ramp.rs's.
fn config(adaptive: bool) -> String {
    format!(
        "[defaults]\nadaptive = {adaptive}\nramp_window = \"0s\"\nbudget = {{ capacity = 1000.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }}\n"
    )
}

fn entry(upstream: &str, requests: u64, outcomes: [u64; 4]) -> pb::UpstreamTraffic {
    pb::UpstreamTraffic {
        upstream: upstream.into(),
        requests,
        successes: outcomes[0],
        failures: outcomes[1],
        retry_successes: outcomes[2],
        retry_failures: outcomes[3],
        ..Default::default()
    }
}

async fn report(client: &mut RetryDeciderClient<Channel>, entries: Vec<pb::UpstreamTraffic>) {
    client
        .report_traffic(pb::ReportTrafficRequest {
            traffic: entries,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// The upstream's budget as `GetBudget` shows it.
async fn get_budget(server: &InProcess, upstream: &str) -> pb::Budget {
    server
        .admin()
        .await
        .get_budget(pb::GetBudgetRequest {
            upstream: upstream.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap()
}

/// Waits until the upstream's budget reads `expected` tokens (the leased
/// mode flushes deposits in its background round), then spends it all:
/// the RETRY answers granted.
async fn spend_all(server: &InProcess, upstream: &str, expected: f64) -> u64 {
    let mut admin = server.admin().await;
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let budget = admin
            .get_budget(pb::GetBudgetRequest {
                upstream: upstream.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .budget
            .unwrap();
        if (budget.tokens - expected).abs() < 1e-9 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{upstream}: {} tokens, expected {expected}",
            budget.tokens
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut client = server.decider().await;
    let mut granted = 0;
    loop {
        let answer = client
            .decide(retryable(upstream))
            .await
            .unwrap()
            .into_inner();
        // A leased replica that found the bucket empty trusts that reading
        // for its view cache (100 ms), while GetBudget reads Redis: a
        // deposit shows in its decisions once the reading is renewed. A
        // DENY spends nothing, so waiting for the first RETRY is exact.
        if answer.verdict() != pb::Verdict::Retry && granted == 0 && expected >= 1.0 {
            assert_eq!(answer.deny_reason(), pb::DenyReason::BudgetExhausted);
            assert!(
                Instant::now() < deadline,
                "{upstream}: {expected} tokens read, but no RETRY"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        if answer.verdict() != pb::Verdict::Retry {
            assert_eq!(answer.deny_reason(), pb::DenyReason::BudgetExhausted);
            return granted;
        }
        granted += 1;
        assert!(granted <= 10_000, "{upstream}: the budget never ran out");
    }
}

/// The cases every store must answer alike.
async fn adaptive_cases<S: BudgetStore, T: BudgetStore>(adaptive: S, fixed: T) {
    let server = InProcess::start(&config(true), adaptive).await;
    let mut client = server.decider().await;
    // One caller's 429 with Retry-After: the upstream paces the fleet for
    // 30 s (this decision's own RETRY finds no token: none is funded yet).
    let paced = client
        .decide(pb::DecideRequest {
            upstream: "paced".into(),
            idempotency: pb::Idempotency::Idempotent as i32,
            attempt: 1,
            evidence: pb::Evidence::ResponseReceived as i32,
            http_status: 429,
            retry_after: "30".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        paced.deny_reason(),
        pb::DenyReason::BudgetExhausted,
        "{paced:?}"
    );
    report(
        &mut client,
        vec![
            // An outage: 100 first attempts failed, and 40 retries.
            entry("outage", 100, [0, 100, 0, 40]),
            // 10% and 30% failing, retries mostly succeeding: unchanged.
            entry("ten", 100, [90, 10, 9, 1]),
            entry("thirty", 100, [70, 30, 21, 9]),
            // 3 in 10 succeeding: 1 − (10 − 6) / 11 = 7/11 of 110.
            entry("mostly-failing", 110, [3, 7, 0, 0]),
            // First attempts fine, no retry succeeding: 1/21 of 100 = 4.
            entry("sticky", 100, [80, 20, 0, 20]),
            // A caller that reports no outcomes funds as before.
            entry("silent", 100, [0, 0, 0, 0]),
            // Every first attempt failed while the upstream paced: its
            // announced 429s, not ill health: funded in full.
            entry("paced", 100, [0, 100, 0, 0]),
        ],
    )
    .await;
    assert_eq!(spend_all(&server, "paced", 50.0).await, 50);
    assert_eq!(spend_all(&server, "outage", 0.0).await, 0);
    assert_eq!(spend_all(&server, "ten", 50.0).await, 50);
    assert_eq!(spend_all(&server, "thirty", 50.0).await, 50);
    assert_eq!(spend_all(&server, "mostly-failing", 35.0).await, 35);
    assert_eq!(spend_all(&server, "sticky", 2.0).await, 2);
    assert_eq!(spend_all(&server, "silent", 50.0).await, 50);
    // The outage's successes return: the next report funds in full.
    report(&mut client, vec![entry("outage", 20, [20, 0, 0, 0])]).await;
    assert_eq!(spend_all(&server, "outage", 10.0).await, 10);

    assert!(get_budget(&server, "outage").await.adaptive);
    drop(server);

    let server = InProcess::start(&config(false), fixed).await;
    assert!(!get_budget(&server, "outage").await.adaptive);
    let mut client = server.decider().await;
    report(&mut client, vec![entry("outage", 100, [0, 100, 0, 40])]).await;
    assert_eq!(spend_all(&server, "outage", 50.0).await, 50);
}

#[tokio::test]
async fn memory_store_funds_by_outcome() {
    let clock = ManualClock::default();
    adaptive_cases(
        MemoryBudgetStore::with_clock(100, clock.clone()),
        MemoryBudgetStore::with_clock(100, clock),
    )
    .await;
}

#[tokio::test]
async fn redis_exact_funds_by_outcome() {
    let redis = RedisServer::start();
    adaptive_cases(
        redis_store::<Exact>(&[redis.url()], &fresh_prefix("adaptive"), STORE_TIMEOUT).await,
        redis_store::<Exact>(&[redis.url()], &fresh_prefix("adaptive"), STORE_TIMEOUT).await,
    )
    .await;
}

#[tokio::test]
async fn redis_leased_funds_by_outcome() {
    let redis = RedisServer::start();
    adaptive_cases(
        redis_store::<Leased>(&[redis.url()], &fresh_prefix("adaptive"), STORE_TIMEOUT).await,
        redis_store::<Leased>(&[redis.url()], &fresh_prefix("adaptive"), STORE_TIMEOUT).await,
    )
    .await;
}

/// One step of a scripted sequence.
#[derive(Clone, Debug)]
enum Step {
    /// A report: requests and the four outcome counts.
    Report(u64, [u64; 4]),
    /// A retryable failure asking for a RETRY.
    Decide,
    /// The clock moves on, in milliseconds.
    Advance(u64),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let count = || prop_oneof![Just(0u64), 0u64..50];
    prop_oneof![
        2 => (0u64..100, [count(), count(), count(), count()]).prop_map(|(n, o)| Step::Report(n, o)),
        6 => Just(Step::Decide),
        1 => (0u64..3_000).prop_map(Step::Advance),
    ]
}

const INITIAL: f64 = 5.0;
const RATIO: f64 = 0.2;
const FLOOR: f64 = 2.0;

/// Runs `steps` on a memory store on a manual clock; returns the RETRYs
/// granted, the requests reported and the milliseconds elapsed.
async fn run_steps(adaptive: bool, steps: &[Step]) -> (u64, u64, u64) {
    let clock = ManualClock::default();
    let toml = format!(
        "[defaults]\nadaptive = {adaptive}\nbudget = {{ capacity = 20.0, initial = {INITIAL}, ratio = {RATIO}, min_per_second = {FLOOR} }}\n"
    );
    let server = InProcess::start(&toml, MemoryBudgetStore::with_clock(100, clock.clone())).await;
    let mut client = server.decider().await;
    let (mut granted, mut reported, mut elapsed) = (0, 0, 0);
    for step in steps {
        match step {
            Step::Report(requests, outcomes) => {
                report(&mut client, vec![entry("up", *requests, *outcomes)]).await;
                reported += requests;
            }
            Step::Decide => {
                let answer = client.decide(retryable("up")).await.unwrap().into_inner();
                granted += u64::from(answer.verdict() == pb::Verdict::Retry);
            }
            Step::Advance(millis) => {
                clock.advance(millis * 1_000_000);
                elapsed += millis;
            }
        }
    }
    (granted, reported, elapsed)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Whatever the outcomes reported, the adaptive budget grants within
    /// the fleet-wide bound, and never more than the same budget without
    /// the rule would (it only takes deposits away).
    #[test]
    fn the_bound_holds_with_the_adaptive_rule(steps in proptest::collection::vec(step(), 1..60)) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let ((adaptive, reported, elapsed), (fixed, _, _)) = runtime.block_on(async {
            (run_steps(true, &steps).await, run_steps(false, &steps).await)
        });
        let bound = INITIAL + RATIO * reported as f64 + FLOOR * elapsed as f64 / 1000.0;
        proptest::prop_assert!(adaptive as f64 <= bound + 1e-9, "{adaptive} > {bound}");
        proptest::prop_assert!(adaptive <= fixed, "adaptive {adaptive} > fixed {fixed}");
    }
}
