//! The client itself against a real retryd: the API key and mTLS, the
//! traffic reporter's batches and re-sends, one warning per outage with its
//! counts, and shadow answers followed by the local rule.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use retryd_client::engine::{DenyReason, Verdict};
use retryd_client::{Client, Error, Source, pb};

/// A request retryd answers RETRY at its defaults (a refused connection).
fn refused(upstream: &str, attempt: u32) -> pb::DecideRequest {
    pb::DecideRequest {
        upstream: upstream.into(),
        operation: "PUT /things/1".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt,
        failure: pb::FailureKind::Connect as i32,
        ..Default::default()
    }
}

/// `retryd hash-key` of `key`, so that the suite never imports the server.
fn hash_key(key: &str) -> String {
    let mut child = Command::new(retryd_testkit::binary())
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("retryd hash-key");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(key.as_bytes())
        .expect("write key");
    let output = child.wait_with_output().expect("hash-key output");
    assert!(output.status.success());
    String::from_utf8(output.stdout)
        .expect("hex")
        .trim()
        .to_owned()
}

const KEY: &str = "checkout-key-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_travels_as_a_bearer_token() {
    let retryd = support::Retryd::start(&format!(
        "{}\n[[auth.principals]]\nname = \"checkout\"\napi_keys_sha256 = [\"{}\"]\nupstreams = [\"*\"]\n",
        support::RETRYD_CONFIG,
        hash_key(KEY)
    ));
    let with_key = Client::builder(format!("http://{}", retryd.grpc))
        .api_key(KEY)
        .no_fallback()
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let decision = with_key
        .decide(&refused("payments", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Retryd);
    assert!(!decision.decision_id.is_empty());

    let without = Client::builder(format!("http://{}", retryd.grpc))
        .no_fallback()
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    match without.decide(&refused("payments", 1)).await {
        Err(Error::Unavailable(status)) => assert_eq!(status.code(), tonic::Code::Unauthenticated),
        other => panic!("{other:?}"),
    }
    let spaced = Client::builder(format!("http://{}", retryd.grpc))
        .api_key("has a space")
        .connect()
        .await;
    assert!(matches!(spaced, Err(Error::InvalidConfig(_))), "{spaced:?}");
}

struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "retryd-client test CA");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let ca = Issuer::new(ca_params, ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![name.to_owned()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("leaf");
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca: ca_cert.pem(),
        server: leaf("localhost"),
        client: leaf("checkout.example"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_the_client_certificate_is_the_credential() {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let pki = pki();
    let dir = tempfile::tempdir().expect("dir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.display().to_string()
    };
    let retryd = support::Retryd::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"\nclient_auth = \"required\"\n[[auth.principals]]\nname = \"checkout\"\nidentities = [\"checkout.example\"]\nupstreams = [\"*\"]\n",
        write("server.pem", &pki.server.0),
        write("server.key", &pki.server.1),
        write("ca.pem", &pki.ca),
    ));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca))
        .domain_name("localhost");
    let client = Client::builder(format!("https://{}", retryd.grpc))
        .tls(
            tls.clone()
                .identity(Identity::from_pem(&pki.client.0, &pki.client.1)),
        )
        .no_fallback()
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let decision = client
        .decide(&refused("payments", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Retryd);

    // Without a certificate the handshake is refused: the fallback decides.
    let anonymous = Client::builder(format!("https://{}", retryd.grpc))
        .tls(tls)
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let decision = anonymous
        .decide(&refused("payments", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Fallback);
}

/// Warnings logged through `tracing`, collected.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn lines(&self) -> Vec<String> {
        let bytes = self.0.lock().expect("logs").clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One warning when retryd stops answering and one when it is back, with
/// the counts of what happened meanwhile; the traffic batch retryd did not
/// take is kept with its id and re-sent once retryd is back.
#[tokio::test(flavor = "current_thread")]
async fn one_warning_per_outage_and_the_unsent_batch_is_re_sent() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // The test runs on one thread: the guard covers every task.
    let _guard = tracing::subscriber::set_default(subscriber);

    let port = support::refused_addr().await.port();
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .connect_timeout(Duration::from_millis(200))
        .disable_reporting()
        .connect()
        .await
        .expect("built while retryd is down");
    for _ in 0..5 {
        let decision = client
            .decide(&refused("catalog", 1))
            .await
            .expect("decided");
        assert_eq!(decision.source, Source::Fallback);
    }
    client.reporter().record("filled", 40);
    assert!(client.reporter().flush().await.is_err(), "retryd is down");
    assert_eq!(client.reporter().pending().await.get("filled"), Some(&40));
    let outage = client.outage();
    assert_eq!(
        (outage.outages, outage.decisions, outage.reports),
        (1, 5, 1)
    );
    let unreachable: Vec<String> = logs
        .lines()
        .into_iter()
        .filter(|line| line.contains("unreachable ("))
        .collect();
    assert_eq!(unreachable.len(), 1, "{unreachable:?}");

    // retryd comes up on that port.
    let retryd = support::Retryd::start(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:0\"\n{}",
        support::RETRYD_CONFIG
    ));
    let before = client.get_budget("filled").await.expect("budget").tokens;
    client.reporter().flush().await.expect("taken now");
    assert!(client.reporter().pending().await.is_empty());
    let after = client.get_budget("filled").await.expect("budget").tokens;
    // 40 first attempts at ratio 0.1: four tokens.
    assert!((after - before - 4.0).abs() < 1e-6, "{before} -> {after}");
    let back: Vec<String> = logs
        .lines()
        .into_iter()
        .filter(|line| line.contains("answering again"))
        .collect();
    assert_eq!(back.len(), 1, "{back:?}");
    assert!(
        back[0].contains("5 decision(s)") && back[0].contains("1 traffic batch(es)"),
        "{back:?}"
    );
    assert!(!client.outage().unreachable);
    drop(retryd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_id_is_applied_once_however_often_it_is_sent() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    let report = pb::ReportTrafficRequest {
        traffic: vec![pb::UpstreamTraffic {
            upstream: "catalog".into(),
            requests: 30,
            ..Default::default()
        }],
        report_id: retryd_client::new_report_id(),
    };
    assert_eq!(report.report_id.len(), 36);
    let first = client.report_traffic(report.clone()).await.expect("first");
    assert_eq!((first.accepted, first.already_applied), (1, 0));
    let again = client.report_traffic(report).await.expect("again");
    assert_eq!((again.accepted, again.already_applied), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_reporter_sends_first_attempts() {
    let retryd = support::retryd();
    let client = Client::builder(format!("http://{}", retryd.grpc))
        .reporter(retryd_client::ReporterOptions {
            interval: Duration::from_millis(50),
            ..Default::default()
        })
        .connect()
        .await
        .expect("client");
    let before = client.get_budget("filled").await.expect("budget").tokens;
    client.reporter().record("filled", 100);
    retryd_testkit::eventually("the batch taken", || {
        futures::executor::block_on(client.reporter().pending())
            .is_empty()
            .then_some(())
    })
    .await;
    let after = client.get_budget("filled").await.expect("budget").tokens;
    assert!((after - before - 10.0).abs() < 1e-6, "{before} -> {after}");
    client.close(Duration::from_secs(5)).await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_answer_is_followed_by_the_local_rule() {
    let retryd = support::retryd();
    let client = support::client(&retryd).await;
    // retryd allows 3 attempts; the local rule 2: attempt 2 differs.
    let decision = client
        .decide(&refused("shadowed", 2))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Shadow);
    assert_eq!(decision.verdict, Verdict::Deny(DenyReason::MaxAttempts));
    let retryd_answer = decision.retryd.as_ref().expect("retryd's answer beside it");
    assert!(retryd_answer.should_retry());
    assert_eq!(decision.decision_id, retryd_answer.decision_id);
    assert_eq!(client.shadow_divergences().get("shadowed"), Some(&1));

    // Where they agree nothing is counted; an enforced upstream is retryd's.
    let decision = client
        .decide(&refused("shadowed", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Shadow);
    assert!(decision.should_retry());
    assert_eq!(client.shadow_divergences().get("shadowed"), Some(&1));
    let decision = client
        .decide(&refused("enforced", 2))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Retryd);
    assert!(decision.should_retry());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_request_is_never_hidden_by_the_fallback() {
    let port = support::refused_addr().await.port();
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .connect_timeout(Duration::from_millis(100))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    match client.decide(&refused("", 1)).await {
        Err(Error::InvalidRequest(invalid)) => assert_eq!(invalid.field, "upstream"),
        other => panic!("{other:?}"),
    }
    assert_eq!(client.outage().outages, 0, "a bug, not an outage");
}

/// The variable that makes `first_decision_in_a_fresh_process` do its work
/// (the address of retryd); without it that test returns at once.
const FIRST_DECISION: &str = "RETRYD_CLIENT_FIRST_DECISION";

/// The child half of `the_first_decision_is_retryds_from_process_start`: a
/// fresh process builds a client at its defaults and makes one decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_decision_in_a_fresh_process() {
    let Ok(addr) = std::env::var(FIRST_DECISION) else {
        return;
    };
    let client = Client::builder(format!("http://{addr}"))
        .connect()
        .await
        .expect("client");
    let decision = client.decide(&refused("first", 1)).await.expect("decided");
    println!("FIRST-DECISION source={:?}", decision.source);
}

/// The client connects when it is built, so that the first decision of a
/// new process is retryd's and not the fallback's (at the default 200 ms
/// timeout). The time from spawning the process to its answer is printed,
/// not asserted: it is the README's figure, not a promise under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_decision_is_retryds_from_process_start() {
    let retryd = support::retryd();
    let addr = retryd.grpc.to_string();
    let (elapsed, output) = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let output = Command::new(std::env::current_exe().expect("own path"))
            .args([
                "--exact",
                "first_decision_in_a_fresh_process",
                "--nocapture",
            ])
            .env(FIRST_DECISION, addr)
            .output()
            .expect("run the child");
        (started.elapsed(), output)
    })
    .await
    .expect("child");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("FIRST-DECISION source=Retryd"), "{stdout}");
    eprintln!("process start to the first decision: {elapsed:?}");
}

