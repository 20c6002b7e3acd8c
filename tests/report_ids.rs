//! Idempotent traffic reports (issue 16, finding 7): a report re-sent with
//! its id deposits nothing twice, on the memory store and through two
//! replicas on one real Redis. Black-box: the real binary on loopback.

use retryd_testkit as support;

use retryd_proto as pb;
use support::Server;
use support::redis::RedisServer;
use tonic::Code;

/// Tokens deposited only by reports: no initial tokens, no floor, 1 token
/// per reported request.
const BUDGET: &str = "[defaults]\nbudget = { capacity = 1000.0, initial = 0.0, ratio = 1.0, min_per_second = 0.0 }\n";

fn report(id: &str, entries: &[(&str, u64)]) -> pb::ReportTrafficRequest {
    pb::ReportTrafficRequest {
        traffic: entries
            .iter()
            .map(|(upstream, requests)| pb::UpstreamTraffic {
                upstream: (*upstream).into(),
                requests: *requests,
                ..Default::default()
            })
            .collect(),
        report_id: id.into(),
    }
}

async fn tokens(server: &Server, upstream: &str) -> f64 {
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
        .tokens
}

#[tokio::test]
async fn memory_a_resent_report_deposits_nothing_twice() {
    let server = Server::start(BUDGET);
    let mut client = server.decider().await;
    let batch = report(
        "3f1d7c2a-0b5e-4e8f-9a61-2c4b8d0e7f13",
        &[("orders", 5), ("search", 3), ("orders", 2)],
    );
    let first = client
        .report_traffic(batch.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!((first.accepted, first.already_applied), (3, 0));
    for _ in 0..3 {
        let again = client
            .report_traffic(batch.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!((again.accepted, again.already_applied), (0, 3), "{again:?}");
    }
    assert_eq!(tokens(&server, "orders").await, 7.0);
    assert_eq!(tokens(&server, "search").await, 3.0);

    // The same id with other entries is refused, naming the field.
    let status = client
        .report_traffic(report(
            "3f1d7c2a-0b5e-4e8f-9a61-2c4b8d0e7f13",
            &[("orders", 50)],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("report_id"), "{status:?}");
    assert_eq!(tokens(&server, "orders").await, 7.0, "nothing deposited");

    // Without an id, every send counts, as before.
    for _ in 0..2 {
        client
            .report_traffic(report("", &[("orders", 1)]))
            .await
            .unwrap();
    }
    assert_eq!(tokens(&server, "orders").await, 9.0);
}

#[tokio::test]
async fn bad_report_ids_name_the_field_and_deposit_nothing() {
    let server = Server::start(BUDGET);
    let mut client = server.decider().await;
    for id in [
        "x".repeat(129),
        "tab\there".to_string(),
        "ünïcode".to_string(),
    ] {
        let status = client
            .report_traffic(report(&id, &[("orders", 5)]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{id:?}: {status:?}");
        assert!(status.message().starts_with("report_id"), "{status:?}");
    }
    // 128 printable bytes is the limit.
    let longest = "y".repeat(128);
    let ok = client
        .report_traffic(report(&longest, &[("orders", 5)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.accepted, 1);
    assert_eq!(tokens(&server, "orders").await, 5.0);
}

/// A client whose call to one replica timed out re-sends the batch to
/// another: the second replica finds the id in Redis and deposits nothing.
async fn two_replicas(mode: &str) {
    let redis = RedisServer::start();
    let config = format!(
        "{BUDGET}[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"{mode}\"\n",
        redis.url()
    );
    let first_replica = Server::start(&config);
    let second_replica = Server::start(&config);
    let batch = report(
        "0c8e5a42-7d19-4b3f-8e26-91f4a6d2c5b7",
        &[("ledger", 40), ("fx", 4)],
    );
    let first = first_replica
        .decider()
        .await
        .report_traffic(batch.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!((first.accepted, first.already_applied), (2, 0));
    let resent = second_replica
        .decider()
        .await
        .report_traffic(batch)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (resent.accepted, resent.already_applied),
        (0, 2),
        "{resent:?}"
    );
    // Leased mode sends deposits in batches within milliseconds: wait for
    // them to land, then check both replicas see exactly one report.
    let deadline = std::time::Instant::now() + support::HANG_GUARD;
    loop {
        let seen = tokens(&second_replica, "ledger").await;
        if seen >= 40.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the deposits did not land: ledger holds {seen}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for replica in [&first_replica, &second_replica] {
        assert_eq!(tokens(replica, "ledger").await, 40.0);
        assert_eq!(tokens(replica, "fx").await, 4.0);
    }
    // The id lives in Redis, with the window as its expiry.
    let ttl: i64 = redis
        .cli(&["--scan", "--pattern", "*report*"])
        .lines()
        .map(|key| redis.cli(&["PTTL", key]).trim().parse::<i64>().unwrap())
        .next()
        .expect("a report key in Redis");
    assert!(ttl > 590_000 && ttl <= 600_000, "PTTL {ttl}");
}

#[tokio::test]
async fn redis_exact_a_report_resent_to_another_replica_deposits_nothing() {
    two_replicas("exact").await;
}

#[tokio::test]
async fn redis_leased_a_report_resent_to_another_replica_deposits_nothing() {
    two_replicas("leased").await;
}
