//! The connection and message deadlines, in process on tokio's paused
//! clock, so that each is held to its configured default however busy the
//! machine is (issue 29, findings 1 and 2): a connection that never
//! authenticates is closed at `server.authenticate_timeout` (5 s), an
//! authenticated one with no call open at `server.idle_timeout` (5 min),
//! and a credentialed caller's half-sent message is ended at
//! `server.receive_timeout` (10 s), with no `server.request_timeout`.
//!
//! Before, an anonymous idle connection stayed open as long as it answered
//! PINGs (63 of 64 after 50 s) and a half-sent message was buffered for
//! as long as the caller liked.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use retryd::config::Config;
use retryd::grpc::{self, Reload, Service};
use retryd::telemetry::{Metrics, Tracer};
use retryd::transport::Acceptor;
use retryd_budget::MemoryBudgetStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const KEY: &str = "checkout-key-0123456789";

/// The defaults under test.
const AUTHENTICATE_TIMEOUT: Duration = Duration::from_secs(5);
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A server with one principal (by API key) and every other setting at
/// its default, in this process.
async fn serve() -> (SocketAddr, tempfile::TempDir) {
    let hash: String = retryd::auth::hash_key(KEY)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retryd.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n\n[[auth.principals]]\nname = \"checkout\"\napi_keys_sha256 = [\"{hash}\"]\nupstreams = [\"*\"]\n"
        ),
    )
    .unwrap();
    let config = Config::load(Some(&path)).unwrap();
    assert_eq!(
        config.server_limits.authenticate_timeout,
        AUTHENTICATE_TIMEOUT
    );
    assert_eq!(config.server_limits.idle_timeout, IDLE_TIMEOUT);
    assert_eq!(config.server_limits.receive_timeout, RECEIVE_TIMEOUT);
    assert_eq!(config.server_limits.request_timeout, None);
    let acceptor = Acceptor::try_new(config.tls.as_ref(), &config.server_limits).unwrap();
    let metrics = Arc::new(Metrics::new(config.policies.named().map(|(name, _)| name)));
    let service = Service::new(
        MemoryBudgetStore::new(1000),
        "in-process",
        Reload {
            path: Some(path),
            startup: config,
        },
        metrics,
        Tracer::disabled(),
    );
    let listener = grpc::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(grpc::serve(
        listener,
        acceptor,
        service,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    (addr, dir)
}

/// Reads from `stream` until the server closes it.
async fn closed(stream: &mut TcpStream) {
    let mut buffer = [0u8; 4096];
    while matches!(stream.read(&mut buffer).await, Ok(n) if n > 0) {}
}

/// A Decide request for `h2`, with the API key if `key`.
fn decide_request(addr: SocketAddr, key: bool) -> http::Request<()> {
    let mut request = http::Request::post(format!("http://{addr}/retryd.v1.RetryDecider/Decide"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if key {
        request = request.header("authorization", format!("Bearer {KEY}"));
    }
    request.body(()).unwrap()
}

/// The gRPC status of a response, from its headers (trailers-only) or
/// its trailers.
async fn grpc_status(response: h2::client::ResponseFuture) -> u32 {
    let response = response.await.unwrap();
    let status = |headers: &http::HeaderMap| {
        headers
            .get("grpc-status")
            .and_then(|value| value.to_str().ok()?.parse().ok())
    };
    if let Some(code) = status(response.headers()) {
        return code;
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let _ = chunk.unwrap();
    }
    status(&body.trailers().await.unwrap().expect("trailers")).expect("a grpc-status")
}

/// A plain HTTP/2 connection that sends its preface and settings, answers
/// nothing and calls nothing, is closed at the authentication deadline.
#[tokio::test(start_paused = true)]
async fn a_connection_that_never_authenticates_is_closed_at_the_deadline() {
    let (addr, _dir) = serve().await;
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    opening.extend([0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    stream.write_all(&opening).await.unwrap();
    closed(&mut stream).await;
    let lived = started.elapsed();
    assert!(
        (AUTHENTICATE_TIMEOUT..AUTHENTICATE_TIMEOUT + Duration::from_millis(50)).contains(&lived),
        "closed after {lived:?}"
    );
}

/// A connection whose calls were all refused UNAUTHENTICATED has not
/// authenticated either: it is closed at the same deadline. One that made
/// an authenticated call stays until it has been idle for the idle
/// timeout, answering the server's PINGs all the while.
#[tokio::test(start_paused = true)]
async fn refused_calls_do_not_keep_a_connection_and_idle_ones_go_after_the_idle_timeout() {
    let (addr, _dir) = serve().await;
    for key in [false, true] {
        let started = Instant::now();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        let connection = tokio::spawn(connection);
        let mut client = client.ready().await.unwrap();
        let (response, mut body) = client
            .send_request(decide_request(addr, key), false)
            .unwrap();
        // An empty message: the default policy's answer is INVALID_ARGUMENT
        // (no upstream), which needs authentication first.
        body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .unwrap();
        let code = grpc_status(response).await;
        let answered = started.elapsed();
        let _ = connection.await;
        let lived = started.elapsed() - answered;
        if key {
            assert_eq!(code, tonic::Code::InvalidArgument as u32);
            assert!(
                (IDLE_TIMEOUT..IDLE_TIMEOUT + Duration::from_millis(50)).contains(&lived),
                "authenticated: closed {lived:?} after its call"
            );
        } else {
            assert_eq!(code, tonic::Code::Unauthenticated as u32);
            assert!(
                lived <= AUTHENTICATE_TIMEOUT + Duration::from_millis(50),
                "unauthenticated: closed {lived:?} after its call"
            );
        }
    }
}

/// A credentialed caller sends 65,531 bytes of a declared 65,536 and
/// stops: the call is ended DEADLINE_EXCEEDED at the receive deadline,
/// without any request timeout.
#[tokio::test(start_paused = true)]
async fn a_half_sent_message_is_ended_at_the_receive_deadline() {
    let (addr, _dir) = serve().await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let started = Instant::now();
    let (response, mut body) = client
        .send_request(decide_request(addr, true), false)
        .unwrap();
    let mut message = vec![0u8; 65_531];
    message[1..5].copy_from_slice(&65_536u32.to_be_bytes());
    body.send_data(Bytes::from(message), false).unwrap();
    let code = grpc_status(response).await;
    let waited = started.elapsed();
    assert_eq!(code, tonic::Code::DeadlineExceeded as u32);
    assert!(
        (RECEIVE_TIMEOUT..RECEIVE_TIMEOUT + Duration::from_millis(50)).contains(&waited),
        "ended after {waited:?}"
    );
    drop(body);
}
