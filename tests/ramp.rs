//! The recovery ramp end to end (issue 32; README, "Recovery"), through
//! the real gRPC pipeline in this process: after retries are switched back
//! on (SetRetriesEnabled), or after an upstream's reported successes return
//! following a low adaptive level, retries are admitted on a share that
//! grows linearly from 0 to 1 over `ramp_window` (5 s by default), the rest
//! denied BUDGET_EXHAUSTED at no cost, and the admitted ones' backoffs are
//! spread over what is left of the ramp. On the memory store on a manual
//! clock, and on Redis exact and leased with the switch flipped through one
//! retryd and the decisions made through another.

use std::time::{Duration, Instant};

use retryd_budget::MemoryBudgetStore;
use retryd_budget::memory::ManualClock;
use retryd_budget::redis::{Exact, Leased, Mode};
use retryd_proto as pb;
use retryd_testkit::redis::{RedisServer, fresh_prefix};
use retryd_testkit::{millis, retryable};

mod in_process_server;
use in_process_server::{InProcess, redis_store};

/// Above the default 20 ms: what is tested is the ramp, not the store's
/// timeouts (see tests/pushback.rs).
const STORE_TIMEOUT: Duration = Duration::from_millis(250);

/// A large budget, so that only the ramp limits what is admitted.
const CONFIG: &str = "[defaults]\nbudget = { capacity = 10000.0, initial = 10000.0, ratio = 0.1, min_per_second = 1.0 }\n";

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

async fn switch(server: &InProcess, upstream: &str, enabled: bool) {
    server
        .admin()
        .await
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: upstream.into(),
            enabled,
            reason: "ramp test".into(),
        })
        .await
        .unwrap();
}

