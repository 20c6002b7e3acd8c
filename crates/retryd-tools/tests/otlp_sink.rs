//! `retryd-otlp-sink` counts what retryd exports, over OTLP/gRPC and
//! OTLP/HTTP, and tells the count on `GET /spans`: the figure
//! `scripts/bench-telemetry` compares with the decisions made, so a sink
//! that miscounted would make its "0 dropped" wrong.

use retryd_testkit as support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use support::Server;

const BOUNDLESS: &str = "[defaults]\nbudget = { capacity = 1e9, initial = 1e9, ratio = 0.1, min_per_second = 1000.0 }\n";

/// A running sink, killed when dropped.
struct Sink {
    child: Child,
    grpc: String,
    http: String,
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sink() -> Sink {
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryd-otlp-sink"))
        .args(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start retryd-otlp-sink");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addresses: serde_json::Value = serde_json::from_str(&line).expect(&line);
    Sink {
        grpc: addresses["otlp"].as_str().unwrap().to_owned(),
        http: addresses["http"].as_str().unwrap().to_owned(),
        child,
    }
}

/// One HTTP/1.1 request; the status line and the body.
fn http(address: &str, request: &str) -> (String, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.lines().next().unwrap_or_default().to_owned();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn counts(sink: &Sink) -> serde_json::Value {
    let (status, body) = http(
        &sink.http,
        "GET /spans HTTP/1.1\r\nhost: sink\r\nconnection: close\r\n\r\n",
    );
    assert!(status.contains("200"), "{status}: {body}");
    serde_json::from_str(&body).expect(&body)
}

fn spans(sink: &Sink) -> u64 {
    counts(sink)["spans"].as_u64().unwrap()
}

fn load(target: &str, mode: &str, requests: &str) {
    let output = Command::new(env!("CARGO_BIN_EXE_retryd-load"))
        .args(["--target", target, "--mode", mode, "-n", "2", "-c", "8"])
        .args(["--requests", requests])
        .output()
        .expect("run retryd-load");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn the_sink_counts_every_span_retryd_exports_over_grpc_and_http() {
    let sink = sink();
    assert_eq!(spans(&sink), 0);
    let over_grpc = Server::start(&format!(
        "{BOUNDLESS}[telemetry]\notlp_endpoint = \"http://{}\"\n",
        sink.grpc
    ));
    let over_http = Server::start(&format!(
        "{BOUNDLESS}[telemetry]\notlp_endpoint = \"http://{}/v1/traces\"\notlp_protocol = \"http/protobuf\"\n",
        sink.http
    ));
    let grpc_target = over_grpc.grpc.to_string();
    let http_target = over_http.grpc.to_string();
    load(&grpc_target, "unary", "300");
    load(&grpc_target, "stream", "300");
    load(&http_target, "unary", "200");
    support::eventually("the sink counted 800 spans", || {
        (spans(&sink) == 800).then_some(())
    })
    .await;
    // A decision's span, its ids, times and some twenty attributes, is
    // hundreds of bytes, not a few and not tens of thousands.
    let bytes = counts(&sink)["bytes"].as_u64().unwrap();
    assert!((200 * 800..4_000 * 800).contains(&bytes), "{bytes} bytes");
    for server in [&over_grpc, &over_http] {
        let scrape = server.scrape();
        for series in [
            "retryd_spans_dropped_total",
            "retryd_spans_export_failed_total",
        ] {
            let value = scrape
                .lines()
                .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("{series} in\n{scrape}"));
            assert_eq!(value.trim(), "0", "{series}:\n{scrape}");
        }
    }
    // Not an export: refused, and not counted.
    let (status, _) = http(
        &sink.http,
        "POST /v1/traces HTTP/1.1\r\nhost: sink\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc",
    );
    assert!(status.contains("400"), "{status}");
    assert_eq!(spans(&sink), 800);
}
