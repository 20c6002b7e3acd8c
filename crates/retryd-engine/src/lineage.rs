//! Where a call sits in a call chain (`docs/lineage.md`): the
//! `retryd.lineage` baggage member of the request the call is made while
//! serving, and the layer below that already retried a failure. Parsed
//! here, beside the rule that reads them, so that the server and the Rust
//! client refuse the same values.

use std::fmt;

use crate::Evidence;

/// Most entries in a lineage.
pub const MAX_LINEAGE_ENTRIES: usize = 32;
/// Longest lineage, in bytes.
pub const MAX_LINEAGE_BYTES: usize = 1024;
/// Longest layer name, in bytes.
pub const MAX_LAYER_BYTES: usize = 64;
/// Highest attempt number an entry may carry.
pub const MAX_LINEAGE_ATTEMPT: u32 = 1000;

/// The enclosing calls of a call, as `layer:attempt` entries, outermost
/// first (`edge:2/middle:1`). Only what the rule needs is kept: the depth,
/// and the innermost enclosing call that is itself a retry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lineage<'a> {
    raw: &'a str,
    entries: u8,
    retrying: Option<(&'a str, u32)>,
}

impl<'a> Lineage<'a> {
    /// No enclosing call: the edge.
    pub const EDGE: Lineage<'static> = Lineage {
        raw: "",
        entries: 0,
        retrying: None,
    };

    /// Parses a lineage; the empty string is [`Lineage::EDGE`].
    pub fn parse(raw: &'a str) -> Result<Lineage<'a>, LineageError> {
        if raw.is_empty() {
            return Ok(Lineage::EDGE);
        }
        if raw.len() > MAX_LINEAGE_BYTES {
            return Err(LineageError::TooLong);
        }
        let mut entries = 0;
        let mut retrying = None;
        for entry in raw.split('/') {
            entries += 1;
            if entries > MAX_LINEAGE_ENTRIES {
                return Err(LineageError::TooManyEntries);
            }
            let (layer, attempt) = entry.rsplit_once(':').ok_or(LineageError::Entry(entries))?;
            layer_name(layer).map_err(|_| LineageError::Entry(entries))?;
            let attempt = attempt_number(attempt).ok_or(LineageError::Entry(entries))?;
            if attempt > 1 {
                retrying = Some((layer, attempt));
            }
        }
        Ok(Lineage {
            raw,
            entries: entries as u8,
            retrying,
        })
    }

    /// The lineage as it was sent.
    pub fn as_str(&self) -> &'a str {
        self.raw
    }

    /// The deciding layer's depth in the chain: 1 at the edge, one more
    /// per enclosing call.
    pub fn depth(&self) -> u32 {
        u32::from(self.entries) + 1
    }

    /// The innermost enclosing call that is a retry, as (layer, attempt):
    /// while it is set, a layer above is already retrying.
    pub fn enclosing_retry(&self) -> Option<(&'a str, u32)> {
        self.retrying
    }
}

/// A decimal 1 to [`MAX_LINEAGE_ATTEMPT`], without sign or leading zeros
/// (one spelling per number, so that logs and metrics agree).
fn attempt_number(raw: &str) -> Option<u32> {
    if raw.is_empty() || raw.len() > 4 || raw.starts_with('0') {
        return None;
    }
    if !raw.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    let number: u32 = raw.parse().ok()?;
    (number <= MAX_LINEAGE_ATTEMPT).then_some(number)
}

/// Checks a layer name: 1 to [`MAX_LAYER_BYTES`] bytes of
/// `[A-Za-z0-9._-]`. What `retried_below` and each lineage entry name.
pub fn layer_name(raw: &str) -> Result<&str, LineageError> {
    if raw.is_empty() || raw.len() > MAX_LAYER_BYTES {
        return Err(LineageError::LayerName);
    }
    if !raw
        .bytes()
        .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'))
    {
        return Err(LineageError::LayerName);
    }
    Ok(raw)
}

/// Reads `retried_below`, the layer a failed response said had already
/// retried it: empty is none. The mark travels on a response, so it needs
/// one: a claimed RESPONSE_RECEIVED or PARTIAL_RESPONSE, or (with no claim)
/// a status.
pub fn retried_below(
    raw: &str,
    claimed_evidence: Option<Evidence>,
    has_status: bool,
) -> Result<Option<&str>, LineageError> {
    if raw.is_empty() {
        return Ok(None);
    }
    let answered = match claimed_evidence {
        Some(Evidence::NotSent | Evidence::SentNoResponse) => false,
        Some(Evidence::ResponseReceived | Evidence::PartialResponse) => true,
        None => has_status,
    };
    if !answered {
        return Err(LineageError::NoResponse);
    }
    layer_name(raw).map(Some)
}

