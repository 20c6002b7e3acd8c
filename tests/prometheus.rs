//! The dashboard and the alerts against a real Prometheus (Debian's
//! `prometheus`, started here on a loopback port with its own data
//! directory) scraping a real retryd while the test drives decisions:
//! every panel query and every alert expression evaluates without error,
//! and returns the series the test caused; `promtool` checks the rules and
//! runs their unit tests; the scrape carries exemplars. Missing
//! `prometheus`/`promtool` fails the test (scripts/test installs them).

use retryd_testkit as support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use retryd_proto as pb;
use support::{Server, retryable};

/// How long a wait for Prometheus may take: its own start, then its 1 s
/// scrape and rule-evaluation intervals on a busy machine. Not a wait for
/// retryd (those use the testkit's `HANG_GUARD`), nor a latency claim: a
/// third party's pace: 90 s, three hang guards.
const PROMETHEUS_PACE: Duration = Duration::from_secs(90);

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn tool(name: &str) -> Command {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        found,
        "{name} is not installed (Debian: apt-get install prometheus)"
    );
    Command::new(name)
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() {
    let rules = deploy().join("prometheus");
    let check = tool("promtool")
        .args(["check", "rules", "retryd-rules.yaml"])
        .current_dir(&rules)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let test = tool("promtool")
        .args(["test", "rules", "retryd-rules.test.yaml"])
        .current_dir(&rules)
        .output()
        .unwrap();
    assert!(
        test.status.success(),
        "{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );
}

/// A Prometheus child, killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let rules = deploy().join("prometheus/retryd-rules.yaml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules:?}\nscrape_configs:\n  - job_name: retryd\n    static_configs:\n      - targets: [\"{target}\"]\n"
        );
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        // A free loopback port (the race with another process is harmless:
        // Prometheus would fail to start and the test say so).
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = tool("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--enable-feature=exemplar-storage")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Prometheus {
            child,
            addr,
            _dir: dir,
        }
    }

    /// GET `path` from the HTTP API: the body, if it answered.
    fn get(&self, path: &str) -> Option<serde_json::Value> {
        let mut stream = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (_, body) = response.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    }

    /// Evaluates `expr` now: the result vector (panics on an error).
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let answer = self
            .get(&format!("/api/v1/query?query={}", encode(expr)))
            .unwrap_or_else(|| panic!("no answer to {expr}"));
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits (up to [`PROMETHEUS_PACE`]) until `expr` returns a series.
    fn wait_for(&self, expr: &str) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + PROMETHEUS_PACE;
        loop {
            let answer = self.get(&format!("/api/v1/query?query={}", encode(expr)));
            if let Some(result) = answer.as_ref().and_then(|a| a["data"]["result"].as_array()) {
                if !result.is_empty() {
                    return result.clone();
                }
            }
            assert!(
                Instant::now() < deadline,
                "{expr} returned nothing: {answer:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy().join("prometheus/retryd-rules.yaml")).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let mut alerts = Vec::new();
    for group in docs[0]["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            if let Some(alert) = rule["alert"].as_str() {
                alerts.push((alert.to_owned(), rule["expr"].as_str().unwrap().to_owned()));
            }
        }
    }
    alerts
}

fn panels() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy().join("grafana/retryd-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push((
                panel["title"].as_str().unwrap().to_owned(),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    queries
}

