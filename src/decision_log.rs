//! The decision log: every decision, traffic report and kill-switch flip
//! as one JSON line, in the order retryd made them, holding every fact a
//! decision used (the jitter draw and the clock included), so that
//! `retryd replay` can decide them again under another configuration.
//!
//! The format is a contract (README, "The decision log"): one object per
//! line, `"kind"` first, fields named as below, version 1. Readers ignore
//! fields they do not know; a new field is added, never changed.
//!
//! Writing never fails a decision: a decision's record (its strings copied
//! into one buffer, the rest numbers and static names) goes through a
//! bounded queue to a thread of their own, which writes its line
//! (`json.rs`); when the queue is full, a line is dropped and counted
//! (`retryd_decision_log_dropped_total`) and the log says so. Only a
//! DecideStream ever waits for the writer, between items, while the queue
//! is over half full, and at most until the writer is seen stalled
//! (`telemetry/pace.rs`). The file is
//! created 0600 and never opened when its path is a symbolic link; it is reopened
//! on SIGHUP (log rotation) and, with `decision_log.max_bytes`, lines that
//! would pass that size are dropped and counted the same way.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::texts::Texts;

use serde::{Deserialize, Serialize};

use crate::decide::{Attempt, Decided, Draw, NO_BODY};
use crate::engine::{
    Body, Evidence, Facts, FailureKind, GrpcCode, Idempotency, Lineage, Verdict, layer_name,
};
use crate::telemetry::{Backlog, Metrics, Room};

mod json;

/// How long the writer naps between batches while lines keep coming: at
/// the default queue (65,536 lines) a nap holds a few hundred at full rate.
const BUSY_NAP: Duration = Duration::from_millis(2);
/// The writer's buffer: one write per batch at full rate.
const WRITE_BUFFER: usize = 1 << 20;

/// The format's version, on every line.
pub const VERSION: u32 = 1;

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    /// A decision (boxed: it is by far the largest line).
    Decision(Box<DecisionLine>),
    /// A traffic report's entry, deposited.
    Report(ReportLine),
    /// An operator switched retries on or off.
    RetriesEnabled(SwitchLine),
}

/// A decision: its facts, its draw, and what was answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionLine {
    /// The format's version.
    pub v: u32,
    /// Monotonic nanoseconds since the log was opened: what budget refills
    /// count (`retryd replay` reads only their differences).
    pub clock_ns: u64,
    /// Wall time, milliseconds since the Unix epoch, for people.
    pub unix_ms: u64,
    /// The decision id answered.
    pub decision_id: String,
    /// The calling principal.
    pub principal: String,
    /// The upstream.
    pub upstream: String,
    /// The operation, possibly empty.
    pub operation: String,
    /// `safe`, `idempotent`, `idempotent_with_key`, `non_idempotent`.
    pub idempotency: String,
    /// The body's replayability: `replayable`, `reopenable`, `one_shot`.
    pub replayability: String,
    /// Attempts so far, the failed one included.
    pub attempt: u32,
    /// The claimed evidence, if any (`not_sent`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
    /// The failure kind, if any (`connect`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// The HTTP status, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_status: Option<u16>,
    /// The raw Retry-After, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// The gRPC code number, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u32>,
    /// The raw gRPC pushback, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_pushback: Option<String>,
    /// The caller's deadline left, in nanoseconds, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_remaining_ns: Option<u64>,
    /// The response's first byte reached the application.
    pub first_byte_delivered: bool,
    /// The caller's runtime is draining.
    pub runtime_draining: bool,
    /// Credentials were already refreshed.
    pub auth_refresh_attempted: bool,
    /// The backoff before the failed attempt, in nanoseconds, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_backoff_ns: Option<u64>,
    /// The caller's own attempt limit, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// The call chain's lineage (`edge:2/middle:1`), if the call was made
    /// while serving a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
    /// The layer below that already retried the failure, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_below: Option<String>,
    /// The wall clock the decision read (Unix nanoseconds), which only an
    /// HTTP-date Retry-After uses.
    pub now_unix_ns: u64,
    /// The uniform draw in [0, 1) for the backoff jitter.
    pub jitter: f64,
    /// `retry`, `deny` or `ambiguous`.
    pub verdict: String,
    /// For a DENY: the reason (`budget_exhausted`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_reason: Option<String>,
    /// The rule that decided, 1 to 9.
    pub rule: u8,
    /// For a RETRY: the backoff, in nanoseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_ns: Option<u64>,
    /// Tokens left in the upstream's budget after the decision.
    pub tokens_remaining: f64,
    /// The decision was answered as not enforced.
    pub shadow: bool,
    /// Set when the attempt may have taken effect upstream, whatever the
    /// verdict: `reconcile` or `resend_with_key` (absent in logs written
    /// before the field existed, and when the outcome is not in doubt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_outcome: Option<String>,
    /// A hedge decision's numbers (absent for a retry's decision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hedge: Option<HedgeLine>,
}