/// A stand-in for retryd that never answers a decision and fails the first
/// `failing` traffic reports with UNAVAILABLE, recording what it was sent.
#[derive(Clone, Default)]
struct Recorder {
    timeouts: Arc<Mutex<Vec<String>>>,
    reports: Arc<Mutex<Vec<pb::ReportTrafficRequest>>>,
    failing: Arc<std::sync::atomic::AtomicU32>,
}

#[tonic::async_trait]
impl pb::retry_decider_server::RetryDecider for Recorder {
    async fn decide(
        &self,
        request: tonic::Request<pb::DecideRequest>,
    ) -> Result<tonic::Response<pb::DecideResponse>, tonic::Status> {
        let timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("none")
            .to_owned();
        self.timeouts.lock().expect("timeouts").push(timeout);
        std::future::pending().await
    }

    type DecideStreamStream =
        futures::stream::BoxStream<'static, Result<pb::DecideResponse, tonic::Status>>;

    async fn decide_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::DecideRequest>>,
    ) -> Result<tonic::Response<Self::DecideStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not here"))
    }

    async fn report_traffic(
        &self,
        request: tonic::Request<pb::ReportTrafficRequest>,
    ) -> Result<tonic::Response<pb::ReportTrafficResponse>, tonic::Status> {
        use std::sync::atomic::Ordering;
        let report = request.into_inner();
        let entries = report.traffic.len() as u32;
        self.reports.lock().expect("reports").push(report);
        let failing = self.failing.load(Ordering::SeqCst);
        if failing > 0 {
            self.failing.store(failing - 1, Ordering::SeqCst);
            return Err(tonic::Status::unavailable("not now"));
        }
        Ok(tonic::Response::new(pb::ReportTrafficResponse {
            accepted: entries,
            already_applied: 0,
            ..Default::default()
        }))
    }
}