async fn report(server: &InProcess, upstream: &str, successes: u64, failures: u64) {
    server
        .decider()
        .await
        .report_traffic(pb::ReportTrafficRequest {
            traffic: vec![pb::UpstreamTraffic {
                upstream: upstream.into(),
                requests: successes + failures,
                successes,
                failures,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap();
}

/// `n` retryable failures: (RETRYs, longest backoff in ms). Every other
/// answer must be the ramp's BUDGET_EXHAUSTED.
async fn decide_many(server: &InProcess, upstream: &str, n: u32) -> (u32, i64) {
    let mut client = server.decider().await;
    let (mut admitted, mut longest) = (0, 0);
    for _ in 0..n {
        let answer = client
            .decide(retryable(upstream))
            .await
            .unwrap()
            .into_inner();
        match answer.verdict() {
            pb::Verdict::Retry => {
                admitted += 1;
                longest = longest.max(millis(answer.backoff));
            }
            _ => {
                assert_eq!(answer.deny_reason(), pb::DenyReason::BudgetExhausted);
                assert!(
                    answer.explanation.contains("recovering"),
                    "{}",
                    answer.explanation
                );
            }
        }
    }
    (admitted, longest)
}

/// Waits until `server` reads the upstream as ramping (a leased replica
/// trusts its cached reading of the bucket for up to 100 ms, the bound of
/// README's "leased" mode: the ramp reaches it as the kill switch does).
async fn until_ramping(server: &InProcess, upstream: &str) -> pb::Budget {
    let deadline = Instant::now() + retryd_testkit::HANG_GUARD;
    loop {
        let budget = get_budget(server, upstream).await;
        if budget.retries_enabled && budget.ramp < 1.0 {
            return budget;
        }
        assert!(Instant::now() < deadline, "no ramp seen: {budget:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn memory_store_ramps_after_the_kill_switch_and_a_recovery() {
    let clock = ManualClock::default();
    let server = InProcess::start(CONFIG, MemoryBudgetStore::with_clock(100, clock.clone())).await;
    // No ramp before anything happened.
    assert_eq!(decide_many(&server, "pay", 10).await.0, 10);
    assert_eq!(get_budget(&server, "pay").await.ramp, 1.0);

    switch(&server, "pay", false).await;
    switch(&server, "pay", true).await;
    // Released: nothing admitted at first.
    let budget = get_budget(&server, "pay").await;
    assert_eq!(budget.ramp, 0.0);
    let tokens = budget.tokens;
    assert_eq!(decide_many(&server, "pay", 50).await.0, 0);
    // Nothing spent for the denied ones.
    assert_eq!(get_budget(&server, "pay").await.tokens, tokens);
    // Halfway: about half admitted (binomial, 400 draws: 0.5 ± 0.15 is
    // six standard deviations), spread over the 2.5 s left.
    clock.advance(2_500_000_000);
    assert_eq!(get_budget(&server, "pay").await.ramp, 0.5);
    let (admitted, longest) = decide_many(&server, "pay", 400).await;
    assert!((140..=260).contains(&admitted), "{admitted} of 400");
    assert!(longest <= 2500, "{longest} ms");
    assert!(
        longest > 1000,
        "the admitted retries are spread: {longest} ms"
    );
    // Over: every retry again, none spread.
    clock.advance(2_500_000_000);
    assert_eq!(get_budget(&server, "pay").await.ramp, 1.0);
    let (admitted, longest) = decide_many(&server, "pay", 50).await;
    assert_eq!(admitted, 50);
    assert!(longest <= 50, "{longest} ms");

    // An outage's report (level about 0), then successes: a ramp.
    report(&server, "ledger", 0, 100).await;
    let budget = get_budget(&server, "ledger").await;
    assert!(budget.adaptive_level < 0.05, "{budget:?}");
    assert_eq!(budget.ramp, 1.0);
    report(&server, "ledger", 100, 0).await;
    let budget = get_budget(&server, "ledger").await;
    assert_eq!(budget.adaptive_level, 1.0);
    assert_eq!(budget.ramp, 0.0);
    assert_eq!(decide_many(&server, "ledger", 20).await.0, 0);
    clock.advance(5_000_000_000);
    assert_eq!(decide_many(&server, "ledger", 20).await.0, 20);
    // Rare failures never start one.
    report(&server, "ledger", 70, 30).await;
    report(&server, "ledger", 90, 10).await;
    assert_eq!(get_budget(&server, "ledger").await.ramp, 1.0);
}

async fn two_replicas<M: Mode>() {
    let redis = RedisServer::start();
    let prefix = fresh_prefix("ramp");
    let a = InProcess::start(
        CONFIG,
        redis_store::<M>(&[redis.url()], &prefix, STORE_TIMEOUT).await,
    )
    .await;
    let b = InProcess::start(
        CONFIG,
        redis_store::<M>(&[redis.url()], &prefix, STORE_TIMEOUT).await,
    )
    .await;
    assert_eq!(decide_many(&b, "pay", 5).await.0, 5);
    switch(&a, "pay", false).await;
    switch(&a, "pay", true).await;
    let released = Instant::now();
    until_ramping(&b, "pay").await;
    let (admitted, longest) = decide_many(&b, "pay", 40).await;
    // The share grows by 0.2 a second: whatever time passed on a busy
    // machine, at most that share of the 40 (plus a generous margin).
    let share = (released.elapsed().as_secs_f64() / 5.0).min(1.0);
    assert!(
        f64::from(admitted) <= 40.0 * share + 12.0,
        "{admitted} of 40 admitted {:?} after the release",
        released.elapsed()
    );
    assert!(longest <= 5000, "{longest} ms");

    // Recovery noted through A, ramp seen through B.
    report(&a, "ledger", 0, 100).await;
    report(&a, "ledger", 100, 0).await;
    let budget = until_ramping(&b, "ledger").await;
    assert_eq!(budget.adaptive_level, 1.0);
}

#[tokio::test]
async fn redis_exact_ramps_across_replicas() {
    two_replicas::<Exact>().await;
}

#[tokio::test]
async fn redis_leased_ramps_across_replicas() {
    two_replicas::<Leased>().await;
}