#[tokio::test]
async fn every_panel_and_alert_evaluates_on_a_real_prometheus_scraping_retryd() {
    // Spans go to a port nobody listens on: sampled (so the latency
    // histogram gets exemplars), and lost (so the spans alert has a series).
    let server = Server::start(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:9\"\n\
         [upstreams.pay]\nmax_attempts = 10\n\
         budget = { capacity = 1000.0, initial = 1000.0 }\n\
         [upstreams.tiny]\nbudget = { capacity = 2.0, initial = 2.0, min_per_second = 0.0 }\n\
         [upstreams.ledger]\n\
         [upstreams.hedged.hedging]\n",
    );
    let mut decider = server.decider().await;
    let mut admin = server.admin().await;
    let drive = async |decider: &mut pb::retry_decider_client::RetryDeciderClient<_>| {
        decider
            .report_traffic(pb::ReportTrafficRequest {
                traffic: vec![
                    pb::UpstreamTraffic {
                        upstream: "pay".into(),
                        requests: 10,
                        ..Default::default()
                    },
                    // A caller's hedges that answered first (the won series).
                    pb::UpstreamTraffic {
                        upstream: "hedged".into(),
                        requests: 10,
                        hedges_won: 1,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            })
            .await
            .unwrap();
        for _ in 0..5 {
            decider.decide(retryable("pay")).await.unwrap();
        }
        for _ in 0..3 {
            decider.decide(retryable("tiny")).await.unwrap();
        }
        // A hedge before any latency is known: denied (hedging_off).
        decider
            .decide(pb::DecideRequest {
                upstream: "hedged".into(),
                idempotency: pb::Idempotency::Idempotent as i32,
                attempt: 1,
                hedge: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        decider
            .decide(pb::DecideRequest {
                failure: 0,
                http_status: 404,
                ..retryable("ledger")
            })
            .await
            .unwrap();
        decider
            .decide(pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                evidence: pb::Evidence::NotSent as i32,
                failure: pb::FailureKind::GenericIo as i32,
                ..retryable("pay")
            })
            .await
            .unwrap();
    };
    drive(&mut decider).await;
    // Started after a whole drive: its first scrape sees every series, each
    // at a drive's end, so the rates below start from one consistent point.
    let prometheus = Prometheus::start(server.metrics);
    // No drive before Prometheus's first scrape has landed: on a loaded
    // machine that scrape came late, fell in the middle of the next drive
    // (after its report, before its retries), and the ratio below read
    // 0.67 instead of 0.5.
    prometheus.wait_for("retryd_upstream_reported_requests_total{upstream=\"pay\"}");
    prometheus.wait_for("retryd_retries_granted_total{upstream=\"pay\"}");
    admin
        .set_retries_enabled(pb::SetRetriesEnabledRequest {
            upstream: "ledger".into(),
            enabled: false,
            reason: "test".into(),
        })
        .await
        .unwrap();

    // Exemplars in the scrape: a trace id on a decision-latency bucket.
    let scrape = server.scrape();
    assert!(
        scrape.lines().any(
            |line| line.starts_with("retryd_decision_duration_seconds_bucket{")
                && line.contains(" # {trace_id=\"")
        ),
        "{scrape}"
    );
    assert!(scrape.ends_with("# EOF\n"), "OpenMetrics");

    // Rates need two scrapes with traffic between them: keep driving until
    // the recording rule has a value.
    let deadline = Instant::now() + PROMETHEUS_PACE;
    while prometheus
        .get(&format!(
            "/api/v1/query?query={}",
            encode("upstream:retryd_retry_amplification:ratio_rate5m{upstream=\"pay\"}")
        ))
        .and_then(|a| a["data"]["result"].as_array().map(|r| !r.is_empty()))
        != Some(true)
    {
        assert!(
            Instant::now() < deadline,
            "the amplification rule never had a value"
        );
        drive(&mut decider).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    for (title, expr) in panels() {
        let expr = expr.replace("$__rate_interval", "1m");
        let result = prometheus.wait_for(&expr);
        assert!(!result.is_empty(), "panel {title:?}: {expr}");
    }
    // The amplification rule against what retryd counted. Pay's budget never
    // runs dry, so every drive adds the same retries per reported request,
    // and both series extrapolate alike. Traffic stops;
    // once Prometheus holds retryd's final counts, every sample in the
    // window was taken between drives (the first after a whole one), both
    // series share their scrape times, and the rule must come to exactly
    // the counted retries per reported request. Which scrapes fell where
    // changes nothing; a busy machine only makes it take longer.
    let counted = |name: &str| -> f64 {
        let scrape = server.scrape();
        scrape
            .lines()
            .find(|line| line.starts_with(&format!("{name}{{upstream=\"pay\"}} ")))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("{name} for pay in {scrape}"))
    };
    let (retries, reported) = (
        counted("retryd_retries_granted_total"),
        counted("retryd_upstream_reported_requests_total"),
    );
    let sample = |expr: &str| -> Vec<f64> {
        prometheus
            .query(expr)
            .first()
            .and_then(|series| series["values"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .map(|point| point[1].as_str().unwrap().parse().unwrap())
            .collect()
    };
    let deadline = Instant::now() + PROMETHEUS_PACE;
    let (retry_samples, report_samples) = loop {
        let retry_samples = sample("retryd_retries_granted_total{upstream=\"pay\"}[10m]");
        let report_samples =
            sample("retryd_upstream_reported_requests_total{upstream=\"pay\"}[10m]");
        if retry_samples.last() == Some(&retries) && report_samples.last() == Some(&reported) {
            break (retry_samples, report_samples);
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never scraped {retries} retries, {reported} reported"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let expected = (retries - retry_samples[0]) / (reported - report_samples[0]);
    assert!(
        (0.4..=0.6).contains(&expected),
        "5 or 6 retries per 10 reported: {expected}"
    );
    let deadline = Instant::now() + PROMETHEUS_PACE;
    loop {
        let value: Option<f64> = prometheus
            .query("upstream:retryd_retry_amplification:ratio_rate5m{upstream=\"pay\"}")
            .first()
            .and_then(|series| series["value"][1].as_str()?.parse().ok());
        if value.is_some_and(|value| (value - expected).abs() < 1e-3 * expected) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "amplification {value:?}, counted {expected}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    for (alert, expr) in rules() {
        // The ones the test caused are waited for (spans are counted lost
        // only when an export to the dead port gives up, which a busy
        // machine delays past the first evaluations); the others must
        // evaluate, to nothing.
        let expected = matches!(
            alert.as_str(),
            "RetrydBudgetEmpty" | "RetrydAmplificationHigh" | "RetrydSpansDropped"
        );
        let result = if expected {
            prometheus.wait_for(&expr)
        } else {
            prometheus.query(&expr)
        };
        match alert.as_str() {
            // The test emptied `tiny`, let retries add 50% to `pay`, and
            // sent spans nowhere.
            "RetrydBudgetEmpty" => assert!(
                result.iter().any(|s| s["metric"]["upstream"] == "tiny"),
                "{alert}: {result:?}"
            ),
            "RetrydAmplificationHigh" => assert!(
                result.iter().any(|s| s["metric"]["upstream"] == "pay"),
                "{alert}: {result:?}"
            ),
            "RetrydSpansDropped" => assert!(!result.is_empty(), "{alert}: {result:?}"),
            // The memory store is always available; no reload was refused.
            "RetrydStoreUnavailable" | "RetrydReloadFailed" => {
                assert!(result.is_empty(), "{alert}: {result:?}")
            }
            other => panic!("an alert the test does not know: {other}"),
        }
    }

    // Prometheus kept the exemplars: decision latency links to traces.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let exemplars = prometheus
        .get(&format!(
            "/api/v1/query_exemplars?query={}&start={}&end={}",
            encode("retryd_decision_duration_seconds_bucket"),
            now - 600,
            now + 60
        ))
        .unwrap();
    assert!(
        exemplars.to_string().contains("trace_id"),
        "no exemplar in Prometheus: {exemplars}"
    );
}
