//! Audit telemetry against the real binary: spans received by a real
//! OTLP/gRPC collector (built from the official OpenTelemetry protobuf
//! definitions) inside the test, exporter failures that never slow a
//! decision, exact Prometheus counters, and decision log lines.

mod support;

use std::net::SocketAddr;
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
use retryd::pb;
use retryd::pb::retry_decider_client::RetryDeciderClient;
use support::{Server, retryable};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// A collector that keeps every span it receives, or never answers.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    stalled: bool,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
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

    /// Waits until `count` spans satisfy `filter`, or 10 s.
    async fn wait_for(&self, count: usize, filter: impl Fn(&Span) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found: Vec<Span> = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|s| filter(s))
                .cloned()
                .collect();
            if found.len() >= count || Instant::now() > deadline {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
        assert_eq!(spans.len(), 1, "exactly one span for trace {trace_id}");
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
                }],
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

/// Sends `n` sequential decisions, each with a trace context.
async fn decide_sequentially(client: &mut RetryDeciderClient<Channel>, n: usize) -> Duration {
    let started = Instant::now();
    for i in 0..n {
        let trace_id = format!("{:032x}", 0xE0000 + i);
        let response = client
            .decide(traced(retryable("timed"), &trace_id, PARENT))
            .await
            .unwrap();
        assert_ne!(response.into_inner().verdict(), pb::Verdict::Unspecified);
    }
    started.elapsed()
}

#[tokio::test]
async fn a_stalled_or_absent_collector_never_slows_decisions() {
    let stalled = Collector {
        stalled: true,
        ..Collector::default()
    }
    .start()
    .await;
    // A port with nothing listening: bind, note, close.
    let absent = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // A small export queue, so that the stalled exporter fills it and the
    // drop path is exercised.
    let config = "[defaults]\nbudget = { capacity = 1000000.0, initial = 1000000.0 }\n[telemetry]\nexport_queue = 64\n";
    let baseline = Server::start(config);
    let with_stalled = Server::start(&format!("{config}otlp_endpoint = \"http://{stalled}\"\n"));
    let with_absent = Server::start(&format!("{config}otlp_endpoint = \"http://{absent}\"\n"));
    let mut clients = [
        baseline.decider().await,
        with_stalled.decider().await,
        with_absent.decider().await,
    ];

    // Rounds interleave the three servers, so that the machine's noise
    // falls on all of them alike.
    let mut totals = [Duration::ZERO; 3];
    for _ in 0..20 {
        for (client, total) in clients.iter_mut().zip(&mut totals) {
            *total += decide_sequentially(client, 150).await;
        }
    }
    let [base, stalled_time, absent_time] = totals;
    eprintln!(
        "3000 decisions each: no exporter {base:?}, stalled {stalled_time:?}, absent {absent_time:?}"
    );
    // Generous: a blocking exporter would take an hour per stalled export.
    let limit = base * 2 + Duration::from_secs(1);
    assert!(
        stalled_time < limit,
        "stalled collector: {stalled_time:?} vs {base:?}"
    );
    assert!(
        absent_time < limit,
        "absent collector: {absent_time:?} vs {base:?}"
    );

    let scrape = with_stalled.scrape();
    let dropped = metric(&scrape, "retryd_spans_dropped_total");
    assert!(dropped > 0.0, "a full queue drops and counts:\n{scrape}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let failed = metric(&with_absent.scrape(), "retryd_spans_export_failed_total");
    assert!(failed > 0.0, "failed exports are counted");
    assert!(
        with_absent.logs().contains("span export failed"),
        "and logged"
    );
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
            traffic: vec![pb::UpstreamTraffic {
                upstream: "pay".into(),
                requests: 10,
            }],
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
    tokio::time::sleep(Duration::from_millis(200)).await;
    let logs = server.logs();
    let line = logs
        .lines()
        .find(|line| line.contains(&response.decision_id))
        .unwrap_or_else(|| panic!("no log line for the decision:\n{logs}"));
    let json: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert_eq!(json["trace_id"], trace_id);
    assert_eq!(json["verdict"], "retry");
    assert_eq!(json["upstream"], "logged");
}
