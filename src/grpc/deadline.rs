//! The caller's gRPC deadline: a decision nobody waits for must not spend.
//!
//! A caller that gives up (its `grpc-timeout` passed) falls back to its own
//! rule; if retryd then withdrew a token for it, the budget would shrink
//! for a retry that never happened. That was measured with retryd frozen
//! (SIGSTOP): the calls timed out at the client, and once resumed retryd
//! answered them all and spent the tokens. Two checks close it, both before
//! the store call:
//!
//! - the deadline, counted from when the kernel received the call (see
//!   `transport/received.rs`; from the handler's start where that is
//!   unknown), taken when the call was dispatched, so that bytes read after
//!   it (its own reset, other calls) cannot make it look younger: past it,
//!   the call is answered DEADLINE_EXCEEDED and nothing is spent;
//! - a caller that cancelled (gRPC clients reset the stream when their
//!   deadline passes): the call waits until its connection's reader has
//!   found nothing more to read after the read that dispatched it (so HTTP/2
//!   has processed every frame that came with or after it, a reset
//!   included), then yields once, and hyper, which polls a stream's reset
//!   only while its handler is pending, drops the handler there. One yield
//!   alone was a race: on a busy machine the handler ran again before the
//!   connection's task had processed the reset that was already read (7 of
//!   8 frozen-server runs under `stress-ng --cpu 2` spent a token).
//!
//! Only a call that carries `grpc-timeout` pays for the yield: about 4,800
//! instructions, 8% of a unary call (callgrind). Yielding only for calls
//! that had waited in the socket was tried and is wrong: the reset of the
//! last call a caller gave up on arrives in the same read as that call,
//! so the read's receive stamp (the latest segment's) shows no wait, and
//! the Python client's frozen-retryd test spent a token.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tonic::metadata::MetadataMap;

use crate::telemetry::Metrics;
use crate::telemetry::metrics::Expiry;
use crate::transport::{Arrival, ReceivedAt};

/// When the caller's `grpc-timeout` runs out, counted from `received`
/// (when the kernel received the call, if known) or else from now; `None`
/// without a valid header (an invalid one is ignored, as tonic's own
/// timeout layer does).
pub(super) fn caller_deadline(
    metadata: &MetadataMap,
    received: Option<SystemTime>,
) -> Option<Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let timeout = parse_timeout(value)?;
    let now = Instant::now();
    // How long the call waited before this handler saw it. A stamp in the
    // future (the wall clock stepped back) counts as no wait.
    let waited = received
        .and_then(|received| SystemTime::now().duration_since(received).ok())
        .unwrap_or_default();
    now.checked_add(timeout.saturating_sub(waited))
}

/// `grpc-timeout` as the gRPC over HTTP/2 spec writes it: at most eight
/// ASCII digits, then a unit (H, M, S, m, u, n).
fn parse_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Counts a call dropped before its decision (the caller cancelled) unless
/// disarmed: dropping the handler is the only sign of it.
pub(super) struct CancelWatch {
    metrics: Option<Arc<Metrics>>,
}

impl CancelWatch {
    pub(super) fn new(metrics: &Arc<Metrics>) -> CancelWatch {
        CancelWatch {
            metrics: Some(Arc::clone(metrics)),
        }
    }

    /// The handler went on: nothing to count.
    pub(super) fn disarm(mut self) {
        self.metrics = None;
    }
}

impl Drop for CancelWatch {
    fn drop(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.record_expiry(Expiry::Cancelled);
        }
    }
}

/// Waits until the call's connection has processed what was read with and
/// after the call (`arrived`, if the call came through the acceptor), at
/// most until `deadline`, and yields once, so that a call its caller
/// already reset is dropped here; then checks the deadline: `Err` if it
/// passed, having counted it.
pub(super) async fn still_wanted(
    deadline: Instant,
    arrived: Option<(&ReceivedAt, Arrival)>,
    metrics: &Arc<Metrics>,
) -> Result<(), tonic::Status> {
    let watch = CancelWatch::new(metrics);
    if let Some((received, arrival)) = arrived {
        // Past the deadline the call is refused below anyway.
        let _ = tokio::time::timeout_at(
            tokio::time::Instant::from_std(deadline),
            received.drained_past(arrival.reads),
        )
        .await;
    }
    tokio::task::yield_now().await;
    watch.disarm();
    expired(deadline, metrics)
}

/// An answer needs time to travel back: one that would reach the caller
/// after its deadline is worth nothing to it, and must not spend. (With
/// retryd thawed right at a caller's deadline, its calls were otherwise
/// decided in the last millisecond, their resets still in flight.)
const ANSWER_MARGIN: Duration = Duration::from_millis(5);

/// `Err(DEADLINE_EXCEEDED)` if `deadline` passed (or is closer than the
/// answer's way back), having counted it.
pub(super) fn expired(deadline: Instant, metrics: &Metrics) -> Result<(), tonic::Status> {
    if Instant::now() + ANSWER_MARGIN < deadline {
        return Ok(());
    }
    metrics.record_expiry(Expiry::Deadline);
    Err(super::status::deadline_exceeded(
        "grpc-timeout: the caller's deadline passed before retryd decided; nothing was spent",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_as_the_spec_writes_them() {
        assert_eq!(parse_timeout("300m"), Some(Duration::from_millis(300)));
        assert_eq!(parse_timeout("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_timeout("99999999u"),
            Some(Duration::from_micros(99_999_999))
        );
        assert_eq!(parse_timeout("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "m", "123456789m", "10x", "-1m", "1.5S", " 1S"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
    }
}
