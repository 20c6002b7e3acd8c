//! Runs the language-neutral conformance vectors (`conformance/decisions.json`)
//! against the real `retryd` binary on a loopback port, once over unary
//! `Decide` and once over one `DecideStream`. Each test starts its own server
//! with the configuration the vectors carry, so budget spending in one test
//! cannot starve the other. The format is described in `conformance/README.md`.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use serde_json::Value;

/// The vectors, read from the repository at run time.
fn load_vectors() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/conformance/decisions.json");
    let text = std::fs::read_to_string(path).expect("conformance/decisions.json is readable");
    serde_json::from_str(&text).expect("conformance/decisions.json is valid JSON")
}

/// A `retryd serve` child process; killed when dropped.
struct Server {
    child: Child,
    grpc: String,
    stderr_log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(config: &str) -> Server {
        let dir = tempfile::tempdir().expect("temporary directory");
        let config_path = dir.path().join("retryd.toml");
        std::fs::write(&config_path, config).expect("write config");
        let stderr_log = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_log).expect("stderr log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_retryd"))
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn retryd");
        let stdout = child.stdout.take().expect("piped stdout");
        let (line_tx, line_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = line_tx.send(line);
            // Keep draining so the server never writes into a closed pipe.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let mut server = Server {
            child,
            grpc: String::new(),
            stderr_log,
            _dir: dir,
        };
        let line = match line_rx.recv_timeout(retryd_testkit::HANG_GUARD) {
            Ok(line) if !line.trim().is_empty() => line,
            other => panic!(
                "retryd printed no address line ({other:?}); stderr:\n{}",
                server.stderr_tail()
            ),
        };
        let addresses: Value = serde_json::from_str(line.trim())
            .unwrap_or_else(|error| panic!("address line {line:?} is not JSON: {error}"));
        server.grpc = addresses["grpc"]
            .as_str()
            .unwrap_or_else(|| panic!("address line {line:?} has no \"grpc\""))
            .to_string();
        server
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    fn stderr_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(&self.stderr_log) {
            let _ = file.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server for the vectors and switches retries off where they ask.
async fn start_for(vectors: &Value) -> (Server, RetryDeciderClient<tonic::transport::Channel>) {
    let server = Server::start(vectors["config"].as_str().expect("\"config\" is a string"));
    let mut admin = RetryAdminClient::connect(server.endpoint())
        .await
        .expect("connect admin client");
    for upstream in vectors["disable_upstreams"]
        .as_array()
        .into_iter()
        .flatten()
    {
        admin
            .set_retries_enabled(pb::SetRetriesEnabledRequest {
                upstream: upstream.as_str().expect("upstream name").to_string(),
                enabled: false,
                reason: "conformance vectors".to_string(),
            })
            .await
            .expect("SetRetriesEnabled");
    }
    let decider = RetryDeciderClient::connect(server.endpoint())
        .await
        .expect("connect decider client");
    (server, decider)
}

// ------------------------------------------------------------------ JSON -> pb

/// Reads a field by its proto3 JSON name, falling back to the proto name.
fn field<'a>(object: &'a Value, json_name: &str, proto_name: &str) -> Option<&'a Value> {
    object.get(json_name).or_else(|| object.get(proto_name))
}

/// An enum given by name (`"IDEMPOTENCY_SAFE"`) or by number (`9`).
fn enum_value(value: Option<&Value>, from_name: fn(&str) -> Option<i32>) -> i32 {
    match value {
        None | Some(Value::Null) => 0,
        Some(Value::Number(number)) => number.as_i64().expect("integer enum") as i32,
        Some(Value::String(name)) => {
            from_name(name).unwrap_or_else(|| panic!("unknown enum name {name:?}"))
        }
        Some(other) => panic!("bad enum value {other}"),
    }
}

fn idempotency_from_name(name: &str) -> Option<i32> {
    pb::Idempotency::from_str_name(name).map(|value| value as i32)
}
fn evidence_from_name(name: &str) -> Option<i32> {
    pb::Evidence::from_str_name(name).map(|value| value as i32)
}
fn failure_from_name(name: &str) -> Option<i32> {
    pb::FailureKind::from_str_name(name).map(|value| value as i32)
}
fn body_kind_from_name(name: &str) -> Option<i32> {
    pb::BodyKind::from_str_name(name).map(|value| value as i32)
}
fn replayability_from_name(name: &str) -> Option<i32> {
    pb::Replayability::from_str_name(name).map(|value| value as i32)
}

