//! Audit telemetry against the real binary: spans received by a real
//! OTLP/gRPC collector (built from the official OpenTelemetry protobuf
//! definitions) inside the test, exporter failures that never slow a
//! decision, exact Prometheus counters, and decision log lines.

use retryd_testkit as support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use retryd_proto as pb;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use support::{Server, retryable};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// A collector that keeps every span it receives, or never answers.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    /// Export calls received, answered or not.
    exports: Arc<AtomicUsize>,
    stalled: bool,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.exports.fetch_add(1, Ordering::SeqCst);
        if self.stalled {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    async fn start(self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(self))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    /// Waits until `count` spans satisfy `filter` (within the testkit's
    /// hang guard).
    async fn wait_for(&self, count: usize, filter: impl Fn(&Span) -> bool) -> Vec<Span> {
        support::eventually(&format!("{count} matching spans"), || {
            let found: Vec<Span> = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|s| filter(s))
                .cloned()
                .collect();
            (found.len() >= count).then_some(found)
        })
        .await
    }

    /// Every span received so far that `filter` matches.
    fn received(&self, filter: impl Fn(&Span) -> bool) -> Vec<Span> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| filter(s))
            .cloned()
            .collect()
    }
}

fn attribute<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn text(span: &Span, key: &str) -> String {
    match attribute(span, key) {
        Some(Value::StringValue(text)) => text.clone(),
        other => panic!("{key}: {other:?} in {span:?}"),
    }
}

fn traced<T>(message: T, trace_id: &str, parent: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let header = format!("00-{trace_id}-{parent}-01");
    request.metadata_mut().insert(
        "traceparent",
        MetadataValue::try_from(header.as_str()).unwrap(),
    );
    request
        .metadata_mut()
        .insert("tracestate", MetadataValue::from_static("vendor=abc"));
    request
}

