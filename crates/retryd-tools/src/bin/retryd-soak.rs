//! `retryd-soak`: a long, steady run against a real `retryd` to show it
//! holds up: a mix of every verdict kind, bad inputs, traffic reports, kill
//! switch flips and configuration reloads, for minutes.
//!
//! It starts the server itself (the binary beside it, or `--retryd`) on
//! loopback ports, drives it from several connections, and fails (exit 1)
//! on any unexpected status, any call slower than the hang limit, or
//! resident memory that keeps growing after the warm-up.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use retryd_proto as pb;
use retryd_proto::retry_admin_client::RetryAdminClient;
use retryd_proto::retry_decider_client::RetryDeciderClient;
use tonic::Code;
use tonic::transport::Channel;

#[derive(Parser)]
#[command(
    about = "Soak a real retryd: steady mixed load, bad inputs, reloads; assert no errors, no hangs, flat memory."
)]
struct Args {
    /// How long to run, e.g. 5m.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Connections driving load, each with one call in flight.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Calls per second in all (a steady rate, not flat out).
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// A call slower than this counts as hung.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    hang_limit: Duration,
    /// Memory may grow at most this much (MiB) between the end of the
    /// warm-up and the end of the run.
    #[arg(long, default_value_t = 16)]
    max_growth_mib: u64,
    /// The retryd binary (default: beside this one).
    #[arg(long)]
    retryd: Option<PathBuf>,
}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    retry: AtomicU64,
    deny: AtomicU64,
    ambiguous: AtomicU64,
    invalid: AtomicU64,
    unexpected: AtomicU64,
    hung: AtomicU64,
    slowest_micros: AtomicU64,
}

const CONFIG_A: &str =
    "[defaults]\nmax_attempts = 3\n[upstreams.\"soak-0\"]\ntransient_500 = true\n";
const CONFIG_B: &str =
    "[defaults]\nmax_attempts = 4\n[upstreams.\"soak-1\"]\ntransient_500 = true\n";

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(soak(args))
}

