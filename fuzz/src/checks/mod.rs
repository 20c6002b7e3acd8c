//! The invariants of everything retryd parses from untrusted input, each a
//! plain function of a byte string: a fuzz target in `fuzz/fuzz_targets/`
//! is one call, and `tests/fuzz_smoke.rs` calls the same functions on
//! seeded pseudo-random inputs and on the committed seeds, so that stable
//! `cargo test` checks what the fuzzers check.
//!
//! A function returns when the input is uninteresting (a protobuf that
//! does not decode) or every invariant holds, and panics, which libFuzzer
//! reports as a crash, when one does not. The test includes this folder by
//! path, so it may use only what both crates have: retryd, prost,
//! prost-types and httpdate. It must not depend on retryd's private code
//! either: the invariants are restated here, independently of the engine.
//!
//! One module per fuzz target (`decide`, `traffic_report`, `retry_after`,
//! `config`, `trace_context`), each that target's input format and oracle;
//! `common` reads structure off raw bytes and holds the checks two targets
//! share; `seeds` is the committed corpus. A `mod.rs` rather than
//! `checks.rs` beside a `checks/` folder: `tests/fuzz_smoke.rs` includes
//! this file with `#[path]`, and a file included so looks for its modules
//! beside itself, as a `mod.rs` does, so both crates find them here.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod common;
mod config;
mod decide;
mod retry_after;
mod seeds;
mod trace_context;
mod traffic_report;

pub use config::{check_config, config};
pub use decide::{Environment, check_decide, check_decision, decide};
pub use retry_after::{HTTP_DATE_END, check_http_date_round_trip, check_retry_after, retry_after};
pub use seeds::{Seed, seeds};
pub use trace_context::{check_trace_context, trace_context};
pub use traffic_report::{check_traffic_report, traffic_report};

/// The fuzz targets, one per parser of untrusted input.
pub const TARGETS: [&str; 5] = [
    "decide",
    "traffic_report",
    "retry_after",
    "config",
    "trace_context",
];

/// Runs target `target`'s checks on one input.
pub fn run(target: &str, data: &[u8]) {
    match target {
        "decide" => {
            decide(data);
        }
        "traffic_report" => traffic_report(data),
        "retry_after" => retry_after(data),
        "config" => config(data),
        "trace_context" => trace_context(data),
        other => panic!("no fuzz target is called {other:?}"),
    }
}

/// Wall-clock time as the engine sees it in every check: a fixed instant, so
/// that a crash reproduces whenever it is replayed.
pub fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}
