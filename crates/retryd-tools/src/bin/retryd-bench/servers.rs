//! The processes a benchmark run starts: servers that print their address
//! as a JSON line (`retryd serve`, `retryd-baseline`), a `redis-server`,
//! and what the run reads about processes from /proc. Each is stopped
//! (SIGTERM, then waited for) when its handle is stopped or dropped, so
//! an error or a panic leaves nothing running.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process};

use crate::START_WITHIN;

/// /proc's clock ticks per second (USER_HZ, 100 on every Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// A running server, stopped when dropped.
pub(crate) struct Server {
    child: Child,
    /// The gRPC address it printed.
    pub(crate) addr: String,
}

impl Server {
    /// Starts `command`, its stdout and stderr in `out/NAME.out` and
    /// `.err`, and waits for its first stdout line, `{"grpc":"ADDR",...}`.
    /// `None` if it exits or stays silent for [`START_WITHIN`].
    pub(crate) fn start(
        out: &Path,
        name: &str,
        mut command: Command,
    ) -> anyhow::Result<Option<Server>> {
        let stdout_path = out.join(format!("{name}.out"));
        let child = command
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout_path)?)
            .stderr(fs::File::create(out.join(format!("{name}.err")))?)
            .spawn()
            .with_context(|| format!("start {name}: {command:?}"))?;
        let mut server = Server {
            child,
            addr: String::new(),
        };
        let started = Instant::now();
        while started.elapsed() < START_WITHIN {
            let line = fs::File::open(&stdout_path)
                .ok()
                .and_then(|file| BufReader::new(file).lines().next())
                .and_then(Result::ok)
                .filter(|line| line.ends_with('}'));
            if let Some(line) = line {
                let announced: serde_json::Value = serde_json::from_str(&line)
                    .with_context(|| format!("{name}'s address line {line:?}"))?;
                server.addr = announced["grpc"]
                    .as_str()
                    .with_context(|| format!("no grpc address in {line:?}"))?
                    .to_owned();
                return Ok(Some(server));
            }
            if server.child.try_wait()?.is_some() {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(None)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then waits for it to exit (a server under callgrind
    /// writes its counts as it exits).
    pub(crate) fn stop(self) {}
}

impl Drop for Server {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// A `redis-server` on a free loopback port, without persistence.
pub(crate) struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    pub(crate) fn start(out: &Path) -> anyhow::Result<Redis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = fs::File::create(out.join("redis.log"))?;
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start redis-server")?;
        let redis = Redis { child, port };
        for _ in 0..50 {
            let ping = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "ping"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if ping.is_ok_and(|status| status.success()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(redis)
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn stop(self) {}
}

impl Drop for Redis {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

fn terminate(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        if let Some(pid) = Pid::from_raw(child.id() as i32) {
            let _ = kill_process(pid, Signal::TERM);
        }
    }
    let _ = child.wait();
}

/// `program`, run by `taskset -c CORE` when `pin` names a core.
pub(crate) fn pinned(pin: Option<u8>, program: &Path) -> Command {
    match pin {
        Some(core) => {
            let mut command = Command::new("taskset");
            command.arg("-c").arg(core.to_string()).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// A retryd configuration on loopback with a budget that never runs dry,
/// so RETRY verdicts stay RETRY for the whole run; `store` is the body of
/// its `[store]` section.
pub(crate) fn retryd_config(
    out: &Path,
    name: &str,
    max_upstreams: u64,
    store: &str,
) -> anyhow::Result<PathBuf> {
    let path = out.join(format!("{name}.toml"));
    fs::write(
        &path,
        format!(
            r#"[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
shutdown_grace = "1s"

[store]
{store}

[telemetry]
log_level = "warn"

[limits]
max_upstreams = {max_upstreams}

[defaults]
budget = {{ capacity = 1e9, initial = 1e9, ratio = 0.1, min_per_second = 1000.0 }}
"#
        ),
    )?;
    Ok(path)
}

/// User and system CPU time of process `pid` so far, in seconds (fields
/// 14 and 15 of /proc/PID/stat).
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    stat_seconds(&format!("/proc/{pid}/stat"), 11)
}

/// User and system CPU time of this process's children that have been
/// waited for, in seconds (fields 16 and 17 of /proc/self/stat).
pub(crate) fn children_cpu_seconds() -> anyhow::Result<f64> {
    stat_seconds("/proc/self/stat", 13)
}

/// The sum of two consecutive tick counts of a /proc stat file, `index`
/// counting from the field after the command name.
fn stat_seconds(path: &str, index: usize) -> anyhow::Result<f64> {
    let stat = fs::read_to_string(path).with_context(|| format!("read {path}"))?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |at: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(at)
            .with_context(|| format!("{path} is short"))?
            .parse::<f64>()?)
    };
    Ok((ticks(index)? + ticks(index + 1)?) / TICKS_PER_SECOND)
}

/// Whether `program` is on the PATH.
pub(crate) fn have(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

pub(crate) fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