/// What a hedge decision was made on: which hedge, and the fleet's state
/// over the window as it was read.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HedgeLine {
    /// Which hedge of the call (1 for the first).
    pub k: u32,
    /// The hedge delay, in nanoseconds.
    pub delay_ns: u64,
    /// The fleet's median, in nanoseconds.
    pub p50_ns: u64,
    /// The fleet's tail quantile, in nanoseconds.
    pub tail_ns: u64,
    /// Latencies counted over the window.
    pub samples: u64,
    /// First attempts reported over the window.
    pub first_attempts: u64,
    /// Hedges granted over the window before this decision.
    pub hedges: u64,
    /// Latencies counted over the window's most recent part (absent from
    /// lines written before it was kept: none).
    #[serde(default)]
    pub recent_samples: u64,
    /// Their median, in nanoseconds.
    #[serde(default)]
    pub recent_p50_ns: u64,
    /// Their tail quantile, in nanoseconds.
    #[serde(default)]
    pub recent_tail_ns: u64,
}

/// One deposited entry of a traffic report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReportLine {
    /// The format's version.
    pub v: u32,
    /// As in [`DecisionLine::clock_ns`].
    pub clock_ns: u64,
    /// Wall time, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The upstream.
    pub upstream: String,
    /// Requests that funded the budget: the first attempts reported, or
    /// with the adaptive budget the share of them their outcomes allow.
    pub requests: u64,
}

/// A kill-switch flip.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchLine {
    /// The format's version.
    pub v: u32,
    /// As in [`DecisionLine::clock_ns`].
    pub clock_ns: u64,
    /// Wall time, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The upstream.
    pub upstream: String,
    /// Retries are now switched on.
    pub enabled: bool,
}

/// The writer side: a bounded queue to a thread that appends to the file.
#[derive(Debug)]
pub struct DecisionLog {
    lines: SyncSender<Pending>,
    /// The origin of `clock_ns`.
    opened: Instant,
    /// Drops, shared with the writer thread (which drops over the size cap).
    drops: Arc<Drops>,
    /// Set by [`DecisionLog::reopen`]; the writer reopens the file before
    /// its next write.
    reopen: Arc<AtomicBool>,
    /// What the queue holds, for a DecideStream's back-pressure.
    backlog: Arc<LogBacklog>,
}

/// The queue's length as producers and the writer count it (std's channel
/// does not tell), and the writer's progress: a DecideStream waits for it
/// while half the queue or more is waiting (`telemetry/pace.rs`).
#[derive(Debug)]
struct LogBacklog {
    queued: AtomicUsize,
    half: usize,
    room: Room,
    drops: Arc<Drops>,
}

impl Backlog for LogBacklog {
    fn over_half(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= self.half
    }

    fn room(&self) -> &Room {
        &self.room
    }

