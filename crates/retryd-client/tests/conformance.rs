//! The language-neutral conformance vectors (`conformance/decisions.json`)
//! through this crate: over `Client::decide`, over one `DecideStream`, and
//! through the local fallback once retryd is stopped, which must agree with
//! what retryd answered on every vector when its policy mirrors retryd's
//! configuration (it decides with the same engine). And the hedge vectors
//! (`conformance/hedging.json`) over `Client::decide`, after the reports
//! they name; their invalid cases through the fallback too (a hedge that
//! reports a failure is refused locally naming the same field).

mod support;

use std::collections::HashMap;
use std::time::Duration;

use retryd_client::engine::{
    Backoff, EnclosingRetry, Evidence, FailureKind, GrpcCode, GrpcCodes, Jitter, Policy,
    UnknownOutcome, Verdict,
};
use retryd_client::{
    Client, Decision, Error, FallbackPolicy, LocalBudget, Source, UpstreamFallback,
    deny_reason_name, pb,
};
use serde_json::Value;

fn load_vectors() -> Value {
    load("decisions.json")
}

fn load(file: &str) -> Value {
    let path = format!("{}/../../conformance/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the conformance file is readable");
    serde_json::from_str(&text).expect("valid JSON")
}

fn cases(vectors: &Value) -> &Vec<Value> {
    let cases = vectors["cases"].as_array().expect("cases");
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    cases
}

// ------------------------------------------------------------ JSON -> pb

fn field<'a>(object: &'a Value, json_name: &str, proto_name: &str) -> Option<&'a Value> {
    object.get(json_name).or_else(|| object.get(proto_name))
}

fn enum_value(value: Option<&Value>, from_name: fn(&str) -> Option<i32>) -> i32 {
    match value {
        None | Some(Value::Null) => 0,
        Some(Value::Number(number)) => number.as_i64().expect("integer") as i32,
        Some(Value::String(name)) => from_name(name).unwrap_or_else(|| panic!("enum {name:?}")),
        Some(other) => panic!("bad enum {other}"),
    }
}

fn uint(value: Option<&Value>) -> u32 {
    value.map_or(0, |value| value.as_u64().expect("unsigned") as u32)
}

fn boolean(value: Option<&Value>) -> bool {
    value.is_some_and(|value| value.as_bool().expect("boolean"))
}

fn duration(value: Option<&Value>) -> Option<prost_types::Duration> {
    let text = value?.as_str().expect("duration string");
    let digits = text.strip_suffix('s').expect("ends in s");
    let (negative, digits) = match digits.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, digits),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let seconds: i64 = whole.parse().expect("seconds");
    let nanos: i32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}")[..9].parse().expect("fraction")
    };
    let sign = if negative { -1 } else { 1 };
    Some(prost_types::Duration {
        seconds: sign * seconds,
        nanos: sign as i32 * nanos,
    })
}

fn body(value: &Value) -> pb::Body {
    pb::Body {
        kind: enum_value(value.get("kind"), |n| {
            pb::BodyKind::from_str_name(n).map(|v| v as i32)
        }),
        declared: enum_value(value.get("declared"), |n| {
            pb::Replayability::from_str_name(n).map(|v| v as i32)
        }),
        parts: value
            .get("parts")
            .and_then(Value::as_array)
            .map(|parts| parts.iter().map(body).collect())
            .unwrap_or_default(),
    }
}

