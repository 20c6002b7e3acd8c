//! Shared helpers of the client's suites: the real retryd (through
//! retryd-testkit), real failing HTTP servers on loopback (hyper where
//! hyper can express the failure; a raw tokio socket for what a
//! well-behaved server cannot do: a reset before the request is read, a
//! reset after reading it, a body cut short), and a small tonic upstream.
//! Every server counts the attempts it saw.
#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use retryd_client::{Client, pb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub use retryd_testkit::Server as Retryd;

/// Fast backoffs and budgets that never run dry, so that the suites test
/// verdicts, not waiting.
pub const RETRYD_CONFIG: &str = r#"
[defaults]
max_attempts = 3
budget = { capacity = 10000.0, initial = 10000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "5ms", max = "20ms", jitter = "full" }

[upstreams."shadowed"]
enforce = false

# Far from full and without a time refill, so that deposits show.
[upstreams."filled"]
budget = { capacity = 1000.0, initial = 10.0, ratio = 0.1, min_per_second = 0.0 }
"#;

/// A retryd for the suites.
pub fn retryd() -> Retryd {
    Retryd::start(RETRYD_CONFIG)
}

/// A client of `retryd` with its defaults (reporter on).
pub async fn client(retryd: &Retryd) -> Client {
    Client::builder(format!("http://{}", retryd.grpc))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("client")
}

/// A counter of attempts the server saw.
#[derive(Clone, Default)]
pub struct Attempts(Arc<AtomicU32>);

impl Attempts {
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }
    fn add(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A loopback address nothing listens on (bound, then closed).
pub async fn refused_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    addr
}

/// What a hyper server answers each request with (after reading it whole).
#[derive(Clone)]
pub enum Answer {
    /// This status, these headers, this body.
    Status(u16, Vec<(&'static str, String)>),
    /// No answer, ever (a held response).
    Hold,
    /// 401 unless `authorization` is this value, then 200.
    UnauthorizedUnless(&'static str),
}

/// A hyper HTTP/1.1 server answering every request with `answer`; each
/// request read (its body included) is one attempt.
pub async fn hyper_server(answer: Answer) -> (SocketAddr, Attempts) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let attempts = Attempts::default();
    let counted = attempts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let answer = answer.clone();
            let counted = counted.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let answer = answer.clone();
                    let counted = counted.clone();
                    async move {
                        let authorization = request
                            .headers()
                            .get("authorization")
                            .map(|value| value.as_bytes().to_vec());
                        let _ = request.into_body().collect().await;
                        counted.add();
                        let answer = match answer {
                            Answer::UnauthorizedUnless(token) => {
                                let status = if authorization.as_deref() == Some(token.as_bytes()) {
                                    200
                                } else {
                                    401
                                };
                                Answer::Status(status, vec![])
                            }
                            other => other,
                        };
                        match answer {
                            Answer::Hold => {
                                std::future::pending::<()>().await;
                                unreachable!()
                            }
                            Answer::UnauthorizedUnless(_) => unreachable!("answered above"),
                            Answer::Status(status, headers) => {
                                let mut response = hyper::Response::builder().status(status);
                                for (name, value) in headers {
                                    response = response.header(name, value);
                                }
                                Ok::<_, Infallible>(
                                    response
                                        .body(Full::new(Bytes::from_static(b"answer")))
                                        .expect("response"),
                                )
                            }
                        }
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, attempts)
}

/// What a raw server does with each connection.
#[derive(Clone, Copy, Debug)]
#[allow(clippy::enum_variant_names)]
pub enum Raw {
    /// Resets the connection as soon as it is accepted: the client may see
    /// it while still connecting (then nothing was written) or after
    /// writing its request, whichever comes first.
    ResetOnAccept,
    /// Waits until the request has arrived, then resets without reading it.
    ResetBeforeRead,
    /// Reads the request (head and Content-Length body), then resets.
    ResetAfterRead,
    /// Reads the request, sends 200 headers promising 1000 bytes and 10 of
    /// them, then resets.
    ResetMidBody,
}

/// A raw TCP server behaving as `behaviour`; for ResetOnAccept an attempt is
/// a connection accepted, for ResetBeforeRead a request arrived (unread),
/// otherwise a request read.
pub async fn raw_server(behaviour: Raw) -> (SocketAddr, Attempts) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let attempts = Attempts::default();
    let counted = attempts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut stream = stream;
                match behaviour {
                    Raw::ResetOnAccept => {
                        counted.add();
                        reset(stream);
                    }
                    Raw::ResetBeforeRead => {
                        // Unread bytes at close make the kernel reset too;
                        // the linger makes it certain.
                        if stream.peek(&mut [0u8; 1]).await.is_ok_and(|n| n > 0) {
                            counted.add();
                        }
                        reset(stream);
                    }
                    Raw::ResetAfterRead => {
                        if read_request(&mut stream).await {
                            counted.add();
                        }
                        reset(stream);
                    }
                    Raw::ResetMidBody => {
                        if read_request(&mut stream).await {
                            counted.add();
                        }
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789")
                            .await;
                        let _ = stream.flush().await;
                        reset(stream);
                    }
                }
            });
        }
    });
    (addr, attempts)
}

