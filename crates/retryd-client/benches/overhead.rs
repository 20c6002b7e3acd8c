//! What `RetryMiddleware` costs on a call that succeeds (retryd is never
//! asked), against a plain reqwest call and a `reqwest-middleware` client
//! with no middleware, in the same run: an in-process hyper server on
//! loopback answers 200 with a small body, one call in flight.
//!
//! The three sides alternate in batches and the median over the rounds of
//! time(side) ÷ time(plain) is reported, so that load from other work hits
//! every side alike (the machine is shared). The middleware's successful
//! path is: read the declaration, clone the request (for a replay), count
//! the first attempt on the reporter (a map increment and the local
//! bucket's deposit), send. The reporter's background task is off, so no
//! report is sent during the run; the counting stays on the path.
//!
//! A fifth side is a call to a hedged upstream that answers before its hedge
//! delay (1 s, the local rule's, retryd being away): the hedge timer is armed
//! and dropped, no Decide is made. It is what hedging costs a fast call.
//!
//! Run: `cargo bench -p retryd-client --bench overhead` (`-- --quick` for a
//! short run). Run by `cargo test --all-targets`, it makes one short round.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use retryd_client::engine::Idempotency;
use retryd_client::{Call, Client, FallbackPolicy, RetryMiddleware, pb};

/// The answer to every call: a small JSON document.
const BODY: &[u8] = b"{\"id\":7,\"name\":\"item\"}";