fn decide_request(request: &Value) -> pb::DecideRequest {
    let text = |json: &str, proto: &str| {
        field(request, json, proto)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    pb::DecideRequest {
        upstream: text("upstream", "upstream"),
        operation: text("operation", "operation"),
        idempotency: enum_value(request.get("idempotency"), |n| {
            pb::Idempotency::from_str_name(n).map(|v| v as i32)
        }),
        body: request.get("body").map(body),
        attempt: uint(request.get("attempt")),
        evidence: enum_value(request.get("evidence"), |n| {
            pb::Evidence::from_str_name(n).map(|v| v as i32)
        }),
        failure: enum_value(request.get("failure"), |n| {
            pb::FailureKind::from_str_name(n).map(|v| v as i32)
        }),
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
        grpc_retry_pushback_ms: field(request, "grpcRetryPushbackMs", "grpc_retry_pushback_ms")
            .map(|value| value.as_str().expect("pushback").to_string()),
        lineage: text("lineage", "lineage"),
        retried_below: text("retriedBelow", "retried_below"),
        hedge: uint(request.get("hedge")),
    }
}

// ------------------------------------------------------------ checks

fn verdict_name(decision: &Decision) -> &'static str {
    match decision.verdict {
        Verdict::Retry { .. } => "VERDICT_RETRY",
        Verdict::Deny(_) => "VERDICT_DENY",
        Verdict::Ambiguous => "VERDICT_AMBIGUOUS",
    }
}

fn evidence_name(evidence: Evidence) -> &'static str {
    match evidence {
        Evidence::NotSent => "EVIDENCE_NOT_SENT",
        Evidence::SentNoResponse => "EVIDENCE_SENT_NO_RESPONSE",
        Evidence::ResponseReceived => "EVIDENCE_RESPONSE_RECEIVED",
        Evidence::PartialResponse => "EVIDENCE_PARTIAL_RESPONSE",
    }
}

fn mark_name(mark: Option<UnknownOutcome>) -> &'static str {
    match mark {
        None => "UNKNOWN_OUTCOME_NONE",
        Some(UnknownOutcome::Reconcile) => "UNKNOWN_OUTCOME_RECONCILE",
        Some(UnknownOutcome::ResendWithKey) => "UNKNOWN_OUTCOME_RESEND_WITH_KEY",
    }
}

fn check_decision(expect: &Value, decision: &Decision) -> Vec<String> {
    let mut problems = Vec::new();
    let mut same = |what: &str, got: String, want: &str| {
        if got != want {
            problems.push(format!("{what} {got} != {want}"));
        }
    };
    let want_verdict = expect["verdict"].as_str().expect("verdict");
    same("verdict", verdict_name(decision).into(), want_verdict);
    same(
        "deny_reason",
        decision
            .deny_reason()
            .map_or("DENY_REASON_UNSPECIFIED", deny_reason_name)
            .into(),
        expect
            .get("deny_reason")
            .and_then(Value::as_str)
            .unwrap_or("DENY_REASON_UNSPECIFIED"),
    );
    same(
        "rule",
        decision.rule.to_string(),
        &expect["rule"].as_u64().expect("rule").to_string(),
    );
    same(
        "effective_evidence",
        evidence_name(decision.effective_evidence).into(),
        expect["effective_evidence"].as_str().expect("evidence"),
    );
    if let Some(want) = expect.get("evidence_adjusted").and_then(Value::as_bool) {
        same(
            "evidence_adjusted",
            decision.evidence_adjusted.to_string(),
            &want.to_string(),
        );
    }
    let want_mark = expect["unknown_outcome"].as_str().expect("unknown_outcome");
    same(
        "unknown_outcome",
        mark_name(decision.unknown_outcome).into(),
        want_mark,
    );
    // A DENY with a mark must reach a caller as its ambiguous outcome.
    if want_verdict == "VERDICT_DENY" && want_mark != "UNKNOWN_OUTCOME_NONE" {
        same(
            "is_outcome_unknown",
            decision.is_outcome_unknown().to_string(),
            "true",
        );
    }
    if let Some(want) = expect.get("refresh_credentials").and_then(Value::as_bool) {
        same(
            "refresh_credentials",
            decision.refresh_credentials().to_string(),
            &want.to_string(),
        );
    }
    let backoff = decision.backoff().as_secs_f64() * 1000.0;
    if want_verdict == "VERDICT_RETRY" {
        if let Some(min) = expect.get("backoff_min_ms").and_then(Value::as_f64) {
            if backoff < min {
                problems.push(format!("backoff {backoff}ms < {min}"));
            }
        }
        if let Some(max) = expect.get("backoff_max_ms").and_then(Value::as_f64) {
            if backoff > max {
                problems.push(format!("backoff {backoff}ms > {max}"));
            }
        }
    } else if backoff != 0.0 {
        problems.push(format!("backoff {backoff}ms on a non-RETRY verdict"));
    }
    problems
}

