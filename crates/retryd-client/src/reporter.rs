//! The traffic reporter: first-attempt counts batched into `ReportTraffic`
//! calls, each batch with a random `report_id` that it keeps when re-sent,
//! as every other client does.
//!
//! Budgets fill from reported first attempts only ("retries never fund
//! retries"), so [`TrafficReporter::record`] is called once per real
//! request, never for a retry. A batch retryd did not take (unreachable,
//! timed out, ABORTED, a partial failure) is re-sent later with the same
//! id and the same entries in the same order, so retryd applies each entry
//! at most once; counts recorded meanwhile wait for the next batch. A batch
//! refused for good (PERMISSION_DENIED, RESOURCE_EXHAUSTED,
//! INVALID_ARGUMENT) is dropped with one warning and counted in
//! [`TrafficReporter::dropped`].
//!
//! Reports also carry outcomes, so that a budget can follow the upstream's
//! health: [`TrafficReporter::record_outcome`] once per finished attempt,
//! first attempts (`successes`, `failures`) apart from retries
//! (`retry_successes`, `retry_failures`). An attempt is a failure when the
//! caller asked (or would ask) retryd or its local rule whether to retry it
//! (not sent, no response, a retryable status); every other ending is a
//! success, a 404 included. An attempt the caller cancelled or abandoned (a
//! dropped future) is neither. Both adapters record every attempt's outcome
//! by default. A batch carries each upstream's requests and outcomes
//! together, and a re-sent batch the same counts; beyond the upstream bound
//! outcomes are dropped with the requests.
//!
//! And latencies, for hedging: [`TrafficReporter::record_latency`] once
//! per finished first attempt (never a retry or a hedge), the successes
//! apart from the failures, in the contract's `LatencyHistogram` buckets.
//! retryd merges them fleet-wide and answers each report with the hedging
//! of its upstreams, kept here for [`TrafficReporter::hedging`]: a fresh
//! process learns a hedge delay within one report interval.
//!
//! It sends through [`crate::Client`]; it makes no decision.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use retryd_engine::latency::Histogram;
use retryd_proto as pb;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::client::{Client, Error, Inner};
use crate::request::MAX_TRAFFIC_ENTRIES;

/// How many report intervals a served hedging outlives the last answer
/// that carried it. An answer lists only the upstreams of its own report,
/// so an upstream idle for an interval is missing from it with its policy
/// unchanged: forgetting it at once would leave the next calls unhedged.
/// Three intervals ride out an idle interval or two and a re-sent batch,
/// while with retryd unreachable (no answers at all) the entry is gone
/// within seconds and the local rule's hedging applies, not a stale delay
/// (as the Go client's `hedgingStaleAfter`).
pub const HEDGING_STALE_AFTER: u32 = 3;

/// How the reporter batches.
#[derive(Clone, Debug)]
pub struct ReporterOptions {
    /// How often pending counts are sent (default 1 s).
    pub interval: Duration,
    /// Most distinct upstreams held while retryd is unreachable (default
    /// 10,000); counts for more are dropped and counted.
    pub max_upstreams: usize,
}

impl Default for ReporterOptions {
    fn default() -> Self {
        ReporterOptions {
            interval: Duration::from_secs(1),
            max_upstreams: 10_000,
        }
    }
}

/// What a report carries for one upstream: the first attempts sent, and how
/// attempts ended (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// First attempts sent.
    pub requests: u64,
    /// First attempts that succeeded.
    pub successes: u64,
    /// First attempts that failed.
    pub failures: u64,
    /// Retries (attempts after the first) that succeeded.
    pub retry_successes: u64,
    /// Retries that failed.
    pub retry_failures: u64,
    /// Hedged calls whose answer came from a hedge rather than from the
    /// first attempt ([`TrafficReporter::record_hedge_won`]).
    pub hedges_won: u64,
}

impl Traffic {
    fn add(&mut self, other: &Traffic) {
        self.requests += other.requests;
        self.successes += other.successes;
        self.failures += other.failures;
        self.retry_successes += other.retry_successes;
        self.retry_failures += other.retry_failures;
        self.hedges_won += other.hedges_won;
    }

    /// The counts of one report entry.
    pub fn of(entry: &pb::UpstreamTraffic) -> Traffic {
        Traffic {
            requests: entry.requests,
            successes: entry.successes,
            failures: entry.failures,
            retry_successes: entry.retry_successes,
            retry_failures: entry.retry_failures,
            hedges_won: entry.hedges_won,
        }
    }

    /// The report entry for `upstream`.
    pub fn entry(&self, upstream: String) -> pb::UpstreamTraffic {
        pb::UpstreamTraffic {
            upstream,
            requests: self.requests,
            successes: self.successes,
            failures: self.failures,
            retry_successes: self.retry_successes,
            retry_failures: self.retry_failures,
            hedges_won: self.hedges_won,
            ..Default::default()
        }
    }
}

