//! The identity of this build, embedded by the package's `build.rs`: what
//! `retryd --version` prints, the `retryd_build_info` gauge carries and
//! spans export as `service.version`.
//!
//! Constants only: nothing here reads the environment at run time.

/// The package version (Cargo's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git revision built (12 hex digits), `RETRYD_GIT_REVISION` where the
/// source had no git directory, or `unknown`.
pub const REVISION: &str = env!("RETRYD_GIT_REVISION");

/// The Cargo profile built (`debug` or `release`).
pub const PROFILE: &str = env!("RETRYD_BUILD_PROFILE");

/// `retryd --version`: `0.1.0 (revision 1a2b3c4d5e6f, release)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (revision ",
    env!("RETRYD_GIT_REVISION"),
    ", ",
    env!("RETRYD_BUILD_PROFILE"),
    ")"
);

/// `service.version` on exported spans: the version with the revision as
/// semver build metadata (`0.1.0+1a2b3c4d5e6f`).
pub const SERVICE_VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), "+", env!("RETRYD_GIT_REVISION"));