const PARENT: &str = "00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn every_decision_is_one_span_in_the_callers_trace() {
    let collector = Collector::default();
    let endpoint = collector.clone().start().await;
    let server = Server::start(&format!(
        "[telemetry]\notlp_endpoint = \"http://{endpoint}\"\n"
    ));
    let mut client = server.decider().await;

    let kinds = [
        ("retry", retryable("ledger")),
        (
            "deny",
            pb::DecideRequest {
                failure: 0,
                http_status: 404,
                ..retryable("ledger")
            },
        ),
        (
            "ambiguous",
            pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                evidence: pb::Evidence::NotSent as i32,
                failure: pb::FailureKind::GenericIo as i32,
                ..retryable("ledger")
            },
        ),
    ];
    // (trace id, verdict, decision id), unary then streamed.
    let mut expected = Vec::new();
    for (n, (verdict, request)) in kinds.iter().enumerate() {
        let trace_id = format!("{:032x}", 0xA000 + n);
        let response = client
            .decide(traced(request.clone(), &trace_id, PARENT))
            .await
            .unwrap()
            .into_inner();
        expected.push((trace_id, *verdict, response.decision_id));
    }
    for (n, (verdict, request)) in kinds.iter().enumerate() {
        let trace_id = format!("{:032x}", 0xB000 + n);
        let stream = tokio_stream::iter(vec![request.clone()]);
        let mut responses = client
            .decide_stream(traced(stream, &trace_id, PARENT))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        expected.push((trace_id, *verdict, response.decision_id));
    }

    for (trace_id, verdict, decision_id) in &expected {
        let spans = collector
            .wait_for(1, |span| hex(&span.trace_id) == *trace_id)
            .await;
        let span = &spans[0];
        assert_eq!(span.name, "retry.decide");
        assert_eq!(
            hex(&span.parent_span_id),
            PARENT,
            "the caller's span is the parent"
        );
        assert_eq!(span.trace_state, "vendor=abc");
        assert_eq!(text(span, "retry.verdict"), *verdict);
        assert_eq!(
            text(span, "retry.decision_id"),
            *decision_id,
            "the id returned is the span's"
        );
        assert_eq!(text(span, "retry.upstream"), "ledger");
        assert_eq!(text(span, "retry.operation"), "PUT /things/1");
        assert_eq!(text(span, "retry.store"), "memory");
        for key in [
            "retry.attempt",
            "retry.idempotency",
            "retry.evidence.effective",
            "retry.failure",
            "retry.rule",
            "retry.tokens_remaining",
        ]
        .iter()
        .chain(match *verdict {
            "retry" => &["retry.backoff_ms"][..],
            "deny" => &["retry.deny_reason", "http.response.status_code"][..],
            _ => &["retry.evidence.claimed"][..],
        })
        .filter(|key| !(*verdict == "deny" && **key == "retry.failure"))
        {
            assert!(
                attribute(span, key).is_some(),
                "{verdict}: missing {key} in {span:?}"
            );
        }
    }

    // Without a trace context, a decision starts its own trace.
    let response = client
        .decide(retryable("rootless"))
        .await
        .unwrap()
        .into_inner();
    let spans = collector
        .wait_for(1, |span| {
            matches!(attribute(span, "retry.decision_id"), Some(Value::StringValue(id)) if *id == response.decision_id)
        })
        .await;
    assert_eq!(spans.len(), 1);
    assert!(spans[0].parent_span_id.is_empty());
    // Spans leave in the order they were made, so once this later one has
    // arrived, a second span for any decision above would have too: each
    // decision made exactly one. (Counted right after the first arrival,
    // as before, a duplicate in a later batch could never fail the test.)
    for (trace_id, _, _) in &expected {
        let spans = collector.received(|span| hex(&span.trace_id) == *trace_id);
        assert_eq!(spans.len(), 1, "exactly one span for trace {trace_id}");
    }

    // Traffic reports and the kill switch are spans too; the switch says who
    // and why.
    let trace_id = format!("{:032x}", 0xC000);
    let mut admin = server.admin().await;
    admin
        .set_retries_enabled(traced(
            pb::SetRetriesEnabledRequest {
                upstream: "ledger".into(),
                enabled: false,
                reason: "INC-7".into(),
            },
            &trace_id,
            PARENT,
        ))
        .await
        .unwrap();
    let spans = collector
        .wait_for(1, |span| hex(&span.trace_id) == trace_id)
        .await;
    assert_eq!(spans[0].name, "retry.admin.set_retries_enabled");
    assert_eq!(text(&spans[0], "retry.admin.reason"), "INC-7");
    assert!(text(&spans[0], "retry.admin.peer").starts_with("127.0.0.1:"));
    let trace_id = format!("{:032x}", 0xD000);
    client
        .report_traffic(traced(
            pb::ReportTrafficRequest {
                traffic: vec![pb::UpstreamTraffic {
                    upstream: "ledger".into(),
                    requests: 7,
                    ..Default::default()
                }],
                ..Default::default()
            },
            &trace_id,
            PARENT,
        ))
        .await
        .unwrap();
    let spans = collector
        .wait_for(1, |span| hex(&span.trace_id) == trace_id)
        .await;
    assert_eq!(spans[0].name, "retry.report_traffic");
}

/// Sends `n` sequential decisions, each with a trace context, each
/// answered within the hang guard (one held by an exporter would wait an
/// hour). Returns how long they took.
async fn decide_sequentially(client: &mut RetryDeciderClient<Channel>, n: usize) -> Duration {
    let started = Instant::now();
    for i in 0..n {
        let trace_id = format!("{:032x}", 0xE0000 + i);
        let response = tokio::time::timeout(
            support::HANG_GUARD,
            client.decide(traced(retryable("timed"), &trace_id, PARENT)),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "decision {i} waited {:?}: for the exporter?",
                support::HANG_GUARD
            )
        })
        .unwrap();
        assert_ne!(response.into_inner().verdict(), pb::Verdict::Unspecified);
    }
    started.elapsed()
}

