//! Latencies in the contract's log-linear buckets (`LatencyHistogram` in
//! `retryd.proto`) and quantiles read from them.
//!
//! Here rather than in the budget crate because every client buckets its
//! own latencies with the same function and the Rust client depends on the
//! engine only; a histogram is a plain value (no clock, no I/O). The
//! sliding window over time is the store's (`retryd_budget::hedging`).

use std::time::Duration;

/// The highest bucket index: one hour, and anything above it.
pub const MAX_BUCKET: u32 = 237;
/// Buckets in a histogram.
pub const BUCKETS: usize = MAX_BUCKET as usize + 1;
/// The longest latency told apart, in microseconds: one hour.
pub const MAX_MICROS: u64 = 3_600_000_000;

/// The bucket of a latency of `micros` microseconds: `micros` below 16,
/// else `8 * (e - 2) + (m - 8)` with `e = floor(log2(micros))` and `m` the
/// top 4 bits of `micros`. Above one hour counts as one hour.
pub fn bucket(micros: u64) -> u32 {
    let v = micros.min(MAX_MICROS);
    if v < 16 {
        return v as u32;
    }
    let e = 63 - v.leading_zeros();
    let m = (v >> (e - 3)) as u32;
    8 * (e - 2) + (m - 8)
}

/// The bucket of a duration (whole microseconds, rounded down).
pub fn bucket_of(latency: Duration) -> u32 {
    bucket(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX))
}

/// The first latency, in microseconds, of bucket `b` (at most
/// [`MAX_BUCKET`]).
pub fn bucket_start(b: u32) -> u64 {
    if b < 16 {
        u64::from(b)
    } else {
        u64::from(8 + b % 8) << (b / 8 - 1)
    }
}

/// The first latency past bucket `b`: the start of the next one.
pub fn bucket_end(b: u32) -> u64 {
    bucket_start(b + 1)
}

