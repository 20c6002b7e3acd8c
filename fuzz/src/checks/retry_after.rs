//! Fuzz target `retry_after`: the engine's Retry-After parser, and
//! HTTP-dates read back.

use std::time::{Duration, UNIX_EPOCH};

use retryd_engine as engine;

use super::now;

/// Seconds since the epoch of the first instant httpdate cannot format
/// (year 10000).
pub const HTTP_DATE_END: u64 = 253_402_300_800;

/// Fuzz target `retry_after`: the whole input as a header value, and its
/// first 8 bytes as an instant to format as an HTTP-date and read back.
pub fn retry_after(data: &[u8]) {
    check_retry_after(&String::from_utf8_lossy(data));
    if let Some(head) = data.first_chunk::<8>() {
        check_http_date_round_trip(u64::from_le_bytes(*head) % HTTP_DATE_END);
    }
}

/// Parsing a Retry-After value never panics; delay-seconds always parse
/// (saturating); surrounding whitespace changes nothing.
pub fn check_retry_after(raw: &str) {
    let parsed = engine::parse_retry_after(raw, now());
    let value = raw.trim();
    if value.is_empty() {
        assert_eq!(parsed, None, "{raw:?}");
    } else if value.bytes().all(|byte| byte.is_ascii_digit()) {
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        assert_eq!(parsed, Some(Duration::from_secs(seconds)), "{raw:?}");
    }
    let padded = format!(" \t{raw}\t ");
    assert_eq!(engine::parse_retry_after(&padded, now()), parsed, "{raw:?}");
}

/// An instant `seconds` after the epoch, formatted as an IMF-fixdate, reads
/// back as the delay from now to it (zero once it is past).
pub fn check_http_date_round_trip(seconds: u64) {
    let at = UNIX_EPOCH + Duration::from_secs(seconds);
    let text = httpdate::fmt_http_date(at);
    let expected = at.duration_since(now()).unwrap_or(Duration::ZERO);
    assert_eq!(
        engine::parse_retry_after(&text, now()),
        Some(expected),
        "{text:?}"
    );
}
