//! Fleet-wide pushback end to end (issue 32; README, "Fleet-wide
//! pushback"), through the real gRPC pipeline in this process: a caller's
//! 429 with Retry-After, or a gRPC pushback, sets the upstream's
//! earliest-retry time for every caller: on the memory store (one process,
//! on a manual clock) and on Redis exact and leased, where caller A talks
//! to one retryd and caller B to another, both on one redis-server the test
//! starts. B's RETRY backoff ends no earlier than that time (spread after
//! it, and the explanation says why); it is bounded by `max_retry_after`; a
//! deadline it does not fit is a DEADLINE denial that spends nothing; a
//! negative pushback stops B's retries for `pushback_stop_window` (5 s by
//! default); GetBudget shows the pushback in force.

use std::time::{Duration, Instant};

use retryd_budget::MemoryBudgetStore;
use retryd_budget::memory::ManualClock;
use retryd_budget::redis::{Exact, Leased, Mode};
use retryd_proto as pb;
use retryd_testkit::millis;
use retryd_testkit::redis::{RedisServer, fresh_prefix};

mod in_process_server;
use in_process_server::{InProcess, redis_store};

/// Above the default 20 ms: what is tested is the pacing, not the store's
/// timeouts, and on a busy 2-core machine a 20 ms deadline sends calls to
/// the local fallback (seen: a kill switch refused).
const STORE_TIMEOUT: Duration = Duration::from_millis(250);

/// The defaults, and one upstream whose longest Retry-After is 1 s.
const CONFIG: &str = "[upstreams.capped]\nmax_retry_after = \"1s\"\n";

/// A failure of `upstream` with HTTP `status` and `retry_after`.
fn http(upstream: &str, status: u32, retry_after: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "GET /things/1".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: 1,
        http_status: status,
        retry_after: retry_after.into(),
        ..Default::default()
    }
}

/// A gRPC RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms: pushback`.
fn exhausted(upstream: &str, pushback: &str) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "/things.Things/Get".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: 1,
        evidence: pb::Evidence::ResponseReceived as i32,
        grpc_status_code: 8,
        grpc_retry_pushback_ms: Some(pushback.into()),
        ..Default::default()
    }
}

async fn decide(server: &InProcess, request: pb::DecideRequest) -> pb::DecideResponse {
    server
        .decider()
        .await
        .decide(request)
        .await
        .unwrap()
        .into_inner()
}

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

const STRETCHED: &str = "stretched past the upstream's earliest-retry time";

/// Asserts a RETRY of B stretched to end at `announced` (an instant
/// `wait_ms` after `since`), at most the spread window later.
fn assert_stretched(answer: &pb::DecideResponse, since: Instant, wait_ms: i64, spread_ms: i64) {
    assert_eq!(
        answer.verdict(),
        pb::Verdict::Retry,
        "{}",
        answer.explanation
    );
    assert!(
        answer.explanation.contains(STRETCHED),
        "{}",
        answer.explanation
    );
    let backoff = millis(answer.backoff);
    // Ends no earlier than the announced time: whatever time passed since
    // A's call (and a millisecond of Redis's rounding).
    let passed = since.elapsed().as_millis() as i64;
    assert!(
        backoff + passed + 1 >= wait_ms,
        "B waits {backoff} ms, {passed} ms after A's {wait_ms} ms"
    );
    assert!(
        backoff <= wait_ms + spread_ms,
        "B waits {backoff} ms: past the spread window"
    );
}

