//! `retryd-bench`: produces the table of BENCHMARKS.md in one command.
//! Builds release, runs the criterion benches (engine; budget store vs
//! governor vs tower), then starts the baseline server and retryd on
//! loopback ports, one at a time, and drives each with `retryd-load`:
//! saturation, latency at 10%, 50% and 90% of the measured saturation
//! (also with server and generator pinned to separate cores), scaling with
//! 1 / 1,000 / 100,000 upstreams, the Redis store (exact, leased) against
//! its own `redis-server`, an h2load cross-check and instructions per call
//! under callgrind. Every figure is reported next to a reference measured
//! in the same run (`table.rs`), since on a shared machine only such
//! ratios hold still.
//!
//! `scripts/bench` runs it (`--quick` for shorter runs, `--update` to
//! rewrite the table between BENCHMARKS.md's markers). Everything talks to
//! 127.0.0.1 only, every run is bounded in time, and every process it
//! starts is stopped when it ends, however it ends. Raw results go to
//! `target/bench-run/` (`results.jsonl`, `criterion/`, `*.log`).
//!
//! It measures nothing itself: the generator is `retryd-load`, the
//! in-process figures criterion's; this program only runs them in a fixed
//! order and renders what they wrote.

mod servers;
mod table;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::Value;

use servers::{Redis, Server};

#[derive(Parser)]
#[command(
    about = "Run retryd's benchmarks and print (or, with --update, write) BENCHMARKS.md's table."
)]
struct Args {
    /// Shorter runs, to try the program (a few minutes after the build).
    #[arg(long)]
    quick: bool,
    /// Also rewrite the table between BENCHMARKS.md's markers.
    #[arg(long)]
    update: bool,
}

/// Lengths of the timed runs.
struct Lengths {
    warmup: &'static str,
    duration: &'static str,
    criterion: [&'static str; 4],
    /// Calls and stream items under callgrind.
    callgrind: (u64, u64),
}

impl Lengths {
    fn new(quick: bool) -> Lengths {
        if quick {
            Lengths {
                warmup: "1s",
                duration: "3s",
                criterion: ["--warm-up-time", "0.3", "--measurement-time", "0.7"],
                callgrind: (1000, 10_000),
            }
        } else {
            Lengths {
                warmup: "1s",
                duration: "5s",
                criterion: ["--warm-up-time", "0.5", "--measurement-time", "1.5"],
                callgrind: (3000, 30_000),
            }
        }
    }
}

// Load shapes, chosen on the project's 2-core machine (see BENCHMARKS.md,
// Method): unary saturates with 4 connections x 32 calls in flight; a
// stream with 256 messages in flight per stream, 2 streams.
const UNARY: &[&str] = &["--mode", "unary", "-n", "4", "-c", "32"];
const STREAM: &[&str] = &["--mode", "stream", "-n", "2", "--streams", "1", "-c", "256"];

/// The workspace root: the tools crate is `crates/retryd-tools` in it.
fn workspace_root() -> anyhow::Result<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .context("the workspace root")
}

/// The run's state: where results go and what has been measured so far.
struct Bench {
    out: PathBuf,
    bin: PathBuf,
    lengths: Lengths,
    rows: Vec<Value>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let root = workspace_root()?;
    std::env::set_current_dir(&root)?;
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let out = target.join("bench-run");
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("clear {}", out.display()))?;
    }
    fs::create_dir_all(&out)?;
    fs::write(out.join("results.jsonl"), "")?;
    let mut bench = Bench {
        out,
        bin: target.join("release"),
        lengths: Lengths::new(args.quick),
        rows: Vec::new(),
    };

    eprintln!("== build (release)");
    run_checked(Command::new("cargo").args([
        "build",
        "--release",
        "-p",
        "retryd",
        "-p",
        "retryd-tools",
        "--bin",
        "retryd",
        "--bin",
        "retryd-load",
        "--bin",
        "retryd-baseline",
    ]))?;
    bench.criterion()?;

    let load_before = loadavg();
    bench.memory_and_baseline()?;
    bench.latency_at_fractions()?;
    bench.latency_pinned()?;
    bench.scaling()?;
    let redis_measured = bench.redis()?;
    bench.h2load()?;
    bench.callgrind()?;

    eprintln!("== table");
    let load_after = loadavg();
    let table = table::render(&table::Inputs {
        out: &bench.out,
        rows: &bench.rows,
        redis_measured,
        load_before: &load_before,
        load_after: &load_after,
    })?;
    println!("{table}");
    if args.update {
        update_benchmarks_md(&root.join("BENCHMARKS.md"), &table)?;
        eprintln!("BENCHMARKS.md updated");
    }
    Ok(())
}