fn check(case: &Value, answer: &Result<Decision, Error>, source: Source) -> Vec<String> {
    match (answer, case.get("expect_error")) {
        (Ok(decision), None) => {
            let mut problems = check_decision(&case["expect"], decision);
            if decision.source != source {
                problems.push(format!("decided by {:?}, not {source:?}", decision.source));
            }
            if source == Source::Retryd && decision.decision_id.is_empty() {
                problems.push("no decision_id".into());
            }
            problems
        }
        (Ok(decision), Some(_)) => vec![format!("expected an error, got {decision:?}")],
        (Err(Error::InvalidRequest(invalid)), Some(expect_error)) => {
            let want = expect_error["field"].as_str().expect("field");
            let message = invalid.to_string();
            if message.starts_with(want) {
                vec![]
            } else {
                vec![format!("message {message:?} does not start with {want:?}")]
            }
        }
        (Err(error), _) => vec![format!("unexpected error {error}")],
    }
}

fn report(what: &str, outcomes: Vec<(String, Vec<String>)>) {
    let total = outcomes.len();
    let failures: Vec<String> = outcomes
        .into_iter()
        .filter(|(_, problems)| !problems.is_empty())
        .map(|(name, problems)| format!("  {name}: {}", problems.join("; ")))
        .collect();
    assert!(
        failures.is_empty(),
        "{what}: {} of {total} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

async fn start(vectors: &Value, fallback: Option<FallbackPolicy>) -> (support::Retryd, Client) {
    let server = support::Retryd::start(vectors["config"].as_str().expect("config"));
    let mut builder = Client::builder(format!("http://{}", server.grpc))
        .timeout(Duration::from_secs(5))
        .disable_reporting();
    builder = match fallback {
        Some(policy) => builder.fallback(policy),
        // Nothing hidden: a failure of retryd fails the case.
        None => builder.no_fallback(),
    };
    let client = builder.connect().await.expect("client");
    for upstream in vectors["disable_upstreams"]
        .as_array()
        .into_iter()
        .flatten()
    {
        client
            .set_retries_enabled(upstream.as_str().expect("name"), false, "conformance")
            .await
            .expect("SetRetriesEnabled");
    }
    (server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vector_through_client_decide() {
    let vectors = load_vectors();
    let (_server, client) = start(&vectors, None).await;
    let mut outcomes = Vec::new();
    for case in cases(&vectors) {
        let answer = client.decide(&decide_request(&case["request"])).await;
        outcomes.push((
            case["name"].as_str().expect("name").to_owned(),
            check(case, &answer, Source::Retryd),
        ));
    }
    report("Client::decide", outcomes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vector_through_one_decide_stream() {
    let vectors = load_vectors();
    let (_server, client) = start(&vectors, None).await;
    let stream = client.decide_stream();
    let mut outcomes = Vec::new();
    for case in cases(&vectors) {
        let answer = stream.decide(&decide_request(&case["request"])).await;
        outcomes.push((
            case["name"].as_str().expect("name").to_owned(),
            check(case, &answer, Source::Retryd),
        ));
    }
    report("DecideStream::decide", outcomes);
}

/// The conformance configuration, restated as the fallback's policy (its
/// `config` TOML: `[defaults]` and each `[upstreams."…"]`).
fn mirrored_policy() -> FallbackPolicy {
    let default_policy = Policy {
        max_attempts: 3,
        min_attempt_budget: Duration::from_millis(50),
        max_retry_after: Duration::from_secs(60),
        transient_500: false,
        grpc_retryable: GrpcCodes::DEFAULT,
        permanent_failures: Vec::new(),
        backoff: Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(5),
            jitter: Jitter::Full,
        },
        inside_enclosing_retry: EnclosingRetry::Deny,
    };
    let budget = LocalBudget {
        capacity: 1000.0,
        initial: 1000.0,
        ratio: 0.1,
        min_per_second: 1.0,
    };
    let with = |change: &dyn Fn(&mut Policy)| {
        let mut policy = default_policy.clone();
        change(&mut policy);
        UpstreamFallback {
            policy,
            budget,
            hedging: None,
        }
    };
    let upstreams: HashMap<String, UpstreamFallback> = [
        ("conf-max2", with(&|p| p.max_attempts = 2)),
        (
            "conf-empty",
            UpstreamFallback {
                policy: default_policy.clone(),
                budget: LocalBudget {
                    capacity: 10.0,
                    initial: 0.0,
                    ratio: 0.1,
                    min_per_second: 0.0,
                },
                hedging: None,
            },
        ),
        ("conf-transient500", with(&|p| p.transient_500 = true)),
        (
            "conf-chain-allow",
            with(&|p| p.inside_enclosing_retry = EnclosingRetry::Allow),
        ),
        (
            "conf-permanent",
            with(&|p| {
                p.permanent_failures =
                    vec![FailureKind::Connect, FailureKind::ResponseHeaderTimeout]
            }),
        ),
        (
            "conf-decorrelated",
            with(&|p| {
                p.backoff = Backoff {
                    base: Duration::from_millis(100),
                    max: Duration::from_secs(1),
                    jitter: Jitter::Decorrelated,
                }
            }),
        ),
        (
            "conf-capped",
            with(&|p| {
                p.max_attempts = 10;
                p.backoff = Backoff {
                    base: Duration::from_secs(1),
                    max: Duration::from_secs(2),
                    jitter: Jitter::Full,
                };
            }),
        ),
        (
            "conf-deadline",
            with(&|p| {
                p.min_attempt_budget = Duration::from_millis(200);
                p.max_retry_after = Duration::from_secs(5);
            }),
        ),
        (
            "conf-grpc-internal",
            with(&|p| {
                p.grpc_retryable = GrpcCodes::DEFAULT
                    .with(GrpcCode::Internal)
                    .with(GrpcCode::Unknown)
            }),
        ),
        (
            "conf-grpc-unavailable-only",
            with(&|p| p.grpc_retryable = GrpcCodes::NONE.with(GrpcCode::Unavailable)),
        ),
    ]
    .into_iter()
    .map(|(name, fallback)| (name.to_owned(), fallback))
    .collect();
    FallbackPolicy {
        default: UpstreamFallback {
            policy: default_policy.clone(),
            budget,
            hedging: None,
        },
        upstreams,
        disabled: ["conf-disabled".to_owned()].into_iter().collect(),
    }
}

/// Whether two decisions agree on everything but the jittered backoff.
fn agree(server: &Decision, local: &Decision) -> Option<String> {
    let same = verdict_name(server) == verdict_name(local)
        && server.deny_reason() == local.deny_reason()
        && server.rule == local.rule
        && server.effective_evidence == local.effective_evidence
        && server.evidence_adjusted == local.evidence_adjusted
        && server.unknown_outcome == local.unknown_outcome
        && server.refresh_credentials() == local.refresh_credentials();
    (!same).then(|| format!("retryd {server:?} but the fallback {local:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_agrees_with_retryd_on_every_vector_once_retryd_is_stopped() {
    let vectors = load_vectors();
    let (mut server, client) = start(&vectors, Some(mirrored_policy())).await;
    let mut answered = Vec::new();
    for case in cases(&vectors) {
        answered.push(client.decide(&decide_request(&case["request"])).await);
    }
    server.terminate(retryd_testkit::HANG_GUARD);
    drop(server);

    let mut outcomes = Vec::new();
    for (case, retryd) in cases(&vectors).iter().zip(&answered) {
        let local = client.decide(&decide_request(&case["request"])).await;
        let mut problems = check(case, &local, Source::Fallback);
        match (retryd, &local) {
            (Ok(retryd), Ok(local)) => {
                problems.extend(check(case, &Ok(retryd.clone()), Source::Retryd));
                problems.extend(agree(retryd, local));
            }
            (Err(Error::InvalidRequest(retryd)), Err(Error::InvalidRequest(local))) => {
                if retryd.field != local.field {
                    problems.push(format!(
                        "retryd named {:?}, the fallback {:?}",
                        retryd.field, local.field
                    ));
                }
            }
            (retryd, local) => problems.push(format!("retryd {retryd:?}, the fallback {local:?}")),
        }
        outcomes.push((case["name"].as_str().expect("name").to_owned(), problems));
    }
    report("the fallback against retryd", outcomes);
    // One outage, however many decisions the local rule made in it.
    let outage = client.outage();
    assert!(outage.unreachable);
    assert_eq!(outage.outages, 1);
    let valid = cases(&vectors)
        .iter()
        .filter(|case| case.get("expect_error").is_none())
        .count() as u64;
    assert_eq!(outage.decisions, valid);
}

/// A report of `hedging.json` (proto3 JSON) as the contract's message.
fn traffic_report(report: &Value) -> pb::ReportTrafficRequest {
    let histogram = |entry: &Value, name: &str| {
        entry.get(name).map(|histogram| pb::LatencyHistogram {
            counts: histogram["counts"]
                .as_object()
                .expect("counts")
                .iter()
                .map(|(index, count)| {
                    let count = count.as_u64().or_else(|| count.as_str()?.parse().ok());
                    (index.parse().expect("bucket"), count.expect("count"))
                })
                .collect(),
        })
    };
    let number = |entry: &Value, name: &str| {
        entry.get(name).map_or(0, |n| {
            n.as_u64()
                .or_else(|| n.as_str()?.parse().ok())
                .expect("count")
        })
    };
    pb::ReportTrafficRequest {
        traffic: report["traffic"]
            .as_array()
            .expect("traffic")
            .iter()
            .map(|entry| pb::UpstreamTraffic {
                upstream: entry["upstream"].as_str().expect("upstream").to_owned(),
                requests: number(entry, "requests"),
                successes: number(entry, "successes"),
                failures: number(entry, "failures"),
                latency_successes: histogram(entry, "latencySuccesses"),
                latency_failures: histogram(entry, "latencyFailures"),
                ..Default::default()
            })
            .collect(),
        report_id: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hedging_vector_through_client_decide() {
    let vectors = load("hedging.json");
    let (_server, client) = start(&vectors, None).await;
    for report in vectors["reports"].as_array().expect("reports") {
        let request = traffic_report(report);
        let answer = client.report_traffic(request.clone()).await.expect("taken");
        assert_eq!(answer.accepted as usize, request.traffic.len());
    }
    let cases = vectors["cases"].as_array().expect("cases");
    assert!(cases.len() >= 20, "only {} cases", cases.len());
    let mut outcomes = Vec::new();
    let local = retryd_client::Fallback::default();
    for case in cases {
        let request = decide_request(&case["request"]);
        assert!(request.hedge >= 1, "a hedge case");
        let answer = client.decide(&request).await;
        let mut problems = check(case, &answer, Source::Retryd);
        // An invalid hedge is refused locally as retryd refuses it.
        if let Some(expect_error) = case.get("expect_error") {
            let want = expect_error["field"].as_str().expect("field");
            match local.decide(&request, "conformance", Source::Fallback) {
                Err(invalid) if invalid.to_string().starts_with(want) => {}
                other => problems.push(format!("locally: {other:?}, not {want}")),
            }
        }
        outcomes.push((case["name"].as_str().expect("name").to_owned(), problems));
    }
    report("Client::decide, hedging.json", outcomes);
}