    fn count_wait(&self) {
        if let Some(metrics) = self.drops.metrics.get() {
            metrics.decision_log_waits.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Lines dropped, counted here and, once attached, in `/metrics`.
#[derive(Debug, Default)]
struct Drops {
    dropped: AtomicU64,
    metrics: OnceLock<Arc<Metrics>>,
}

impl Drops {
    /// Counts `n` dropped lines; true for the first drop since start.
    fn count(&self, n: u64) -> bool {
        if let Some(metrics) = self.metrics.get() {
            metrics.decision_log_dropped.fetch_add(n, Ordering::Relaxed);
        }
        self.dropped.fetch_add(n, Ordering::Relaxed) == 0
    }
}

/// Opens the log for appending: created owner-only (0600, whatever the
/// umask), never when its path is a symbolic link, since the file holds every
/// caller's upstreams and operations and a link planted at its path would
/// have retryd write wherever it points. An existing file keeps its mode.
fn open_file(path: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    }
    options.open(path)
}

/// The writer thread: appends what comes, reopens when asked, keeps the
/// file under `max_bytes`.
struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    /// Bytes in the file, as far as this writer knows.
    written: u64,
    max_bytes: Option<u64>,
    reopen: Arc<AtomicBool>,
    drops: Arc<Drops>,
    backlog: Arc<LogBacklog>,
    /// One line, serialized.
    buffer: Vec<u8>,
}

impl Writer {
    fn run(mut self, receiver: Receiver<Pending>) {
        let mut busy = false;
        loop {
            // While lines keep coming, naps and looks again rather than
            // blocking: a writer blocked on the queue has every decision's
            // send wake it (a futex call on the decision's thread), one
            // that naps is never waited on. Idle, it blocks, and wakes at
            // least once a second, so that a reopen asked for while nothing
            // is logged still lets go of a rotated file.
            let line = if busy {
                std::thread::sleep(BUSY_NAP);
                match receiver.try_recv() {
                    Ok(line) => Some(line),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                }
            } else {
                match receiver.recv_timeout(Duration::from_secs(1)) {
                    Ok(line) => Some(line),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            busy = line.is_some();
            if self.reopen.swap(false, Ordering::AcqRel) {
                self.reopen_file();
            }
            let Some(line) = line else { continue };
            // Writes what else is queued, then flushes: lines reach the
            // file within a batch.
            let mut ok = self.write(&line);
            let mut taken = 1;
            while let Ok(line) = receiver.try_recv() {
                ok &= self.write(&line);
                taken += 1;
            }
            if !(ok && self.out.flush().is_ok()) {
                tracing::warn!("cannot write the decision log");
            }
            // Progress: DecideStreams waiting for room look again.
            let before = self.backlog.queued.fetch_sub(taken, Ordering::Relaxed);
            self.backlog
                .room
                .progressed(before - taken >= self.backlog.half);
        }
    }

    fn write(&mut self, pending: &Pending) -> bool {
        self.buffer.clear();
        let serialized = match pending {
            // A decision's line by hand (`json.rs`): the same bytes as
            // serde's, a fraction of the instructions.
            Pending::Decision(record) => {
                record.write_json(&mut self.buffer);
                Ok(())
            }
            Pending::Line(line) => serde_json::to_writer(&mut self.buffer, line),
            Pending::Flush(done) => {
                let flushed = self.out.flush().is_ok();
                let _ = done.try_send(());
                return flushed;
            }
        };
        if serialized.is_err() {
            return true;
        }
        self.buffer.push(b'\n');
        let size = self.buffer.len() as u64;
        if self
            .max_bytes
            .is_some_and(|max| self.written.saturating_add(size) > max)
        {
            if self.drops.count(1) {
                tracing::warn!(
                    "the decision log reached decision_log.max_bytes: dropping lines until it is rotated and reopened (SIGHUP), counted in retryd_decision_log_dropped_total"
                );
            }
            return true;
        }
        self.written = self.written.saturating_add(size);
        self.out.write_all(&self.buffer).is_ok()
    }

    /// After a rotation (logrotate moves the file, then sends SIGHUP): the
    /// lines so far stay in the old file, the next go to a new one.
    fn reopen_file(&mut self) {
        if self.out.flush().is_err() {
            tracing::warn!("cannot write the decision log");
        }
        match open_file(&self.path) {
            Ok(file) => {
                self.written = file.metadata().map_or(0, |meta| meta.len());
                self.out = BufWriter::with_capacity(WRITE_BUFFER, file);
                tracing::info!(path = %self.path.display(), "decision log reopened");
            }
            Err(error) => tracing::warn!(
                %error,
                path = %self.path.display(),
                "cannot reopen the decision log; writing on to the file already open"
            ),
        }
    }
}

impl DecisionLog {
    /// Opens `path` for appending (created 0600 if missing, never through
    /// a symbolic link) and starts the writer thread, with room for `queue`
    /// lines and, with `max_bytes`, a bound on the file's size.
    pub fn open(path: &Path, queue: usize, max_bytes: Option<u64>) -> std::io::Result<DecisionLog> {
        let file = open_file(path)?;
        let written = file.metadata()?.len();
        let (lines, receiver) = mpsc::sync_channel::<Pending>(queue.max(1));
        let drops = Arc::new(Drops::default());
        let reopen = Arc::new(AtomicBool::new(false));
        let backlog = Arc::new(LogBacklog {
            queued: AtomicUsize::new(0),
            half: (queue.max(1) / 2).max(1),
            room: Room::new(
                "the decision log's writer is not keeping up: DecideStreams no longer wait for it, and lines are dropped when its queue is full (retryd_decision_log_dropped_total)",
            ),
            drops: Arc::clone(&drops),
        });
        let writer = Writer {
            path: path.to_owned(),
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
            written,
            max_bytes,
            reopen: Arc::clone(&reopen),
            drops: Arc::clone(&drops),
            backlog: Arc::clone(&backlog),
            buffer: Vec::with_capacity(1024),
        };
        std::thread::Builder::new()
            .name("retryd-decision-log".into())
            .spawn(move || writer.run(receiver))?;
        Ok(DecisionLog {
            lines,
            opened: Instant::now(),
            drops,
            reopen,
            backlog,
        })
    }

    /// The queue, for a DecideStream's back-pressure (`telemetry/pace.rs`).
    pub fn backlog(&self) -> Arc<dyn Backlog> {
        Arc::clone(&self.backlog) as Arc<dyn Backlog>
    }

    /// Counts drops in `metrics` too.
    pub fn count_drops_in(&mut self, metrics: Arc<Metrics>) {
        let _ = self.drops.metrics.set(metrics);
    }

    /// Lines dropped because the queue was full or the file at its bound.
    pub fn dropped(&self) -> u64 {
        self.drops.dropped.load(Ordering::Relaxed)
    }

    /// Waits, up to `within`, until every line sent before this call is
    /// in the file: the writer thread appends a moment after each
    /// decision, and a process that stops must not leave its last lines
    /// in the queue. Blocking: call it off the runtime's workers.
    pub fn flush(&self, within: Duration) -> bool {
        let (done, flushed) = mpsc::sync_channel(1);
        // Counted before it is sent: the writer counts it off once taken.
        self.backlog.queued.fetch_add(1, Ordering::Relaxed);
        if self.lines.send(Pending::Flush(done)).is_err() {
            self.backlog.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        flushed.recv_timeout(within).is_ok()
    }

    /// Has the writer reopen the file by its path (within a second), for
    /// log rotation: what SIGHUP does.
    pub fn reopen(&self) {
        self.reopen.store(true, Ordering::Release);
    }

    fn stamp(&self) -> (u64, u64) {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        let clock_ns = u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        (clock_ns, unix_ms)
    }

    fn send(&self, pending: Pending) {
        // Counted before it is sent, so that the writer, which counts it
        // off once taken, never counts below zero.
        self.backlog.queued.fetch_add(1, Ordering::Relaxed);
        match self.lines.try_send(pending) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.backlog.queued.fetch_sub(1, Ordering::Relaxed);
                if self.drops.count(1) {
                    tracing::warn!(
                        "the decision log cannot keep up: dropping lines (counted in retryd_decision_log_dropped_total)"
                    );
                }
            }
        }
    }

    /// Logs a decision: its record is copied here, and made a line and
    /// serialized on the writer's thread.
    pub fn decision(&self, decided: &Decided<'_>) {
        let (clock_ns, unix_ms) = self.stamp();
        self.send(Pending::Decision(Box::new(DecisionRecord::new(
            decided, clock_ns, unix_ms,
        ))));
    }

    /// Logs one deposited entry of a traffic report.
    pub fn report(&self, upstream: &str, requests: u64) {
        let (clock_ns, unix_ms) = self.stamp();
        self.send(Pending::Line(Line::Report(ReportLine {
            v: VERSION,
            clock_ns,
            unix_ms,
            upstream: upstream.to_owned(),
            requests,
        })));
    }

    /// Logs a kill-switch flip.
    pub fn retries_enabled(&self, upstream: &str, enabled: bool) {
        let (clock_ns, unix_ms) = self.stamp();
        self.send(Pending::Line(Line::RetriesEnabled(SwitchLine {
            v: VERSION,
            clock_ns,
            unix_ms,
            upstream: upstream.to_owned(),
            enabled,
        })));
    }
}

/// What the writer thread is given: a decision's record, or a line.
#[derive(Debug)]
enum Pending {
    /// Boxed: the queue holds its slots from the start.
    Decision(Box<DecisionRecord>),
    Line(Line),
    /// Flush what came before, then say so (at shutdown).
    Flush(mpsc::SyncSender<()>),
}

/// A [`DecisionLine`] borrowed from its record, serialized by serde: the
/// reference the hand-written line (`json.rs`) is tested against, byte
/// for byte.
#[cfg(test)]
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum LineView<'a> {
    Decision(DecisionLineView<'a>),
}

#[cfg(test)]
#[derive(Serialize)]
struct DecisionLineView<'a> {
    v: u32,
    clock_ns: u64,
    unix_ms: u64,
    decision_id: &'a str,
    principal: &'a str,
    upstream: &'a str,
    operation: &'a str,
    idempotency: &'a str,
    replayability: &'a str,
    attempt: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    evidence: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failure: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    http_status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    grpc_status: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    grpc_pushback: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline_remaining_ns: Option<u64>,
    first_byte_delivered: bool,
    runtime_draining: bool,
    auth_refresh_attempted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    previous_backoff_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_attempts: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lineage: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retried_below: Option<&'a str>,
    now_unix_ns: u64,
    jitter: f64,
    verdict: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    deny_reason: Option<&'a str>,
    rule: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    backoff_ns: Option<u64>,
    tokens_remaining: f64,
    shadow: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    unknown_outcome: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hedge: Option<HedgeLine>,
}

/// The strings of a [`DecisionRecord`], by index.
const DECISION_ID: usize = 0;
const PRINCIPAL: usize = 1;
const UPSTREAM: usize = 2;
const OPERATION: usize = 3;
const RETRY_AFTER: usize = 4;
const GRPC_PUSHBACK: usize = 5;
const LINEAGE: usize = 6;
const RETRIED_BELOW: usize = 7;
const TEXTS: usize = 8;

/// A decision as the decision's thread captures it: the call's strings
/// copied into one buffer, the rest as numbers and static names. The
/// writer makes it a [`DecisionLine`] and serializes it, off the
/// decision's thread (issue 34).
#[derive(Debug)]
struct DecisionRecord {
    /// The call's strings, indexed by the constants above.
    texts: Texts<TEXTS>,
    clock_ns: u64,
    unix_ms: u64,
    idempotency: &'static str,
    replayability: &'static str,
    attempt: u32,
    evidence: Option<&'static str>,
    failure: Option<&'static str>,
    http_status: Option<u16>,
    grpc_status: Option<u32>,
    deadline_remaining_ns: Option<u64>,
    first_byte_delivered: bool,
    runtime_draining: bool,
    auth_refresh_attempted: bool,
    previous_backoff_ns: Option<u64>,
    max_attempts: Option<u32>,
    now_unix_ns: u64,
    jitter: f64,
    verdict: &'static str,
    deny_reason: Option<&'static str>,
    rule: u8,
    backoff_ns: Option<u64>,
    tokens_remaining: f64,
    shadow: bool,
    unknown_outcome: Option<&'static str>,
    hedge: Option<HedgeLine>,
}

impl DecisionRecord {
    fn new(decided: &Decided<'_>, clock_ns: u64, unix_ms: u64) -> DecisionRecord {
        let facts = decided.facts();
        let decision = &decided.decision;
        let nanos = |duration: Duration| u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let (deny_reason, backoff_ns) = match decision.verdict {
            Verdict::Deny(reason) => (Some(reason.as_str()), None),
            Verdict::Retry { backoff, .. } => (None, Some(nanos(backoff))),
            Verdict::Ambiguous => (None, None),
        };
        let parts = [
            Some(decided.decision_id.as_str()),
            Some(decided.principal.name.as_str()),
            Some(decided.attempt.upstream),
            Some(decided.attempt.operation),
            facts.retry_after,
            facts.grpc_pushback,
            Some(facts.lineage.as_str()).filter(|raw| !raw.is_empty()),
            facts.retried_below,
        ];
        let texts = Texts::pack(parts);
        DecisionRecord {
            texts,
            clock_ns,
            unix_ms,
            idempotency: facts.idempotency.as_str(),
            replayability: facts.body.replayability().as_str(),
            attempt: facts.attempt,
            evidence: facts.claimed_evidence.map(|evidence| evidence.as_str()),
            failure: facts.failure.map(|failure| failure.as_str()),
            http_status: facts.http_status,
            grpc_status: facts.grpc_status.map(GrpcCode::number),
            deadline_remaining_ns: facts.deadline_remaining.map(nanos),
            first_byte_delivered: facts.first_byte_delivered,
            runtime_draining: facts.runtime_draining,
            auth_refresh_attempted: facts.auth_refresh_attempted,
            previous_backoff_ns: facts.previous_backoff.map(nanos),
            max_attempts: facts.max_attempts,
            now_unix_ns: facts.now.duration_since(UNIX_EPOCH).map_or(0, nanos),
            jitter: facts.jitter,
            verdict: decision.verdict.as_str(),
            deny_reason,
            rule: decision.rule.number(),
            backoff_ns,
            tokens_remaining: decided.tokens_remaining,
            shadow: decided.shadow,
            unknown_outcome: decision.unknown_outcome.map(|mark| mark.as_str()),
            hedge: decision.hedge.map(|note| HedgeLine {
                k: note.hedge,
                delay_ns: nanos(note.delay),
                p50_ns: nanos(note.p50),
                tail_ns: nanos(note.tail),
                samples: note.samples,
                first_attempts: note.first_attempts,
                hedges: note.hedges,
                recent_samples: note.recent.samples,
                recent_p50_ns: nanos(note.recent.p50),
                recent_tail_ns: nanos(note.recent.tail),
            }),
        }
    }