/// The gRPC codes that make an attempt a failure in the outcome counts:
/// those the retry tables can retry (UNAVAILABLE and DEADLINE_EXCEEDED as
/// 502-504 and "no response", RESOURCE_EXHAUSTED as 429, UNAUTHENTICATED as
/// 401, INTERNAL and UNKNOWN as 500), the twins of the HTTP statuses the
/// reqwest middleware asks about. Every other code is a success (the
/// upstream answered, as a 404), except CANCELLED: the caller's own, counted
/// as neither.
pub const FAILURE_CODES: [tonic::Code; 6] = [
    tonic::Code::Unavailable,
    tonic::Code::DeadlineExceeded,
    tonic::Code::ResourceExhausted,
    tonic::Code::Unauthenticated,
    tonic::Code::Internal,
    tonic::Code::Unknown,
];

/// How a gRPC attempt that ended with `code` counts: `Some(true)` a
/// success, `Some(false)` a failure, `None` neither (CANCELLED).
pub fn attempt_succeeded(code: tonic::Code) -> Option<bool> {
    match code {
        tonic::Code::Cancelled => None,
        code => Some(!FAILURE_CODES.contains(&code)),
    }
}

/// Batches first-attempt counts and outcomes into `ReportTraffic` calls;
/// see the module docs. Recording is a map increment under a lock.
#[derive(Debug)]
pub struct TrafficReporter {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    client: Weak<Inner>,
    options: ReporterOptions,
    counts: Mutex<Counts>,
    // One flush at a time: the unsent batches are re-sent in order.
    sending: tokio::sync::Mutex<VecDeque<pb::ReportTrafficRequest>>,
    stop: Notify,
    stopped: std::sync::atomic::AtomicBool,
    /// The hedging retryd last answered, per upstream, and when.
    hedging: Mutex<HashMap<String, (pb::Hedging, Instant)>>,
}

#[derive(Debug, Default)]
struct Counts {
    pending: HashMap<String, Traffic>,
    /// First attempts' latencies since the last cut: successes, failures.
    latencies: HashMap<String, Box<(Histogram, Histogram)>>,
    dropped: u64,
}

/// A histogram as the contract carries it: its non-empty buckets.
fn histogram(histogram: &Histogram) -> Option<pb::LatencyHistogram> {
    (histogram.total() > 0).then(|| pb::LatencyHistogram {
        counts: histogram.buckets().collect(),
    })
}