/// A black-box test cannot pause the server's clock, so this one claims no
/// latency (a wall-time ratio against a server without an exporter was a
/// ceiling a loaded machine could break). It shows instead that decisions
/// never wait for an export: 3000 of them are answered while the stalled
/// collector holds an export it never answers, which an exporter on the
/// decision path would make each of them wait for (an hour: the testkit's
/// hang guard, on each decision, fails the test first), and the full queue
/// drops, counts and warns about spans rather than holding their
/// decisions. The times are printed.
#[tokio::test]
async fn a_stalled_or_absent_collector_never_slows_decisions() {
    let stalled = Collector {
        stalled: true,
        ..Collector::default()
    };
    let stalled_exports = Arc::clone(&stalled.exports);
    let stalled = stalled.start().await;
    // A port with nothing listening: bind, note, close.
    let absent = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // A small export queue, so that the stalled exporter fills it and the
    // drop path is exercised.
    let config = "[defaults]\nbudget = { capacity = 1000000.0, initial = 1000000.0 }\n[telemetry]\nexport_queue = 64\n";
    let with_stalled = Server::start(&format!("{config}otlp_endpoint = \"http://{stalled}\"\n"));
    let with_absent = Server::start(&format!("{config}otlp_endpoint = \"http://{absent}\"\n"));
    let mut clients = [with_stalled.decider().await, with_absent.decider().await];

    // The stalled collector holds an export before the measured decisions.
    decide_sequentially(&mut clients[0], 1).await;
    support::eventually("an export reaches the stalled collector", || {
        (stalled_exports.load(Ordering::SeqCst) > 0).then_some(())
    })
    .await;

    let mut totals = [Duration::ZERO; 2];
    for _ in 0..20 {
        for (client, total) in clients.iter_mut().zip(&mut totals) {
            *total += decide_sequentially(client, 150).await;
        }
    }
    let [stalled_time, absent_time] = totals;
    eprintln!("3000 decisions each: stalled collector {stalled_time:?}, absent {absent_time:?}");

    let scrape = with_stalled.scrape();
    let dropped = metric(&scrape, "retryd_spans_dropped_total");
    assert!(dropped > 0.0, "a full queue drops and counts:\n{scrape}");
    support::eventually("and warns", || {
        with_stalled
            .logs()
            .contains("the span export queue is full")
            .then_some(())
    })
    .await;
    // An export to the absent port fails only once its attempt gives up.
    support::eventually("failed exports are counted", || {
        (metric(&with_absent.scrape(), "retryd_spans_export_failed_total") > 0.0).then_some(())
    })
    .await;
    support::eventually("and logged", || {
        with_absent
            .logs()
            .contains("span export failed")
            .then_some(())
    })
    .await;
}

