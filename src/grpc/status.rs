//! The one place where errors become `tonic::Status`, so that handlers can
//! use `?` (or, for the budget store's errors, `.map_err(store_status)?`)
//! and every error kind maps the same way everywhere.

use tonic::Status;

use super::validate::InvalidRequest;
use crate::auth::Denied;
use crate::budget::StoreError;
use crate::config::InvalidConfig;
use crate::decide::Refused;

impl From<Denied> for Status {
    fn from(denied: Denied) -> Status {
        match denied {
            Denied::Unauthenticated(why) => Status::unauthenticated(why),
            Denied::PermissionDenied(why) => Status::permission_denied(why),
        }
    }
}

impl From<InvalidConfig> for Status {
    fn from(error: InvalidConfig) -> Status {
        // The running configuration is kept: the precondition (a valid file)
        // is what failed.
        Status::failed_precondition(error.to_string())
    }
}

impl From<super::ReloadError> for Status {
    fn from(error: super::ReloadError) -> Status {
        match error {
            super::ReloadError::Invalid(invalid) => invalid.into(),
            // Not UNAVAILABLE, which clients retry at once: the caller
            // should wait for the running reload.
            super::ReloadError::Busy => Status::resource_exhausted(error.to_string()),
        }
    }
}

impl From<InvalidRequest> for Status {
    fn from(error: InvalidRequest) -> Status {
        // The message starts with the field, so callers and tests can tell
        // which field to fix without parsing prose.
        Status::invalid_argument(error.to_string())
    }
}

impl From<Refused> for Status {
    fn from(refused: Refused) -> Status {
        match refused {
            Refused::Denied(denied) => denied.into(),
            Refused::ShareFull(full) => Status::resource_exhausted(full.to_string()),
            Refused::Store(error) => store_status(error),
            Refused::Invalid(invalid) => invalid.into(),
            // Not UNAVAILABLE: the caller must not re-send at once, but once
            // the other call is done.
            Refused::ReportInProgress => Status::aborted(refused.to_string()),
            Refused::Report {
                refused,
                failed,
                entries,
            } => report_failed(Status::from(*refused), failed, entries),
        }
    }
}

/// A store error as a status. A function, not `From`: both types are other
/// crates' (handlers write `.map_err(store_status)?`).
pub(super) fn store_status(error: StoreError) -> Status {
    match error {
        StoreError::TooManyUpstreams { .. } => {
            Status::resource_exhausted(format!("upstream: {error}"))
        }
        StoreError::Unavailable(ref source) => {
            tracing::warn!(error = %source, "budget store unavailable");
            Status::unavailable(error.to_string())
        }
    }
}

/// The status of a traffic report the store failed, saying what was
/// applied: nothing if it failed before the deposits (`failed` is `None`),
/// else the entries before `failed`, maybe `failed` itself (a deposit that
/// timed out may have landed), and none after it. The wording is the
/// contract's (see ReportTraffic in the proto).
fn report_failed(status: Status, failed: Option<usize>, entries: usize) -> Status {
    let message = match failed {
        None => format!("{}; no traffic entry was applied", status.message()),
        Some(index) => format!(
            "traffic[{index}]: {}; entries 0..{index} were applied, entry {index} may or may not have been, entries {}..{entries} were not",
            status.message(),
            index + 1
        ),
    };
    Status::new(status.code(), message)
}

/// A decision stream's deadline passed: the items after it are answered
/// with this, in place.
pub(super) fn deadline_exceeded(message: &'static str) -> Status {
    Status::deadline_exceeded(message)
}

/// An `authorization` header that is not text.
pub(super) fn unreadable_authorization() -> Status {
    Status::unauthenticated("authorization: not valid ASCII")
}

/// A store that promised to answer at once (`BudgetStore::ANSWERS_AT_ONCE`)
/// and did not: nothing was spent that retryd knows of.
pub(super) fn not_answered_at_once() -> Status {
    Status::unavailable("the budget store did not answer at once")
}