impl TrafficReporter {
    pub(crate) fn new(client: Client, options: ReporterOptions) -> TrafficReporter {
        TrafficReporter {
            shared: Arc::new(Shared {
                client: Arc::downgrade(&client.inner),
                options,
                counts: Mutex::new(Counts::default()),
                sending: tokio::sync::Mutex::new(VecDeque::new()),
                stop: Notify::new(),
                stopped: std::sync::atomic::AtomicBool::new(false),
                hedging: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Counts `requests` first attempts to `upstream` (and deposits them in
    /// the local fallback's bucket).
    pub fn record(&self, upstream: &str, requests: u64) {
        if requests == 0 || upstream.is_empty() {
            return;
        }
        if let Some(inner) = self.shared.client.upgrade() {
            inner.fallback.record_traffic(upstream, requests);
        }
        self.add(
            upstream,
            Traffic {
                requests,
                ..Traffic::default()
            },
        );
    }

    /// Counts how one attempt to `upstream` ended: `retry` false for a
    /// first attempt (`successes`, `failures`), true for an attempt after
    /// it (`retry_successes`, `retry_failures`). See the module docs for
    /// the rule.
    pub fn record_outcome(&self, upstream: &str, success: bool, retry: bool) {
        if upstream.is_empty() {
            return;
        }
        let mut traffic = Traffic::default();
        *match (retry, success) {
            (false, true) => &mut traffic.successes,
            (false, false) => &mut traffic.failures,
            (true, true) => &mut traffic.retry_successes,
            (true, false) => &mut traffic.retry_failures,
        } = 1;
        self.add(upstream, traffic);
    }

    /// Counts how long one first attempt to `upstream` took, from sending
    /// to its answer, as a success or a failure (as
    /// [`TrafficReporter::record_outcome`] counts it). Never a retry or a
    /// hedge. Bounded like the counts: beyond the upstream bound, dropped.
    pub fn record_latency(&self, upstream: &str, success: bool, latency: Duration) {
        if upstream.is_empty() {
            return;
        }
        let mut counts = self.shared.counts.lock().unwrap_or_else(|e| e.into_inner());
        let max = self.shared.options.max_upstreams;
        if !counts.latencies.contains_key(upstream) && counts.latencies.len() >= max {
            return;
        }
        // The common case, a known upstream, allocates nothing.
        let histograms = match counts.latencies.get_mut(upstream) {
            Some(histograms) => histograms,
            None => counts.latencies.entry(upstream.to_owned()).or_default(),
        };
        if success {
            histograms.0.record(latency);
        } else {
            histograms.1.record(latency);
        }
    }

    /// Counts one hedged call to `upstream` whose answer came from a hedge
    /// (`UpstreamTraffic.hedges_won`): only the caller knows which copy
    /// answered. Both adapters count it when they hedge.
    pub fn record_hedge_won(&self, upstream: &str) {
        if upstream.is_empty() {
            return;
        }
        self.add(
            upstream,
            Traffic {
                hedges_won: 1,
                ..Traffic::default()
            },
        );
    }

    /// The hedging retryd served for `upstream` in its last answer to a
    /// report naming it, if that answer came in the last
    /// [`HEDGING_STALE_AFTER`] report intervals; `None` before one (no hedge
    /// delay known: do not hedge), once it is that old, or for an upstream
    /// without a hedging policy.
    pub fn hedging(&self, upstream: &str) -> Option<pb::Hedging> {
        let stale = self.shared.options.interval * HEDGING_STALE_AFTER;
        self.shared
            .hedging
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(upstream)
            .filter(|(_, seen)| seen.elapsed() <= stale)
            .map(|(hedging, _)| hedging.clone())
    }

    /// How a call to `upstream` of `idempotency` is hedged by what retryd
    /// served: `None` when nothing fresh is known (the local rule may
    /// apply), `Some(None)` when retryd says not to hedge it. Read in place:
    /// a call to an unhedged upstream allocates nothing.
    pub(crate) fn served_plan(
        &self,
        upstream: &str,
        idempotency: retryd_engine::Idempotency,
    ) -> Option<Option<crate::hedge::Plan>> {
        let stale = self.shared.options.interval * HEDGING_STALE_AFTER;
        let hedging = self
            .shared
            .hedging
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (served, seen) = hedging.get(upstream)?;
        if seen.elapsed() > stale {
            return None;
        }
        let delay = served.delay.map_or(Duration::ZERO, |delay| {
            Duration::new(
                delay.seconds.max(0) as u64,
                delay.nanos.clamp(0, 999_999_999) as u32,
            )
        });
        let level = crate::request::pb_idempotency(idempotency) as i32;
        // Never NON_IDEMPOTENT, whatever was served.
        let allowed = served.enabled
            && !delay.is_zero()
            && served.max_hedges > 0
            && idempotency != retryd_engine::Idempotency::NonIdempotent
            && served.idempotency.contains(&level);
        Some(allowed.then_some(crate::hedge::Plan {
            delay,
            max: served.max_hedges,
        }))
    }

    fn add(&self, upstream: &str, traffic: Traffic) {
        let mut counts = self.shared.counts.lock().unwrap_or_else(|e| e.into_inner());
        let max = self.shared.options.max_upstreams;
        // The common case, a known upstream, allocates nothing.
        if let Some(count) = counts.pending.get_mut(upstream) {
            count.add(&traffic);
        } else if counts.pending.len() < max {
            counts.pending.insert(upstream.to_owned(), traffic);
        } else {
            // The outcomes go with them.
            counts.dropped += traffic.requests;
        }
    }

    /// The requests not yet taken by retryd: recorded since the last batch
    /// was cut, plus those of batches kept for a re-send.
    pub async fn pending(&self) -> HashMap<String, u64> {
        self.pending_traffic()
            .await
            .into_iter()
            .filter(|(_, traffic)| traffic.requests > 0)
            .map(|(upstream, traffic)| (upstream, traffic.requests))
            .collect()
    }

    /// [`TrafficReporter::pending`] with the outcomes.
    pub async fn pending_traffic(&self) -> HashMap<String, Traffic> {
        let unsent = self.shared.sending.lock().await;
        let counts = self.shared.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = counts.pending.clone();
        for batch in unsent.iter() {
            for entry in &batch.traffic {
                total
                    .entry(entry.upstream.clone())
                    .or_default()
                    .add(&Traffic::of(entry));
            }
        }
        total
    }

    /// Requests never reported: over the upstream bound, or in a batch
    /// retryd refused for good.
    pub fn dropped(&self) -> u64 {
        self.shared
            .counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dropped
    }

    /// Cuts the pending counts into batches (in upstream order, so a batch
    /// is deterministic) and empties them.
    fn cut(&self) -> VecDeque<pb::ReportTrafficRequest> {
        let (pending, mut latencies) = {
            let mut counts = self.shared.counts.lock().unwrap_or_else(|e| e.into_inner());
            (
                std::mem::take(&mut counts.pending),
                std::mem::take(&mut counts.latencies),
            )
        };
        let mut sorted: BTreeMap<String, Traffic> = pending.into_iter().collect();
        // Latencies of an upstream whose requests went in an earlier batch.
        for upstream in latencies.keys() {
            sorted.entry(upstream.clone()).or_default();
        }
        let entries: Vec<pb::UpstreamTraffic> = sorted
            .into_iter()
            .map(|(upstream, traffic)| {
                let histograms = latencies.remove(&upstream);
                let mut entry = traffic.entry(upstream);
                if let Some(histograms) = histograms {
                    entry.latency_successes = histogram(&histograms.0);
                    entry.latency_failures = histogram(&histograms.1);
                }
                entry
            })
            .collect();
        entries
            .chunks(MAX_TRAFFIC_ENTRIES)
            .map(|chunk| pb::ReportTrafficRequest {
                traffic: chunk.to_vec(),
                report_id: new_report_id(),
            })
            .collect()
    }

    /// Sends what is pending now: first the batches retryd has not taken
    /// yet (same ids), then, once they are all taken, the counts recorded
    /// since. Returns the error of a batch kept for a re-send; a batch
    /// dropped for good is not an error (it is logged and counted).
    pub async fn flush(&self) -> Result<(), Error> {
        let Some(inner) = self.shared.client.upgrade() else {
            return Ok(());
        };
        let client = Client { inner };
        let mut unsent = self.shared.sending.lock().await;
        // While old batches are unsent, new counts keep accumulating in
        // `pending` (bounded) rather than in ever more batches.
        if unsent.is_empty() {
            *unsent = self.cut();
        }
        while let Some(batch) = unsent.front() {
            match client.report_traffic(batch.clone()).await {
                Ok(answer) => {
                    let mut hedging = self
                        .shared
                        .hedging
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    let stale = self.shared.options.interval * HEDGING_STALE_AFTER;
                    hedging.retain(|_, (_, seen)| now.saturating_duration_since(*seen) <= stale);
                    let max = self.shared.options.max_upstreams;
                    for served in answer.hedging {
                        if hedging.len() >= max && !hedging.contains_key(&served.upstream) {
                            continue;
                        }
                        hedging.insert(served.upstream.clone(), (served, now));
                    }
                }
                Err(status) if is_permanent(status.code()) => {
                    // retryd answered, with a refusal: not an outage.
                    client.inner.outage.answered();
                    let requests: u64 = batch.traffic.iter().map(|entry| entry.requests).sum();
                    self.shared
                        .counts
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .dropped += requests;
                    tracing::warn!(
                        target: "retryd_client",
                        "retryd: traffic report {} refused ({:?}), dropping its {requests} request(s) for {} upstream(s): {}",
                        batch.report_id,
                        status.code(),
                        batch.traffic.len(),
                        status.message()
                    );
                }
                Err(status) => {
                    client.inner.outage.report_failed(&format!(
                        "{:?}: {}",
                        status.code(),
                        status.message()
                    ));
                    return Err(Error::Unavailable(status));
                }
            }
            unsent.pop_front();
            if unsent.is_empty() {
                // Everything old is taken: what was recorded meanwhile goes now.
                *unsent = self.cut();
            }
        }
        Ok(())
    }

    /// Sends pending counts every interval until [`TrafficReporter::stop`]
    /// (or until every [`Client`] is dropped).
    pub(crate) fn start(&self) {
        let reporter = TrafficReporter {
            shared: self.shared.clone(),
        };
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(reporter.shared.options.interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                tokio::select! {
                    _ = reporter.shared.stop.notified() => return,
                    _ = ticker.tick() => {}
                }
                if reporter.shared.client.strong_count() == 0 {
                    return;
                }
                // A failure is counted by the outage log and kept.
                let _ = reporter.flush().await;
            }
        });
    }

    /// Stops the background task (the counts stay; [`TrafficReporter::flush`]
    /// still sends them).
    pub fn stop(&self) {
        use std::sync::atomic::Ordering;
        if !self.shared.stopped.swap(true, Ordering::AcqRel) {
            self.shared.stop.notify_one();
        }
    }
}

/// Whether retryd refused a report for good: the same batch would be
/// refused again.
fn is_permanent(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::PermissionDenied
            | tonic::Code::ResourceExhausted
            | tonic::Code::InvalidArgument
    )
}

/// A random UUID (version 4), as the contract suggests.
pub fn new_report_id() -> String {
    let mut bytes: [u8; 16] = rand::random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_report_id_is_a_version_4_uuid() {
        let id = super::new_report_id();
        assert_eq!(id.len(), 36);
        let groups: Vec<&str> = id.split('-').collect();
        assert_eq!(
            groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(groups[2].starts_with('4'));
        assert!(matches!(groups[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b'));
        assert_ne!(id, super::new_report_id());
    }
}
