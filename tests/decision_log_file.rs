//! The decision log's file and `retryd replay`'s input (issue 29, findings
//! 8 and 11), against the real binary: the log is created owner-only
//! whatever the umask, never through a symbolic link, reopened on SIGHUP
//! (log rotation) and bounded by `decision_log.max_bytes`, drops counted;
//! replay refuses what the live edge would have refused, and lines past
//! its bound.

use retryd_testkit as support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{HANG_GUARD, Server, retryable};

fn log_config(path: &Path, extra: &str) -> String {
    format!("[decision_log]\npath = \"{}\"\n{extra}\n", path.display())
}

fn lines_in(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|text| text.lines().count())
        .unwrap_or(0)
}

/// Polls until `path` holds `lines` lines.
async fn holds(path: &Path, lines: usize) {
    let started = Instant::now();
    while lines_in(path) != lines {
        assert!(
            started.elapsed() < HANG_GUARD,
            "{} holds {} lines, not {lines}",
            path.display(),
            lines_in(path)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn decide(server: &Server, n: usize) {
    let mut decider = server.decider().await;
    for _ in 0..n {
        decider.decide(retryable("pay")).await.unwrap();
    }
}

/// Finding 8: 0600 even when retryd runs under umask 000.
#[tokio::test]
async fn the_log_is_created_owner_only_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let server = Server::start_under(
        &["sh", "-c", "umask 000; exec \"$@\"", "sh"],
        &log_config(&path, ""),
    );
    decide(&server, 1).await;
    holds(&path, 1).await;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "created {mode:o}");
}

/// Finding 8: a symbolic link at the log's path is refused at startup,
/// naming the key; the file it points to is left alone.
#[test]
fn a_symbolic_link_at_the_logs_path_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, "").unwrap();
    let path = dir.path().join("decisions.jsonl");
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let config = dir.path().join("retryd.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n{}",
            log_config(&path, "")
        ),
    )
    .unwrap();
    let mut child = Command::new(support::binary())
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The ready line, if it comes, says it started: read it on a thread so
    // that the wait is bounded.
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = sender.send(line);
    });
    let ready = receiver.recv_timeout(HANG_GUARD).unwrap_or_default();
    if !ready.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("retryd started, writing through the link: {ready}");
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("decision_log.path"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "");
}

/// Finding 8: logrotate moves the file, then sends SIGHUP; the next lines
/// go to a new file at the path, the old lines stay in the moved one.
#[tokio::test]
async fn sighup_reopens_the_log_after_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let server = Server::start(&log_config(&path, ""));
    decide(&server, 2).await;
    holds(&path, 2).await;
    let rotated = PathBuf::from(format!("{}.1", path.display()));
    std::fs::rename(&path, &rotated).unwrap();
    server.signal("HUP");
    // The writer reopens within its next wake-up; lines decided before it
    // does go on to the rotated file, so decide until the new file fills.
    let started = Instant::now();
    while lines_in(&path) == 0 {
        assert!(started.elapsed() < HANG_GUARD, "no new file at the path");
        decide(&server, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        lines_in(&rotated) >= 2,
        "the old lines stay where they were"
    );
}

/// Finding 8: with `decision_log.max_bytes`, the file stops short of the
/// bound and every line left out is counted.
#[tokio::test]
async fn the_log_is_bounded_by_max_bytes_and_drops_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let server = Server::start(&log_config(&path, "max_bytes = 2000"));
    decide(&server, 20).await;
    let started = Instant::now();
    loop {
        let written = lines_in(&path);
        let dropped = server
            .scrape()
            .lines()
            .find_map(|line| line.strip_prefix("retryd_decision_log_dropped_total "))
            .and_then(|value| value.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if written + dropped == 20 && dropped > 0 {
            break;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "{written} lines written, {dropped} dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size <= 2000, "{size} bytes");
}

/// Finding 11: replay applies the live edge's rules and bounds a line.
#[tokio::test]
async fn replay_refuses_what_the_edge_would_and_overlong_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decisions.jsonl");
    let server = Server::start(&log_config(&path, ""));
    decide(&server, 1).await;
    holds(&path, 1).await;
    let recorded: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&path).unwrap().trim()).unwrap();
    let config = dir.path().join("replay.toml");
    std::fs::write(&config, "[limits]\nmax_upstreams = 2\n").unwrap();
    let replay = |lines: &[serde_json::Value]| {
        let log = dir.path().join("input.jsonl");
        let text: String = lines.iter().map(|line| format!("{line}\n")).collect();
        std::fs::write(&log, text).unwrap();
        let output = Command::new(support::binary())
            .args(["replay", "--config"])
            .arg(&config)
            .arg(&log)
            .output()
            .unwrap();
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let with = |key: &str, value: serde_json::Value| {
        let mut line = recorded.clone();
        line[key] = value;
        line
    };
    let (ok, stderr) = replay(std::slice::from_ref(&recorded));
    assert!(ok, "the recorded line replays: {stderr}");

    let cases = [
        (
            vec![with("operation", "x".repeat(100_000).into())],
            "line 1: longer than 65536 bytes",
        ),
        (
            vec![recorded.clone(), with("upstream", "pay\u{1b}[31m".into())],
            "line 2: upstream: ",
        ),
        (
            vec![
                with("upstream", "a".into()),
                with("upstream", "b".into()),
                with("upstream", "c".into()),
            ],
            "line 3: upstream: more than limits.max_upstreams (2)",
        ),
        (
            vec![serde_json::json!({
                "kind": "report", "v": 1, "clock_ns": 1, "unix_ms": 1,
                "upstream": "pay", "requests": u64::MAX
            })],
            "line 1: requests: more than",
        ),
    ];
    for (lines, wanted) in cases {
        let (ok, stderr) = replay(&lines);
        assert!(!ok && stderr.contains(wanted), "{wanted:?}: {stderr}");
    }
}