/// Counts of latencies per bucket. Dense (238 counters): merged over a
/// window's slots by plain addition, with no allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    counts: [u64; BUCKETS],
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: [0; BUCKETS],
            total: 0,
        }
    }
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one latency.
    pub fn record(&mut self, latency: Duration) {
        self.add(bucket_of(latency), 1);
    }

    /// Adds `count` latencies to bucket `b` (clamped to [`MAX_BUCKET`];
    /// the edge refuses higher indexes before they get here).
    pub fn add(&mut self, b: u32, count: u64) {
        let b = b.min(MAX_BUCKET) as usize;
        self.counts[b] = self.counts[b].saturating_add(count);
        self.total = self.total.saturating_add(count);
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine = mine.saturating_add(*theirs);
        }
        self.total = self.total.saturating_add(other.total);
    }

    /// Latencies counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The non-empty buckets and their counts, lowest first.
    pub fn buckets(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, count)| **count > 0)
            .map(|(b, count)| (b as u32, *count))
    }

    /// Forgets every count.
    pub fn clear(&mut self) {
        *self = Histogram::default();
    }

    /// The `q` quantile (0 < q < 1), or `None` when empty. The value of
    /// rank `ceil(q * total)` lies in a known bucket; within it the ranks
    /// are spread evenly, so the estimate is off by less than the bucket's
    /// width (exact below 16 µs, at most 12.5% above).
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.total == 0 {
            return None;
        }
        let q = q.clamp(0.0, 1.0);
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut below = 0u64;
        for (b, &count) in self.counts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            if below + count >= rank {
                let b = b as u32;
                let start = bucket_start(b) as f64;
                let width = (bucket_end(b) - bucket_start(b)) as f64;
                let micros = if width <= 1.0 {
                    start
                } else {
                    // Rank r of n in the bucket sits at the middle of its
                    // 1/n-wide share of the bucket.
                    start + width * ((rank - below) as f64 - 0.5) / count as f64
                };
                return Some(Duration::from_nanos((micros * 1000.0) as u64));
            }
            below += count;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_boundaries_of_the_contract() {
        for (micros, expected) in [
            (0, 0),
            (1, 1),
            (15, 15),
            (16, 16),
            (17, 16),
            (18, 17),
            (31, 23),
            (32, 24),
            (1_000, 63),
            (1_000_000, 143),
            (MAX_MICROS, 237),
            (MAX_MICROS + 1, 237),
            (u64::MAX, 237),
        ] {
            assert_eq!(bucket(micros), expected, "{micros} µs");
        }
    }

    /// `conformance/latency_buckets.json`, the pairs every client checks
    /// its own bucket function against, agrees with this one. Read line by
    /// line (one `[a, b]` pair a line) to keep serde out of the engine.
    #[test]
    fn the_conformance_pairs() {
        let text = include_str!("../../../conformance/latency_buckets.json");
        let (starts, pairs) = text.split_once("\"pairs\"").expect("a pairs list");
        let read = |section: &str| -> Vec<(u64, u64)> {
            section
                .lines()
                .filter_map(|line| {
                    let line = line.trim().trim_end_matches(',');
                    let inner = line.strip_prefix('[')?.strip_suffix(']')?;
                    let (a, b) = inner.split_once(',')?;
                    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
                })
                .collect()
        };
        let pairs = read(pairs);
        assert!(pairs.len() > 600, "{} pairs", pairs.len());
        for (micros, expected) in pairs {
            assert_eq!(u64::from(bucket(micros)), expected, "{micros} µs");
        }
        let starts = read(starts);
        assert_eq!(starts.len(), BUCKETS);
        for (b, start) in starts {
            assert_eq!(bucket_start(b as u32), start, "start of bucket {b}");
        }
    }

    #[test]
    fn every_bucket_starts_where_the_last_ended() {
        for b in 0..MAX_BUCKET {
            let start = bucket_start(b);
            assert_eq!(bucket(start), b, "start of {b}");
            assert_eq!(bucket(bucket_end(b) - 1), b, "end of {b}");
            assert!(bucket_end(b) > start);
            if b >= 16 {
                // At most 12.5% wide.
                assert!((bucket_end(b) - start) * 8 <= start, "width of {b}");
            }
        }
        assert_eq!(bucket(bucket_start(MAX_BUCKET)), MAX_BUCKET);
    }

    /// The exact quantile of sorted values, by the same rank.
    fn exact(sorted: &[u64], q: f64) -> u64 {
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    }

    /// The estimate is in the exact value's bucket: off by less than the
    /// bucket's width, 12.5% of the value at most.
    fn check(mut values: Vec<u64>, q: f64) -> Result<(), TestCaseError> {
        let mut histogram = Histogram::new();
        for &v in &values {
            histogram.record(Duration::from_micros(v));
        }
        values.sort_unstable();
        let truth = exact(&values, q).min(MAX_MICROS);
        let estimate = histogram.quantile(q).unwrap().as_nanos() as f64 / 1000.0;
        let error = (estimate - truth as f64).abs();
        let width = (bucket_end(bucket(truth)) - bucket_start(bucket(truth))) as f64;
        prop_assert!(
            error <= width && error <= 0.125 * truth as f64 + 1.0,
            "q {q}: exact {truth} µs, estimated {estimate} µs"
        );
        Ok(())
    }

    /// A uniform draw in [0, 1) from a seed (the test's own generator:
    /// proptest shrinks the seed).
    fn uniforms(seed: u64, n: usize) -> impl Iterator<Item = f64> {
        let mut state = seed | 1;
        (0..n).map(move |_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        })
    }

    proptest! {
        #[test]
        fn uniform_latencies(seed in any::<u64>(), low in 0u64..100_000, span in 1u64..1_000_000,
                             q in prop::sample::select(vec![0.5, 0.9, 0.95, 0.99, 0.999])) {
            let values = uniforms(seed, 2_000).map(|u| low + (u * span as f64) as u64).collect();
            check(values, q)?;
        }

        #[test]
        fn exponential_latencies(seed in any::<u64>(), mean in 100f64..1e6,
                                 q in prop::sample::select(vec![0.5, 0.9, 0.95, 0.99])) {
            let values = uniforms(seed, 2_000).map(|u| (-(1.0 - u).ln() * mean) as u64).collect();
            check(values, q)?;
        }

        #[test]
        fn a_two_percent_tail(seed in any::<u64>(), fast in 1_000u64..50_000,
                              q in prop::sample::select(vec![0.5, 0.95, 0.97, 0.98, 0.99, 0.999])) {
            // 98% around `fast`, 2% around one second.
            let values = uniforms(seed, 5_000).map(|u| {
                if u < 0.02 { 1_000_000 + (u * 5e6) as u64 } else { fast + (u * fast as f64 * 0.2) as u64 }
            }).collect();
            check(values, q)?;
        }

        #[test]
        fn merging_is_adding(a in prop::collection::vec(0u64..10_000_000, 0..200),
                             b in prop::collection::vec(0u64..10_000_000, 0..200)) {
            let mut left = Histogram::new();
            let mut right = Histogram::new();
            let mut both = Histogram::new();
            for &v in &a { left.record(Duration::from_micros(v)); both.record(Duration::from_micros(v)); }
            for &v in &b { right.record(Duration::from_micros(v)); both.record(Duration::from_micros(v)); }
            left.merge(&right);
            prop_assert_eq!(left, both);
        }
    }
}
