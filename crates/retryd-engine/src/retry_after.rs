//! The Retry-After header: delay-seconds or an HTTP-date (RFC 9110 §10.2.3).

use std::time::{Duration, SystemTime};

/// Parses a raw Retry-After value into a delay from `now`.
///
/// Returns `None` for a value that is neither form: the specification says
/// an unparseable Retry-After is ignored, not an error. A date in the past
/// means "now" (a zero delay).
pub fn parse_retry_after(raw: &str, now: SystemTime) -> Option<Duration> {
    let value = raw.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|byte| byte.is_ascii_digit()) {
        // An absurdly long digit string overflows u64; saturate rather
        // than ignore it, so it is then refused as too long to wait.
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
    }

    #[test]
    fn delay_seconds() {
        assert_eq!(
            parse_retry_after("120", at(0)),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", at(0)), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("99999999999999999999999", at(0)),
            Some(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn http_date() {
        // Sun, 06 Nov 1994 08:49:37 GMT is 784111777.
        let raw = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(
            parse_retry_after(raw, at(784_111_777 - 30)),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after(raw, at(784_111_777 + 30)),
            Some(Duration::ZERO)
        );
        // The obsolete RFC 850 and asctime forms are valid HTTP-dates too.
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", at(784_111_777 - 5)),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:37 1994", at(784_111_777 - 5)),
            Some(Duration::from_secs(5))
        );
    }

    #[test]
    fn garbage_is_ignored() {
        for raw in [
            "",
            "  ",
            "-5",
            "1.5",
            "soon",
            "12s",
            "Sun, 32 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(parse_retry_after(raw, at(0)), None, "{raw:?}");
        }
    }
}