async fn recorder(failing: u32) -> (std::net::SocketAddr, Recorder) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let recorder = Recorder::default();
    recorder
        .failing
        .store(failing, std::sync::atomic::Ordering::SeqCst);
    let service = pb::retry_decider_server::RetryDeciderServer::new(recorder.clone());
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    (addr, recorder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_is_bounded_by_the_callers_deadline_with_a_floor() {
    let (addr, recorder) = recorder(0).await;
    let client = Client::builder(format!("http://{addr}"))
        .timeout(Duration::from_secs(30))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let with_deadline = |remaining: Duration| pb::DecideRequest {
        deadline_remaining: Some(retryd_client::pb_duration(remaining)),
        ..refused("catalog", 1)
    };
    // 120 ms left: the call may take 120 ms, not the client's 30 s, and
    // the local rule decides when retryd does not answer in it.
    let decision = client
        .decide(&with_deadline(Duration::from_millis(120)))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Fallback);
    // 10 ms left: still 50 ms, so that retryd can answer DENY DEADLINE.
    let decision = client
        .decide(&with_deadline(Duration::from_millis(10)))
        .await
        .expect("decided");
    assert_eq!(decision.deny_reason(), Some(DenyReason::Deadline));
    // What retryd was told, as grpc-timeout.
    let timeouts = recorder.timeouts.lock().expect("timeouts").clone();
    let millis = |raw: &str| -> u64 {
        let (digits, unit) = raw.split_at(raw.len() - 1);
        let value: u64 = digits.parse().expect("digits");
        match unit {
            "m" => value,
            "u" => value / 1000,
            "n" => value / 1_000_000,
            "S" => value * 1000,
            other => panic!("unit {other}"),
        }
    };
    assert_eq!(timeouts.len(), 2, "{timeouts:?}");
    assert!(millis(&timeouts[0]) <= 120, "{timeouts:?}");
    assert!(
        millis(&timeouts[1]) <= 50 && millis(&timeouts[1]) > 10,
        "{timeouts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_not_taken_is_re_sent_with_its_id_and_entries() {
    let (addr, recorder) = recorder(2).await;
    let client = Client::builder(format!("http://{addr}"))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let reporter = client.reporter();
    reporter.record("b-upstream", 3);
    reporter.record("a-upstream", 2);
    assert!(reporter.flush().await.is_err());
    // Recorded meanwhile: waits for the next batch, never joins the old one.
    reporter.record("a-upstream", 5);
    assert!(reporter.flush().await.is_err());
    reporter.flush().await.expect("taken at the third try");
    let reports = recorder.reports.lock().expect("reports").clone();
    assert_eq!(reports.len(), 4, "{reports:?}");
    let entries = |report: &pb::ReportTrafficRequest| -> Vec<(String, u64)> {
        report
            .traffic
            .iter()
            .map(|entry| (entry.upstream.clone(), entry.requests))
            .collect()
    };
    for resent in &reports[..3] {
        assert_eq!(resent.report_id, reports[0].report_id);
        assert_eq!(
            entries(resent),
            [("a-upstream".to_owned(), 2), ("b-upstream".to_owned(), 3)]
        );
    }
    assert_ne!(reports[3].report_id, reports[0].report_id);
    assert_eq!(entries(&reports[3]), [("a-upstream".to_owned(), 5)]);
    assert!(reporter.pending().await.is_empty());
    assert_eq!(reporter.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_falls_back_and_is_reopened_when_retryd_is_back() {
    let port = support::refused_addr().await.port();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:0\"\nshutdown_grace = \"1s\"\n{}",
        support::RETRYD_CONFIG
    );
    let mut retryd = support::Retryd::start(&config);
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .disable_reporting()
        .connect()
        .await
        .expect("client");
    let stream = client.decide_stream();
    let decision = stream
        .decide(&refused("catalog", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Retryd);

    retryd.terminate(retryd_testkit::HANG_GUARD);
    drop(retryd);
    let decision = stream
        .decide(&refused("catalog", 1))
        .await
        .expect("decided");
    assert_eq!(decision.source, Source::Fallback);
    assert!(client.outage().unreachable);

    let _retryd = support::Retryd::start(&config);
    let decision = retryd_testkit::eventually("the stream reopened", || {
        let decision =
            futures::executor::block_on(stream.decide(&refused("catalog", 1))).expect("decided");
        (decision.source == Source::Retryd).then_some(decision)
    })
    .await;
    assert!(!decision.decision_id.is_empty());
    assert!(!client.outage().unreachable);
}