fn uint(value: Option<&Value>) -> u32 {
    value.map_or(0, |value| {
        value.as_u64().expect("non-negative integer") as u32
    })
}

fn boolean(value: Option<&Value>) -> bool {
    value.is_some_and(|value| value.as_bool().expect("boolean"))
}

/// A proto3 JSON duration: `"1.5s"`, `"-0.500s"`, `"0s"`.
fn duration(value: Option<&Value>) -> Option<prost_types::Duration> {
    let text = value?.as_str().expect("duration string");
    let digits = text.strip_suffix('s').expect("duration ends in s");
    let (negative, digits) = match digits.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, digits),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let seconds: i64 = whole.parse().expect("duration seconds");
    let nanos: i32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}")[..9]
            .parse()
            .expect("duration fraction")
    };
    let sign = if negative { -1 } else { 1 };
    Some(prost_types::Duration {
        seconds: sign * seconds,
        nanos: sign as i32 * nanos,
    })
}

fn body(value: &Value) -> pb::Body {
    pb::Body {
        kind: enum_value(value.get("kind"), body_kind_from_name),
        declared: enum_value(value.get("declared"), replayability_from_name),
        parts: value
            .get("parts")
            .and_then(Value::as_array)
            .map(|parts| parts.iter().map(body).collect())
            .unwrap_or_default(),
    }
}

