//! A decision's line written straight from its record: the keys as fixed
//! bytes, the strings escaped with a fast path for the common case (nothing
//! to escape), the numbers through serde_json's own formatters (itoa and
//! zmij behind `serde_json::to_writer`, so that a number reads exactly as
//! serde writes it). Serializing the record through serde's derive cost the
//! writer thread ~8.8k instructions a line (callgrind, issue 34), most of it
//! the generic `Serializer` walking every key and value through `io::Write`.
//!
//! The line must stay byte for byte what serde writes for the same
//! [`DecisionLine`](super::DecisionLine): `retryd replay` and operators'
//! tools read it. The tests below compare the two on many records.

use super::{DECISION_ID, OPERATION, PRINCIPAL, UPSTREAM, VERSION};
use super::{DecisionRecord, GRPC_PUSHBACK, HedgeLine, LINEAGE, RETRIED_BELOW, RETRY_AFTER};

/// serde_json's escape table: 0 for a byte written as is, else the letter
/// after the backslash (`u` for `\u00XX`).
static ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = b'u';
        byte += 1;
    }
    table[0x08] = b'b';
    table[0x09] = b't';
    table[0x0a] = b'n';
    table[0x0c] = b'f';
    table[0x0d] = b'r';
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table
};

/// Appends `text` as a JSON string, quotes included, escaped as serde_json
/// escapes it.
#[inline]
pub(super) fn string(text: &str, out: &mut Vec<u8>) {
    let bytes = text.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    if bytes.iter().all(|&byte| ESCAPE[byte as usize] == 0) {
        out.extend_from_slice(bytes);
    } else {
        escaped(bytes, out);
    }
    out.push(b'"');
}

/// The slow path: some byte needs escaping.
#[cold]
fn escaped(bytes: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut run = 0;
    for (at, &byte) in bytes.iter().enumerate() {
        let escape = ESCAPE[byte as usize];
        if escape == 0 {
            continue;
        }
        out.extend_from_slice(&bytes[run..at]);
        run = at + 1;
        if escape == b'u' {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(byte >> 4) as usize],
                HEX[(byte & 0xf) as usize],
            ]);
        } else {
            out.extend_from_slice(&[b'\\', escape]);
        }
    }
    out.extend_from_slice(&bytes[run..]);
}

/// Appends a number (or `null`, for a float that is not finite) as serde
/// writes it.
#[inline]
fn number<T: serde::Serialize>(value: T, out: &mut Vec<u8>) {
    // Into a Vec, serialization of a number cannot fail.
    let _ = serde_json::to_writer(&mut *out, &value);
}

#[inline]
fn boolean(value: bool, out: &mut Vec<u8>) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

/// Appends `key` (its comma, quotes and colon included: `,"key":`) and a
/// value, when present.
macro_rules! optional {
    ($out:ident, $key:literal, $value:expr, $write:ident) => {
        if let Some(value) = $value {
            $out.extend_from_slice(concat!(",\"", $key, "\":").as_bytes());
            $write(value, $out);
        }
    };
}

macro_rules! field {
    ($out:ident, $key:literal, $value:expr, $write:ident) => {
        $out.extend_from_slice(concat!(",\"", $key, "\":").as_bytes());
        $write($value, $out);
    };
}

impl DecisionRecord {
    /// Appends the record's line (no newline), the fields in the order and
    /// under the rules of [`DecisionLine`](super::DecisionLine)'s serde
    /// derive: absent options left out.
    pub(super) fn write_json(&self, out: &mut Vec<u8>) {
        let text = |index| self.text(index);
        let required = |index| self.text(index).unwrap_or_default();
        out.extend_from_slice(b"{\"kind\":\"decision\",\"v\":");
        number(VERSION, out);
        field!(out, "clock_ns", self.clock_ns, number);
        field!(out, "unix_ms", self.unix_ms, number);
        field!(out, "decision_id", required(DECISION_ID), string);
        field!(out, "principal", required(PRINCIPAL), string);
        field!(out, "upstream", required(UPSTREAM), string);
        field!(out, "operation", required(OPERATION), string);
        field!(out, "idempotency", self.idempotency, string);
        field!(out, "replayability", self.replayability, string);
        field!(out, "attempt", self.attempt, number);
        optional!(out, "evidence", self.evidence, string);
        optional!(out, "failure", self.failure, string);
        optional!(out, "http_status", self.http_status, number);
        optional!(out, "retry_after", text(RETRY_AFTER), string);
        optional!(out, "grpc_status", self.grpc_status, number);
        optional!(out, "grpc_pushback", text(GRPC_PUSHBACK), string);
        optional!(
            out,
            "deadline_remaining_ns",
            self.deadline_remaining_ns,
            number
        );
        field!(
            out,
            "first_byte_delivered",
            self.first_byte_delivered,
            boolean
        );
        field!(out, "runtime_draining", self.runtime_draining, boolean);
        field!(
            out,
            "auth_refresh_attempted",
            self.auth_refresh_attempted,
            boolean
        );
        optional!(out, "previous_backoff_ns", self.previous_backoff_ns, number);
        optional!(out, "max_attempts", self.max_attempts, number);
        optional!(out, "lineage", text(LINEAGE), string);
        optional!(out, "retried_below", text(RETRIED_BELOW), string);
        field!(out, "now_unix_ns", self.now_unix_ns, number);
        field!(out, "jitter", self.jitter, number);
        field!(out, "verdict", self.verdict, string);
        optional!(out, "deny_reason", self.deny_reason, string);
        field!(out, "rule", self.rule, number);
        optional!(out, "backoff_ns", self.backoff_ns, number);
        field!(out, "tokens_remaining", self.tokens_remaining, number);
        field!(out, "shadow", self.shadow, boolean);
        optional!(out, "unknown_outcome", self.unknown_outcome, string);
        optional!(out, "hedge", self.hedge.as_ref(), hedge);
        out.push(b'}');
    }
}