    fn text(&self, index: usize) -> Option<&str> {
        self.texts.get(index)
    }

    /// The line, borrowed from the record, as serde serializes it.
    #[cfg(test)]
    fn view(&self) -> LineView<'_> {
        LineView::Decision(DecisionLineView {
            v: VERSION,
            clock_ns: self.clock_ns,
            unix_ms: self.unix_ms,
            decision_id: self.text(DECISION_ID).unwrap_or_default(),
            principal: self.text(PRINCIPAL).unwrap_or_default(),
            upstream: self.text(UPSTREAM).unwrap_or_default(),
            operation: self.text(OPERATION).unwrap_or_default(),
            idempotency: self.idempotency,
            replayability: self.replayability,
            attempt: self.attempt,
            evidence: self.evidence,
            failure: self.failure,
            http_status: self.http_status,
            retry_after: self.text(RETRY_AFTER),
            grpc_status: self.grpc_status,
            grpc_pushback: self.text(GRPC_PUSHBACK),
            deadline_remaining_ns: self.deadline_remaining_ns,
            first_byte_delivered: self.first_byte_delivered,
            runtime_draining: self.runtime_draining,
            auth_refresh_attempted: self.auth_refresh_attempted,
            previous_backoff_ns: self.previous_backoff_ns,
            max_attempts: self.max_attempts,
            lineage: self.text(LINEAGE),
            retried_below: self.text(RETRIED_BELOW),
            now_unix_ns: self.now_unix_ns,
            jitter: self.jitter,
            verdict: self.verdict,
            deny_reason: self.deny_reason,
            rule: self.rule,
            backoff_ns: self.backoff_ns,
            tokens_remaining: self.tokens_remaining,
            shadow: self.shadow,
            unknown_outcome: self.unknown_outcome,
            hedge: self.hedge,
        })
    }

