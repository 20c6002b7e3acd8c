//! What more than one target needs: [`Input`], which reads structure off
//! raw bytes, a caller's [`name`], and the checks of validation's refusals
//! and of names that two targets (`decide`, `traffic_report`) share.

use retryd::grpc::validate::{self, InvalidRequest};

/// Reads choices off the front of a fuzz input. Past its end every read is
/// zero, so any byte string maps to some value and the fuzzer's mutations
/// map to nearby values.
pub(super) struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    pub(super) fn byte(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&first, rest)) => {
                self.bytes = rest;
                first
            }
            None => 0,
        }
    }

    pub(super) fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    pub(super) fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    pub(super) fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n
    }

    pub(super) fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    /// Up to `max_len` bytes of the input as text, invalid UTF-8 replaced.
    pub(super) fn text(&mut self, max_len: usize) -> String {
        let len = (usize::from(self.u16()) % (max_len + 1)).min(self.bytes.len());
        let (head, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        String::from_utf8_lossy(head).into_owned()
    }

    pub(super) fn rest(self) -> &'a [u8] {
        self.bytes
    }
}

/// A name as a caller might send it: valid, at or past the length limit,
/// with a control character, or raw bytes from the input.
pub(super) fn name(input: &mut Input<'_>) -> String {
    match input.byte() % 16 {
        0 => String::new(),
        1 => "a".repeat(validate::MAX_NAME_BYTES),
        2 => "a".repeat(validate::MAX_NAME_BYTES + 1),
        3 => "bad\nname".into(),
        4 => "é".repeat(validate::MAX_NAME_BYTES / 2),
        5..=7 => input.text(300),
        _ => "payments-api".into(),
    }
}

/// An error names a field of the request (its path starts with one of
/// `fields`) and says what is wrong with it.
pub(super) fn check_invalid_request(invalid: &InvalidRequest, fields: &[&str]) {
    let top = invalid.field.split(['.', '[']).next().unwrap_or_default();
    assert!(
        fields.contains(&top),
        "the error names no field of the request: {invalid:?}"
    );
    assert!(!invalid.reason.is_empty(), "{invalid:?}");
    assert!(
        invalid.to_string().starts_with(&invalid.field),
        "the message does not start with the field: {invalid}"
    );
}

pub(super) fn check_name(what: &str, name: &str) {
    assert!(
        name.len() <= validate::MAX_NAME_BYTES,
        "{what} of {} bytes passed",
        name.len()
    );
    assert!(
        !name.chars().any(char::is_control),
        "{what} {name:?} with a control character passed"
    );
}