/// The cases every store must answer alike: `a` and `b` are the two
/// callers' retryd (the same one on the memory store).
async fn pushback_cases(a: &InProcess, b: &InProcess) {
    // A's 429 with Retry-After: 2 is its own floor, not a stretch.
    let since = Instant::now();
    let own = decide(a, http("pay", 429, "2")).await;
    assert_eq!(own.verdict(), pb::Verdict::Retry, "{}", own.explanation);
    assert_eq!(millis(own.backoff), 2000);
    assert!(!own.explanation.contains(STRETCHED), "{}", own.explanation);
    // B's 503 on the same upstream, with no Retry-After of its own, waits
    // for the fleet's earliest-retry time, spread over 500 ms after it.
    let stretched = decide(b, http("pay", 503, "")).await;
    assert_stretched(&stretched, since, 2000, 500);
    let budget = get_budget(b, "pay").await;
    let remaining = millis(budget.pushback_remaining);
    assert!((1..=2000).contains(&remaining), "{budget:?}");
    assert_eq!(budget.ramp, 1.0);
    // Another upstream is not paced by it.
    let other = decide(b, http("ledger", 503, "")).await;
    assert_eq!(other.verdict(), pb::Verdict::Retry);
    assert!(millis(other.backoff) <= 50, "{}", other.explanation);
    assert!(get_budget(b, "ledger").await.pushback_remaining.is_none());

    // A deadline the fleet's wait does not fit: DEADLINE, nothing spent.
    let before = get_budget(b, "pay").await.tokens;
    let hurried = decide(
        b,
        pb::DecideRequest {
            deadline_remaining: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ..http("pay", 503, "")
        },
    )
    .await;
    assert_eq!(
        hurried.deny_reason(),
        pb::DenyReason::Deadline,
        "{}",
        hurried.explanation
    );
    // The floor refills meanwhile (on Redis's clock); a token is 1.
    let after = get_budget(b, "pay").await.tokens;
    assert!((after - before).abs() < 0.5, "{before} → {after}");

    // Bounded by max_retry_after: A's Retry-After of 30 s is more than the
    // policy waits (A is denied), and sets the fleet's time only 1 s away.
    let since = Instant::now();
    let long = decide(a, http("capped", 429, "30")).await;
    assert_eq!(
        long.deny_reason(),
        pb::DenyReason::Deadline,
        "{}",
        long.explanation
    );
    let capped = decide(b, http("capped", 503, "")).await;
    assert_stretched(&capped, since, 1000, 250);
    assert!(millis(get_budget(b, "capped").await.pushback_remaining) <= 1000);

    // A gRPC pushback of 1500 ms paces B as a Retry-After does.
    let since = Instant::now();
    let own = decide(a, exhausted("grpc", "1500")).await;
    assert_eq!(millis(own.backoff), 1500, "{}", own.explanation);
    let stretched = decide(b, http("grpc", 503, "")).await;
    assert_stretched(&stretched, since, 1500, 375);

    // A negative pushback: A is told not to retry, and so is B, for the
    // stop window (5 s), at no cost to the budget.
    let stop = decide(a, exhausted("stop", "-1")).await;
    assert_eq!(stop.deny_reason(), pb::DenyReason::ServerPushback);
    let before = get_budget(b, "stop").await;
    let denied = decide(b, http("stop", 503, "")).await;
    assert_eq!(
        denied.deny_reason(),
        pb::DenyReason::ServerPushback,
        "{}",
        denied.explanation
    );
    assert!(
        denied
            .explanation
            .contains("asked another caller not to retry"),
        "{}",
        denied.explanation
    );
    let after = get_budget(b, "stop").await;
    assert!(
        (after.tokens - before.tokens).abs() < 0.5,
        "{before:?} → {after:?}"
    );
    let remaining = millis(after.pushback_remaining);
    assert!((1..=5000).contains(&remaining), "{after:?}");
}

#[tokio::test]
async fn memory_store_paces_every_caller() {
    let clock = ManualClock::default();
    let server = InProcess::start(CONFIG, MemoryBudgetStore::with_clock(100, clock.clone())).await;
    pushback_cases(&server, &server).await;
    // On the store's clock: 2 s later the earliest-retry time has passed.
    clock.advance(2_001_000_000);
    let free = decide(&server, http("pay", 503, "")).await;
    assert_eq!(free.verdict(), pb::Verdict::Retry);
    assert!(
        !free.explanation.contains(STRETCHED),
        "{}",
        free.explanation
    );
    assert!(
        get_budget(&server, "pay")
            .await
            .pushback_remaining
            .is_none()
    );
    // The stop window ends 5 s after the negative pushback.
    let still = decide(&server, http("stop", 503, "")).await;
    assert_eq!(still.deny_reason(), pb::DenyReason::ServerPushback);
    clock.advance(3_000_000_000);
    let free = decide(&server, http("stop", 503, "")).await;
    assert_eq!(free.verdict(), pb::Verdict::Retry, "{}", free.explanation);
    // A later announcement never brings an earlier one forward.
    decide(&server, http("pay", 429, "10")).await;
    decide(&server, http("pay", 429, "1")).await;
    let remaining = millis(get_budget(&server, "pay").await.pushback_remaining);
    assert_eq!(remaining, 10_000);
}

async fn two_replicas<M: Mode>() {
    let redis = RedisServer::start();
    let prefix = fresh_prefix("pushback");
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
    pushback_cases(&a, &b).await;
    // A later announcement never brings an earlier one forward.
    decide(&a, http("later", 429, "10")).await;
    decide(&b, http("later", 429, "1")).await;
    let remaining = millis(get_budget(&b, "later").await.pushback_remaining);
    assert!((9_000..=10_000).contains(&remaining), "{remaining}");
}

#[tokio::test]
async fn redis_exact_paces_every_replica() {
    two_replicas::<Exact>().await;
}

#[tokio::test]
async fn redis_leased_paces_every_replica() {
    two_replicas::<Leased>().await;
}
