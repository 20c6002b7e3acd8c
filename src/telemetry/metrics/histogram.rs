//! Latency histograms with fixed buckets, as atomics: recorded without a
//! lock, and with an exemplar per bucket (the trace id of a recent traced
//! observation) held in a seqlock of atomics.
//!
//! Exemplars are written here by hand rather than through
//! `prometheus-client`: its only way to make one is
//! `HistogramWithExemplars::observe`, which takes a write lock per
//! observation, and the decision path takes none.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Upper bounds of the latency histograms, in seconds.
pub(super) const LATENCY_BOUNDS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub(super) struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
    /// One per bucket, `+Inf` last.
    exemplars: [Exemplar; LATENCY_BOUNDS.len() + 1],
}

/// The last traced observation of a bucket. A writer that finds another
/// writing skips (an exemplar is a sample, not a count), and so does one
/// in the millisecond of the last write: at full sampling every decision
/// is traced, and writing each (a compare-and-swap and five stores) bought
/// nothing a scrape would see; a reader that sees a write in progress or
/// finished in between skips too.
#[derive(Debug, Default)]
struct Exemplar {
    /// Odd while written; 0 until the first write.
    sequence: AtomicU64,
    trace_high: AtomicU64,
    trace_low: AtomicU64,
    nanos: AtomicU64,
    unix_millis: AtomicU64,
}

/// An exemplar as read at scrape time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ExemplarValue {
    pub(super) trace_id: [u8; 16],
    pub(super) seconds: f64,
    pub(super) unix_millis: u64,
}

impl Exemplar {
    fn write(&self, trace_id: [u8; 16], elapsed: Duration, at: SystemTime) {
        let unix_millis = at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        let sequence = self.sequence.load(Ordering::Relaxed);
        if (sequence != 0 && self.unix_millis.load(Ordering::Relaxed) == unix_millis)
            || sequence & 1 == 1
            || self
                .sequence
                .compare_exchange(sequence, sequence + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        fence(Ordering::Release);
        let (high, low) = trace_id.split_at(8);
        let word = |half: &[u8]| u64::from_be_bytes(half.try_into().unwrap_or_default());
        self.trace_high.store(word(high), Ordering::Relaxed);
        self.trace_low.store(word(low), Ordering::Relaxed);
        self.nanos
            .store(elapsed.as_nanos() as u64, Ordering::Relaxed);
        self.unix_millis.store(unix_millis, Ordering::Relaxed);
        self.sequence.store(sequence + 2, Ordering::Release);
    }

    fn read(&self) -> Option<ExemplarValue> {
        let before = self.sequence.load(Ordering::Acquire);
        if before == 0 || before & 1 == 1 {
            return None;
        }
        let high = self.trace_high.load(Ordering::Relaxed);
        let low = self.trace_low.load(Ordering::Relaxed);
        let nanos = self.nanos.load(Ordering::Relaxed);
        let unix_millis = self.unix_millis.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if self.sequence.load(Ordering::Relaxed) != before {
            return None;
        }
        let mut trace_id = [0u8; 16];
        trace_id[..8].copy_from_slice(&high.to_be_bytes());
        trace_id[8..].copy_from_slice(&low.to_be_bytes());
        Some(ExemplarValue {
            trace_id,
            seconds: nanos as f64 / 1e9,
            unix_millis,
        })
    }
}

/// Sum, count and per-bucket (not cumulative) counts, `+Inf` last.
pub(super) struct Totals {
    pub(super) sum_seconds: f64,
    pub(super) count: u64,
    pub(super) buckets: Vec<(f64, u64)>,
}

impl Histogram {
    pub(super) fn record(&self, elapsed: Duration) {
        self.record_traced(elapsed, None);
    }