    /// The line, in the format's terms (owned), as the view serializes.
    #[cfg(test)]
    fn line(&self) -> DecisionLine {
        let owned = |text: Option<&str>| text.map(str::to_owned);
        DecisionLine {
            v: VERSION,
            clock_ns: self.clock_ns,
            unix_ms: self.unix_ms,
            decision_id: owned(self.text(DECISION_ID)).unwrap_or_default(),
            principal: owned(self.text(PRINCIPAL)).unwrap_or_default(),
            upstream: owned(self.text(UPSTREAM)).unwrap_or_default(),
            operation: owned(self.text(OPERATION)).unwrap_or_default(),
            idempotency: self.idempotency.to_owned(),
            replayability: self.replayability.to_owned(),
            attempt: self.attempt,
            evidence: owned(self.evidence),
            failure: owned(self.failure),
            http_status: self.http_status,
            retry_after: owned(self.text(RETRY_AFTER)),
            grpc_status: self.grpc_status,
            grpc_pushback: owned(self.text(GRPC_PUSHBACK)),
            deadline_remaining_ns: self.deadline_remaining_ns,
            first_byte_delivered: self.first_byte_delivered,
            runtime_draining: self.runtime_draining,
            auth_refresh_attempted: self.auth_refresh_attempted,
            previous_backoff_ns: self.previous_backoff_ns,
            max_attempts: self.max_attempts,
            lineage: owned(self.text(LINEAGE)),
            retried_below: owned(self.text(RETRIED_BELOW)),
            now_unix_ns: self.now_unix_ns,
            jitter: self.jitter,
            verdict: self.verdict.to_owned(),
            deny_reason: owned(self.deny_reason),
            rule: self.rule,
            backoff_ns: self.backoff_ns,
            tokens_remaining: self.tokens_remaining,
            shadow: self.shadow,
            unknown_outcome: owned(self.unknown_outcome),
            hedge: self.hedge,
        }
    }
}

