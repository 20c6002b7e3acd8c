//! Fuzz target `trace_context`: see `retryd_fuzz::checks::trace_context` for the input format
//! and the invariants it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| retryd_fuzz::checks::trace_context(data));
