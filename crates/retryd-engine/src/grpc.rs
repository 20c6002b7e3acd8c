//! gRPC outcomes: the status codes of `google.rpc.Code` and the
//! `grpc-retry-pushback-ms` trailer of gRFC A6.
//!
//! A code is only a fact about the attempt; what it means for a retry is
//! rule 9's business (`status_rule` in lib.rs), so that gRPC and HTTP
//! outcomes go through one decision order.

use std::time::Duration;

use strum::VariantArray;

/// A gRPC status code other than OK, numbered as `google.rpc.Code` is (the
/// discriminant is the wire number). `GrpcCode::VARIANTS` lists them in
/// order, derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::VariantArray)]
#[repr(u8)]
pub enum GrpcCode {
    /// 1: the caller cancelled the call.
    Cancelled = 1,
    /// 2: an error the server or library could not classify.
    Unknown = 2,
    /// 3: the request is invalid whatever the server's state.
    InvalidArgument = 3,
    /// 4: the deadline expired before the call completed.
    DeadlineExceeded = 4,
    /// 5: the entity was not found.
    NotFound = 5,
    /// 6: the entity already exists.
    AlreadyExists = 6,
    /// 7: the caller may not do this.
    PermissionDenied = 7,
    /// 8: a quota or resource ran out (or the message was too large).
    ResourceExhausted = 8,
    /// 9: the system is not in the state the call needs.
    FailedPrecondition = 9,
    /// 10: aborted, typically by a concurrency conflict.
    Aborted = 10,
    /// 11: out of the valid range.
    OutOfRange = 11,
    /// 12: not implemented by the server.
    Unimplemented = 12,
    /// 13: an invariant broke inside the server or the library.
    Internal = 13,
    /// 14: the service is unavailable for now.
    Unavailable = 14,
    /// 15: unrecoverable data loss.
    DataLoss = 15,
    /// 16: the call has no valid credentials.
    Unauthenticated = 16,
}

impl GrpcCode {
    /// The code numbered `number` on the wire; `None` for 0 (OK, which is
    /// not a failure) and for anything above 16.
    pub fn from_number(number: u32) -> Option<GrpcCode> {
        let index = usize::try_from(number).ok()?.checked_sub(1)?;
        GrpcCode::VARIANTS.get(index).copied()
    }

    /// The wire number, 1 to 16.
    pub fn number(self) -> u32 {
        u32::from(self as u8)
    }

    /// The snake_case name used in configuration, logs and labels
    /// (`"unavailable"`, `"resource_exhausted"`).
    pub fn as_str(self) -> &'static str {
        match self {
            GrpcCode::Cancelled => "cancelled",
            GrpcCode::Unknown => "unknown",
            GrpcCode::InvalidArgument => "invalid_argument",
            GrpcCode::DeadlineExceeded => "deadline_exceeded",
            GrpcCode::NotFound => "not_found",
            GrpcCode::AlreadyExists => "already_exists",
            GrpcCode::PermissionDenied => "permission_denied",
            GrpcCode::ResourceExhausted => "resource_exhausted",
            GrpcCode::FailedPrecondition => "failed_precondition",
            GrpcCode::Aborted => "aborted",
            GrpcCode::OutOfRange => "out_of_range",
            GrpcCode::Unimplemented => "unimplemented",
            GrpcCode::Internal => "internal",
            GrpcCode::Unavailable => "unavailable",
            GrpcCode::DataLoss => "data_loss",
            GrpcCode::Unauthenticated => "unauthenticated",
        }
    }

    /// The code named `name` (as [`GrpcCode::as_str`] spells it).
    pub fn from_name(name: &str) -> Option<GrpcCode> {
        GrpcCode::VARIANTS
            .iter()
            .copied()
            .find(|code| code.as_str() == name)
    }
}

/// A set of gRPC codes: the ones an upstream treats as retryable, as gRFC
/// A6's `retryableStatusCodes` lists them. A bit per code, so the policy
/// stays cheap to copy and a lookup is one mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GrpcCodes(u32);

impl GrpcCodes {
    /// No code.
    pub const NONE: GrpcCodes = GrpcCodes(0);

    /// The default retryable codes: UNAVAILABLE, RESOURCE_EXHAUSTED (only
    /// with a pushback), DEADLINE_EXCEEDED and UNAUTHENTICATED (one refresh).
    /// INTERNAL and UNKNOWN are the upstream's to register, as HTTP 500 is.
    pub const DEFAULT: GrpcCodes = GrpcCodes::NONE
        .with(GrpcCode::Unavailable)
        .with(GrpcCode::ResourceExhausted)
        .with(GrpcCode::DeadlineExceeded)
        .with(GrpcCode::Unauthenticated);

    /// This set and `code`.
    pub const fn with(self, code: GrpcCode) -> GrpcCodes {
        GrpcCodes(self.0 | 1 << code as u8)
    }

    /// Whether `code` is in the set.
    pub fn contains(self, code: GrpcCode) -> bool {
        self.0 & 1 << code as u8 != 0
    }

    /// The codes in the set, in wire order.
    pub fn iter(self) -> impl Iterator<Item = GrpcCode> {
        GrpcCode::VARIANTS
            .iter()
            .copied()
            .filter(move |&code| self.contains(code))
    }
}

impl Default for GrpcCodes {
    fn default() -> Self {
        GrpcCodes::DEFAULT
    }
}

impl FromIterator<GrpcCode> for GrpcCodes {
    fn from_iter<I: IntoIterator<Item = GrpcCode>>(codes: I) -> Self {
        codes.into_iter().fold(GrpcCodes::NONE, GrpcCodes::with)
    }
}

/// What a `grpc-retry-pushback-ms` trailer asks for (gRFC A6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushback {
    /// Wait at least this long before the next attempt.
    Wait(Duration),
    /// A negative or unparseable value: the server asks not to retry.
    DoNotRetry,
}

/// Reads a raw `grpc-retry-pushback-ms` value. A6 defines only a decimal
/// integer of milliseconds; surrounding whitespace is forgiven (header
/// values are trimmed on the wire anyway), and a number too large for
/// `u64` is a very long wait, not garbage: it is denied later for
/// exceeding `max_retry_after`, which says more than "unparseable" would.
pub fn parse_pushback(raw: &str) -> Pushback {
    let digits = raw.trim_matches([' ', '\t']);
    if digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return Pushback::DoNotRetry;
    }
    let millis = digits.parse::<u64>().unwrap_or(u64::MAX);
    Pushback::Wait(Duration::from_millis(millis))
}