    /// Records `elapsed`; with a trace id and the time the observation
    /// ended, as its bucket's exemplar too.
    pub(super) fn record_traced(
        &self,
        elapsed: Duration,
        exemplar: Option<([u8; 16], SystemTime)>,
    ) {
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BOUNDS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(LATENCY_BOUNDS.len());
        if bucket < LATENCY_BOUNDS.len() {
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        if let Some((trace_id, at)) = exemplar {
            self.exemplars[bucket].write(trace_id, elapsed, at);
        }
    }

    /// The sum of `histograms`, for `prometheus-client`'s encoder.
    pub(super) fn totals<'h>(histograms: impl Iterator<Item = &'h Histogram> + Clone) -> Totals {
        let load = |counter: fn(&Histogram) -> &AtomicU64| -> u64 {
            histograms
                .clone()
                .map(|histogram| counter(histogram).load(Ordering::Relaxed))
                .sum()
        };
        let count = load(|histogram| &histogram.count);
        let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .enumerate()
            .map(|(bucket, bound)| {
                let n = histograms
                    .clone()
                    .map(|histogram| histogram.buckets[bucket].load(Ordering::Relaxed))
                    .sum();
                (*bound, n)
            })
            .collect();
        let bounded: u64 = buckets.iter().map(|(_, n)| n).sum();
        buckets.push((f64::INFINITY, count.saturating_sub(bounded)));
        Totals {
            sum_seconds: load(|histogram| &histogram.sum_nanos) as f64 / 1e9,
            count,
            buckets,
        }
    }

    /// Renders the sum of `histograms` as one OpenMetrics histogram family
    /// with, on each bucket, the most recent exemplar of any of them.
    pub(super) fn render_with_exemplars<'h>(
        histograms: impl Iterator<Item = &'h Histogram> + Clone,
        out: &mut String,
        name: &str,
        help: &str,
    ) {
        let totals = Histogram::totals(histograms.clone());
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bucket, (bound, n)) in totals.buckets.iter().enumerate() {
            cumulative += n;
            let le = if bound.is_infinite() {
                "+Inf".to_owned()
            } else {
                bound.to_string()
            };
            let _ = write!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
            let latest = histograms
                .clone()
                .filter_map(|histogram| histogram.exemplars[bucket].read())
                .max_by_key(|exemplar| exemplar.unix_millis);
            if let Some(exemplar) = latest {
                let _ = write!(
                    out,
                    " # {{trace_id=\"{}\"}} {} {}.{:03}",
                    crate::telemetry::hex(&exemplar.trace_id),
                    exemplar.seconds,
                    exemplar.unix_millis / 1000,
                    exemplar.unix_millis % 1000
                );
            }
            out.push('\n');
        }
        let _ = writeln!(out, "{name}_sum {}", totals.sum_seconds);
        let _ = writeln!(out, "{name}_count {}", totals.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exemplar_is_written_at_most_once_a_millisecond_and_stamped_with_its_end() {
        let histogram = Histogram::default();
        let took = Duration::from_micros(30);
        let bucket = LATENCY_BOUNDS.iter().position(|b| 30e-6 <= *b).unwrap();
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let read = || histogram.exemplars[bucket].read().unwrap();
        histogram.record_traced(took, Some(([1; 16], at)));
        assert_eq!(read().trace_id, [1; 16]);
        assert_eq!(read().unix_millis, 1_700_000_000_123);
        // The same millisecond: the first one stays.
        histogram.record_traced(took, Some(([2; 16], at + Duration::from_micros(500))));
        assert_eq!(read().trace_id, [1; 16]);
        // The next: replaced.
        histogram.record_traced(took, Some(([3; 16], at + Duration::from_millis(1))));
        assert_eq!(read().trace_id, [3; 16]);
        assert_eq!(read().unix_millis, 1_700_000_000_124);
        // Untraced observations count and leave the exemplar be.
        histogram.record(took);
        assert_eq!(read().trace_id, [3; 16]);
        assert_eq!(histogram.count.load(Ordering::Relaxed), 4);
    }
}
