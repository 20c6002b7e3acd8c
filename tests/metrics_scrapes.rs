//! `/metrics` scrapes against the Redis store (issue 29, finding 4): the
//! budget gauges come from a snapshot the scrapes share, so that a crowd of
//! anonymous scrapers costs Redis one listing per interval, not one per
//! scrape (a listing reads every tracked upstream; one scrape was 30,006
//! Redis commands with 10,000 upstreams, and eight scrapers tripped the
//! decisions' circuit).
//!
//! Black-box: the real binary on loopback and a `redis-server` of the
//! test's own, whose command counter says what the scrapes cost.

use retryd_testkit as support;

use std::time::{Duration, Instant};

use support::redis::RedisServer;
use support::{HANG_GUARD, Server, ServingStatus, retryable};

/// Commands Redis has processed since it started.
fn commands(redis: &RedisServer) -> u64 {
    let stats = redis.cli(&["INFO", "stats"]);
    stats
        .lines()
        .find_map(|line| line.strip_prefix("total_commands_processed:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no command count in {stats:?}"))
}

/// Keys in Redis: about two per tracked upstream.
fn keys(redis: &RedisServer) -> u64 {
    let answer = redis.cli(&["DBSIZE"]);
    answer
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("DBSIZE answered {answer:?}"))
}

fn tracked(scrape: &str) -> u64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix("retryd_tracked_upstreams "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no retryd_tracked_upstreams in {scrape}"))
}

#[tokio::test]
async fn concurrent_scrapes_share_one_listing_of_the_budgets() {
    let redis = RedisServer::start();
    let server = Server::start(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nmode = \"exact\"\n",
        redis.url()
    ));
    // Track 300 upstreams in Redis. On a loaded machine some decisions
    // time out (the default store timeout) and fall back to the local
    // bucket, tracking nothing in Redis: send them until Redis holds most.
    let mut decider = server.decider().await;
    let started = Instant::now();
    while keys(&redis) < 200 {
        assert!(
            started.elapsed() < HANG_GUARD,
            "Redis holds {} keys",
            keys(&redis)
        );
        let requests = tokio_stream::iter((0..300).map(|i| retryable(&format!("upstream-{i:03}"))));
        let mut answers = decider.decide_stream(requests).await.unwrap().into_inner();
        while answers.message().await.unwrap().is_some() {}
    }
    server
        .health_becomes(retryd::grpc::STORE_HEALTH_SERVICE, ServingStatus::Serving)
        .await;

    // A scrape lists the budgets (again once its snapshot is 5 s old, if a
    // listing failed on the loaded machine).
    let upstreams = loop {
        let upstreams = tracked(&server.scrape());
        if upstreams >= 100 {
            break upstreams;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "the scrapes show {upstreams} upstreams"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // As many scrapers at once as the metrics port holds (16,
    // MAX_SCRAPE_CONNECTIONS: a 17th would evict the oldest), well within
    // one interval.
    const OUTAGE: &str = "Redis budget store unreachable";
    let outages_before = server.logs().matches(OUTAGE).count();
    let before = commands(&redis);
    let scraping = Instant::now();
    let scrapers: Vec<_> = (0..16)
        .map(|_| {
            let metrics = server.metrics;
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut stream = std::net::TcpStream::connect(metrics).unwrap();
                stream
                    .write_all(
                        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                    )
                    .unwrap();
                let mut response = String::new();
                stream.read_to_string(&mut response).unwrap();
                response
            })
        })
        .collect();
    let responses: Vec<String> = scrapers
        .into_iter()
        .map(|scraper| scraper.join().unwrap())
        .collect();
    let elapsed = scraping.elapsed();
    let spent = commands(&redis) - before;
    eprintln!("16 scrapes of {upstreams} upstreams in {elapsed:?}: {spent} Redis commands");
    assert!(
        elapsed < retryd::telemetry::BUDGET_GAUGES_INTERVAL,
        "the scrapes took {elapsed:?}, longer than one interval: the bound below assumes one"
    );
    // At most one listing (the snapshot may age past the interval between
    // the first scrape and these), plus the INFO calls and the store's own
    // probes; one listing per scrape would be 16 × (upstreams + 1).
    assert!(
        spent <= upstreams + 60,
        "16 scrapes cost {spent} Redis commands for {upstreams} upstreams"
    );
    // Listing once per scrape, 20 scrapers at the default store timeout
    // opened the decisions' circuit here: the outage the finding saw.
    assert_eq!(
        server.logs().matches(OUTAGE).count(),
        outages_before,
        "the scrapes opened the decisions' circuit:\n{}",
        server.logs()
    );
    for response in responses {
        assert!(
            response.contains(&format!("retryd_tracked_upstreams {upstreams}")),
            "every scrape shows the budgets: {response}"
        );
    }
}
