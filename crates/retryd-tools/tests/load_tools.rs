//! The benchmark tools work: `retryd-load` drives the real retryd and the
//! canned `retryd-baseline`, and reports what it was answered. Figures in
//! BENCHMARKS.md come from these binaries, so a generator that silently
//! counted errors as answers, or sent a different number of requests than
//! asked, would make every ratio there wrong.

use retryd_testkit as support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use support::Server;

/// A budget that never runs dry, as `scripts/bench` configures, so that
/// every RETRY-kind request is answered RETRY.
const BOUNDLESS: &str = "[defaults]\nbudget = { capacity = 1e9, initial = 1e9, ratio = 0.1, min_per_second = 1000.0 }\n";

/// Runs `retryd-load` against `target` and parses its JSON line.
fn load(target: &str, arguments: &[&str]) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_retryd-load"))
        .args(["--target", target])
        .args(arguments)
        .output()
        .expect("run retryd-load");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "retryd-load failed: {stderr}");
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("retryd-load's stdout is not one JSON line ({e}): {stderr}"))
}

fn count(report: &serde_json::Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {report}"))
}

#[test]
fn a_counted_run_sends_exactly_that_many_and_sees_every_verdict_kind() {
    let server = Server::start(BOUNDLESS);
    let target = server.grpc.to_string();
    for mode in ["unary", "stream"] {
        let report = load(
            &target,
            &["--mode", mode, "-n", "2", "-c", "8", "--requests", "400"],
        );
        assert_eq!(count(&report, "answered"), 400, "{mode}: {report}");
        assert_eq!(count(&report, "errors"), 0, "{mode}: {report}");
        let (retry, deny, ambiguous) = (
            count(&report, "retry"),
            count(&report, "deny"),
            count(&report, "ambiguous"),
        );
        assert_eq!(retry + deny + ambiguous, 400, "{mode}: {report}");
        // The default mix is retry=2, deny=1, ambiguous=1, each sender
        // starting at a different place in it, so the split is near
        // 200:100:100 but not exact.
        assert!(
            retry >= 150 && deny >= 50 && ambiguous >= 50,
            "{mode}: {report}"
        );
    }
    // The server counted the same decisions the generator did.
    let metrics = server.scrape();
    let decided: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("retryd_decisions_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(decided, 800.0, "{metrics}");
}

#[test]
fn a_paced_run_offers_its_rate() {
    let server = Server::start("");
    let report = load(
        &server.grpc.to_string(),
        &["--rate", "400", "--warmup", "0s", "--duration", "1s"],
    );
    // The pacer releases exactly 400 evenly spaced tickets in the second,
    // however late its thread wakes (it releases what fell due at once):
    // it neither floods nor stalls. What a busy machine's server answers
    // by the window's end may be fewer, never more.
    assert_eq!(count(&report, "released"), 400, "{report}");
    let answered = count(&report, "answered");
    assert!((1..=400).contains(&answered), "{report}");
    assert_eq!(count(&report, "errors"), 0, "{report}");
}

/// `retryd-baseline` on a free loopback port, killed when dropped.
struct Baseline(Child);

impl Drop for Baseline {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_baseline_answers_the_same_calls() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryd-baseline"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run retryd-baseline");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("read the ready line");
    let baseline = Baseline(child);
    let ready: serde_json::Value = serde_json::from_str(&line).expect("ready line is JSON");
    let target = ready["grpc"].as_str().expect("grpc address").to_owned();
    for mode in ["unary", "stream"] {
        let report = load(&target, &["--mode", mode, "--requests", "200"]);
        assert_eq!(count(&report, "answered"), 200, "{mode}: {report}");
        assert_eq!(count(&report, "errors"), 0, "{mode}: {report}");
    }
    drop(baseline);
}