async fn server() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|_request| async {
                    Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(BODY))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // binary without it, and then one short round only shows it works.
    let benching = std::env::args().any(|arg| arg == "--bench");
    let quick = std::env::args().any(|arg| arg == "--quick");
    let (rounds, batch) = match (benching, quick) {
        (false, _) => (1, 20),
        (true, true) => (11, 500),
        (true, false) => (41, 2000),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let addr = server().await;
        let url = format!("http://{addr}/items/7");
        // No retryd at all: a successful call must never ask it.
        let retryd = Client::builder("http://127.0.0.1:1")
            .connect_timeout(Duration::from_millis(50))
            .disable_reporting()
            .connect()
            .await
            .expect("client");
        let plain = reqwest::Client::builder().build().expect("reqwest");
        let bare = reqwest_middleware::ClientBuilder::new(plain.clone()).build();
        let governed = reqwest_middleware::ClientBuilder::new(plain.clone())
            .with(RetryMiddleware::new(retryd.clone()).upstream("catalog"))
            .build();
        // Hedged at the local rule's 1 s while retryd is away: one failed
        // Decide starts the outage, so every call arms a hedge timer.
        let hedging = Client::builder("http://127.0.0.1:1")
            .connect_timeout(Duration::from_millis(50))
            .disable_reporting()
            .fallback(FallbackPolicy::default().local_hedge_delay(Duration::from_secs(1)))
            .connect()
            .await
            .expect("client");
        let _ = hedging
            .decide(&pb::DecideRequest {
                upstream: "catalog".into(),
                idempotency: pb::Idempotency::Safe as i32,
                attempt: 1,
                failure: pb::FailureKind::Connect as i32,
                ..Default::default()
            })
            .await;
        assert!(hedging.outage().unreachable);
        let hedged = reqwest_middleware::ClientBuilder::new(plain.clone())
            .with(RetryMiddleware::new(hedging.clone()).upstream("catalog"))
            .build();
        let call = Call::new(Idempotency::Safe).deadline_in(Duration::from_secs(3600));
        // The same call without a deadline: no timer is armed.
        let undated = Call::new(Idempotency::Safe);

        let time_plain = |n: usize| {
            let plain = plain.clone();
            let url = url.clone();
            async move {
                let started = Instant::now();
                for _ in 0..n {
                    let response = plain.get(&url).send().await.expect("ok");
                    assert_eq!(response.bytes().await.expect("body").len(), BODY.len());
                }
                started.elapsed()
            }
        };
        let time_bare = |n: usize| {
            let bare = bare.clone();
            let url = url.clone();
            async move {
                let started = Instant::now();
                for _ in 0..n {
                    let response = bare.get(&url).send().await.expect("ok");
                    assert_eq!(response.bytes().await.expect("body").len(), BODY.len());
                }
                started.elapsed()
            }
        };
        let time_governed = |n: usize, call: &Call, governed: &reqwest_middleware::ClientWithMiddleware| {
            let governed = governed.clone();
            let url = url.clone();
            let call = call.clone();
            async move {
                let started = Instant::now();
                for _ in 0..n {
                    let response = governed
                        .get(&url)
                        .with_extension(call.clone())
                        .send()
                        .await
                        .expect("ok");
                    assert_eq!(response.bytes().await.expect("body").len(), BODY.len());
                }
                started.elapsed()
            }
        };

        // Warm-up: connections, pools, caches.
        time_plain(batch).await;
        time_bare(batch).await;
        time_governed(batch, &call, &governed).await;
        time_governed(batch, &call, &hedged).await;

        let (mut bare_ratio, mut governed_ratio) = (Vec::new(), Vec::new());
        let mut undated_ratio = Vec::new();
        let mut hedged_ratio = Vec::new();
        let (mut plain_us, mut governed_us) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate the order so that neither side always runs first.
            let (p, b, g, u, h) = if round % 2 == 0 {
                let p = time_plain(batch).await;
                let b = time_bare(batch).await;
                let g = time_governed(batch, &call, &governed).await;
                let u = time_governed(batch, &undated, &governed).await;
                let h = time_governed(batch, &call, &hedged).await;
                (p, b, g, u, h)
            } else {
                let h = time_governed(batch, &call, &hedged).await;
                let u = time_governed(batch, &undated, &governed).await;
                let g = time_governed(batch, &call, &governed).await;
                let b = time_bare(batch).await;
                let p = time_plain(batch).await;
                (p, b, g, u, h)
            };
            bare_ratio.push(b.as_secs_f64() / p.as_secs_f64());
            governed_ratio.push(g.as_secs_f64() / p.as_secs_f64());
            undated_ratio.push(u.as_secs_f64() / p.as_secs_f64());
            hedged_ratio.push(h.as_secs_f64() / p.as_secs_f64());
            plain_us.push(p.as_secs_f64() * 1e6 / batch as f64);
            governed_us.push(g.as_secs_f64() * 1e6 / batch as f64);
        }
        let outage = retryd.outage();
        assert_eq!(outage.decisions, 0, "retryd was never asked");
        let plain_us = median(&mut plain_us);
        let governed_us = median(&mut governed_us);
        let bare_ratio = median(&mut bare_ratio);
        let governed_ratio = median(&mut governed_ratio);
        let undated_ratio = median(&mut undated_ratio);
        let hedged_ratio = median(&mut hedged_ratio);
        // One Decide (the one that started the outage), no hedge asked.
        assert_eq!(hedging.outage().decisions, 1, "no hedge was asked");
        println!("| side | µs per call (median of {rounds} rounds × {batch}) | time ÷ plain reqwest (median) |");
        println!("| --- | --- | --- |");
        println!("| plain reqwest | {plain_us:.1} | 1.00 |");
        println!("| reqwest-middleware, no middleware | | {bare_ratio:.3} |");
        println!("| reqwest-middleware + RetryMiddleware | {governed_us:.1} | {governed_ratio:.3} |");
        println!("| the same, the call without a deadline (no timer) | | {undated_ratio:.3} |");
        println!("| the same, to a hedged upstream (hedge timer armed, not fired) | | {hedged_ratio:.3} |");
        println!(
            "{{\"bench\":\"retryd-client overhead\",\"plain_us\":{plain_us:.2},\"governed_us\":{governed_us:.2},\"bare_ratio\":{bare_ratio:.4},\"governed_ratio\":{governed_ratio:.4},\"undated_ratio\":{undated_ratio:.4},\"hedged_ratio\":{hedged_ratio:.4},\"rounds\":{rounds},\"batch\":{batch}}}"
        );
    });
}
