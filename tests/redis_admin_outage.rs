//! The truth during an outage (issue 37): while a replica believes its one
//! Redis down, GetBudget says the shared budget is unavailable
//! (`shared_unavailable`, tokens from the replica's own empty bucket)
//! rather than reporting the local bucket's 0 tokens as the budget, and
//! ListBudgets answers UNAVAILABLE; both tell the truth again once Redis is
//! back. The real binary, one redis-server stopped by SIGSTOP.

use retryd_testkit as support;

use std::time::{Duration, Instant};

use retryd_proto as pb;
use support::redis::{RedisServer, fresh_prefix};
use support::{HANG_GUARD, Server, retryable};

/// Waiting for Redis to be shared again: a guard against a hang, not a
/// promise of how soon.
const WITHIN: Duration = HANG_GUARD;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_budget_says_the_shared_budget_is_unavailable_while_redis_is_down() {
    let redis = RedisServer::start();
    let prefix = fresh_prefix("admin-outage");
    let server = Server::start(&format!(
        r#"
        [store]
        kind = "redis"
        url = "{}"
        on_unavailable = "local"
        key_prefix = "{prefix}"

        [defaults]
        budget = {{ capacity = 10.0, initial = 10.0, ratio = 0.5, min_per_second = 0.0 }}
        "#,
        redis.url()
    ));
    let mut decider = server.decider().await;
    let mut admin = server.admin().await;
    let answer = decider.decide(retryable("pay")).await.unwrap().into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Retry);
    let get = pb::GetBudgetRequest {
        upstream: "pay".into(),
    };
    let budget = admin
        .get_budget(get.clone())
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert_eq!((budget.tokens, budget.shared_unavailable), (9.0, false));
    let listed = admin.list_budgets(pb::ListBudgetsRequest {}).await.unwrap();
    assert!(
        listed
            .get_ref()
            .budgets
            .iter()
            .all(|budget| !budget.shared_unavailable)
    );

    redis.stop();
    let budget = admin
        .get_budget(get.clone())
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(budget.shared_unavailable, "{budget:?}");
    assert_eq!(budget.tokens, 0.0, "the local bucket starts empty");
    // Three timeouts in a row open the circuit (one late answer does not).
    // Until then a decision is still sent to Redis, which would apply it
    // when it resumes: wait for the circuit, so that the one below is not.
    let deadline = Instant::now() + WITHIN;
    while !server.scrape().contains("\nretryd_store_available 0\n") {
        let budget = admin.get_budget(get.clone()).await.unwrap().into_inner();
        assert!(budget.budget.unwrap().shared_unavailable);
        assert!(Instant::now() < deadline, "the outage was never noticed");
    }
    // A decision meanwhile is answered from the local bucket, and says so
    // as it did before this field: the budget is the local one's.
    let answer = decider.decide(retryable("pay")).await.unwrap().into_inner();
    assert_eq!(answer.verdict(), pb::Verdict::Deny);
    let budget = admin
        .get_budget(get.clone())
        .await
        .unwrap()
        .into_inner()
        .budget
        .unwrap();
    assert!(budget.shared_unavailable, "{budget:?}");
    let status = admin
        .list_budgets(pb::ListBudgetsRequest {})
        .await
        .expect_err("ListBudgets needs Redis");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");

    redis.cont();
    let back = Instant::now();
    loop {
        let budget = admin
            .get_budget(get.clone())
            .await
            .unwrap()
            .into_inner()
            .budget
            .unwrap();
        if !budget.shared_unavailable {
            assert_eq!(budget.tokens, 9.0, "the shared budget, as Redis kept it");
            break;
        }
        assert!(back.elapsed() < WITHIN, "never shared again: {budget:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let listed = admin.list_budgets(pb::ListBudgetsRequest {}).await.unwrap();
    let pay = listed
        .get_ref()
        .budgets
        .iter()
        .find(|budget| budget.upstream == "pay")
        .expect("pay is listed");
    assert!(!pay.shared_unavailable && pay.tokens == 9.0, "{pay:?}");
}