impl Bench {
    fn results(&self) -> PathBuf {
        self.out.join("results.jsonl")
    }

    /// Appends one result row, in memory and to `results.jsonl`.
    fn record(&mut self, row: Value) -> anyhow::Result<()> {
        let mut file = fs::OpenOptions::new().append(true).open(self.results())?;
        writeln!(file, "{row}")?;
        self.rows.push(row);
        Ok(())
    }

    fn log(&self, name: &str) -> anyhow::Result<fs::File> {
        Ok(fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out.join(name))?)
    }

    /// The criterion benches; `redis_raw` is built here too (without
    /// `--url` it measures nothing), so the Redis section does not wait for
    /// a compile.
    fn criterion(&self) -> anyhow::Result<()> {
        eprintln!("== criterion benches");
        let log_path = self.out.join("criterion.log");
        let log = fs::File::create(&log_path)?;
        let status = Command::new("cargo")
            .args([
                "bench",
                "-p",
                "retryd-engine",
                "-p",
                "retryd-budget",
                "--features",
                "retryd-budget/redis",
                "--bench",
                "engine",
                "--bench",
                "budget",
                "--bench",
                "redis_raw",
                "--",
            ])
            .args(self.lengths.criterion)
            .arg("--noplot")
            .env("CRITERION_HOME", self.out.join("criterion"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .context("run cargo bench")?;
        if !status.success() {
            let text = fs::read_to_string(&log_path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("{}", lines[lines.len().saturating_sub(30)..].join("\n"));
            bail!("the criterion benches failed ({status})");
        }
        Ok(())
    }

    fn baseline(
        &self,
        name: &str,
        extra: &[&str],
        pin: Option<u8>,
    ) -> anyhow::Result<Option<Server>> {
        let mut command = servers::pinned(pin, &self.bin.join("retryd-baseline"));
        command.args(["--listen", "127.0.0.1:0"]).args(extra);
        Server::start(&self.out, name, command)
    }

    fn retryd(&self, name: &str, config: &Path, pin: Option<u8>) -> anyhow::Result<Option<Server>> {
        let mut command = servers::pinned(pin, &self.bin.join("retryd"));
        command.arg("serve").arg("--config").arg(config);
        Server::start(&self.out, name, command)
    }

    /// A server that must start: the run means nothing without it.
    fn must(server: anyhow::Result<Option<Server>>, name: &str) -> anyhow::Result<Server> {
        server?.with_context(|| format!("{name} did not start (see target/bench-run/{name}.err)"))
    }

    /// One `retryd-load` run against `server`, its JSON row recorded with
    /// the CPU time the generator and the server used during it
    /// (`load_cpu_s`, `server_cpu_s`, over `wall_s`): on 2 cores shared by
    /// both, how busy the machine was explains a latency figure as much as
    /// the server does. `pin` puts the generator on that core.
    fn load(
        &mut self,
        server: &Server,
        label: &str,
        shape: &[&str],
        extra: &[String],
        pin: Option<u8>,
    ) -> anyhow::Result<()> {
        let mut command = servers::pinned(pin, &self.bin.join("retryd-load"));
        command
            .args(["--target", &server.addr, "--label", label])
            .args([
                "--warmup",
                self.lengths.warmup,
                "--duration",
                self.lengths.duration,
            ])
            .args(shape)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(self.log("load.log")?);
        let server_before = servers::cpu_seconds(server.pid())?;
        let children_before = servers::children_cpu_seconds()?;
        let started = Instant::now();
        let output = command.output().context("run retryd-load")?;
        let wall = started.elapsed().as_secs_f64();
        if !output.status.success() {
            bail!(
                "retryd-load {label} failed ({}); see target/bench-run/load.log",
                output.status
            );
        }
        let mut row: Value = serde_json::from_slice(&output.stdout)
            .with_context(|| format!("retryd-load {label}'s JSON line"))?;
        row["wall_s"] = wall.into();
        row["server_cpu_s"] = (servers::cpu_seconds(server.pid())? - server_before).into();
        row["load_cpu_s"] = (servers::children_cpu_seconds()? - children_before).into();
        self.record(row)?;
        let log = fs::read_to_string(self.out.join("load.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!("{}", lines[lines.len().saturating_sub(2)..].join("\n"));
        Ok(())
    }

    /// The throughput of the last run labelled `label`.
    fn throughput(&self, label: &str) -> anyhow::Result<u64> {
        self.rows
            .iter()
            .rev()
            .find(|row| row["label"] == label)
            .and_then(|row| row["throughput"].as_f64())
            .map(|value| value as u64)
            .with_context(|| format!("no throughput for {label}"))
    }

    /// The mean throughput of the runs whose label starts with `prefix`.
    fn mean_throughput(&self, prefix: &str) -> u64 {
        let found: Vec<f64> = self
            .rows
            .iter()
            .filter(|row| {
                row["label"]
                    .as_str()
                    .is_some_and(|label| label.starts_with(prefix))
            })
            .filter_map(|row| row["throughput"].as_f64())
            .collect();
        (found.iter().sum::<f64>() / found.len().max(1) as f64) as u64
    }

    fn memory_config(&self, name: &str, max_upstreams: u64) -> anyhow::Result<PathBuf> {
        servers::retryd_config(&self.out, name, max_upstreams, "kind = \"memory\"")
    }

    /// Two rounds each of baseline, baseline set up as retryd and retryd
    /// on the memory store, alternating, so slow drift on a shared machine
    /// hits them all.
    fn memory_and_baseline(&mut self) -> anyhow::Result<()> {
        eprintln!("== baseline and retryd (memory store), interleaved");
        let config = self.memory_config("memory", 10_000)?;
        for round in 1..=2 {
            let server = Self::must(self.baseline("baseline", &[], None), "baseline")?;
            self.load(
                &server,
                &format!("baseline.unary.{round}"),
                UNARY,
                &[],
                None,
            )?;
            self.load(
                &server,
                &format!("baseline.stream.{round}"),
                STREAM,
                &[],
                None,
            )?;
            server.stop();
            // The same canned server set up as `retryd serve` is by default
            // ([server] defaults, health and reflection routes): what that
            // setup costs, apart from the decision.
            let server = Self::must(
                self.baseline("baseline-limits", &["--server-limits"], None),
                "baseline-limits",
            )?;
            self.load(&server, &format!("limits.unary.{round}"), UNARY, &[], None)?;
            server.stop();
            let server = Self::must(self.retryd("memory", &config, None), "memory")?;
            self.load(&server, &format!("memory.unary.{round}"), UNARY, &[], None)?;
            self.load(
                &server,
                &format!("memory.stream.{round}"),
                STREAM,
                &[],
                None,
            )?;
            server.stop();
        }
        Ok(())
    }

    /// Two rounds, servers alternating, at 10%, 50% and 90% of each
    /// server's saturation above. 10% shows the latency of a machine that
    /// is not busy.
    fn latency_at_fractions(&mut self) -> anyhow::Result<()> {
        eprintln!("== latency at 10%, 50% and 90% of saturation");
        let config = self.memory_config("memory", 10_000)?;
        let base_sat = self.mean_throughput("baseline.unary.");
        let mem_sat = self.mean_throughput("memory.unary.");
        for round in 1..=2 {
            for name in ["baseline", "memory"] {
                let (server, sat) = if name == "baseline" {
                    (
                        Self::must(self.baseline("baseline", &[], None), name)?,
                        base_sat,
                    )
                } else {
                    (
                        Self::must(self.retryd("memory", &config, None), name)?,
                        mem_sat,
                    )
                };
                for pct in [10, 50, 90] {
                    let rate = vec!["--rate".to_owned(), (sat * pct / 100).to_string()];
                    self.load(
                        &server,
                        &format!("{name}.at{pct}.{round}"),
                        UNARY,
                        &rate,
                        None,
                    )?;
                }
                server.stop();
            }
        }
        Ok(())
    }

    /// The same with the server on core 1 and the generator on core 0:
    /// with both free to use both cores, the generator's threads (pacer
    /// and senders) preempt the server's for whole scheduler slices, which
    /// is the machine's latency, not the server's. Saturation is measured
    /// again pinned, and each server gets two rounds at 50% and 90% of it.
    fn latency_pinned(&mut self) -> anyhow::Result<()> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if !servers::have("taskset") || cores < 2 {
            return Ok(());
        }
        eprintln!("== latency, server and generator pinned to separate cores");
        let config = self.memory_config("memory", 10_000)?;
        for name in ["baseline", "memory"] {
            let server = if name == "baseline" {
                Self::must(
                    self.baseline("baseline-pinned", &[], Some(1)),
                    "baseline-pinned",
                )?
            } else {
                Self::must(
                    self.retryd("memory-pinned", &config, Some(1)),
                    "memory-pinned",
                )?
            };
            self.load(&server, &format!("{name}.pinned.sat"), UNARY, &[], Some(0))?;
            let sat = self.throughput(&format!("{name}.pinned.sat"))?;
            for round in 1..=2 {
                let half = vec!["--rate".to_owned(), (sat / 2).to_string()];
                self.load(
                    &server,
                    &format!("{name}.pinned.at50.{round}"),
                    UNARY,
                    &half,
                    Some(0),
                )?;
                let most = vec!["--rate".to_owned(), (sat * 9 / 10).to_string()];
                self.load(
                    &server,
                    &format!("{name}.pinned.at90.{round}"),
                    UNARY,
                    &most,
                    Some(0),
                )?;
            }
            server.stop();
        }
        Ok(())
    }

    fn scaling(&mut self) -> anyhow::Result<()> {
        eprintln!("== scaling with the number of upstreams");
        for upstreams in [1000, 100_000] {
            let name = format!("memory-{upstreams}");
            let config = self.memory_config(&name, upstreams)?;
            let server = Self::must(self.retryd(&name, &config, None), &name)?;
            let spread = vec!["--upstreams".to_owned(), upstreams.to_string()];
            self.load(
                &server,
                &format!("memory.unary.up{upstreams}"),
                UNARY,
                &spread,
                None,
            )?;
            self.load(
                &server,
                &format!("memory.stream.up{upstreams}"),
                STREAM,
                &spread,
                None,
            )?;
            server.stop();
        }
        Ok(())
    }

    /// The Redis store against its own `redis-server`; returns whether
    /// retryd served on it at all.
    fn redis(&mut self) -> anyhow::Result<bool> {
        eprintln!("== Redis store");
        if !servers::have("redis-server") {
            return Ok(false);
        }
        let redis = Redis::start(&self.out)?;
        let url = redis.url();
        let redis_config = |bench: &Bench, mode: &str| {
            servers::retryd_config(
                &bench.out,
                &format!("redis-{mode}"),
                10_000,
                &format!("kind = \"redis\"\nurl = \"{url}\"\nmode = \"{mode}\""),
            )
        };
        let mut measured = false;
        // Two interleaved rounds: the baseline running the exact store's
        // script per call ("gRPC plus the raw script"), retryd on each
        // mode, and retryd on the memory store again, so each Redis ratio
        // compares neighbours in time.
        for round in 1..=2 {
            if let Some(server) = self.baseline("baseline-redis", &["--redis", &url], None)? {
                self.load(
                    &server,
                    &format!("baseline-redis.unary.{round}"),
                    UNARY,
                    &[],
                    None,
                )?;
                server.stop();
            }
            for mode in ["exact", "leased"] {
                let config = redis_config(self, mode)?;
                let name = format!("redis-{mode}");
                match self.retryd(&name, &config, None)? {
                    Some(server) => {
                        measured = true;
                        self.load(
                            &server,
                            &format!("redis-{mode}.unary.{round}"),
                            UNARY,
                            &[],
                            None,
                        )?;
                        server.stop();
                    }
                    None => {
                        let err = fs::read_to_string(self.out.join(format!("{name}.err")))
                            .unwrap_or_default();
                        eprintln!(
                            "   retryd did not start with the {mode} Redis store: {}",
                            err.lines().last().unwrap_or_default()
                        );
                    }
                }
            }
            let config = self.memory_config("memory", 10_000)?;
            let server = Self::must(self.retryd("memory", &config, None), "memory")?;
            self.load(
                &server,
                &format!("memory-redis-round.unary.{round}"),
                UNARY,
                &[],
                None,
            )?;
            server.stop();
        }
        // Latency at half of each mode's saturation.
        for mode in ["exact", "leased"] {
            let config = redis_config(self, mode)?;
            if let Some(server) = self.retryd(&format!("redis-{mode}"), &config, None)? {
                let sat = self.throughput(&format!("redis-{mode}.unary.2"))?;
                let half = vec!["--rate".to_owned(), (sat / 2).to_string()];
                self.load(&server, &format!("redis-{mode}.at50"), UNARY, &half, None)?;
                server.stop();
            }
        }
        // The store against the raw script in one process
        // (benches/redis_raw.rs): its JSON lines go to the results.
        if measured {
            let output = Command::new("cargo")
                .args([
                    "bench",
                    "-p",
                    "retryd-budget",
                    "--features",
                    "redis",
                    "--bench",
                    "redis_raw",
                    "--",
                    "--url",
                    &url,
                    "--duration",
                    self.lengths.duration,
                ])
                .stderr(self.log("load.log")?)
                .output()
                .context("run the redis_raw bench")?;
            if output.status.success() {
                for line in String::from_utf8_lossy(&output.stdout).lines() {
                    if let Ok(row) = serde_json::from_str::<Value>(line) {
                        if row.get("label").is_some() {
                            self.record(row)?;
                        }
                    }
                }
            }
        }
        redis.stop();
        Ok(measured)
    }

    /// h2load against both servers, installed if it can be (as root, from
    /// Debian's nghttp2-client).
    fn h2load(&mut self) -> anyhow::Result<()> {
        eprintln!("== h2load cross-check");
        if !servers::have("h2load") && servers::have("apt-get") && servers::is_root() {
            let install = || {
                Command::new("apt-get")
                    .args(["install", "-y", "-qq", "nghttp2-client"])
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if !install() {
                let _ = Command::new("apt-get").args(["update", "-qq"]).status();
                install();
            }
        }
        if !servers::have("h2load") {
            eprintln!("   h2load not installed (apt-get install -y nghttp2-client); skipped");
            return Ok(());
        }
        let frame = self.out.join("decide.bin");
        run_checked(
            Command::new(self.bin.join("retryd-load"))
                .arg("--write-frame")
                .arg(&frame)
                .stdout(Stdio::null()),
        )?;
        let config = self.memory_config("memory", 10_000)?;
        for name in ["baseline", "memory"] {
            let server = if name == "baseline" {
                Self::must(self.baseline("baseline", &[], None), name)?
            } else {
                Self::must(self.retryd("memory", &config, None), name)?
            };
            let seconds = self.lengths.duration.trim_end_matches('s');
            let output = Command::new("h2load")
                .args(["-D", seconds, "-c", "4", "-m", "32", "-t", "1"])
                .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
                .arg("-d")
                .arg(&frame)
                .arg(format!(
                    "http://{}/retryd.v1.RetryDecider/Decide",
                    server.addr
                ))
                .output()
                .context("run h2load")?;
            let text = String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr);
            fs::write(self.out.join(format!("h2load-{name}.log")), &text)?;
            let (throughput, succeeded) = table::parse_h2load(&text);
            self.record(serde_json::json!({"label": format!("h2load.{name}"), "throughput": throughput, "succeeded": succeeded}))?;
            server.stop();
        }
        Ok(())
    }

    /// Counted instructions do not depend on what else the machine is
    /// doing, so this ratio holds still where the timed ones wander. Each
    /// server runs under callgrind three times: started and stopped with no
    /// calls, then for a fixed number of unary calls, then of stream items;
    /// the idle count is subtracted and the rest divided by the calls. The
    /// load generator runs natively; only the server is counted.
    fn callgrind(&mut self) -> anyhow::Result<()> {
        eprintln!("== instructions per call (callgrind)");
        if !servers::have("valgrind") {
            eprintln!("   valgrind not installed (apt-get install -y valgrind); skipped");
            return Ok(());
        }
        let (n_calls, n_items) = self.lengths.callgrind;
        let config = self.memory_config("memory", 10_000)?;
        for name in ["baseline", "memory"] {
            for work in ["idle", "unary", "stream"] {
                let counted = self.out.join(format!("callgrind.{name}.{work}"));
                let mut command = Command::new("valgrind");
                command
                    .arg("--tool=callgrind")
                    .arg(format!("--callgrind-out-file={}", counted.display()));
                if name == "baseline" {
                    command
                        .arg(self.bin.join("retryd-baseline"))
                        .args(["--listen", "127.0.0.1:0"]);
                } else {
                    command
                        .arg(self.bin.join("retryd"))
                        .arg("serve")
                        .arg("--config")
                        .arg(&config);
                }
                let server_name = format!("cg-{name}");
                let server = Self::must(
                    Server::start(&self.out, &server_name, command),
                    &server_name,
                )?;
                let (calls, shape): (u64, &[&str]) = match work {
                    "idle" => (0, &[]),
                    "unary" => (n_calls, &["--mode", "unary", "-n", "4", "-c", "32"]),
                    _ => (n_items, &["--mode", "stream", "-n", "2", "-c", "256"]),
                };
                if calls > 0 {
                    run_checked(
                        Command::new(self.bin.join("retryd-load"))
                            .args(["--target", &server.addr])
                            .args(shape)
                            .args(["--requests", &calls.to_string()])
                            .stdout(Stdio::null())
                            .stderr(self.log("load.log")?),
                    )?;
                }
                server.stop();
                let text = fs::read_to_string(&counted)
                    .with_context(|| format!("read {}", counted.display()))?;
                let instructions: u64 = text
                    .lines()
                    .find_map(|line| line.strip_prefix("summary: "))
                    .and_then(|count| count.trim().parse().ok())
                    .with_context(|| format!("no summary line in {}", counted.display()))?;
                self.record(serde_json::json!({"label": format!("callgrind.{name}.{work}"), "instructions": instructions, "calls": calls}))?;
            }
        }
        Ok(())
    }
}

/// Runs `command` to its end; an error unless it succeeded.
fn run_checked(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("run {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg prints them.
fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Replaces what stands between BENCHMARKS.md's markers by `table`.
fn update_benchmarks_md(path: &Path, table: &str) -> anyhow::Result<()> {
    const BEGIN: &str = "<!-- bench:begin -->";
    const END: &str = "<!-- bench:end -->";
    let text = fs::read_to_string(path)?;
    let start = text.find(BEGIN).context("no bench:begin marker")? + BEGIN.len();
    let stop = text.find(END).context("no bench:end marker")?;
    fs::write(
        path,
        format!("{}\n{table}\n{}", &text[..start], &text[stop..]),
    )?;
    Ok(())
}

/// How long a server may take to print its address: a server under
/// valgrind starts slowly.
pub(crate) const START_WITHIN: Duration = Duration::from_secs(30);
