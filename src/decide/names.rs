//! The names a caller gives (upstreams, operations) and the one error of a
//! request field that cannot be used. The edge (`grpc/validate.rs`) checks
//! every request with these rules and `retryd replay` checks every logged
//! line with the same ones, so a log cannot make replay track what the live
//! service would have refused.

/// Longest upstream or operation name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// A request field that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidRequest {
    /// The field's path, e.g. `body.parts[1].kind`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

/// An [`InvalidRequest`] for `field`.
pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> InvalidRequest {
    InvalidRequest {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Validates a required upstream name.
pub fn upstream<'a>(field: &str, raw: &'a str) -> Result<&'a str, InvalidRequest> {
    if raw.is_empty() {
        return Err(invalid(field, "required"));
    }
    name(field, raw)
}

/// Names end up in logs, span attributes and metric labels: bounded, and
/// free of control characters that would forge log lines.
pub fn name<'a>(field: &str, raw: &'a str) -> Result<&'a str, InvalidRequest> {
    if raw.len() > MAX_NAME_BYTES {
        return Err(invalid(
            field,
            format!("longer than {MAX_NAME_BYTES} bytes"),
        ));
    }
    // The ASCII test is vectorised; only a name with other characters pays
    // for decoding them (ASCII's control characters are below 0x20 and 0x7f).
    let control = if raw.is_ascii() {
        raw.bytes().any(|byte| byte < 0x20 || byte == 0x7f)
    } else {
        raw.chars().any(char::is_control)
    };
    if control {
        return Err(invalid(field, "contains control characters"));
    }
    Ok(raw)
}