fn metric(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{scrape}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn metrics_count_exactly_what_happened() {
    let server = Server::start("[upstreams.pay]\nmax_attempts = 3\n");
    let mut client = server.decider().await;
    for _ in 0..3 {
        client.decide(retryable("pay")).await.unwrap();
    }
    for _ in 0..2 {
        client
            .decide(pb::DecideRequest {
                failure: 0,
                http_status: 404,
                ..retryable("pay")
            })
            .await
            .unwrap();
    }
    client
        .decide(pb::DecideRequest {
            idempotency: pb::Idempotency::NonIdempotent as i32,
            failure: pb::FailureKind::ConnectionReset as i32,
            ..retryable("elsewhere")
        })
        .await
        .unwrap();
    client
        .decide(pb::DecideRequest {
            attempt: 3,
            ..retryable("elsewhere")
        })
        .await
        .unwrap();
    // Invalid requests are not decisions.
    client
        .decide(pb::DecideRequest {
            attempt: 0,
            ..retryable("pay")
        })
        .await
        .unwrap_err();
    client
        .report_traffic(pb::ReportTrafficRequest {
            // 4 of 10 first attempts succeeded: the adaptive budget funds
            // 1 − (10 − 8) / 11 = 9/11 of the 10 requests, 8.
            traffic: vec![pb::UpstreamTraffic {
                upstream: "pay".into(),
                requests: 10,
                successes: 4,
                failures: 6,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap();

    let scrape = server.scrape();
    let expected = [
        (
            "retryd_decisions_total{upstream=\"pay\",verdict=\"retry\",reason=\"\"}",
            3.0,
        ),
        (
            "retryd_decisions_total{upstream=\"pay\",verdict=\"deny\",reason=\"status_not_retryable\"}",
            2.0,
        ),
        (
            "retryd_decisions_total{upstream=\"_other\",verdict=\"ambiguous\",reason=\"\"}",
            1.0,
        ),
        (
            "retryd_decisions_total{upstream=\"_other\",verdict=\"deny\",reason=\"max_attempts\"}",
            1.0,
        ),
        ("retryd_decision_duration_seconds_count", 7.0),
        ("retryd_reported_requests_total", 10.0),
        ("retryd_funded_requests_total", 8.0),
        (
            "retryd_upstream_reported_requests_total{upstream=\"pay\"}",
            10.0,
        ),
        (
            "retryd_upstream_funded_requests_total{upstream=\"pay\"}",
            8.0,
        ),
        ("retryd_budget_withdrawals_total", 3.0),
        ("retryd_tracked_upstreams", 1.0),
        ("retryd_store_errors_total{op=\"view\"}", 0.0),
        ("retryd_spans_dropped_total", 0.0),
    ];
    for (series, value) in expected {
        assert_eq!(metric(&scrape, series), value, "{series}\n{scrape}");
    }
    let decision_lines = scrape
        .lines()
        .filter(|l| l.starts_with("retryd_decisions_total{"))
        .count();
    assert_eq!(decision_lines, 4, "no other outcome was counted:\n{scrape}");
    let tokens = metric(&scrape, "retryd_budget_tokens{upstream=\"pay\"}");
    assert!((97.0..=100.0).contains(&tokens), "{tokens}");
}

#[tokio::test]
async fn decision_log_lines_carry_trace_and_decision_ids() {
    let server = Server::start(
        "[telemetry]\nlog_format = \"json\"\nlog_level = \"info,retryd::decision=debug\"\n",
    );
    let mut client = server.decider().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let response = client
        .decide(traced(retryable("logged"), trace_id, PARENT))
        .await
        .unwrap()
        .into_inner();
    let line = support::eventually("the decision's log line", || {
        server
            .logs()
            .lines()
            .find(|line| line.contains(&response.decision_id))
            .map(str::to_owned)
    })
    .await;
    let json: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    assert_eq!(json["trace_id"], trace_id);
    assert_eq!(json["verdict"], "retry");
    assert_eq!(json["upstream"], "logged");
}

fn with_key<T>(mut request: tonic::Request<T>, key: &str) -> tonic::Request<T> {
    request.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {key}").as_str()).unwrap(),
    );
    request
}

fn int(span: &Span, key: &str) -> i64 {
    match attribute(span, key) {
        Some(Value::IntValue(value)) => *value,
        other => panic!("{key}: {other:?} in {span:?}"),
    }
}

/// Admin calls, refused attempts included, are audited whatever the
/// caller's sampling flag or the sampling ratio; every span names the
/// principal; refusals are logged, throttled.
#[tokio::test]
async fn admin_calls_are_always_audited_and_spans_name_the_principal() {
    const OPS_KEY: &str = "ops-key-0123456789abcdef";
    const CHECKOUT_KEY: &str = "checkout-key-0123456789";
    let sha = |key: &str| hex(&retryd::auth::hash_key(key));
    let collector = Collector::default();
    let endpoint = collector.clone().start().await;
    let server = Server::start(&format!(
        r#"[telemetry]
otlp_endpoint = "http://{endpoint}"
sampling_ratio = 0.0
log_format = "json"

[[auth.principals]]
name = "ops"
api_keys_sha256 = ["{}"]
upstreams = ["*"]
admin = true

[[auth.principals]]
name = "checkout"
api_keys_sha256 = ["{}"]
upstreams = ["payments-*"]
"#,
        sha(OPS_KEY),
        sha(CHECKOUT_KEY)
    ));
    let channel = server.channel().await;
    let mut admin = retryd_proto::retry_admin_client::RetryAdminClient::new(channel.clone());
    let mut decider = RetryDeciderClient::new(channel);
    let kill = |reason: &str| pb::SetRetriesEnabledRequest {
        upstream: "ledger".into(),
        enabled: false,
        reason: reason.into(),
    };
    let unsampled = |message, trace_id: &str| {
        let mut request = tonic::Request::new(message);
        let header = format!("00-{trace_id}-{PARENT}-00");
        request.metadata_mut().insert(
            "traceparent",
            MetadataValue::try_from(header.as_str()).unwrap(),
        );
        request
    };

    // An admin asking not to be sampled, and one with no trace at all
    // under a sampling ratio of 0: both recorded.
    let quiet_trace = "11111111111111111111111111111111";
    admin
        .set_retries_enabled(with_key(unsampled(kill("unsampled"), quiet_trace), OPS_KEY))
        .await
        .unwrap();
    admin
        .set_retries_enabled(with_key(tonic::Request::new(kill("root")), OPS_KEY))
        .await
        .unwrap();
    // Refused: a principal without the admin role, and a wrong key, both
    // unsampled.
    let refused_trace = "22222222222222222222222222222222";
    let status = admin
        .set_retries_enabled(with_key(
            unsampled(kill("not admin"), refused_trace),
            CHECKOUT_KEY,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    let status = admin
        .set_retries_enabled(with_key(
            unsampled(kill("wrong key"), refused_trace),
            "not-a-key-at-all-000",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let admin_spans = collector
        .wait_for(4, |span| span.name == "retry.admin.set_retries_enabled")
        .await;
    assert_eq!(admin_spans.len(), 4, "{admin_spans:?}");
    let in_trace = |trace: &str| {
        admin_spans
            .iter()
            .filter(|span| hex(&span.trace_id) == trace)
            .collect::<Vec<_>>()
    };
    let quiet = in_trace(quiet_trace);
    assert_eq!(quiet.len(), 1);
    assert_eq!(text(quiet[0], "retry.admin.principal"), "ops");
    assert_eq!(hex(&quiet[0].parent_span_id), PARENT);
    let refused = in_trace(refused_trace);
    assert_eq!(refused.len(), 2);
    for span in &refused {
        assert!(
            text(span, "retry.admin.peer").starts_with("127.0.0.1:"),
            "{span:?}"
        );
    }
    let codes: Vec<i64> = refused
        .iter()
        .map(|span| int(span, "rpc.grpc.status_code"))
        .collect();
    assert!(
        codes.contains(&(tonic::Code::PermissionDenied as i64)),
        "{codes:?}"
    );
    assert!(
        codes.contains(&(tonic::Code::Unauthenticated as i64)),
        "{codes:?}"
    );
    let not_admin = refused
        .iter()
        .find(|span| int(span, "rpc.grpc.status_code") == tonic::Code::PermissionDenied as i64)
        .unwrap();
    assert_eq!(text(not_admin, "retry.admin.principal"), "checkout");

    // Decide and ReportTraffic spans (sampled by their caller) name the
    // principal.
    let trace_id = "33333333333333333333333333333333";
    decider
        .decide(with_key(
            traced(retryable("payments-api"), trace_id, PARENT),
            CHECKOUT_KEY,
        ))
        .await
        .unwrap();
    let report = pb::ReportTrafficRequest {
        traffic: vec![pb::UpstreamTraffic {
            upstream: "payments-api".into(),
            requests: 10,
            ..Default::default()
        }],
        ..Default::default()
    };
    decider
        .report_traffic(with_key(traced(report, trace_id, PARENT), CHECKOUT_KEY))
        .await
        .unwrap();
    let spans = collector
        .wait_for(2, |span| hex(&span.trace_id) == trace_id)
        .await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    for span in &spans {
        assert_eq!(text(span, "retry.principal"), "checkout", "{span:?}");
    }

    // Refusals are logged for audit, naming the call, the peer and (when
    // known) the principal; a flood of them is throttled.
    let flood_started = Instant::now();
    for _ in 0..50 {
        let status = decider
            .decide(with_key(
                tonic::Request::new(retryable("ledger")),
                CHECKOUT_KEY,
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
    }
    let flood_seconds = flood_started.elapsed().as_secs_f64();
    // The log is written as the refusals happen: wait for the flood's
    // first line to be on stderr rather than for a fixed time.
    let logs = support::eventually("the flood's refusals are logged", || {
        let logs = server.logs();
        logs.contains("/retryd.v1.RetryDecider/Decide")
            .then_some(logs)
    })
    .await;
    let refusals: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| line["message"] == "call refused")
        .collect();
    assert!(
        refusals.iter().any(
            |line| line["rpc"] == "/retryd.v1.RetryAdmin/SetRetriesEnabled"
                && line["code"] == "Unauthenticated"
                && line["peer"]
                    .as_str()
                    .is_some_and(|peer| peer.contains("127.0.0.1"))
        ),
        "{logs}"
    );
    // The kill switch's own audit line names its peer plainly too.
    let switched = logs
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|line| line["message"] == "retries switched off for upstream")
        .expect("the kill switch is logged");
    assert!(
        switched["peer"]
            .as_str()
            .is_some_and(|peer| peer.starts_with("127.0.0.1:")),
        "{switched}"
    );
    let decide_refusals = refusals
        .iter()
        .filter(|line| line["rpc"] == "/retryd.v1.RetryDecider/Decide")
        .count();
    // A burst of ten lines, then at most one per second of flood (and one
    // for a second boundary).
    assert!(
        decide_refusals as f64 <= 10.0 + flood_seconds + 1.0,
        "{decide_refusals} lines for 50 refusals in {flood_seconds:.1} s:\n{logs}"
    );
}

/// A gRPC decision's span describes the failed attempt in OpenTelemetry's
/// terms (`rpc.grpc.status_code`) with the raw pushback beside it, and the
/// new deny reason is a metric label.
#[tokio::test]
async fn grpc_outcomes_on_spans_and_metrics() {
    let collector = Collector::default();
    let endpoint = collector.clone().start().await;
    let server = Server::start(&format!(
        "[telemetry]\notlp_endpoint = \"http://{endpoint}\"\n[upstreams.\"stock\"]\n"
    ));
    let mut client = server.decider().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    // Two upstreams: a negative pushback stops its upstream's retries
    // fleet-wide for `pushback_stop_window`.
    let grpc = |upstream: &str, code: i32, pushback: Option<&str>| pb::DecideRequest {
        failure: 0,
        evidence: pb::Evidence::ResponseReceived as i32,
        grpc_status_code: code as u32,
        grpc_retry_pushback_ms: pushback.map(str::to_owned),
        ..retryable(upstream)
    };
    let denied = client
        .decide(traced(
            grpc("stock", tonic::Code::Unavailable as i32, Some("-1")),
            trace_id,
            PARENT,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        denied.deny_reason(),
        pb::DenyReason::ServerPushback,
        "{denied:?}"
    );
    let granted = client
        .decide(traced(
            grpc(
                "stock-paced",
                tonic::Code::ResourceExhausted as i32,
                Some("300"),
            ),
            trace_id,
            PARENT,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(granted.verdict(), pb::Verdict::Retry, "{granted:?}");
    assert_eq!(support::millis(granted.backoff), 300);

    let spans = collector
        .wait_for(2, |span| span.name == "retry.decide")
        .await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    let by_id = |id: &str| {
        spans
            .iter()
            .find(|span| text(span, "retry.decision_id") == id)
            .unwrap_or_else(|| panic!("no span for {id}"))
    };
    let span = by_id(&denied.decision_id);
    assert_eq!(int(span, "rpc.grpc.status_code"), 14);
    assert_eq!(text(span, "retry.grpc.pushback_ms"), "-1");
    assert_eq!(text(span, "retry.deny_reason"), "server_pushback");
    assert!(attribute(span, "http.response.status_code").is_none());
    let span = by_id(&granted.decision_id);
    assert_eq!(int(span, "rpc.grpc.status_code"), 8);
    assert_eq!(text(span, "retry.grpc.pushback_ms"), "300");

    let scrape = server.scrape();
    assert_eq!(
        metric(
            &scrape,
            "retryd_decisions_total{upstream=\"stock\",verdict=\"deny\",reason=\"server_pushback\"}"
        ),
        1.0
    );
}
