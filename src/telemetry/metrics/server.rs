//! The `/metrics` port: HTTP/1.1 through hyper, one OpenMetrics page,
//! bounded in time and in connections.
//!
//! Unbounded, 300 keep-alive connections to this port took every file
//! descriptor of a process under `nofile = 256`, and new gRPC callers got
//! none. So at most [`MAX_SCRAPE_CONNECTIONS`] are open at once, within
//! the descriptors the gRPC acceptor leaves for everything else, and a
//! new one takes the place of the oldest rather than being refused: a
//! scraper always gets in, and whoever holds the port keeps it for at
//! most one lifetime.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// How long a scraper has to send its request head, and a connection to
/// live: a peer that opens the port and never speaks, or reads slowly, is
/// closed.
const SCRAPE_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Long enough for several scrapes on one connection, short enough that a
/// connection held open for nothing goes soon. Prometheus reconnects when
/// its connection has gone.
const SCRAPE_CONNECTION_LIFETIME: Duration = Duration::from_secs(10);

/// Most metrics connections open at once: a quarter of the descriptors
/// the gRPC port's bound keeps for everything else (`RESERVED_FILES` in
/// `transport/connections.rs`), and more scrapers than any deployment runs.
const MAX_SCRAPE_CONNECTIONS: usize = 16;

/// Serves `GET /metrics` over HTTP/1.1 (hyper) on `listener` until
/// `shutdown` completes. `scrape` renders the page; every other path is a
/// 404. Keep-alive is allowed (Prometheus reuses its connection), within
/// the bounds above.
pub async fn serve_metrics<F, Fut>(
    listener: TcpListener,
    scrape: F,
    shutdown: impl Future<Output = ()>,
) where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = String> + Send,
{
    tokio::pin!(shutdown);
    // The open connections' tasks, oldest first.
    let mut open: VecDeque<tokio::task::AbortHandle> = VecDeque::new();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // EMFILE and the like repeat at once: do not spin.
                    tracing::warn!(error = %err, "metrics listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        open.retain(|task| !task.is_finished());
        if open.len() >= MAX_SCRAPE_CONNECTIONS {
            // Dropping the task's future closes its connection.
            if let Some(oldest) = open.pop_front() {
                oldest.abort();
            }
        }
        let scrape = scrape.clone();
        let task = tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let scrape = scrape.clone();
                async move { Ok::<_, std::convert::Infallible>(respond(&request, scrape).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(SCRAPE_HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            if tokio::time::timeout(SCRAPE_CONNECTION_LIFETIME, connection.as_mut())
                .await
                .is_err()
            {
                // At the end of its lifetime a scrape in progress is
                // finished (within the head timeout), not cut off: the
                // short lifetime must not fail Prometheus's scrapes.
                connection.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(SCRAPE_HEAD_TIMEOUT, connection).await;
            }
        });
        open.push_back(task.abort_handle());
    }
}

async fn respond<F, Fut>(
    request: &hyper::Request<Incoming>,
    scrape: F,
) -> hyper::Response<Full<Bytes>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = String>,
{
    let (status, body) =
        if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
            (hyper::StatusCode::OK, scrape().await)
        } else {
            (
                hyper::StatusCode::NOT_FOUND,
                "not found: try GET /metrics\n".to_owned(),
            )
        };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        // OpenMetrics, which Prometheus asks for first and which alone
        // carries exemplars.
        hyper::header::HeaderValue::from_static(super::render::CONTENT_TYPE),
    );
    response
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Reads one HTTP/1.1 response with a Content-Length body.
    async fn response(stream: &mut tokio::net::TcpStream) -> (String, String) {
        let mut raw = Vec::new();
        let mut byte = [0u8; 1];
        while !raw.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "closed early");
            raw.push(byte[0]);
        }
        let head = String::from_utf8(raw).unwrap();
        let length: usize = head
            .lines()
            .find_map(|line| {
                line.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_owned)
            })
            .expect("a content-length")
            .trim()
            .parse()
            .unwrap();
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await.unwrap();
        (head, String::from_utf8(body).unwrap())
    }

    #[tokio::test]
    async fn serves_metrics_with_keep_alive_and_404_elsewhere() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_metrics(
            listener,
            || async { "retryd_up 1\n".to_owned() },
            async {
                let _ = stopped.await;
            },
        ));
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        for _ in 0..2 {
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let (head, body) = response(&mut stream).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            assert!(head.contains("application/openmetrics-text"), "{head}");
            assert_eq!(body, "retryd_up 1\n");
        }
        stream
            .write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (head, _) = response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        let _ = stop.send(());
        server.await.unwrap();
    }
}