fn hedge(hedge: &HedgeLine, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"k\":");
    number(hedge.k, out);
    field!(out, "delay_ns", hedge.delay_ns, number);
    field!(out, "p50_ns", hedge.p50_ns, number);
    field!(out, "tail_ns", hedge.tail_ns, number);
    field!(out, "samples", hedge.samples, number);
    field!(out, "first_attempts", hedge.first_attempts, number);
    field!(out, "hedges", hedge.hedges, number);
    field!(out, "recent_samples", hedge.recent_samples, number);
    field!(out, "recent_p50_ns", hedge.recent_p50_ns, number);
    field!(out, "recent_tail_ns", hedge.recent_tail_ns, number);
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::texts::Texts;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        let mut every_char: String = (0u32..0x300).filter_map(char::from_u32).collect();
        every_char.push_str("\u{2028}\u{2029}\u{fffd}😀\u{7f}");
        for text in [
            "",
            "plain",
            "\"",
            "\\",
            "a\"b\\c\nd\re\tf\u{8}\u{c}\u{0}\u{1f}",
            every_char.as_str(),
        ] {
            let mut ours = Vec::new();
            string(text, &mut ours);
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                serde_json::to_string(text).unwrap(),
                "{text:?}"
            );
        }
    }

    /// A random record: every option present or not, strings with
    /// characters to escape, numbers at their edges.
    fn random(rng: &mut SmallRng) -> DecisionRecord {
        const WORDS: [&str; 8] = [
            "",
            "payments",
            "checkout \"svc\"",
            "a\\b",
            "line\nbreak\u{1}",
            "é ü 😀",
            "edge:2/middle:1",
            "0123456789abcdef0123456789abcdef",
        ];
        const NAMES: [&str; 4] = ["idempotent", "not_sent", "connect", "reconcile"];
        let mut word = || WORDS[rng.random_range(0..WORDS.len())];
        let parts = [
            Some(word()),
            Some(word()),
            Some(word()),
            Some(word()),
            Some(word()),
            Some(word()),
            Some(word()),
            Some(word()),
        ];
        let parts = parts.map(|part| part.filter(|_| rng.random_bool(0.6)));
        let mut some = |p: f64| rng.random_bool(p);
        let (a, b, c, d, e, f, g, h, i, j, k, l) = (
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
            some(0.5),
        );
        let floats = [
            0.0,
            -0.0,
            0.375,
            1e-300,
            -1.5e300,
            9.5,
            f64::MAX,
            f64::MIN_POSITIVE,
            f64::NAN,
            f64::INFINITY,
            1.0 / 3.0,
            1e21,
            123456789.0,
        ];
        let float = |rng: &mut SmallRng| floats[rng.random_range(0..floats.len())];
        let int = |rng: &mut SmallRng| match rng.random_range(0..4) {
            0 => 0,
            1 => u64::MAX,
            2 => rng.random_range(0..1000),
            _ => rng.random(),
        };
        DecisionRecord {
            texts: Texts::pack(parts),
            clock_ns: int(rng),
            unix_ms: int(rng),
            idempotency: NAMES[0],
            replayability: "one_shot",
            attempt: rng.random(),
            evidence: a.then_some(NAMES[1]),
            failure: b.then_some(NAMES[2]),
            http_status: c.then(|| rng.random()),
            grpc_status: d.then(|| rng.random()),
            deadline_remaining_ns: e.then(|| int(rng)),
            first_byte_delivered: f,
            runtime_draining: g,
            auth_refresh_attempted: h,
            previous_backoff_ns: i.then(|| int(rng)),
            max_attempts: j.then(|| rng.random()),
            now_unix_ns: int(rng),
            jitter: float(rng),
            verdict: "retry",
            deny_reason: k.then_some("budget_exhausted"),
            rule: rng.random(),
            backoff_ns: l.then(|| int(rng)),
            tokens_remaining: float(rng),
            shadow: rng.random(),
            unknown_outcome: rng.random_bool(0.5).then_some(NAMES[3]),
            hedge: rng.random_bool(0.5).then(|| HedgeLine {
                k: rng.random(),
                delay_ns: int(rng),
                p50_ns: int(rng),
                tail_ns: int(rng),
                samples: int(rng),
                first_attempts: int(rng),
                hedges: int(rng),
                recent_samples: int(rng),
                recent_p50_ns: int(rng),
                recent_tail_ns: int(rng),
            }),
        }
    }

    #[test]
    fn a_line_is_byte_for_byte_what_serde_writes() {
        let mut rng = SmallRng::seed_from_u64(34);
        let mut ours = Vec::new();
        for _ in 0..5_000 {
            let record = random(&mut rng);
            ours.clear();
            record.write_json(&mut ours);
            let serde = serde_json::to_string(&record.view()).unwrap();
            assert_eq!(std::str::from_utf8(&ours).unwrap(), serde);
            // And the owned line, the format's own type, agrees
            // (a NaN reads back as null, so only where every float is
            // finite).
            if record.jitter.is_finite() && record.tokens_remaining.is_finite() {
                let line = super::super::Line::Decision(Box::new(record.line()));
                assert_eq!(serde_json::to_string(&line).unwrap(), serde);
            }
        }
    }
}
