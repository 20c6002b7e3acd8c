//! The one place where errors become `tonic::Status`, so that handlers can
//! use `?` (or, for the budget store's errors, `.map_err(store_status)?`)
//! and every error kind maps the same way everywhere.

use tonic::Status;

use super::validate::InvalidRequest;
use crate::auth::Denied;
use crate::budget::StoreError;
use crate::config::InvalidConfig;

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

/// A store error as a status. A function, not `From`: both types are other
/// crates' (handlers write `.map_err(store_status)?`).
pub(super) fn store_status(error: StoreError) -> Status {
    {
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
}
