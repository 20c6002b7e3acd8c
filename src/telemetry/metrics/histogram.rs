//! Latency histograms with fixed buckets, as atomics: recorded without a
//! lock, rendered in the Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histograms, in seconds.
const LATENCY_BOUNDS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub(super) struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub(super) fn record(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        if let Some(bucket) = LATENCY_BOUNDS.iter().position(|bound| seconds <= *bound) {
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(super) fn render(&self, out: &mut String, name: &str, labels: &str) {
        Histogram::render_sum(std::iter::once(self), out, name, labels);
    }

    /// Renders the sum of `histograms` as one.
    pub(super) fn render_sum<'h>(
        histograms: impl Iterator<Item = &'h Histogram> + Clone,
        out: &mut String,
        name: &str,
        labels: &str,
    ) {
        let load = |counter: fn(&Histogram) -> &AtomicU64| -> u64 {
            histograms
                .clone()
                .map(|histogram| counter(histogram).load(Ordering::Relaxed))
                .sum()
        };
        let separator = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bucket, bound) in LATENCY_BOUNDS.iter().enumerate() {
            cumulative += histograms
                .clone()
                .map(|histogram| histogram.buckets[bucket].load(Ordering::Relaxed))
                .sum::<u64>();
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{separator}le=\"{bound}\"}} {cumulative}"
            );
        }
        let count = load(|histogram| &histogram.count);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{separator}le=\"+Inf\"}} {count}"
        );
        let sum = load(|histogram| &histogram.sum_nanos) as f64 / 1e9;
        let braces = |labels: &str| {
            if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}
