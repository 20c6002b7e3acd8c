//! `retryd replay`: decides a recorded decision log again under another
//! configuration, budgets included, in the order the log has them.
//!
//! The lines are decided by the live service's own pipeline (`Decider`),
//! over a memory store whose clock is set to each line's `clock_ns`: every upstream's bucket starts from its
//! initial tokens at its first line, takes the logged reports' deposits and
//! the floor over the logged time, and pays the replayed RETRYs. Replayed
//! against the configuration that recorded it (one replica on the memory
//! store, the log on from its start), a log gives back the recorded
//! verdicts; against a candidate, what the candidate would have answered.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, Read};

use serde::Serialize;

use super::{Decider, Draw, Live, Report, Traffic, at_once, names};
use crate::auth::{Auth, Principal};
use crate::budget::MemoryBudgetStore;
use crate::budget::memory::ManualClock;
use crate::config::Config;
use crate::decision_log::{DecisionLine, Line, attempt_of, hedge_state_of};
use crate::engine::{Decision, Verdict};

/// What the replay found for one upstream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UpstreamReplay {
    /// Decisions replayed.
    pub decisions: u64,
    /// Real requests reported (deposited).
    pub reported: u64,
    /// Recorded verdicts: retry, deny, ambiguous.
    pub recorded: Verdicts,
    /// Replayed verdicts.
    pub replayed: Verdicts,
    /// Decisions whose replayed verdict or deny reason differs.
    pub changed: u64,
    /// Recorded RETRYs the replay denied for the budget.
    pub retries_now_budget_denials: u64,
    /// Replayed denials by reason.
    pub replayed_denials: BTreeMap<String, u64>,
    /// Replayed decisions whose attempt may have taken effect upstream
    /// (the mark depends on the facts alone, so another policy keeps it).
    pub unknown_outcomes: u64,
}

/// Counts by verdict.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Verdicts {
    /// RETRY.
    pub retry: u64,
    /// DENY.
    pub deny: u64,
    /// AMBIGUOUS.
    pub ambiguous: u64,
}

impl Verdicts {
    fn count(&mut self, verdict: &str) {
        match verdict {
            "retry" => self.retry += 1,
            "deny" => self.deny += 1,
            _ => self.ambiguous += 1,
        }
    }
}

/// A replay: per upstream, in name order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Replay {
    /// Lines read.
    pub lines: u64,
    /// Per upstream.
    pub upstreams: BTreeMap<String, UpstreamReplay>,
}

/// The longest line read, in bytes. A recorded line is at most a few KiB
/// (every name in it bounded as the live edge bounds it); reading a longer
/// one whole would let a hostile or corrupt file take memory without limit.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Replays `log` under `config`. An unreadable line is an error naming its
/// number, as is one the live edge would have refused: longer than
/// [`MAX_LINE_BYTES`], an upstream name it would not accept, a report
/// larger than it allows, or an upstream beyond `limits.max_upstreams`
/// distinct ones (the live store would not have tracked it).
pub fn replay(config: &Config, mut log: impl BufRead) -> Result<Replay, String> {
    let clock = ManualClock::default();
    // Bounded by `check_line`: at most `limits.max_upstreams` unconfigured
    // upstreams, as the live store tracks.
    let store = MemoryBudgetStore::with_clock(usize::MAX, clock.clone());
    // One caller who may use every upstream: the log's principals were
    // authorised when it was written, and shares bound what `check_line`
    // already bounds.
    let decider = Decider::new(
        store,
        Live {
            policies: config.policies.clone(),
            auth: Auth::disabled(),
        },
        None,
        config.evict_idle_after,
        config.report_ids.window,
    );
    let live = decider.live_full();
    let principal = live
        .auth
        .authenticate(None, [])
        .map_err(|error| format!("replay: {error}"))?;
    let mut unconfigured = HashSet::new();
    let mut replay = Replay::default();
    let mut last_clock: Option<u64> = None;
    let mut bytes = Vec::new();
    for number in 1.. {
        bytes.clear();
        let read = (&mut log)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut bytes)
            .map_err(|error| format!("line {number}: {error}"))?;
        if read == 0 {
            break;
        }
        if bytes.len() > MAX_LINE_BYTES {
            return Err(format!("line {number}: longer than {MAX_LINE_BYTES} bytes"));
        }
        let text =
            std::str::from_utf8(&bytes).map_err(|error| format!("line {number}: {error}"))?;
        if text.trim().is_empty() {
            continue;
        }
        let line: Line =
            serde_json::from_str(text).map_err(|error| format!("line {number}: {error}"))?;
        check_line(config, &mut unconfigured, &line)
            .map_err(|error| format!("line {number}: {error}"))?;
        replay.lines = replay.lines.saturating_add(1);
        let clock_ns = match &line {
            Line::Decision(line) => line.clock_ns,
            Line::Report(line) => line.clock_ns,
            Line::RetriesEnabled(line) => line.clock_ns,
        };
        // Moves the simulated clock to the line's time (never back).
        if let Some(last) = last_clock {
            clock.advance(clock_ns.saturating_sub(last));
        }
        last_clock = Some(last_clock.map_or(clock_ns, |last| last.max(clock_ns)));
        match line {
            Line::Report(report) => {
                // The log holds the requests the entry funded (after the
                // adaptive rule): deposited again as they are.
                let entries = [Traffic::requests(report.upstream.as_str(), report.requests)];
                let report_all = Report {
                    entries: &entries,
                    id: None,
                };
                // As logged: the entry was deposited live, so it is here.
                let _ = at_once(decider.report(&live, principal, report_all, &()), || {
                    Ok((0, 0))
                });
                // Saturating: a log's sums must not wrap into nonsense.
                let upstream = replay.upstreams.entry(report.upstream).or_default();
                upstream.reported = upstream.reported.saturating_add(report.requests);
            }
            Line::RetriesEnabled(switch) => {
                let switched = decider.set_retries_enabled(
                    &live,
                    principal,
                    &switch.upstream,
                    switch.enabled,
                    &(),
                );
                let _ = at_once(switched, || Ok(true));
            }
            Line::Decision(recorded) => {
                let decision = decide_again(&decider, &live, principal, &recorded)
                    .map_err(|field| format!("line {number}: {field} does not read"))?;
                tally(
                    replay
                        .upstreams
                        .entry(recorded.upstream.clone())
                        .or_default(),
                    &recorded,
                    &decision,
                );
            }
        }
    }
    Ok(replay)
}