/// Why a lineage or a layer name was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineageError {
    /// Longer than [`MAX_LINEAGE_BYTES`].
    TooLong,
    /// More than [`MAX_LINEAGE_ENTRIES`] entries.
    TooManyEntries,
    /// The entry at this position (from 1) is not `layer:attempt`.
    Entry(usize),
    /// Not 1 to 64 bytes of `[A-Za-z0-9._-]`.
    LayerName,
    /// A `retried_below` reported without a response to carry it.
    NoResponse,
}

impl fmt::Display for LineageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineageError::TooLong => write!(f, "longer than {MAX_LINEAGE_BYTES} bytes"),
            LineageError::TooManyEntries => {
                write!(f, "more than {MAX_LINEAGE_ENTRIES} entries")
            }
            LineageError::Entry(position) => write!(
                f,
                "entry {position} is not layer:attempt (a layer name of 1 to \
                 {MAX_LAYER_BYTES} bytes of [A-Za-z0-9._-], an attempt from 1 to \
                 {MAX_LINEAGE_ATTEMPT}), entries separated by /"
            ),
            LineageError::NoResponse => f.write_str(
                "needs a response (evidence RESPONSE_RECEIVED or PARTIAL_RESPONSE, or a status): \
                 the mark is read from one",
            ),
            LineageError::LayerName => write!(
                f,
                "not a layer name: 1 to {MAX_LAYER_BYTES} bytes of [A-Za-z0-9._-]"
            ),
        }
    }
}

impl std::error::Error for LineageError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_lineage_is_the_edge() {
        let lineage = Lineage::parse("").unwrap();
        assert_eq!(lineage.depth(), 1);
        assert_eq!(lineage.enclosing_retry(), None);
    }

    #[test]
    fn the_innermost_retrying_entry_is_kept() {
        let lineage = Lineage::parse("edge:2/middle:3/inner:1").unwrap();
        assert_eq!(lineage.depth(), 4);
        assert_eq!(lineage.enclosing_retry(), Some(("middle", 3)));
        let first_attempts = Lineage::parse("edge:1/middle:1").unwrap();
        assert_eq!(first_attempts.enclosing_retry(), None);
        // The shortened form a client writes when it drops entries.
        let shortened = Lineage::parse("...:4/middle:1").unwrap();
        assert_eq!(shortened.enclosing_retry(), Some(("...", 4)));
    }

    #[test]
    fn malformed_entries_are_refused_by_position() {
        for (raw, error) in [
            ("edge", LineageError::Entry(1)),
            ("edge:1/", LineageError::Entry(2)),
            ("edge:0", LineageError::Entry(1)),
            ("edge:01", LineageError::Entry(1)),
            ("edge:+1", LineageError::Entry(1)),
            ("edge:1001", LineageError::Entry(1)),
            ("edge:1/mid dle:1", LineageError::Entry(2)),
            (":1", LineageError::Entry(1)),
            ("edge:1//x:1", LineageError::Entry(2)),
        ] {
            assert_eq!(Lineage::parse(raw), Err(error), "{raw:?}");
        }
        assert_eq!(Lineage::parse("edge:1000").unwrap().depth(), 2);
    }

    #[test]
    fn limits_are_enforced() {
        let entries = vec!["a:1"; MAX_LINEAGE_ENTRIES];
        assert!(Lineage::parse(&entries.join("/")).is_ok());
        let one_more = vec!["a:1"; MAX_LINEAGE_ENTRIES + 1];
        assert_eq!(
            Lineage::parse(&one_more.join("/")),
            Err(LineageError::TooManyEntries)
        );
        let long = format!("{}:1", "a".repeat(MAX_LINEAGE_BYTES));
        assert_eq!(Lineage::parse(&long), Err(LineageError::TooLong));
        assert!(layer_name(&"a".repeat(MAX_LAYER_BYTES)).is_ok());
        assert!(layer_name(&"a".repeat(MAX_LAYER_BYTES + 1)).is_err());
        assert!(layer_name("payments-api.v2_eu").is_ok());
        assert!(layer_name("é").is_err());
        assert!(layer_name("").is_err());
    }

    #[test]
    fn retried_below_needs_a_response() {
        assert_eq!(retried_below("", None, false), Ok(None));
        assert_eq!(retried_below("middle", None, true), Ok(Some("middle")));
        assert_eq!(
            retried_below("middle", Some(Evidence::PartialResponse), false),
            Ok(Some("middle"))
        );
        for evidence in [
            None,
            Some(Evidence::NotSent),
            Some(Evidence::SentNoResponse),
        ] {
            assert_eq!(
                retried_below("middle", evidence, evidence.is_some()),
                Err(LineageError::NoResponse),
                "{evidence:?}"
            );
        }
        assert_eq!(
            retried_below("mid/dle", None, true),
            Err(LineageError::LayerName)
        );
    }
}