async fn soak(args: Args) -> anyhow::Result<()> {
    let retryd = match &args.retryd {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("retryd"),
    };
    let dir = std::env::temp_dir().join(format!("retryd-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config_path = dir.join("retryd.toml");
    let head = "[server]\nlisten = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n[limits]\nmax_upstreams = 2000\n";
    write_config(&config_path, head, CONFIG_A)?;
    let (mut server, grpc) = start(&retryd, &config_path)?;
    let pid = server.id();
    let result = drive(&args, pid, &grpc, &config_path, head).await;
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let exited = wait(&mut server, Duration::from_secs(15));
    let report = result?;
    ensure!(exited, "retryd did not stop within 15 s of SIGTERM");
    let _ = std::fs::remove_dir_all(&dir);
    println!("{report}");
    Ok(())
}

fn write_config(path: &std::path::Path, head: &str, policy: &str) -> anyhow::Result<()> {
    // Atomic replace: a reload must never read half a file.
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, format!("{head}{policy}"))?;
    std::fs::rename(&temporary, path)?;
    Ok(())
}

fn start(retryd: &std::path::Path, config: &std::path::Path) -> anyhow::Result<(Child, String)> {
    let mut child = Command::new(retryd)
        .args(["serve", "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {}", retryd.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    // The ready line is {"grpc":"ADDR","metrics":"ADDR"}.
    let grpc = line
        .split("\"grpc\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .with_context(|| format!("unexpected ready line {line:?}"))?
        .to_owned();
    Ok((child, grpc))
}

fn wait(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    false
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The i-th request of the mix, and whether it is meant to be refused.
fn request(i: u64) -> (pb::DecideRequest, bool) {
    let upstream = format!("soak-{}", i % 1000);
    let base = pb::DecideRequest {
        upstream,
        operation: "POST /soak".into(),
        idempotency: pb::Idempotency::Idempotent as i32,
        attempt: 1,
        failure: pb::FailureKind::Connect as i32,
        ..Default::default()
    };
    match i % 10 {
        // RETRY: proven not sent.
        0..=2 => (base, false),
        // AMBIGUOUS: sent, no answer, not idempotent.
        3 => (
            pb::DecideRequest {
                idempotency: pb::Idempotency::NonIdempotent as i32,
                failure: pb::FailureKind::ResponseHeaderTimeout as i32,
                ..base
            },
            false,
        ),
        // DENY by status, by attempts, by body.
        4 => (
            pb::DecideRequest {
                failure: 0,
                http_status: 404,
                ..base
            },
            false,
        ),
        5 => (pb::DecideRequest { attempt: 9, ..base }, false),
        6 => (
            pb::DecideRequest {
                body: Some(pb::Body {
                    kind: pb::BodyKind::InputStream as i32,
                    ..Default::default()
                }),
                ..base
            },
            false,
        ),
        // 500: depends on the policy being reloaded back and forth.
        7 => (
            pb::DecideRequest {
                failure: 0,
                http_status: 500,
                ..base
            },
            false,
        ),
        // Bad inputs.
        8 => (
            pb::DecideRequest {
                upstream: String::new(),
                ..base
            },
            true,
        ),
        _ => (
            pb::DecideRequest {
                idempotency: 17,
                ..base
            },
            true,
        ),
    }
}

async fn drive(
    args: &Args,
    pid: u32,
    grpc: &str,
    config_path: &std::path::Path,
    head: &str,
) -> anyhow::Result<String> {
    let channel = |address: String| async move {
        tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
            .connect()
            .await
            .context("connect to retryd")
    };
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let stop_at = started + args.duration;
    let per_connection = Duration::from_secs_f64(args.connections as f64 / args.rate.max(1) as f64);

    let mut workers = Vec::new();
    for worker in 0..args.connections {
        let mut client = RetryDeciderClient::new(channel(grpc.to_owned()).await?);
        let counts = Arc::clone(&counts);
        let hang_limit = args.hang_limit;
        workers.push(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(per_connection);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = worker as u64;
            while Instant::now() < stop_at {
                ticker.tick().await;
                let (message, bad) = request(i);
                i += 17;
                decide(&mut client, message, bad, hang_limit, &counts).await;
            }
        }));
    }

    // Side traffic: reports, kill-switch flips and reloads, once a second.
    let side = {
        let mut decider = RetryDeciderClient::new(channel(grpc.to_owned()).await?);
        let mut admin = RetryAdminClient::new(channel(grpc.to_owned()).await?);
        let counts = Arc::clone(&counts);
        let config_path = config_path.to_owned();
        let head = head.to_owned();
        tokio::spawn(async move {
            let mut second = 0u64;
            while Instant::now() < stop_at {
                tokio::time::sleep(Duration::from_secs(1)).await;
                second += 1;
                let traffic = (0..50)
                    .map(|n| pb::UpstreamTraffic {
                        upstream: format!("soak-{}", (second * 50 + n) % 1000),
                        requests: 100,
                        // The soak reports no outcomes (the contract's
                        // "both counts 0").
                        ..Default::default()
                    })
                    .collect();
                let ok = decider
                    .report_traffic(pb::ReportTrafficRequest {
                        traffic,
                        ..Default::default()
                    })
                    .await
                    .is_ok();
                let flipped = admin
                    .set_retries_enabled(pb::SetRetriesEnabledRequest {
                        upstream: "soak-999".into(),
                        enabled: second % 2 == 0,
                        reason: "soak".into(),
                    })
                    .await
                    .is_ok();
                let policy = if second % 2 == 0 { CONFIG_A } else { CONFIG_B };
                let written = write_config(&config_path, &head, policy).is_ok();
                let reloaded = if second % 3 == 0 {
                    let _ = Command::new("kill")
                        .args(["-HUP", &pid.to_string()])
                        .status();
                    true
                } else {
                    admin
                        .reload_config(pb::ReloadConfigRequest {})
                        .await
                        .is_ok()
                };
                if !(ok && flipped && written && reloaded) {
                    counts.unexpected.fetch_add(1, Ordering::Relaxed);
                }
            }
            second
        })
    };

    // Memory: sample every 5 s; the baseline is taken after a warm-up of a
    // fifth of the run (allocator and connection pools settle by then).
    let warmup = args.duration / 5;
    let mut samples = Vec::new();
    let mut baseline = None;
    while Instant::now() < stop_at {
        tokio::time::sleep(Duration::from_secs(5).min(args.duration / 10)).await;
        let rss = rss_kib(pid);
        samples.push((started.elapsed().as_secs(), rss));
        if baseline.is_none() && started.elapsed() >= warmup {
            baseline = Some(rss);
        }
    }
    for worker in workers {
        worker.await?;
    }
    let seconds_of_side_traffic = side.await?;
    let end = rss_kib(pid);
    let baseline = baseline.unwrap_or(end);
    let growth = end.saturating_sub(baseline);

    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let report = format!(
        "soak: {:.0} s, {} calls ({:.0}/s): {} retry, {} deny, {} ambiguous, {} invalid as intended; {} unexpected, {} hung (limit {:?}); slowest {:.1} ms; {} seconds of reports, kill-switch flips and reloads; RSS {} KiB after warm-up, {} KiB at the end (growth {} KiB, limit {} MiB); samples (s, KiB): {:?}",
        elapsed,
        load(&counts.calls),
        load(&counts.calls) as f64 / elapsed,
        load(&counts.retry),
        load(&counts.deny),
        load(&counts.ambiguous),
        load(&counts.invalid),
        load(&counts.unexpected),
        load(&counts.hung),
        args.hang_limit,
        load(&counts.slowest_micros) as f64 / 1000.0,
        seconds_of_side_traffic,
        baseline,
        end,
        growth,
        args.max_growth_mib,
        samples,
    );
    if load(&counts.unexpected) > 0 || load(&counts.hung) > 0 {
        bail!("{report}");
    }
    if growth > args.max_growth_mib * 1024 {
        bail!("memory kept growing: {report}");
    }
    Ok(report)
}

async fn decide(
    client: &mut RetryDeciderClient<Channel>,
    message: pb::DecideRequest,
    meant_to_fail: bool,
    hang_limit: Duration,
    counts: &Counts,
) {
    let started = Instant::now();
    let outcome = tokio::time::timeout(hang_limit, client.decide(message)).await;
    let micros = started.elapsed().as_micros() as u64;
    counts.slowest_micros.fetch_max(micros, Ordering::Relaxed);
    counts.calls.fetch_add(1, Ordering::Relaxed);
    let counter = match outcome {
        Err(_) => &counts.hung,
        Ok(Ok(response)) if !meant_to_fail => match response.into_inner().verdict() {
            pb::Verdict::Retry => &counts.retry,
            pb::Verdict::Deny => &counts.deny,
            pb::Verdict::Ambiguous => &counts.ambiguous,
            pb::Verdict::Unspecified => &counts.unexpected,
        },
        Ok(Err(status)) if meant_to_fail && status.code() == Code::InvalidArgument => {
            &counts.invalid
        }
        Ok(_) => &counts.unexpected,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}