fn decide_request(request: &Value) -> pb::DecideRequest {
    let text = |json_name: &str, proto_name: &str| {
        field(request, json_name, proto_name)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    pb::DecideRequest {
        upstream: text("upstream", "upstream"),
        operation: text("operation", "operation"),
        idempotency: enum_value(request.get("idempotency"), idempotency_from_name),
        body: request.get("body").map(body),
        attempt: uint(request.get("attempt")),
        evidence: enum_value(request.get("evidence"), evidence_from_name),
        failure: enum_value(request.get("failure"), failure_from_name),
        http_status: uint(field(request, "httpStatus", "http_status")),
        retry_after: text("retryAfter", "retry_after"),
        deadline_remaining: duration(field(request, "deadlineRemaining", "deadline_remaining")),
        first_byte_delivered: boolean(field(request, "firstByteDelivered", "first_byte_delivered")),
        runtime_draining: boolean(field(request, "runtimeDraining", "runtime_draining")),
        auth_refresh_attempted: boolean(field(
            request,
            "authRefreshAttempted",
            "auth_refresh_attempted",
        )),
        previous_backoff: duration(field(request, "previousBackoff", "previous_backoff")),
        max_attempts: uint(field(request, "maxAttempts", "max_attempts")),
        grpc_status_code: uint(field(request, "grpcStatusCode", "grpc_status_code")),
        // Present (even empty) when the vector names it: presence matters.
        grpc_retry_pushback_ms: field(request, "grpcRetryPushbackMs", "grpc_retry_pushback_ms")
            .map(|value| value.as_str().expect("pushback string").to_string()),
        lineage: text("lineage", "lineage"),
        retried_below: text("retriedBelow", "retried_below"),
        hedge: uint(request.get("hedge")),
    }
}

// ------------------------------------------------------------------ checks

fn duration_ms(duration: Option<&prost_types::Duration>) -> f64 {
    duration.map_or(0.0, |d| {
        d.seconds as f64 * 1000.0 + f64::from(d.nanos) / 1e6
    })
}

fn name_of<E: std::fmt::Debug>(
    value: i32,
    parse: fn(i32) -> Result<E, prost::UnknownEnumValue>,
) -> String {
    match parse(value) {
        Ok(known) => format!("{known:?}"),
        Err(_) => format!("#{value}"),
    }
}

/// The differences between a decision and a case's `expect`; empty if none.
fn check_decision(expect: &Value, response: &pb::DecideResponse) -> Vec<String> {
    let mut problems = Vec::new();
    let verdict = pb::Verdict::try_from(response.verdict).map(|v| v.as_str_name());
    let want_verdict = expect["verdict"].as_str().expect("expect.verdict");
    if verdict != Ok(want_verdict) {
        problems.push(format!(
            "verdict {} != {want_verdict}",
            name_of(response.verdict, pb::Verdict::try_from)
        ));
    }
    let want_reason = expect
        .get("deny_reason")
        .and_then(Value::as_str)
        .unwrap_or("DENY_REASON_UNSPECIFIED");
    if pb::DenyReason::try_from(response.deny_reason).map(|v| v.as_str_name()) != Ok(want_reason) {
        problems.push(format!(
            "deny_reason {} != {want_reason}",
            name_of(response.deny_reason, pb::DenyReason::try_from)
        ));
    }
    let want_rule = expect["rule"].as_u64().expect("expect.rule");
    if u64::from(response.rule) != want_rule {
        problems.push(format!("rule {} != {want_rule}", response.rule));
    }
    let want_evidence = expect["effective_evidence"]
        .as_str()
        .expect("expect.effective_evidence");
    if pb::Evidence::try_from(response.effective_evidence).map(|v| v.as_str_name())
        != Ok(want_evidence)
    {
        problems.push(format!(
            "effective_evidence {} != {want_evidence}",
            name_of(response.effective_evidence, pb::Evidence::try_from)
        ));
    }
    if let Some(want) = expect.get("evidence_adjusted").and_then(Value::as_bool) {
        if response.evidence_adjusted != want {
            problems.push(format!(
                "evidence_adjusted {} != {want}",
                response.evidence_adjusted
            ));
        }
    }
    // Every case states it: a DENY must never hide a possibly-executed call.
    let want_mark = expect["unknown_outcome"]
        .as_str()
        .expect("expect.unknown_outcome");
    if pb::UnknownOutcome::try_from(response.unknown_outcome).map(|v| v.as_str_name())
        != Ok(want_mark)
    {
        problems.push(format!(
            "unknown_outcome {} != {want_mark}",
            name_of(response.unknown_outcome, pb::UnknownOutcome::try_from)
        ));
    }
    if let Some(want) = expect.get("refresh_credentials").and_then(Value::as_bool) {
        if response.refresh_credentials != want {
            problems.push(format!(
                "refresh_credentials {} != {want}",
                response.refresh_credentials
            ));
        }
    }
    let backoff = duration_ms(response.backoff.as_ref());
    if want_verdict == "VERDICT_RETRY" {
        if let Some(min) = expect.get("backoff_min_ms").and_then(Value::as_f64) {
            if backoff < min {
                problems.push(format!("backoff {backoff}ms < backoff_min_ms {min}"));
            }
        }
        if let Some(max) = expect.get("backoff_max_ms").and_then(Value::as_f64) {
            if backoff > max {
                problems.push(format!("backoff {backoff}ms > backoff_max_ms {max}"));
            }
        }
    } else if backoff != 0.0 {
        problems.push(format!("backoff {backoff}ms on a non-RETRY verdict"));
    }
    problems
}

fn check_error(expect_error: &Value, code: tonic::Code, message: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let want_code = expect_error["code"].as_str().expect("expect_error.code");
    let want_field = expect_error["field"].as_str().expect("expect_error.field");
    if want_code != "INVALID_ARGUMENT" {
        panic!("the vectors only use INVALID_ARGUMENT, not {want_code}");
    }
    if code != tonic::Code::InvalidArgument {
        problems.push(format!(
            "code {code:?} != InvalidArgument (message {message:?})"
        ));
    }
    if !message.starts_with(want_field) {
        problems.push(format!(
            "message {message:?} does not start with {want_field:?}"
        ));
    }
    problems
}

fn report(outcomes: Vec<(String, Vec<String>)>) {
    let total = outcomes.len();
    let failures: Vec<String> = outcomes
        .into_iter()
        .filter(|(_, problems)| !problems.is_empty())
        .map(|(name, problems)| format!("  {name}: {}", problems.join("; ")))
        .collect();
    eprintln!(
        "conformance: {} passed, {} failed",
        total - failures.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {total} conformance cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn cases(vectors: &Value) -> &Vec<Value> {
    let cases = vectors["cases"].as_array().expect("\"cases\" is an array");
    assert!(
        cases.len() >= 60,
        "expected at least 60 cases, found {}",
        cases.len()
    );
    cases
}

#[tokio::test]
async fn conformance_vectors_over_decide() {
    let vectors = load_vectors();
    let (server, mut decider) = start_for(&vectors).await;
    let mut outcomes = Vec::new();
    for case in cases(&vectors) {
        let name = case["name"].as_str().expect("case name").to_string();
        let request = decide_request(&case["request"]);
        let problems = match (decider.decide(request).await, case.get("expect_error")) {
            (Ok(response), None) => check_decision(&case["expect"], response.get_ref()),
            (Ok(response), Some(_)) => {
                vec![format!("expected an error, got {:?}", response.get_ref())]
            }
            (Err(status), Some(expect_error)) => {
                check_error(expect_error, status.code(), status.message())
            }
            (Err(status), None) => vec![format!(
                "unexpected error {:?}: {}",
                status.code(),
                status.message()
            )],
        };
        outcomes.push((name, problems));
    }
    if outcomes.iter().any(|(_, problems)| !problems.is_empty()) {
        eprintln!("retryd stderr (tail):\n{}", server.stderr_tail());
    }
    report(outcomes);
}

#[tokio::test]
async fn conformance_vectors_over_one_stream() {
    let vectors = load_vectors();
    let (_server, mut decider) = start_for(&vectors).await;
    let cases = cases(&vectors);
    let requests: Vec<pb::DecideRequest> = cases
        .iter()
        .map(|case| decide_request(&case["request"]))
        .collect();
    let mut responses = decider
        .decide_stream(futures::stream::iter(requests))
        .await
        .expect("DecideStream opens")
        .into_inner();
    let mut outcomes = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("case name").to_string();
        let response = match responses.message().await {
            Ok(Some(response)) => response,
            Ok(None) => {
                outcomes.push((name, vec!["stream ended early".to_string()]));
                continue;
            }
            Err(status) => {
                outcomes.push((name, vec![format!("stream failed: {status}")]));
                break;
            }
        };
        let problems = match (&response.error, case.get("expect_error")) {
            (None, None) => check_decision(&case["expect"], &response),
            (Some(error), Some(expect_error)) => {
                let mut problems =
                    check_error(expect_error, tonic::Code::from(error.code), &error.message);
                if response.verdict != pb::Verdict::Unspecified as i32 {
                    problems.push("an error item carries a verdict".to_string());
                }
                problems
            }
            (None, Some(_)) => vec![format!("expected an error item, got {response:?}")],
            (Some(error), None) => vec![format!("unexpected error item: {error:?}")],
        };
        outcomes.push((name, problems));
    }
    report(outcomes);
}

// ------------------------------------------------------------------ hedging

/// A `ReportTrafficRequest` in the proto3 JSON mapping, as far as the
/// hedging vectors use it: upstream, requests and `latencySuccesses`.
fn report_request(report: &Value) -> pb::ReportTrafficRequest {
    let traffic = report["traffic"]
        .as_array()
        .expect("\"traffic\" is an array")
        .iter()
        .map(|entry| pb::UpstreamTraffic {
            upstream: entry["upstream"].as_str().expect("upstream").to_string(),
            requests: entry["requests"].as_u64().expect("requests"),
            latency_successes: field(entry, "latencySuccesses", "latency_successes").map(
                |histogram| pb::LatencyHistogram {
                    counts: histogram["counts"]
                        .as_object()
                        .expect("counts is an object")
                        .iter()
                        .map(|(bucket, count)| {
                            (
                                bucket.parse().expect("a bucket index"),
                                count.as_u64().expect("a count"),
                            )
                        })
                        .collect(),
                },
            ),
            ..Default::default()
        })
        .collect();
    pb::ReportTrafficRequest {
        traffic,
        ..Default::default()
    }
}

/// `conformance/hedging.json`: hedge decisions after the reports the file
/// carries, over unary `Decide`. Run by the server's suite only: the
/// clients' local fallbacks do not decide hedges (conformance/README.md).
#[tokio::test]
async fn hedging_vectors_over_decide() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/conformance/hedging.json");
    let text = std::fs::read_to_string(path).expect("conformance/hedging.json is readable");
    let vectors: Value = serde_json::from_str(&text).expect("conformance/hedging.json is JSON");
    let (server, mut decider) = start_for(&vectors).await;
    for report in vectors["reports"].as_array().expect("\"reports\"") {
        decider
            .report_traffic(report_request(report))
            .await
            .expect("a vectors report is accepted");
    }
    let cases = vectors["cases"].as_array().expect("\"cases\" is an array");
    assert!(cases.len() >= 20, "{} hedging cases", cases.len());
    let mut outcomes = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("case name").to_string();
        let request = decide_request(&case["request"]);
        let problems = match (decider.decide(request).await, case.get("expect_error")) {
            (Ok(response), None) => check_decision(&case["expect"], response.get_ref()),
            (Ok(response), Some(_)) => {
                vec![format!("expected an error, got {:?}", response.get_ref())]
            }
            (Err(status), Some(expect_error)) => {
                check_error(expect_error, status.code(), status.message())
            }
            (Err(status), None) => vec![format!(
                "unexpected error {:?}: {}",
                status.code(),
                status.message()
            )],
        };
        outcomes.push((name, problems));
    }
    if outcomes.iter().any(|(_, problems)| !problems.is_empty()) {
        eprintln!("retryd stderr (tail):\n{}", server.stderr_tail());
    }
    report(outcomes);
}
