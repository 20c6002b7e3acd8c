//! Hedging's fields validated: a hedge Decide reports no failure, and a
//! report's latency histograms stay within the contract's buckets and a
//! bounded total. Like the rest of `validate`, nothing is spent before
//! this passes.

use crate::decide::names::{InvalidRequest, invalid};
use crate::engine::latency::{self, Histogram};
use crate::pb;

/// Most hedges of one call a request may ask about (a policy allows 4).
pub const MAX_HEDGE: u32 = 16;

/// A hedge (`hedge` >= 1) reports no failure: nothing has failed, the
/// first attempt is still running. Any failure field is refused by name, so
/// that a caller mixing the two never has a hedge decided as a retry.
pub(super) fn hedge_request(request: &pb::DecideRequest) -> Result<(), InvalidRequest> {
    if request.hedge > MAX_HEDGE {
        return Err(invalid(
            "hedge",
            format!(
                "at most {MAX_HEDGE} hedges of one call, not {}",
                request.hedge
            ),
        ));
    }
    for (field, set) in [
        ("evidence", request.evidence != 0),
        ("failure", request.failure != 0),
        ("http_status", request.http_status != 0),
        ("grpc_status_code", request.grpc_status_code != 0),
        (
            "grpc_retry_pushback_ms",
            request.grpc_retry_pushback_ms.is_some(),
        ),
        ("retry_after", !request.retry_after.is_empty()),
        ("retried_below", !request.retried_below.is_empty()),
    ] {
        if set {
            return Err(invalid(
                field,
                "must be empty with hedge >= 1: a hedge reports no failure",
            ));
        }
    }
    Ok(())
}

/// Most latencies one histogram of a traffic report entry may count (as
/// `requests`: more between two reports is a bug in the caller).
pub const MAX_REPORTED_LATENCIES: u64 = 1_000_000_000;

/// Validates a latency histogram: indexes at most 237, counts above 0, a
/// bounded total.
pub(super) fn latency_histogram(
    field: &str,
    raw: Option<&pb::LatencyHistogram>,
) -> Result<Option<Histogram>, InvalidRequest> {
    let Some(raw) = raw else { return Ok(None) };
    if raw.counts.len() > latency::BUCKETS {
        return Err(invalid(
            format!("{field}.counts"),
            format!("more than {} buckets", latency::BUCKETS),
        ));
    }
    let mut histogram = Histogram::new();
    let mut total = 0u64;
    for (&index, &count) in &raw.counts {
        if index > latency::MAX_BUCKET {
            return Err(invalid(
                format!("{field}.counts[{index}]"),
                format!("a bucket index is at most {}", latency::MAX_BUCKET),
            ));
        }
        if count == 0 {
            return Err(invalid(
                format!("{field}.counts[{index}]"),
                "a count of 0 (leave empty buckets out)",
            ));
        }
        total = total.saturating_add(count);
        if total > MAX_REPORTED_LATENCIES {
            return Err(invalid(
                format!("{field}.counts"),
                "more than 1e9 latencies in one report",
            ));
        }
        histogram.add(index, count);
    }
    Ok(Some(histogram))
}
