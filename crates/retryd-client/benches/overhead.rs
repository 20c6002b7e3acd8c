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
//! Run: `cargo bench -p retryd-client --bench overhead` (`-- --quick` for a
//! short run). Run by `cargo test --all-targets`, it makes one short round.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use retryd_client::engine::Idempotency;
use retryd_client::{Call, Client, RetryMiddleware};

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
        let time_governed = |n: usize, call: &Call| {
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
        time_governed(batch, &call).await;

        let (mut bare_ratio, mut governed_ratio) = (Vec::new(), Vec::new());
        let mut undated_ratio = Vec::new();
        let (mut plain_us, mut governed_us) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate the order so that neither side always runs first.
            let (p, b, g, u) = if round % 2 == 0 {
                let p = time_plain(batch).await;
                let b = time_bare(batch).await;
                let g = time_governed(batch, &call).await;
                let u = time_governed(batch, &undated).await;
                (p, b, g, u)
            } else {
                let u = time_governed(batch, &undated).await;
                let g = time_governed(batch, &call).await;
                let b = time_bare(batch).await;
                let p = time_plain(batch).await;
                (p, b, g, u)
            };
            bare_ratio.push(b.as_secs_f64() / p.as_secs_f64());
            governed_ratio.push(g.as_secs_f64() / p.as_secs_f64());
            undated_ratio.push(u.as_secs_f64() / p.as_secs_f64());
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
        println!("| side | µs per call (median of {rounds} rounds × {batch}) | time ÷ plain reqwest (median) |");
        println!("| --- | --- | --- |");
        println!("| plain reqwest | {plain_us:.1} | 1.00 |");
        println!("| reqwest-middleware, no middleware | | {bare_ratio:.3} |");
        println!("| reqwest-middleware + RetryMiddleware | {governed_us:.1} | {governed_ratio:.3} |");
        println!("| the same, the call without a deadline (no timer) | | {undated_ratio:.3} |");
        println!(
            "{{\"bench\":\"retryd-client overhead\",\"plain_us\":{plain_us:.2},\"governed_us\":{governed_us:.2},\"bare_ratio\":{bare_ratio:.4},\"governed_ratio\":{governed_ratio:.4},\"undated_ratio\":{undated_ratio:.4},\"rounds\":{rounds},\"batch\":{batch}}}"
        );
    });
}