/// The live edge's rules, applied to a line: an upstream name it accepts,
/// a report it would take, and no more distinct unconfigured upstreams
/// than the store tracks (`unconfigured`, those seen so far).
fn check_line(
    config: &Config,
    unconfigured: &mut HashSet<String>,
    line: &Line,
) -> Result<(), String> {
    let upstream = match line {
        Line::Decision(line) => &line.upstream,
        Line::Report(line) => {
            if line.requests > MAX_REPORTED_REQUESTS {
                return Err(format!(
                    "requests: more than {MAX_REPORTED_REQUESTS} in one report"
                ));
            }
            &line.upstream
        }
        Line::RetriesEnabled(line) => &line.upstream,
    };
    names::upstream("upstream", upstream).map_err(|error| error.to_string())?;
    if config.policies.get(upstream).bucket.configured || unconfigured.contains(upstream) {
        return Ok(());
    }
    if unconfigured.len() >= config.max_upstreams {
        return Err(format!(
            "upstream: more than limits.max_upstreams ({}) distinct unconfigured upstreams; raise it in the replay's configuration",
            config.max_upstreams
        ));
    }
    unconfigured.insert(upstream.clone());
    Ok(())
}

/// The most requests one traffic report entry may carry, as the edge
/// (`validate::traffic_report`) allows.
const MAX_REPORTED_REQUESTS: u64 = 1_000_000_000;

/// A logged decision decided again by `decider`, with the logged draw.
fn decide_again(
    decider: &Decider<MemoryBudgetStore<ManualClock>>,
    live: &Live,
    principal: &Principal,
    recorded: &DecisionLine,
) -> Result<Decision, &'static str> {
    let (attempt, draw): (_, Draw) = attempt_of(recorded)?;
    // A hedge is decided again on the fleet's state it was decided on live.
    let hedge_state = recorded.hedge.as_ref().map(hedge_state_of);
    let decided = decider
        .begin_with(live, principal, attempt, draw, hedge_state)
        .and_then(|begun| decider.decide_now(begun, &()));
    // The memory store answers at once and tracks every upstream
    // `check_line` let through, so no refusal is expected here.
    decided
        .map(|decided| decided.decision)
        .map_err(|_| "upstream (the replay's budget store refused it)")
}

fn tally(upstream: &mut UpstreamReplay, recorded: &DecisionLine, replayed: &Decision) {
    upstream.decisions += 1;
    upstream.recorded.count(&recorded.verdict);
    upstream.replayed.count(replayed.verdict.as_str());
    let replayed_reason = match replayed.verdict {
        Verdict::Deny(reason) => Some(reason.as_str()),
        _ => None,
    };
    let replayed_mark = replayed.unknown_outcome.map(|mark| mark.as_str());
    if replayed_mark.is_some() {
        upstream.unknown_outcomes += 1;
    }
    // A log from before the mark existed has none to compare.
    let mark_changed =
        recorded.unknown_outcome.is_some() && recorded.unknown_outcome.as_deref() != replayed_mark;
    if replayed.verdict.as_str() != recorded.verdict
        || replayed_reason != recorded.deny_reason.as_deref()
        || mark_changed
    {
        upstream.changed += 1;
    }
    if let Some(reason) = replayed_reason {
        *upstream
            .replayed_denials
            .entry(reason.to_owned())
            .or_default() += 1;
        if recorded.verdict == "retry" && matches!(reason, "budget_exhausted") {
            upstream.retries_now_budget_denials += 1;
        }
    }
}

impl Replay {
    /// The replay as a table, one row per upstream.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<24} {:>9} {:>9} {:>15} {:>15} {:>8} {:>12} {:>8}\n",
            "upstream",
            "decisions",
            "reported",
            "recorded r/d/a",
            "replayed r/d/a",
            "changed",
            "retry→budget",
            "unknown"
        );
        for (name, upstream) in &self.upstreams {
            let triple = |v: &Verdicts| format!("{}/{}/{}", v.retry, v.deny, v.ambiguous);
            out.push_str(&format!(
                "{:<24} {:>9} {:>9} {:>15} {:>15} {:>8} {:>12} {:>8}\n",
                name,
                upstream.decisions,
                upstream.reported,
                triple(&upstream.recorded),
                triple(&upstream.replayed),
                upstream.changed,
                upstream.retries_now_budget_denials,
                upstream.unknown_outcomes
            ));
        }
        out
    }
}