/// Closes with RST (SO_LINGER 0), not FIN.
fn reset(stream: TcpStream) {
    #[allow(deprecated)]
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// Reads one HTTP/1.1 request head and its Content-Length body; false if
/// the connection ended first.
async fn read_request(stream: &mut TcpStream) -> bool {
    let mut read = Vec::new();
    let mut buffer = [0u8; 4096];
    let head_end = loop {
        if let Some(end) = read.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => read.extend_from_slice(&buffer[..n]),
        }
    };
    let head = String::from_utf8_lossy(&read[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0);
    while read.len() < head_end + length {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => read.extend_from_slice(&buffer[..n]),
        }
    }
    true
}

/// How the small gRPC upstream answers.
#[derive(Clone, Debug)]
pub enum GrpcAnswer {
    /// This code, with this `grpc-retry-pushback-ms` if any.
    Fail(tonic::Code, Option<&'static str>),
    /// Never answers (the caller's timeout ends it).
    Hold,
    /// Succeeds.
    Ok,
    /// UNAUTHENTICATED unless `authorization` is this value, then succeeds.
    UnauthenticatedUnless(&'static str),
}

/// An upstream speaking gRPC (retryd's own contract stands in for any
/// service): every Decide or DecideStream call is one attempt.
#[derive(Clone)]
struct Upstream {
    answer: GrpcAnswer,
    attempts: Attempts,
}

impl Upstream {
    async fn answer(&self, authorization: Option<&str>) -> Result<(), tonic::Status> {
        self.attempts.add();
        match &self.answer {
            GrpcAnswer::Ok => Ok(()),
            GrpcAnswer::UnauthenticatedUnless(token) if authorization == Some(*token) => Ok(()),
            GrpcAnswer::UnauthenticatedUnless(_) => {
                Err(tonic::Status::unauthenticated("stale credentials"))
            }
            GrpcAnswer::Hold => std::future::pending().await,
            GrpcAnswer::Fail(code, pushback) => {
                let mut status = tonic::Status::new(*code, "the upstream says no");
                if let Some(pushback) = pushback {
                    status
                        .metadata_mut()
                        .insert("grpc-retry-pushback-ms", pushback.parse().expect("ascii"));
                }
                Err(status)
            }
        }
    }
}

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for Upstream {
    async fn decide(
        &self,
        request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok());
        self.answer(authorization).await?;
        Ok(tonic::Response::new(pb::DecideResponse {
            decision_id: "upstream-ok".into(),
            ..Default::default()
        }))
    }

    type DecideStreamStream =
        futures::stream::BoxStream<'static, Result<pb::DecideResponse, tonic::Status>>;

    async fn decide_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::DecideRequest>>,
    ) -> Result<tonic::Response<Self::DecideStreamStream>, tonic::Status> {
        self.answer(None).await?;
        Ok(tonic::Response::new(Box::pin(futures::stream::empty())))
    }

    async fn report_traffic(
        &self,
        _request: tonic::Request<pb::ReportTrafficRequest>,
    ) -> Result<tonic::Response<pb::ReportTrafficResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }
}

/// Starts the gRPC upstream on a free loopback port.
pub async fn grpc_server(answer: GrpcAnswer) -> (SocketAddr, Attempts) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let attempts = Attempts::default();
    let upstream = Upstream {
        answer,
        attempts: attempts.clone(),
    };
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(pb::retry_decider_server::RetryDeciderServer::new(upstream))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    (addr, attempts)
}

/// The testkit's one bound on waiting for a state.
pub async fn retryd_testkit_eventually(what: &str, probe: impl FnMut() -> Option<()>) {
    retryd_testkit::eventually(what, probe).await
}

/// An HTTP/2 (prior knowledge) server that refuses every stream with
/// REFUSED_STREAM, counting the streams it refused.
pub async fn h2_refusing_server() -> (SocketAddr, Attempts) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let refused = Attempts::default();
    let counted = refused.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = connection.accept().await {
                    counted.add();
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    (addr, refused)
}