/// The attempt of a logged decision and its draw, in the engine's terms,
/// to decide again. `Err` names the field that does not read.
pub fn attempt_of(line: &DecisionLine) -> Result<(Attempt<'_>, Draw), &'static str> {
    let nanos = Duration::from_nanos;
    let body = body_of(&line.replayability).ok_or("replayability")?;
    let reported = Facts {
        idempotency: idempotency_of(&line.idempotency).ok_or("idempotency")?,
        body: &NO_BODY,
        attempt: line.attempt,
        claimed_evidence: match &line.evidence {
            None => None,
            Some(name) => Some(evidence_of(name).ok_or("evidence")?),
        },
        failure: match &line.failure {
            None => None,
            Some(name) => Some(FailureKind::from_name(name).ok_or("failure")?),
        },
        http_status: line.http_status,
        retry_after: line.retry_after.as_deref(),
        grpc_status: match line.grpc_status {
            None => None,
            Some(number) => Some(GrpcCode::from_number(number).ok_or("grpc_status")?),
        },
        grpc_pushback: line.grpc_pushback.as_deref(),
        deadline_remaining: line.deadline_remaining_ns.map(nanos),
        first_byte_delivered: line.first_byte_delivered,
        runtime_draining: line.runtime_draining,
        auth_refresh_attempted: line.auth_refresh_attempted,
        previous_backoff: line.previous_backoff_ns.map(nanos),
        max_attempts: line.max_attempts,
        lineage: match &line.lineage {
            None => Lineage::EDGE,
            Some(raw) => Lineage::parse(raw).map_err(|_| "lineage")?,
        },
        retried_below: match &line.retried_below {
            None => None,
            Some(layer) => Some(layer_name(layer).map_err(|_| "retried_below")?),
        },
        budget: crate::engine::BudgetView::OPEN,
        now: UNIX_EPOCH,
        jitter: 0.0,
    };
    let attempt = Attempt {
        upstream: &line.upstream,
        operation: &line.operation,
        body,
        hedge: line.hedge.map_or(0, |hedge| hedge.k),
        reported,
    };
    let draw = Draw {
        now: UNIX_EPOCH + nanos(line.now_unix_ns),
        jitter: line.jitter,
    };
    Ok((attempt, draw))
}

/// The fleet's state a logged hedge decision was made on.
pub fn hedge_state_of(line: &HedgeLine) -> crate::engine::HedgeState {
    let nanos = Duration::from_nanos;
    crate::engine::HedgeState {
        samples: line.samples,
        p50: nanos(line.p50_ns),
        delay: nanos(line.delay_ns),
        tail: nanos(line.tail_ns),
        first_attempts: line.first_attempts,
        hedges: line.hedges,
        recent: crate::engine::RecentLatency {
            samples: line.recent_samples,
            p50: nanos(line.recent_p50_ns),
            tail: nanos(line.recent_tail_ns),
        },
    }
}

/// A body of the given replayability, as the engine reads it.
pub fn body_of(replayability: &str) -> Option<Body> {
    Some(match replayability {
        "replayable" => Body::Bytes,
        "reopenable" => Body::ReopenableSupplier,
        "one_shot" => Body::InputStream,
        _ => return None,
    })
}

fn idempotency_of(name: &str) -> Option<Idempotency> {
    [
        Idempotency::Safe,
        Idempotency::Idempotent,
        Idempotency::IdempotentWithKey,
        Idempotency::NonIdempotent,
    ]
    .into_iter()
    .find(|idempotency| idempotency.as_str() == name)
}

fn evidence_of(name: &str) -> Option<Evidence> {
    [
        Evidence::NotSent,
        Evidence::SentNoResponse,
        Evidence::ResponseReceived,
        Evidence::PartialResponse,
    ]
    .into_iter()
    .find(|evidence| evidence.as_str() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_returns_once_every_line_before_it_is_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let log = DecisionLog::open(&path, 1024, None).unwrap();
        for n in 0..500 {
            log.report("flushed", n);
        }
        assert!(log.flush(Duration::from_secs(30)));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 500);
        assert!(text.ends_with('\n'));
    }

    fn record(all: bool) -> DecisionRecord {
        let some = |text: &'static str| all.then_some(text);
        let parts = [
            Some("0123456789abcdef0123456789abcdef"),
            Some("checkout \"svc\""),
            Some("payments"),
            Some(""),
            some("120"),
            some("250"),
            some("edge:2/middle:1"),
            some("middle"),
        ];
        let texts = Texts::pack(parts);
        DecisionRecord {
            texts,
            clock_ns: 12_345,
            unix_ms: 1_764_000_000_000,
            idempotency: "idempotent",
            replayability: "replayable",
            attempt: 2,
            evidence: all.then_some("not_sent"),
            failure: all.then_some("connect"),
            http_status: all.then_some(503),
            grpc_status: all.then_some(14),
            deadline_remaining_ns: all.then_some(5_000_000),
            first_byte_delivered: all,
            runtime_draining: false,
            auth_refresh_attempted: all,
            previous_backoff_ns: all.then_some(100),
            max_attempts: all.then_some(3),
            now_unix_ns: 1_764_000_000_000_000_001,
            jitter: 0.375,
            verdict: if all { "retry" } else { "deny" },
            deny_reason: (!all).then_some("not_retryable"),
            rule: 4,
            backoff_ns: all.then_some(12_250_000),
            tokens_remaining: 9.5,
            shadow: all,
            unknown_outcome: all.then_some("reconcile"),
            hedge: all.then_some(HedgeLine {
                k: 1,
                delay_ns: 40_000_000,
                p50_ns: 10_000_000,
                tail_ns: 200_000_000,
                samples: 1_000,
                first_attempts: 1_000,
                hedges: 3,
                recent_samples: 150,
                recent_p50_ns: 11_000_000,
                recent_tail_ns: 190_000_000,
            }),
        }
    }

    #[test]
    fn the_writer_serializes_a_record_as_the_format_says() {
        for all in [true, false] {
            let record = record(all);
            let view = serde_json::to_string(&record.view()).unwrap();
            let line = Line::Decision(Box::new(record.line()));
            assert_eq!(view, serde_json::to_string(&line).unwrap());
            assert_eq!(serde_json::from_str::<Line>(&view).unwrap(), line);
        }
    }
}
